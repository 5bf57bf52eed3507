"""The BiMark baseline: reweighting against the reference, unbiasedness, round trip,
calibration on random and human text, wrong key, registry match."""

from __future__ import annotations

import hashlib
import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from baselinelib import (
    VOCAB,
    assert_fpr_at_most_nominal,
    assert_fpr_nominal,
    chi_square_against,
    generate_synthetic,
    human_chunks,
    model_round_trip,
    random_texts,
)
from scipy import stats

from worldcup_core.baselines import (
    BASELINES,
    MPAC,
    BiMark,
    BiMarkConfig,
    bimark_reweight,
    build_baseline,
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


P = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
CANDIDATES = np.array([3, 17, 52, 99, 140, 201], dtype=np.int64)


def _key_averaged(scheme: str, keys: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Over ``keys`` random keys (each with a random context and payload): the mean
    next-token distribution q, and one token drawn from q per key."""
    rng = np.random.default_rng(seed)
    qs = np.empty((keys, len(P)))
    for i in range(keys):
        key = WatermarkKey(rng.bytes(32))
        payload = Payload.random(8, rng)
        if scheme == "bimark":
            seq: Any = BiMark(key).sequence(payload)
        else:
            seq = MPAC(key).sequence(payload)
        for tok in rng.integers(1000, VOCAB, size=2):
            seq.observe(int(tok))
        if scheme == "bimark":
            qs[i] = seq.reweight(CANDIDATES, P)
        else:  # KGW-style: +delta on the green logits of these candidates
            logits = np.full(300, -np.inf)
            logits[CANDIDATES] = np.log(P)
            biased = seq.process_logits(logits)[CANDIDATES]
            qs[i] = np.exp(biased - biased.max()) / np.exp(biased - biased.max()).sum()
    cdf = np.cumsum(qs, axis=1)
    draws = (rng.random(keys)[:, None] > cdf).sum(axis=1)
    return qs, np.bincount(np.minimum(draws, len(P) - 1), minlength=len(P))


KEYS = 20000


def test_real_keys_average_to_the_model_distribution() -> None:
    """Distortion-free as the paper defines it: E_key[q] = p, tested two ways."""
    qs, counts = _key_averaged("bimark", KEYS, seed=11)
    z = (qs.mean(axis=0) - P) / (qs.std(axis=0, ddof=1) / math.sqrt(KEYS))
    assert np.abs(z).max() < 4.0, z
    assert chi_square_against(counts, P) > 1e-3
    assert qs.std(axis=0).max() > 0.05  # each key does move the distribution


def test_the_same_tests_reject_a_distortionary_scheme() -> None:
    """Power: at the same sample size MPAC (delta = 2 on the green logits) is rejected."""
    qs, counts = _key_averaged("mpac", KEYS, seed=12)
    z = (qs.mean(axis=0) - P) / (qs.std(axis=0, ddof=1) / math.sqrt(KEYS))
    assert np.abs(z).max() > 8.0, z
    assert chi_square_against(counts, P) < 1e-6


# --- generation, decoding, registry --------------------------------------------


def test_scheme_identity_and_registry() -> None:
    assert BASELINES["bimark"] is BiMark
    bimark = build_baseline("bimark", KEY)
    assert isinstance(bimark, BiMark)
    assert (bimark.name, bimark.version) == ("bimark", "bimark-v1")
    seq = bimark.sequence(Payload("0101"))
    assert not seq.modifies_logits
    logits = np.zeros(5)
    assert seq.process_logits(logits) is logits


def test_generation_recovers_payload() -> None:
    rng = np.random.default_rng(3)
    bimark = BiMark(KEY)
    accuracies = []
    for _ in range(20):
        payload = Payload.random(NUM_BITS, rng)
        tokens = generate_synthetic(bimark, payload, 200, rng)
        result = bimark.decode(tokens, num_bits=NUM_BITS)
        accuracies.append(np.mean([a == b for a, b in zip(result.bits, payload.bits, strict=True)]))
        assert result.detection.p_value < 1e-6
        assert bimark.detect(tokens).p_value < 1e-6  # payload length unknown
        assert result.alternatives[0].bits == result.bits
    assert np.mean(accuracies) >= 0.9, accuracies


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


def test_registry_match_finds_true_message() -> None:
    rng = np.random.default_rng(7)
    bimark = BiMark(KEY)
    payload = Payload.random(NUM_BITS, rng)
    tokens = generate_synthetic(bimark, payload, 200, rng)
    others: set[str] = set()
    while len(others) < 499:
        cand = Payload.random(NUM_BITS, rng).bits
        if cand != payload.bits:
            others.add(cand)
    candidates = sorted(others)
    candidates.insert(137, payload.bits)
    match = bimark.match(tokens, candidates)
    assert match is not None
    assert (match.index, match.bits) == (137, payload.bits)
    assert match.p_value < 1e-6 and match.posterior > 0.99
    assert bimark.match(tokens, []) is None


def test_wrong_key_sees_nothing() -> None:
    """Texts watermarked under one key are null text to another key."""
    rng = np.random.default_rng(8)
    owner, other = BiMark(_key("owner")), BiMark(_key("other"))
    p_own, p_other = [], []
    for _ in range(60):
        tokens = generate_synthetic(owner, Payload.random(NUM_BITS, rng), 128, rng)
        p_own.append(owner.detect(tokens, num_bits=NUM_BITS).p_value)
        p_other.append(other.detect(tokens, num_bits=NUM_BITS).p_value)
    assert max(p_own) < 1e-6
    assert stats.kstest(p_other, "uniform").pvalue > 1e-3
    assert np.mean(np.array(p_other) < 0.05) <= 0.15


@pytest.mark.model
def test_round_trip_on_the_embedded_model(data_dir: Path) -> None:
    """SmolLM2 generates (top-k 50, top-p 0.95), the text is detokenised and re-tokenised:
    the payload comes back, and another key sees chance bits and no watermark."""
    from worldcup_core.models import load_model

    bimark = BiMark(KEY)
    payloads, texts = model_round_trip(bimark, load_model(), data_dir, prompts=4)
    accuracies, p_values, wrong_p = [], [], []
    wrong = BiMark(_key("wrong"))
    correct = 0
    for payload, ids in zip(payloads, texts, strict=True):
        decoded = bimark.decode(ids, NUM_BITS)
        accuracies.append(
            np.mean([a == b for a, b in zip(decoded.bits, payload.bits, strict=True)])
        )
        p_values.append(decoded.detection.p_value)
        other = wrong.decode(ids, NUM_BITS)
        correct += sum(a == b for a, b in zip(other.bits, payload.bits, strict=True))
        wrong_p.append(other.detection.p_value)
    assert np.mean(accuracies) >= 0.9, accuracies
    assert max(p_values) < 1e-6, p_values
    assert stats.binomtest(correct, NUM_BITS * len(texts), 0.5).pvalue > 1e-3
    assert min(wrong_p) > 1e-3, wrong_p


# --- calibration under H0 -----------------------------------------------------


@pytest.fixture(scope="module")
def random_detections() -> list[Any]:
    bimark = BiMark(_key("random"))
    return [bimark.detect(t, num_bits=NUM_BITS) for t in random_texts(20250601, 3000)]


def test_random_text_pvalues_are_calibrated(random_detections: list[Any]) -> None:
    p = np.array([d.p_value for d in random_detections])
    assert_fpr_nominal(p, "random texts")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    assert stats.kstest(p[-400:], "uniform").pvalue > 1e-3  # 8-id texts, repeated contexts
    scored = np.array([d.num_scored_tokens for d in random_detections[-400:]])
    assert scored.max() <= 1 + 8 + 64  # (pad, pad), (pad, x) and 64 pairs: repeats skipped


def test_native_z_is_not_calibrated(random_detections: list[Any]) -> None:
    """The reference's z on majority counts: E[z] ~ sqrt(2b/pi) under H0, not 0."""
    z = np.array([d.paper_z_score for d in random_detections])
    assert z.mean() > 2.0
    assert np.mean(z > stats.norm.isf(0.01)) > 0.2  # a nominal 1% test rejects > 20%


def test_unknown_length_scan_is_conservative() -> None:
    bimark = BiMark(_key("scan"))
    p = np.array([bimark.detect(t).p_value for t in random_texts(7, 600, small_vocab=100)])
    assert_fpr_at_most_nominal(p, "random texts, length unknown")
    assert np.mean(p < 0.05) <= 0.05 + 4 * math.sqrt(0.05 / len(p))


@pytest.fixture(scope="module")
def human(data_dir: Path, smollm2_tokenizer: Any) -> list[list[int]]:
    return human_chunks(data_dir, smollm2_tokenizer)


def test_human_text_pvalues_are_calibrated(human: list[list[int]]) -> None:
    assert len(human) >= 1000
    p_values: list[float] = []
    native: list[float] = []
    for i in range(3):
        bimark = BiMark(_key(f"human-{i}"))
        for chunk in human:
            det = bimark.detect(chunk, num_bits=NUM_BITS)
            p_values.append(det.p_value)
            native.append(det.paper_z_score)
    p = np.array(p_values)
    assert_fpr_nominal(p, "human text, 3 keys")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    assert np.mean(np.array(native) > stats.norm.isf(0.01)) > 0.2  # native z: not calibrated


def test_null_decoded_bits_are_coin_flips() -> None:
    bimark = BiMark(_key("decode"))
    payload = "1010010110100101"
    correct = total = 0
    for tokens in random_texts(99, 300, small_vocab=0):
        bits = bimark.decode(tokens, NUM_BITS).bits
        pairs = [(b, t) for b, t in zip(bits, payload, strict=True) if b != "?"]
        correct += sum(b == t for b, t in pairs)
        total += len(pairs)
    assert stats.binomtest(correct, total, 0.5).pvalue > 1e-3


# --- hygiene -------------------------------------------------------------------


def test_repr_hides_key() -> None:
    key = WatermarkKey.generate()
    bimark = BiMark(key)
    seq = bimark.sequence(Payload("01"))
    for text in (repr(bimark), str(bimark), repr(seq), repr(BiMarkPRF(key, 2))):
        assert key.hex() not in text
    assert key.key_id in repr(bimark)


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


def test_degenerate_inputs() -> None:
    """Nothing to score, one candidate: no error, no watermark, nothing changed."""
    bimark = BiMark(KEY)
    assert bimark.detect([]).p_value == 1.0
    assert bimark.decode([], NUM_BITS).bits == "?" * NUM_BITS
    assert bimark.match([], ["0101"]) is None
    seq = bimark.sequence(Payload("01"))
    assert seq.reweight(np.array([3]), np.array([1.0])).tolist() == [1.0]
