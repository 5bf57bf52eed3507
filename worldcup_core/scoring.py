"""Token evidence and the exact binomial statistics shared by decoder and detector.

Model-free: only token ids and the key are needed. Each scored token adds,
for every group j, the number of its g-bits that favour bit 0 (``ones``) out
of ``trials_per_token`` bits: m for the complementary variants (bit 0 <=> high
g, bit 1 <=> high g_bar = 1 - g), 2m for the random-second ablation
(``sum g_A + sum (1 - g_B)``). Under H0 -- text written without this key --
scored pairs are distinct, so every cell's count is *exactly*
Binomial(trials, 1/2) given the positions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import special

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.prf import (
    PRF,
    PRFV2,
    SCHEME_V1,
    SCHEME_V2,
    ScoredTokensV2,
    gvalue_words,
    splitmix64,
    uniforms_from_u64,
    unpack_g,
    v2_group_ones,
    v2_gwords,
    v2_positions,
)

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
_LOG2 = math.log(2.0)


@dataclass(frozen=True)
class TokenEvidence:
    """Per scored token: its position hash and per-group counts."""

    position_u64: npt.NDArray[np.uint64]  # (n_scored,)
    ones: I64  # (n_scored, k)
    trials_per_token: int
    num_tokens: int
    text_digest: bytes
    version: str = SCHEME_V1  # sets how the position hash maps to a symbol

    @property
    def num_scored(self) -> int:
        return int(self.position_u64.shape[0])

    @property
    def groups(self) -> int:
        return int(self.ones.shape[1])

    def positions(self, num_symbols: int) -> I64:
        return symbol_index(self.position_u64, num_symbols, self.version)

    def cells(self, num_symbols: int) -> tuple[I64, I64, I64]:
        """(ones, trials) per (position, group), and tokens per position."""
        pos = self.positions(num_symbols)
        counts = np.bincount(pos, minlength=num_symbols).astype(np.int64)
        ones = np.zeros((num_symbols, self.groups), dtype=np.int64)
        np.add.at(ones, pos, self.ones)
        trials = np.repeat(counts[:, None] * self.trials_per_token, self.groups, axis=1)
        return ones, trials, counts


def symbol_index(
    position_u64: npt.NDArray[np.uint64], num_symbols: int | npt.NDArray[np.uint64], version: str
) -> I64:
    """The message position of each scored token: ``p mod B`` (v1), ``((p >> 32) B) >> 32`` (v2);
    ``num_symbols`` may differ per token (the batched step's rows)."""
    if version == SCHEME_V1:
        return (position_u64 % np.uint64(num_symbols)).astype(np.int64)
    hi = position_u64 >> np.uint64(32)
    return ((hi * np.uint64(num_symbols)) >> np.uint64(32)).astype(np.int64)


def extract_evidence_v2(
    prf: PRFV2, config: WatermarkConfig, token_ids: Sequence[int]
) -> TokenEvidence:
    """v2 evidence: SipHash over every scored token at once (numpy)."""
    ids = [int(t) for t in token_ids]
    items = ScoredTokensV2.of(ids, config.context_width)
    return evidence_from_items_v2(prf, config, items, len(ids), text_digest(ids))


def evidence_from_items_v2(
    prf: PRFV2, config: WatermarkConfig, items: ScoredTokensV2, num_tokens: int, digest: bytes
) -> TokenEvidence:
    k, m = config.groups, config.layers
    n = len(items)
    words = gvalue_words(k, m)
    if n:
        positions = v2_positions(prf.position_key, items.context)
        ones = v2_group_ones(v2_gwords(prf.gvalue_key, items.context, items.tokens, words), k, m)
    else:
        positions, ones = np.zeros(0, dtype=np.uint64), np.zeros((0, k), dtype=np.int64)
    trials = m
    if config.variant is Variant.RANDOM_SECOND and n:
        alt = v2_gwords(prf.alt_key, items.context, items.tokens, words)
        ones = ones + m - v2_group_ones(alt, k, m)
        trials = 2 * m
    return TokenEvidence(
        position_u64=positions,
        ones=ones.reshape(n, k),
        trials_per_token=trials,
        num_tokens=num_tokens,
        text_digest=digest,
        version=SCHEME_V2,
    )


def extract_evidence(prf: PRF, config: WatermarkConfig, token_ids: Sequence[int]) -> TokenEvidence:
    """Hash a response (response tokens only, never the prompt)."""
    ids = [int(t) for t in token_ids]
    alternate = config.variant is Variant.RANDOM_SECOND
    hashes = prf.scan(ids, config.context_width, alternate=alternate)
    return evidence_from_hashes(config, hashes, len(ids), text_digest(ids))


def text_digest(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> bytes:
    """Unkeyed digest of the token ids (uint32 little-endian); seeds the tie-break stream."""
    packed = np.asarray(token_ids, dtype="<u4").tobytes()
    return hashlib.blake2b(packed, digest_size=16).digest()


def evidence_from_hashes(
    config: WatermarkConfig,
    hashes: tuple[list[int], bytes, bytes],
    num_tokens: int,
    digest: bytes,
) -> TokenEvidence:
    """Counts per scored token from :meth:`PRF.scan` / :meth:`PRF.hash_items` output."""
    positions, g_raw, alt_raw = hashes
    n = len(positions)
    k, m = config.groups, config.layers
    ones = unpack_g(g_raw, n, k, m).sum(axis=2, dtype=np.int64)
    trials = m
    if config.variant is Variant.RANDOM_SECOND:
        ones = ones + m - unpack_g(alt_raw, n, k, m).sum(axis=2, dtype=np.int64)
        trials = 2 * m
    return TokenEvidence(
        position_u64=np.array(positions, dtype=np.uint64).reshape(n),
        ones=ones.reshape(n, k),
        trials_per_token=trials,
        num_tokens=num_tokens,
        text_digest=digest,
    )


def sidak_log_p(log_p: float, num_tests: int) -> float:
    """``log(1 - (1 - p)^K)`` from ``log p``, finite however small p is.

    >>> round(math.exp(sidak_log_p(math.log(0.01), 2)), 6)
    0.0199
    """
    if num_tests <= 1 or log_p >= 0.0:
        return min(log_p, 0.0)
    if log_p < -40.0:  # (1 - p)^K = 1 - K p to within K p^2
        return min(log_p + math.log(num_tests), 0.0)
    log_1mp = math.log1p(-math.exp(log_p))  # log(1 - p); p < 1 here
    return min(math.log(-math.expm1(num_tests * log_1mp)), 0.0)


_TAIL_TERMS = 512


def log_binom_half_cdf(k: I64, n: I64) -> F64:
    """``log P(X <= k)`` for ``X ~ Binomial(n, 1/2)``, finite deep in the tail.

    ``scipy.stats.binom.logcdf`` is ``log(cdf)`` and returns ``-inf`` once the
    cdf underflows (around 1e-308), which long watermarked texts reach. There
    we sum the series ``pmf(k) * sum_j prod_{t<j} (k-t)/(n-k+t+1)`` in log
    space, adding a geometric bound on the terms left out (an upper bound, so
    the p-value stays conservative).
    """
    k = np.asarray(k, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    with np.errstate(divide="ignore"):
        out = np.where(k < 0, -np.inf, np.log(special.bdtr(np.maximum(k, 0), n, 0.5)))
    deep = (out < -600.0) & (k >= 0)
    if deep.any():
        kd, nd = k[deep][:, None].astype(np.float64), n[deep][:, None].astype(np.float64)
        j = np.arange(_TAIL_TERMS, dtype=np.float64)[None, :]
        ratios = np.clip((kd - j) / (nd - kd + j + 1.0), 0.0, None)
        terms = np.cumprod(ratios, axis=1)
        last = ratios[:, -1]
        rest = np.where(last < 1.0, terms[:, -1] * last / np.maximum(1.0 - last, 1e-300), np.inf)
        series = 1.0 + terms.sum(axis=1) + rest
        out[deep] = log_binom_half_pmf(k[deep], n[deep]) + np.log(series)
    result: F64 = np.asarray(out, dtype=np.float64)
    return result


def log_binom_half_pmf(k: I64, n: I64) -> F64:
    out: F64 = (
        special.gammaln(n + 1.0)
        - special.gammaln(k + 1.0)
        - special.gammaln(n - k + 1.0)
        - n * _LOG2
    )
    return out


def _two_sided_parts(ones: I64, trials: I64) -> tuple[F64, F64]:
    """log P(strictly more extreme), log P(equally extreme) under Bin(t, 1/2)."""
    lo = np.minimum(ones, trials - ones)
    centre = 2 * lo == trials
    log_pmf = log_binom_half_pmf(lo, trials)
    with np.errstate(divide="ignore"):
        strict = np.where(
            centre, np.log1p(-np.exp(log_pmf)), _LOG2 + log_binom_half_cdf(lo - 1, trials)
        )
    equal = np.where(centre, 0.0, _LOG2) + log_pmf
    return np.asarray(strict, dtype=np.float64), np.asarray(equal, dtype=np.float64)


def _two_sided_row(trials: int, size: int) -> tuple[F64, F64]:
    """:func:`_two_sided_parts` for ``lo = 0 .. size - 1`` at one ``trials``: the lower
    tail ``log P(X <= lo - 1)`` as a running log-sum of the pmf, exact up to rounding
    (no underflow: every term is a finite log)."""
    lo = np.arange(size, dtype=np.int64)
    n = np.full(size, trials, dtype=np.int64)
    log_pmf = log_binom_half_pmf(lo, n)
    below = np.concatenate([[-np.inf], np.logaddexp.accumulate(log_pmf)[:-1]])
    centre = 2 * lo == trials
    with np.errstate(divide="ignore"):
        strict = np.where(centre, np.log1p(-np.exp(log_pmf)), _LOG2 + below)
    equal = np.where(centre, 0.0, _LOG2) + log_pmf
    return np.asarray(strict, dtype=np.float64), np.asarray(equal, dtype=np.float64)


def two_sided_log_pvalues(ones: I64, trials: I64) -> F64:
    """Exact (conservative) two-sided binomial log p-values of each cell."""
    strict, equal = _two_sided_parts(ones, trials)
    return np.minimum(np.logaddexp(strict, equal), 0.0)


def randomized_log_pvalues(ones: I64, trials: I64, uniforms: F64) -> F64:
    """Two-sided randomised p-values: exactly Uniform(0, 1) under H0.

    ``p = P(more extreme) + U * P(equally extreme)`` (Lehmann & Romano,
    Testing Statistical Hypotheses, Sec. 3.2).
    """
    strict, equal = _two_sided_parts(ones, trials)
    return np.minimum(np.logaddexp(strict, np.log(uniforms) + equal), 0.0)


def fisher_log_sf(statistic: F64, num_pvalues: I64) -> F64:
    """``log P(chi2_{2C} >= T)``, exact and finite for any T.

    For even degrees of freedom the chi-square tail is a Poisson cdf:
    ``P(chi2_{2C} >= T) = exp(-T/2) * sum_{i<C} (T/2)^i / i!``; summed in log
    space it never underflows (``scipy.stats.chi2.logsf`` does, near 1e-308).
    """
    t = np.asarray(statistic, dtype=np.float64)
    c = np.asarray(num_pvalues, dtype=np.int64)
    width = int(c.max(initial=0))
    if width == 0:
        return np.zeros_like(t)
    y = np.maximum(t / 2.0, 1e-300)
    i = np.arange(width, dtype=np.float64)
    terms = i[None, :] * np.log(y)[:, None] - special.gammaln(i + 1.0)[None, :]
    terms = np.where(i[None, :] < c[:, None], terms, -np.inf)
    with np.errstate(divide="ignore"):
        out = np.where(c > 0, -y + special.logsumexp(terms, axis=1), 0.0)
    result: F64 = np.minimum(out, 0.0)
    return result


class BinomialTable:
    """Exact two-sided tails of Binomial(c * tau, 1/2), tabulated by (count c, lo).

    A cell of ``c`` scored tokens has ``c * tau`` trials (``tau`` = m, or 2m for the
    random-second ablation). Looking its tails up instead of calling the
    incomplete beta function per cell is what lets a provenance search score
    thousands of keys per text. Entries are :func:`_two_sided_parts`'s values, the
    lower tail summed row by row (:func:`_two_sided_row`), equal to the direct path up
    to rounding (tested). The table grows on demand up to ``max_count`` tokens per
    cell (about 8 MB at tau=30); larger cells are computed directly.
    """

    def __init__(self, tau: int, max_count: int = 512) -> None:
        self.tau, self.max_count = tau, max_count
        self._count = 0
        self._offsets = np.zeros(1, dtype=np.int64)
        self._strict = np.zeros(0, dtype=np.float64)
        self._equal = np.zeros(0, dtype=np.float64)

    def _grow(self, count: int) -> None:
        """Tabulate counts up to ``count`` (at least doubling): one row of trials
        ``n = c * tau`` at a time, its lower tail a running log-sum of the pmf. That is
        O(table size) in time and one row in working memory; the deep-tail series of
        :func:`log_binom_half_cdf` per entry would cost 512 terms each, gigabytes and a
        minute for a long text's first decode."""
        target = min(self.max_count, max(count, 2 * self._count, 64))
        counts = np.arange(self._count + 1, target + 1, dtype=np.int64)
        sizes = counts * self.tau // 2 + 1  # lo = min(ones, trials - ones) <= trials / 2
        strict_rows, equal_rows = [], []
        for c, size in zip(counts.tolist(), sizes.tolist(), strict=True):
            strict, equal = _two_sided_row(c * self.tau, size)
            strict_rows.append(strict)
            equal_rows.append(equal)
        self._offsets = np.concatenate([self._offsets, self._offsets[-1] + np.cumsum(sizes)])
        self._strict = np.concatenate([self._strict, *strict_rows])
        self._equal = np.concatenate([self._equal, *equal_rows])
        self._count = target

    def parts(self, ones: I64, counts: I64) -> tuple[F64, F64]:
        """log P(more extreme), log P(equally extreme) for cells of ``counts`` tokens."""
        trials = counts * self.tau
        lo = np.minimum(ones, trials - ones)
        top = int(counts.max(initial=0))
        if top > self._count and self._count < self.max_count:
            self._grow(top)
        inside = counts <= self._count
        strict = np.empty(lo.shape, dtype=np.float64)
        equal = np.empty(lo.shape, dtype=np.float64)
        idx = self._offsets[counts[inside] - 1] + lo[inside]
        strict[inside], equal[inside] = self._strict[idx], self._equal[idx]
        if not inside.all():
            strict[~inside], equal[~inside] = _two_sided_parts(lo[~inside], trials[~inside])
        return strict, equal


_TABLES: dict[int, BinomialTable] = {}


def binomial_table(tau: int) -> BinomialTable:
    table = _TABLES.get(tau)
    if table is None:
        table = _TABLES[tau] = BinomialTable(tau)
    return table


@dataclass(frozen=True)
class GroupedCells:
    """Per segment (a text, or a key in a provenance bank), its cells under one grouping."""

    ones: I64  # (S, B, k)
    counts: I64  # (S, B): scored tokens per position
    log_p: F64  # (S,) Fisher-combined, randomised, exact under H0
    paper_z: F64  # (S,)


def grouped_log_pvalues(
    segment: I64,
    num_segments: int,
    symbols: I64,
    ones: I64,
    tau: int,
    num_symbols: int,
    seeds: npt.NDArray[np.uint64],
) -> GroupedCells:
    """The v2 detection statistic of many segments at once.

    ``segment``, ``symbols`` (n,) and ``ones`` (n, k) describe every scored token;
    ``seeds`` (S,) are the segments' tie-break seeds. Each (position, group) cell
    with at least one token gets a randomised two-sided binomial p-value, uniform
    on (0, 1) under H0 (its uniform is SplitMix64 of the seed at counter
    ``b * k + j``); Fisher's combination is then exactly chi-square with 2C degrees
    of freedom.
    """
    k = int(ones.shape[1])
    row = segment * num_symbols + symbols  # (n,)
    counts = np.bincount(row, minlength=num_segments * num_symbols).reshape(
        num_segments, num_symbols
    )
    per_group = [  # one bincount per group: 4x faster than one over (token, group) pairs
        np.bincount(row, weights=ones[:, j], minlength=num_segments * num_symbols) for j in range(k)
    ]
    ones_c = np.stack(per_group, axis=-1).astype(np.int64).reshape(num_segments, num_symbols, k)
    used_b = counts > 0  # (S, B)
    seg_idx, b_idx = np.nonzero(used_b)
    cell_counts = np.repeat(counts[seg_idx, b_idx], k)
    cell_ones = ones_c[seg_idx, b_idx].ravel()
    counters = (b_idx[:, None] * k + np.arange(k)).ravel()
    cell_seg = np.repeat(seg_idx, k)
    uniforms = uniforms_from_u64(splitmix64(seeds[cell_seg], counters.astype(np.int64)))
    strict, equal = binomial_table(tau).parts(cell_ones, cell_counts)
    log_p = np.minimum(np.logaddexp(strict, np.log(uniforms) + equal), 0.0)
    fisher = np.bincount(cell_seg, weights=-2.0 * log_p, minlength=num_segments)
    num_cells = np.bincount(cell_seg, minlength=num_segments)
    trials = cell_counts * tau
    deviation = np.bincount(
        cell_seg, weights=np.abs(2 * cell_ones - trials), minlength=num_segments
    )
    scale = np.sqrt(np.bincount(cell_seg, weights=trials, minlength=num_segments))
    paper_z = np.divide(deviation, scale, out=np.zeros(num_segments), where=scale > 0)
    log_sf = fisher_log_sf(fisher.astype(np.float64), num_cells.astype(np.int64))
    return GroupedCells(ones_c, counts, log_sf, paper_z)
