"""The XMark baseline: the reference's counting, the round trip, the exact null law, registry.

Samples come from fixed seeds; FPR bands are exact binomial tests at level 0.001, so a
correct implementation passes for essentially any seed while a miscalibrated one fails.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter

import numpy as np
import numpy.typing as npt
import pytest
from scipy import stats

from worldcup_core.baselines import (
    BASELINES,
    STRENGTH,
    XMark,
    XMarkConfig,
    build_baseline,
    describe_settings,
)
from worldcup_core.baselines.xmark import (
    UNION_NULL,
    log_binom_cdf,
    min_hits_log_pmf,
    min_sum_log_pmf,
    num_blocks,
    payload_symbols,
    token_parts,
)
from worldcup_core.message import Payload
from worldcup_core.prf import WatermarkKey, context_at, pack_context, splitmix64

VOCAB = 1000
KEY = WatermarkKey(bytes(range(32)))


def _key(label: str) -> WatermarkKey:
    return WatermarkKey(hashlib.sha256(f"xmark-test:{label}".encode()).digest())


def _generate(
    scheme: XMark, payload: Payload, n: int, rng: np.random.Generator, scale: float = 2.0
) -> list[int]:
    """Bias random logits, softmax, sample: the generation loop without a model."""
    seq = scheme.sequence(payload)
    for _ in range(n):
        logits = seq.process_logits(rng.normal(size=VOCAB) * scale)
        probs = np.exp(logits - logits.max())
        seq.observe(int(rng.choice(VOCAB, p=probs / probs.sum())))
    return seq.generated


def _accuracy(bits: str, truth: str) -> float:
    return float(np.mean([a == b for a, b in zip(bits, truth, strict=True)]))


def _assert_fpr(p: npt.NDArray[np.float64], alpha: float, what: str) -> None:
    hits = int(np.sum(p < alpha))
    assert stats.binomtest(hits, len(p), alpha).pvalue > 1e-3, f"{what}: {hits}/{len(p)}"


# --- identity and the reference's rules ---------------------------------------------------


def test_scheme_identity_registry_and_strength() -> None:
    scheme = XMark(KEY)
    assert (scheme.name, scheme.version) == ("xmark", "xmark-v1")
    assert BASELINES["xmark"] is XMark and isinstance(build_baseline("xmark", KEY), XMark)
    stronger = build_baseline("xmark", KEY, 3.0)
    assert isinstance(stronger, XMark) and stronger.config.delta == 3.0
    assert STRENGTH["xmark"] == "delta" and "delta=2" in describe_settings("xmark")
    assert "xmark" in repr(scheme).lower() and KEY.hex() not in repr(scheme)
    with pytest.raises(ValueError, match="delta"):
        XMarkConfig(delta=-1.0)
    with pytest.raises(ValueError, match="no strength"):
        build_baseline("stealthink", KEY, 1.0)


def test_payload_blocks_are_two_bits_msb_first_and_padded() -> None:
    assert payload_symbols("0111") == (1, 3)  # the reference's int(bits[i:i+2], 2)
    assert payload_symbols("101") == (2, 2)  # an odd length is zero-padded
    assert num_blocks(32) == 16 and num_blocks(17) == 9
    with pytest.raises(ValueError, match="num_bits"):
        num_blocks(0)


def test_parts_are_uniform_and_independent() -> None:
    q1, q2 = token_parts(12345, np.arange(160_000, dtype=np.int64))
    table = np.zeros((4, 4))
    np.add.at(table, (q1, q2), 1)
    assert stats.chisquare(table.ravel()).pvalue > 1e-3  # 16 cells, each 1/16


def test_boosted_list_is_outside_both_parts_of_the_value() -> None:
    """The generator boosts exactly the tokens in neither partition's part named by the
    block's value: about 9/16 of the vocabulary, +delta on each."""
    hasher = hashlib.blake2b(key=KEY.subkey("xmark"), digest_size=16)
    payload = Payload("0110" * 4)
    seq = XMark(KEY).sequence(payload)
    for tok in (11, 12):
        seq.observe(tok)
    out = seq.process_logits(np.zeros(49152))
    h = hasher.copy()
    h.update(pack_context(context_at([11, 12], 2, 2)))
    digest = h.digest()
    seed, block = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")
    value = payload_symbols(payload.bits)[((block >> 32) * 8) >> 32]
    word = splitmix64(seed, np.arange(49152, dtype=np.int64))
    q1, q2 = (word >> np.uint64(62)).astype(int), ((word >> np.uint64(60)) & np.uint64(3))
    boosted = (q1 != value) & (q2.astype(int) != value)
    np.testing.assert_array_equal(out, 2.0 * boosted)
    assert abs(boosted.mean() - 9 / 16) < 0.01


