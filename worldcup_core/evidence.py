"""Per-token evidence: which tokens of a text carry a key's watermark, and how strongly.

The provenance console colours every token of a text by its evidence, so that a
copy-paste attack shows up as a watermarked island inside human text. Each scored
token t votes on one message position b; for each group j it adds ``ones[t, j]``
g-bits favouring bit 0 out of ``tau`` (see :mod:`worldcup_core.scoring`).

Judging a token against the *decoded* bit of its cell would count its own
g-bits twice (the decoded bit is chosen from them): under no watermark a token
alone in its cell would always "agree". So a token is judged against the bit
the **other** tokens of its cell point to (leave-one-out). Under H0 its g-bits
are independent of that direction, so its agreement count is exactly
Binomial(trials, 1/2) and ``z = (2 agree - trials) / sqrt(trials)`` has mean 0
and variance 1. Groups whose other tokens are absent or tie give no reference and
are left out; a token with no reference in any group has ``z = None`` (shown
neutral, like unscored tokens: the first c tokens and repeated contexts).

Nothing here is key material: the numbers are what the decoder already derives
from the text; the key only went into :meth:`WorldCup.evidence`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worldcup_core.islands import WHOLE_COVERAGE, Coverage, island_coverage
from worldcup_core.scheme import WorldCup
from worldcup_core.scoring import TokenEvidence

__all__ = ["TokenMark", "text_evidence", "token_marks"]


@dataclass(frozen=True)
class TokenMark:
    """The evidence of one scored token (unscored tokens have no mark)."""

    index: int  # token index in the text
    position: int  # the message position it votes on
    g_mean: tuple[float, ...]  # mean g per group; 0.5 is chance
    agree: int  # its g-bits pointing the way the rest of its cells point
    trials: int  # its g-bits that had such a reference (0: none)

    @property
    def z(self) -> float | None:
        """Standardised agreement, exactly mean 0 / variance 1 under H0; None without
        a reference."""
        if self.trials == 0:
            return None
        return (2 * self.agree - self.trials) / math.sqrt(self.trials)


def token_marks(
    evidence: TokenEvidence, indices: Sequence[int], num_symbols: int
) -> list[TokenMark]:
    """Leave-one-out marks of the scored tokens; ``indices`` are their positions in
    the text (``WorldCup.scored_indices``), in the order of ``evidence``."""
    n, tau = evidence.num_scored, evidence.trials_per_token
    if len(indices) != n:
        raise ValueError(f"{len(indices)} indices for {n} scored tokens")
    if n == 0:
        return []
    pos = evidence.positions(num_symbols)
    ones = evidence.ones  # (n, k)
    cell_ones = np.zeros((num_symbols, evidence.groups), dtype=np.int64)
    np.add.at(cell_ones, pos, ones)
    counts = np.bincount(pos, minlength=num_symbols)
    others = cell_ones[pos] - ones  # (n, k): the other tokens' ones in each cell
    other_trials = ((counts[pos] - 1) * tau)[:, None]
    lean = np.sign(2 * others - other_trials)  # +1: bit 0, -1: bit 1, 0: no reference
    agree = np.where(lean > 0, ones, tau - ones) * (lean != 0)
    trials = (lean != 0).sum(axis=1) * tau
    means = ones / tau
    return [
        TokenMark(
            index=int(indices[t]),
            position=int(pos[t]),
            g_mean=tuple(float(x) for x in means[t]),
            agree=int(agree[t].sum()),
            trials=int(trials[t]),
        )
        for t in range(n)
    ]


def text_evidence(scheme: WorldCup, token_ids: Sequence[int], num_bits: int) -> list[TokenMark]:
    """:func:`token_marks` of a text under ``scheme``, its tokens grouped into the
    positions of a ``num_bits`` payload (as the decoder groups them)."""
    return token_marks(
        scheme.evidence(token_ids),
        scheme.scored_indices(token_ids),
        scheme.config.symbols_for(num_bits),
    )


def text_coverage(
    scheme: WorldCup, token_ids: Sequence[int], num_bits: int, threshold: float = WHOLE_COVERAGE
) -> Coverage:
    """How much of a text judged watermarked under ``scheme`` carries the watermark: the
    share of its scored tokens inside the islands of :func:`text_evidence`'s z, and
    whether one island spans (nearly) all of it (:class:`~worldcup_core.islands.Coverage`)."""
    marks = {m.index: m.z for m in text_evidence(scheme, token_ids, num_bits)}
    return island_coverage([marks.get(i) for i in range(len(token_ids))], threshold=threshold)
