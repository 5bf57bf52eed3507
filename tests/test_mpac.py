"""The MPAC baseline: encoder/decoder agreement, calibration under H0, registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
from baselinelib import registry_around
from scipy import stats

from worldcup_core.baselines import MPAC, MPACConfig, extract_mpac_evidence, mpac_z_score
from worldcup_core.message import Payload
from worldcup_core.prf import PRF, WatermarkKey, context_at, pack_context, vocab_bits

VOCAB = 1000
KEY = WatermarkKey(bytes(range(32)))


def _generate(
    mpac: MPAC, payload: Payload, n: int, rng: np.random.Generator, scale: float = 2.0
) -> list[int]:
    """Bias random logits, softmax, sample: the loop without a model."""
    seq = mpac.sequence(payload)
    for _ in range(n):
        logits = seq.process_logits(rng.normal(size=VOCAB) * scale)
        probs = np.exp(logits - logits.max())
        seq.observe(int(rng.choice(VOCAB, p=probs / probs.sum())))
    return seq.generated


def _reference_counts(key: WatermarkKey, tokens: list[int], num_bits: int) -> np.ndarray:
    """MPAC's M[p][colour], computed independently of the module under test."""
    prf = PRF(key)
    counts = np.zeros((num_bits, 2), dtype=np.int64)
    seen: set[tuple[int, ...]] = set()
    for t, tok in enumerate(tokens):
        ctx = context_at(tokens, t, 2)
        if ctx in seen:
            continue
        seen.add(ctx)
        seed = prf.mpac_seed(pack_context(ctx))
        pos = prf.position_u64(seed.to_bytes(8, "little")) % num_bits
        counts[pos, vocab_bits(seed, np.array([tok]))[0]] += 1
    return counts


def test_scheme_identity() -> None:
    mpac = MPAC(KEY)
    assert (mpac.name, mpac.version) == ("mpac", "mpac-v1")
    seq = mpac.sequence(Payload("0101"))
    assert seq.modifies_logits
    probs = np.array([0.25, 0.75])
    assert seq.reweight(np.array([3, 4]), probs) is probs


def test_generation_recovers_payload() -> None:
    rng = np.random.default_rng(1)
    mpac = MPAC(KEY)
    accuracies = []
    for _ in range(20):
        payload = Payload.random(8, rng)
        tokens = _generate(mpac, payload, 200, rng)
        result = mpac.decode(tokens, num_bits=8)
        accuracies.append(np.mean([a == b for a, b in zip(result.bits, payload.bits, strict=True)]))
        assert result.detection.p_value < 1e-6
        assert mpac.detect(tokens).p_value < 1e-6  # payload length unknown
        assert result.alternatives[0].bits == result.bits
        assert 0.2 < result.estimated_bias < 0.5
    assert np.mean(accuracies) >= 0.9


def test_decoder_matches_reference_counting() -> None:
    """Same M[p][j] as a from-scratch MPAC decoder; argmax, erasures, native z."""
    rng = np.random.default_rng(2)
    mpac = MPAC(KEY)
    payload = Payload.random(16, rng)
    tokens = _generate(mpac, payload, 40, rng)
    tokens += tokens[:10]  # repeated contexts must be skipped on both sides
    counts = _reference_counts(KEY, tokens, 16)
    result = mpac.decode(tokens, num_bits=16)
    expected = "".join("?" if c.sum() == 0 else ("1" if c[1] > c[0] else "0") for c in counts)
    assert result.bits == expected
    assert result.position_token_counts == tuple(counts.sum(axis=1))
    total = counts.sum()
    native = (counts.max(axis=1).sum() - 0.5 * total) / math.sqrt(total * 0.25)
    assert result.detection.paper_z_score == pytest.approx(native)
    assert result.detection.num_scored_tokens == total


def test_strong_bias_is_exact() -> None:
    """With a huge delta every scored token is green: encoder and decoder agree."""
    rng = np.random.default_rng(3)
    mpac = MPAC(KEY, MPACConfig(delta=20.0))
    payload = Payload.random(8, rng)
    tokens = _generate(mpac, payload, 200, rng)
    result = mpac.decode(tokens, num_bits=8)
    assert result.bits == payload.bits
    assert result.estimated_bias == pytest.approx(0.5)


def test_repeated_context_is_not_biased() -> None:
    seq = MPAC(KEY).sequence(Payload("1"))
    for tok in (5, 6, 5, 6):
        seq.observe(tok)
    logits = np.zeros(VOCAB)
    assert seq.process_logits(logits) is logits  # context (5, 6) seen before
    seq.observe(7)
    assert seq.process_logits(logits) is not logits  # (6, 7) is new
    ev = extract_mpac_evidence(PRF(KEY), MPACConfig(), [5, 6, 5, 6, 7])
    assert ev.num_scored == 4


def test_null_pvalues_are_calibrated_and_native_z_is_not() -> None:
    rng = np.random.default_rng(4)
    mpac = MPAC(KEY)
    p_values, native_z = [], []
    for _ in range(1000):
        det = mpac.detect(rng.integers(0, VOCAB, size=100).tolist(), num_bits=8)
        p_values.append(det.p_value)
        native_z.append(det.paper_z_score)
    p = np.array(p_values)
    assert 0.003 <= np.mean(p < 0.01) <= 0.02
    assert stats.kstest(p, "uniform").pvalue > 0.001
    z = np.array(native_z)
    assert z.mean() > 0.5  # E[z] ~ sqrt(2b/pi) ~ 2.3, not 0
    assert np.mean(z > 2.326) > 0.02  # nominal 1% test rejects far more often


def test_null_scan_over_lengths_is_conservative() -> None:
    rng = np.random.default_rng(5)
    mpac = MPAC(KEY)
    p = np.array(
        [mpac.detect(rng.integers(0, VOCAB, size=80).tolist()).p_value for _ in range(120)]
    )
    assert np.mean(p < 0.05) <= 0.08


def test_scan_reports_native_z_of_selected_length() -> None:
    rng = np.random.default_rng(6)
    mpac = MPAC(KEY)
    tokens = _generate(mpac, Payload.random(12, rng), 150, rng)
    det = mpac.detect(tokens)
    ev = mpac.evidence(tokens)
    natives = [mpac_z_score(ev, b) for b in range(1, 65)]
    assert min(abs(det.paper_z_score - v) for v in natives) < 1e-9


def test_registry_match_finds_true_message() -> None:
    rng = np.random.default_rng(7)
    mpac = MPAC(KEY)
    payload = Payload.random(16, rng)
    tokens = _generate(mpac, payload, 250, rng)
    candidates = registry_around(payload.bits, rng)
    match = mpac.match(tokens, candidates)
    assert match is not None
    assert (match.index, match.bits) == (137, payload.bits)
    assert match.p_value < 1e-6
    assert match.posterior > 0.99
    assert mpac.match(tokens, []) is None


def test_repr_hides_key() -> None:
    key = WatermarkKey.generate()
    mpac = MPAC(key)
    seq = mpac.sequence(Payload("01"))
    for text in (repr(mpac), str(mpac), repr(seq)):
        assert key.hex() not in text
    assert key.key_id in repr(mpac)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gamma": 0.25},
        {"gamma": 1.0},
        {"delta": -1.0},
        {"delta": math.nan},
        {"delta": math.inf},
        {"context_width": 0},
        {"context_width": 9},
    ],
)
def test_bad_config_raises(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        MPACConfig(**kwargs)  # type: ignore[arg-type]


def test_gamma_error_says_what_is_supported() -> None:
    with pytest.raises(ValueError, match="only gamma = 0.5"):
        MPACConfig(gamma=0.3)
