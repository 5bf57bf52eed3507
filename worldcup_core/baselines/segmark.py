"""SegMark, the RSBH baseline (Qu et al., USENIX Security 2025), behind WorldCup's protocols.

How it is built, and where it departs from the reference and why:
``docs/baselines.md`` (section SegMark).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt
import reedsolo
from scipy import special

from worldcup_core.baselines.cells import BaselineScheme
from worldcup_core.baselines.sequence import GreenListConfig, GreenListSequence
from worldcup_core.config import MAX_PAYLOAD_BITS
from worldcup_core.decoder import (
    DEFAULT_LIST_SIZE,
    Alternative,
    DecodeResult,
    RegistryMatch,
    llr_scale,
    registry_match,
    top_flip_sets,
)
from worldcup_core.detector import DEFAULT_SIGNIFICANCE, DetectionResult, z_from_log_p
from worldcup_core.message import Payload
from worldcup_core.prf import (
    Context,
    WatermarkKey,
    context_at,
    pack_context,
    splitmix64,
    uniforms_from_u64,
    vocab_bits,
)
from worldcup_core.scoring import log_binom_half_cdf, text_digest

if TYPE_CHECKING:
    from worldcup_core.scheme import SequenceWatermark, WatermarkScheme

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]
_LOG2: Final = math.log(2.0)

SEGMARK_VERSION: Final = "segmark-v1"
# The reference's code search (rs_search.py): rate k/n >= 0.6 and t/n >= 0.15.
MIN_RATE: Final = 0.6
MIN_CORRECTABLE: Final = 0.15
SYMBOL_BITS: Final = range(2, 9)  # GF(2^2) .. GF(2^8), as rs_search.py
# What the evaluation report says about this baseline (``describe_settings``).
SETTINGS: Final = (
    "SegMark: RSBH, segments hashed from the last c=2 generated tokens, Reed-Solomon over "
    "GF(2^m) chosen per payload length by the reference's rule (k/n >= 0.6, t/n >= 0.15, "
    "smallest n: 16 bits RS(6,4) m=4, 24 RS(5,3) m=8, 32 RS(6,4) m=8, 48 RS(10,6) m=8), "
    "green list shifted by the segment value, gamma=0.5, delta=2; calibrated p-value from "
    "the exact null law of the native max-sum score, native z (anti-conservative) beside it"
)


@dataclass(frozen=True)
class RSCode:
    """A Reed-Solomon code: ``k`` message symbols of ``m`` bits into ``n`` symbols.

    >>> rs_code_for(32)
    RSCode(n=6, k=4, m=8)
    >>> rs_code_for(32).correctable
    1
    """

    n: int
    k: int
    m: int

    @property
    def correctable(self) -> int:
        """``t``: symbol errors corrected (with no erasures)."""
        return (self.n - self.k) // 2

    @property
    def alphabet(self) -> int:
        return 1 << self.m

    @property
    def payload_bits(self) -> int:
        return self.k * self.m


@functools.cache
def rs_code_for(num_bits: int) -> RSCode:
    """The code the reference's ``rs_search.py`` picks for ``num_bits``.

    Lengths with no exact code are zero-padded to the next length that has one.
    Codes are restricted to ``n <= 2^m - 1`` (plain, not extended, RS); no
    length the search returns needs more.
    """
    if not 1 <= num_bits <= MAX_PAYLOAD_BITS:
        raise ValueError(f"num_bits must be in 1..{MAX_PAYLOAD_BITS}, got {num_bits}")
    padded = num_bits
    while True:
        best: RSCode | None = None
        for m in SYMBOL_BITS:
            if padded % m:
                continue
            k = padded // m
            for n in range(k + 2, 1 << m):
                if (n - k) % 2 or k / n < MIN_RATE or (n - k) / 2 / n < MIN_CORRECTABLE:
                    continue
                if best is None or n < best.n:
                    best = RSCode(n, k, m)
                break  # the smallest admissible n for this m
        if best is not None:
            return best
        padded += 1


@functools.cache
def code_shapes() -> tuple[tuple[int, int], ...]:
    """The distinct ``(n, m)`` over 1..64 bits: what detection tests when ``b`` is unknown."""
    shapes = {(c.n, c.m) for c in map(rs_code_for, range(1, MAX_PAYLOAD_BITS + 1))}
    return tuple(sorted(shapes))


class ReedSolomon:
    """``reedsolo`` for one code. reedsolo keeps its field tables in module globals
    that each codec swaps in per call, so calls are serialised by a lock."""

    _lock = threading.Lock()

    def __init__(self, code: RSCode) -> None:
        self.code = code
        with self._lock:
            self._codec = reedsolo.RSCodec(
                nsym=code.n - code.k, nsize=(1 << code.m) - 1, c_exp=code.m
            )

    def encode(self, message: Sequence[int]) -> tuple[int, ...]:
        """The ``n`` codeword symbols of ``k`` message symbols (systematic)."""
        if len(message) != self.code.k:
            raise ValueError(f"a message has {self.code.k} symbols, got {len(message)}")
        with self._lock:
            out = self._codec.encode(bytearray(message))
        return tuple(int(s) for s in out)

    def decode(
        self, received: Sequence[int], erasures: Sequence[int] = ()
    ) -> tuple[int, ...] | None:
        """The nearest codeword within the decoding radius, or None if there is none.

        Beyond ``2e + f <= n - k`` this either fails or returns another codeword,
        as any bounded-distance decoder does.
        """
        if len(received) != self.code.n:
            raise ValueError(f"a word has {self.code.n} symbols, got {len(received)}")
        if len(erasures) > self.code.n - self.code.k:
            return None
        try:
            with self._lock:
                _, full, _ = self._codec.decode(bytearray(received), erase_pos=list(erasures))
        except reedsolo.ReedSolomonError:
            return None
        return tuple(int(s) for s in full)


@functools.cache
def reed_solomon(code: RSCode) -> ReedSolomon:
    return ReedSolomon(code)


def payload_symbols(bits: str, code: RSCode) -> tuple[int, ...]:
    """``k`` symbols of ``m`` bits each, most significant bit first, zero-padded."""
    padded = bits.ljust(code.payload_bits, "0")
    return tuple(int(padded[i * code.m : (i + 1) * code.m], 2) for i in range(code.k))


@functools.lru_cache(maxsize=1 << 16)
def encode_payload(bits: str) -> tuple[int, ...]:
    """The ``n`` segment values embedded for a payload."""
    code = rs_code_for(len(bits))
    return reed_solomon(code).encode(payload_symbols(bits, code))


def _symbol_bits(symbols: Sequence[int], m: int) -> str:
    return "".join(format(s, f"0{m}b") for s in symbols)


class _Hasher:
    """The keyed functions of one key: context seeds and tie-break uniforms."""

    __slots__ = ("_ctx", "_tie")

    def __init__(self, key: WatermarkKey) -> None:
        self._ctx = hashlib.blake2b(key=key.subkey("segmark"), digest_size=16)
        self._tie = hashlib.blake2b(key=key.subkey("segmark-tiebreak"), digest_size=8)

    def __repr__(self) -> str:
        return "_Hasher(<keyed>)"

    def seeds(self, packed_context: bytes) -> tuple[int, int]:
        """(colour seed, segment hash) of a context."""
        h = self._ctx.copy()
        h.update(packed_context)
        digest = h.digest()
        return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")

    def tiebreak_uniform(self, digest: bytes, code: tuple[int, int]) -> float:
        h = self._tie.copy()
        h.update(digest + struct.pack("<HH", *code))
        seed = int.from_bytes(h.digest(), "little")
        return float(uniforms_from_u64(splitmix64(seed, np.zeros(1, dtype=np.int64)))[0])


def segment_index(segment_u64: U64Array | int, n: int) -> IntArray:
    """Multiply-shift of the high 32 bits: uniform on 0..n-1."""
    hi = np.asarray(segment_u64, dtype=np.uint64) >> np.uint64(32)
    out: IntArray = ((hi * np.uint64(n)) >> np.uint64(32)).astype(np.int64)
    return out


@dataclass(frozen=True)
class SegMarkConfig(GreenListConfig):
    """:class:`~worldcup_core.baselines.sequence.GreenListConfig`, under SegMark's name.

    >>> SegMarkConfig().delta
    2.0
    """


@dataclass(frozen=True)
class SegMarkEvidence:
    """Per scored token: its colour seed, segment hash and id."""

    colour_seeds: U64Array  # (N,)
    segment_u64: U64Array  # (N,)
    tokens: IntArray  # (N,)
    num_tokens: int
    text_digest: bytes
    _green: dict[int, IntArray] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_scored(self) -> int:
        return int(self.tokens.shape[0])

    def green(self, m: int) -> IntArray:
        """(N, 2^m): whether each scored token is green under each shift ``v``."""
        cached = self._green.get(m)
        if cached is None:
            shifted = self.tokens[:, None] + np.arange(1 << m, dtype=np.int64)[None, :]
            bits = splitmix64(self.colour_seeds[:, None], shifted) >> np.uint64(63)
            cached = self._green[m] = bits.astype(np.int64)
        return cached

    def counts(self, n: int, m: int) -> tuple[IntArray, IntArray]:
        """``COUNT`` (n, 2^m): green tokens per (segment, value), and tokens per segment."""
        seg = segment_index(self.segment_u64, n)
        onehot = (seg[None, :] == np.arange(n)[:, None]).astype(np.int64)  # (n, N)
        count: IntArray = onehot @ self.green(m)
        sizes: IntArray = onehot.sum(axis=1)
        return count, sizes


def extract_segmark_evidence(
    hasher: _Hasher, config: SegMarkConfig, token_ids: Sequence[int]
) -> SegMarkEvidence:
    """Hash a response (response tokens only); first occurrence of each context only."""
    ids = [int(t) for t in token_ids]
    seen: set[bytes] = set()
    colour, segment, tokens = [], [], []
    for t, token in enumerate(ids):
        packed = pack_context(context_at(ids, t, config.context_width))
        if packed in seen:
            continue
        seen.add(packed)
        c, s = hasher.seeds(packed)
        colour.append(c)
        segment.append(s)
        tokens.append(token)
    return SegMarkEvidence(
        colour_seeds=np.array(colour, dtype=np.uint64),
        segment_u64=np.array(segment, dtype=np.uint64),
        tokens=np.array(tokens, dtype=np.int64),
        num_tokens=len(ids),
        text_digest=text_digest(ids),
    )


@functools.lru_cache(maxsize=4096)
def _log_max_pmf(trials: int, alphabet: int) -> FloatArray:
    """``log P(max of `alphabet` i.i.d. Binomial(trials, 1/2) = c)``, c = 0..trials."""
    c = np.arange(trials + 1, dtype=np.int64)
    n = np.full_like(c, trials)
    lower = log_binom_half_cdf(c, n)  # log F(c), accurate where F is small
    upper = log_binom_half_cdf(trials - c - 1, n)  # log P(X > c), by symmetry
    with np.errstate(divide="ignore"):
        log_f = np.where(lower < -_LOG2, lower, np.log1p(-np.exp(upper)))
    log_cdf = alphabet * log_f  # log P(max <= c)
    prev = np.concatenate([[-np.inf], log_cdf[:-1]])
    with np.errstate(divide="ignore"):
        out: FloatArray = log_cdf + np.log(-np.expm1(prev - log_cdf))
    out.flags.writeable = False
    return out


def log_convolve(a: FloatArray, b: FloatArray) -> FloatArray:
    """The log pmf of the sum of two independent variables from their log pmfs."""
    i = np.arange(a.shape[0])[:, None]
    j = np.arange(b.shape[0])[None, :]
    grid = np.full((a.shape[0], a.shape[0] + b.shape[0] - 1), -np.inf)
    grid[i, i + j] = a[:, None] + b[None, :]
    top = grid.max(axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    out: FloatArray = top + np.log(np.exp(grid - top).sum(axis=0))
    return out


def max_sum_log_pmf(sizes: Sequence[int], alphabet: int) -> FloatArray:
    """Exact null law of the native score ``S = sum_i max_v COUNT[i][v]`` (log pmf)."""
    out = np.zeros(1)
    for size in sizes:
        if size > 0:
            out = log_convolve(out, _log_max_pmf(int(size), alphabet))
    return out


def native_score(count: IntArray, sizes: IntArray) -> tuple[int, float]:
    """``S`` and the reference's z, ``(S - T/2) / (sqrt(T)/2)`` (anti-conservative)."""
    total = int(sizes.sum())
    if total == 0:
        return 0, 0.0
    s = int(count.max(axis=1)[sizes > 0].sum())
    return s, (s - 0.5 * total) / (0.5 * math.sqrt(total))


