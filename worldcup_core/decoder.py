"""Confidence-aware message decoding (Section 3.4, Algorithm 2).

For each position p and group j the decoder compares the mean g with the mean
g_bar over every layer and scored token of that position, i.e. the cell
count ``ones`` against ``trials / 2``; the bit is 1 when ``ones < trials/2``.

Beyond the paper:

* **Per-bit confidence.** ``z = |2*ones - trials| / sqrt(trials)`` and the
  exact two-sided binomial p-value that the cell is unbiased.
* **Erasures.** A position with no scored token carries no evidence; its bits
  are reported as ``?``, never guessed. A tie (``2*ones == trials``) is
  reported as bit 0 with p = 1.
* **List decoding** (after MPAC). Cells are independent, and with a common
  per-bit bias delta the log-likelihood of a message is
  ``beta * agreement`` with ``beta = log((1/2+delta)/(1/2-delta))``; flipping
  bit i costs ``|2*ones_i - trials_i|``. The top-L messages are the L
  cheapest flip sets, enumerated exactly with a heap.
* **Registry matching.** For a candidate message, its agreement count
  (g-bits pointing its way, pad bits included) is exactly
  Binomial(total trials, 1/2) under H0, so each candidate gets an exact
  one-sided p-value; the best (maximum-likelihood) candidate's p-value is
  Bonferroni-corrected for the registry size. A posterior under a uniform
  prior over the registry, with delta estimated from the best candidate,
  says how sure the choice is among the candidates; it is 0 when a payload
  cell contradicts the best entry beyond chance, or the cells do combined
  (Fisher, :func:`contradicted`), so a text watermarked with
  an unregistered payload is not pinned on its nearest registry entry.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worldcup_core.config import WatermarkConfig
from worldcup_core.detector import DetectionResult
from worldcup_core.message import bits_matrix
from worldcup_core.scoring import (
    I64,
    TokenEvidence,
    log_binom_half_cdf,
    two_sided_log_pvalues,
)

DEFAULT_LIST_SIZE = 5


@dataclass(frozen=True)
class Alternative:
    bits: str
    flip_cost: float  # in g-bit units; 0 for the best message
    log_likelihood_ratio: float  # against the best message, <= 0


@dataclass(frozen=True)
class DecodeResult:
    bits: str  # "0"/"1" per payload bit, "?" for an erasure
    bit_z: tuple[float, ...]
    bit_p_values: tuple[float, ...]
    erasures: tuple[int, ...]
    position_token_counts: tuple[int, ...]
    alternatives: tuple[Alternative, ...]
    estimated_bias: float
    detection: DetectionResult

    @property
    def num_bits(self) -> int:
        return len(self.bits)


@dataclass(frozen=True)
class RegistryMatch:
    index: int
    bits: str
    agreement_z: float
    p_value: float  # Bonferroni-corrected for the registry size
    log10_p_value: float
    posterior: float
    runner_up_index: int | None
    margin_z: float  # best minus runner-up agreement, in z units


def llr_scale(delta: float) -> float:
    d = min(max(delta, 1e-9), 0.49)
    return math.log((0.5 + d) / (0.5 - d))


def top_flip_sets(costs: list[float], limit: int) -> list[tuple[float, tuple[int, ...]]]:
    """The ``limit`` cheapest subsets of items whose ``costs`` are sorted ascending, exactly:
    (total cost, item indices), cheapest first."""
    out: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    if not costs:
        return out
    heap: list[tuple[float, tuple[int, ...]]] = [(costs[0], (0,))]
    while heap and len(out) < limit:
        cost, ranks = heapq.heappop(heap)
        out.append((cost, ranks))
        last = ranks[-1]
        if last + 1 < len(costs):
            nxt = costs[last + 1]
            heapq.heappush(heap, (cost + nxt, (*ranks, last + 1)))
            heapq.heappush(heap, (cost - costs[last] + nxt, (*ranks[:-1], last + 1)))
    return out


def decode(
    config: WatermarkConfig,
    evidence: TokenEvidence,
    num_bits: int,
    detection: DetectionResult,
    list_size: int = DEFAULT_LIST_SIZE,
) -> DecodeResult:
    """Recover a ``num_bits`` payload; see the module docstring."""
    ones, trials, counts = evidence.cells(config.symbols_for(num_bits))
    return decode_cells(ones[None], trials[None], counts[None], num_bits, [detection], list_size)[0]


def decode_cells(
    ones: I64,
    trials: I64,
    counts: I64,
    num_bits: int,
    detections: Sequence[DetectionResult],
    list_size: int = DEFAULT_LIST_SIZE,
    scale: I64 | None = None,
    bit_log_p: npt.NDArray[np.float64] | None = None,
) -> list[DecodeResult]:
    """The payloads of many texts from their cells: ``ones``/``trials`` (S, B, k) and
    ``counts`` (S, B). The arithmetic runs once for all texts; only the top-L list search
    and the result objects are per text.

    Weighted cells (:mod:`worldcup_core.detector_model`) pass their weighted score as
    ``ones``, their mass as ``trials``, the variance of ``2 ones - trials`` under H0 as
    ``scale`` (default ``trials``: unit g-bits) and each cell's exact two-sided
    ``bit_log_p`` (default: the binomial one)."""
    if list_size < 1:
        raise ValueError(f"list_size must be >= 1, got {list_size}")
    texts = ones.shape[0]
    ones_f = ones.reshape(texts, -1)[:, :num_bits]
    trials_f = trials.reshape(texts, -1)[:, :num_bits]
    erased = trials_f == 0
    signed = 2 * ones_f - trials_f  # > 0 favours bit 0
    codes = np.where(erased, ord("?"), np.where(signed < 0, ord("1"), ord("0")))
    all_bits = codes.astype(np.uint8).tobytes().decode("ascii")
    var_f = trials_f if scale is None else scale.reshape(texts, -1)[:, :num_bits]
    z = np.abs(signed) / np.sqrt(np.maximum(var_f, 1))
    if bit_log_p is None:
        bit_lp = two_sided_log_pvalues(ones_f, trials_f)
    else:
        bit_lp = bit_log_p.reshape(texts, -1)[:, :num_bits]
    p_vals = np.where(erased, 1.0, np.exp(bit_lp))
    cost = np.abs(signed).astype(np.float64)
    live_trials = np.where(erased, 0, trials_f).sum(axis=1)
    delta = np.divide(cost.sum(axis=1), 2 * live_trials, out=np.zeros(texts), where=live_trials > 0)
    order = np.argsort(np.where(erased, np.inf, cost), axis=1, kind="stable")
    live_count = (~erased).sum(axis=1).tolist()
    # Only the list_size cheapest ranks can enter the list_size cheapest flip sets (each
    # pop of the search adds at most one rank), so the per-text work reads just those.
    head = order[:, :list_size]
    head_costs = np.take_along_axis(cost, head, axis=1).tolist()
    head_ranks = head.tolist()
    z_rows, p_rows, count_rows = z.tolist(), p_vals.tolist(), counts.tolist()
    er_text, er_bit = np.nonzero(erased)
    er_rows = np.split(er_bit, np.searchsorted(er_text, np.arange(1, texts))) if texts else []
    # a weighted unit is not a g-bit's worth (TextCells.llr_factor): live mass over
    # the live variance, 1 for unit g-bits
    live_var = np.where(erased, 0, var_f).sum(axis=1)
    factor = np.divide(live_trials, live_var, out=np.ones(texts), where=live_var > 0)
    betas = [llr_scale(d) * f for d, f in zip(delta.tolist(), factor.tolist(), strict=True)]
    out = []
    for i in range(texts):
        bits = all_bits[i * num_bits : (i + 1) * num_bits]
        base = bits.encode("ascii")
        beta = betas[i]
        live = min(live_count[i], list_size)
        ranked = head_ranks[i][:live]
        alternatives = []
        for flip_cost, flips in top_flip_sets(head_costs[i][:live], list_size):
            alt = bytearray(base)
            for f in flips:
                alt[ranked[f]] ^= 1  # '0' <-> '1'
            alternatives.append(Alternative(alt.decode("ascii"), flip_cost, -beta * flip_cost))
        out.append(
            DecodeResult(
                bits=bits,
                bit_z=tuple(z_rows[i]),
                bit_p_values=tuple(p_rows[i]),
                erasures=tuple(er_rows[i].tolist()),
                position_token_counts=tuple(count_rows[i]),
                alternatives=tuple(alternatives),
                estimated_bias=float(delta[i]),
                detection=detections[i],
            )
        )
    return out


CONTRADICTION_P = 1e-3  # a cell this far against the entry's bit rules the entry out
COMBINED_CONTRADICTION_P = 1e-2  # the entry's cells, combined (Fisher), rule it out


def log_chi2_even_sf(x: float, half_df: int) -> float:
    """``log P(X > x)`` for ``X ~ chi2(2 * half_df)``, exact: ``exp(-x/2) * sum_{j <
    half_df} (x/2)^j / j!`` (the Poisson identity), summed in log space."""
    if x <= 0.0:
        return 0.0
    h = x / 2.0
    j = np.arange(half_df, dtype=np.float64)
    terms = j * math.log(h) - np.array([math.lgamma(t + 1.0) for t in j])
    top = float(terms.max())
    return min(-h + top + math.log(float(np.exp(terms - top).sum())), 0.0)


def contradicted(
    entry: npt.NDArray[np.int64],
    ones: npt.NDArray[np.int64],
    trials: npt.NDArray[np.int64],
    num_bits: int,
) -> bool:
    """Whether some payload cell leans against the entry's bit beyond chance.

    The posterior below is over the registry only, so a text watermarked with a
    payload outside it (another registry, an explicit payload) would go to its
    nearest entry with full confidence. If the entry were the payload, every cell
    would lean its way; a cell whose agreement with it is this low even under no
    watermark at all (exact one-sided binomial, Bonferroni over the payload bits)
    says the payload is something else. Weak cells (short texts) never trigger it.

    Nor does one such cell catch a payload that differs from the entry in many bits, each
    only moderately against it (an unregistered payload, 23 of 32 bits shared with its
    nearest entry: nine cells at p 2e-4 to 0.2). So the cells are also combined, Fisher's
    ``-2 sum log p_i`` against chi2 with ``2 * cells`` degrees of freedom, and the entry
    is ruled out below ``COMBINED_CONTRADICTION_P``. Both tests are valid for the entry
    that is the payload: its cells are disjoint sets of tokens, each cell's agreement is
    exactly binomial under no watermark and only pushed up by a watermark carrying the
    entry's bit, so each p_i is super-uniform and a true entry is ruled out at most at
    the stated rates (``tests/test_codec.py`` measures it on simulated texts).
    """
    free = slice(0, num_bits)
    agree = np.where(entry[free] == 0, ones[free], trials[free] - ones[free])
    live = trials[free] > 0
    if not live.any():
        return False
    log_p = log_binom_half_cdf(agree[live], trials[free][live])
    if float(log_p.min()) + math.log(num_bits) < math.log(CONTRADICTION_P):
        return True
    fisher = -2.0 * float(log_p.sum())
    return log_chi2_even_sf(fisher, int(live.sum())) < math.log(COMBINED_CONTRADICTION_P)


def match_registry(
    config: WatermarkConfig,
    evidence: TokenEvidence,
    candidates: list[str],
    registry_size: int | None = None,
) -> RegistryMatch | None:
    """Maximum-likelihood candidate among equal-length bit strings; the p-value is
    Bonferroni-corrected for ``registry_size`` (default: the number of candidates)."""
    if not candidates:
        return None
    ones, trials, _ = evidence.cells(-(-len(candidates[0]) // config.groups))
    return match_cells(ones, trials, candidates, registry_size)


def match_cells(
    ones: I64, trials: I64, candidates: list[str], registry_size: int | None = None
) -> RegistryMatch | None:
    """:func:`match_registry` on a text's cells ``ones``/``trials`` (B, k)."""
    if not candidates:
        return None
    groups = ones.shape[-1]
    cand = bits_matrix(candidates, groups)  # (R, B, k), pad bits zero
    total = int(trials.sum())
    if total == 0:
        return None
    flat = cand.reshape(len(candidates), -1).astype(np.int64)
    ones_f, trials_f = ones.ravel(), trials.ravel()
    agreement = (1 - flat) @ ones_f + flat @ (trials_f - ones_f)  # (R,)

    def adjust(best: int, _delta: float, posterior: float) -> float:
        if contradicted(flat[best], ones_f, trials_f, len(candidates[0])):
            return 0.0  # the payload is not this entry, whatever the others say
        return posterior

    return registry_match(candidates, agreement, total, adjust, registry_size)


