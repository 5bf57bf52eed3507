"""Test vectors that lock the PRF of scheme ``worldcup-v1``, and key handling.

CHANGING ANY EXPECTED VALUE IN THIS FILE MEANS A NEW SCHEME VERSION. These
vectors pin every byte the encoder and the detector derive from a key; if one
of them changes, texts watermarked before the change no longer decode. Do not
"update the vectors": add a scheme version (its own BLAKE2b personalisation or
primitive, as ``worldcup-v2`` did) with vectors of its own.

``tests/fixtures/worldcup_v1_texts.json`` holds texts that the v1 code path
generated on the embedded model before v2 existed, with what that code decoded
from them; the current code must decode them identically, forever.
"""

from __future__ import annotations

import doctest
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import worldcup_core.prf
from worldcup_core import SCHEME_V1, WatermarkConfig, WorldCup
from worldcup_core.prf import (
    PRF,
    SENTINEL,
    WatermarkKey,
    context_at,
    pack_context,
    unpack_g,
    vocab_bits,
)

KEY_0_31 = WatermarkKey(bytes(range(32)))
KEY_ZERO = WatermarkKey(bytes(32))

VECTORS = {
    "00..1f": {
        "key": KEY_0_31,
        "key_id": "11204f2e2f9a569e",
        "subkey_context": "f6fd6b3d1f32881ef9abf406f875d536de3dd577d5f48500061019d6d397a4a4",
        "seed_11_22": "48b6a81459402f8cdd2d9bff20852169",
        "seed_sentinel": "408f7854326e47ca458cf9bd29ac010a",
        "position_u64": 5932932434312637405,
        "g_bytes_1234_prefix": "a9d2658cd2d8b857",
        "g_bits_1234_k2_m30": (
            "100101010100101110100110001100"  # group 0, layers 0..29
            "010100110110110100010110001111"  # group 1, layers 0..29
        ),
        "tiebreak_x_2": (0.8618187968546935, 0.06895153868690679),
        "mpac_seed_11_22": 389869225365879390,
    },
    "zero": {
        "key": KEY_ZERO,
        "key_id": "6fc6c856ebcca4d0",
        "subkey_context": "009fd000e091589cfc52bc73e105f75b4c5cbe95f4499c1c54f4701467cb3ebd",
        "seed_11_22": "2f383e284e69c5c865b8d8b0dd6464ae",
        "seed_sentinel": "9a3d93a79077a2788f8c94d3ec76ad3c",
        "position_u64": 7999271102153395660,
        "g_bytes_1234_prefix": "781072e02a7077d1",
        "g_bits_1234_k2_m30": (
            "000111100000100001001110000001"  # group 0
            "010111101111001110111010001001"  # group 1
        ),
        "tiebreak_x_2": (0.339519779943863, 0.8535865868020263),
        "mpac_seed_11_22": 9514958560123657702,
    },
}
# SplitMix64 expansion of seed 12345 over token ids 0..15 (key-independent).
VOCAB_BITS_12345 = "1101110110000100"


def test_scheme_version() -> None:
    assert SCHEME_V1 == "worldcup-v1"
    assert WorldCup(KEY_ZERO, WatermarkConfig(version=SCHEME_V1)).version == SCHEME_V1


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_vectors(name: str) -> None:
    v = VECTORS[name]
    key = v["key"]
    assert isinstance(key, WatermarkKey)
    prf = PRF(key)

    assert key.key_id == v["key_id"]
    assert key.subkey("context").hex() == v["subkey_context"]

    context = context_at([11, 22], 2, 2)
    assert context == (11, 22)
    assert prf.context_seed(pack_context(context)).hex() == v["seed_11_22"]

    sentinel = context_at([], 0, 2)
    assert sentinel == (SENTINEL, SENTINEL)
    seed = prf.context_seed(pack_context(sentinel))
    assert seed.hex() == v["seed_sentinel"]
    assert prf.position_u64(seed) == v["position_u64"]
    assert prf.g_bytes(seed, 1234).hex()[:16] == v["g_bytes_1234_prefix"]

    bits = prf.g_bits(seed, [1234], 2, 30)
    assert bits.shape == (1, 2, 30)
    assert "".join(map(str, bits.ravel())) == v["g_bits_1234_k2_m30"]

    assert tuple(prf.tiebreak_uniforms(b"x", 2).tolist()) == v["tiebreak_x_2"]
    assert prf.mpac_seed(pack_context(context)) == v["mpac_seed_11_22"]


def test_vocab_bits_vector() -> None:
    bits = vocab_bits(12345, np.arange(16, dtype=np.int64))
    assert bits.dtype == np.uint8
    assert "".join(map(str, bits)) == VOCAB_BITS_12345


