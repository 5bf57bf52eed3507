"""The SegMark (RSBH) baseline: the code, the round trip, exact calibration, registry.

Every sample comes from a fixed seed, so outcomes are deterministic; FPR bands are
exact two-sided binomial tests at level 0.001, so a correct implementation passes
for essentially any seed while a miscalibrated one (the native z read as normal,
a non-randomised or one-sided tail, repeated contexts counted twice) fails.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from scipy import stats

from worldcup_core.baselines import BASELINES, SegMark, SegMarkConfig, build_baseline, rs_code_for
from worldcup_core.baselines.segmark import (
    RSCode,
    _log_max_pmf,
    code_shapes,
    encode_payload,
    max_sum_log_pmf,
    payload_symbols,
    reed_solomon,
)
from worldcup_core.message import Payload
from worldcup_core.prf import WatermarkKey, context_at, pack_context, vocab_bits

VOCAB = 1000
KEY = WatermarkKey(bytes(range(32)))
GRID_BITS = (16, 24, 32, 48)  # the paper's payload lengths


def _key(label: str) -> WatermarkKey:
    return WatermarkKey(hashlib.sha256(f"segmark-test:{label}".encode()).digest())


def _generate(
    scheme: SegMark, payload: Payload, n: int, rng: np.random.Generator, scale: float = 2.0
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
    test = stats.binomtest(hits, len(p), alpha)
    assert test.pvalue > 1e-3, f"{what}: {hits}/{len(p)} below {alpha}"


# --- the code ----------------------------------------------------------------------


def _reference_search(b: int) -> tuple[int, int, int] | None:
    """The reference repository's rs_search.py loop, for one length."""
    best: tuple[int, int, int] | None = None
    for m in range(2, 9):
        for k in range(1, 2**m):
            for n in range(k + 2, 2**m + 1):
                t = (n - k) / 2
                if (n - k) % 2 or m * k != b or k / n < 0.6 or t / n < 0.15:
                    continue
                if best is None or best[0] > n:
                    best = (n, k, m)
    return best


def test_code_choice_is_the_reference_search() -> None:
    for b in range(1, 65):
        ref = _reference_search(b)
        code = rs_code_for(b)
        if ref is not None:
            assert (code.n, code.k, code.m) == ref, b
        else:  # padded to the next length the search can encode
            padded = next(p for p in range(b, 100) if _reference_search(p) is not None)
            assert (code.n, code.k, code.m) == _reference_search(padded), b
    assert [rs_code_for(b) for b in GRID_BITS] == [
        RSCode(6, 4, 4),
        RSCode(5, 3, 8),
        RSCode(6, 4, 8),
        RSCode(10, 6, 8),
    ]
    assert len(code_shapes()) == len({(rs_code_for(b).n, rs_code_for(b).m) for b in range(1, 65)})
    with pytest.raises(ValueError, match="num_bits"):
        rs_code_for(65)


def test_reed_solomon_is_mds_by_brute_force() -> None:
    """Every codeword of RS(5, 3) over GF(8): systematic, minimum distance n - k + 1 = 3."""
    code = RSCode(5, 3, 3)
    rs = reed_solomon(code)
    messages = list(itertools.product(range(8), repeat=3))
    words = np.array([rs.encode(msg) for msg in messages])
    assert (words[:, :3] == np.array(messages)).all()
    assert words.max() < 8 and len({tuple(w) for w in words}) == len(messages)
    distance = (words[:, None, :] != words[None, :, :]).sum(axis=2)
    np.fill_diagonal(distance, 99)
    assert distance.min() == code.n - code.k + 1


