"""Test vectors that lock scheme ``worldcup-v2``'s PRF, and its two backends.

CHANGING ANY EXPECTED VALUE IN THIS FILE MEANS A NEW SCHEME VERSION: texts issued
under ``worldcup-v2`` would stop decoding. The SipHash-1-3 vectors are the
primitive's published ones (key 00..0f, message 00..n-1: the SipHash reference
vectors for 1-3, as in Rust's ``SipHasher13`` tests); the v2 vectors below are ours,
also published in ``docs/scheme-v2.md``.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from worldcup_core import WatermarkConfig, WatermarkKey, WorldCup, siphash
from worldcup_core.prf import (
    PRF,
    PRFV2,
    SCHEME_V2,
    SENTINEL,
    ScoredTokensV2,
    gvalue_words,
    v2_group_bits,
    v2_group_ones,
    v2_gwords,
    v2_positions,
    v2_subkey,
    v2_tiebreak_seeds,
)
from worldcup_core.scoring import symbol_index
from worldcup_core.siphash import as_signed, message_blocks, siphash13

# SipHash-1-3, key 00 01 .. 0f, message 00 01 .. (n-1): output bytes, little-endian.
SIPHASH13_VECTORS = {
    0: "dcc40f055801acab",
    1: "93ca577df39bf4c9",
    7: "4011b19b987d92d3",
    8: "8e9a298d11959036",
    12: "a2d9b457b184a378",
    13: "a7ff29120c766f30",
    15: "5699512a6dd820d3",
    16: "668b907d1add4fcc",
    31: "bcd1218c1fdd7023",
    63: "a8b3bbb76290199d",
}
KEY_BYTES = bytes(range(16))
K0, K1 = struct.unpack("<QQ", KEY_BYTES)

V2_VECTORS = {
    "00..1f": {
        "key": WatermarkKey(bytes(range(32))),
        "position_key": (0x12B467E198EEA5A8, 0x7DAE2EC23152C580),
        "gvalue_key": (0xDD40EE39FE381996, 0x6934CA0FA402784B),
        "alt_key": (0xCBA0C2E529C962B7, 0x365670A71C40522D),
        "tiebreak_key": (0xFA4E430349796632, 0x5F0C8C492B055873),
        "position_11_22": 8669488676417943416,
        "symbol_of_16": 7,
        "gwords_11_22_1234": (0x9503DFAC5DC7C454, 0xCEC9A50DE0B7CBBA),
        "g_bits_k2_m30": (
            "001010100010001111100011101110"  # group 0, layers 0..29
            "100011010111111011110000001010"  # group 1
        ),
        "tiebreak_seed_zero_digest": 13837730193589029162,
    },
    "zero": {
        "key": WatermarkKey(bytes(32)),
        "position_key": (0x2755102637E7A9EA, 0x9A6F28AF7FEAB5A7),
        "gvalue_key": (0x2B56C55646001CDF, 0xAB6A41F5880D57B6),
        "alt_key": (0xD0E44D441608908C, 0xD9A89FBBC5E8F32F),
        "tiebreak_key": (0xA239BAF7304B0C98, 0x5024581BC312A40F),
        "position_11_22": 12501693174230857176,
        "symbol_of_16": 10,
        "gwords_11_22_1234": (0x18D9CDB2DA4DE0F8, 0xC684E88BAFCBC6EA),
        "g_bits_k2_m30": ("000111110000011110110010010110110100110110110011100110110001"),
        "tiebreak_seed_zero_digest": 2710272923434061857,
    },
}


def as_tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint64).view(np.int64))


def as_u64(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().view(np.uint64)


def blocks_of(msg: bytes) -> tuple[list[np.ndarray], np.ndarray]:
    """The reference padding: full 8-byte blocks, then the tail with the length on top."""
    full = len(msg) // 8
    blocks = [np.array(struct.unpack("<Q", msg[8 * i : 8 * i + 8]), np.uint64) for i in range(full)]
    tail = msg[8 * full :] + bytes(7 - (len(msg) - 8 * full)) + bytes([len(msg) & 0xFF])
    return blocks, np.array(struct.unpack("<Q", tail), np.uint64)


# --------------------------------------------------------------------------- SipHash-1-3
@pytest.fixture(params=["compiled", "array-rounds"])
def hash_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every SipHash test runs on both CPU paths: numba's compiled loop and the array rounds."""
    monkeypatch.setattr(siphash, "JIT_ENABLED", request.param == "compiled")
    return str(request.param)


def test_the_compiled_loop_is_active() -> None:
    """numba is a dependency: CPU hashing must not silently fall back to the slow rounds."""
    assert siphash.jit_active()


@pytest.mark.parametrize("length", sorted(SIPHASH13_VECTORS))
def test_siphash13_reference_vectors_on_both_backends(length: int, hash_path: str) -> None:
    expected = struct.unpack("<Q", bytes.fromhex(SIPHASH13_VECTORS[length]))[0]
    blocks, final = blocks_of(bytes(range(length)))
    assert int(siphash13(K0, K1, blocks, final)[0]) == expected
    torch_out = siphash13(K0, K1, [as_tensor(b) for b in blocks], as_tensor(final))
    assert int(as_u64(torch_out)[0]) == expected


