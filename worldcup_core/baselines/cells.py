"""What the baselines share: :class:`BaselineScheme` (all four), and
:class:`CountCellScheme` (MPAC, BiMark and StealthInk, whose evidence is count cells).

:class:`BaselineScheme` holds a key and a configuration, and its ``detect`` is
``_detect`` on the text's ``evidence``; a baseline supplies those two.

Each of the three packs a scored token as one trial in one (position, group)
cell, ``ones`` counting the votes for bit 0 (see ``mpac.py``), so WorldCup's
exact detector, decoder and registry match apply to them unchanged. This base
class is that shared half: a baseline supplies ``evidence`` (its own PRF and
colouring) and ``_native_z`` (its paper's score, reported beside the calibrated
p-value), and inherits ``detect``, ``decode`` and ``match``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from worldcup_core.config import WatermarkConfig
from worldcup_core.decoder import DEFAULT_LIST_SIZE, DecodeResult, RegistryMatch, decode
from worldcup_core.decoder import match_registry as _match_registry
from worldcup_core.detector import DEFAULT_SIGNIFICANCE, DetectionResult, detect
from worldcup_core.prf import PRF, WatermarkKey, context_at, pack_context
from worldcup_core.scoring import TokenEvidence


def first_contexts(ids: Sequence[int], width: int) -> Iterator[tuple[int, bytes]]:
    """``(t, packed context)`` of each response token whose context occurs for the first
    time: the tokens a count-cell scheme biased at generation, so the only ones scored."""
    seen: set[bytes] = set()
    for t in range(len(ids)):
        packed = pack_context(context_at(ids, t, width))
        if packed not in seen:
            seen.add(packed)
            yield t, packed


def hashed_contexts(
    ids: Sequence[int], width: int, context_hash: Callable[[bytes], tuple[int, int]]
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    """(seeds, position hashes, tokens) of the scored tokens, for schemes whose context
    hash yields a (seed, position) pair (BiMark, StealthInk)."""
    scored = [(*context_hash(packed), ids[t]) for t, packed in first_contexts(ids, width)]
    seeds = np.array([s for s, _, _ in scored], dtype=np.uint64).reshape(len(scored))
    positions = np.array([p for _, p, _ in scored], dtype=np.uint64).reshape(len(scored))
    tokens = np.array([x for _, _, x in scored], dtype=np.int64).reshape(len(scored))
    return seeds, positions, tokens


E = TypeVar("E")


class BaselineScheme(Generic[E]):
    """A baseline's key, configuration and ``detect``; subclasses supply the rest."""

    key: WatermarkKey
    config: Any  # the baseline's own frozen configuration dataclass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key_id={self.key.key_id!r}, config={self.config!r})"

    def evidence(self, token_ids: Sequence[int]) -> E:
        raise NotImplementedError

    def _detect(self, ev: E, num_bits: int | None, significance: float) -> DetectionResult:
        raise NotImplementedError

    def detect(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DetectionResult:
        return self._detect(self.evidence(token_ids), num_bits, significance)


class CountCellScheme(BaselineScheme[TokenEvidence]):
    """Detection, decoding and registry matching over count-cell evidence."""

    _prf: PRF  # the detector's tie-break stream
    _cells: WatermarkConfig  # the cell layout: one group, one trial a token

    def _native_z(self, ev: TokenEvidence, num_bits: int) -> float:
        raise NotImplementedError

    def _detect(
        self, ev: TokenEvidence, num_bits: int | None, significance: float
    ) -> DetectionResult:
        result = detect(self._prf, self._cells, ev, num_bits, significance)
        if num_bits is None:
            # the scan's paper z, sum |2*ones - trials| / sqrt(T) over the selected
            # grouping, is already the native z of these schemes at gamma = 1/2
            return result
        return replace(result, paper_z_score=self._native_z(ev, num_bits))

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult:
        ev = self.evidence(token_ids)
        detection = self._detect(ev, num_bits, significance)
        return decode(self._cells, ev, num_bits, detection, list_size)

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None:
        return _match_registry(self._cells, self.evidence(token_ids), candidates)
