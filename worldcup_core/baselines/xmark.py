"""XMark, the shadow-list multi-bit baseline (Xu et al., ACL 2026), behind WorldCup's protocols.

How it is built, and where it departs from the reference and why:
``docs/baselines.md`` (section XMark).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt
from scipy import special

from worldcup_core.baselines.cells import BaselineScheme
from worldcup_core.baselines.segmark import log_convolve, segment_index
from worldcup_core.baselines.sequence import GreenListSequence
from worldcup_core.config import MAX_PAYLOAD_BITS
from worldcup_core.decoder import (
    DEFAULT_LIST_SIZE,
    Alternative,
    DecodeResult,
    RegistryMatch,
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
)
from worldcup_core.scoring import text_digest

if TYPE_CHECKING:
    from worldcup_core.scheme import SequenceWatermark, WatermarkScheme

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]

XMARK_VERSION: Final = "xmark-v1"
PARTS: Final = 4  # each permutation is cut into 4 parts: a block carries 2 payload bits
SYMBOL_BITS: Final = 2
PERMUTATIONS: Final = 2
# under H0 a token falls in the union of its two parts named v with probability 7/16
UNION_NULL: Final = 1.0 - (1.0 - 1.0 / PARTS) ** PERMUTATIONS
SETTINGS: Final = (
    "XMark: blocks of 2 payload bits hashed from the last c=2 generated tokens, two keyed "
    "4-part partitions per context, +delta=2 on the tokens outside both parts named by the "
    "block's value (9/16 of the vocabulary); decoded by the least-hit union per block "
    "(the reference's cTMM); calibrated p-value from the exact null law of the summed "
    "per-block minima"
)


@dataclass(frozen=True)
class XMarkConfig:
    """XMark's generator and detector settings (besides the key).

    ``delta`` is the logit bias on the boosted list (the reference's ``--delta``,
    default 2); ``context_width`` the window every scheme in the comparison shares.

    >>> XMarkConfig().delta
    2.0
    """

    delta: float = 2.0
    context_width: int = 2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.delta) and 0.0 <= self.delta <= 20.0):
            raise ValueError(f"delta must be in [0, 20], got {self.delta}")
        if not 1 <= self.context_width <= 8:
            raise ValueError(f"context_width must be in 1..8, got {self.context_width}")


def num_blocks(num_bits: int) -> int:
    """Blocks of 2 bits for a ``num_bits`` payload (an odd length is zero-padded)."""
    if not 1 <= num_bits <= MAX_PAYLOAD_BITS:
        raise ValueError(f"num_bits must be in 1..{MAX_PAYLOAD_BITS}, got {num_bits}")
    return (num_bits + SYMBOL_BITS - 1) // SYMBOL_BITS


def payload_symbols(bits: str) -> tuple[int, ...]:
    """The 2-bit block values of a payload, most significant bit first, zero-padded."""
    padded = bits.ljust(SYMBOL_BITS * num_blocks(len(bits)), "0")
    return tuple(int(padded[i : i + SYMBOL_BITS], 2) for i in range(0, len(padded), SYMBOL_BITS))


def token_parts(seeds: U64Array | int, tokens: IntArray) -> tuple[IntArray, IntArray]:
    """(q1, q2): the part of each token in the context's first and second partition.

    The two top bit pairs of one keyed SplitMix64 word: independent and uniform on
    0..3 for every token, so the parts hold ``|V|/4 +- O(sqrt|V|)`` tokens each.
    """
    word = splitmix64(seeds, tokens)
    q1 = (word >> np.uint64(62)).astype(np.int64)
    q2 = ((word >> np.uint64(60)) & np.uint64(3)).astype(np.int64)
    return q1, q2


class _Hasher:
    """XMark's keyed functions, under the subkeys ``xmark`` and ``xmark-tiebreak``."""

    __slots__ = ("_ctx", "_tie")

    def __init__(self, key: WatermarkKey) -> None:
        self._ctx = hashlib.blake2b(key=key.subkey("xmark"), digest_size=16)
        self._tie = hashlib.blake2b(key=key.subkey("xmark-tiebreak"), digest_size=8)

    def __repr__(self) -> str:
        return "_Hasher(<keyed>)"

    def seeds(self, packed_context: bytes) -> tuple[int, int]:
        """(partition seed, block hash) of a context."""
        h = self._ctx.copy()
        h.update(packed_context)
        digest = h.digest()
        return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")

    def tiebreak_uniform(self, digest: bytes, blocks: int) -> float:
        h = self._tie.copy()
        h.update(digest + struct.pack("<H", blocks))
        seed = int.from_bytes(h.digest(), "little")
        return float(uniforms_from_u64(splitmix64(seed, np.zeros(1, dtype=np.int64)))[0])


