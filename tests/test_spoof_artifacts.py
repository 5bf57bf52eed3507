"""Spoof-artifact statistics of issue #45: the fluency test (worldcup_eval.fluency: exact terms,
calibration, power) and the context split of evidence (worldcup_eval.context_artifact_study)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from worldcup_eval.fluency import (
    Surprisal,
    fluency_p,
    fluency_z,
    surprisal_from_logits,
    surprisal_rows,
)

VOCAB = 40


def _softmax(x: np.ndarray) -> np.ndarray:
    w = np.exp(x - x.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True)


def _text(rng: np.random.Generator, n: int, temperature: float = 1.0, boost: float = 0.0):
    """Logits of n positions and tokens drawn from them at ``temperature`` (the model's
    own draws at 1.0), or with a random half of the vocabulary boosted by ``boost``."""
    logits = rng.normal(0.0, 2.5, size=(n, VOCAB))
    green = rng.random((n, VOCAB)) < 0.5
    drawn = _softmax(logits / temperature + boost * green)
    tokens = np.array([rng.choice(VOCAB, p=row) for row in drawn])
    return logits, tokens


def test_terms_match_a_direct_computation() -> None:
    rng = np.random.default_rng(1)
    logits, tokens = _text(rng, 25)
    logits[3, 5] = -np.inf  # a token the model never draws: no effect on the others
    tokens[3] = 7
    e, v = surprisal_rows(logits, tokens)
    for t in range(len(tokens)):
        p = _softmax(logits[t])
        logp = np.log(p, where=p > 0, out=np.zeros_like(p))
        h = -sum(pi * li for pi, li in zip(p, logp, strict=True) if pi > 0)
        second = sum(pi * li * li for pi, li in zip(p, logp, strict=True) if pi > 0)
        assert e[t] == pytest.approx(-math.log(p[tokens[t]]) - h, abs=1e-9)
        assert v[t] == pytest.approx(second - h * h, abs=1e-9)


def test_a_token_the_model_never_draws_makes_z_infinite() -> None:
    logits = np.zeros((3, VOCAB))
    logits[1, 4] = -np.inf
    s = surprisal_from_logits(logits, [0, 1, 4, 2], first=1)
    assert math.isnan(s.excess[0]) and math.isinf(s.excess[2])
    assert fluency_z(s) == math.inf
    assert fluency_z(s, mask=[True, True, False, True]) == 0.0  # flat rows: v = e = 0


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        surprisal_from_logits(np.zeros((5, VOCAB)), [1, 2, 3], first=1)
    with pytest.raises(ValueError, match="vocabulary"):
        surprisal_rows(np.zeros((1, VOCAB)), [VOCAB])
    with pytest.raises(ValueError, match="1-D"):
        Surprisal(np.zeros(3), np.zeros(2))


def test_the_models_own_draws_give_a_standard_normal_z() -> None:
    rng = np.random.default_rng(7)
    zs = []
    for _ in range(600):
        logits, tokens = _text(rng, 120)
        zs.append(fluency_z(surprisal_from_logits(logits, [0, *tokens.tolist()], first=1)))
    # Kolmogorov-Smirnov against N(0, 1) at 600 texts of 120 tokens (a martingale CLT)
    assert stats.kstest(zs, "norm").pvalue > 1e-3
    assert sum(z > 3.0 for z in zs) <= 4  # 1.35e-3 each: 0.8 expected


def test_cooler_draws_lower_z_and_boosted_ones_raise_it() -> None:
    rng = np.random.default_rng(11)

    def mean_z(**kw: float) -> float:
        zs = []
        for _ in range(60):
            logits, tokens = _text(rng, 120, **kw)
            zs.append(fluency_z(surprisal_from_logits(logits, [0, *tokens.tolist()], first=1)))
        return float(np.mean(zs))

    # 60 texts a mean: its standard error is about 0.15
    assert mean_z(temperature=0.7) < -2.0
    boosted_2, boosted_4 = mean_z(boost=2.0), mean_z(boost=4.0)
    assert 0.8 < boosted_2 < boosted_4 - 0.8


def test_p_is_the_normal_upper_tail() -> None:
    assert fluency_p(0.0) == pytest.approx(0.5)
    assert fluency_p(3.090232) == pytest.approx(1e-3, rel=1e-4)


def test_texts_pool_their_sums_into_one_z() -> None:
    """Texts read together pool their sums; a text without a reading pools to None."""
    from worldcup_eval.fluency import fluency_sums, pooled_z

    rng = np.random.default_rng(3)
    logits, tokens = _text(rng, 50)
    s = surprisal_from_logits(logits, [0, *tokens.tolist()], first=1)
    half = Surprisal(s.excess[:25], s.variance[:25]), Surprisal(s.excess[25:], s.variance[25:])
    pooled = pooled_z([fluency_sums(h) for h in half])
    assert pooled == pytest.approx(fluency_z(s))
    assert pooled_z([fluency_sums(half[0]), None]) is None and pooled_z([]) is None


def test_the_studys_separation_is_mann_whitney() -> None:
    from worldcup_eval.fluency_study import auc

    assert auc([3.0, 4.0], [1.0, 2.0]) == 1.0 and auc([1.0], [2.0]) == 0.0
    assert auc([1.0, 2.0], [1.0, 2.0]) == 0.5 and math.isnan(auc([], [1.0]))
    rng = np.random.default_rng(0)
    shifted = auc(rng.normal(1.0, 1.0, 400).tolist(), rng.normal(0.0, 1.0, 400).tolist())
    assert abs(shifted - stats.norm.cdf(1.0 / math.sqrt(2.0))) < 0.04  # 0.760


def test_the_context_split_of_evidence() -> None:
    """worldcup_eval.context_artifact_study: R is about N(0, 1) where rare contexts carry
    no watermark and large where they do; D compares the groups' means; contexts are
    counted once per text."""
    from worldcup_core.context_sketch import split_evidence
    from worldcup_eval.context_artifact_study import context_counts

    rng = np.random.default_rng(2)
    null_r = [
        split_evidence(rng.normal(0, 1, 80).tolist(), rng.integers(0, 10, 80).tolist(), 5).r
        for _ in range(400)
    ]
    assert stats.kstest(null_r, "norm").pvalue > 1e-3
    seen = [0] * 40 + [9] * 40
    genuine = split_evidence((rng.normal(0.8, 1, 80)).tolist(), seen, 5)
    spoof = split_evidence(np.r_[rng.normal(0, 1, 40), rng.normal(1.6, 1, 40)].tolist(), seen, 5)
    assert genuine.rare == genuine.common == 40
    assert genuine.r > 3.0 > spoof.r and spoof.d > 4.0 > abs(genuine.d)
    only_common = split_evidence([1.0, 2.0], [7, 8], 5)
    assert only_common.rare == 0 and math.isnan(only_common.r) and math.isnan(only_common.d)
    counts = context_counts([[(1, 2), (1, 2), (3, 4)], [(1, 2)]])
    assert counts == {(1, 2): 2, (3, 4): 1}
    with pytest.raises(ValueError, match="one count per token"):
        split_evidence([1.0], [1, 2], 5)


def test_a_runs_saved_config_reads_back(tmp_path: Path) -> None:
    """The studies read a forgery run's config as it saved it; fields a newer release
    added take their defaults, fields it dropped are ignored."""
    import json
    from dataclasses import asdict

    from worldcup_eval.forgery import ForgeryConfig, saved_config

    config = ForgeryConfig("fixed", 1234, deltas=(1.0, 3.0), context_width=2, sealed=False)
    saved = asdict(config) | {"dropped_field": 1}
    del saved["human_tokens"]
    (tmp_path / "config-1234.json").write_text(json.dumps(saved))
    assert saved_config(tmp_path, 1234) == config


def test_the_studies_refuse_bad_input_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nonsense on the command line is an argparse error (exit 2, one line), never a
    traceback, and nothing is loaded first."""
    from worldcup_eval import context_artifact_study, fluency_study

    run = ["--run", str(tmp_path), "--budget-tokens", "100"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"sets": 3}')
    cases = [
        (fluency_study.main, [*run, "--genuine", str(tmp_path), "--collect", "-3"], ">= 0"),
        (fluency_study.main, [*run, "--collect", "3"], "--collect needs --genuine"),
        (fluency_study.main, [*run, "--top-p", "1.5"], "--top-p in (0, 1]"),
        (fluency_study.main, run, "no spoofs-100.jsonl"),
        (context_artifact_study.main, [*run, "--verdicts", "v.json"], "no such file"),
        (context_artifact_study.main, [*run, "--verdicts", "v", "--rare-below", "0"], ">= 1"),
        (context_artifact_study.main, run, "required: --verdicts"),
        (context_artifact_study.main, ["--table", str(tmp_path / "no.json")], "no such file"),
        (context_artifact_study.main, ["--table", str(bad)], "not a study's JSON"),
    ]
    for main, argv, said in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err