@pytest.mark.parametrize("bits", GRID_BITS)
def test_ecc_corrects_up_to_its_radius_and_not_beyond(bits: int) -> None:
    code = rs_code_for(bits)
    rs = reed_solomon(code)
    rng = np.random.default_rng(bits)
    beyond_failed = 0
    for _ in range(100):
        word = np.array(rs.encode(rng.integers(0, code.alphabet, size=code.k).tolist()))

        def corrupt(positions: npt.NDArray[np.int64], w: npt.NDArray[np.int64]) -> list[int]:
            out = w.copy()
            out[positions] ^= rng.integers(1, code.alphabet, size=len(positions))  # != original
            return out.tolist()

        order = rng.permutation(code.n)
        # any e errors and f erasures with 2e + f <= n - k are corrected
        for errors in range(code.correctable + 1):
            for erasures in range(code.n - code.k - 2 * errors + 1):
                hit = order[: errors + erasures]
                received = corrupt(hit, word)
                assert rs.decode(received, sorted(hit[errors:].tolist())) == tuple(word)
        # one error past the radius: never the sent codeword (bounded-distance decoder)
        received = corrupt(order[: code.correctable + 1], word)
        decoded = rs.decode(received)
        assert decoded != tuple(word)
        beyond_failed += decoded is None
        # too many erasures: reported as a failure
        assert rs.decode(word.tolist(), list(range(code.n - code.k + 1))) is None
    assert beyond_failed > 0  # the decoder also says so, at least sometimes


def test_payload_symbols_are_msb_first_and_padded() -> None:
    assert payload_symbols("1" + "0" * 15, RSCode(6, 4, 4)) == (8, 0, 0, 0)
    assert payload_symbols("1" * 17, rs_code_for(17)) == (63, 63, 62)  # 18 bits, one pad bit


# --- the exact null law ---------------------------------------------------------------


def test_max_pmf_matches_exact_integer_arithmetic() -> None:
    for trials, alphabet in [(1, 8), (7, 4), (64, 16), (200, 256)]:
        cum = list(itertools.accumulate(math.comb(trials, i) for i in range(trials + 1)))
        powers = [0] + [c**alphabet for c in cum]
        exact = [
            math.log(powers[c + 1] - powers[c]) - trials * alphabet * math.log(2)
            for c in range(trials + 1)
        ]
        np.testing.assert_allclose(_log_max_pmf(trials, alphabet), exact, rtol=0, atol=1e-8)


def test_max_sum_law_matches_enumeration() -> None:
    """Segments of 2 and 3 tokens, 4 values each: all 2^20 colourings enumerated."""
    sizes, alphabet = (2, 3), 4
    total = sum(sizes) * alphabet
    outcomes = (np.arange(2**total)[:, None] >> np.arange(total)) & 1
    first = outcomes[:, : sizes[0] * alphabet].reshape(-1, sizes[0], alphabet).sum(axis=1)
    second = outcomes[:, sizes[0] * alphabet :].reshape(-1, sizes[1], alphabet).sum(axis=1)
    score = first.max(axis=1) + second.max(axis=1)
    freq = np.bincount(score, minlength=sum(sizes) + 1) / 2**total
    np.testing.assert_allclose(np.exp(max_sum_log_pmf(sizes, alphabet)), freq, atol=1e-12)


# --- generation and decoding ---------------------------------------------------------


def test_scheme_identity_and_registry() -> None:
    scheme = SegMark(KEY)
    assert (scheme.name, scheme.version) == ("segmark", "segmark-v1")
    assert BASELINES["segmark"] is SegMark
    assert isinstance(build_baseline("segmark", KEY), SegMark)
    seq = scheme.sequence(Payload("0101"))
    assert seq.modifies_logits
    probs = np.array([0.25, 0.75])
    assert seq.reweight(np.array([3, 4]), probs) is probs
    assert "segmark" in repr(scheme).lower() and KEY.hex() not in repr(scheme)
    with pytest.raises(ValueError, match="gamma"):
        SegMarkConfig(gamma=0.25)


@pytest.mark.parametrize("bits", [16, 32])
def test_generation_recovers_payload(bits: int) -> None:
    rng = np.random.default_rng(bits)
    scheme = SegMark(KEY)
    accuracies, exact = [], 0
    for _ in range(20):
        payload = Payload.random(bits, rng)
        tokens = _generate(scheme, payload, 200, rng)
        result = scheme.decode(tokens, num_bits=bits)
        accuracies.append(_accuracy(result.bits, payload.bits))
        exact += result.bits == payload.bits
        assert result.detection.p_value < 1e-6
        assert scheme.detect(tokens).p_value < 1e-6  # payload length unknown
        assert result.alternatives[0].bits == result.bits
        assert 0.2 < result.estimated_bias < 0.5
        assert len(result.position_token_counts) == rs_code_for(bits).n
    assert np.mean(accuracies) >= 0.95
    assert exact >= 16


