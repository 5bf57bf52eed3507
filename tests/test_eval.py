"""The evaluation harness: a CLI smoke run on a tiny model, resuming, attacks, metrics.

The smoke run is what CI runs: ``worldcup eval --smoke`` on a 2-layer random
model saved to a temporary directory (real tokenizer, real data), so the
whole pipeline -- generation, paraphrase, perplexity, every attack, the
report and the plots -- runs in well under a minute.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import worldcup_eval.runner as runner_module
from worldcup_cli.main import app
from worldcup_core.models import tiny_random_model
from worldcup_eval.attacks import (
    SynonymSubstitution,
    copy_paste,
    load_wordnet,
    paraphrase_prompt_ids,
    split_words,
    word_deletion,
    wordnet_dir,
)
from worldcup_eval.config import EvalConfig, build_config
from worldcup_eval.metrics import auc, best_f1, bit_accuracy, clopper_pearson, rate_above

cli = CliRunner()

PLOTS = [
    "roc_none.png",
    "roc_deletion.png",
    "roc_synonym.png",
    "roc_copy-paste.png",
    "roc_paraphrase.png",
    "bit_accuracy_vs_length.png",
    "ppl_distribution.png",
]


def _strip_timing(obj: Any) -> Any:
    """Everything but wall-clock measurements and the environment: must be deterministic."""
    if isinstance(obj, dict):
        return {k: _strip_timing(v) for k, v in obj.items() if k not in ("timing", "environment")}
    if isinstance(obj, list):
        return [_strip_timing(v) for v in obj]
    return obj


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    lm = tiny_random_model(smollm2_tokenizer)
    lm.model.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def smoke_args(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, data_dir: Path
) -> list[str]:
    out = tmp_path_factory.mktemp("eval-out")
    return [
        "eval",
        "--smoke",
        "--model",
        str(tiny_model_dir),
        "--data-dir",
        str(data_dir),
        "--out",
        str(out),
        "--scorer-model",  # the same tiny model stands in for a second PPL scorer
        str(tiny_model_dir),
        "--no-progress",
    ]


@pytest.fixture(scope="module")
def smoke(smoke_args: list[str]) -> tuple[Path, dict[str, Any]]:
    result = cli.invoke(app, smoke_args)
    assert result.exit_code == 0, result.output
    out = Path(smoke_args[smoke_args.index("--out") + 1])
    return out, json.loads((out / "results.json").read_text())


# --------------------------------------------------------------------------- smoke run


def test_smoke_run_writes_report_plots_and_sane_numbers(smoke: tuple[Path, dict[str, Any]]) -> None:
    out, results = smoke
    assert results["complete"] and not results["missing"]
    for name in ["results.json", "report.md", "per_text.jsonl", *PLOTS]:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    cfg = results["config"]
    assert cfg["smoke"] and cfg["prompts"] == 4
    cells = [c for c in results["main"] + results["ablation"] if c["bits"] is not None]
    assert {(c["scheme"], c["bits"], c["length"]) for c in results["main"] if c["bits"]} == {
        (s, b, n) for s in ("worldcup-k2", "mpac") for b in (8, 16) for n in (32, 64)
    }
    for c in cells + results["robustness"]:
        assert 0.0 <= c["auc"] <= 1.0 and 0.0 <= c["bit_accuracy"] <= 1.0
        assert 0.0 <= c["tpr"]["fpr_0.01"] <= 1.0 and 0.0 <= c["best_f1"] <= 1.0
        assert all(0.0 <= v <= 1.0 for v in c["extraction"].values())
    for c in cells:
        assert c["n"] == 4 and c["ppl"]["self_median"] > 1.0
        # same weights, re-tokenised text: the scorer agrees with self-PPL up to tokenisation
        assert c["ppl"]["scorer_median"] == pytest.approx(c["ppl"]["self_median"], rel=0.1)
        assert c["timing"]["decode_ms_mean"] > 0
        # the calibrated test on human text: no flood of false positives
        assert c["human_fpr"]["fpr_0.01"]["rate"] <= 0.05

    # A random model has high entropy everywhere: the watermark must come through.
    for c in results["main"]:
        if c["bits"] is not None and c["length"] == 64:
            assert c["bit_accuracy"] > 0.8, c
            assert c["auc"] > 0.9, c
    # Unwatermarked text scored with the same key: p-values are not tiny.
    per_text = [json.loads(line) for line in (out / "per_text.jsonl").read_text().splitlines()]
    null = [r["log10_p"] for r in per_text if r["text"] in ("unwatermarked", "human")]
    assert null and min(null) > -4.0

    attacks = {r["attack"] for r in results["robustness"]}
    assert attacks == {"none", "deletion", "synonym", "copy-paste", "paraphrase"}
    curve = results["curves"][0]
    assert curve["prefix_tokens"] == [16, 32, 48, 64]
    encoding = {(e["scheme"], e["bits"]) for e in results["timing"]["encoding"]}
    assert ("unwatermarked", None) in encoding

    report = (out / "report.md").read_text()
    assert "**Status: complete**" in report and "Table 1" in report
    assert "| Bits | Scheme | AUC @32 | Bit Acc @32 | PPL @32 | Time (ms) @32 |" in report
    assert "## Robustness" in report and "copy-paste" in report
    assert "second PPL scorer: not configured" not in report
    assert "| scorer PPL @32 |" in report
    for name in PLOTS:
        assert f"]({name})" in report


def test_rerun_reuses_the_cache_and_is_deterministic(
    smoke: tuple[Path, dict[str, Any]], smoke_args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, first = smoke
    real_generate = runner_module.generate
    calls: list[int] = []

    def counting_generate(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[1]))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(runner_module, "generate", counting_generate)

    # Everything cached: nothing is generated, the numbers are identical.
    result = cli.invoke(app, smoke_args)
    assert result.exit_code == 0, result.output
    assert calls == []
    again = json.loads((out / "results.json").read_text())
    assert _strip_timing(again) == _strip_timing(first)

    # An interrupted run: one batch lost. Only that batch is redone, to the same numbers.
    # scorer: (unwatermarked + 4 main cells) x 2 lengths + 1 ablation at 64 tokens
    assert len(list((out / "cache" / "scorer").glob("*/*.json"))) == 11
    batches = sorted((out / "cache" / "gen").glob("*/*.json"))
    assert len(batches) == 6  # unwatermarked + 2 schemes x 2 payload lengths + 1 ablation
    batches[0].unlink()
    result = cli.invoke(app, smoke_args)
    assert result.exit_code == 0, result.output
    assert calls == [4]
    redone = json.loads((out / "results.json").read_text())
    assert _strip_timing(redone) == _strip_timing(first)
    assert not list((out / "cache").rglob("*.tmp"))


def test_report_only_marks_missing_cells_partial(
    smoke: tuple[Path, dict[str, Any]], smoke_args: list[str], tmp_path: Path
) -> None:
    out, _ = smoke
    args = [*smoke_args, "--report-only", "--bits", "8,16,24", "--cache-dir", str(out / "cache")]
    args[args.index("--out") + 1] = str(tmp_path)
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert not results["complete"]
    assert "generate worldcup-k2/24b" in results["missing"]
    assert "**Status: PARTIAL**" in (tmp_path / "report.md").read_text()


# --------------------------------------------------------------------------- config


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "eval.toml"
    path.write_text('prompts = 12\nbits = [16, 32]\nattacks = "deletion"\nbatch-size = 4\n')
    cfg = build_config(config_file=path, overrides={"prompts": 20, "seed": None})
    assert cfg.prompts == 20 and cfg.bits == (16, 32) and cfg.batch_size == 4
    assert cfg.attacks == ("deletion",) and cfg.seed == EvalConfig().seed
    assert build_config(overrides={"ablations": "none"}).ablations == ()
    with pytest.raises(ValueError, match="unknown config key"):
        build_config(overrides={"promts": 3})
    with pytest.raises(ValueError, match="unknown scheme"):
        build_config(overrides={"schemes": "worldcup-k3"})


def test_cli_rejects_bad_settings_in_one_line(tmp_path: Path) -> None:
    result = cli.invoke(app, ["eval", "--bits", "99", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and "payload bits" in result.stderr


# --------------------------------------------------------------------------- attacks

TEXT = (
    "The storm moved slowly across the coast on Tuesday, flooding roads and closing schools. "
    "Officials said the damage was severe, and thousands of residents were left without "
    "power for several days.\n\nRescue teams worked through the night to reach families "
    "trapped in their homes, while volunteers handed out water, blankets and food at the "
    "shelters. The governor promised quick help for farmers whose crops were destroyed, "
    "and engineers began to inspect bridges, dams and the old harbour wall."
)


def test_wordnet_is_installed() -> None:
    """CI must have Debian's wordnet-base (scripts/setup.sh installs it): fail, never skip."""
    assert (wordnet_dir() / "data.noun").is_file(), f"WordNet missing in {wordnet_dir()}"
    wn = load_wordnet()
    assert "dog" in {lemma for s in wn.synsets("dogs") for lemma in s.lemma_names()}


