"""worldcup_core.detector_weighted: the layer-weighted detection statistic.

Its cell law is checked against brute-force enumeration, its p-values for
uniformity on null text under many keys, unit weights against the unweighted v2
statistic (identical p-values), and its power against the unweighted statistic on
low-entropy watermarked text (where the later layers carry little evidence).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.config import SERVICE_PRESET, WATERMARK_PRESETS
from worldcup_core.detector_weighted import (
    WeightedTable,
    layer_weights,
    verdict_log_p,
    weighted_log_p_many,
)

PRESET = WATERMARK_PRESETS[SERVICE_PRESET]
CONFIG = WatermarkConfig(groups=PRESET.groups, layers=PRESET.layers, alpha=PRESET.alpha)


def test_layer_weights_decrease_from_four_to_one() -> None:
    w = layer_weights(30)
    assert w[0] == 4 and w[-1] == 1 and np.all(np.diff(w) <= 0) and len(w) == 30
    assert list(layer_weights(1)) == [1]


@pytest.mark.parametrize("weights", [[3, 1], [2, 2, 1], [4, 3, 1]])
def test_cell_tails_match_brute_force(weights: list[int]) -> None:
    table = WeightedTable(np.array(weights))
    w = np.array(weights)
    for n in (1, 2, 3):
        tokens = itertools.product((0, 1), repeat=len(w))  # one token's layer bits
        values = [
            int(sum(int(w[layer]) * token[layer] for token in combo for layer in range(len(w))))
            for combo in itertools.product(list(tokens), repeat=n)
        ]
        law = np.bincount(values) / len(values)
        mean = n * w.sum() / 2
        scores = np.arange(len(law))
        strict, equal = table.parts(scores, np.full(len(law), n))
        for s in scores:
            d = abs(s - mean)
            want_strict = law[np.abs(scores - mean) > d + 1e-9].sum()
            want_equal = law[np.abs(np.abs(scores - mean) - d) < 1e-9].sum()
            assert math.isclose(math.exp(strict[s]), want_strict, abs_tol=1e-12) or (
                want_strict == 0 and strict[s] < -600
            )
            assert math.isclose(math.exp(equal[s]), want_equal, rel_tol=1e-9, abs_tol=1e-299)


def test_unit_weights_give_the_unweighted_statistic_exactly() -> None:
    rng = np.random.default_rng(4)
    texts = [rng.integers(0, 49152, size=int(n)).tolist() for n in rng.integers(10, 200, size=20)]
    key = WatermarkKey(rng.bytes(32))
    scheme = WorldCup(key, CONFIG)
    for bits in (None, 32):
        ours = weighted_log_p_many(key, CONFIG, texts, bits, np.ones(CONFIG.layers, np.int64))
        ref = np.array([r.log10_p_value for r in scheme.detect_many(texts, bits)]) * math.log(10)
        np.testing.assert_allclose(ours, ref, atol=1e-9)


def test_null_p_values_are_uniform_under_many_keys() -> None:
    rng = np.random.default_rng(5)
    p = []
    for _ in range(150):
        key = WatermarkKey(rng.bytes(32))
        texts = [rng.integers(0, 49152, size=128).tolist() for _ in range(6)]
        texts.append(np.repeat(rng.integers(0, 40, size=16), 8).tolist())  # repeated contexts
        for bits in (None, 32):
            p.extend(np.exp(weighted_log_p_many(key, CONFIG, texts, bits)))
    p_arr = np.array(p)
    assert stats.kstest(p_arr, "uniform").pvalue > 1e-3
    assert np.mean(p_arr < 0.01) <= 0.01 + 4 * math.sqrt(0.01 / len(p_arr))


def test_more_power_than_unweighted_on_low_entropy_text() -> None:
    rng = np.random.default_rng(6)
    gains = []
    for _ in range(12):
        key = WatermarkKey(rng.bytes(32))
        scheme = WorldCup(key, CONFIG)
        seq = scheme.sequence(Payload.from_bits("".join(rng.choice(["0", "1"], 32))))
        for _ in range(128):  # peaked next-token laws, as cool sampling gives
            probs = rng.dirichlet(np.full(50, 0.05))
            cand = rng.choice(49000, 50, replace=False)
            seq.observe(int(cand[rng.choice(50, p=seq.reweight(cand, probs))]))
        ids = seq.generated
        for bits in (None, 32):
            unweighted = scheme.detect(ids, bits).log10_p_value * math.log(10)
            gains.append(unweighted - float(verdict_log_p(scheme, [ids], bits)[0]))
    assert np.median(gains) > 0 and np.mean(np.array(gains) > 0) >= 0.7, gains


def test_other_versions_keep_the_unweighted_statistic() -> None:
    rng = np.random.default_rng(7)
    texts = [rng.integers(0, 49152, size=100).tolist() for _ in range(5)]
    v1 = WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig(version="worldcup-v1"))
    ref = np.array([r.log10_p_value for r in v1.detect_many(texts, 16)]) * math.log(10)
    np.testing.assert_allclose(verdict_log_p(v1, texts, 16), ref)
    with pytest.raises(ValueError, match="worldcup-v2"):
        weighted_log_p_many(v1.key, v1.config, texts, 16)


def test_tilted_tail_is_the_direct_convolution_at_every_depth() -> None:
    """The registry test's tail (exponential tilting and an FFT) against the exact
    law by direct convolution, from the bulk to the last value (1e-200 and below)."""
    from worldcup_core.detector_weighted import weighted_upper_log_sf

    w = layer_weights(30)
    table = WeightedTable(w)
    checked = 0
    for n in (1, 3, 16, 60, 128):
        law = table._law(n)
        top = len(law) - 1
        for frac in (0.0, 0.4, 0.5, 0.52, 0.6, 0.75, 0.9, 1.0):
            a = round(frac * top)
            exact = float(law[a:].sum())
            got = weighted_upper_log_sf(w, n, a)
            if exact == 0.0:  # below the smallest double: the tilt still gives it
                assert got < math.log(1e-300), (n, a)
            else:
                assert math.isclose(got, math.log(exact), rel_tol=1e-9, abs_tol=1e-9), (n, a)
            checked += 1
    assert checked == 40
    assert weighted_upper_log_sf(w, 4, 4 * int(w.sum()) + 1) == -math.inf


def test_registry_entry_test_is_exact_on_null_text_and_stronger_on_watermarked_text() -> None:
    """The one verdict's registry test (layer-weighted agreement with the matched entry):
    on random text under 300 keys its p for a fixed entry is super-uniform (rate below
    each level within 4 SE, not dead, KS against uniform); on peaked watermarked text
    (as cool sampling gives) it is smaller than the unweighted binomial test's for most
    texts, Bonferroni factor alike."""
    from worldcup_core.decoder import match_registry
    from worldcup_core.detector_weighted import entry_log_p, registry_verdict_log_p

    rng = np.random.default_rng(11)
    p = []
    for _ in range(300):
        key = WatermarkKey(rng.bytes(32))
        bits = "".join(rng.choice(["0", "1"], 32))
        for _ in range(4):
            ids = rng.integers(0, 49152, size=int(rng.integers(16, 200))).tolist()
            p.append(math.exp(entry_log_p(key, CONFIG, ids, bits)))
    p_arr = np.array(p)
    for t in (0.1, 0.01, 1e-3):
        assert np.mean(p_arr < t) <= t + 4 * math.sqrt(t / len(p_arr)), t
    assert np.mean(p_arr < 0.1) >= 0.07
    assert stats.kstest(p_arr, "uniform").pvalue > 1e-3
    gains = []
    for _ in range(12):
        scheme = WorldCup(WatermarkKey(rng.bytes(32)), CONFIG)
        bits = "".join(rng.choice(["0", "1"], 32))
        seq = scheme.sequence(Payload.from_bits(bits))
        for _ in range(128):
            probs = rng.dirichlet(np.full(50, 0.05))
            cand = rng.choice(49000, 50, replace=False)
            seq.observe(int(cand[rng.choice(50, p=seq.reweight(cand, probs))]))
        ids = seq.generated
        plain = match_registry(scheme.config, scheme.evidence(ids), [bits], registry_size=20)
        weighted = registry_verdict_log_p(scheme, ids, bits, 20)
        assert plain is not None and weighted is not None
        gains.append(plain.log10_p_value * math.log(10) - weighted)
    assert np.median(gains) > 0 and np.mean(np.array(gains) > 0) >= 0.7, gains