PosteriorAdjust = Callable[[int, float, float], float]


def registry_match(
    candidates: Sequence[str],
    agreement: npt.NDArray[np.int64],
    total: int,
    adjust: PosteriorAdjust | None = None,
    registry_size: int | None = None,
    weights: npt.NDArray[np.float64] | None = None,
    llr_factor: float = 1.0,
) -> RegistryMatch:
    """The best of ``candidates`` by ``agreement`` (R,): scored tokens that agree with
    each entry, out of ``total``, each agreeing with probability exactly 1/2 under H0.

    The p-value is the exact binomial tail, Bonferroni-corrected for the registry
    size (``registry_size``, a count the store keeps, when the candidates are only
    part of the registry; else their number); the posterior is uniform over the
    registry with the bias estimated from the best entry. ``adjust(best, delta,
    posterior)`` lets a scheme revise the posterior (an entry the evidence
    contradicts, a competitor outside the registry). ``weights`` (R,), each >= 1, are
    the candidates' prior weights, the texts each was issued for (:func:`prior_logits`):
    the best stays the likeliest candidate, and only its posterior weighs them.
    ``llr_factor`` scales the log-likelihood ratio of a unit of agreement, for units
    that are not binomial g-bits (weighted cells:
    :attr:`worldcup_core.registry_lookup.TextCells.llr_factor`).
    """
    order = np.argsort(-agreement, kind="stable")
    best = int(order[0])
    a_best = int(agreement[best])
    log_p = registry_log_p(a_best, total, max(len(candidates), registry_size or 0))
    delta = a_best / total - 0.5
    logits = llr_factor * llr_scale(delta) * (agreement - a_best).astype(np.float64)
    logits = logits + prior_logits(weights, best, logits.size)
    posterior = float(1.0 / np.exp(logits).sum())
    if adjust is not None:
        posterior = adjust(best, delta, posterior)
    runner = int(order[1]) if len(candidates) > 1 else None
    margin = (a_best - int(agreement[runner])) if runner is not None else a_best - total / 2
    return registry_match_of(
        best, candidates[best], a_best, total, log_p, posterior, runner, margin
    )


