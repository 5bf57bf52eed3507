"""Message codec, decoder (erasures, list decoding), registry matching, end to end.

Watermarked text is produced by a simulated generator: at every step a random
high-entropy distribution over 50 random candidate ids of a 49152-token
vocabulary is reweighted by ``WorldCup.sequence(payload)`` and sampled with
numpy. No model is involved, so these tests are fast and deterministic.
"""

from __future__ import annotations

import doctest
import itertools
from typing import Any

import numpy as np
import pytest
from scipy import stats

import worldcup_core.message
import worldcup_core.scheme
from worldcup_core import (
    DecodeResult,
    Payload,
    Variant,
    WatermarkConfig,
    WatermarkKey,
    WorldCup,
)
from worldcup_core.decoder import decode
from worldcup_core.detector import DetectionResult
from worldcup_core.message import bits_matrix
from worldcup_core.scoring import TokenEvidence

VOCAB = 49152
KEY = WatermarkKey(bytes(range(32)))
OTHER_KEY = WatermarkKey(bytes(range(1, 33)))


def simulate(wc: WorldCup, payload: Payload, length: int, rng: np.random.Generator) -> list[int]:
    """Watermarked generation over random Dirichlet(0.5) distributions on 50 candidates."""
    seq: Any = wc.sequence(payload)
    for _ in range(length):
        p = rng.dirichlet(np.ones(50) * 0.5)
        cand = rng.choice(VOCAB, 50, replace=False)
        q = seq.reweight(cand, p)
        assert q.shape == (50,) and abs(q.sum() - 1.0) < 1e-9
        seq.observe(int(cand[rng.choice(50, p=q)]))
    tokens: list[int] = seq.generated
    assert len(tokens) == length
    return tokens


def bit_accuracy(decoded: str, truth: str) -> float:
    return sum(a == b for a, b in zip(decoded, truth, strict=True)) / len(truth)


# --- Payload -------------------------------------------------------------------


def test_payload_from_bits() -> None:
    assert Payload.from_bits("0110").bits == "0110"
    assert Payload.from_bits(" 0110\n").bits == "0110"
    assert Payload("1" * 64).num_bits == 64
    assert Payload("0").to_int() == 0
    assert Payload("0110").to_int() == 6


