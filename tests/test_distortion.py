"""Is WorldCup distortion-free? E over keys of P(x) = p(x), tested for both presets.

SynthID's definition (the paper's appendix on distortionary and non-distortionary
g-value functions): a sampler is non-distortionary if, averaged over uniformly
random keys, it draws each token with its model probability. A 2-leaf tournament
layer is, for any i.i.d. g (E_g[q(1 + g - E_q g)] = q); so WorldCup's
``nondistortionary`` preset, which averages the k groups' tournaments with no
subtraction, is exactly non-distortionary. The default subtracts
``alpha * tanh(H)`` times the complementary families and clips, which is not.

Two checks: the exact expectation, enumerating every g-bit assignment on tiny
configurations; and a Monte-Carlo average over many real ``worldcup-v2`` keys
through the batched step, with a chi-square-style test that has power (it must
reject the default).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from worldcup_core import Payload, Variant, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.batched import BatchedWorldCup
from worldcup_core.encoder import lambda_for
from worldcup_core.tournament import tournament_distribution

P = np.array([0.45, 0.3, 0.15, 0.1])


def exact_expectation(probs: np.ndarray, groups: int, layers: int, variant: Variant) -> np.ndarray:
    """E over every assignment of the intended g-bits (k x m x n, uniform) of q."""
    n = probs.shape[0]
    bits = np.array(list(itertools.product((0, 1), repeat=groups * layers * n)), dtype=np.uint8)
    intended = bits.reshape(-1, groups, layers, n)
    families = np.concatenate([intended, 1 - intended], axis=1)  # complementary second family
    q = tournament_distribution(probs, families)  # (A, 2k, n)
    q_int, q_other = q[:, :groups].sum(axis=1), q[:, groups:].sum(axis=1)
    lam = lambda_for(WatermarkConfig(groups=groups, layers=layers, variant=variant), probs)
    scores = np.clip(q_int - lam * q_other, 0.0, None)
    total = scores.sum(axis=1, keepdims=True)
    fallback = q_int / q_int.sum(axis=1, keepdims=True)
    out = np.where(total > 0, scores / np.where(total > 0, total, 1.0), fallback)
    return out.mean(axis=0)


@pytest.mark.parametrize(("groups", "layers", "n"), [(1, 2, 4), (1, 4, 3), (2, 2, 3), (2, 3, 2)])
def test_nondistortionary_preset_is_exactly_unbiased(groups: int, layers: int, n: int) -> None:
    probs = P[:n] / P[:n].sum()
    mean = exact_expectation(probs, groups, layers, Variant.NONDISTORTIONARY)
    assert np.abs(mean - probs).max() < 1e-12


@pytest.mark.parametrize(("groups", "layers", "n"), [(1, 2, 4), (1, 4, 3), (2, 2, 3), (2, 3, 2)])
def test_default_worldcup_is_distortionary(groups: int, layers: int, n: int) -> None:
    """How far the default is from p, exactly: the total variation distance."""
    probs = P[:n] / P[:n].sum()
    mean = exact_expectation(probs, groups, layers, Variant.WORLDCUP)
    tv = 0.5 * float(np.abs(mean - probs).sum())
    assert tv > 5e-3, tv  # measurably biased
    # ... away from the likeliest token: subtracting the complementary family and clipping
    # flattens the distribution (mass moves to unlikely tokens: the perplexity cost)
    assert mean[0] < probs[0] and mean[-1] > probs[-1]


def monte_carlo_mean(variant: Variant, keys: int, seed: int) -> np.ndarray:
    """Mean of q over ``keys`` random worldcup-v2 keys (one context each), batched step."""
    rng = np.random.default_rng(seed)
    cand = torch.arange(100, 100 + len(P), dtype=torch.int64)
    out = np.zeros(len(P))
    chunk = 2048
    for start in range(0, keys, chunk):
        rows = min(chunk, keys - start)
        step = BatchedWorldCup(capacity=rows)
        config = WatermarkConfig(variant=variant)  # k = 2, m = 30, alpha 1.2, v2
        for slot in range(rows):
            step.set_row(slot, WorldCup(WatermarkKey(rng.bytes(32)), config), Payload("10"))
        slots = list(range(rows))
        for _ in range(2):  # a random context of c = 2 tokens per row
            step.append(slots, torch.from_numpy(rng.integers(1000, 50_000, rows)))
        probs = torch.from_numpy(np.tile(P, (rows, 1)))
        q = step.step(slots, cand.expand(rows, -1), probs).numpy()
        out += q.sum(axis=0)
    return out / keys


def z_scores_against_p(mean: np.ndarray, keys: int) -> np.ndarray:
    """Per token: how far the key-average is from p in standard errors of a q(x) that
    lies in [0, 1] (variance at most p(1-p)), a conservative scale."""
    return (mean - P) / np.sqrt(P * (1 - P) / keys)


def test_real_keys_nondistortionary_average_to_p() -> None:
    keys = 8192
    z = z_scores_against_p(monte_carlo_mean(Variant.NONDISTORTIONARY, keys, seed=1), keys)
    assert np.abs(z).max() < 4.0, z


def test_real_keys_detect_the_default_distortion() -> None:
    """The same test rejects the default WorldCup: it has power."""
    keys = 8192
    z = z_scores_against_p(monte_carlo_mean(Variant.WORLDCUP, keys, seed=2), keys)
    assert np.abs(z).max() > 6.0, z