def read_codeword(
    rs: ReedSolomon, count: IntArray, sizes: IntArray
) -> tuple[IntArray, tuple[int, ...] | None]:
    """Each segment's argmax (lowest value on ties), and the codeword decoded from it.

    First the reference's hard decision: the argmax word, with segments no scored
    token reached as erasures. If that is beyond the decoding radius, generalized
    minimum-distance decoding (Forney, 1966): erase the ``s`` least reliable
    segments (smallest margin between the top two counts; ties have margin 0) for
    ``s`` up to ``n - k``, and keep the decoded codeword with the most green tokens.
    A known-unreliable segment costs one unit of the ``n - k`` budget as an erasure
    but two as an error, so this only adds successes to hard decision.
    """
    raw = count.argmax(axis=1)
    empty = [int(i) for i in np.flatnonzero(sizes == 0)]
    word = rs.decode(raw.tolist(), empty)
    if word is not None:
        return raw, word
    top2 = np.sort(count, axis=1)[:, -2:]
    margin = np.where(sizes > 0, top2[:, 1] - top2[:, 0], -1)  # empty segments first
    order = np.argsort(margin, kind="stable")
    rows = np.arange(count.shape[0])
    best: tuple[int, ...] | None = None
    best_green = -1
    for erasures in range(len(empty) + 1, rs.code.n - rs.code.k + 1):
        candidate = rs.decode(raw.tolist(), sorted(order[:erasures].tolist()))
        if candidate is None:
            continue
        green = int(count[rows, np.array(candidate)].sum())
        if green > best_green:
            best, best_green = candidate, green
    return raw, best


