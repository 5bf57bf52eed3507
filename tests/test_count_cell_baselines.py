"""What BiMark and StealthInk must both do, run once for each: distortion-freeness over
keys (and the power to reject MPAC), generation and decoding, registry match, wrong key,
round trip on the embedded model, calibration on random and human text, coin-flip bits
on null text, degenerate inputs and key hygiene.

Each scheme's own module keeps what is specific to it: its reweighting against the
reference code, unbiasedness, its configuration checks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
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
    registry_around,
)
from scipy import stats

from worldcup_core.baselines import BASELINES, MPAC, BiMark, StealthInk, build_baseline
from worldcup_core.baselines.bimark import BiMarkPRF
from worldcup_core.baselines.stealthink import StealthInkPRF
from worldcup_core.message import Payload
from worldcup_core.prf import WatermarkKey

KEY = WatermarkKey(bytes(range(32)))
NUM_BITS = 16


@dataclass(frozen=True)
class Spec:
    """A scheme and the strength of its watermark where the two schemes differ."""

    name: str
    scheme: type[BiMark] | type[StealthInk]
    prf: Any  # builds the scheme's PRF from a key (its repr is checked)
    owner_p_max: float  # synthetic 128-token texts under the owner's key
    model_accuracy: float  # mean bit accuracy of the embedded-model round trip
    model_p: tuple[str, float]  # ("max" or "median" p-value of those texts, bound)
    random_seed: int

    def key(self, label: str) -> WatermarkKey:
        return WatermarkKey(hashlib.sha256(f"{self.name}-test:{label}".encode()).digest())

    def build(self, key: WatermarkKey = KEY) -> Any:
        return self.scheme(key)


SPECS = [
    # BiMark votes d = 10 layers a token: a stronger signal per token.
    Spec("bimark", BiMark, lambda k: BiMarkPRF(k, 2), 1e-6, 0.9, ("max", 1e-6), 20250601),
    Spec("stealthink", StealthInk, StealthInkPRF, 1e-4, 0.85, ("median", 1e-3), 20250602),
]


@pytest.fixture(params=SPECS, ids=[s.name for s in SPECS], scope="module")
def spec(request: pytest.FixtureRequest) -> Spec:
    return request.param  # type: ignore[no-any-return]


# --- distortion-freeness ---------------------------------------------------------

P = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
CANDIDATES = np.array([3, 17, 52, 99, 140, 201], dtype=np.int64)
KEYS = 20000


def _key_averaged(scheme: type[Any], keys: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Over ``keys`` random keys (each with a random context and payload): every key's
    next-token distribution q, and the counts of one token drawn from q per key."""
    rng = np.random.default_rng(seed)
    qs = np.empty((keys, len(P)))
    for i in range(keys):
        seq = scheme(WatermarkKey(rng.bytes(32))).sequence(Payload.random(8, rng))
        for tok in rng.integers(1000, VOCAB, size=2):
            seq.observe(int(tok))
        if seq.modifies_logits:  # KGW-style (MPAC): +delta on the green logits
            logits = np.full(300, -np.inf)
            logits[CANDIDATES] = np.log(P)
            biased = seq.process_logits(logits)[CANDIDATES]
            qs[i] = np.exp(biased - biased.max()) / np.exp(biased - biased.max()).sum()
        else:
            qs[i] = seq.reweight(CANDIDATES, P)
    cdf = np.cumsum(qs, axis=1)
    draws = (rng.random(keys)[:, None] > cdf).sum(axis=1)
    return qs, np.bincount(np.minimum(draws, len(P) - 1), minlength=len(P))


def test_real_keys_average_to_the_model_distribution(spec: Spec) -> None:
    """Distortion-free as the papers define it: E_key[q] = p, tested two ways."""
    qs, counts = _key_averaged(spec.scheme, KEYS, seed=11)
    z = (qs.mean(axis=0) - P) / (qs.std(axis=0, ddof=1) / math.sqrt(KEYS))
    assert np.abs(z).max() < 4.0, z
    assert chi_square_against(counts, P) > 1e-3
    assert qs.std(axis=0).max() > 0.05  # each key does move the distribution