def test_a_saved_context_study_prints_again_with_the_services_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--table`` reprints docs/results/forgery/context-artifact.json; the service's rule
    line counts the texts :func:`~worldcup_core.context_sketch.spoof_artifact` flags."""
    from worldcup_core.context_sketch import Split, spoof_artifact
    from worldcup_eval import context_artifact_study

    path = Path(__file__).resolve().parents[1] / "docs/results/forgery/context-artifact.json"
    assert context_artifact_study.main(["--table", str(path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["sets"]["stolen d=4"]
    held = [r for r in rows if r["watermarked"]]
    flagged = sum(spoof_artifact(Split(r["rare"], r["common"], r["r"], r["d"])) for r in held)
    section = out.split("stolen d=4:")[1]
    assert f"the service's rule (R < 1.64 and D > 3) takes {flagged}/{len(held)} " in section
    assert 0 < flagged < len(held)


def test_spoof_prompts_can_be_held_out_from_another_range(data_dir: Path) -> None:
    """--spoof-from: the spoofer's topics are another range of ELI5 questions, none of
    them among the training prompts; 0 keeps the earlier runs' split."""
    from worldcup_eval.forgery import load_prompts

    first = load_prompts(data_dir, 40)
    later = load_prompts(data_dir, 40, 40)
    assert len(later.spoof) == 40 and not set(later.spoof) & set(first.spoof)
    assert not set(later.spoof) & set(later.train)
    assert set(first.spoof) <= set(later.train)
    assert len(first.train) == len(later.train)
    with pytest.raises(ValueError, match="held-out questions 190..230"):
        load_prompts(data_dir, 40, 190)


def test_a_held_out_study_counts_prompts_an_oracle_gets_through(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Spoof rows carry their prompt: ``--table`` says on how many prompts some draft is
    watermarked and not flagged (what a yes/no oracle's best of n gets past the rule)."""
    from worldcup_core.context_sketch import Split, spoof_artifact
    from worldcup_eval import context_artifact_study

    path = (
        Path(__file__).resolve().parents[1] / "docs/results/forgery/context-artifact-heldout.json"
    )
    assert context_artifact_study.main(["--table", str(path)]) == 0
    section = capsys.readouterr().out.split("stolen d=4:")[1]
    rows = json.loads(path.read_text())["sets"]["stolen d=4"]
    by: dict[str, bool] = {}
    for r in rows:
        ok = r["watermarked"] and not spoof_artifact(Split(r["rare"], r["common"], r["r"], r["d"]))
        by[r["prompt"]] = by.get(r["prompt"], False) or ok
    assert f"(an oracle's best of 4): {sum(by.values())}/{len(by)}" in section