@dataclass(frozen=True)
class XMarkEvidence:
    """Per scored token: its block hash and its parts in the two partitions."""

    block_u64: U64Array  # (N,)
    q1: IntArray  # (N,)
    q2: IntArray  # (N,)
    num_tokens: int
    text_digest: bytes
    _onehot: dict[int, IntArray] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_scored(self) -> int:
        return int(self.q1.shape[0])

    def _blocks(self, blocks: int) -> IntArray:
        cached = self._onehot.get(blocks)
        if cached is None:
            idx = segment_index(self.block_u64, blocks)
            cached = self._onehot[blocks] = (idx[None, :] == np.arange(blocks)[:, None]).astype(
                np.int64
            )
        return cached

    def counts(self, blocks: int) -> tuple[IntArray, IntArray, IntArray]:
        """Per block and value v (``(blocks, 4)`` each): the union counts (tokens in part v
        of either partition, the reference's cTMM counts), the hit counts (part v of the
        first partition plus part v of the second) and the tokens per block (``(blocks,)``)."""
        onehot = self._blocks(blocks)  # (B, N)
        v = np.arange(PARTS)[None, :]
        in1 = (self.q1[:, None] == v).astype(np.int64)  # (N, 4)
        in2 = (self.q2[:, None] == v).astype(np.int64)
        union: IntArray = onehot @ (in1 | in2)
        hits: IntArray = onehot @ (in1 + in2)
        sizes: IntArray = onehot.sum(axis=1)
        return union, hits, sizes


def extract_xmark_evidence(
    hasher: _Hasher, config: XMarkConfig, token_ids: Sequence[int]
) -> XMarkEvidence:
    """Hash a response (response tokens only); first occurrence of each context only."""
    ids = [int(t) for t in token_ids]
    seen: set[bytes] = set()
    seeds, blocks, tokens = [], [], []
    for t, token in enumerate(ids):
        packed = pack_context(context_at(ids, t, config.context_width))
        if packed in seen:
            continue
        seen.add(packed)
        s, b = hasher.seeds(packed)
        seeds.append(s)
        blocks.append(b)
        tokens.append(token)
    q1, q2 = token_parts(np.array(seeds, dtype=np.uint64), np.array(tokens, dtype=np.int64))
    return XMarkEvidence(
        block_u64=np.array(blocks, dtype=np.uint64),
        q1=q1.reshape(len(tokens)),
        q2=q2.reshape(len(tokens)),
        num_tokens=len(ids),
        text_digest=text_digest(ids),
    )


# --------------------------------------------------------------------------- the null law


def _logsumexp(x: FloatArray) -> float:
    return float(special.logsumexp(x)) if x.size else -math.inf


