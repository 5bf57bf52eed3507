"""Where a text's watermark evidence sits: the spoof-artifact test and its memory (#45).

A watermark-stealing spoofer (Jovanović et al., ICML 2024) learns the watermark only in
the contexts (the last ``c`` tokens) that its collected answers showed it often. Where
it saw a context rarely or never, its token is the plain model's and carries no
watermark. A genuine answer carries the watermark at every scored context, common or
rare. Gloaguen et al. (ICML 2025) detect learning-based spoofers by this artifact.

The service issued every genuine text of a tenant, so it can count, per key version,
in how many of its issued texts each scored context occurred: a superset of what any
spoofer collected from that tenant. For a text under test, each scored token's
leave-one-out evidence ``z_t`` (:func:`worldcup_core.evidence.text_evidence`, mean 0
and variance 1 without the watermark) goes in the **rare** group when its context was
counted fewer than :data:`RARE_BELOW` times in *other* issued texts, else in the
**common** group, and

* ``R = sum_rare z_t / sqrt(n_rare)`` is the rare contexts' evidence alone: about
  N(0, 1) where they carry no watermark (a spoof), large for a genuine text;
* ``D`` is the common group's mean ``z`` minus the rare group's, standardised: about 0
  for genuine text, positive for a spoof.

:func:`spoof_artifact` flags a text whose rare-context evidence is missing while its
common-context evidence is not (both lines, :data:`R_BELOW` and :data:`D_ABOVE`).

**The memory** is a count-min sketch (Cormode and Muthukrishnan, 2005) with
conservative update (Estan and Varghese, 2002): ``depth`` rows of ``2**width_log2``
saturating 8-bit counters, fixed in size whatever the tenant's volume. Its estimate
never undercounts; collisions only overcount, so a rare context can read as common,
and the check then sees less of any text, genuine or spoofed (how that grows with a
tenant's volume: ``scripts/context_sketch_load.py``). A
context's cells come from one keyed BLAKE2b digest of its tokens (the subkey
:data:`SUBKEY_LABEL`), so the stored counters say nothing about the texts without the
key. A text's contexts are counted once per text, as the scheme scores a repeated
context once.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from worldcup_core.prf import WatermarkKey
from worldcup_core.scheme import WorldCup

__all__ = [
    "D_ABOVE",
    "DEPTH",
    "MAX_COUNT",
    "R_BELOW",
    "RARE_BELOW",
    "SUBKEY_LABEL",
    "WIDTH_LOG2",
    "ContextSketch",
    "Split",
    "conservative_update",
    "context_cells",
    "estimate",
    "flat_cells",
    "leave_one_out",
    "split_evidence",
    "spoof_artifact",
    "text_cells",
]

SUBKEY_LABEL: Final = "context-count-sketch"
DEPTH: Final = 4
# 4 rows of 2^20 one-byte counters: 4 MiB a tenant's key version. The default for new
# key versions only: the service records each version's width with it
# (app.stores.base.KeyRecord.sketch_width_log2) and reads its counters at that width.
WIDTH_LOG2: Final = 20
MAX_COUNT: Final = 255
# A context seen in fewer other issued texts than this is rare (the study's line: a
# spoofer that saw a context fewer than 5 times has little to learn there from).
RARE_BELOW: Final = 5
# The lines (worldcup_eval/context_artifact_study.py, docs/results/forgery/
# context-artifact.md): a text is flagged when its rare contexts' evidence R is below
# R_BELOW and its common contexts lead its rare ones by more than D_ABOVE.
R_BELOW: Final = 1.64
D_ABOVE: Final = 3.0

I64 = npt.NDArray[np.int64]
Cells = I64  # (contexts, depth): each context's counter in each row


def flat_cells(
    cells: Sequence[Sequence[int]] | Cells, distinct: bool = False, width_log2: int = WIDTH_LOG2
) -> Cells:
    """Contexts' cells as flat counter indices (``row * 2**width_log2 + column``, the
    stores' layout), shape ``(contexts, depth)``, checked in range; in order, or each
    distinct context once (``distinct``: a text's, to count)."""
    rows = np.asarray(cells, dtype=np.int64)
    if rows.size == 0:
        return np.zeros((0, DEPTH), dtype=np.int64)
    if rows.ndim != 2 or not 1 <= rows.shape[1] <= 8:
        raise ValueError("cells are (contexts, depth)")
    width = 1 << width_log2
    if rows.min() < 0 or rows.max() >= width:
        raise ValueError(f"a cell is outside 0..{width - 1}")
    if distinct:
        rows = np.unique(rows, axis=0)
    out: Cells = rows + (np.arange(rows.shape[1], dtype=np.int64) * width)[None, :]
    return out


def context_cells(
    key: WatermarkKey,
    token_ids: Sequence[int],
    indices: Sequence[int],
    width: int,
    depth: int = DEPTH,
    width_log2: int = WIDTH_LOG2,
) -> Cells:
    """The counters of the contexts of the tokens at ``indices``: the ``width`` tokens
    before each, hashed with the key's sketch subkey into ``depth`` rows of
    ``2**width_log2`` counters. Shape ``(len(indices), depth)``."""
    _check_geometry(depth, width_log2)
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    secret = key.subkey(SUBKEY_LABEL)
    ids = np.asarray(token_ids, dtype=np.int64)
    out = np.empty((len(indices), depth), dtype=np.int64)
    shift = np.uint64(64 - width_log2)
    for row, i in enumerate(indices):
        if not width <= i <= len(ids):
            raise ValueError(f"token {i} has no {width} tokens before it")
        message = width.to_bytes(1, "little") + ids[i - width : i].astype("<i8").tobytes()
        digest = hashlib.blake2b(message, key=secret, digest_size=8 * depth).digest()
        words = np.frombuffer(digest, dtype="<u8")
        out[row] = (words >> shift).astype(np.int64)
    return out


def text_cells(scheme: WorldCup, token_ids: Sequence[int], width_log2: int = WIDTH_LOG2) -> Cells:
    """The cells of the contexts ``scheme`` scores in a text (its scored tokens'), in a
    sketch of ``2**width_log2`` counters a row."""
    indices = scheme.scored_indices(token_ids)
    return context_cells(
        scheme.key, token_ids, indices, scheme.config.context_width, width_log2=width_log2
    )


def _check_geometry(depth: int, width_log2: int) -> None:
    if not 1 <= depth <= 8:
        raise ValueError(f"depth must be in 1..8, got {depth}")
    if not 4 <= width_log2 <= 30:
        raise ValueError(f"width_log2 must be in 4..30, got {width_log2}")


class ContextSketch:
    """A count-min sketch of texts' contexts with conservative update (see the module
    docstring); in memory, for tests and offline studies. The service keeps the same
    counters in its store (one byte a counter, row-major) and updates them the same
    way (SQLite through :func:`conservative_update`, Redis in a Lua script;
    ``tests/test_store_contract.py`` holds both equal to this)."""

    def __init__(self, depth: int = DEPTH, width_log2: int = WIDTH_LOG2) -> None:
        _check_geometry(depth, width_log2)
        self.depth = depth
        self.width_log2 = width_log2
        self.counters = np.zeros((depth, 1 << width_log2), dtype=np.uint8)

    def add_text(self, cells: Cells) -> None:
        """Count one text's contexts (each distinct one once)."""
        rows = _unique_rows(cells, self.depth)
        if rows.size == 0:
            return
        current = self.counters[np.arange(self.depth), rows]
        updated = conservative_update(current)
        depth = np.broadcast_to(np.arange(self.depth), rows.shape)
        np.maximum.at(self.counters, (depth, rows), updated)

    def counts(self, cells: Cells) -> npt.NDArray[np.int64]:
        """Each context's estimated count: never below the true one."""
        rows = np.asarray(cells, dtype=np.int64).reshape(-1, self.depth)
        return estimate(self.counters[np.arange(self.depth), rows])


def _unique_rows(cells: Cells, depth: int) -> Cells:
    rows = np.asarray(cells, dtype=np.int64).reshape(-1, depth)
    return np.unique(rows, axis=0) if rows.size else rows


def estimate(current: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Count-min's estimate from each context's ``(contexts, depth)`` counters."""
    values = np.asarray(current, dtype=np.int64)
    if values.ndim != 2:
        raise ValueError("counters are (contexts, depth)")
    if values.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    out: npt.NDArray[np.int64] = values.min(axis=1)
    return out


def conservative_update(current: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """The counters after one more occurrence of each context: every counter of a
    context rises to at least its estimate plus one (saturating at :data:`MAX_COUNT`),
    and no further. Counters shared by two contexts of one text take the larger."""
    values = np.asarray(current, dtype=np.int64)
    target = np.minimum(estimate(values) + 1, MAX_COUNT)[:, None]
    return np.maximum(values, target).astype(np.uint8)


@dataclass(frozen=True)
class Split:
    """A text's scored evidence split by how often its contexts were seen elsewhere."""

    rare: int
    common: int
    r: float  # sum of rare z / sqrt(rare); NaN without rare tokens
    d: float  # standardised common-minus-rare mean z; NaN without both groups


def split_evidence(zs: Sequence[float], seen: Sequence[int], rare_below: int = RARE_BELOW) -> Split:
    """:class:`Split` of tokens' ``zs`` whose contexts were ``seen`` that many times."""
    z = np.asarray(zs, dtype=np.float64)
    n = np.asarray(seen, dtype=np.int64)
    if z.shape != n.shape:
        raise ValueError("one count per token")
    rare, common = z[n < rare_below], z[n >= rare_below]
    r = float(rare.sum() / math.sqrt(rare.size)) if rare.size else math.nan
    d = math.nan
    if rare.size and common.size:
        d = float((common.mean() - rare.mean()) / math.sqrt(1 / common.size + 1 / rare.size))
    return Split(int(rare.size), int(common.size), r, d)


def spoof_artifact(split: Split, r_below: float = R_BELOW, d_above: float = D_ABOVE) -> bool:
    """Whether the text's evidence sits in common contexts only: little in its rare
    ones (``R < r_below``) and clearly more in its common ones (``D > d_above``). A text
    without both groups is never flagged: with no rare token there is nothing to compare
    (a narrow tenant's genuine answers can be all common)."""
    return split.r < r_below and split.d > d_above  # False when either is NaN


def leave_one_out(counts: Iterable[int]) -> list[int]:
    """Counts in *other* issued texts: the text under test may be one of them, counted
    once (for a text that was not issued this only makes more of its contexts rare)."""
    return [max(0, int(c) - 1) for c in counts]
