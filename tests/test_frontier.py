"""The quality frontier (issue #29): names, statistics, the quality profile, the rule that
picks the service default, and the report written from whatever cells exist."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from worldcup_core import Payload, WatermarkConfig, WatermarkKey
from worldcup_core.config import Variant
from worldcup_core.encoder import WorldCupEncoder, lambda_for
from worldcup_eval.config import EvalConfig, build_config, scheme_spec
from worldcup_eval.frontier import (
    FrontierConfig,
    auc_se,
    deployable,
    frontier_spec,
    median_se,
    paired,
    render_frontier,
    select_default,
    write_frontier,
)
from worldcup_eval.quality import distinct_n, repetition, words
from worldcup_eval.runner import GenCell, gen_cell_key

FP = {"model": "m", "config": "c", "dtype": "float32"}


def test_point_names_keep_the_cache_key_of_an_alpha_set_in_a_config_file() -> None:
    base = EvalConfig()
    for name, alpha, layers in (("worldcup-k1", 0.6, 30), ("worldcup-k2", 0.3, 10)):
        point = frontier_spec(f"{name}@{alpha}" + (f"/m{layers}" if layers != 30 else ""), base)
        via_file = build_config(overrides={"alpha": alpha, "layers": layers}).spec(name)
        assert point == via_file
        assert gen_cell_key(base, GenCell(point, 32), FP) == gen_cell_key(
            base, GenCell(via_file, 32), FP
        )
        # and a different alpha is a different cell
        other = frontier_spec(f"{name}@{alpha + 0.1}", base)
        assert gen_cell_key(base, GenCell(other, 32), FP) != gen_cell_key(
            base, GenCell(point, 32), FP
        )
    assert frontier_spec("bimark", base) == scheme_spec("bimark")
    assert frontier_spec("worldcup-v2-k1@0.6", base).version == "worldcup-v2"


@pytest.mark.parametrize("bad", ["bimark@0.6", "worldcup-k1@x", "worldcup-k1@0.6/10", "nope@1"])
def test_bad_point_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        frontier_spec(bad, EvalConfig())


def test_alpha_zero_is_the_nondistortionary_sampler() -> None:
    """The frontier reads the non-distortionary cell as its alpha = 0 point: same lambda
    and the same reweighted distribution at every step."""
    rng = np.random.default_rng(3)
    key = WatermarkKey(bytes(range(32)))
    for k in (1, 2):
        zero = WatermarkConfig(groups=k, alpha=0.0, version="worldcup-v1")
        nd = WatermarkConfig(groups=k, variant=Variant.NONDISTORTIONARY, version="worldcup-v1")
        payload = Payload("0110" * 4)
        a, b = (
            WorldCupEncoder(key, zero, payload).start(),
            WorldCupEncoder(key, nd, payload).start(),
        )
        for _ in range(20):
            cand = rng.choice(1000, size=8, replace=False).astype(np.int64)
            p = rng.dirichlet(np.ones(8))
            assert lambda_for(zero, p) == lambda_for(nd, p) == 0.0
            np.testing.assert_array_equal(a.reweight(cand, p), b.reweight(cand, p))
            tok = int(cand[0])
            a.observe(tok)
            b.observe(tok)


def test_auc_standard_error() -> None:
    assert auc_se(1.0, 100, 200) == 0.0
    # Hanley-McNeil at A = 0.5 with equal groups: sqrt((0.25 + (n-1)(1/3 - 1/4) * 2) / n^2)
    n = 50
    expected = math.sqrt((0.25 + 2 * (n - 1) * (1 / 3 - 0.25)) / n**2)
    assert auc_se(0.5, n, n) == pytest.approx(expected)
    assert math.isnan(auc_se(0.9, 0, 10))


def test_median_se_matches_the_normal_theory_for_a_large_sample() -> None:
    rng = np.random.default_rng(0)
    samples = [list(rng.normal(size=400)) for _ in range(8)]
    # SE of the median of N(0, 1): sqrt(pi / 2) / sqrt(n); one bootstrap is noisy, 8 average
    found = np.mean([median_se(x, 1000, i) for i, x in enumerate(samples)])
    assert found == pytest.approx(math.sqrt(math.pi / 2 / 400), rel=0.15)
    x = samples[0]
    assert median_se(list(x), 500, 1) == median_se(list(x), 500, 1)  # seeded


def test_paired_difference() -> None:
    d, se = paired([1.0, 2.0, 3.0, 4.0], [0.5, 1.5, 2.0, 4.0])
    assert d == pytest.approx(0.5)
    assert se == pytest.approx(np.std([0.5, 0.5, 1.0, 0.0], ddof=1) / 2)


def test_quality_profile() -> None:
    assert words("It's 2 o'clock, OK?") == ["it's", "2", "o'clock", "ok"]
    text = words("the cat sat on the mat and the cat sat on the mat")
    assert distinct_n(text, 2) == pytest.approx(7 / 12)
    assert repetition(text, 3) == pytest.approx(4 / 11)
    fresh = words("one two three four five six")
    assert distinct_n(fresh, 2) == 1.0 and repetition(fresh, 3) == 0.0
    assert distinct_n(["a"], 2) is None and repetition(["a", "b"], 3) is None


# --------------------------------------------------------------------------- the rule


def _point(name: str, acc: float, ppl: float, tpr: float = 1.0, **kw: object) -> dict:
    groups = int(name[10]) if name.startswith("worldcup-k") else None
    base = {
        "name": name,
        "scheme": "worldcup" if groups else name,
        "groups": groups,
        "alpha": 1.2,
        "layers": 30,
        "variant": "worldcup" if groups else None,
        "version": "worldcup-v1" if groups else None,
        "bits": 32,
        "length": 256,
        "bit_accuracy": acc,
        "bit_accuracy_se": 0.004,
        "exact": 0.5,
        "exact_se": 0.05,
        "auc": 1.0,
        "auc_se": 0.0,
        "tpr_short": tpr,
        "tpr_short_se": 0.0,
        "self_ppl_median": ppl,
        "self_ppl_median_se": 0.2,
        "distinct2": 0.9,
        "distinct2_se": 0.01,
        "rep3": 0.02,
        "rep3_se": 0.001,
        "n": 100,
    }
    base.update(kw)
    return base


def _results(points: list[dict], unwm_ppl: float = 8.0, missing: tuple[str, ...] = ()) -> dict:
    fcfg = FrontierConfig(points=tuple(p["name"] for p in points) + ("bimark",))
    summary = {"distinct2": 0.9, "distinct2_se": 0.01, "rep3": 0.02, "rep3_se": 0.001, "n": 100}
    results = {
        "missing": list(missing),
        "frontier_config": json.loads(json.dumps(fcfg.__dict__)),
        "protocol": {
            "prompts": 100,
            "model": {"model": "m"},
            "key_id": "k",
            "generated_length": 256,
        },
        "settings": [
            {
                "bits": 32,
                "length": 256,
                "unwatermarked": {
                    **summary,
                    "self_ppl_median": unwm_ppl,
                    "self_ppl_median_se": 0.2,
                },
                "human": summary,
                "points": points + [_point("bimark", 0.98, 8.2)],
            }
        ],
    }
    results["selection"] = select_default(results)
    return results


def test_the_rule_takes_the_most_accurate_setting_within_the_ppl_margin() -> None:
    today = _point("worldcup-k2", 0.979, 12.7)
    a = _point("worldcup-k1@0.6", 0.984, 8.3, alpha=0.6)  # within 8.0 * 1.05 = 8.4
    b = _point("worldcup-k1@0.9", 0.990, 8.9, alpha=0.9)  # more accurate, but over the margin
    c = _point("worldcup-k1@0.3", 0.980, 8.1, alpha=0.3)
    sel = _results([today, a, b, c])["selection"]
    assert sel["chosen"] == "worldcup-k1@0.6"
    assert sel["chosen_settings"] == {"groups": 1, "layers": 30, "alpha": 0.6}
    assert sel["eligible"] == ["worldcup-k1@0.3", "worldcup-k1@0.6"]
    assert sel["ppl_limit"] == pytest.approx(8.4)


def test_the_rule_keeps_short_text_detection_power_and_breaks_ties_by_ppl() -> None:
    today = _point("worldcup-k2", 0.979, 12.7, tpr=0.97)
    weak = _point("worldcup-k1@0.6", 0.990, 8.3, alpha=0.6, tpr=0.95)  # loses power at 128
    tie_hi = _point("worldcup-k1@0.3", 0.985, 8.3, alpha=0.3, tpr=0.97)
    tie_lo = _point("worldcup-k2@0.3", 0.985, 8.2, alpha=0.3, tpr=0.99)
    sel = _results([today, weak, tie_hi, tie_lo])["selection"]
    assert sel["chosen"] == "worldcup-k2@0.3"


def test_the_rule_reads_the_nondistortionary_cell_as_alpha_zero_and_skips_baselines() -> None:
    today = _point("worldcup-k2", 0.979, 12.7)
    nd = _point("worldcup-k1-nondistortionary", 0.975, 8.1, variant="nondistortionary")
    other = _point("worldcup-k1-flat@0.3", 0.999, 8.0, variant="flat")  # not deployable
    assert deployable(nd) and not deployable(other)
    sel = _results([today, nd, other])["selection"]
    assert sel["chosen"] == "worldcup-k1-nondistortionary"
    assert sel["chosen_settings"] == {"groups": 1, "layers": 30, "alpha": 0.0}


def test_nothing_is_chosen_when_nothing_qualifies() -> None:
    sel = _results([_point("worldcup-k2", 0.979, 12.7)])["selection"]
    assert sel["chosen"] is None and sel["eligible"] == []


def test_report_and_plot_come_from_whatever_cells_exist(tmp_path: Path) -> None:
    pts = [_point("worldcup-k2", 0.979, 12.7), _point("worldcup-k1@0.6", 0.984, 8.3, alpha=0.6)]
    results = _results(pts, missing=("worldcup-k1@0.3 32",))
    text = render_frontier(results)
    assert "PARTIAL" in text and "`worldcup-k1@0.3 32`" in text
    assert "| `worldcup-k1@0.6` | 1 | 0.6 | 30 | 0.984 ± 0.004 |" in text
    assert "Chosen: `worldcup-k1@0.6`" in text
    write_frontier(results, tmp_path)
    assert (tmp_path / "frontier.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["selection"]["chosen"] == (
        "worldcup-k1@0.6"
    )


def test_the_flat_lambda_experiment_is_the_no_entropy_sampler_at_alpha_one() -> None:
    """``lambda = alpha`` at every step: at alpha = 1 it is the no-entropy ablation
    (lambda = 1), step for step; and it changes nothing the detector reads."""
    from worldcup_core import WorldCup
    from worldcup_eval.ideas import FlatLambdaWorldCup

    rng = np.random.default_rng(11)
    key = WatermarkKey(bytes(range(1, 33)))
    payload = Payload("1011" * 4)
    flat = FlatLambdaWorldCup(key, WatermarkConfig(groups=1, alpha=1.0, version="worldcup-v1"))
    ablation = WorldCup(
        key,
        WatermarkConfig(groups=1, variant=Variant.NO_ENTROPY, version="worldcup-v1"),
    )
    a, b = flat.sequence(payload), ablation.sequence(payload)
    half = FlatLambdaWorldCup(key, WatermarkConfig(groups=1, alpha=0.5, version="worldcup-v1"))
    c = half.sequence(payload)
    tanh = WorldCup(key, WatermarkConfig(groups=1, alpha=0.5, version="worldcup-v1"))
    d = tanh.sequence(payload)
    differs = 0
    for _ in range(30):
        cand = rng.choice(5000, size=12, replace=False).astype(np.int64)
        p = rng.dirichlet(np.ones(12) * 0.5)
        np.testing.assert_allclose(a.reweight(cand, p), b.reweight(cand, p), atol=1e-15)
        differs += not np.allclose(c.reweight(cand, p), d.reweight(cand, p))
        tok = int(cand[int(rng.integers(12))])
        for s in (a, b, c, d):
            s.observe(tok)
    assert differs > 0  # alpha * tanh(H) is not alpha (where the two tournaments overlap)
    ids = [int(x) for x in rng.integers(0, 5000, size=200)]
    assert flat.decode(ids, 16).bits == WorldCup(key, flat.config).decode(ids, 16).bits
    with pytest.raises(ValueError, match="worldcup-v1 only"):
        FlatLambdaWorldCup(key, WatermarkConfig(groups=1, alpha=0.5)).sequence(payload)


def test_later_sampling_fields_enter_the_cell_key_only_when_set() -> None:
    """A field added to SamplingConfig must not orphan the committed cache: at its
    default it leaves the key as it was; set, it makes a different cell."""
    from dataclasses import asdict, replace

    from worldcup_eval.runner import LATER_SAMPLING_FIELDS, sampling_key

    sampling = EvalConfig().sampling
    key = sampling_key(sampling)
    assert not set(LATER_SAMPLING_FIELDS) & set(key)
    assert set(key) | set(LATER_SAMPLING_FIELDS) == set(asdict(sampling))
    for field, value in (("min_p", 0.05), ("repetition_penalty", 1.1), ("logprobs", 2)):
        changed = sampling_key(replace(sampling, **{field: value}))
        assert changed[field] == value and changed != key


def test_every_reported_cell_is_in_the_committed_cache() -> None:
    """The frontier report and the service default rest on docs/results/cache: every
    point, idea and confirmation of frontier.toml resolves to cached batches under the
    current code (a change to the cache key would silently orphan them)."""
    from worldcup_core.models import load_model
    from worldcup_eval.cache import BatchCache
    from worldcup_eval.data import default_data_dir, load_data
    from worldcup_eval.frontier import load_frontier
    from worldcup_eval.runner import gen_jobs, model_fingerprint

    root = Path(__file__).resolve().parents[1]
    cfg, fcfg = load_frontier(root / "docs" / "results" / "frontier" / "frontier.toml")
    lm = load_model(cfg.model)  # a first load writes the config.json the key hashes
    fp = model_fingerprint(cfg.model, cfg.dtype, cfg.device)
    data = load_data(
        lm.tokenizer,
        default_data_dir(),
        cfg.prompts,
        cfg.datasets,
        cfg.prompt_tokens,
        cfg.max_length,
        cfg.seed,
    )
    cache = BatchCache(root / cfg.cache_path)
    cells = [("unwatermarked", None)] + [
        (name, bits) for name in fcfg.points for bits, _ in fcfg.settings
    ]
    cells += [(name, fcfg.select_at[0]) for pair in fcfg.ideas for name in pair]
    cells += [(name, bits) for pair in fcfg.confirm for name in pair for bits, _ in fcfg.settings]
    missing = []
    for name, bits in cells:
        jobs = gen_jobs(cfg, None, GenCell(frontier_spec(name, cfg), bits), data.prompts, cache, fp)
        if name == "worldcup-k1-flat@0.3":
            jobs = jobs[:4]
        missing += [f"{name} {bits} {j.path.name}" for j in jobs if cache.load(j.path) is None]
    assert missing == []