@functools.lru_cache(maxsize=1024)
def min_hits_log_pmf(draws: int) -> FloatArray:
    """``log P(min_v H_v = m)``, m = 0..draws // 4, where ``H ~ Multinomial(draws; 1/4 x 4)``.

    A block of ``T`` scored tokens makes ``draws = 2T`` independent uniform draws over
    the 4 values under H0 (each token's part in each partition), and ``H_v`` counts
    the draws equal to v. Exactly, with only positive terms (finite deep in the tail):
    ``P(min = m) = sum_j C(4, j) N! 4^-N m!^-j [x^(N - j m)] E_m(x)^(4 - j)``, the sum
    over the number ``j`` of values hit exactly ``m`` times, where
    ``E_m(x) = sum_{k > m} x^k / k!`` collects the values hit more often.
    """
    n = draws
    log_fact = special.gammaln(np.arange(n + 1, dtype=np.float64) + 1.0)
    inv = -log_fact  # log(1/k!)
    base = log_fact[n] - n * math.log(PARTS)
    out = np.full(n // PARTS + 1, -np.inf)
    k = np.arange(n + 1)
    for m in range(n // PARTS + 1):
        terms: list[float] = []
        # j = 4: every value hit exactly m times
        if PARTS * m == n:
            terms.append(base + PARTS * inv[m])
        # j = 3: the fourth value takes the rest, more than m
        rest = n - 3 * m
        if rest > m:
            terms.append(math.log(4) + base + 3 * inv[m] + inv[rest])
        # j = 2: two values share r = n - 2m, each more than m
        r2 = n - 2 * m
        if r2 >= 2 * (m + 1):
            ks = k[m + 1 : r2 - m]
            terms.append(math.log(6) + base + 2 * inv[m] + _logsumexp(inv[ks] + inv[r2 - ks]))
        # j = 1: three values share r = n - m, each more than m. The coefficient of a
        # cube is computed in linear space under the exponential tilt theta = r / 3 (its
        # saddle point: the terms that matter are near the maximum, none underflow).
        r1 = n - m
        if r1 >= 3 * (m + 1):
            theta = r1 / 3.0
            ks = k[m + 1 : r1 + 1]
            logv = ks * math.log(theta) + inv[ks]
            shift = float(logv.max())
            v = np.zeros(r1 + 1)
            v[m + 1 :] = np.exp(logv - shift)
            cube = float(np.dot(v, np.convolve(v, v)[: r1 + 1][::-1]))
            if cube > 0.0:
                log_cube = math.log(cube) + 3 * shift - r1 * math.log(theta)
                terms.append(math.log(4) + base + inv[m] + log_cube)
        out[m] = _logsumexp(np.array(terms)) if terms else -np.inf
    out.flags.writeable = False
    return out


def min_sum_log_pmf(sizes: Sequence[int]) -> FloatArray:
    """Exact null law of ``S = sum_b min_v H[b][v]`` over blocks of the given sizes."""
    out = np.zeros(1)
    for size in sizes:
        if size > 0:
            out = log_convolve(out, min_hits_log_pmf(2 * int(size)))
    return out


def log_binom_cdf(k: int, n: int, p: float) -> float:
    """``log P(X <= k)``, ``X ~ Binomial(n, p)``, summed in log space (never underflows)."""
    if k < 0:
        return -math.inf
    j = np.arange(min(k, n) + 1, dtype=np.float64)
    log_pmf = (
        special.gammaln(n + 1.0)
        - special.gammaln(j + 1.0)
        - special.gammaln(n - j + 1.0)
        + j * math.log(p)
        + (n - j) * math.log1p(-p)
    )
    return min(_logsumexp(log_pmf), 0.0)


# --------------------------------------------------------------------------- generation


class XMarkSequence(GreenListSequence):
    """Per-sequence XMark state: the payload's block values on top of the shared bookkeeping."""

    _config: XMarkConfig

    def __init__(self, hasher: _Hasher, config: XMarkConfig, payload: Payload) -> None:
        super().__init__(config)
        self._hasher = hasher
        self._symbols = np.array(payload_symbols(payload.bits), dtype=np.int64)

    def _green(self, context: Context, vocab: IntArray) -> npt.NDArray[np.bool_]:
        """The boosted list: tokens in neither partition's part named by the block's value."""
        seed, block = self._hasher.seeds(pack_context(context))
        value = int(self._symbols[int(segment_index(block, self._symbols.shape[0]))])
        q1, q2 = token_parts(seed, vocab)
        mask: npt.NDArray[np.bool_] = (q1 != value) & (q2 != value)
        return mask


# --------------------------------------------------------------------------- the scheme


class XMark(BaselineScheme[XMarkEvidence]):
    """The XMark baseline with one key and configuration.

    >>> xmark = XMark(WatermarkKey(bytes(32)))
    >>> xmark.detect([1, 2, 3], num_bits=32).num_symbols
    16
    """

    name = "xmark"
    version = XMARK_VERSION

    def __init__(self, key: WatermarkKey, config: XMarkConfig | None = None) -> None:
        self.key = key
        self.config = config or XMarkConfig()
        self._hasher = _Hasher(key)

    def sequence(self, payload: Payload) -> XMarkSequence:
        return XMarkSequence(self._hasher, self.config, payload)

    def evidence(self, token_ids: Sequence[int]) -> XMarkEvidence:
        return extract_xmark_evidence(self._hasher, self.config, token_ids)

    def _blocks_log_p(self, ev: XMarkEvidence, blocks: int) -> tuple[float, float]:
        """(log p, native z) of the exact test of ``S`` with ``blocks`` blocks."""
        union, hits, sizes = ev.counts(blocks)
        total = int(sizes.sum())
        if total == 0:
            return 0.0, 0.0
        live = sizes > 0
        s = int(hits.min(axis=1)[live].sum())
        # the reference has no detector; its decoder's margin in z units is reported beside
        expected = UNION_NULL * sizes[live]
        native = float(
            (expected - union.min(axis=1)[live]).sum()
            / math.sqrt(float((expected * (1.0 - UNION_NULL)).sum()))
        )
        log_pmf = min_sum_log_pmf(sizes.tolist())
        below = _logsumexp(log_pmf[:s])
        u = self._hasher.tiebreak_uniform(ev.text_digest, blocks)
        log_p = min(float(np.logaddexp(below, math.log(u) + log_pmf[s])), 0.0)
        return log_p, native

    def _detect(
        self, ev: XMarkEvidence, num_bits: int | None, significance: float
    ) -> DetectionResult:
        if not 0.0 < significance < 1.0:
            raise ValueError(f"significance must be in (0, 1), got {significance}")
        if num_bits is not None:
            blocks: int | None = num_blocks(num_bits)
            assert blocks is not None
            log_p, z = self._blocks_log_p(ev, blocks)
        else:
            shapes = sorted({num_blocks(b) for b in range(1, MAX_PAYLOAD_BITS + 1)})
            results = [self._blocks_log_p(ev, b) for b in shapes]
            best = min(range(len(results)), key=lambda i: results[i][0])
            log_p = min(results[best][0] + math.log(len(shapes)), 0.0)  # Bonferroni
            z = results[best][1]
            blocks = None
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
            num_symbols=blocks,
        )

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult:
        """Each block's least-hit union (the reference's cTMM, lowest value on ties).

        A block no scored token reached is erased (``??``). ``alternatives`` switch the
        least confident blocks (smallest gap to their runner-up) to the runner-up value,
        cheapest first.
        """
        if list_size < 1:
            raise ValueError(f"list_size must be >= 1, got {list_size}")
        ev = self.evidence(token_ids)
        detection = self._detect(ev, num_bits, significance)
        blocks = num_blocks(num_bits)
        union, _, sizes = ev.counts(blocks)
        order = np.argsort(union, axis=1, kind="stable")
        chosen = order[:, 0]
        live = sizes > 0

        def spell(symbols: Sequence[int]) -> str:
            return "".join(
                format(int(v), "02b") if live[i] else "??" for i, v in enumerate(symbols)
            )[:num_bits]

        bits = spell(chosen.tolist())
        rows = np.arange(blocks)
        least = union[rows, chosen]
        expected = UNION_NULL * sizes
        sd = np.sqrt(np.maximum(expected * (1.0 - UNION_NULL), 1e-12))
        block_z = np.where(live, (expected - least) / sd, 0.0)
        block_p = [
            math.exp(log_binom_cdf(int(least[i]), int(sizes[i]), UNION_NULL)) if live[i] else 1.0
            for i in range(blocks)
        ]
        total = int(sizes.sum())
        boosted = float((sizes - least)[live].sum()) / total if total else 0.0
        per_bit = [i // SYMBOL_BITS for i in range(num_bits)]
        margins = (union[rows, order[:, 1]] - least).astype(np.float64)
        out = [Alternative(bits, 0.0, 0.0)]
        ranked = [int(i) for i in np.argsort(margins, kind="stable") if live[i]]
        seen = {bits}
        for cost, flips in top_flip_sets([float(margins[i]) for i in ranked], 8 * list_size)[1:]:
            if len(out) >= list_size:
                break
            word = chosen.copy()
            for f in flips:
                word[ranked[f]] = order[ranked[f], 1]
            alt = spell(word.tolist())
            if alt not in seen:
                seen.add(alt)
                out.append(Alternative(alt, cost, -cost))
        return DecodeResult(
            bits=bits,
            bit_z=tuple(float(block_z[i]) for i in per_bit),
            bit_p_values=tuple(float(block_p[i]) for i in per_bit),
            erasures=tuple(i for i, b in enumerate(bits) if b == "?"),
            position_token_counts=tuple(int(s) for s in sizes),
            alternatives=tuple(out),
            estimated_bias=boosted - (1.0 - UNION_NULL),
            detection=detection,
        )

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None:
        """Maximum-likelihood registry entry: the fewest hits on its block values.

        For a fixed entry the hits (each token's part equal to its block's value, in
        either partition) are ``2T`` independent draws that hit with probability 1/4
        under H0, so their count is exactly Binomial(2T, 1/4): an exact p-value,
        Bonferroni-corrected for the registry size.
        """
        if not candidates:
            return None
        lengths = {len(c) for c in candidates}
        if len(lengths) != 1:
            raise ValueError("registry entries must all have the same length")
        for c in candidates:
            Payload(c)  # validates
        blocks = num_blocks(len(candidates[0]))
        ev = self.evidence(token_ids)
        _, hits, sizes = ev.counts(blocks)
        draws = 2 * int(sizes.sum())
        if draws == 0:
            return None
        words = np.array([payload_symbols(c) for c in candidates], dtype=np.int64)  # (R, B)
        misses = hits[np.arange(blocks)[None, :], words].sum(axis=1)  # (R,)
        order = np.argsort(misses, kind="stable")
        best = int(order[0])
        m_best = int(misses[best])
        log_p = min(log_binom_cdf(m_best, draws, 1.0 / PARTS) + math.log(len(candidates)), 0.0)
        rate = min(max(m_best / draws, 1e-6), 0.25 - 1e-6)
        llr = math.log(0.25 * (1.0 - rate) / (rate * 0.75))  # per extra hit: evidence against
        posterior = float(1.0 / np.exp(-llr * (misses - m_best).astype(np.float64)).sum())
        runner = int(order[1]) if len(candidates) > 1 else None
        sd = math.sqrt(draws * 0.25 * 0.75)
        margin = (int(misses[runner]) - m_best) if runner is not None else 0.25 * draws - m_best
        return RegistryMatch(
            index=best,
            bits=candidates[best],
            agreement_z=(0.25 * draws - m_best) / sd,
            p_value=math.exp(log_p),
            log10_p_value=log_p / math.log(10.0),
            posterior=posterior,
            runner_up_index=runner,
            margin_z=margin / sd,
        )


if TYPE_CHECKING:  # static proof that XMark fits the harness's protocols

    def _as_scheme(x: XMark) -> WatermarkScheme:
        return x

    def _as_sequence(s: XMarkSequence) -> SequenceWatermark:
        return s