def _reference_counts(key: WatermarkKey, tokens: list[int], n: int, m: int) -> np.ndarray:
    """COUNT[i][v] from scratch: keyed BLAKE2b, green under v iff bit(x + v) = 1."""
    hasher = hashlib.blake2b(key=key.subkey("segmark"), digest_size=16)
    count = np.zeros((n, 2**m), dtype=np.int64)
    seen: set[tuple[int, ...]] = set()
    for t, tok in enumerate(tokens):
        ctx = context_at(tokens, t, 2)
        if ctx in seen:
            continue
        seen.add(ctx)
        h = hasher.copy()
        h.update(pack_context(ctx))
        digest = h.digest()
        colour = int.from_bytes(digest[:8], "little")
        segment = ((int.from_bytes(digest[8:], "little") >> 32) * n) >> 32
        count[segment] += vocab_bits(colour, tok + np.arange(2**m, dtype=np.int64))
    return count


def test_decoder_matches_reference_counting() -> None:
    """Same COUNT as a from-scratch decoder; argmax + RS, native z, repeated contexts."""
    rng = np.random.default_rng(2)
    scheme = SegMark(KEY)
    payload = Payload.random(32, rng)
    tokens = _generate(scheme, payload, 120, rng)
    tokens += tokens[:30]  # repeated contexts must be skipped on both sides
    code = rs_code_for(32)
    count = _reference_counts(KEY, tokens, code.n, code.m)
    result = scheme.decode(tokens, num_bits=32)
    ev = scheme.evidence(tokens)
    ours, sizes = ev.counts(code.n, code.m)
    np.testing.assert_array_equal(ours, count)
    assert result.position_token_counts == tuple(sizes.tolist())
    assert ev.num_scored == sizes.sum() == len(set(map(tuple, _contexts(tokens))))
    raw = count.argmax(axis=1)
    decoded = reed_solomon(code).decode(raw.tolist())
    assert decoded is not None and result.bits == "".join(
        format(s, "08b") for s in decoded[: code.k]
    )
    total = int(sizes.sum())
    native = (count.max(axis=1).sum() - total / 2) / (math.sqrt(total) / 2)
    assert result.detection.paper_z_score == pytest.approx(native)


def _contexts(tokens: list[int]) -> list[tuple[int, ...]]:
    return [context_at(tokens, t, 2) for t in range(len(tokens))]


@pytest.mark.parametrize("wrong", [1, 2])
def test_pipeline_corrects_wrong_segments_within_the_radius(wrong: int) -> None:
    """Embed a codeword with ``wrong`` segments replaced: RS(6, 4) repairs one, not two.

    A strong bias makes every segment read as embedded, so the outcome is the code's.
    """
    rng = np.random.default_rng(10 + wrong)
    scheme = SegMark(KEY, SegMarkConfig(delta=20.0))
    code = rs_code_for(32)
    for _ in range(5):
        payload = Payload.random(32, rng)
        seq = scheme.sequence(payload)
        word = np.array(encode_payload(payload.bits))
        hit = rng.choice(code.n, size=wrong, replace=False)
        word[hit] ^= rng.integers(1, code.alphabet, size=wrong)
        seq._codeword = word  # what a reader sees after `wrong` segments are misread
        for _ in range(300):
            logits = seq.process_logits(rng.normal(size=VOCAB))
            probs = np.exp(logits - logits.max())
            seq.observe(int(rng.choice(VOCAB, p=probs / probs.sum())))
        result = scheme.decode(seq.generated, num_bits=32)
        counts, _ = scheme.evidence(seq.generated).counts(code.n, code.m)
        assert (counts.argmax(axis=1) == word).all()  # each segment reads as embedded
        hard = reed_solomon(code).decode(counts.argmax(axis=1).tolist())
        sent = encode_payload(payload.bits)
        if wrong <= code.correctable:
            assert hard == sent and result.bits == payload.bits
        else:  # beyond the radius hard decision cannot return it (GMD may, by luck)
            assert hard != sent


