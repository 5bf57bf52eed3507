"""Provenance search over many keys: exact agreement with single-key detection,
power (the right key out of 1000) and calibration of the search-corrected p-value."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from test_codec import simulate

from worldcup_core import Payload, Variant, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.prf import ScoredItems, ScoredTokensV2
from worldcup_core.provenance import KeyBank, ScreenConfig, sidak_log_p

VOCAB = 49152  # the SmolLM2 vocabulary size, as in test_codec


def keys(n: int, seed: int) -> list[WatermarkKey]:
    rng = np.random.default_rng(seed)
    return [WatermarkKey(rng.bytes(32)) for _ in range(n)]


CONFIGS = [
    WatermarkConfig(),
    WatermarkConfig(groups=1),
    WatermarkConfig(groups=3, layers=7),
    WatermarkConfig(context_width=1),
    WatermarkConfig(variant=Variant.RANDOM_SECOND),
    WatermarkConfig(version="worldcup-v1"),  # banks hold keys of both schemes
    WatermarkConfig(groups=1, context_width=3, version="worldcup-v1"),
    WatermarkConfig(variant=Variant.RANDOM_SECOND, version="worldcup-v1"),
]


@pytest.mark.parametrize("num_bits", [None, 16, 32])
def test_bank_equals_single_key_detection(num_bits: int | None) -> None:
    """Mixed configurations in one bank; every key's p-value is exactly detect()'s."""
    schemes = [WorldCup(k, CONFIGS[i % len(CONFIGS)]) for i, k in enumerate(keys(23, 1))]
    bank = KeyBank(schemes, chunk_size=4)  # several chunks per configuration
    rng = np.random.default_rng(2)
    texts = [
        rng.integers(0, VOCAB, 120).tolist(),
        simulate(schemes[7], Payload.random(32, np.random.default_rng(3)), 120, rng),
        [5, 6, 5, 6, 5, 6, 5, 6, 9],  # repeated contexts: most tokens are not scored
    ]
    for ids in texts:
        log10_p, symbols, _ = bank.log10_p_values(ids, num_bits)
        for i, scheme in enumerate(schemes):
            single = scheme.detect(ids, num_bits)
            assert log10_p[i] == pytest.approx(single.log10_p_value, abs=1e-12, rel=1e-12)
            if num_bits is not None:
                assert symbols[i] == scheme.config.symbols_for(num_bits)


def test_scored_items_match_the_detector() -> None:
    ids = [1, 2, 3, 1, 2, 3, 1, 2, 4, 4, 4, 4]
    key = keys(1, 9)[0]
    items = ScoredItems.of(ids, 2)
    v1 = WorldCup(key, WatermarkConfig(version="worldcup-v1"))
    assert len(items) == v1.detect(ids).num_scored_tokens
    # contexts (1,2), (2,3), (3,1) recur from t=5 and (4,4) at t=11: only first occurrences score
    assert items.indices == (0, 1, 2, 3, 4, 9, 10)
    assert items.tokens[5] == (4).to_bytes(4, "little")
    # v2 also leaves out t = 0 and 1, whose context is the padding
    v2_items = ScoredTokensV2.of(ids, 2)
    assert v2_items.indices.tolist() == [2, 3, 4, 9, 10]
    assert len(v2_items) == WorldCup(key).detect(ids).num_scored_tokens


def test_finds_the_generating_key_among_a_thousand() -> None:
    bank_keys = keys(1000, 4)
    schemes = [WorldCup(k) for k in bank_keys]
    bank = KeyBank(schemes)
    rng = np.random.default_rng(5)
    for truth in (0, 517, 999):
        ids = simulate(schemes[truth], Payload.random(32, rng), 96, rng)
        result = bank.search(ids, top=3)
        assert result.best is not None and result.best.index == truth
        assert result.num_keys == 1000 and len(result.top) == 3
        assert result.p_value < 1e-6
        # the correction is the Šidák one, ~ K * p for small p
        assert (
            result.log10_p_value == pytest.approx(result.best.log10_p_value + 3.0, abs=1e-6)
            or result.log10_p_value < -300
        )


@pytest.mark.parametrize(
    "screen",
    [ScreenConfig(), ScreenConfig(min_keys=10, stride=2, keep=4, keep_fraction=0.0, min_tokens=8)],
    ids=["exact", "screened"],
)
def test_search_p_value_is_calibrated_on_unwatermarked_text(screen: ScreenConfig) -> None:
    """Under the global null the corrected p-value is Uniform(0,1) or conservative,
    with or without the screening pass."""
    bank = KeyBank([WorldCup(k) for k in keys(40, 6)])
    rng = np.random.default_rng(7)
    results = [bank.search(rng.integers(0, VOCAB, 60).tolist(), screen=screen) for _ in range(400)]
    assert all(r.screened == (screen.min_keys < 40) for r in results)
    p = np.array([r.p_value for r in results])
    # level checks with binomial slack (one-sided: conservative is fine)
    for alpha in (0.05, 0.2, 0.5):
        hits = int((p < alpha).sum())
        assert stats.binomtest(hits, len(p), alpha, alternative="greater").pvalue > 1e-3, alpha
    # and it is not uselessly conservative: the scan over groupings costs a little
    assert float((p < 0.5).mean()) > 0.2


def test_empty_bank_and_unscorable_text() -> None:
    empty = KeyBank([])
    result = empty.search([1, 2, 3])
    assert result.best is None and result.p_value == 1.0 and result.num_keys == 0
    bank = KeyBank([WorldCup(k) for k in keys(3, 8)])
    assert bank.search([]).best is None


@pytest.mark.parametrize("k", [1, 2, 10, 1000])
@pytest.mark.parametrize("p", [0.5, 1e-3, 1e-12, 1e-30, 1e-200])
def test_sidak_matches_exact_formula(k: int, p: float) -> None:
    exact = -math.expm1(k * math.log1p(-p))
    got = math.exp(sidak_log_p(math.log(p), k))
    assert got == pytest.approx(exact, rel=1e-9)
    assert got <= min(1.0, k * p) * (1 + 1e-12)  # never above Bonferroni


def test_sidak_edges() -> None:
    assert sidak_log_p(0.0, 5) == 0.0
    assert sidak_log_p(-2000.0, 1000) == pytest.approx(-2000.0 + math.log(1000))


def test_screening_finds_the_key_among_two_thousand() -> None:
    schemes = [WorldCup(k) for k in keys(2000, 10)]
    bank = KeyBank(schemes)
    rng = np.random.default_rng(11)
    for truth in (3, 1777):
        ids = simulate(schemes[truth], Payload.random(32, rng), 128, rng)
        result = bank.search(ids)
        assert result.screened and result.num_full_scans == 40  # 2 % of the bank
        assert result.best is not None and result.best.index == truth
        assert result.p_value < 1e-6
        # the survivor's p-value is the exact one
        assert result.best.log10_p_value == pytest.approx(
            schemes[truth].detect(ids).log10_p_value, abs=1e-12
        )


def test_screened_p_value_is_never_below_the_exact_one() -> None:
    bank = KeyBank([WorldCup(k) for k in keys(300, 12)])
    exact = ScreenConfig(min_keys=10**9)
    rng = np.random.default_rng(13)
    for _ in range(5):
        ids = rng.integers(0, VOCAB, 100).tolist()
        screened = bank.search(ids)
        assert screened.screened and screened.num_full_scans == 32
        assert screened.p_value >= bank.search(ids, screen=exact).p_value
    short = bank.search([1, 2, 3, 4, 5])  # too few tokens to screen: exact scan
    assert not short.screened and short.num_full_scans == 300
