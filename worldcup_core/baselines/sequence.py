"""The per-sequence state every baseline keeps, and the green-list step two of them share.

All four baselines (like WorldCup) bias a step only where its context (the last
``c`` generated tokens) is new in this response, and their detectors score only
those tokens: a repeated context would repeat the same bias and count the same
evidence twice. :class:`ContextSequence` is that bookkeeping;
:class:`GreenListSequence` adds the KGW-style logit step of MPAC and SegMark
(``+delta`` on a green list, before temperature, top-k and top-p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from worldcup_core.prf import Context, context_at
from worldcup_core.tournament import FloatArray

IntArray = npt.NDArray[np.int64]


class _Windowed(Protocol):
    @property
    def context_width(self) -> int: ...


class _Biased(_Windowed, Protocol):
    @property
    def delta(self) -> float: ...


@dataclass(frozen=True)
class GreenListConfig:
    """What a green-list scheme's generator and detector share (besides the key):
    MPAC's and SegMark's configurations are this one.

    >>> GreenListConfig().delta
    2.0
    """

    gamma: float = 0.5
    delta: float = 2.0
    context_width: int = 2

    def __post_init__(self) -> None:
        if self.gamma != 0.5:
            raise ValueError(
                f"only gamma = 0.5 is supported (binary green lists, as in the papers' "
                f"settings), got {self.gamma}"
            )
        if not (math.isfinite(self.delta) and 0.0 <= self.delta <= 20.0):
            raise ValueError(f"delta must be in [0, 20], got {self.delta}")
        if not 1 <= self.context_width <= 8:
            raise ValueError(f"context_width must be in 1..8, got {self.context_width}")


class ContextSequence:
    """The response so far and the contexts seen; subclasses add the scheme's step."""

    modifies_logits = False  # the scheme reweights the final filtered distribution

    def __init__(self, config: _Windowed) -> None:
        self._config = config
        self.generated: list[int] = []
        self._seen: set[Context] = set()
        self.watermarked_steps = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(config={self._config!r}, generated={len(self.generated)})"

    def _context(self) -> Context:
        return context_at(self.generated, len(self.generated), self._config.context_width)

    def fresh_context(self) -> Context | None:
        """This step's context, or None where it was seen before in this response."""
        context = self._context()
        return None if context in self._seen else context

    def process_logits(self, logits: FloatArray) -> FloatArray:
        """Leaves logits alone (schemes that reweight the filtered distribution)."""
        return logits

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        """Leaves the distribution alone (schemes that act on logits)."""
        return probs

    def observe(self, token: int) -> None:
        self._seen.add(self._context())
        self.generated.append(int(token))


class GreenListSequence(ContextSequence):
    """KGW-style: ``+delta`` on this step's green list of the full vocabulary."""

    modifies_logits = True  # the loop must hand over full-vocabulary logits
    _config: _Biased

    def __init__(self, config: _Biased) -> None:
        super().__init__(config)
        self._vocab: IntArray = np.arange(0, dtype=np.int64)

    def green_mask(self, vocab_size: int) -> npt.NDArray[np.bool_] | None:
        """This step's green list, or None where the context repeats."""
        context = self.fresh_context()
        if context is None:
            return None
        if self._vocab.shape[0] != vocab_size:
            self._vocab = np.arange(vocab_size, dtype=np.int64)
        return self._green(context, self._vocab)

    def _green(self, context: Context, vocab: IntArray) -> npt.NDArray[np.bool_]:
        raise NotImplementedError

    def process_logits(self, logits: FloatArray) -> FloatArray:
        """Full-vocabulary logits (last axis) plus ``delta`` on the green list.

        Applied before temperature/top-k/top-p, as in KGW and the references.
        """
        mask = self.green_mask(logits.shape[-1])
        if mask is None:
            return logits
        self.watermarked_steps += 1
        out: FloatArray = logits + self._config.delta * mask
        return out
