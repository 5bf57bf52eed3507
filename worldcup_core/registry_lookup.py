"""Registry matching whose cost does not grow with the registry (list decoding).

The exhaustive match (:func:`worldcup_core.decoder.match_registry`) scores every
issued payload. Here the decoder goes the other way: the payload is a keyed
permutation of the message id (:class:`~worldcup_core.message.MessageIdCodec`), so
the most likely payloads given the per-bit evidence are inverted to message ids and
the store is asked about just those.

* **The list.** A payload's log-likelihood is ``-beta * flip cost`` (flipping bit i
  of the decoded bits costs ``|2*ones_i - trials_i|``, see :mod:`decoder`), so the
  likeliest payloads flip the weakest bits. The list is every subset of the ``m``
  weakest bits (``2^m = list_size``, 4 096 by default), cheapest first. Any payload
  flipping a stronger bit costs at least the (m+1)-th weakest bit's cost, so the list
  holds *every* payload cheaper than that (``complete_below``).
* **Exactness.** The first issued payload of the list is then the registry's
  maximum-likelihood entry whenever its cost is below ``complete_below``: the same
  entry the exhaustive match picks (ties to the lower message id, as there).
* **p-value.** The exact binomial tail of the best entry's agreement, Bonferroni-
  corrected by the registry's size (a counter the store keeps at write time), as in
  the exhaustive path.
* **Posterior.** Uniform over the registry, as in the exhaustive path, for the entries
  found in the list (a recorded client payload weighs its texts:
  :func:`worldcup_core.decoder.prior_logits`); the registry's other entries are not
  seen, but their payloads are keyed-random among the payloads outside the list, so
  their expected contribution is ``(N - found) / (2^b - L)`` times the likelihood mass
  outside the list, which factorises over bits: ``prod_i (1 + exp(-beta c_i)) -
  sum_list``.
* **Weighted cells** (:mod:`worldcup_core.detector_model`: token weights from the
  served model): the same list, exhaustive match and completeness bound, on the
  weighted flip costs ``|2S - M|``; the p-value is the exact tail of the weighted
  agreement (:meth:`~worldcup_core.detector_model.WeightedCells.upper_log_sf`), again
  Bonferroni over the registry; the posterior's ``beta`` is scaled by
  :attr:`TextCells.llr_factor` (a weighted unit is not a g-bit's worth). Every
  argument above holds for any nonnegative costs, so the list's first issued payload
  is the registry's weighted-ML entry whenever its cost is below ``complete_below``,
  as the exhaustive match on the same cells finds.
* **Expired ids** (registry retention) stay candidates: a text issued for an expired
  entry matches it and the answer says so, instead of being pinned on a live
  neighbour.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import overload

import numpy as np
import numpy.typing as npt

from worldcup_core.decoder import (
    RegistryMatch,
    contradicted,
    llr_scale,
    prior_logits,
    registry_log_p,
    registry_match,
    registry_match_of,
)
from worldcup_core.detector_model import WeightedCells
from worldcup_core.scoring import I64

LIST_SIZE = 4096  # payloads looked up per text: the likeliest, exactly, over SEARCH_BITS
SEARCH_BITS = 24  # the weakest bits the list flips (two halves of 2^12 subsets each)
EXHAUSTIVE_MIN = 2048  # registries this small are always scored exhaustively
EXHAUSTIVE_MAX = 65_536  # and none bigger (the service caches their payloads)


def use_list(num_bits: int, registry_size: int) -> bool:
    """Whether to look a ``num_bits`` payload up by list rather than exhaustively.

    The exhaustive match can be confident about an entry ranked r-th likeliest among
    all 2^b payloads only while few other entries are likelier, i.e. while
    ``r * N / 2^b`` is small; the list covers r <= LIST_SIZE. So the list takes over
    once ``N >= 2^b / (16 LIST_SIZE)`` (65 536 entries at 32 bits), within
    [EXHAUSTIVE_MIN, EXHAUSTIVE_MAX]: longer payloads in big registries go to the
    list too, and miss more of the exhaustive answers for texts with many bit errors
    (docs/benchmarks.md gives the rates)."""
    threshold = (1 << num_bits) // (16 * LIST_SIZE)
    return registry_size > min(EXHAUSTIVE_MAX, max(EXHAUSTIVE_MIN, threshold))


U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class TextCells:
    """One text's payload cells, summarised for matching payloads against them."""

    bit_costs: F64  # (b,) flipping each decoded bit costs this much agreement
    decoded: int  # the decoded payload (the cheapest), ties to bit 0
    agreement_max: int  # agreement of the decoded payload (pad bits included)
    total: int  # scored g-bits, pad cells included
    ones: I64  # flattened cells, for the contradiction check
    trials: I64
    num_bits: int
    weighted: WeightedCells | None = None  # costs and agreements are weighted (model)

    def log_sf(self, agreement: int) -> float:
        """``log P(A >= agreement)`` under H0 for one fixed entry: binomial, or the
        weighted law's exact tail."""
        if self.weighted is not None:
            return self.weighted.upper_log_sf(agreement)
        return registry_log_p(agreement, self.total, 1)

    @property
    def llr_factor(self) -> float:
        """What one unit of agreement tells one payload from another, against a binomial
        g-bit's worth: 1 for unweighted cells. A weighted cell's unit of mass comes from a
        g-bit of weight ``w``, whose sign has variance ``w^2`` for ``w`` units of mass, so
        a cost gap is worth ``sum M / sum W^2`` of the binomial's log-likelihood ratio
        (the same factor whether a token's bias is uniform or grows with its weight: the
        text's signal over its variance). Without it the posterior over-counted the
        evidence about five-fold on chat answers (``sum W^2 / sum M`` about 5 there)."""
        if self.weighted is None:
            return 1.0
        sumsq = int(self.weighted.sumsq.sum())
        return int(self.weighted.mass.sum()) / sumsq if sumsq > 0 else 1.0

    @property
    def sd(self) -> float:
        """The standard deviation of ``2A - total`` under H0."""
        return self.weighted.sd if self.weighted is not None else math.sqrt(self.total)