def test_siphash13_matches_cpython_hash(hash_path: str) -> None:
    """CPython hashes bytes with its own C SipHash-1-3; with PYTHONHASHSEED=0 the key
    is zero. An independent implementation, checked on random messages of 1..40 bytes."""
    rng = np.random.default_rng(5)
    messages = [rng.bytes(int(n)) for n in rng.integers(1, 41, 60)]
    code = "import sys\nfor h in sys.stdin.read().split():\n    print(hash(bytes.fromhex(h)))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=" ".join(m.hex() for m in messages),
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    for msg, line in zip(messages, result.stdout.split(), strict=True):
        ours = int(siphash13(0, 0, *blocks_of(msg))[0])
        signed = ours - (1 << 64) if ours >= 1 << 63 else ours
        assert signed == int(line) or (signed == -1 and int(line) == -2), msg.hex()


@pytest.mark.parametrize("seed", range(4))
def test_numpy_and_torch_are_bit_identical(seed: int, hash_path: str) -> None:
    """Random per-lane keys and messages of 1..9 words, with and without a tag byte,
    over more lanes than one numpy chunk; on the CPU path under test, against the
    array rounds on numpy as the reference."""
    rng = np.random.default_rng(seed)
    n = 20_000
    words = [rng.integers(0, 2**32, n, dtype=np.uint64) for _ in range(int(rng.integers(1, 10)))]
    tag = None if seed % 2 else int(rng.integers(0, 256))
    k0, k1 = rng.integers(0, 2**64, n, dtype=np.uint64), rng.integers(0, 2**64, n, dtype=np.uint64)
    blocks, final = message_blocks(words, tag)
    expected = siphash13(k0, k1, blocks, final)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(siphash, "JIT_ENABLED", False)
        assert np.array_equal(siphash13(k0, k1, blocks, final), expected)
    t_blocks, t_final = message_blocks([as_tensor(w) for w in words], tag)
    got = siphash13(as_tensor(k0), as_tensor(k1), t_blocks, t_final)
    assert np.array_equal(as_u64(got), expected)
    # scalar keys broadcast the same way on both backends
    scalar = siphash13(int(k0[0]), int(k1[0]), blocks, final)
    assert np.array_equal(as_u64(siphash13(int(k0[0]), int(k1[0]), t_blocks, t_final)), scalar)
    # and a lane computed alone equals the same lane computed in the batch
    one = siphash13(int(k0[7]), int(k1[7]), [b[7:8] for b in blocks], final[7:8])
    assert int(one[0]) == int(expected[7])


def test_message_blocks_match_the_reference_byte_padding() -> None:
    rng = np.random.default_rng(1)
    for n_words in range(1, 9):
        for tag in (None, 0, 200):
            words = [int(x) for x in rng.integers(0, 2**32, n_words)]
            msg = struct.pack(f"<{n_words}I", *words) + (b"" if tag is None else bytes([tag]))
            blocks, final = message_blocks([np.array([w], np.uint64) for w in words], tag)
            ref_blocks, ref_final = blocks_of(msg)
            assert [int(b[0]) for b in blocks] == [int(b[0]) for b in ref_blocks]
            assert int(final[0]) == int(ref_final[0])


# --------------------------------------------------------------------------- v2 vectors
@pytest.mark.parametrize("name", sorted(V2_VECTORS))
def test_v2_vectors(name: str) -> None:
    v = V2_VECTORS[name]
    key = v["key"]
    assert isinstance(key, WatermarkKey)
    prf = PRFV2.of(key)
    for label in ("position_key", "gvalue_key", "alt_key", "tiebreak_key"):
        assert getattr(prf, label) == v[label], label
    ctx = [np.array([11], np.uint64), np.array([22], np.uint64)]
    position = v2_positions(prf.position_key, ctx)
    assert int(position[0]) == v["position_11_22"]
    assert int(symbol_index(position, 16, SCHEME_V2)[0]) == v["symbol_of_16"]
    words = v2_gwords(prf.gvalue_key, ctx, np.array([1234], np.uint64), 2)
    assert tuple(int(w[0]) for w in words) == v["gwords_11_22_1234"]
    bits = v2_group_bits(words[:1], 2, 30)[0]
    assert "".join(str(int(b)) for b in bits.ravel()) == v["g_bits_k2_m30"]
    seed = v2_tiebreak_seeds(prf.tiebreak_key, [bytes(16)])
    assert int(seed[0]) == v["tiebreak_seed_zero_digest"]
    # the same values through torch
    t_ctx = [as_tensor(c) for c in ctx]
    assert int(as_u64(v2_positions(prf.position_key, t_ctx))[0]) == v["position_11_22"]
    t_words = v2_gwords(prf.gvalue_key, t_ctx, as_tensor(np.array([1234], np.uint64)), 2)
    assert tuple(int(as_u64(w)[0]) for w in t_words) == v["gwords_11_22_1234"]
    t_bits = v2_group_bits(t_words[:1], 2, 30)[0]
    assert "".join(str(int(b)) for b in t_bits.ravel()) == v["g_bits_k2_m30"]


