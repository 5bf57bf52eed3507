"""Keys and the pseudo-random functions of scheme ``worldcup-v1``.

Every other module (encoder, decoder, detector, the MPAC baseline) draws its
randomness from here, so generation and detection cannot drift apart.

Decisions (locked by the test vectors in ``tests/test_prf_vectors.py``; any
change needs a new scheme version, or texts already issued stop decoding):

* **Primitive: keyed BLAKE2b.** One BLAKE2b-512 call yields the 512 g-bits that
  cover k=8 groups x m=64 layers, where HMAC-SHA256 needs two calls of a
  hash that is itself slower; a pre-keyed state is copied per call (~0.35 us
  against ~1.3 us for HMAC in CPython), which is what makes >1000 decodes/s
  possible on one core.
* **Domain-separated subkeys.** ``K_label = BLAKE2b(label, key=secret,
  person="worldcup-v1")`` for the labels ``context``, ``position``,
  ``gvalue``, ``gvalue-alt`` (the random second family of the ablation),
  ``tiebreak`` (randomised exact p-values) and ``mpac`` (the baseline).
* **Context seed** ``r_t = BLAKE2b_{K_context}(x_{t-c} .. x_{t-1})`` over
  the last ``c`` *generated* tokens, each packed as uint32 little-endian, the
  missing ones replaced by the sentinel ``0xFFFFFFFF``. Prompt tokens never
  enter, so a detector holding only the response rebuilds every seed.
* **Position** ``u64(BLAKE2b_{K_position}(r_t)) mod B``: a function of the
  context only, as the paper requires. The raw u64 is kept so one scan serves
  every payload length.
* **g-values** ``BLAKE2b-512_{K_gvalue}(r_t || uint32(x))``; bit ``64*j + l``
  (byte-wise little-endian bit order) is ``g_l^{(j)}``, group ``j`` in 0..7,
  layer ``l`` in 0..63. A layer's bit does not depend on k or m, so the
  configurations nest. The complementary family is ``1 - g``.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

SCHEME_VERSION: Final = "worldcup-v1"
KEY_BYTES: Final = 32
MAX_GROUPS: Final = 8
MAX_LAYERS: Final = 64
SENTINEL: Final = 0xFFFFFFFF
_PERSON: Final = SCHEME_VERSION.encode()

Context = tuple[int, ...]


def _subkey(secret: bytes, label: str) -> bytes:
    return hashlib.blake2b(label.encode(), key=secret, digest_size=32, person=_PERSON).digest()


@dataclass(frozen=True, repr=False)
class WatermarkKey:
    """A 32-byte watermark secret with its derived subkeys.

    The secret never appears in ``repr``/``str``; ``key_id`` is a public
    fingerprint for logs and registries.

    >>> key = WatermarkKey.from_hex("00" * 32)
    >>> key.key_id
    '6fc6c856ebcca4d0'
    """

    secret: bytes = field(compare=True)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != KEY_BYTES:
            raise ValueError(f"a watermark key is exactly {KEY_BYTES} bytes")

    @classmethod
    def generate(cls) -> WatermarkKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> WatermarkKey:
        cleaned = text.strip().lower().removeprefix("0x")
        if len(cleaned) != 2 * KEY_BYTES:
            raise ValueError(
                f"a watermark key is {2 * KEY_BYTES} hex characters, got {len(cleaned)}"
            )
        try:
            return cls(bytes.fromhex(cleaned))
        except ValueError:
            raise ValueError("a watermark key must be hexadecimal") from None

    def hex(self) -> str:
        return self.secret.hex()

    @property
    def key_id(self) -> str:
        return _subkey(self.secret, "key-id")[:8].hex()

    def subkey(self, label: str) -> bytes:
        return _subkey(self.secret, label)

    def __repr__(self) -> str:
        return f"WatermarkKey(key_id={self.key_id!r})"

    __str__ = __repr__


def context_at(tokens: Sequence[int], t: int, width: int) -> Context:
    """The ``width`` generated tokens before index ``t``, sentinel-padded."""
    start = max(0, t - width)
    return (SENTINEL,) * (width - (t - start)) + tuple(int(x) for x in tokens[start:t])


def pack_context(context: Context) -> bytes:
    return struct.pack(f"<{len(context)}I", *context)


@dataclass(frozen=True)
class ScoredItems:
    """The key-independent half of a scan: which tokens are scored, and their bytes.

    Only the first occurrence of each context is scored. Computed once per
    text, it serves every key a provenance search tries.
    """

    indices: tuple[int, ...]  # positions in the response of the scored tokens
    contexts: tuple[bytes, ...]  # packed context of each scored token
    tokens: tuple[bytes, ...]  # the scored token, packed as uint32

    @classmethod
    def of(cls, token_ids: Sequence[int], width: int) -> ScoredItems:
        n = len(token_ids)
        packed = struct.pack(f"<{n + width}I", *([SENTINEL] * width), *token_ids)
        seen: set[bytes] = set()
        indices: list[int] = []
        contexts: list[bytes] = []
        tokens: list[bytes] = []
        for t in range(n):
            ctx = packed[4 * t : 4 * (t + width)]
            if ctx in seen:
                continue
            seen.add(ctx)
            indices.append(t)
            contexts.append(ctx)
            tokens.append(packed[4 * (t + width) : 4 * (t + width + 1)])
        return cls(tuple(indices), tuple(contexts), tuple(tokens))

    def __len__(self) -> int:
        return len(self.indices)


class PRF:
    """Pre-keyed hashers for one key; cheap to copy per call."""

    __slots__ = ("_ctx", "_pos", "_g", "_galt", "_tie", "_mpac")

    def __init__(self, key: WatermarkKey) -> None:
        self._ctx = hashlib.blake2b(key=key.subkey("context"), digest_size=16)
        self._pos = hashlib.blake2b(key=key.subkey("position"), digest_size=8)
        self._g = hashlib.blake2b(key=key.subkey("gvalue"), digest_size=64)
        self._galt = hashlib.blake2b(key=key.subkey("gvalue-alt"), digest_size=64)
        self._tie = hashlib.blake2b(key=key.subkey("tiebreak"), digest_size=8)
        self._mpac = hashlib.blake2b(key=key.subkey("mpac"), digest_size=8)

    def __repr__(self) -> str:
        return "PRF(<keyed>)"

    def context_seed(self, packed_context: bytes) -> bytes:
        h = self._ctx.copy()
        h.update(packed_context)
        return h.digest()

    def position_u64(self, seed: bytes) -> int:
        h = self._pos.copy()
        h.update(seed)
        return int.from_bytes(h.digest(), "little")

    def g_bytes(self, seed: bytes, token: int, *, alternate: bool = False) -> bytes:
        """512 g-bits for (context seed, token) as 64 raw bytes."""
        h = (self._galt if alternate else self._g).copy()
        h.update(seed)
        h.update(struct.pack("<I", token))
        return h.digest()

    def g_bits(
        self,
        seed: bytes,
        tokens: Sequence[int],
        groups: int,
        layers: int,
        *,
        alternate: bool = False,
    ) -> npt.NDArray[np.uint8]:
        """g-values of shape (len(tokens), groups, layers) in {0, 1}."""
        raw = b"".join(self.g_bytes(seed, int(t), alternate=alternate) for t in tokens)
        return unpack_g(raw, len(tokens), groups, layers)

    def scan(
        self, token_ids: Sequence[int], width: int, *, alternate: bool = False
    ) -> tuple[list[int], bytes, bytes]:
        """Hash a response for scoring: (position u64s, g bytes, alt g bytes).

        A token is scored only where its context occurs for the first time,
        mirroring the encoder's repeated-context rule; scored (context, token)
        pairs are therefore distinct and their g-values independent under H0.
        """
        pos_raw, g_raw, alt_raw = self.hash_items(
            ScoredItems.of(token_ids, width), alternate=alternate
        )
        positions = [
            int.from_bytes(pos_raw[i : i + 8], "little") for i in range(0, len(pos_raw), 8)
        ]
        return positions, g_raw, alt_raw

    def hash_items(
        self, items: ScoredItems, *, alternate: bool = False
    ) -> tuple[bytes, bytes, bytes]:
        """The keyed half of :meth:`scan`: (position u64s as little-endian bytes, g bytes,
        alt g bytes). ``items`` is key-independent, so many keys can share it."""
        pos_raw: list[bytes] = []
        g_raw: list[bytes] = []
        alt_raw: list[bytes] = []
        ctx_copy, pos_copy, g_copy, alt_copy = (
            self._ctx.copy,
            self._pos.copy,
            self._g.copy,
            self._galt.copy,
        )
        for ctx, token in zip(items.contexts, items.tokens, strict=True):
            h = ctx_copy()
            h.update(ctx)
            seed = h.digest()
            h = pos_copy()
            h.update(seed)
            pos_raw.append(h.digest())
            item = seed + token
            h = g_copy()
            h.update(item)
            g_raw.append(h.digest())
            if alternate:
                h = alt_copy()
                h.update(item)
                alt_raw.append(h.digest())
        return b"".join(pos_raw), b"".join(g_raw), b"".join(alt_raw)

    def tiebreak_seed(self, data: bytes) -> int:
        h = self._tie.copy()
        h.update(data)
        return int.from_bytes(h.digest(), "little")

    def tiebreak_uniforms(self, data: bytes, count: int) -> npt.NDArray[np.float64]:
        """``count`` keyed uniforms in (0, 1) for the cells of one text.

        A keyed BLAKE2b seed of ``data`` (the text digest and the grouping)
        drives a SplitMix64 counter stream. The subkey is their own, so under
        H0 they are independent of every g-value; they make each cell's
        p-value exactly uniform. The stream is prefix-stable in ``count``.
        """
        raw = splitmix64(self.tiebreak_seed(data), np.arange(count, dtype=np.int64))
        return uniforms_from_u64(raw)

    def mpac_seed(self, packed_context: bytes) -> int:
        """A 64-bit per-context seed for the MPAC baseline's own domain."""
        h = self._mpac.copy()
        h.update(packed_context)
        return int.from_bytes(h.digest(), "little")