class SegMarkSequence(GreenListSequence):
    """Per-sequence SegMark state: the payload's codeword on top of the shared bookkeeping."""

    _config: SegMarkConfig

    def __init__(self, hasher: _Hasher, config: SegMarkConfig, payload: Payload) -> None:
        super().__init__(config)
        self._hasher = hasher
        self._code = rs_code_for(len(payload.bits))
        self._codeword = np.array(encode_payload(payload.bits), dtype=np.int64)

    def _green(self, context: Context, vocab: IntArray) -> npt.NDArray[np.bool_]:
        """The green list, shifted by the value of this context's segment."""
        colour, segment = self._hasher.seeds(pack_context(context))
        value = int(self._codeword[int(segment_index(segment, self._code.n))])
        mask: npt.NDArray[np.bool_] = vocab_bits(colour, vocab + value) == 1
        return mask


class SegMark(BaselineScheme[SegMarkEvidence]):
    """The SegMark (RSBH) baseline with one key and configuration.

    >>> segmark = SegMark(WatermarkKey(bytes(32)))
    >>> segmark.detect([1, 2, 3], num_bits=32).num_symbols
    6
    """

    name = "segmark"
    version = SEGMARK_VERSION

    def __init__(self, key: WatermarkKey, config: SegMarkConfig | None = None) -> None:
        self.key = key
        self.config = config or SegMarkConfig()
        self._hasher = _Hasher(key)

    def sequence(self, payload: Payload) -> SegMarkSequence:
        return SegMarkSequence(self._hasher, self.config, payload)

    def evidence(self, token_ids: Sequence[int]) -> SegMarkEvidence:
        return extract_segmark_evidence(self._hasher, self.config, token_ids)

    def _shape_log_p(self, ev: SegMarkEvidence, n: int, m: int) -> tuple[float, float]:
        """(log p, native z) of the exact test of ``S`` under code shape (n, m)."""
        count, sizes = ev.counts(n, m)
        s, z = native_score(count, sizes)
        if int(sizes.sum()) == 0:
            return 0.0, 0.0
        log_pmf = max_sum_log_pmf(sizes.tolist(), 1 << m)
        strict = float(special.logsumexp(log_pmf[s + 1 :])) if s + 1 < log_pmf.shape[0] else -np.inf
        u = self._hasher.tiebreak_uniform(ev.text_digest, (n, m))
        log_p = min(float(np.logaddexp(strict, math.log(u) + log_pmf[s])), 0.0)
        return log_p, z

    def _detect(
        self, ev: SegMarkEvidence, num_bits: int | None, significance: float
    ) -> DetectionResult:
        if not 0.0 < significance < 1.0:
            raise ValueError(f"significance must be in (0, 1), got {significance}")
        if num_bits is not None:
            code = rs_code_for(num_bits)
            log_p, z = self._shape_log_p(ev, code.n, code.m)
            num_symbols: int | None = code.n
        else:
            shapes = code_shapes()
            results = [self._shape_log_p(ev, n, m) for n, m in shapes]
            best = min(range(len(results)), key=lambda i: results[i][0])
            log_p = min(results[best][0] + math.log(len(shapes)), 0.0)  # Bonferroni
            z = results[best][1]
            num_symbols = None
        p_value = math.exp(log_p)
        return DetectionResult(
            p_value=p_value,
            log10_p_value=log_p / math.log(10.0),
            z_score=z_from_log_p(log_p, ev.num_scored),
            paper_z_score=z,
            is_watermarked=p_value < significance,
            significance=significance,
            num_tokens=ev.num_tokens,
            num_scored_tokens=ev.num_scored,
            num_symbols=num_symbols,
        )

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult:
        """Argmax per segment, then Reed-Solomon errors-and-erasures decoding.

        If the word is beyond the decoding radius, the message segments are read
        as they are (the reference's fallback); unreached ones are erasures ``?``.
        ``alternatives`` lists distinct payloads from re-decoding the word with the
        least confident segments switched to their runner-up value, cheapest first.
        """
        if list_size < 1:
            raise ValueError(f"list_size must be >= 1, got {list_size}")
        ev = self.evidence(token_ids)
        detection = self._detect(ev, num_bits, significance)
        code = rs_code_for(num_bits)
        rs = reed_solomon(code)
        count, sizes = ev.counts(code.n, code.m)
        order = np.argsort(-count, axis=1, kind="stable")
        raw, word = read_codeword(rs, count, sizes)
        erased = [int(i) for i in np.flatnonzero(sizes == 0)]
        if word is None:
            symbols = raw.tolist()
            bits = "".join(
                "?" * code.m if sizes[i] == 0 else format(int(symbols[i]), f"0{code.m}b")
                for i in range(code.k)
            )[:num_bits]
        else:
            symbols = list(word)
            bits = _symbol_bits(symbols[: code.k], code.m)[:num_bits]
        live = sizes > 0
        chosen = count[np.arange(code.n), np.asarray(symbols, dtype=np.int64)]
        total = int(sizes.sum())
        delta = float(chosen[live].sum()) / total - 0.5 if total else 0.0
        seg_z = np.where(live, (2 * chosen - sizes) / np.sqrt(np.maximum(sizes, 1)), 0.0)
        seg_p = np.where(
            live, np.exp(log_binom_half_cdf(sizes - chosen, np.maximum(sizes, 0))), 1.0
        )
        per_bit = [i // code.m for i in range(num_bits)]
        alternatives = self._alternatives(rs, count, order, sizes, erased, bits, delta, list_size)
        return DecodeResult(
            bits=bits,
            bit_z=tuple(float(seg_z[i]) for i in per_bit),
            bit_p_values=tuple(float(seg_p[i]) for i in per_bit),
            erasures=tuple(i for i, b in enumerate(bits) if b == "?"),
            position_token_counts=tuple(int(s) for s in sizes),
            alternatives=alternatives,
            estimated_bias=delta,
            detection=detection,
        )

    @staticmethod
    def _alternatives(
        rs: ReedSolomon,
        count: IntArray,
        order: IntArray,
        sizes: IntArray,
        erased: list[int],
        best_bits: str,
        delta: float,
        list_size: int,
    ) -> tuple[Alternative, ...]:
        code = rs.code
        num_bits = len(best_bits)
        out = [Alternative(best_bits, 0.0, 0.0)]
        if list_size == 1:
            return tuple(out)
        rows = np.arange(code.n)
        margins = (count[rows, order[:, 0]] - count[rows, order[:, 1]]).astype(np.float64)
        live = [int(i) for i in np.argsort(margins, kind="stable") if sizes[i] > 0]
        beta = llr_scale(delta)
        seen = {best_bits}
        for cost, flips in top_flip_sets([float(margins[i]) for i in live], 8 * list_size)[1:]:
            word = order[:, 0].copy()
            for f in flips:
                word[live[f]] = order[live[f], 1]
            decoded = rs.decode(word.tolist(), erased)
            if decoded is None:
                continue
            bits = _symbol_bits(decoded[: code.k], code.m)[:num_bits]
            if bits in seen:
                continue
            seen.add(bits)
            out.append(Alternative(bits, cost, -beta * cost))
            if len(out) == list_size:
                break
        return tuple(out)

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None:
        """Maximum-likelihood registry entry: the most green tokens under its codeword.

        For a fixed entry each scored token is green under its segment's value
        with probability exactly 1/2 under H0, so the agreement is exactly
        Binomial(T, 1/2): an exact p-value, Bonferroni-corrected for the
        registry size. The posterior is WorldCup's (uniform prior over the
        registry, bias estimated from the best entry) with one more competitor: the
        payload Reed-Solomon-decoded from the text itself when it is not in the
        registry. A wrong entry differs from the embedded codeword in at least
        ``n - k + 1`` segments, so a text watermarked with an unregistered payload
        is not pinned on its nearest entry. (WorldCup's rule, a cell leaning
        against the entry's bit beyond chance, has no analogue here: a wrong value
        of a ``2^m``-ary segment sits at chance, it is not pushed below it.)
        """
        if not candidates:
            return None
        lengths = {len(c) for c in candidates}
        if len(lengths) != 1:
            raise ValueError("registry entries must all have the same length")
        for c in candidates:
            Payload(c)  # validates
        code = rs_code_for(len(candidates[0]))
        ev = self.evidence(token_ids)
        count, sizes = ev.counts(code.n, code.m)
        total = int(sizes.sum())
        if total == 0:
            return None
        words = np.array([encode_payload(c) for c in candidates], dtype=np.int64)  # (R, n)
        agreement = count[np.arange(code.n)[None, :], words].sum(axis=1)  # (R,)
        _, decoded = read_codeword(reed_solomon(code), count, sizes)

        def adjust(best: int, delta: float, posterior: float) -> float:
            if decoded is None or (words == np.array(decoded)).all(axis=1).any():
                return posterior
            # the text's own payload is outside the registry: it competes as one more entry
            outside = int(count[np.arange(code.n), np.array(decoded)].sum())
            a_best = int(agreement[best])
            return 1.0 / (1.0 / posterior + math.exp(llr_scale(delta) * (outside - a_best)))

        return registry_match(candidates, agreement, total, adjust)


if TYPE_CHECKING:  # static proof that SegMark fits the harness's protocols

    def _as_scheme(s: SegMark) -> WatermarkScheme:
        return s

    def _as_sequence(s: SegMarkSequence) -> SequenceWatermark:
        return s
