"""The sign-consistency test of worldcup_eval.sign_study: exact given the magnitudes.

Its p-values are claimed exact under H0 (fair signs given the magnitudes, whatever
they are), so they are checked against brute force on small cells and for calibration
on many null cells and texts, including cells whose magnitudes are all large (the
spoof's artifact), where the message-free statistic's evidence would be."""

from __future__ import annotations

import itertools

import numpy as np
from scipy import stats

from worldcup_core import WatermarkConfig, WatermarkKey
from worldcup_eval.sign_study import cell_sign_p, sign_log_p


def _brute(signed: list[int], uniform: float) -> float:
    a = [abs(d) for d in signed if d]
    dev = abs(sum(signed))
    strict = equal = 0.0
    for signs in itertools.product((-1, 1), repeat=len(a)):
        s = abs(sum(x * y for x, y in zip(signs, a, strict=True)))
        strict += (s > dev) / 2 ** len(a)
        equal += (s == dev) / 2 ** len(a)
    return min(1.0, strict + uniform * equal)


def test_cell_p_is_the_brute_force_sign_flip_p() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        signed = (rng.integers(1, 40, n) * rng.choice([-1, 1], n)).tolist()
        u = float(rng.random())
        assert abs(cell_sign_p(signed, u) - _brute(signed, u)) < 1e-12
    assert cell_sign_p([0, 0], 0.3) == 1.0


def test_cell_p_is_uniform_under_fair_signs_even_for_extreme_magnitudes() -> None:
    rng = np.random.default_rng(2)
    ps = []
    for _ in range(4000):
        n = int(rng.integers(1, 7))
        mags = rng.integers(60, 120, n)  # every token far from chance: the artifact
        ps.append(cell_sign_p((mags * rng.choice([-1, 1], n)).tolist(), float(rng.random())))
    assert stats.kstest(ps, "uniform").pvalue > 1e-3
    # agreeing signs are evidence
    assert cell_sign_p([50, 60, 70, 80, 90], 0.5) < 0.07


def test_text_p_is_calibrated_on_null_text() -> None:
    config = WatermarkConfig()
    key = WatermarkKey(bytes(range(32)))
    rng = np.random.default_rng(3)
    texts = [rng.integers(0, 49_000, 120).tolist() for _ in range(300)]
    weights = [rng.random(120) for _ in texts]
    log_p = sign_log_p(key, config, texts, weights, rng)
    p = np.exp(log_p)
    # 300 texts: P(p < 0.1) near 0.1 (binomial, 4 SE), and uniform overall
    assert abs(np.mean(p < 0.1) - 0.1) < 4 * np.sqrt(0.09 / 300)
    assert stats.kstest(p, "uniform").pvalue > 1e-3
