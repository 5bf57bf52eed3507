"""Plain zero-bit KGW (Kirchenbauer et al., ICML 2023): a green list per context, a z-test.

The anchor of the forgery measurement (:mod:`worldcup_eval.forgery`, issue #45):
watermark stealing (Jovanović et al., ICML 2024) is reported to spoof KGW with a
context of one token over 80 % of the time at FPR 1e-3, so an attack that does not
spoof this scheme is broken, not the defence it is measured against.

* **Generation.** At each step whose context (the last ``context_width`` generated
  tokens, sentinel-padded as everywhere in the project) is new in the response, a
  ``gamma`` share of the vocabulary is green (keyed BLAKE2b seed of the context,
  SplitMix64 per token id) and gets ``+delta`` on its logits, before temperature,
  top-k and top-p. Repeated contexts are left alone, as in every scheme here.
* **Detection.** The green tokens among the scored ones (the first occurrence of
  each context) against Binomial(n, gamma): the exact upper tail is the p-value
  (valid at any length), the classic ``z`` is reported beside it.

The payload a :class:`~worldcup_core.generation.GenerationRequest` carries is
ignored: KGW carries no message.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
from scipy import stats

from worldcup_core.baselines.cells import first_contexts
from worldcup_core.baselines.sequence import ContextSequence
from worldcup_core.message import Payload
from worldcup_core.prf import Context, WatermarkKey, context_at, pack_context, splitmix64
from worldcup_core.tournament import FloatArray

KGW_VERSION: Final = "kgw-v1"
_PERSON: Final = b"worldcup-kgw"


@dataclass(frozen=True)
class KGWConfig:
    """Green share, logit boost and context width (the forgery anchor: width 1).

    >>> KGWConfig().context_width
    1
    """

    gamma: float = 0.25
    delta: float = 2.0
    context_width: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"gamma must be in (0, 1), got {self.gamma}")
        if not (math.isfinite(self.delta) and 0.0 <= self.delta <= 20.0):
            raise ValueError(f"delta must be in [0, 20], got {self.delta}")
        if not 1 <= self.context_width <= 8:
            raise ValueError(f"context_width must be in 1..8, got {self.context_width}")


@dataclass(frozen=True)
class KGWDetection:
    """The z-test of one text: ``green`` of ``scored`` tokens green."""

    green: int
    scored: int
    num_tokens: int
    z_score: float
    p_value: float  # exact binomial upper tail, P(Bin(scored, gamma) >= green)


def kgw_seed(key: WatermarkKey, context: Context) -> int:
    """The 64-bit seed of a context's green list (its own domain of the secret)."""
    digest = hashlib.blake2b(
        pack_context(context), key=key.secret, digest_size=8, person=_PERSON
    ).digest()
    return int.from_bytes(digest, "little")


def green_of(seed: int, token_ids: npt.NDArray[np.int64], gamma: float) -> npt.NDArray[np.bool_]:
    """Whether each token id is green under a context's seed (a ``gamma`` share of ids)."""
    limit = np.uint64(min(int(gamma * 2.0**64), 2**64 - 1))
    out: npt.NDArray[np.bool_] = splitmix64(seed, token_ids) < limit
    return out


class KGWSequence(ContextSequence):
    """``+delta`` on the green list of each fresh context's full-vocabulary logits."""

    modifies_logits = True
    _config: KGWConfig

    def __init__(self, key: WatermarkKey, config: KGWConfig) -> None:
        super().__init__(config)
        self._key = key
        self._vocab: npt.NDArray[np.int64] = np.arange(0, dtype=np.int64)

    def process_logits(self, logits: FloatArray) -> FloatArray:
        context = self.fresh_context()
        if context is None:
            return logits
        vocab = logits.shape[-1]
        if self._vocab.shape[0] != vocab:
            self._vocab = np.arange(vocab, dtype=np.int64)
        green = green_of(kgw_seed(self._key, context), self._vocab, self._config.gamma)
        self.watermarked_steps += 1
        out: FloatArray = logits + self._config.delta * green
        return out


class KGW:
    """Zero-bit KGW with one key (generation hooks and the z-test).

    >>> kgw = KGW(WatermarkKey(bytes(32)))
    >>> kgw.detect([5, 6, 7, 8]).scored
    4
    """

    name = "kgw"
    version = KGW_VERSION

    def __init__(self, key: WatermarkKey, config: KGWConfig | None = None) -> None:
        self.key = key
        self.config = config or KGWConfig()

    def __repr__(self) -> str:
        return f"KGW(key_id={self.key.key_id!r}, config={self.config!r})"

    def sequence(self, payload: Payload) -> KGWSequence:
        """A fresh response's hooks (``payload`` is ignored: zero-bit)."""
        return KGWSequence(self.key, self.config)

    def is_green(self, context: Context, token: int) -> bool:
        seed = kgw_seed(self.key, context)
        return bool(green_of(seed, np.array([token], dtype=np.int64), self.config.gamma)[0])

    def detect(self, token_ids: Sequence[int]) -> KGWDetection:
        """The z-test over the first occurrence of each context (what generation biased)."""
        ids = [int(t) for t in token_ids]
        width, gamma = self.config.context_width, self.config.gamma
        green = 0
        scored = 0
        for t, _ in first_contexts(ids, width):
            scored += 1
            green += self.is_green(context_at(ids, t, width), ids[t])
        if scored == 0:
            return KGWDetection(0, 0, len(ids), 0.0, 1.0)
        z = (green - gamma * scored) / math.sqrt(scored * gamma * (1.0 - gamma))
        p = float(stats.binom.sf(green - 1, scored, gamma))
        return KGWDetection(green, scored, len(ids), z, min(1.0, max(p, 0.0)))