def test_word_deletion_removes_a_fifth_of_the_words_in_order() -> None:
    words = split_words(TEXT)[1]
    result = word_deletion(TEXT, 0.2, np.random.default_rng(0))
    kept = split_words(result.text)[1]
    assert len(kept) == len(words) - round(0.2 * len(words))
    assert result.stats["deleted"] == round(0.2 * len(words))
    it = iter(w.strip() for w in words)
    assert all(any(k.strip() == w for w in it) for k in kept)  # an ordered subsequence
    assert word_deletion(TEXT, 0.2, np.random.default_rng(0)) == result  # seeded


def test_synonym_substitution_uses_real_wordnet_synonyms() -> None:
    """Paper/MarkLLM rule: round(0.2 * words) words, chosen among the eligible ones."""
    wn = load_wordnet()
    attack = SynonymSubstitution(wn)
    before = split_words(TEXT)[1]
    result = attack(TEXT, 0.2, np.random.default_rng(3))
    after = split_words(result.text)[1]
    assert len(after) == len(before)
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    expected = min(round(0.2 * len(before)), int(result.stats["eligible"]))
    assert len(changed) == result.stats["replaced"] == expected > 0
    assert result.stats["eligible"] > result.stats["replaced"]  # a choice among eligible words
    core = re.compile(r"^([^A-Za-z]*)([A-Za-z]+)([^A-Za-z]*)$")
    for old, new in changed:
        mo, mn = core.match(old), core.match(new)
        assert mo and mn and (mo.group(1), mo.group(3)) == (mn.group(1), mn.group(3))
        lemmas = {
            lemma.lower() for s in wn.synsets(mo.group(2).lower()) for lemma in s.lemma_names()
        }
        assert mn.group(2).lower() in lemmas and mn.group(2).lower() != mo.group(2).lower()
        assert mo.group(2)[0].isupper() == mn.group(2)[0].isupper()
    assert attack(TEXT, 0.2, np.random.default_rng(3)) == result


