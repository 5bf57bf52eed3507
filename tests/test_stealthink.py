"""The StealthInk baseline: reweighting against the reference, unbiasedness, generation and
decoding, configuration. What it shares with BiMark (registry match, wrong key, the
model round trip, calibration, hygiene) is tested once for both in
test_count_cell_baselines.py."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
from baselinelib import (
    VOCAB,
    generate_synthetic,
)
from scipy import stats

from worldcup_core.baselines import (
    StealthInk,
    StealthInkConfig,
    extract_stealthink_evidence,
    stealthink_reweight,
)
from worldcup_core.baselines.stealthink import StealthInkPRF
from worldcup_core.message import Payload
from worldcup_core.prf import WatermarkKey, context_at, pack_context, splitmix64

KEY = WatermarkKey(bytes(range(32)))
NUM_BITS = 16
TOP = np.uint64(63)


def _key(label: str) -> WatermarkKey:
    return WatermarkKey(hashlib.sha256(f"stealthink-test:{label}".encode()).digest())


# --- the reweighting itself ----------------------------------------------------


def _reference_map(acc: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """A transcription of the reference ``ReweightProcessor.reweight``: the piecewise
    linear map of the cumulative probabilities ``acc = [0, cdf]``, four cases."""
    if alpha >= 0.5 or beta <= 0.5:
        if alpha >= 0.5:  # 2p p 0
            a, b, c, d = 1 - beta, 1 - alpha, alpha, beta
            return np.where(
                acc <= a,
                acc - d,
                np.where(
                    acc <= b,
                    2 * acc - 1,
                    np.where(acc <= c, acc - c, np.where(acc <= d, 0.0, acc - d)),
                ),
            )
        a, b, c, d = alpha, beta, 1 - beta, 1 - alpha  # 0 p 2p
        return np.where(
            acc <= a,
            acc - a,
            np.where(
                acc <= b, 0.0, np.where(acc <= c, acc - b, np.where(acc <= d, 2 * acc - 1, acc - a))
            ),
        )
    if alpha <= 1 - beta <= beta <= 1 - alpha:  # alpha + beta < 1
        a, b, c, d = alpha, 1 - beta, beta, 1 - alpha
        return np.where(
            acc <= a,
            acc - a,
            np.where(
                acc <= b, 0.0, np.where(acc <= c, acc - b, np.where(acc <= d, 2 * acc - 1, acc - a))
            ),
        )
    a, b, c, d = 1 - beta, alpha, 1 - alpha, beta  # alpha + beta > 1
    return np.where(
        acc <= a,
        acc - d,
        np.where(
            acc <= b, 2 * acc - 1, np.where(acc <= c, acc - c, np.where(acc <= d, 0.0, acc - d))
        ),
    )


def _reference_reweight(probs: np.ndarray, words: np.ndarray, bit: int) -> np.ndarray:
    """The reference's reweighting with our permutation: tokens in ``h`` order, colour 0
    first; the red list (colour ``bit``) spans ``[alpha, beta]`` of the permuted cdf."""
    order = np.argsort(words, kind="stable")
    cdf = np.cumsum(probs[order])
    n0 = int(np.count_nonzero((words >> TOP) == 0))
    boundary = float(cdf[n0 - 1]) if n0 else 0.0
    alpha, beta = (0.0, boundary) if bit == 0 else (boundary, float(cdf[-1]))
    mapped = _reference_map(np.concatenate([[0.0], cdf]), alpha, beta)
    out = np.empty_like(probs)
    out[order] = np.diff(mapped)
    return out


def _branch(probs: np.ndarray, words: np.ndarray, bit: int) -> str:
    """Which of the reference's four cases a reweighting falls in."""
    p0 = float(probs[(words >> TOP) == 0].sum())
    alpha, beta = (0.0, p0) if bit == 0 else (p0, 1.0)
    if alpha >= 0.5:
        return "2p p 0"
    if beta <= 0.5:
        return "0 p 2p"
    return "overlap, alpha+beta<1" if alpha + beta < 1 else "overlap, alpha+beta>1"