def test_vectors_are_self_consistent() -> None:
    """The g-bit vector is the little-endian bit order of the g-byte vector."""
    prf = PRF(KEY_0_31)
    seed = bytes.fromhex(str(VECTORS["00..1f"]["seed_sentinel"]))
    raw = prf.g_bytes(seed, 1234)
    first_byte_bits = format(raw[0], "08b")[::-1]  # little-endian bit order
    assert str(VECTORS["00..1f"]["g_bits_1234_k2_m30"])[:8] == first_byte_bits
    # group 1 starts at bit 64, i.e. byte 8
    assert str(VECTORS["00..1f"]["g_bits_1234_k2_m30"])[30:38] == format(raw[8], "08b")[::-1]


def test_context_at_and_packing() -> None:
    tokens = [5, 6, 7, 8]
    assert context_at(tokens, 0, 3) == (SENTINEL,) * 3
    assert context_at(tokens, 1, 3) == (SENTINEL, SENTINEL, 5)
    assert context_at(tokens, 4, 3) == (6, 7, 8)
    assert context_at(tokens, 2, 1) == (6,)
    assert pack_context((1, 0xFFFFFFFF)) == bytes([1, 0, 0, 0, 255, 255, 255, 255])


# --- keys ----------------------------------------------------------------------


def test_key_hex_round_trip() -> None:
    key = WatermarkKey.generate()
    assert WatermarkKey.from_hex(key.hex()) == key
    assert WatermarkKey.from_hex("0x" + key.hex().upper()) == key
    assert WatermarkKey.from_hex(f"  {key.hex()}\n") == key
    assert KEY_0_31.hex() == bytes(range(32)).hex()
    assert WatermarkKey.generate() != key


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("00" * 31, "64 hex characters, got 62"),
        ("00" * 33, "64 hex characters, got 66"),
        ("", "64 hex characters, got 0"),
        ("zz" * 32, "must be hexadecimal"),
        ("0g" + "00" * 31, "must be hexadecimal"),
    ],
)
def test_bad_hex_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WatermarkKey.from_hex(text)


@pytest.mark.parametrize("secret", [bytes(31), bytes(33), b"", "00" * 32, bytearray(32)])
def test_bad_key_bytes(secret: object) -> None:
    with pytest.raises(ValueError, match="exactly 32 bytes"):
        WatermarkKey(secret)  # type: ignore[arg-type]


def test_repr_and_str_hide_the_secret() -> None:
    for key in (KEY_0_31, KEY_ZERO, WatermarkKey.generate()):
        secret_hex = key.hex()
        for text in (repr(key), str(key), f"{key}", repr(PRF(key)), repr(WorldCup(key))):
            assert secret_hex not in text
            assert secret_hex.upper() not in text
            assert repr(key.secret) not in text
        assert key.key_id in repr(key)


def test_subkeys_are_domain_separated() -> None:
    labels = ["context", "position", "gvalue", "gvalue-alt", "tiebreak", "mpac", "key-id"]
    subkeys = [KEY_0_31.subkey(label) for label in labels]
    assert len(set(subkeys)) == len(labels)
    assert all(len(s) == 32 for s in subkeys)
    assert KEY_0_31.subkey("context") != KEY_ZERO.subkey("context")


# --- scan agrees with the per-call PRF ----------------------------------------


def _reference_scan(
    prf: PRF, tokens: list[int], width: int
) -> tuple[list[int], bytes, bytes, list[int]]:
    seen = set()
    positions, g_raw, alt_raw, scored = [], b"", b"", []
    for t, token in enumerate(tokens):
        context = context_at(tokens, t, width)
        if context in seen:
            continue
        seen.add(context)
        seed = prf.context_seed(pack_context(context))
        positions.append(prf.position_u64(seed))
        g_raw += prf.g_bytes(seed, token)
        alt_raw += prf.g_bytes(seed, token, alternate=True)
        scored.append(t)
    return positions, g_raw, alt_raw, scored


@pytest.mark.parametrize("width", [1, 2, 3])
def test_scan_matches_per_call_methods(width: int) -> None:
    prf = PRF(KEY_0_31)
    rng = np.random.default_rng(width)
    # A small vocabulary so that contexts repeat.
    tokens = rng.integers(0, 6, size=300).tolist()
    positions, g_raw, alt_raw = prf.scan(tokens, width, alternate=True)
    ref_pos, ref_g, ref_alt, scored = _reference_scan(prf, tokens, width)
    assert positions == ref_pos
    assert g_raw == ref_g
    assert alt_raw == ref_alt
    assert len(scored) < len(tokens)  # some contexts were repeated and skipped
    assert len(scored) == len({context_at(tokens, t, width) for t in range(len(tokens))})
    # without `alternate` the alt family is not computed, the rest is identical
    assert prf.scan(tokens, width) == (positions, g_raw, b"")


