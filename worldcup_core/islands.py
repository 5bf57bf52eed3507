"""Where in a text the watermark is: stretches of tokens whose evidence stands out.

Each scored token has a leave-one-out ``z`` (:mod:`worldcup_core.evidence`): mean 0
and variance 1 without the watermark, a positive mean inside a watermarked stretch.
A stretch ``[a, b]`` is judged by its own z-test, ``S(a, b) = sum(z) / sqrt(n)``
over its ``n`` tokens with a z. For a watermarked stretch of mean ``mu`` and
length ``L``, ``S`` peaks at the true stretch (``mu * sqrt(L)``): adding human
tokens dilutes it and dropping watermarked ones shortens it. So the locator is
the interval of largest ``S`` (a scan statistic), found exactly over every
interval with prefix sums.

* The first island is reported whenever the caller has already established that
  the text is watermarked (the route's own test): it is where the evidence is.
* Further islands, searched for in what lies left and right of the ones found,
  must be significant on their own: ``S`` above the Bonferroni bound for every
  interval of the text (``alpha`` over ``n (n + 1) / 2`` intervals).

Texts of more than :data:`EXACT_TOKENS` tokens are searched over blocks of
consecutive tokens (at most :data:`EXACT_TOKENS` blocks), so boundaries are then
exact to a block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy import stats

__all__ = [
    "EXACT_TOKENS",
    "GAP_ALPHA",
    "SEGMENT_TOKENS",
    "WHOLE_COVERAGE",
    "Coverage",
    "Island",
    "island_coverage",
    "locate_islands",
]

EXACT_TOKENS = 2048  # exact search up to this many tokens; blocks above
MIN_TOKENS = 8  # scored tokens an island needs at least
_ROWS = 256  # interval starts per numpy chunk (memory: rows x tokens floats)


@dataclass(frozen=True)
class Island:
    """Tokens ``start``..``end`` (inclusive, indices into the text)."""

    start: int
    end: int
    scored: int  # tokens in it with a z
    z: float  # its own z-test: sum of z over sqrt(scored)
    mean_z: float


def _best(
    sums: NDArray[np.float64], counts: NDArray[np.int64], lo: int, hi: int, min_tokens: int
) -> tuple[float, int, int] | None:
    """The interval of units ``[a, b)`` within ``[lo, hi)`` of largest S, from prefix sums."""
    best: tuple[float, int, int] | None = None
    ends = np.arange(lo + 1, hi + 1)
    for first in range(lo, hi, _ROWS):
        starts = np.arange(first, min(first + _ROWS, hi))
        n = counts[ends][None, :] - counts[starts][:, None]
        s = sums[ends][None, :] - sums[starts][:, None]
        valid = (ends[None, :] > starts[:, None]) & (n >= min_tokens)
        score = np.where(valid, s / np.sqrt(np.maximum(n, 1)), -np.inf)
        at = int(np.argmax(score))
        value = float(score.flat[at])
        if value == -np.inf:
            continue
        if best is None or value > best[0]:
            row, col = divmod(at, len(ends))
            best = (value, int(starts[row]), int(ends[col]))
    return best


def locate_islands(
    z: Sequence[float | None],
    *,
    alpha: float = 0.01,
    max_islands: int = 5,
    min_tokens: int = MIN_TOKENS,
) -> list[Island]:
    """Islands of watermark evidence, strongest first, for a text already judged
    watermarked; ``z[i]`` is token i's z (None: unscored or no reference)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    values = np.array([0.0 if v is None else float(v) for v in z], dtype=np.float64)
    has = np.array([v is not None for v in z], dtype=np.int64)
    scored = int(has.sum())
    if scored < min_tokens:
        return []
    block = max(1, math.ceil(len(values) / EXACT_TOKENS))
    units = math.ceil(len(values) / block)
    pad = units * block - len(values)
    unit_sums = np.pad(values, (0, pad)).reshape(units, block).sum(axis=1)
    unit_counts = np.pad(has, (0, pad)).reshape(units, block).sum(axis=1)
    sums = np.concatenate([[0.0], np.cumsum(unit_sums)])
    counts = np.concatenate([[0], np.cumsum(unit_counts)]).astype(np.int64)
    intervals = scored * (scored + 1) / 2
    bound = float(stats.norm.isf(alpha / intervals))
    first = _best(sums, counts, 0, units, min_tokens)
    if first is None:
        return []
    found = _split(sums, counts, first, bound, min_tokens, max_islands)
    while len(found) < max_islands:  # significant islands outside those found
        candidates = [
            best
            for lo, hi in _gaps(units, [(a, b) for _, a, b in found])
            if (best := _best(sums, counts, lo, hi, min_tokens)) is not None
        ]
        if not candidates or max(candidates)[0] <= bound:
            break
        more = _split(sums, counts, max(candidates), bound, min_tokens, max_islands - len(found))
        found += more
    islands = [_island(a, b, block, len(values), sums, counts) for _, a, b in found]
    return sorted(islands, key=lambda i: i.start)


