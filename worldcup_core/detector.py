"""Zero-bit detection with a calibrated p-value that needs no message.

Statistic: for each (position, group) cell with at least one scored token,
a two-sided binomial p-value of its count, randomised within its lattice
point by a keyed uniform so that it is *exactly* Uniform(0, 1) under H0;
then Fisher's combination ``T = -2 sum log p_c``, which is then exactly
chi-square with 2C degrees of freedom. Nothing is chosen after looking at
the data (contrast MPAC, whose z-score tests the decoded message as if it
had been fixed in advance and is anti-conservative).

Two-sided cells make the test blind to which bits were sent: a cell pushed
towards bit 0 or towards bit 1 is equally significant.

The payload length sets how tokens are grouped into positions. When it is
unknown:

* ``worldcup-v2`` tests one grouping, the ``S = ceil(64 / k)`` *slots*. Its
  positions are intervals of the position hash (multiply-shift), so the cells of
  any payload whose symbol count divides S are unions of slots, and the others
  straddle at most B - 1 slot boundaries. One test, so the p-value is exactly
  uniform under H0 and ``z`` is exactly standard normal there; in simulation its
  power matches scanning every length with a correction (better at the default
  32 bits, a little worse for short payloads, ``tests/test_detector_v2.py``).
* ``worldcup-v1`` (positions ``mod B`` do not nest) scans every symbol count
  B = 1..S and Šidák-corrects the smallest p-value. The groupings share tokens,
  but each acceptance region is a symmetric convex set of the token scores, so
  by the Gaussian correlation inequality (Royen, 2014) Šidák stays conservative;
  z leans slightly negative under H0 (its mean is about -0.6).

``z_score`` is always :func:`z_from_log_p` of the reported p-value.
``paper_z_score`` is the paper's Appendix-E style statistic with the signs
taken from the decoded bits, ``sum_c |2*ones - trials| / sqrt(sum trials)``.
It is reported for comparison only: under H0 its mean is about
``sqrt(2C/pi)``, not 0, so it is not a calibrated z-score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import special

from worldcup_core.config import MAX_PAYLOAD_BITS, WatermarkConfig
from worldcup_core.prf import PRF, splitmix64, uniforms_from_u64
from worldcup_core.scoring import (
    TokenEvidence,
    fisher_log_sf,
    randomized_log_pvalues,
    sidak_log_p,
)

DEFAULT_SIGNIFICANCE = 0.01


@dataclass(frozen=True)
class DetectionResult:
    p_value: float
    log10_p_value: float
    z_score: float
    paper_z_score: float
    is_watermarked: bool
    significance: float
    num_tokens: int
    num_scored_tokens: int
    num_symbols: int | None


def z_from_log_p(log_p: float, num_scored: int) -> float:
    """The z-score of a p-value, ``Φ⁻¹(1 − p)``: the one definition every caller uses.

    Where ``p`` is exactly uniform under H0, ``z`` is exactly standard normal there, and
    ``z > 0`` exactly when ``p < 1/2``. Computed from ``log p`` in both tails (``1 - p``
    as ``-expm1(log p)``), so it is exact for p far below 1e-308 and for p within
    1e-17 of 1, where p itself rounds to 1.0; never clipped to a fixed value. With
    nothing scored there is no evidence either way: 0.

    >>> abs(z_from_log_p(math.log(0.5), 10)) < 1e-12, round(z_from_log_p(math.log(0.025), 10), 3)
    (True, 1.96)
    >>> round(z_from_log_p(-1e-20, 10), 2), round(z_from_log_p(-2000.0, 10), 1)
    (-9.26, 63.2)
    """
    if num_scored == 0:
        return 0.0
    if log_p < -_LOG2:  # p < 1/2: the upper tail, from log p
        return float(-special.ndtri_exp(log_p))
    one_minus_p = -math.expm1(min(log_p, 0.0))
    return float(special.ndtri(max(one_minus_p, _TINY)))


_LOG2 = math.log(2.0)
_TINY = 5e-324  # the smallest double: z stays finite (about -38.5) even at p = 1


def grouping_log_pvalues(
    prf: PRF, evidence: TokenEvidence, symbol_counts: list[int]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(log p, paper z) for each grouping into B positions, in one vectorised pass."""
    seeds = np.array(
        [[prf.tiebreak_seed(tiebreak_data(evidence.text_digest, b)) for b in symbol_counts]],
        dtype=np.uint64,
    )
    log_p, paper_z = stacked_grouping_log_pvalues(
        seeds,
        evidence.position_u64[None, :],
        evidence.ones[None, :, :],
        evidence.trials_per_token,
        symbol_counts,
    )
    return log_p[0], paper_z[0]