def test_the_same_tests_reject_a_distortionary_scheme() -> None:
    """Power: at the same sample size MPAC (delta = 2 on the green logits) is rejected."""
    qs, counts = _key_averaged(MPAC, KEYS, seed=12)
    z = (qs.mean(axis=0) - P) / (qs.std(axis=0, ddof=1) / math.sqrt(KEYS))
    assert np.abs(z).max() > 8.0, z
    assert chi_square_against(counts, P) < 1e-6


# --- generation, decoding, registry --------------------------------------------


def test_scheme_identity_and_registry(spec: Spec) -> None:
    assert BASELINES[spec.name] is spec.scheme
    scheme = build_baseline(spec.name, KEY)
    assert isinstance(scheme, spec.scheme)
    assert (scheme.name, scheme.version) == (spec.name, f"{spec.name}-v1")
    seq = scheme.sequence(Payload("0101"))
    assert not seq.modifies_logits
    logits = np.zeros(5)
    assert seq.process_logits(logits) is logits


def test_generation_recovers_payload(spec: Spec) -> None:
    rng = np.random.default_rng(3)
    scheme = spec.build()
    accuracies = []
    for _ in range(20):
        payload = Payload.random(NUM_BITS, rng)
        tokens = generate_synthetic(scheme, payload, 200, rng)
        result = scheme.decode(tokens, num_bits=NUM_BITS)
        accuracies.append(np.mean([a == b for a, b in zip(result.bits, payload.bits, strict=True)]))
        assert result.detection.p_value < 1e-6
        assert scheme.detect(tokens).p_value < 1e-6  # payload length unknown
        assert result.alternatives[0].bits == result.bits
    assert np.mean(accuracies) >= 0.9, accuracies


def test_registry_match_finds_true_message(spec: Spec) -> None:
    rng = np.random.default_rng(7)
    scheme = spec.build()
    payload = Payload.random(NUM_BITS, rng)
    tokens = generate_synthetic(scheme, payload, 200, rng)
    candidates = registry_around(payload.bits, rng)
    match = scheme.match(tokens, candidates)
    assert match is not None
    assert (match.index, match.bits) == (137, payload.bits)
    assert match.p_value < 1e-6 and match.posterior > 0.99
    assert scheme.match(tokens, []) is None


def test_wrong_key_sees_nothing(spec: Spec) -> None:
    """Texts watermarked under one key are null text to another key."""
    rng = np.random.default_rng(8)
    owner, other = spec.build(spec.key("owner")), spec.build(spec.key("other"))
    p_own, p_other = [], []
    for _ in range(60):
        tokens = generate_synthetic(owner, Payload.random(NUM_BITS, rng), 128, rng)
        p_own.append(owner.detect(tokens, num_bits=NUM_BITS).p_value)
        p_other.append(other.detect(tokens, num_bits=NUM_BITS).p_value)
    assert max(p_own) < spec.owner_p_max
    assert stats.kstest(p_other, "uniform").pvalue > 1e-3
    assert np.mean(np.array(p_other) < 0.05) <= 0.15


@pytest.mark.model
def test_round_trip_on_the_embedded_model(spec: Spec, data_dir: Path) -> None:
    """SmolLM2 generates (top-k 50, top-p 0.95), the text is detokenised and re-tokenised:
    the payload comes back, and another key sees chance bits and no watermark."""
    from worldcup_core.models import load_model

    scheme = spec.build()
    payloads, texts = model_round_trip(scheme, load_model(), data_dir, prompts=4)
    accuracies, p_values, wrong_p = [], [], []
    wrong = spec.build(spec.key("wrong"))
    correct = 0
    for payload, ids in zip(payloads, texts, strict=True):
        decoded = scheme.decode(ids, NUM_BITS)
        accuracies.append(
            np.mean([a == b for a, b in zip(decoded.bits, payload.bits, strict=True)])
        )
        p_values.append(decoded.detection.p_value)
        other = wrong.decode(ids, NUM_BITS)
        correct += sum(a == b for a, b in zip(other.bits, payload.bits, strict=True))
        wrong_p.append(other.detection.p_value)
    assert np.mean(accuracies) >= spec.model_accuracy, accuracies
    statistic, bound = spec.model_p
    assert float(getattr(np, statistic)(p_values)) < bound, p_values
    assert stats.binomtest(correct, NUM_BITS * len(texts), 0.5).pvalue > 1e-3
    assert min(wrong_p) > 1e-3, wrong_p