def test_scan_skips_repeated_contexts_exactly() -> None:
    prf = PRF(KEY_ZERO)
    tokens = [1, 2, 1, 2, 1, 3]
    # contexts (width 2): SS, S1, 12, 21, 12*, 21*  -> t = 4, 5 skipped
    positions, g_raw, _ = prf.scan(tokens, 2)
    assert len(positions) == 4
    assert len(g_raw) == 4 * 64
    positions1, _, _ = prf.scan(tokens, 1)
    # contexts (width 1): S, 1, 2, 1*, 2*, 1*  -> 3 scored
    assert len(positions1) == 3
    assert prf.scan([], 2) == ([], b"", b"")


def test_g_bits_nest_across_k_and_m() -> None:
    """The bit of (group j, layer l) does not depend on the configured k or m."""
    prf = PRF(KEY_0_31)
    seed = prf.context_seed(pack_context((3, 4)))
    tokens = list(range(100, 140))
    full = prf.g_bits(seed, tokens, 8, 64)
    assert full.shape == (40, 8, 64)
    for k, m in itertools.product((1, 2, 3, 8), (1, 17, 30, 64)):
        np.testing.assert_array_equal(prf.g_bits(seed, tokens, k, m), full[:, :k, :m])
    alt = prf.g_bits(seed, tokens, 8, 64, alternate=True)
    np.testing.assert_array_equal(prf.g_bits(seed, tokens, 2, 30, alternate=True), alt[:, :2, :30])
    assert not np.array_equal(alt, full)
    # unpack_g on raw bytes is the same layout
    raw = b"".join(prf.g_bytes(seed, t) for t in tokens)
    np.testing.assert_array_equal(unpack_g(raw, 40, 5, 9), full[:, :5, :9])


def test_g_bits_look_fair_and_independent() -> None:
    prf = PRF(KEY_ZERO)
    seed = prf.context_seed(pack_context((1, 2)))
    bits = prf.g_bits(seed, list(range(2000)), 8, 64).astype(np.float64)  # 1,024,000 bits
    assert abs(bits.mean() - 0.5) < 5 * 0.5 / np.sqrt(bits.size)
    # neighbouring layers and groups uncorrelated
    flat = bits.reshape(2000, -1) - 0.5
    corr = (flat[:, :-1] * flat[:, 1:]).mean() / 0.25
    assert abs(corr) < 5 / np.sqrt(flat[:, :-1].size)


def test_tiebreak_uniforms_in_open_unit_interval() -> None:
    prf = PRF(KEY_0_31)
    u = prf.tiebreak_uniforms(b"digest", 5000)
    assert np.all((u > 0) & (u < 1))
    assert abs(u.mean() - 0.5) < 0.02
    np.testing.assert_array_equal(prf.tiebreak_uniforms(b"digest", 3), u[:3])
    assert not np.array_equal(prf.tiebreak_uniforms(b"other", 3), u[:3])


def test_docstring_examples() -> None:
    result = doctest.testmod(worldcup_core.prf)
    assert result.attempted > 0
    assert result.failed == 0


FIXTURE = Path(__file__).parent / "fixtures" / "worldcup_v1_texts.json"


def test_texts_issued_under_v1_still_decode_identically() -> None:
    """Texts generated by the v1 code before scheme v2 existed decode to the same bits,
    per-bit p-values and known-length p-value as that code gave."""
    frozen = json.loads(FIXTURE.read_text(encoding="utf-8"))["texts"]
    assert len(frozen) == 2
    for item in frozen:
        config = WatermarkConfig(
            groups=item["groups"],
            layers=item["layers"],
            alpha=item["alpha"],
            context_width=item["context_width"],
            version=SCHEME_V1,
        )
        scheme = WorldCup(WatermarkKey.from_hex(item["key_hex"]), config)
        num_bits = len(item["payload"])
        decoded = scheme.decode(item["token_ids"], num_bits)
        assert decoded.bits == item["decoded_bits"]
        assert np.allclose(decoded.bit_p_values, item["bit_p_values"], rtol=1e-12, atol=0)
        detection = scheme.detect(item["token_ids"], num_bits)
        assert detection.num_scored_tokens == item["num_scored_tokens"]
        assert abs(detection.log10_p_value - item["known_length_log10_p"]) < 1e-9
        assert detection.log10_p_value < -6  # and they are, of course, watermarked
        # the same text under a v2 key of the same secret carries nothing
        v2 = WorldCup(scheme.key, WatermarkConfig(groups=item["groups"]))
        assert v2.detect(item["token_ids"], num_bits).p_value > 1e-3
