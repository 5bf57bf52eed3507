"""worldcup_core.assess: one verdict per text, its corrections checked against
brute-force enumeration and simulation.

Weighted Bonferroni must hold its level whatever the dependence between the tests
and key versions: checked exactly where the p-values are independent (the rejection
probability has a closed form) and identical (the worst case for the union bound is
disjoint rejection regions; identical p-values are the other extreme), and by
simulation with correlated p-values.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from worldcup_cli.calibration_bench import human_chunks, null_joint_p_values, null_p_values
from worldcup_core.assess import TestP, assess, weights_for
from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW, verdict_of

SEARCHED = "test keys"


def _tests(
    detect: float, decode: float, registry: float | None, registry_exists: bool
) -> list[TestP]:
    tests = [TestP("detect", detect), TestP("decode", decode, 32)]
    if registry_exists:
        tests.append(TestP("registry", registry, 32, registry_size=20))
    return tests


def test_weights_depend_only_on_which_tests_exist_and_sum_to_one() -> None:
    for kinds in (["detect"], ["detect", "decode"], ["detect", "decode", "registry"]):
        for lengths in (1, 2, 3):
            tests = [TestP("detect", 0.5)] + [
                TestP(k, 0.5, 8 * (i + 1)) for k in kinds[1:] for i in range(lengths)
            ]
            w = weights_for(tests)
            assert math.isclose(sum(w), 1.0)
            moved = weights_for([TestP(t.name, 1e-9, t.num_bits) for t in tests])
            assert w == moved  # the p-values never change the weights


def test_the_verdict_is_the_smallest_corrected_p() -> None:
    said = assess(_tests(1e-3, 1e-4, 1e-9, True), 3, SEARCHED)
    # weights 0.1, 0.1, 0.8; three versions: registry 1e-9 * 3 / 0.8
    assert said.statistic == "registry"
    assert math.isclose(said.p_value, 1e-9 * 3 / 0.8)
    assert said.statistic_p_value == 1e-9
    assert said.verdict == "watermarked" and said.is_watermarked
    assert said.threshold == VERDICT_WATERMARKED_BELOW == 1e-6
    assert said.keys_searched == SEARCHED and said.versions_tried == 3
    assert said.may_name_entry and math.isclose(said.entry_p_value or 0, said.p_value)
    without = assess(_tests(1e-3, 1e-7, None, False), 1, SEARCHED)
    assert without.statistic == "decode" and math.isclose(without.p_value, 2e-7)
    assert without.entry_p_value is None and not without.may_name_entry


def test_key_versions_are_corrected_for() -> None:
    one = assess(_tests(0.5, 4e-7, None, False), 1, SEARCHED)
    two = assess(_tests(0.5, 4e-7, None, False), 2, SEARCHED)
    assert one.verdict == "watermarked" and math.isclose(one.p_value, 8e-7)
    assert two.verdict == "inconclusive" and math.isclose(two.p_value, 1.6e-6)


def test_a_missing_registry_p_spends_its_weight() -> None:
    said = assess(_tests(1e-8, 0.5, None, True), 1, SEARCHED)
    assert said.statistic == "detect" and math.isclose(said.p_value, 1e-7)
    assert not said.may_name_entry


def test_is_watermarked_and_entry_naming_never_contradict_the_verdict() -> None:
    rng = np.random.default_rng(3)
    for _ in range(3000):
        p = 10.0 ** rng.uniform(-12, 0, size=3)
        said = assess(
            _tests(p[0], p[1], p[2], bool(rng.integers(2))), int(rng.integers(1, 5)), SEARCHED
        )
        assert said.is_watermarked == (said.verdict == "watermarked")
        assert said.verdict == verdict_of(said.p_value)
        if said.may_name_entry:
            assert said.verdict == "watermarked"
        assert 0.0 <= said.p_value <= 1.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one test"):
        assess([], 1, SEARCHED)
    with pytest.raises(ValueError, match="versions_tried"):
        assess([TestP("detect", 0.1)], 0, SEARCHED)


@pytest.mark.parametrize("registry", [False, True])
@pytest.mark.parametrize("versions", [1, 3])
def test_level_matches_the_exact_rate_for_independent_p_values(
    registry: bool, versions: int
) -> None:
    """Independent tests, each the best of ``versions`` independent uniforms: the
    rate of p < t has a closed form, 1 - prod_s (1 - t w_s / V)^V, which is <= t
    (the union bound), and assess's rate must match it within 4 standard errors."""
    rng = np.random.default_rng(versions + 10 * registry)
    n = 60_000
    names = 3 if registry else 2
    u = rng.random((n, versions, names)).min(axis=1)
    combined = np.array(
        [
            assess(
                _tests(r[0], r[1], r[2] if registry else None, registry), versions, SEARCHED
            ).p_value
            for r in u
        ]
    )
    weights = weights_for(_tests(0.5, 0.5, 0.5, registry))
    for t in (0.05, 0.01):
        exact = 1.0 - math.prod((1.0 - t * w / versions) ** versions for w in weights)
        assert exact <= t
        rate = float(np.mean(combined < t))
        assert abs(rate - exact) <= 4 * math.sqrt(exact / n) + 1e-12, (t, rate, exact)


def test_identical_p_values_stay_below_the_level() -> None:
    """Perfect dependence: every test and version sees the same p; the rate is then
    t * max(w) / V <= t, computed here by enumeration over a fine grid of p."""
    grid = (np.arange(200_000) + 0.5) / 200_000
    for versions, registry in ((1, False), (2, True)):
        t = 0.01
        hits = sum(
            assess(_tests(p, p, p, registry), versions, SEARCHED).p_value < t for p in grid[:5000]
        )  # p >= 5000/200000 = 0.025 > t is never significant
        rate = hits / len(grid)
        expected = t * max(weights_for(_tests(0.5, 0.5, 0.5, registry))) / versions
        assert abs(rate - expected) <= 1e-5 and rate <= t


