"""The #40 comparison (worldcup_eval.compare): names, the attacks, the rules, and that the
committed report rests on the committed cache and re-renders from its results.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.baselines import MPAC, BiMark
from worldcup_eval.attacks import split_words
from worldcup_eval.compare import (
    _Scored,
    add_paired,
    compare_spec,
    copy_paste_share,
    label,
    load_compare,
    match_strength,
    readme_table,
    render,
    verdict,
)
from worldcup_eval.config import build_config
from worldcup_eval.runner import build_scheme

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "results" / "compare" / "compare.toml"


def test_baseline_strength_names_and_cache_keys() -> None:
    cfg = build_config()
    plain, strong = compare_spec("mpac", cfg), compare_spec("mpac@3", cfg)
    assert plain.strength is None and strong.strength == 3.0
    # the paper setting's cache key is the one the committed grid was written under
    assert "strength" not in plain.describe() and strong.describe()["strength"] == 3.0
    scheme = build_scheme(cfg, strong)
    assert isinstance(scheme, MPAC) and scheme.config.delta == 3.0
    bimark = build_scheme(cfg, compare_spec("bimark@0.5", cfg))
    assert isinstance(bimark, BiMark) and bimark.config.base_delta == 0.5
    assert compare_spec("worldcup-v2-k1@0.6", cfg).alpha == 0.6  # frontier names pass through
    assert label("mpac@3") == "MPAC δ=3" and label("bimark@0.5") == "BiMark δ̃=0.5"
    with pytest.raises(ValueError, match="strength"):
        compare_spec("stealthink@2", cfg)
    with pytest.raises(ValueError, match="BASELINE@STRENGTH"):
        compare_spec("mpac@x", cfg)


def test_config_rejects_what_it_cannot_measure(tmp_path: Path) -> None:
    text = CONFIG.read_text(encoding="utf-8")
    cfg, ccfg = load_compare(CONFIG)
    assert ccfg.reference == ccfg.schemes[0] and ccfg.attacks.bits in ccfg.bits
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("fpr = 0.01", "fpr = 0.01\nnope = 1"), encoding="utf-8")
    with pytest.raises(ValueError, match="nope"):
        load_compare(bad)
    bad.write_text(text.replace('xmark = ["xmark"', 'xmark = ["xmark@q"'), encoding="utf-8")
    with pytest.raises(ValueError, match="STRENGTH"):
        load_compare(bad)


def test_copy_paste_share_keeps_length_and_human_share() -> None:
    wm = " ".join(f"w{i}" for i in range(200))
    human = " ".join(f"h{i}" for i in range(400))
    for share in (0.25, 0.5, 0.75):
        text, stats = copy_paste_share(wm, human, share, 3, np.random.default_rng(1))
        words = [w.strip() for w in split_words(text)[1]]
        marked = [w for w in words if w.startswith("w")]
        assert abs(len(words) - 200) <= 1  # as long as the original
        assert abs(stats["human_fraction"] - share) < 0.01
        assert marked == [f"w{i}" for i in range(len(marked))]  # the prefix, in order
        assert abs(len(marked) - 200 * (1 - share)) <= 1


def test_match_strength_takes_the_weakest_point_that_reaches_the_target() -> None:
    points = [{"name": "a", "tpr": 0.9}, {"name": "b", "tpr": 0.99}, {"name": "c", "tpr": 1.0}]
    assert match_strength(points, 0.99) == {"reached": True, "point": points[1]}
    assert match_strength(points[:1], 0.99) == {"reached": False, "point": points[0]}
    assert match_strength([], 0.99) == {"reached": False, "point": None}


def test_verdicts_and_paired_differences() -> None:
    assert verdict(0.03, 0.01, 2.0) == "trails"  # the baseline is better by 3 SE
    assert verdict(-0.03, 0.01, 2.0) == "leads"
    assert verdict(0.01, 0.01, 2.0) == "ties"
    assert verdict(0.0, 0.0, 2.0) == "ties" and verdict(None, None, 2.0) == "—"
    points: list[dict[str, Any]] = [{"name": "ref"}, {"name": "x"}]
    scored = {
        "ref": _Scored([0, 1, 2], {"bit_accuracy": [1.0, 0.5, 0.75]}),
        "x": _Scored([2, 1], {"bit_accuracy": [1.0, 1.0]}),  # paired by prompt index
    }
    add_paired(points, scored, "ref", keys=("bit_accuracy",))
    assert points[1]["bit_accuracy_minus_ref"] == pytest.approx(0.375)
    assert "bit_accuracy_minus_ref" not in points[0]


def test_unmasked_ablation_watermarks_repeated_contexts_and_still_decodes() -> None:
    from worldcup_eval.ideas import idea_scheme

    key = WatermarkKey(bytes(range(32)))
    config = WatermarkConfig(groups=1, alpha=0.6, version="worldcup-v1")
    payload = Payload("01" * 8)
    masked = WorldCup(key, config).sequence(payload)
    unmasked = idea_scheme("nomask", key, config).sequence(payload)
    candidates, probs = np.arange(50), np.full(50, 1 / 50)
    for seq in (masked, unmasked):
        for tok in (5, 6, 5):
            seq.observe(tok)
    # context (6, 5) is new for both; then (5, 6) repeats
    masked.observe(6)
    unmasked.observe(6)
    assert masked.reweight(candidates, probs) is probs
    assert not np.allclose(unmasked.reweight(candidates, probs), probs)
    with pytest.raises(ValueError, match="worldcup-v1"):
        idea_scheme("nomask", key, WatermarkConfig(groups=1)).sequence(payload)


# --- the committed report -------------------------------------------------------------------


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    results: dict[str, Any] = json.loads(
        (CONFIG.parent / "results.json").read_text(encoding="utf-8")
    )
    return results


def test_every_reported_cell_is_in_the_committed_cache(committed: dict[str, Any]) -> None:
    """Every cell the committed report measured resolves to cached batches under the
    current code (a change to a cache key would silently orphan them), paraphrases too;
    and the cells it lists as missing are exactly the uncached ones."""
    from worldcup_core.models import load_model
    from worldcup_eval.compare import Comparison

    cfg, ccfg = load_compare(CONFIG)
    load_model(cfg.model)  # a first load writes the config.json the key hashes
    comp = Comparison(cfg, ccfg)
    uncached = []
    for name, bits in comp.plan():
        if any(comp.cache.load(j.path) is None for j in comp.jobs(name, bits)):
            uncached.append((name, bits))
    measured = {(p["name"], s["bits"]) for s in committed["grid"] for p in s["points"]}
    measured |= {(r["name"], committed["attacks"]["bits"]) for r in committed["attacks"]["rows"]}
    sweeps = committed["equal"]["sweeps"]
    measured |= {(p["name"], committed["equal"]["bits"]) for w in sweeps for p in w["points"]}
    for pair in committed["masking"]:
        measured |= {(pair[k]["name"], pair[k]["bits"]) for k in ("ablation", "base")}
    assert measured and not measured & set(uncached)
    assert ("unwatermarked", None) not in uncached
    for r in committed["attacks"]["rows"]:
        if r["attack"] == "paraphrase":
            jobs = comp.para_jobs(r["name"], committed["attacks"]["bits"])
            assert jobs is not None and all(comp.cache.load(j.path) for j in jobs)
    listed = " ".join(committed["missing"])
    for name, bits in uncached:
        assert f"{name} {bits}" in listed


def test_report_and_readme_render_from_results(committed: dict[str, Any]) -> None:
    """report.md is render(results.json), and the README holds the headline table."""
    report = (CONFIG.parent / "report.md").read_text(encoding="utf-8")
    assert render(committed) == report
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_table(committed) in readme
    for plot in ("grid.png", "attacks.png", "equal.png"):
        assert (CONFIG.parent / plot).stat().st_size > 10_000