def _reference_bits(key: WatermarkKey, tokens: list[int], bits: int) -> str:
    """The reference detector's cTMM counting, from scratch: per block, +1 on the token's
    part in the first partition and +1 on its part in the second unless it is the same;
    each block reads as its least counted value (first on ties)."""
    hasher = hashlib.blake2b(key=key.subkey("xmark"), digest_size=16)
    blocks = num_blocks(bits)
    counts = np.zeros((blocks, 4), dtype=np.int64)
    seen: set[tuple[int, ...]] = set()
    for t, tok in enumerate(tokens):
        ctx = context_at(tokens, t, 2)
        if ctx in seen:
            continue
        seen.add(ctx)
        h = hasher.copy()
        h.update(pack_context(ctx))
        digest = h.digest()
        seed = int.from_bytes(digest[:8], "little")
        b = ((int.from_bytes(digest[8:], "little") >> 32) * blocks) >> 32
        word = int(splitmix64(seed, np.array([tok], dtype=np.int64))[0])
        p1, p2 = word >> 62, (word >> 60) & 3
        counts[b, p1] += 1
        if p2 != p1:
            counts[b, p2] += 1
    return "".join(format(int(v), "02b") for v in counts.argmin(axis=1))[:bits]


def test_decoder_matches_the_reference_counting() -> None:
    rng = np.random.default_rng(3)
    scheme = XMark(KEY)
    for bits in (16, 17, 32):
        tokens = _generate(scheme, Payload.random(bits, rng), 150, rng)
        tokens += tokens[:30]  # repeated contexts are skipped on both sides
        assert scheme.decode(tokens, num_bits=bits).bits == _reference_bits(KEY, tokens, bits)


def test_repeated_context_is_not_biased() -> None:
    seq = XMark(KEY).sequence(Payload("1" * 16))
    for tok in (5, 6, 5, 6):
        seq.observe(tok)
    logits = np.zeros(VOCAB)
    assert seq.process_logits(logits) is logits  # context (5, 6) seen before
    seq.observe(7)
    assert set(np.unique(seq.process_logits(logits))) == {0.0, 2.0}
    assert XMark(KEY).evidence([5, 6, 5, 6, 7]).num_scored == 4


# --- the round trip -----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [16, 32])
def test_generation_recovers_payload(bits: int) -> None:
    rng = np.random.default_rng(bits)
    scheme = XMark(KEY)
    accuracies, exact = [], 0
    for _ in range(15):
        payload = Payload.random(bits, rng)
        tokens = _generate(scheme, payload, 200, rng)
        result = scheme.decode(tokens, num_bits=bits, list_size=4)
        accuracies.append(_accuracy(result.bits, payload.bits))
        exact += result.bits == payload.bits
        assert result.detection.p_value < 1e-6
        assert scheme.detect(tokens).p_value < 1e-6  # payload length unknown
        assert result.alternatives[0].bits == result.bits
        assert len({a.bits for a in result.alternatives}) == len(result.alternatives) <= 4
        assert 0.1 < result.estimated_bias < 0.5  # boosted share above the null 9/16
        assert len(result.position_token_counts) == num_blocks(bits)
    assert np.mean(accuracies) >= 0.95
    assert exact >= 8


def test_stronger_bias_decodes_more() -> None:
    rng = np.random.default_rng(5)
    weak, strong = XMark(KEY, XMarkConfig(delta=1.0)), XMark(KEY, XMarkConfig(delta=4.0))
    acc = {1.0: [], 4.0: []}  # type: dict[float, list[float]]
    for _ in range(12):
        payload = Payload.random(32, rng)
        for scheme in (weak, strong):
            tokens = _generate(scheme, payload, 100, rng)
            acc[scheme.config.delta].append(_accuracy(scheme.decode(tokens, 32).bits, payload.bits))
    assert np.mean(acc[4.0]) > np.mean(acc[1.0]) + 0.05


# --- the exact null law -------------------------------------------------------------------


