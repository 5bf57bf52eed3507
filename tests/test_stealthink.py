"""The StealthInk baseline: reweighting against the reference, unbiasedness, round trip,
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
    StealthInk,
    StealthInkConfig,
    build_baseline,
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


P = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
CANDIDATES = np.array([3, 17, 52, 99, 140, 201], dtype=np.int64)
KEYS = 20000


def _key_averaged(scheme: str, keys: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Over ``keys`` random keys (each with a random context and payload): every key's
    next-token distribution q, and the counts of one token drawn from q per key."""
    rng = np.random.default_rng(seed)
    qs = np.empty((keys, len(P)))
    for i in range(keys):
        key = WatermarkKey(rng.bytes(32))
        payload = Payload.random(8, rng)
        seq: Any = StealthInk(key).sequence(payload) if scheme == "stealthink" else None
        if seq is None:
            seq = MPAC(key).sequence(payload)
        for tok in rng.integers(1000, VOCAB, size=2):
            seq.observe(int(tok))
        if scheme == "stealthink":
            qs[i] = seq.reweight(CANDIDATES, P)
        else:
            logits = np.full(300, -np.inf)
            logits[CANDIDATES] = np.log(P)
            biased = seq.process_logits(logits)[CANDIDATES]
            qs[i] = np.exp(biased - biased.max()) / np.exp(biased - biased.max()).sum()
    cdf = np.cumsum(qs, axis=1)
    draws = (rng.random(keys)[:, None] > cdf).sum(axis=1)
    return qs, np.bincount(np.minimum(draws, len(P) - 1), minlength=len(P))


def test_real_keys_average_to_the_model_distribution() -> None:
    """Distortion-free as the paper defines it: E_key[q] = p, tested two ways."""
    qs, counts = _key_averaged("stealthink", KEYS, seed=11)
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
    assert BASELINES["stealthink"] is StealthInk
    stealthink = build_baseline("stealthink", KEY)
    assert isinstance(stealthink, StealthInk)
    assert (stealthink.name, stealthink.version) == ("stealthink", "stealthink-v1")
    seq = stealthink.sequence(Payload("0101"))
    assert not seq.modifies_logits
    logits = np.zeros(5)
    assert seq.process_logits(logits) is logits


def test_generation_recovers_payload() -> None:
    rng = np.random.default_rng(3)
    stealthink = StealthInk(KEY)
    accuracies = []
    for _ in range(20):
        payload = Payload.random(NUM_BITS, rng)
        tokens = generate_synthetic(stealthink, payload, 200, rng)
        result = stealthink.decode(tokens, num_bits=NUM_BITS)
        accuracies.append(np.mean([a == b for a, b in zip(result.bits, payload.bits, strict=True)]))
        assert result.detection.p_value < 1e-6
        assert stealthink.detect(tokens).p_value < 1e-6  # payload length unknown
        assert result.alternatives[0].bits == result.bits
    assert np.mean(accuracies) >= 0.9, accuracies


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


def test_registry_match_finds_true_message() -> None:
    rng = np.random.default_rng(7)
    stealthink = StealthInk(KEY)
    payload = Payload.random(NUM_BITS, rng)
    tokens = generate_synthetic(stealthink, payload, 200, rng)
    others: set[str] = set()
    while len(others) < 499:
        cand = Payload.random(NUM_BITS, rng).bits
        if cand != payload.bits:
            others.add(cand)
    candidates = sorted(others)
    candidates.insert(137, payload.bits)
    match = stealthink.match(tokens, candidates)
    assert match is not None
    assert (match.index, match.bits) == (137, payload.bits)
    assert match.p_value < 1e-6 and match.posterior > 0.99
    assert stealthink.match(tokens, []) is None


def test_wrong_key_sees_nothing() -> None:
    """Texts watermarked under one key are null text to another key."""
    rng = np.random.default_rng(8)
    owner, other = StealthInk(_key("owner")), StealthInk(_key("other"))
    p_own, p_other = [], []
    for _ in range(60):
        tokens = generate_synthetic(owner, Payload.random(NUM_BITS, rng), 128, rng)
        p_own.append(owner.detect(tokens, num_bits=NUM_BITS).p_value)
        p_other.append(other.detect(tokens, num_bits=NUM_BITS).p_value)
    assert max(p_own) < 1e-4
    assert stats.kstest(p_other, "uniform").pvalue > 1e-3
    assert np.mean(np.array(p_other) < 0.05) <= 0.15