@pytest.mark.parametrize(
    ("bits", "message"),
    [
        ("", r"1\.\.64 bits, got 0"),
        ("0" * 65, r"1\.\.64 bits, got 65"),
        ("0120", "string of 0 and 1"),
        ("01 0", "string of 0 and 1"),
        ("abc", "string of 0 and 1"),
    ],
)
def test_payload_rejects_bad_bits(bits: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Payload(bits)


def test_payload_from_int() -> None:
    assert Payload.from_int(6, num_bits=4).bits == "0110"
    assert Payload.from_int(0, num_bits=3).bits == "000"
    assert Payload.from_int(2**64 - 1, num_bits=64).bits == "1" * 64
    for value in (0, 1, 12345, 2**40 + 7):
        assert Payload.from_int(value, 48).to_int() == value
    with pytest.raises(ValueError, match="does not fit in 4 bits"):
        Payload.from_int(16, num_bits=4)
    with pytest.raises(ValueError, match="does not fit"):
        Payload.from_int(-1, num_bits=4)
    with pytest.raises(ValueError, match=r"num_bits must be in 1\.\.64, got 0"):
        Payload.from_int(0, num_bits=0)
    with pytest.raises(ValueError, match="got 65"):
        Payload.from_int(0, num_bits=65)


def test_payload_from_hex() -> None:
    assert Payload.from_hex("a5").bits == "10100101"
    assert Payload.from_hex("0xA5").bits == "10100101"
    assert Payload.from_hex("a5", num_bits=12).bits == "000010100101"
    assert Payload.from_hex("0" * 16).num_bits == 64
    with pytest.raises(ValueError, match="must be hexadecimal"):
        Payload.from_hex("zz")
    with pytest.raises(ValueError, match="must be hexadecimal"):
        Payload.from_hex("0x")
    with pytest.raises(ValueError, match="does not fit in 8 bits"):
        Payload.from_hex("1ff", num_bits=8)
    with pytest.raises(ValueError, match="got 68"):
        Payload.from_hex("0" * 17)


def test_payload_random_is_seeded() -> None:
    a = Payload.random(16, np.random.default_rng(1))
    b = Payload.random(16, np.random.default_rng(1))
    assert a == b and a.num_bits == 16


def _reference_symbols(bits: str, k: int) -> tuple[int, ...]:
    padded = bits + "0" * (-len(bits) % k)
    return tuple(int(padded[i : i + k], 2) for i in range(0, len(padded), k))


@pytest.mark.parametrize("k", range(1, 9))
def test_to_symbols(k: int) -> None:
    rng = np.random.default_rng(k)
    for num_bits in (1, 2, 3, 7, 8, 15, 16, 17, 33, 63, 64):
        payload = Payload.random(num_bits, rng)
        symbols = payload.to_symbols(k)
        assert symbols == _reference_symbols(payload.bits, k)
        assert len(symbols) == WatermarkConfig(groups=k).symbols_for(num_bits)
        assert all(0 <= s < 2**k for s in symbols)
        arr = payload.bit_array(k)
        assert arr.shape == (len(symbols), k)
        assert arr.dtype == np.uint8


def test_to_symbols_padding_and_bit_order() -> None:
    assert Payload("0110").to_symbols(2) == (1, 2)  # group 0 is the most significant bit
    assert Payload("101").to_symbols(2) == (2, 2)  # "10", "1" + pad "0"
    assert Payload("1").to_symbols(8) == (128,)
    assert Payload("111").to_symbols(1) == (1, 1, 1)
    np.testing.assert_array_equal(Payload("101").bit_array(2), [[1, 0], [1, 0]])


def test_bits_matrix() -> None:
    m = bits_matrix(["101", "011"], 2)
    assert m.shape == (2, 2, 2)
    np.testing.assert_array_equal(m[0], [[1, 0], [1, 0]])
    np.testing.assert_array_equal(m[1], [[0, 1], [1, 0]])
    assert bits_matrix([], 3).shape == (0, 0, 3)
    with pytest.raises(ValueError, match="same number of bits"):
        bits_matrix(["01", "011"], 2)
    for bad in (["0120"], ["01a0"], ["01 0"]):
        with pytest.raises(ValueError, match="strings of 0 and 1"):
            bits_matrix(bad, 2)


# --- decoding: erasures and list decoding ---------------------------------------


def test_erasures_for_positions_without_tokens() -> None:
    wc = WorldCup(KEY)
    result = wc.decode([7, 8, 101, 202], 64)  # v2 scores neither 7 nor 8 (padded context)
    assert result.num_bits == 64
    assert sum(result.position_token_counts) == 2
    assert len(result.position_token_counts) == 32
    live_positions = [p for p, c in enumerate(result.position_token_counts) if c > 0]
    live_bits = {2 * p + j for p in live_positions for j in range(2)}
    assert set(result.erasures) == set(range(64)) - live_bits
    assert len(result.erasures) >= 60
    for i, bit in enumerate(result.bits):
        if i in result.erasures:
            assert bit == "?"
            assert result.bit_p_values[i] == 1.0
            assert result.bit_z[i] == 0.0
        else:
            assert bit in "01"
    # alternatives only flip live bits; erasures stay '?'
    for alt in result.alternatives:
        assert [i for i, c in enumerate(alt.bits) if c == "?"] == list(result.erasures)
    assert wc.decode([], 16).bits == "?" * 16


def test_decode_rejects_bad_arguments() -> None:
    wc = WorldCup(KEY)
    with pytest.raises(ValueError, match="list_size must be >= 1"):
        wc.decode([1, 2, 3], 16, list_size=0)
    with pytest.raises(ValueError, match="num_bits"):
        wc.decode([1, 2, 3], 65)


def _check_list(result: DecodeResult, list_size: int) -> None:
    alts = result.alternatives
    assert len(alts) == list_size
    assert alts[0].bits == result.bits
    assert alts[0].flip_cost == 0.0
    assert len({a.bits for a in alts}) == len(alts)
    costs = [a.flip_cost for a in alts]
    assert costs == sorted(costs)
    llrs = [a.log_likelihood_ratio for a in alts]
    assert llrs == sorted(llrs, reverse=True)
    assert all(v <= 0 for v in llrs)


def test_list_decoding_is_exact_top_l() -> None:
    """The list is the L cheapest flip sets, checked by brute force over all 2^8 messages."""
    wc = WorldCup(KEY)
    rng = np.random.default_rng(4)
    payload = Payload.random(8, rng)
    tokens = simulate(wc, payload, 24, rng)
    result = wc.decode(tokens, 8, list_size=20)
    _check_list(result, 20)
    ones, trials, _ = wc.evidence(tokens).cells(4)
    weight = np.abs(2 * ones.ravel() - trials.ravel()).astype(float)  # flip cost per bit
    assert result.erasures == ()
    all_costs = sorted(
        sum(weight[i] for i in range(8) if msg[i] != result.bits[i])
        for msg in ("".join(b) for b in itertools.product("01", repeat=8))
    )
    np.testing.assert_allclose([a.flip_cost for a in result.alternatives], all_costs[:20])
    for alt in result.alternatives:
        expected = sum(weight[i] for i in range(8) if alt.bits[i] != result.bits[i])
        assert alt.flip_cost == pytest.approx(expected)


def _evidence(ones: list[int], trials_per_token: int, positions: list[int]) -> TokenEvidence:
    """Hand-made evidence: one scored token per entry, for k = 1 group."""
    return TokenEvidence(
        position_u64=np.array(positions, dtype=np.uint64),
        ones=np.array(ones, dtype=np.int64).reshape(-1, 1),
        trials_per_token=trials_per_token,
        num_tokens=len(ones),
        text_digest=b"\x00" * 16,
    )


def _dummy_detection() -> DetectionResult:
    return DetectionResult(1.0, 0.0, 0.0, 0.0, False, 0.01, 0, 0, None)


def test_list_decoding_recovers_weakly_wrong_bit() -> None:
    """Constructed: true message 0000; bit 2 came out weakly as 1, the others strongly 0."""
    config = WatermarkConfig(groups=1, layers=30)
    # m = 30 trials per token; ones > 15 favours bit 0.
    ev = _evidence([27, 24, 14, 22], 30, [0, 1, 2, 3])
    result = decode(config, ev, 4, _dummy_detection(), list_size=4)
    assert result.bits == "0010"
    _check_list(result, 4)
    bits = [a.bits for a in result.alternatives]
    assert bits[1] == "0000"  # flipping bit 2 costs |2*14 - 30| = 2, the cheapest
    assert result.alternatives[1].flip_cost == 2.0
    assert bits[2:] == ["0011", "0001"]  # then bit 3 (cost 14), then bits 2 and 3 (16)
    assert [a.flip_cost for a in result.alternatives] == [0.0, 2.0, 14.0, 16.0]
    assert result.estimated_bias == pytest.approx((24 + 18 + 2 + 14) / (2 * 120))


def test_list_decoding_finds_true_message_in_simulation() -> None:
    """Short texts decode with errors; the true payload is usually in the top-32 list."""
    wc = WorldCup(KEY)
    rng = np.random.default_rng(2024)
    wrong_top, found = 0, 0
    for _ in range(20):
        payload = Payload.random(16, rng)
        result = wc.decode(simulate(wc, payload, 30, rng), 16, list_size=32)
        _check_list(result, 32)
        if result.bits != payload.bits and "?" not in result.bits:
            wrong_top += 1
            found += payload.bits in [a.bits for a in result.alternatives]
    assert wrong_top >= 5
    assert found >= 0.75 * wrong_top


# --- registry matching ---------------------------------------------------------


def test_match_registry_with_two_bit_errors() -> None:
    """150 tokens, 48-bit payloads: the decoded bits have errors, matching does not."""
    wc = WorldCup(KEY)
    rng = np.random.default_rng(77)
    errors_seen = []
    for _ in range(12):
        payload = Payload.random(48, rng)
        tokens = simulate(wc, payload, 150, rng)
        decoded = wc.decode(tokens, 48).bits
        errors = sum(a != b for a, b in zip(decoded, payload.bits, strict=True))
        errors_seen.append(errors)
        registry = [Payload.random(48, rng).bits for _ in range(1000)]
        index = int(rng.integers(0, 1001))
        registry.insert(index, payload.bits)
        match = wc.match(tokens, registry)
        assert match is not None
        assert match.index == index and match.bits == payload.bits
        assert match.p_value < 1e-20
        assert match.posterior > 0.99
        assert match.runner_up_index is not None and match.runner_up_index != index
        assert match.margin_z > 0
    assert sum(e >= 2 for e in errors_seen) >= 3, errors_seen


def test_match_registry_edge_cases() -> None:
    wc = WorldCup(KEY)
    assert wc.match([1, 2, 3], []) is None
    assert wc.match([], ["0101"]) is None
    with pytest.raises(ValueError, match="same number of bits"):
        wc.match([1, 2, 3], ["0101", "01"])
    single = wc.match([1, 2, 3, 4, 5], ["0101"])
    assert single is not None
    assert single.index == 0 and single.runner_up_index is None and single.posterior == 1.0


def test_an_unregistered_payload_is_not_pinned_on_its_nearest_entry() -> None:
    """A text watermarked with a payload outside the registry (another registry, an
    explicit payload) must not be attributed to the closest entry with confidence;
    the true entry, once registered, is."""
    wc = WorldCup(KEY)
    rng = np.random.default_rng(4242)
    wrong, right = [], []
    for _ in range(12):
        payload = Payload.random(16, rng)
        tokens = simulate(wc, payload, 192, rng)
        near = []
        for distance in (3, 4, 5):  # entries a few bits away, the hardest decoys
            flipped = list(payload.bits)
            for i in rng.choice(16, size=distance, replace=False):
                flipped[i] = "1" if flipped[i] == "0" else "0"
            near.append("".join(flipped))
        decoy = wc.match(tokens, near)
        assert decoy is not None
        wrong.append(decoy.posterior)
        true = wc.match(tokens, [*near, payload.bits])
        assert true is not None and true.bits == payload.bits
        right.append(true.posterior)
    assert max(wrong) == 0.0, wrong  # a strongly evidenced bit contradicts every decoy
    assert min(right) > 0.95, right


def test_match_registry_null_calibration() -> None:
    """On text not watermarked with the key, the Bonferroni p-value is valid."""
    wc = WorldCup(KEY)
    rng = np.random.default_rng(5150)
    registry = [Payload.random(16, rng).bits for _ in range(1000)]
    pvalues = []
    for i in range(500):
        tokens = rng.integers(0, VOCAB, size=(128, 256)[i % 2]).tolist()
        match = wc.match(tokens, registry)
        assert match is not None
        single = wc.match(tokens, [match.bits])
        assert single is not None
        assert match.p_value >= single.p_value
        assert match.p_value == pytest.approx(min(1.0, 1000 * single.p_value), rel=1e-9)
        assert 0.0 <= match.posterior <= 1.0
        pvalues.append(match.p_value)
    p = np.array(pvalues)
    assert float(np.mean(p < 0.01)) <= 0.02
    assert float(np.mean(p < 0.1)) <= 0.1
    assert float(np.median(p)) > 0.5  # Bonferroni over 1000 is conservative


# --- end to end in simulation --------------------------------------------------


@pytest.fixture(scope="module")
def e2e_texts() -> list[tuple[Payload, list[int]]]:
    wc = WorldCup(KEY)
    rng = np.random.default_rng(31337)
    out = []
    for _ in range(30):
        payload = Payload.random(16, rng)
        out.append((payload, simulate(wc, payload, 128, rng)))
    return out


def test_end_to_end_right_key(e2e_texts: list[tuple[Payload, list[int]]]) -> None:
    wc = WorldCup(KEY)
    accuracies = []
    for payload, tokens in e2e_texts:
        result = wc.decode(tokens, 16)
        accuracies.append(bit_accuracy(result.bits, payload.bits))
        assert result.detection.p_value < 1e-6
        assert result.detection.is_watermarked
        assert result.detection.num_symbols == 8
        assert wc.detect(tokens, 16).p_value == result.detection.p_value
        assert wc.detect(tokens).p_value < 1e-4  # payload length unknown: scan + Bonferroni
    assert float(np.mean(accuracies)) >= 0.95


def test_end_to_end_wrong_key(e2e_texts: list[tuple[Payload, list[int]]]) -> None:
    wc = WorldCup(OTHER_KEY)
    correct, pvalues = 0, []
    for payload, tokens in e2e_texts:
        result = wc.decode(tokens, 16)
        correct += sum(a == b for a, b in zip(result.bits, payload.bits, strict=True))
        pvalues.append(result.detection.p_value)
    total = 16 * len(e2e_texts)
    assert 0.4 < correct / total < 0.6
    assert stats.binomtest(correct, total, 0.5).pvalue > 1e-3
    assert sum(p > 0.01 for p in pvalues) >= 27


@pytest.mark.parametrize("variant", list(Variant))
def test_end_to_end_variants(variant: Variant) -> None:
    """Every ablation embeds the payload the decoder reads (incl. the random second family)."""
    config = WatermarkConfig(variant=variant)
    wc = WorldCup(KEY, config)
    rng = np.random.default_rng(len(variant.value))
    accuracies = []
    for _ in range(8):
        payload = Payload.random(16, rng)
        tokens = simulate(wc, payload, 128, rng)
        result = wc.decode(tokens, 16)
        accuracies.append(bit_accuracy(result.bits, payload.bits))
        assert result.detection.p_value < 1e-4
    assert float(np.mean(accuracies)) >= 0.9


@pytest.mark.parametrize("module", [worldcup_core.message, worldcup_core.scheme])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted > 0
    assert result.failed == 0
