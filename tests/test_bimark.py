"""The BiMark baseline: reweighting against the reference, unbiasedness, generation and
decoding, configuration. What it shares with StealthInk (registry match, wrong key, the
model round trip, calibration, hygiene) is tested once for both in
test_count_cell_baselines.py."""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import pytest
from baselinelib import (
    generate_synthetic,
)

from worldcup_core.baselines import (
    BiMark,
    BiMarkConfig,
    bimark_reweight,
    extract_bimark_evidence,
)
from worldcup_core.baselines.bimark import BiMarkPRF
from worldcup_core.message import Payload
from worldcup_core.prf import WatermarkKey, context_at, pack_context, splitmix64

KEY = WatermarkKey(bytes(range(32)))
NUM_BITS = 16


def _key(label: str) -> WatermarkKey:
    return WatermarkKey(hashlib.sha256(f"bimark-test:{label}".encode()).digest())


# --- the reweighting itself ----------------------------------------------------


def _reference_reweight(
    probs: np.ndarray, in_v0: np.ndarray, ops: np.ndarray, base_delta: float
) -> np.ndarray:
    """A transcription of the reference ``WatermarkBimark.__call__`` (alpha = 1): per layer,
    ``delta = max(min(1/p0, 1 + delta~), 1) - 1``, ``beta = min(delta p0/(1 - p0), 1)``,
    V0 times ``1 + op*delta``, V1 times ``1 - op*beta``."""
    q = probs.copy()
    for layer, op in enumerate(ops):
        mask = in_v0[layer]
        p0 = float(np.sum(q * mask))
        if p0 < 1e-30 or 1 - p0 < 1e-30:
            continue
        delta = max(min(1.0 / p0, 1.0 + base_delta), 1.0) - 1.0
        beta = min(delta * p0 / (1.0 - p0), 1.0)
        q = np.where(mask, q * (1 + op * delta), q * (1 - op * beta))
    return q


def test_reweight_matches_reference_formula() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(2, 60))
        probs = rng.dirichlet(np.full(n, float(rng.choice([0.05, 0.5, 5.0]))))
        in_v0 = rng.random((10, n)) < 0.5
        up = rng.random(10) < 0.5
        ours = bimark_reweight(probs, in_v0, up, 1.0)
        ref = _reference_reweight(probs, in_v0, np.where(up, 1.0, -1.0), 1.0)
        assert np.allclose(ours, ref / ref.sum(), atol=1e-12)
        assert np.all(ours >= 0) and math.isclose(ours.sum(), 1.0)
        assert abs(ref.sum() - 1.0) < 1e-9  # each layer keeps the mass


@pytest.mark.parametrize("seed", range(6))
def test_reweight_is_exactly_unbiased_over_flips(seed: int) -> None:
    """E over all 2^d flip vectors (c XOR b is uniform for either bit) of q equals p."""
    rng = np.random.default_rng(seed)
    n = [3, 5, 8, 20, 2, 40][seed]
    probs = rng.dirichlet(np.full(n, 0.3))
    in_v0 = rng.random((10, n)) < 0.5
    total = np.zeros(n)
    for flips in itertools.product((False, True), repeat=10):
        total += bimark_reweight(probs, in_v0, np.array(flips), 1.0)
    mean = total / 2**10
    assert np.abs(mean - probs).max() < 1e-12
    # ... while a single flip pattern does move the distribution
    q = bimark_reweight(probs, in_v0, np.ones(10, dtype=bool), 1.0)
    assert np.abs(q - probs).max() > 1e-3 or n == 2


# --- generation, decoding, registry --------------------------------------------


def _reference_votes(key: WatermarkKey, tokens: list[int], num_bits: int) -> np.ndarray:
    """BiMark's COUNTS[bit][vote], computed from the definitions (not the module)."""
    secret = key.subkey("bimark")
    part = []
    for layer in range(10):
        d = hashlib.blake2b(b"\x01" + layer.to_bytes(4, "little"), key=secret, digest_size=16)
        part.append(int.from_bytes(d.digest()[:8], "little"))
    counts = np.zeros((num_bits, 2), dtype=np.int64)
    seen: set[tuple[int, ...]] = set()
    for t, tok in enumerate(tokens):
        ctx = context_at(tokens, t, 2)
        if ctx in seen:
            continue
        seen.add(ctx)
        digest = hashlib.blake2b(b"\x00" + pack_context(ctx), key=secret, digest_size=16).digest()
        seed = int.from_bytes(digest[:8], "little")
        bit_idx = int.from_bytes(digest[8:], "little") % num_bits
        for layer in range(10):
            c = int(splitmix64(seed, np.array([layer]))[0] >> np.uint64(63))
            in_v0 = int(splitmix64(part[layer], np.array([tok]))[0] >> np.uint64(63))
            counts[bit_idx, in_v0 ^ c] += 1
    return counts


def test_decoder_matches_reference_counting() -> None:
    rng = np.random.default_rng(4)
    bimark = BiMark(KEY)
    tokens = generate_synthetic(bimark, Payload.random(NUM_BITS, rng), 60, rng)
    tokens += tokens[:10]  # repeated contexts must be skipped on both sides
    counts = _reference_votes(KEY, tokens, NUM_BITS)
    result = bimark.decode(tokens, num_bits=NUM_BITS)
    expected = "".join("?" if c.sum() == 0 else ("1" if c[1] > c[0] else "0") for c in counts)
    assert result.bits == expected
    assert result.position_token_counts == tuple(counts.sum(axis=1) // 10)
    total = counts.sum()
    native = (counts.max(axis=1).sum() - 0.5 * total) / math.sqrt(total * 0.25)
    assert result.detection.paper_z_score == pytest.approx(native)
    assert result.detection.num_scored_tokens * 10 == total


def test_repeated_context_is_not_reweighted() -> None:
    seq = BiMark(KEY).sequence(Payload("1"))
    for tok in (5, 6, 5, 6):
        seq.observe(tok)
    probs = np.full(100, 0.01)
    assert seq.reweight(np.arange(100), probs) is probs  # context (5, 6) seen before
    seq.observe(7)
    assert not np.allclose(seq.reweight(np.arange(100), probs), probs)  # (6, 7) is new
    ev = extract_bimark_evidence(BiMarkPRF(KEY, 10), BiMarkConfig(), [5, 6, 5, 6, 7])
    assert ev.num_scored == 4


# --- configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gamma": 0.25},
        {"layers": 0},
        {"layers": 65},
        {"base_delta": -0.1},
        {"base_delta": 1.5},
        {"base_delta": math.nan},
        {"context_width": 0},
        {"context_width": 9},
    ],
)
def test_bad_config_raises(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BiMarkConfig(**kwargs)  # type: ignore[arg-type]