@pytest.mark.model
def test_round_trip_on_the_embedded_model(data_dir: Path) -> None:
    """SmolLM2 generates (top-k 50, top-p 0.95), the text is detokenised and re-tokenised:
    the payload comes back, and another key sees chance bits and no watermark."""
    from worldcup_core.models import load_model

    stealthink = StealthInk(KEY)
    payloads, texts = model_round_trip(stealthink, load_model(), data_dir, prompts=4)
    accuracies, p_values, wrong_p = [], [], []
    wrong = StealthInk(_key("wrong"))
    correct = 0
    for payload, ids in zip(payloads, texts, strict=True):
        decoded = stealthink.decode(ids, NUM_BITS)
        accuracies.append(
            np.mean([a == b for a, b in zip(decoded.bits, payload.bits, strict=True)])
        )
        p_values.append(decoded.detection.p_value)
        other = wrong.decode(ids, NUM_BITS)
        correct += sum(a == b for a, b in zip(other.bits, payload.bits, strict=True))
        wrong_p.append(other.detection.p_value)
    assert np.mean(accuracies) >= 0.85, accuracies
    assert float(np.median(p_values)) < 1e-3, p_values
    assert stats.binomtest(correct, NUM_BITS * len(texts), 0.5).pvalue > 1e-3
    assert min(wrong_p) > 1e-3, wrong_p


# --- calibration under H0 -----------------------------------------------------


@pytest.fixture(scope="module")
def random_detections() -> list[Any]:
    stealthink = StealthInk(_key("random"))
    return [stealthink.detect(t, num_bits=NUM_BITS) for t in random_texts(20250602, 3000)]


def test_random_text_pvalues_are_calibrated(random_detections: list[Any]) -> None:
    p = np.array([d.p_value for d in random_detections])
    assert_fpr_nominal(p, "random texts")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    assert stats.kstest(p[-400:], "uniform").pvalue > 1e-3  # 8-id texts, repeated contexts
    scored = np.array([d.num_scored_tokens for d in random_detections[-400:]])
    assert scored.max() <= 1 + 8 + 64  # (pad, pad), (pad, x) and 64 pairs: repeats skipped


def test_native_score_is_not_calibrated(random_detections: list[Any]) -> None:
    """The reference's score on the least frequent colours: biased under H0."""
    z = np.array([d.paper_z_score for d in random_detections])
    assert z.mean() > 2.0
    assert np.mean(z > stats.norm.isf(0.01)) > 0.2  # a nominal 1% test rejects > 20%


def test_unknown_length_scan_is_conservative() -> None:
    stealthink = StealthInk(_key("scan"))
    p = np.array([stealthink.detect(t).p_value for t in random_texts(7, 600, small_vocab=100)])
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
        stealthink = StealthInk(_key(f"human-{i}"))
        for chunk in human:
            det = stealthink.detect(chunk, num_bits=NUM_BITS)
            p_values.append(det.p_value)
            native.append(det.paper_z_score)
    p = np.array(p_values)
    assert_fpr_nominal(p, "human text, 3 keys")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    assert np.mean(np.array(native) > stats.norm.isf(0.01)) > 0.2  # native: not calibrated


def test_null_decoded_bits_are_coin_flips() -> None:
    stealthink = StealthInk(_key("decode"))
    payload = "1010010110100101"
    correct = total = 0
    for tokens in random_texts(99, 300, small_vocab=0):
        bits = stealthink.decode(tokens, NUM_BITS).bits
        pairs = [(b, t) for b, t in zip(bits, payload, strict=True) if b != "?"]
        correct += sum(b == t for b, t in pairs)
        total += len(pairs)
    assert stats.binomtest(correct, total, 0.5).pvalue > 1e-3


# --- hygiene -------------------------------------------------------------------


def test_repr_hides_key() -> None:
    key = WatermarkKey.generate()
    stealthink = StealthInk(key)
    seq = stealthink.sequence(Payload("01"))
    for text in (repr(stealthink), str(stealthink), repr(seq), repr(StealthInkPRF(key))):
        assert key.hex() not in text
    assert key.key_id in repr(stealthink)


@pytest.mark.parametrize(
    "kwargs",
    [{"chunk_bits": 2}, {"chunk_bits": 0}, {"context_width": 0}, {"context_width": 9}],
)
def test_bad_config_raises(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        StealthInkConfig(**kwargs)  # type: ignore[arg-type]


def test_degenerate_inputs() -> None:
    """Nothing to score, one candidate: no error, no watermark, nothing changed."""
    stealthink = StealthInk(KEY)
    assert stealthink.detect([]).p_value == 1.0
    assert stealthink.decode([], NUM_BITS).bits == "?" * NUM_BITS
    assert stealthink.match([], ["0101"]) is None
    seq = stealthink.sequence(Payload("01"))
    assert seq.reweight(np.array([3]), np.array([1.0])).tolist() == [1.0]