def test_repeated_context_is_not_biased() -> None:
    seq = SegMark(KEY).sequence(Payload("1" * 16))
    for tok in (5, 6, 5, 6):
        seq.observe(tok)
    logits = np.zeros(VOCAB)
    assert seq.process_logits(logits) is logits  # context (5, 6) seen before
    seq.observe(7)
    biased = seq.process_logits(logits)
    assert biased is not logits and set(np.unique(biased)) == {0.0, 2.0}
    assert SegMark(KEY).evidence([5, 6, 5, 6, 7]).num_scored == 4


def test_list_decoding_gives_distinct_payloads() -> None:
    rng = np.random.default_rng(12)
    scheme = SegMark(KEY)
    hits_exact = hits_list = 0
    for _ in range(20):
        payload = Payload.random(32, rng)
        tokens = _generate(scheme, payload, 60, rng)  # short: often misread
        result = scheme.decode(tokens, num_bits=32, list_size=5)
        bits = [a.bits for a in result.alternatives]
        assert bits[0] == result.bits and len(set(bits)) == len(bits) <= 5
        costs = [a.flip_cost for a in result.alternatives]
        assert costs == sorted(costs)
        hits_exact += result.bits == payload.bits
        hits_list += payload.bits in bits
    # the first entry is the best guess, so the list holds every exact hit and more:
    # list decoding must recover payloads the best guess misses (here 4 against 1)
    assert hits_list > hits_exact


def test_bad_input_is_a_clear_error() -> None:
    scheme = SegMark(KEY)
    with pytest.raises(ValueError, match="num_bits"):
        scheme.decode([1, 2, 3], num_bits=0)
    with pytest.raises(ValueError, match="list_size"):
        scheme.decode([1, 2, 3], num_bits=8, list_size=0)
    with pytest.raises(ValueError, match="same length"):
        scheme.match([1, 2, 3], ["0101", "01"])
    with pytest.raises(ValueError, match="significance"):
        scheme.detect([1, 2, 3], significance=1.5)
    empty = scheme.decode([], num_bits=16)
    assert empty.bits == "?" * 16 and empty.detection.p_value == 1.0
    assert scheme.match([], ["0101"]) is None


# --- calibration ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_texts() -> list[list[int]]:
    """Uniform ids at 128 and 256 tokens, and some over 8- and 50-token vocabularies."""
    rng = np.random.default_rng(20240601)
    texts = [rng.integers(0, 49152, size=(128, 256)[i % 2]).tolist() for i in range(2000)]
    for i in range(200):
        vocab = rng.choice(49152, size=(8, 50)[i % 2], replace=False)
        texts.append(vocab[rng.integers(0, len(vocab), size=256)].tolist())
    return texts


def test_null_pvalues_are_exact_and_native_z_is_not(random_texts: list[list[int]]) -> None:
    scheme = SegMark(_key("null"))
    results = [scheme.detect(t, num_bits=32) for t in random_texts]
    p = np.array([r.p_value for r in results])
    _assert_fpr(p, 1e-2, "random text")
    _assert_fpr(p, 1e-3, "random text")
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    z = np.array([r.paper_z_score for r in results])
    assert z.mean() > 5.0  # sums of maxima of 256 binomials: far from centred
    assert np.mean(z > 2.326) > 0.95  # the reference's nominal 1% test fires on null text
    assert min(r.num_scored_tokens for r in results[-200:]) < 64  # repeats were skipped


def test_unknown_length_scan_is_conservative(random_texts: list[list[int]]) -> None:
    scheme = SegMark(_key("scan"))
    p = np.array([scheme.detect(t).p_value for t in random_texts[:60]])
    assert np.mean(p < 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / len(p))
    assert p.min() > 1e-4


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _chunks(ids: list[int]) -> Iterator[list[int]]:
    """Consecutive chunks of alternating lengths 128, 256; the remainder is dropped."""
    start, i = 0, 0
    while start + (128, 256)[i % 2] <= len(ids):
        yield ids[start : start + (128, 256)[i % 2]]
        start += (128, 256)[i % 2]
        i += 1


