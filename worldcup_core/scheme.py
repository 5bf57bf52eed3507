"""The interface every watermark scheme offers, and WorldCup behind it.

The generation loop, the Hugging Face adapter, the CLI and the evaluation
harness only see these protocols, so WorldCup and the MPAC baseline run side
by side through identical code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worldcup_core.config import WatermarkConfig
from worldcup_core.decoder import DEFAULT_LIST_SIZE, DecodeResult, RegistryMatch, decode
from worldcup_core.decoder import match_registry as _match_registry
from worldcup_core.detector import DEFAULT_SIGNIFICANCE, DetectionResult, detect
from worldcup_core.encoder import IntArray, WorldCupEncoder
from worldcup_core.message import Payload
from worldcup_core.prf import PRF, SCHEME_VERSION, WatermarkKey
from worldcup_core.scoring import TokenEvidence, extract_evidence
from worldcup_core.tournament import FloatArray


class SequenceWatermark(Protocol):
    """Per-sequence hooks, called once per generation step.

    ``process_logits`` sees the full-vocabulary logits before any filtering
    (KGW-style schemes bias them); ``reweight`` sees the final filtered
    distribution over the surviving candidates (WorldCup acts here);
    ``observe`` is told the token that was sampled. ``modifies_logits`` tells
    the loop whether ``process_logits`` is worth a full-vocabulary copy.
    """

    modifies_logits: bool

    def process_logits(self, logits: FloatArray) -> FloatArray: ...

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray: ...

    def observe(self, token: int) -> None: ...


class WatermarkScheme(Protocol):
    name: str
    version: str

    def sequence(self, payload: Payload) -> SequenceWatermark: ...

    def detect(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DetectionResult: ...

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult: ...

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None: ...


class WorldCup:
    """WorldCup sampling with one key and configuration.

    >>> wc = WorldCup(WatermarkKey(bytes(32)))
    >>> wc.detect([1, 2, 3]).num_scored_tokens
    3
    """

    name = "worldcup"
    version = SCHEME_VERSION

    def __init__(self, key: WatermarkKey, config: WatermarkConfig | None = None) -> None:
        self.key = key
        self.config = config or WatermarkConfig()
        self._prf = PRF(key)

    def __repr__(self) -> str:
        return f"WorldCup(key_id={self.key.key_id!r}, config={self.config!r})"

    @property
    def prf(self) -> PRF:
        return self._prf

    def sequence(self, payload: Payload) -> SequenceWatermark:
        return WorldCupEncoder(self.key, self.config, payload).start()

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        return extract_evidence(self._prf, self.config, token_ids)

    def detect(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DetectionResult:
        return detect(self._prf, self.config, self.evidence(token_ids), num_bits, significance)

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult:
        ev = self.evidence(token_ids)
        detection = detect(self._prf, self.config, ev, num_bits, significance)
        return decode(self.config, ev, num_bits, detection, list_size)

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None:
        return _match_registry(self.config, self.evidence(token_ids), candidates)