def test_copy_paste_sets_three_segments_inside_thirty_percent_human_text() -> None:
    human = " ".join(f"h{i}" for i in range(200))
    marked = " ".join(f"w{i}" for i in range(70))
    result = copy_paste(marked, human, 3, 0.3, np.random.default_rng(5))
    words = result.text.split()
    sources = ["w" if w.startswith("w") else "h" for w in words]
    runs = [s for i, s in enumerate(sources) if i == 0 or s != sources[i - 1]]
    assert runs.count("w") == 3  # three watermarked segments, separated by human text
    assert [w for w in words if w.startswith("w")] == marked.split()  # in order, all of them
    assert [w for w in words if w.startswith("h")] == human.split()[:30]
    assert sources.count("h") / len(words) == pytest.approx(0.3)
    assert [k for k, _ in result.layout].count("watermark") == 3


def test_paraphrase_request_goes_through_the_chat_template(smollm2_tokenizer: Any) -> None:
    ids = paraphrase_prompt_ids(smollm2_tokenizer, "The storm moved slowly.")
    text = smollm2_tokenizer.decode(ids)
    assert "Paraphrase the following text" in text and "The storm moved slowly." in text
    assert text.rstrip().endswith("assistant")


# --------------------------------------------------------------------------- metrics


def test_metrics() -> None:
    assert auc([3, 2, 1], [0, 0]) == 1.0 and auc([0], [1]) == 0.0 and auc([1], [1]) == 0.5
    assert best_f1([3, 2], [1, 0]) == (1.0, 2.0)
    # p < 0.01 is strict: a p-value of exactly 0.01 is not a detection
    assert rate_above([2.0, 2.0001, 5.0], 0.01) == pytest.approx(2 / 3)
    lo, hi = clopper_pearson(0, 100)
    assert lo == 0.0 and hi == pytest.approx(0.0362, abs=1e-4)
    assert bit_accuracy("01?1", "0101") == 0.75
    assert math.isnan(auc([], [1.0]))