def test_subkeys_are_domain_separated_and_differ_from_v1() -> None:
    key = WatermarkKey(bytes(range(32)))
    labels = ("position", "gvalue", "gvalue-alt", "tiebreak", "context", "mpac")
    v2 = {v2_subkey(key.secret, label) for label in labels}
    assert len(v2) == len(labels)
    v1 = {key.subkey(label)[:16] for label in labels}
    as_bytes = {struct.pack("<QQ", *k) for k in v2}
    assert not (as_bytes & v1)  # personalisation separates the versions
    assert "secret" not in repr(PRFV2.of(key)) and key.hex() not in repr(PRFV2.of(key))


@pytest.mark.parametrize(
    ("k", "m"), [(1, 30), (2, 30), (3, 30), (4, 20), (2, 33), (8, 64), (5, 13)]
)
def test_group_layout_and_counts(k: int, m: int) -> None:
    """Group j is word j // (64 // m), bits (j % (64 // m)) * m + l; popcounts agree with bits."""
    rng = np.random.default_rng(k * 100 + m)
    words = [rng.integers(0, 2**64, 300, dtype=np.uint64) for _ in range(gvalue_words(k, m))]
    bits = v2_group_bits(words, k, m)  # (300, k, m)
    per_word = 64 // m
    for j in range(k):
        w = words[j // per_word]
        for layer in (0, m - 1):
            shift = np.uint64((j % per_word) * m + layer)
            assert np.array_equal(bits[:, j, layer], ((w >> shift) & np.uint64(1)).astype(np.uint8))
    assert np.array_equal(v2_group_ones(words, k, m), bits.sum(axis=2))
    t_bits = v2_group_bits([as_tensor(w) for w in words], k, m)
    assert np.array_equal(t_bits.numpy().astype(np.uint8), bits)


def test_scored_tokens_skip_the_padded_start_and_repeated_contexts() -> None:
    ids = [5, 6, 7, 5, 6, 7, 5, 6, 8, 9]
    two = ScoredTokensV2.of(ids, 2)
    assert two.indices.tolist() == [2, 3, 4, 9]  # (5,6) (6,7) (7,5) then (6,8)
    assert [c.tolist() for c in two.context] == [[5, 6, 7, 6], [6, 7, 5, 8]]
    assert two.tokens.tolist() == [7, 5, 6, 9]
    assert ScoredTokensV2.of(ids, 1).indices.tolist() == [1, 2, 3, 9]
    assert ScoredTokensV2.of(ids, 3).indices.tolist() == [3, 4, 5, 9]
    assert len(ScoredTokensV2.of([1, 2], 2)) == 0 and len(ScoredTokensV2.of([], 2)) == 0
    with pytest.raises(ValueError, match="below"):
        ScoredTokensV2.of([1, 2, SENTINEL], 1)


def test_v2_scores_only_what_the_encoder_watermarks() -> None:
    """WorldCup.scored_indices is the v2 rule; v1 still scores the padded start."""
    key = WatermarkKey(bytes(32))
    ids = [3, 4, 3, 4, 9, 5]  # contexts (S,S) (S,3) (3,4) (4,3) (3,4) (4,9)
    v1 = WorldCup(key, WatermarkConfig(version="worldcup-v1"))
    v2 = WorldCup(key, WatermarkConfig(version=SCHEME_V2))
    assert v1.scored_indices(ids) == [0, 1, 2, 3, 5]
    assert v2.scored_indices(ids) == [2, 3, 5]
    assert v2.detect(ids).num_scored_tokens == 3
    assert isinstance(v1.prf, PRF) and isinstance(v2.prf, PRFV2)


def test_g_bits_positions_and_tiebreak_look_uniform() -> None:
    prf = PRFV2.of(WatermarkKey(bytes(range(32))))
    rng = np.random.default_rng(0)
    n = 20_000
    ctx = [rng.integers(0, 50_000, n, dtype=np.uint64) for _ in range(2)]
    tokens = rng.integers(0, 50_000, n, dtype=np.uint64)
    bits = v2_group_bits(v2_gwords(prf.gvalue_key, ctx, tokens, 1), 2, 30).reshape(n, -1)
    assert abs(bits.mean() - 0.5) < 4 * 0.5 / np.sqrt(bits.size)
    corr = np.corrcoef(bits[:, :8].T.astype(float))  # neighbouring layers and groups
    assert np.abs(corr[np.triu_indices(8, 1)]).max() < 4 / np.sqrt(n)
    symbols = symbol_index(v2_positions(prf.position_key, ctx), 12, SCHEME_V2)
    assert stats.chisquare(np.bincount(symbols, minlength=12)).pvalue > 1e-4
    seeds = v2_tiebreak_seeds(prf.tiebreak_key, [rng.bytes(16) for _ in range(2000)])
    assert stats.kstest(seeds.astype(np.float64) / 2.0**64, "uniform").pvalue > 1e-4


def test_torch_lanes_accept_signed_bit_patterns() -> None:
    assert as_signed(2**64 - 1) == -1 and as_signed(2**63) == -(2**63) and as_signed(5) == 5