@pytest.mark.parametrize("draws", range(0, 10))
def test_min_law_matches_enumeration(draws: int) -> None:
    counts = Counter(
        min(d.count(v) for v in range(4)) for d in itertools.product(range(4), repeat=draws)
    )
    exact = np.array([counts.get(m, 0) / 4**draws for m in range(draws // 4 + 1)])
    np.testing.assert_allclose(np.exp(min_hits_log_pmf(draws)), exact, rtol=1e-12, atol=0)


def test_min_law_is_exact_deep_in_the_tail() -> None:
    """P(min = 0) = P(some value never drawn): inclusion-exclusion, for 600 draws."""
    n = 600
    log_p0 = math.log(4) + n * math.log(0.75)  # the two-value terms are ~1e-75 smaller
    assert min_hits_log_pmf(n)[0] == pytest.approx(log_p0, rel=1e-12)
    assert float(np.exp(min_hits_log_pmf(n)).sum()) == pytest.approx(1.0, abs=1e-9)


def test_min_sum_law_matches_enumeration() -> None:
    sizes = [2, 1]  # blocks of 2 and 1 tokens: 4 and 2 draws
    counts: Counter[int] = Counter()
    for a in itertools.product(range(4), repeat=4):
        for b in itertools.product(range(4), repeat=2):
            counts[min(a.count(v) for v in range(4)) + min(b.count(v) for v in range(4))] += 1
    exact = np.array([counts.get(s, 0) / 4**6 for s in range(2)])  # min 4 draws <= 1, 2 draws: 0
    np.testing.assert_allclose(np.exp(min_sum_log_pmf(sizes)), exact, rtol=1e-12)


def test_log_binom_cdf_matches_scipy_and_survives_underflow() -> None:
    assert log_binom_cdf(30, 200, 0.25) == pytest.approx(stats.binom.logcdf(30, 200, 0.25))
    assert math.isfinite(log_binom_cdf(0, 5000, 0.25)) and log_binom_cdf(-1, 10, 0.25) == -math.inf


@pytest.fixture(scope="module")
def random_texts() -> list[list[int]]:
    rng = np.random.default_rng(20260601)
    texts = [rng.integers(0, 49152, size=(128, 256)[i % 2]).tolist() for i in range(1200)]
    for i in range(100):
        vocab = rng.choice(49152, size=(8, 50)[i % 2], replace=False)
        texts.append(vocab[rng.integers(0, len(vocab), size=256)].tolist())
    return texts


def test_null_pvalues_are_exact(random_texts: list[list[int]]) -> None:
    scheme = XMark(_key("null"))
    results = [scheme.detect(t, num_bits=(32, 16)[i % 2]) for i, t in enumerate(random_texts)]
    p = np.array([r.p_value for r in results])
    _assert_fpr(p, 1e-2, "random text")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    # the decoder's margin, read as a z-score, is biased upwards on null text
    assert np.mean([r.paper_z_score for r in results]) > 1.0
    assert min(r.num_scored_tokens for r in results[-100:]) < 64  # repeats were skipped


def test_unknown_length_scan_is_conservative(random_texts: list[list[int]]) -> None:
    p = np.array([XMark(_key("scan")).detect(t).p_value for t in random_texts[:80]])
    assert np.mean(p < 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / len(p))


def test_wrong_key_sees_nothing() -> None:
    rng = np.random.default_rng(13)
    owner, other = XMark(_key("owner")), XMark(_key("other"))
    p_owner, p_other = [], []
    for _ in range(40):
        tokens = _generate(owner, Payload.random(32, rng), 128, rng)
        p_owner.append(owner.detect(tokens, num_bits=32).p_value)
        p_other.append(other.detect(tokens, num_bits=32).p_value)
    assert np.median(p_owner) < 1e-5
    assert stats.kstest(p_other, "uniform").pvalue > 1e-3


# --- registry and bad input ---------------------------------------------------------------


def test_registry_match_finds_true_message_and_is_calibrated() -> None:
    rng = np.random.default_rng(7)
    scheme = XMark(KEY)
    for _ in range(4):
        registry = [Payload.random(32, rng).bits for _ in range(200)]
        truth = int(rng.integers(len(registry)))
        match = scheme.match(_generate(scheme, Payload(registry[truth]), 128, rng), registry)
        assert match is not None and match.index == truth
        assert match.p_value < 1e-6 and match.posterior > 0.99 and match.margin_z > 0
    null = XMark(_key("registry-null"))
    registry = [Payload.random(16, rng).bits for _ in range(50)]
    p = [null.match(rng.integers(0, 49152, size=128).tolist(), registry) for _ in range(300)]
    rate = np.mean([m is not None and m.p_value < 0.05 for m in p])
    assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / len(p))


def test_bad_input_is_a_clear_error() -> None:
    scheme = XMark(KEY)
    with pytest.raises(ValueError, match="num_bits"):
        scheme.decode([1, 2, 3], num_bits=65)
    with pytest.raises(ValueError, match="list_size"):
        scheme.decode([1, 2, 3], num_bits=8, list_size=0)
    with pytest.raises(ValueError, match="same length"):
        scheme.match([1, 2, 3], ["0101", "01"])
    with pytest.raises(ValueError, match="significance"):
        scheme.detect([1, 2, 3], significance=0.0)
    empty = scheme.decode([], num_bits=16)
    assert empty.bits == "?" * 16 and empty.detection.p_value == 1.0
    assert scheme.match([], ["0101"]) is None
    assert UNION_NULL == pytest.approx(7 / 16)