def text_cells(
    ones: I64, trials: I64, num_bits: int, weighted: WeightedCells | None = None
) -> TextCells:
    """Summarise cells ``ones``/``trials`` (B, k) of a ``num_bits`` payload; with
    ``weighted`` (the same text's model-weighted cells) payloads are ranked and tested
    on the weighted evidence, the unweighted counts kept for the contradiction check."""
    ones_f, trials_f = ones.ravel().astype(np.int64), trials.ravel().astype(np.int64)
    score_f, mass_f = ones_f, trials_f
    if weighted is not None:
        k = int(weighted.score.shape[1])
        score_f = weighted.score.ravel().astype(np.int64)
        mass_f = np.repeat(weighted.mass.astype(np.int64), k)
    signed = 2 * score_f[:num_bits] - mass_f[:num_bits]  # > 0 favours bit 0
    weights = _weights(num_bits)
    decoded = int(np.bitwise_or.reduce(np.where(signed < 0, weights, np.uint64(0)), initial=0))
    free = np.maximum(score_f[:num_bits], mass_f[:num_bits] - score_f[:num_bits])
    return TextCells(
        bit_costs=np.abs(signed).astype(np.float64),
        decoded=decoded,
        agreement_max=int(free.sum()) + int(score_f[num_bits:].sum()),  # pad bits are 0
        total=int(mass_f.sum()),
        ones=ones_f,
        trials=trials_f,
        num_bits=num_bits,
        weighted=weighted,
    )


def _weights(num_bits: int) -> U64:
    """The integer value of each payload bit, most significant first."""
    return np.left_shift(np.uint64(1), np.arange(num_bits - 1, -1, -1, dtype=np.uint64))


def count_weights(payloads: U64, counted: U64, counts: npt.ArrayLike) -> F64:
    """The prior weight of each of ``payloads`` (:func:`worldcup_core.decoder.prior_logits`):
    its count of texts where it is one of ``counted`` (at least 1: a payload counted as 0
    was recorded before texts were counted), else 1 (an entry: one text)."""
    out: F64 = np.ones(payloads.size, dtype=np.float64)
    for payload, n in zip(np.asarray(counted).tolist(), np.asarray(counts).tolist(), strict=True):
        out[payloads == np.uint64(payload)] = max(1, int(n))
    return out


def flip_costs(cells: TextCells, payloads: U64) -> F64:
    """How much agreement each payload gives up against the decoded one."""
    flips = (np.asarray(payloads, dtype=np.uint64) ^ np.uint64(cells.decoded)).astype(">u8")
    bits = np.unpackbits(flips.view(np.uint8).reshape(-1, 8), axis=1)[:, 64 - cells.num_bits :]
    out: F64 = bits @ cells.bit_costs
    return out


@dataclass(frozen=True)
class PayloadList:
    """The likeliest payloads of one text, cheapest first."""

    payloads: U64  # (L,) payload integers (bit 0 of the payload string is the MSB)
    costs: F64  # (L,) flip costs in g-bit units, ascending
    complete_below: float  # every payload cheaper than this is in the list


