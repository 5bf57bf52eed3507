"""The served model's token weights for detection (issue #44): once per text, any key.

Every test of a text (message-free, payload length known, registry, the decoder's
per-bit evidence and list ranking) weighs each scored token by its informativeness
under the served model (:mod:`worldcup_core.token_weights`). The weights depend on
the text and the model only, never on a key, so :class:`ModelWeights` computes them
once per text and every key version and tenant searched reuses them; a small cache
(by a digest of the token ids) serves the same text asked about again (a /detect
then a /decode, two tenants' checkers). Under H0 the g-bits stay fair coins given
the weights, so the p-values stay exact (:mod:`worldcup_core.detector_model`).

Where no model is loaded (the detector role, the vLLM engine, or
``WORLDCUP_DETECT_WITH_MODEL=false``) :meth:`ModelWeights.of` gives None and every
test is the model-free one; the answer says which (:data:`Statistic`). So does an
answer whose forward pass failed (logged): it falls back to model-free rather than
fail the request.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np

from app.engines.base import F64, TokenWeigher
from worldcup_core import WorldCup
from worldcup_core.detector_model import model_applies

logger = logging.getLogger(__name__)

Statistic = Literal["model", "model_free"]
CACHED_TEXTS = 4096  # texts' weights kept per process (a 128-token text: 1 KiB)


def _digest(ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


class ModelWeights:
    """Token weights from the engine's model, cached by text; None without a model."""

    def __init__(self, weigher: TokenWeigher | None, cached: int = CACHED_TEXTS) -> None:
        self.weigher = weigher
        self.cached = cached
        self._cache: OrderedDict[bytes, F64] = OrderedDict()

    @property
    def loaded(self) -> bool:
        return self.weigher is not None

    async def of(self, texts: Sequence[Sequence[int]]) -> list[F64] | None:
        """One weight array per text (as long as it), or None: model-free. One batched
        request to the engine for the texts not cached."""
        if self.weigher is None:
            return None
        keys = [_digest(t) for t in texts]
        missing = {k: i for i, k in enumerate(keys) if k not in self._cache}
        if missing:
            try:
                found = await self.weigher.token_weights([texts[i] for i in missing.values()])
            except Exception:  # the engine stopping, a failed batch: model-free, and said so
                logger.warning("token weights unavailable: model-free statistic", exc_info=True)
                return None
            for key, weights in zip(missing, found, strict=True):
                weights.setflags(write=False)  # shared by every caller of this text
                self._cache[key] = weights
        out = []
        for key in keys:
            self._cache.move_to_end(key)
            out.append(self._cache[key])
        while len(self._cache) > self.cached:
            self._cache.popitem(last=False)
        return out


def statistic_of(weights: object | None, schemes: Sequence[WorldCup]) -> Statistic:
    """Which statistic an answer took: ``model`` when the model's weights were given
    and apply to the scheme that decided (``worldcup-v2``, variant ``worldcup``;
    ``worldcup-v1`` keys keep the model-free statistic whatever is loaded)."""
    if weights is None or not any(model_applies(s.config) for s in schemes):
        return "model_free"
    return "model"