@pytest.fixture(scope="module")
def human_chunks(data_dir: Path, smollm2_tokenizer: Any) -> list[list[int]]:
    documents = [row["article"] for row in _read_jsonl(data_dir / "cnn_dailymail_test.jsonl")]
    for row in _read_jsonl(data_dir / "eli5_longform_qa.jsonl"):
        documents.extend(row["outputs"])
    encoded = smollm2_tokenizer(documents, add_special_tokens=False)["input_ids"]
    return [chunk for ids in encoded for chunk in _chunks(list(ids))]


def test_human_text_is_calibrated(human_chunks: list[list[int]]) -> None:
    assert len(human_chunks) >= 1000
    p = np.array(
        [
            SegMark(_key(f"human-{i}")).detect(chunk, num_bits=bits).p_value
            for i, bits in enumerate((32, 16))
            for chunk in human_chunks
        ]
    )
    _assert_fpr(p, 1e-2, "human text")
    _assert_fpr(p, 1e-3, "human text")
    assert stats.kstest(p, "uniform").pvalue > 1e-3


def test_wrong_key_sees_nothing() -> None:
    rng = np.random.default_rng(13)
    owner, other = SegMark(_key("owner")), SegMark(_key("other"))
    p_owner, p_other = [], []
    for _ in range(60):
        tokens = _generate(owner, Payload.random(32, rng), 128, rng)
        p_owner.append(owner.detect(tokens, num_bits=32).p_value)
        p_other.append(other.detect(tokens, num_bits=32).p_value)
    assert np.median(p_owner) < 1e-5 and np.mean(np.array(p_owner) < 0.01) >= 0.9
    assert min(p_other) > 1e-3
    assert stats.kstest(p_other, "uniform").pvalue > 1e-3


# --- registry ------------------------------------------------------------------------------


def test_registry_match_finds_true_message() -> None:
    rng = np.random.default_rng(7)
    scheme = SegMark(KEY)
    for _ in range(5):
        registry = [Payload.random(32, rng).bits for _ in range(200)]
        truth = int(rng.integers(len(registry)))
        tokens = _generate(scheme, Payload(registry[truth]), 128, rng)
        match = scheme.match(tokens, registry)
        assert match is not None
        assert match.index == truth and match.bits == registry[truth]
        assert match.p_value < 1e-6 and match.posterior > 0.99
        assert match.runner_up_index is not None and match.margin_z > 0
        # the same text against a registry without its payload: nobody is attributed
        others = registry[:truth] + registry[truth + 1 :]
        stray = scheme.match(tokens, others)
        assert stray is not None and stray.posterior < 0.01


def test_registry_match_is_calibrated_on_null_text() -> None:
    rng = np.random.default_rng(8)
    scheme = SegMark(_key("registry-null"))
    registry = [Payload.random(16, rng).bits for _ in range(50)]
    p = []
    for _ in range(300):
        match = scheme.match(rng.integers(0, 49152, size=128).tolist(), registry)
        assert match is not None
        p.append(match.p_value)
    assert np.mean(np.array(p) < 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / len(p))


# --- the evaluation report -----------------------------------------------------------------


def test_report_states_the_settings_of_every_baseline_in_the_run() -> None:
    from worldcup_core.baselines import BASELINE_SETTINGS, describe_settings
    from worldcup_eval.report import _baseline_settings

    assert set(BASELINE_SETTINGS) == set(BASELINES)  # a new baseline must say its settings
    lines = _baseline_settings(["unwatermarked", "worldcup-k2", "segmark"])
    assert len(lines) == 2 and "segmark" in lines[1] and "RS(6,4)" in lines[1]
    assert "mpac" not in "".join(lines)  # only what the run holds
    assert _baseline_settings(["unwatermarked", "worldcup-k2"]) == []
    assert "delta=2" in describe_settings("segmark") and "gamma=0.5" in describe_settings("mpac")
    with pytest.raises(ValueError, match="unknown baseline"):
        describe_settings("nope")