def payload_list(cells: TextCells, list_size: int = LIST_SIZE) -> PayloadList:
    """The ``list_size`` likeliest payloads of a text; see the module docstring."""
    if list_size < 1 or list_size & (list_size - 1):
        raise ValueError(f"list_size must be a power of two, got {list_size}")
    cost, num_bits = cells.bit_costs, cells.num_bits
    weights = _weights(num_bits)
    order = np.argsort(cost, kind="stable")
    m = min(SEARCH_BITS, num_bits)
    half = m // 2
    costs_a, flips_a = _subsets(cost[order[:half]], weights[order[:half]])
    costs_b, flips_b = _subsets(cost[order[half:m]], weights[order[half:m]])
    # the list_size cheapest sums of one subset of each half: pair (i, j) of the two
    # sorted lists is among them only if (i + 1) (j + 1) <= list_size
    ia, ib = _pairs(costs_a.size, costs_b.size, list_size)
    sums = costs_a[ia] + costs_b[ib]
    keep = min(list_size, sums.size)
    top = np.argpartition(sums, keep - 1)[:keep] if keep < sums.size else np.arange(sums.size)
    top = np.sort(top)  # ties in cost go to the lower pair, as a stable sort would
    top = top[np.argsort(sums[top], kind="stable")]
    costs = sums[top]
    flips = flips_a[ia[top]] | flips_b[ib[top]]
    bound = float(cost[order[m]]) if m < num_bits else math.inf
    if keep == list_size and list_size < (1 << m):
        bound = min(bound, float(costs[-1]))
    return PayloadList(np.uint64(cells.decoded) ^ flips, costs, bound)