def _split(
    sums: NDArray[np.float64],
    counts: NDArray[np.int64],
    island: tuple[float, int, int],
    bound: float,
    min_tokens: int,
    limit: int,
) -> list[tuple[float, int, int]]:
    """``island``, or its parts when a stretch inside it is significantly below its mean:
    two watermarked stretches with human text between them are two islands, not one.

    The inner stretch of lowest ``(sum(z) - mean * n) / sqrt(n)`` is cut out when that is
    below ``-bound``; each side is then trimmed to its own best interval and kept when
    significant on its own (the stronger side always), and split again in turn.
    """
    _, a, b = island
    if limit <= 1:
        return [island]
    mean = (sums[b] - sums[a]) / max(int(counts[b] - counts[a]), 1)
    centred = -(sums - mean * counts)  # prefix sums of (mean - z): the gap scores high
    gap = _best(centred, counts, a, b, min_tokens)
    if gap is None or gap[0] <= bound:
        return [island]
    _, g0, g1 = gap
    sides = [
        best
        for lo, hi in ((a, g0), (g1, b))
        if (best := _best(sums, counts, lo, hi, min_tokens)) is not None
    ]
    keep = [s for s in sides if s[0] > bound] or ([max(sides)] if sides else [island])
    parts: list[tuple[float, int, int]] = []
    for side in keep:
        parts += _split(sums, counts, side, bound, min_tokens, limit - len(parts) - 1)
    return parts[:limit]


def _gaps(units: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The unit ranges ``[lo, hi)`` of ``[0, units)`` outside every taken range."""
    gaps, cut = [], 0
    for a, b in sorted(taken):
        if a > cut:
            gaps.append((cut, a))
        cut = max(cut, b)
    if cut < units:
        gaps.append((cut, units))
    return gaps


def _island(
    a: int,
    b: int,
    block: int,
    length: int,
    sums: NDArray[np.float64],
    counts: NDArray[np.int64],
) -> Island:
    n = int(counts[b] - counts[a])
    total = float(sums[b] - sums[a])
    return Island(a * block, min(b * block, length) - 1, n, total / math.sqrt(n), total / n)


# The least share of a text's scored tokens that the watermark must cover for an answer
# to say the whole text carries it (``attribution: "whole"``). Derived from data
# (SECURITY.md, Forgery and framing; ``python -m worldcup_eval.coverage``): genuine
# answers lie above it with high probability, texts with 30 % or more rewritten below.
WHOLE_COVERAGE = 0.8
GAP_ALPHA = 0.01  # a stretch outside the islands is "not watermarked" below this level
SEGMENT_TOKENS = 60  # scored tokens per segment of the segment test (see island_coverage)


@dataclass(frozen=True)
class Coverage:
    """How much of a text carries the watermark (see :func:`island_coverage`)."""

    share: float
    scored: int
    islands: tuple[Island, ...]
    threshold: float

    @property
    def attribution(self) -> str:
        """``"whole"``: the watermark covers at least ``threshold`` of the scored tokens;
        ``"part"``: it sits in part(s) of the text only (piggybacking, a genuine answer
        quoted inside other text)."""
        return "whole" if self.share >= self.threshold else "part"


def island_coverage(
    z: Sequence[float | None],
    *,
    alpha: float = 0.01,
    gap_alpha: float = GAP_ALPHA,
    threshold: float = WHOLE_COVERAGE,
) -> Coverage:
    """The share of a watermarked text's scored tokens that carry the watermark.

    The islands (:func:`locate_islands`) are the watermark's strongest stretches, and
    their ends are trimmed where a few tokens happen to score low, so the islands alone
    undercount a genuine text. So every stretch outside them (before, between, after)
    is tested against the islands' own mean z: it counts as *not* watermarked only when
    its tokens fall significantly short of that mean (one-sided, ``gap_alpha``):
    ``(mean * n - sum z) / sqrt(n) > z_(1 - gap_alpha)``. A human paragraph or a
    rewritten span of more than a few tokens does; a genuine text's trimmed ends do not.
    An island can also span a weak stretch that the splitter's bound (every interval of
    the text) lets through, such as a rewritten middle. So the scored tokens are also cut
    into segments of about :data:`SEGMENT_TOKENS`, and a segment significantly below the
    text's mean z (one-sided, ``gap_alpha`` over the segments) is not watermarked either.
    ``share`` is the scored tokens in neither kind of stretch, over all scored tokens."""
    islands = tuple(locate_islands(z, alpha=alpha))
    scored = sum(v is not None for v in z)
    if not islands or scored == 0:
        return Coverage(0.0, scored, islands, threshold)
    inside = sum(i.scored for i in islands)
    mean = sum(i.z * math.sqrt(i.scored) for i in islands) / inside
    bound = float(stats.norm.isf(gap_alpha))
    values = list(z)
    cuts = [-1] + [x for i in islands for x in (i.start, i.end)] + [len(values)]
    weak = np.zeros(len(values), dtype=bool)
    for a, b in zip(cuts[0::2], cuts[1::2], strict=True):  # the stretch (a, b), exclusive
        stretch = [v for v in values[a + 1 : b] if v is not None]
        n = len(stretch)
        if n and (mean * n - sum(stretch)) / math.sqrt(n) > bound:
            weak[a + 1 : b] = True
    at = np.array([i for i, v in enumerate(values) if v is not None], dtype=np.int64)
    z_at = np.array([values[i] for i in at], dtype=np.float64)
    segments = max(1, round(scored / SEGMENT_TOKENS))
    overall = float(z_at.mean())
    seg_bound = float(stats.norm.isf(gap_alpha / segments))
    for part in np.array_split(np.arange(scored), segments):
        n = int(part.size)
        if n and (overall * n - float(z_at[part].sum())) / math.sqrt(n) > seg_bound:
            weak[at[part]] = True
    unmarked = int(weak[at].sum())
    return Coverage(1.0 - unmarked / scored, scored, islands, threshold)