def test_level_holds_by_simulation_with_correlated_p_values() -> None:
    """Gaussian-copula p-values, correlation 0.7 between tests and versions: the rate of
    p < t stays at or below t (4 standard errors of slack)."""
    rng = np.random.default_rng(11)
    n, versions = 40_000, 2
    cov = 0.7 * np.ones((3 * versions, 3 * versions)) + 0.3 * np.eye(3 * versions)
    z = rng.multivariate_normal(np.zeros(3 * versions), cov, size=n)
    u = stats.norm.sf(z).reshape(n, versions, 3).min(axis=1)
    combined = np.array(
        [assess(_tests(a, b, c, True), versions, SEARCHED).p_value for a, b, c in u]
    )
    for t in (0.05, 0.01, 1e-3):
        rate = float(np.mean(combined < t))
        assert rate <= t + 4 * math.sqrt(t / n), (t, rate)


def test_the_verdict_p_is_calibrated_on_human_text_under_many_keys(
    data_dir: Path, smollm2_tokenizer: Any
) -> None:
    """The combined p on null text (human chunks, a fresh key every 8 chunks, 251 keys,
    a 20-entry registry each): at or below each level down to 1e-3 (4 SE of slack),
    and its exact components uniform (KS). ``worldcup bench calibration`` runs 1e5."""
    chunks = human_chunks(data_dir, smollm2_tokenizer)
    sample = null_p_values(chunks, 2000, seed=35)
    assert sample.keys >= 250 and len(sample.combined) == 2000
    n = len(sample.combined)
    for t in (0.1, 0.01, 1e-3):
        rate = float(np.mean(sample.combined < t))
        assert rate <= t + 4 * math.sqrt(t / n), (t, rate)
    assert float(np.mean(sample.combined < 0.1)) >= 0.03  # conservative, not dead
    for component in (sample.detect, sample.decode):
        assert stats.kstest(component, "uniform").pvalue > 1e-3


def _text_only_weights(chunks: list[list[int]]) -> list[Any]:
    """Stand-in informativeness per token, a function of the text alone (as the model's
    is): the null stays exact for any key-independent weights, which is what is tested."""
    return [
        np.random.default_rng(abs(hash(tuple(c))) % 2**32).uniform(0.0, 1.0, len(c)) for c in chunks
    ]


def test_the_model_weighted_verdict_and_the_joint_test_are_calibrated(
    data_dir: Path, smollm2_tokenizer: Any
) -> None:
    """``worldcup bench calibration --statistic model --joint N`` on a small sample: the
    model-weighted verdict p at or below each level (4 SE), its exact components uniform;
    the joint verdict of 5 null texts read together at or below each level, its exact
    components (message-free, payload length known) uniform (its group search is
    tested in test_collection.py)."""
    chunks = human_chunks(data_dir, smollm2_tokenizer)[:400]
    weights = _text_only_weights(chunks)
    sample = null_p_values(chunks, 800, seed=36, weights=weights)
    n = len(sample.combined)
    for t in (0.1, 0.01):
        assert float(np.mean(sample.combined < t)) <= t + 4 * math.sqrt(t / n)
    for component in (sample.detect, sample.decode):
        assert stats.kstest(component, "uniform").pvalue > 1e-3
    together = null_joint_p_values(chunks, 300, seed=37, weights=weights, searched=0)
    assert len(together.joint) == 300 and len(together.group) == 0
    for t in (0.1, 0.01):
        assert float(np.mean(together.joint < t)) <= t + 4 * math.sqrt(t / 300)
    for component in (together.detect, together.decode):
        assert len(component) == 300 and stats.kstest(component, "uniform").pvalue > 1e-3


def test_absence_needs_the_scored_tokens_the_line_asks_for() -> None:
    """ "not_watermarked" only from MIN_SCORED_TOKENS scored tokens; below, inconclusive
    (too_short) with the line as tokens_needed; watermarked stays watermarked."""
    from worldcup_core.verdict import MIN_SCORED_TOKENS

    clean = _tests(0.6, 0.7, None, False)
    short = assess(clean, 1, SEARCHED, MIN_SCORED_TOKENS - 1)
    assert (short.verdict, short.reason, short.tokens_needed) == (
        "inconclusive",
        "too_short",
        MIN_SCORED_TOKENS,
    )
    enough = assess(clean, 1, SEARCHED, MIN_SCORED_TOKENS)
    assert (enough.verdict, enough.reason, enough.tokens_needed) == ("not_watermarked", None, None)
    assert assess(clean, 1, SEARCHED, 0).verdict == "inconclusive"
    strong = assess(_tests(1e-12, 1e-12, None, False), 1, SEARCHED, 3)
    assert strong.verdict == "watermarked" and strong.reason is None
    # some evidence with enough tokens: the length at which it would reach 1e-6
    some = assess(_tests(1e-4, 1e-4, None, False), 1, SEARCHED, 100)
    assert some.reason == "some_evidence" and some.tokens_needed is not None
    assert some.tokens_needed > 100
    # the nested tests: one decided, the combined p's smallest is the answer's
    from worldcup_core.assess import components

    parts = components(some)
    assert sum(c.decided for c in parts) == 1
    assert min(c.combined_p_value for c in parts) == some.p_value
    assert [c.verdict_alone for c in parts if c.test == "detect"] == ["inconclusive"]