def test_reweight_matches_reference_formula() -> None:
    rng = np.random.default_rng(1)
    branches: dict[str, int] = {}
    for _ in range(400):
        n = int(rng.integers(2, 60))
        probs = rng.dirichlet(np.full(n, float(rng.choice([0.05, 0.5, 5.0]))))
        words = splitmix64(int(rng.integers(0, 2**63)), rng.choice(VOCAB, n, replace=False))
        bit = int(rng.integers(0, 2))
        ours = stealthink_reweight(probs, words, bit)
        assert np.allclose(ours, _reference_reweight(probs, words, bit), atol=1e-12)
        assert np.all(ours >= 0) and math.isclose(ours.sum(), 1.0)
        red = (words >> TOP) == bit
        assert np.all(ours[red] <= probs[red] + 1e-15)  # red tokens only lose mass
        branch = _branch(probs, words, bit)
        branches[branch] = branches.get(branch, 0) + 1
    assert len(branches) == 4 and min(branches.values()) > 20, branches


@pytest.mark.parametrize(("n", "seed"), [(2, 0), (3, 1), (4, 2), (5, 3), (5, 4)])
def test_reweight_is_exactly_unbiased_over_permutations(n: int, seed: int) -> None:
    """E over every order and colouring (i.i.d. keyed words) of q equals p, either bit."""
    probs = np.random.default_rng(seed).dirichlet(np.full(n, 0.4))
    for bit in (0, 1):
        total, count = np.zeros(n), 0
        for perm in itertools.permutations(range(n)):
            for colours in itertools.product((0, 1), repeat=n):
                words = np.array(
                    [(c << 63) | r for c, r in zip(colours, perm, strict=True)], dtype=np.uint64
                )
                total += stealthink_reweight(probs, words, bit)
                count += 1
        assert np.abs(total / count - probs).max() < 1e-12
    words = np.array([(i % 2) << 63 | i for i in range(n)], dtype=np.uint64)
    assert np.abs(stealthink_reweight(probs, words, 0) - probs).max() > 1e-3  # one key moves p


# --- generation, decoding, registry --------------------------------------------


def _reference_counts(key: WatermarkKey, tokens: list[int], num_bits: int) -> np.ndarray:
    """StealthInk's cl_total[position][colour], computed from the definitions."""
    secret = key.subkey("stealthink")
    counts = np.zeros((num_bits, 2), dtype=np.int64)
    seen: set[tuple[int, ...]] = set()
    for t, tok in enumerate(tokens):
        ctx = context_at(tokens, t, 2)
        if ctx in seen:
            continue
        seen.add(ctx)
        digest = hashlib.blake2b(b"\x00" + pack_context(ctx), key=secret, digest_size=16).digest()
        seed = int.from_bytes(digest[:8], "little")
        position = int.from_bytes(digest[8:], "little") % num_bits
        counts[position, int(splitmix64(seed, np.array([tok]))[0] >> TOP)] += 1
    return counts


def test_decoder_matches_reference_counting() -> None:
    """Least frequent colour per position, as the reference decodes; its native score."""
    rng = np.random.default_rng(4)
    stealthink = StealthInk(KEY)
    tokens = generate_synthetic(stealthink, Payload.random(NUM_BITS, rng), 60, rng)
    tokens += tokens[:10]  # repeated contexts must be skipped on both sides
    counts = _reference_counts(KEY, tokens, NUM_BITS)
    result = stealthink.decode(tokens, num_bits=NUM_BITS)
    expected = "".join("?" if c.sum() == 0 else ("1" if c[1] < c[0] else "0") for c in counts)
    assert result.bits == expected
    assert result.position_token_counts == tuple(counts.sum(axis=1))
    total = counts.sum()
    reference_p = stats.norm.cdf((counts.min(axis=1).sum() - 0.5 * total) / math.sqrt(total / 4))
    assert stats.norm.sf(result.detection.paper_z_score) == pytest.approx(reference_p)
    assert result.detection.num_scored_tokens == total


def test_repeated_context_is_not_reweighted() -> None:
    seq = StealthInk(KEY).sequence(Payload("1"))
    for tok in (5, 6, 5, 6):
        seq.observe(tok)
    probs = np.full(100, 0.01)
    assert seq.reweight(np.arange(100), probs) is probs  # context (5, 6) seen before
    seq.observe(7)
    assert not np.allclose(seq.reweight(np.arange(100), probs), probs)  # (6, 7) is new
    ev = extract_stealthink_evidence(StealthInkPRF(KEY), StealthInkConfig(), [5, 6, 5, 6, 7])
    assert ev.num_scored == 4


# --- configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"chunk_bits": 2}, {"chunk_bits": 0}, {"context_width": 0}, {"context_width": 9}],
)
def test_bad_config_raises(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        StealthInkConfig(**kwargs)  # type: ignore[arg-type]