def prior_logits(
    weights: npt.NDArray[np.float64] | None, best: int, size: int
) -> npt.NDArray[np.float64]:
    """Each candidate's log prior odds against candidate ``best``: ``log w - log
    w_best`` for ``weights`` (``size``,), zeros without them.

    A registry entry is issued for one text, so the posterior's prior is uniform over
    entries. A client-chosen payload (:mod:`app.stores.client_payloads`, unsealed) is
    issued for every text its client asked for under it: a text carries it that many
    times more often a priori. Weighing it so keeps a damaged copy of a much-used payload
    (a stolen spoof of it, issue #45) from being named as the entry that lies nearest
    by chance, and costs a text of that entry nothing unless the payload fits it almost
    as well."""
    if weights is None:
        return np.zeros(size)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (size,) or not bool(np.all(w >= 1.0)):
        raise ValueError(f"weights must be {size} numbers, each >= 1")
    out: npt.NDArray[np.float64] = np.log(w) - math.log(float(w[best]))
    return out


def registry_log_p(a_best: int, total: int, size: int) -> float:
    """The registry test's log p: the exact tail P(X >= a_best) for X ~ Bin(total, 1/2)
    (as P(X <= total - a_best); log space never underflows), Bonferroni-corrected for
    ``size`` entries."""
    log_p_single = float(log_binom_half_cdf(np.array([total - a_best]), np.array([total]))[0])
    return min(log_p_single + math.log(size), 0.0)


def registry_match_of(
    index: int,
    bits: str,
    a_best: int,
    total: int,
    log_p: float,
    posterior: float,
    runner: int | None,
    margin: float,
) -> RegistryMatch:
    """The match record of the best entry (agreeing with ``a_best`` of ``total`` scored
    tokens), its runner-up and the margin between them in agreeing tokens."""
    return RegistryMatch(
        index=index,
        bits=bits,
        agreement_z=(2 * a_best - total) / math.sqrt(total),
        p_value=math.exp(log_p),
        log10_p_value=log_p / math.log(10.0),
        posterior=posterior,
        runner_up_index=runner,
        margin_z=2 * margin / math.sqrt(total),
    )
