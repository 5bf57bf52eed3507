"""Keys and the pseudo-random functions of schemes ``worldcup-v1`` and ``worldcup-v2``.

Every other module (encoder, batched encoder, decoder, detector, provenance,
the baselines) draws its randomness from here, so generation and detection
cannot drift apart. A text decodes only under the version it was issued with;
every stored key version records its scheme, and both versions are kept forever.

Decisions (each version is locked by its own test vectors in
``tests/test_prf_vectors.py`` and ``tests/test_prf_v2.py``; any change needs a
new scheme version, or texts already issued stop decoding).

``worldcup-v1`` (keyed BLAKE2b through ``hashlib``, one call per item):

* **Primitive: keyed BLAKE2b.** One BLAKE2b-512 call yields the 512 g-bits that
  cover k=8 groups x m=64 layers; a pre-keyed state is copied per call.
* **Domain-separated subkeys.** ``K_label = BLAKE2b(label, key=secret,
  person="worldcup-v1")`` for the labels ``context``, ``position``,
  ``gvalue``, ``gvalue-alt`` (the random second family of the ablation),
  ``tiebreak`` (randomised exact p-values) and ``mpac`` (the baseline).
* **Context seed** ``r_t = BLAKE2b_{K_context}(x_{t-c} .. x_{t-1})`` over
  the last ``c`` *generated* tokens, each packed as uint32 little-endian, the
  missing ones replaced by the sentinel ``0xFFFFFFFF``. Prompt tokens never
  enter, so a detector holding only the response rebuilds every seed.
* **Position** ``u64(BLAKE2b_{K_position}(r_t)) mod B``.
* **g-values** ``BLAKE2b-512_{K_gvalue}(r_t || uint32(x))``; bit ``64*j + l``
  (byte-wise little-endian bit order) is ``g_l^{(j)}``. The complementary
  family is ``1 - g``.

``worldcup-v2`` (the default for new keys): the same roles, but every function is
computed for whole arrays at once, in numpy on the CPU or torch on any device
(:mod:`worldcup_core.siphash`), bit-identically. v1's per-item ``hashlib``
calls can be neither batched nor run on a GPU; on a GPU they cut throughput
to 0.58-0.64x at batch 64.

* **Primitive: SipHash-1-3** (128-bit key, 64-bit output), a keyed PRF for
  short inputs made of 64-bit add-rotate-xor, so it vectorises on any device.
  Measured here per evaluation in numpy: SipHash-1-3 60 ns, SipHash-2-4 88 ns,
  ChaCha20 400 ns a block (of which we would use 64-124 of its 512 bits).
  Detection costs two evaluations per scored token and key, so this choice sets
  the decode and provenance throughput. One round per block and three at
  finalisation are what SipHash's designer recommends as sufficient for a PRF
  (Aumasson, "Too Much Crypto", 2020); CPython and Rust hash with it.
  Philox and other counter-based generators are fast but not PRFs for secret keys.
* **Domain-separated subkeys.** ``K_label = BLAKE2b-128(label, key=secret,
  person="worldcup-v2")`` for ``position``, ``gvalue``, ``gvalue-alt`` and
  ``tiebreak``; a subkey is the SipHash key ``(k0, k1)``, little-endian.
* **Context**: the last ``c`` generated tokens, uint32 little-endian,
  sentinel-padded as in v1. But the first ``c`` tokens of a response, whose
  context holds the sentinel, are never watermarked nor scored: their context
  is the same in every text under a key, so their positions and g-values would
  repeat and leak.
* **Position** ``p64 = SipHash_{K_position}(ctx)``, a function of the context
  only; the symbol of a B-symbol payload is ``((p64 >> 32) * B) >> 32``
  (multiply-shift range reduction). Unlike ``mod B`` it makes every grouping a
  coarsening of the finer ones by intervals, so the cells of any B that divides
  the slot count ``S = ceil(64 / k)`` are unions of slots: detection with an
  unknown payload length is then *one* exact test on the slots, with no
  multiple-testing correction (see :mod:`worldcup_core.detector`).
* **g-values** ``w_i = SipHash_{K_gvalue}(ctx || uint32(x) || uint8(i))``;
  ``G = 64 // m`` groups share a word: group ``j`` is word ``j // G``, its layer
  ``l`` is bit ``(j % G) * m + l``. For k=2, m=30 one evaluation serves both
  groups. The complementary family is ``1 - g``; the ablation's random second
  family uses ``K_gvalue-alt``.
* **Tie-break stream**: a keyed seed ``SipHash_{K_tiebreak}(text digest)`` per
  text, expanded by SplitMix64; cell ``(b, j)`` of any grouping takes counter
  ``b * k + j``.
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
import torch

from worldcup_core.siphash import Lanes, message_blocks, siphash13

SCHEME_V1: Final = "worldcup-v1"
SCHEME_V2: Final = "worldcup-v2"
SCHEME_VERSIONS: Final = (SCHEME_V1, SCHEME_V2)
KEY_BYTES: Final = 32
MAX_GROUPS: Final = 8
MAX_LAYERS: Final = 64
SENTINEL: Final = 0xFFFFFFFF
_PERSON: Final = SCHEME_V1.encode()  # v1's BLAKE2b personalisation; v2 has its own

Context = tuple[int, ...]
U64Array = npt.NDArray[np.uint64]


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


# --------------------------------------------------------------------------- worldcup-v2

_PERSON_V2: Final = SCHEME_V2.encode()
SipKey = tuple[int, int]  # a SipHash key (k0, k1), as little-endian words


def v2_subkey(secret: bytes, label: str) -> SipKey:
    """``BLAKE2b-128(label, key=secret, person="worldcup-v2")`` as a SipHash key."""
    d = hashlib.blake2b(label.encode(), key=secret, digest_size=16, person=_PERSON_V2).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def gvalue_words(groups: int, layers: int) -> int:
    """How many 64-bit g-words a (k, m) configuration needs: ``ceil(k / (64 // m))``."""
    per_word = 64 // layers
    return -(-groups // per_word)


@dataclass(frozen=True, repr=False)
class PRFV2:
    """The subkeys of one key under scheme ``worldcup-v2``; the functions below take them.

    Keys are plain ``(k0, k1)`` ints so callers can stack many keys into lane
    arrays (a batch of rows, a provenance bank) and hash them in one pass.
    """

    position_key: SipKey
    gvalue_key: SipKey
    alt_key: SipKey
    tiebreak_key: SipKey

    @classmethod
    def of(cls, key: WatermarkKey) -> PRFV2:
        secret = key.secret
        return cls(
            v2_subkey(secret, "position"),
            v2_subkey(secret, "gvalue"),
            v2_subkey(secret, "gvalue-alt"),
            v2_subkey(secret, "tiebreak"),
        )

    def __repr__(self) -> str:
        return "PRFV2(<keyed>)"

    __str__ = __repr__


def v2_positions(key: tuple[Lanes | int, Lanes | int], context: Sequence[Lanes]) -> Lanes:
    """``p64 = SipHash(ctx)`` per lane; ``context`` is c arrays of uint32 token values."""
    blocks, final = message_blocks(context)
    return siphash13(key[0], key[1], blocks, final)


def v2_gwords(
    key: tuple[Lanes | int, Lanes | int],
    context: Sequence[Lanes],
    tokens: Lanes,
    num_words: int,
) -> list[Lanes]:
    """The g-words ``w_i = SipHash(ctx || x || i)``, ``i < num_words``, per lane."""
    out = []
    for i in range(num_words):
        blocks, final = message_blocks([*context, tokens], tag=i)
        out.append(siphash13(key[0], key[1], blocks, final))
    return out


def v2_group_bits(words: Sequence[Lanes], groups: int, layers: int) -> Lanes:
    """Unpack g-words into bits of shape (..., groups, layers), values 0/1, same backend."""
    per_word = 64 // layers
    shifts = [(j % per_word) * layers + np.arange(layers) for j in range(groups)]
    first = words[0]
    if isinstance(first, torch.Tensor):
        shift = torch.tensor(np.stack(shifts), device=first.device)  # (k, m)
        stacked = torch.stack([words[j // per_word] for j in range(groups)], dim=-1)
        out: Lanes = (stacked[..., :, None] >> shift) & 1  # arithmetic shift: masked to 1 bit
        return out
    shift_np = np.stack(shifts).astype(np.uint64)
    stacked_np = np.stack([words[j // per_word] for j in range(groups)], axis=-1)
    return ((stacked_np[..., :, None] >> shift_np) & np.uint64(1)).astype(np.uint8)


def v2_group_ones(words: Sequence[U64Array], groups: int, layers: int) -> npt.NDArray[np.int64]:
    """Per-group counts of g = 1 over the m layers (numpy): what detection needs."""
    per_word = 64 // layers
    mask = np.uint64((1 << layers) - 1)
    cols = [
        np.bitwise_count((words[j // per_word] >> np.uint64((j % per_word) * layers)) & mask)
        for j in range(groups)
    ]
    return np.stack(cols, axis=-1).astype(np.int64)


def v2_tiebreak_seeds(key: tuple[Lanes | int, Lanes | int], digests: Sequence[bytes]) -> U64Array:
    """One keyed 64-bit seed per text digest (16 bytes each), numpy."""
    raw = np.frombuffer(b"".join(digests), dtype="<u4").astype(np.uint64).reshape(-1, 4)
    blocks, final = message_blocks([raw[:, i] for i in range(4)])
    out: U64Array = siphash13(key[0], key[1], blocks, final)
    return out


@dataclass(frozen=True)
class ScoredTokensV2:
    """Which tokens of a response v2 scores: t >= c, first occurrence of the context.

    Key-independent, so a provenance search computes it once per text.
    """

    indices: npt.NDArray[np.int64]  # (n,) positions in the response
    context: tuple[U64Array, ...]  # c arrays (n,): x_{t-c} .. x_{t-1}
    tokens: U64Array  # (n,) x_t

    @classmethod
    def of(cls, token_ids: Sequence[int] | npt.NDArray[np.integer], width: int) -> ScoredTokensV2:
        ids = np.asarray(token_ids, dtype=np.uint64).reshape(-1)
        n = ids.size - width
        if n <= 0:
            empty = np.zeros(0, dtype=np.uint64)
            return cls(np.zeros(0, dtype=np.int64), (empty,) * width, empty)
        if int(ids.max()) >= SENTINEL:
            raise ValueError(f"token ids must be below {SENTINEL:#x}")
        columns = [ids[j : j + n] for j in range(width)]  # x_{t-c+j} for t = c .. len-1
        if width <= 2:  # the context packs exactly into one uint64
            keys = (columns[0] << np.uint64(32)) | columns[1] if width == 2 else columns[0]
            # First occurrences without np.unique's overhead (this runs once per text): a
            # stable sort puts each repeat right after an earlier equal key.
            order = np.argsort(keys, kind="stable")
            ranked = keys[order]
            repeat = ranked[1:] == ranked[:-1]
            if not repeat.any():
                return cls(np.arange(width, width + n, dtype=np.int64), tuple(columns), ids[width:])
            keep = np.ones(n, dtype=bool)
            keep[order[1:][repeat]] = False
            first = np.flatnonzero(keep)
        else:
            _, first = np.unique(np.stack(columns, axis=1), axis=0, return_index=True)
            first.sort()
        return cls(
            first + width,
            tuple(col[first] for col in columns),
            ids[first + width],
        )

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def take(self, rows: npt.NDArray[np.int64]) -> ScoredTokensV2:
        return ScoredTokensV2(
            self.indices[rows], tuple(c[rows] for c in self.context), self.tokens[rows]
        )