def unpack_g(raw: bytes, n: int, groups: int, layers: int) -> npt.NDArray[np.uint8]:
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    return bits.reshape(n, MAX_GROUPS, MAX_LAYERS)[:, :groups, :layers]


_M1: Final = np.uint64(0xBF58476D1CE4E5B9)
_M2: Final = np.uint64(0x94D049BB133111EB)
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(
    seed: int | npt.NDArray[np.uint64], counters: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint64]:
    """SplitMix64 of ``seed ^ (counter * golden)``: a fast vectorised expander.

    Only ever fed keyed BLAKE2b seeds, so its outputs are as secret as the key;
    it spreads one seed over many values where a hash per value would be slow.
    ``seed`` may be an array that broadcasts against ``counters`` (one stream
    per seed, as a provenance search over many keys needs).
    """
    with np.errstate(over="ignore"):
        z = np.asarray(seed, dtype=np.uint64) ^ (counters.astype(np.uint64) * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return out


def uniforms_from_u64(raw: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
    """The top 53 bits as a uniform in (0, 1), never 0 or 1 (their logs are finite)."""
    out: npt.NDArray[np.float64] = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return out


def vocab_bits(seed: int, token_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    """One pseudo-random bit per token id for a context seed (MPAC's partition).

    The seed is cryptographic (``PRF.mpac_seed``); the per-token expansion is
    SplitMix64, vectorised so the baseline can colour a full vocabulary each
    step as the original KGW-style scheme does.
    """
    return (splitmix64(seed, token_ids) >> np.uint64(63)).astype(np.uint8)