# --- calibration under H0 -----------------------------------------------------


@pytest.fixture(scope="module")
def random_detections(spec: Spec) -> list[Any]:
    scheme = spec.build(spec.key("random"))
    return [scheme.detect(t, num_bits=NUM_BITS) for t in random_texts(spec.random_seed, 3000)]


def test_random_text_pvalues_are_calibrated(random_detections: list[Any]) -> None:
    p = np.array([d.p_value for d in random_detections])
    assert_fpr_nominal(p, "random texts")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    assert stats.kstest(p[-400:], "uniform").pvalue > 1e-3  # 8-id texts, repeated contexts
    scored = np.array([d.num_scored_tokens for d in random_detections[-400:]])
    assert scored.max() <= 1 + 8 + 64  # (pad, pad), (pad, x) and 64 pairs: repeats skipped


def test_native_score_is_not_calibrated(random_detections: list[Any]) -> None:
    """The papers' scores on majority (BiMark) or least frequent (StealthInk) counts are
    biased under H0: E[z] ~ sqrt(2b/pi), not 0."""
    z = np.array([d.paper_z_score for d in random_detections])
    assert z.mean() > 2.0
    assert np.mean(z > stats.norm.isf(0.01)) > 0.2  # a nominal 1% test rejects > 20%


def test_unknown_length_scan_is_conservative(spec: Spec) -> None:
    scheme = spec.build(spec.key("scan"))
    p = np.array([scheme.detect(t).p_value for t in random_texts(7, 600, small_vocab=100)])
    assert_fpr_at_most_nominal(p, "random texts, length unknown")
    assert np.mean(p < 0.05) <= 0.05 + 4 * math.sqrt(0.05 / len(p))


@pytest.fixture(scope="module")
def human(data_dir: Path, smollm2_tokenizer: Any) -> list[list[int]]:
    return human_chunks(data_dir, smollm2_tokenizer)


def test_human_text_pvalues_are_calibrated(spec: Spec, human: list[list[int]]) -> None:
    assert len(human) >= 1000
    p_values: list[float] = []
    native: list[float] = []
    for i in range(3):
        scheme = spec.build(spec.key(f"human-{i}"))
        for chunk in human:
            det = scheme.detect(chunk, num_bits=NUM_BITS)
            p_values.append(det.p_value)
            native.append(det.paper_z_score)
    p = np.array(p_values)
    assert_fpr_nominal(p, "human text, 3 keys")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    assert np.mean(np.array(native) > stats.norm.isf(0.01)) > 0.2  # native: not calibrated


def test_null_decoded_bits_are_coin_flips(spec: Spec) -> None:
    scheme = spec.build(spec.key("decode"))
    payload = "1010010110100101"
    correct = total = 0
    for tokens in random_texts(99, 300, small_vocab=0):
        bits = scheme.decode(tokens, NUM_BITS).bits
        pairs = [(b, t) for b, t in zip(bits, payload, strict=True) if b != "?"]
        correct += sum(b == t for b, t in pairs)
        total += len(pairs)
    assert stats.binomtest(correct, total, 0.5).pvalue > 1e-3


# --- hygiene -------------------------------------------------------------------


def test_repr_hides_key(spec: Spec) -> None:
    key = WatermarkKey.generate()
    scheme = spec.build(key)
    seq = scheme.sequence(Payload("01"))
    for text in (repr(scheme), str(scheme), repr(seq), repr(spec.prf(key))):
        assert key.hex() not in text
    assert key.key_id in repr(scheme)


def test_degenerate_inputs(spec: Spec) -> None:
    """Nothing to score, one candidate: no error, no watermark, nothing changed."""
    scheme = spec.build()
    assert scheme.detect([]).p_value == 1.0
    assert scheme.decode([], NUM_BITS).bits == "?" * NUM_BITS
    assert scheme.match([], ["0101"]) is None
    seq = scheme.sequence(Payload("01"))
    assert seq.reweight(np.array([3]), np.array([1.0])).tolist() == [1.0]