@functools.cache
def _pairs(na: int, nb: int, list_size: int) -> tuple[I64, I64]:
    """The pairs (i, j) of two sorted lists' ranks with (i + 1) (j + 1) <= list_size."""
    i = np.arange(na)
    reach = np.minimum(list_size // (i + 1), nb)
    ia = np.repeat(i, reach)
    ib = np.arange(int(reach.sum())) - np.repeat(np.cumsum(reach) - reach, reach)
    return ia, ib


@functools.cache
def _selections(n: int) -> tuple[F64, U64]:
    """Every subset of n items as 0/1 rows (2^n, n), as floats and as integers."""
    rows = np.arange(1 << n, dtype=np.uint64)[:, None] >> np.arange(n, dtype=np.uint64)
    sel: U64 = rows & np.uint64(1)
    return sel.astype(np.float64), sel


def _subsets(cost: F64, weight: U64) -> tuple[F64, U64]:
    """Every subset of these bits: (total cost, OR of their weights), cheapest first."""
    sel_f, sel_u = _selections(cost.size)
    costs = sel_f @ cost
    flips: U64 = sel_u @ weight  # distinct powers of two: the sum is the OR
    rank = np.argsort(costs, kind="stable")
    return costs[rank], flips[rank]


@dataclass(frozen=True)
class ListMatch:
    match: RegistryMatch  # ``index`` is the position in the list
    message_id: int
    expired: bool  # the best candidate is an entry past the registry's retention
    exact: bool  # the best cost is below ``complete_below``: the registry's ML entry


def _contradicts(cells: TextCells, bits: str) -> bool:
    entry = np.zeros(cells.ones.size, dtype=np.int64)
    entry[: cells.num_bits] = np.frombuffer(bits.encode("ascii"), dtype=np.uint8) - ord("0")
    return contradicted(entry, cells.ones, cells.trials, cells.num_bits)


class _PayloadBits(Sequence[str]):
    """Payload integers read as bit strings, one at a time (only the best is read)."""

    def __init__(self, payloads: U64, num_bits: int) -> None:
        self._payloads, self._num_bits = payloads, num_bits

    def __len__(self) -> int:
        return int(self._payloads.size)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [format(int(p), f"0{self._num_bits}b") for p in self._payloads[i]]
        return format(int(self._payloads[i]), f"0{self._num_bits}b")


def exhaustive_match(
    cells: TextCells,
    payloads: U64,
    registry_size: int | None = None,
    weights: F64 | None = None,
) -> RegistryMatch | None:
    """:func:`worldcup_core.decoder.match_cells` on payload integers, vectorised: the
    maximum-likelihood entry of the whole registry (``index`` into ``payloads``);
    ``weights`` (aligned with ``payloads``) are their prior weights
    (:func:`worldcup_core.decoder.prior_logits`)."""
    if payloads.size == 0 or cells.total == 0:
        return None
    agreement = cells.agreement_max - np.rint(flip_costs(cells, payloads)).astype(np.int64)

    def adjust(best: int, _delta: float, posterior: float) -> float:
        bits = format(int(payloads[best]), f"0{cells.num_bits}b")
        return 0.0 if _contradicts(cells, bits) else posterior

    candidates = _PayloadBits(payloads, cells.num_bits)
    match = registry_match(
        candidates, agreement, cells.total, adjust, registry_size, weights, cells.llr_factor
    )
    if cells.weighted is None:
        return match
    a_best = int(agreement[match.index])
    size = max(int(payloads.size), registry_size or 0)
    log_p = min(cells.log_sf(a_best) + math.log(size), 0.0)
    ratio = math.sqrt(cells.total) / cells.sd
    return replace(
        match,
        p_value=math.exp(log_p),
        log10_p_value=log_p / math.log(10.0),
        agreement_z=match.agreement_z * ratio,
        margin_z=match.margin_z * ratio,
    )


def _log_sum_exp(x: F64) -> float:
    if x.size == 0:
        return -math.inf
    top = float(x.max())
    return top + math.log(float(np.exp(x - top).sum()))


def list_match(
    cells: TextCells,
    plist: PayloadList,
    message_ids: U64,
    live: npt.NDArray[np.bool_],
    expired: npt.NDArray[np.bool_],
    registry_size: int,
    weights: F64 | None = None,
) -> ListMatch | None:
    """The best candidate among the listed payloads whose ids (``message_ids``, aligned
    with the list) are issued (``live``) or past retention (``expired``); None if the
    list holds none, or the text has no scored g-bit. ``weights`` (aligned with the list)
    are the candidates' prior weights (:func:`worldcup_core.decoder.prior_logits`: a
    client-chosen payload counts its texts); the registry's unseen entries weigh 1."""
    found = np.flatnonzero(live | expired)
    total = cells.total
    if found.size == 0 or total == 0:
        return None
    costs = plist.costs[found]
    cheapest = np.flatnonzero(costs == costs[0])
    ids = message_ids[found]
    best_at = int(cheapest[np.argmin(ids[cheapest])])  # ties: the lower id, as exhaustive
    best = int(found[best_at])
    c_best = float(plist.costs[best])
    a_best = cells.agreement_max - round(c_best)
    size = max(registry_size, int(found.size))
    if cells.weighted is None:
        log_p = registry_log_p(a_best, total, size)  # Bonferroni over the registry
    else:
        log_p = min(cells.log_sf(a_best) + math.log(size), 0.0)
    delta = a_best / total - 0.5
    beta = llr_scale(delta) * cells.llr_factor
    prior = prior_logits(None if weights is None else weights[found], best_at, found.size)
    rel = -beta * (costs - c_best) + prior
    log_seen = _log_sum_exp(rel)
    # the registry's unseen entries: keyed-random payloads outside the list
    unseen = size - int(found.size)
    outside = (1 << cells.num_bits) - plist.payloads.size
    log_tail = -math.inf
    if unseen > 0 and outside > 0:
        log_all = float(np.logaddexp(0.0, -beta * cells.bit_costs).sum()) + beta * c_best
        log_list = _log_sum_exp(-beta * (plist.costs - c_best))
        gap = log_all - log_list
        if gap > 1e-12:  # mass outside the list: all minus list, in log space
            log_out = log_all + math.log(-math.expm1(-gap))
            log_tail = math.log(unseen) - math.log(outside) + log_out
            if weights is not None:  # each unseen entry weighs 1, the best its own
                log_tail -= math.log(float(weights[best]))
    posterior = math.exp(-float(np.logaddexp(log_seen, log_tail)))
    bits = format(int(plist.payloads[best]), f"0{cells.num_bits}b")
    if _contradicts(cells, bits):
        posterior = 0.0
    others = [i for i in found.tolist() if i != best]
    runner = others[0] if others else None
    runner_cost = float(plist.costs[runner]) if runner is not None else plist.complete_below
    margin = max(runner_cost - c_best, 0.0) if math.isfinite(runner_cost) else a_best - total / 2
    match = registry_match_of(best, bits, a_best, total, log_p, posterior, runner, margin)
    if cells.weighted is not None:
        ratio = math.sqrt(total) / cells.sd
        match = replace(
            match, agreement_z=match.agreement_z * ratio, margin_z=match.margin_z * ratio
        )
    return ListMatch(
        match, int(message_ids[best]), bool(expired[best]), c_best < plist.complete_below
    )