def tiebreak_data(text_digest: bytes, num_symbols: int) -> bytes:
    """What seeds the tie-break uniforms of one text under one grouping."""
    return text_digest + num_symbols.to_bytes(2, "little")


def stacked_grouping_log_pvalues(
    seeds: npt.NDArray[np.uint64],
    position_u64: npt.NDArray[np.uint64],
    ones: npt.NDArray[np.int64],
    trials_per_token: int,
    symbol_counts: list[int],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """The grouping statistics for K keys over one text at once (provenance search).

    ``seeds`` (K, G) are the keys' tie-break seeds per grouping, ``position_u64``
    (K, n) and ``ones`` (K, n, k) their evidence on the same n scored tokens.
    Returns (log p, paper z), each (K, G). With K = 1 this *is* the detector's
    statistic, so single-key detection and provenance cannot disagree.
    """
    num_keys = int(position_u64.shape[0])
    k = int(ones.shape[2])
    num = len(symbol_counts)
    counts = np.array(symbol_counts, dtype=np.int64)
    sizes = counts * k
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    per_key = int(sizes.sum())
    pos = (position_u64[:, None, :] % counts.astype(np.uint64)[None, :, None]).astype(np.int64)
    cell = (
        (np.arange(num_keys, dtype=np.int64) * per_key)[:, None, None, None]
        + offsets[None, :, None, None]
        + pos[:, :, :, None] * k
        + np.arange(k)
    )
    weights = np.broadcast_to(ones[:, None, :, :], cell.shape)
    total = num_keys * per_key
    ones_c = np.bincount(cell.ravel(), weights=weights.ravel(), minlength=total).astype(np.int64)
    trials = np.bincount(cell.ravel(), minlength=total).astype(np.int64) * trials_per_token
    grouping = np.repeat(np.arange(num), sizes)  # (per_key,)
    counters = np.concatenate([np.arange(size, dtype=np.int64) for size in sizes])
    uniforms = uniforms_from_u64(splitmix64(seeds[:, grouping], counters[None, :])).ravel()
    gid = ((np.arange(num_keys) * num)[:, None] + grouping[None, :]).ravel()
    used = trials > 0
    ones_u, trials_u, gid_u = ones_c[used], trials[used], gid[used]
    log_p = randomized_log_pvalues(ones_u, trials_u, uniforms[used])
    slots = num_keys * num
    fisher = np.bincount(gid_u, weights=-2.0 * log_p, minlength=slots).astype(np.float64)
    cells = np.bincount(gid_u, minlength=slots)
    log_sf = fisher_log_sf(fisher, cells)
    deviation = np.bincount(gid_u, weights=np.abs(2 * ones_u - trials_u), minlength=slots)
    scale = np.sqrt(np.bincount(gid_u, weights=trials_u, minlength=slots))
    paper_z = np.divide(deviation, scale, out=np.zeros(slots), where=scale > 0)
    return log_sf.reshape(num_keys, num), paper_z.reshape(num_keys, num)


def detect(
    prf: PRF,
    config: WatermarkConfig,
    evidence: TokenEvidence,
    num_bits: int | None = None,
    significance: float = DEFAULT_SIGNIFICANCE,
) -> DetectionResult:
    """Test H0 "not watermarked with this key"; see the module docstring."""
    if not 0.0 < significance < 1.0:
        raise ValueError(f"significance must be in (0, 1), got {significance}")
    num_symbols = config.symbols_for(num_bits) if num_bits is not None else None
    if evidence.num_scored == 0:
        log_p, paper_z = 0.0, 0.0
    elif num_symbols is not None:
        log_ps, zs = grouping_log_pvalues(prf, evidence, [num_symbols])
        log_p, paper_z = float(log_ps[0]), float(zs[0])
    else:
        counts = list(range(1, slot_count(config) + 1))
        log_ps, zs = grouping_log_pvalues(prf, evidence, counts)
        best = int(np.argmin(log_ps))
        log_p = sidak_log_p(float(log_ps[best]), len(counts))
        paper_z = float(zs[best])
    return DetectionResult(
        p_value=math.exp(log_p),
        log10_p_value=log_p / math.log(10.0),
        z_score=z_from_log_p(log_p, evidence.num_scored),
        paper_z_score=paper_z,
        is_watermarked=math.exp(log_p) < significance,
        significance=significance,
        num_tokens=evidence.num_tokens,
        num_scored_tokens=evidence.num_scored,
        num_symbols=num_symbols,
    )


def slot_count(config: WatermarkConfig) -> int:
    """S = ceil(64 / k): the symbol count of the longest payload, v2's unknown-length grouping."""
    return config.symbols_for(MAX_PAYLOAD_BITS)
