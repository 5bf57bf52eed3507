"""The interface every watermark scheme offers, and WorldCup behind it.

The generation loop, the Hugging Face adapter, the CLI and the evaluation
harness only see these protocols, so WorldCup and the MPAC baseline run side
by side through identical code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from worldcup_core.config import WatermarkConfig
from worldcup_core.decoder import DEFAULT_LIST_SIZE, DecodeResult, RegistryMatch
from worldcup_core.decoder import match_registry as _match_registry
from worldcup_core.detector import DEFAULT_SIGNIFICANCE, DetectionResult
from worldcup_core.detector_v1 import DetectorV1
from worldcup_core.detector_v2 import DetectorV2
from worldcup_core.encoder import IntArray, WorldCupEncoder
from worldcup_core.message import Payload
from worldcup_core.prf import PRF, PRFV2, SCHEME_V1, SCHEME_V2, WatermarkKey
from worldcup_core.scoring import TokenEvidence
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


class VersionDetector(Protocol):
    """How one scheme version hashes, detects and decodes texts (``detector_v1``/``_v2``)."""

    @property
    def prf(self) -> PRF | PRFV2: ...

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence: ...

    def scored_indices(self, token_ids: Sequence[int]) -> list[int]: ...

    def detect_many(
        self, texts: Sequence[Sequence[int]], num_bits: int | None, significance: float
    ) -> list[DetectionResult]: ...

    def decode_many(
        self, texts: Sequence[Sequence[int]], num_bits: int, list_size: int, significance: float
    ) -> list[DecodeResult]: ...


DETECTORS: dict[str, Callable[[WatermarkKey, WatermarkConfig], VersionDetector]] = {
    SCHEME_V1: DetectorV1,
    SCHEME_V2: DetectorV2,
}
"""Each scheme version's detector, by version name: a text decodes under its own."""


class WorldCup:
    """WorldCup sampling with one key and configuration.

    >>> wc = WorldCup(WatermarkKey(bytes(32)))  # scheme worldcup-v2
    >>> wc.detect([1, 2, 3, 4]).num_scored_tokens  # the first c = 2 tokens carry nothing
    2
    """

    name = "worldcup"

    def __init__(self, key: WatermarkKey, config: WatermarkConfig | None = None) -> None:
        self.key = key
        self.config = config or WatermarkConfig()
        self.version = self.config.version
        self._detector = DETECTORS[self.version](key, self.config)

    def __repr__(self) -> str:
        return f"WorldCup(key_id={self.key.key_id!r}, config={self.config!r})"

    @property
    def prf(self) -> PRF | PRFV2:
        """The keyed functions of this scheme's version (BLAKE2b v1, SipHash v2)."""
        return self._detector.prf

    def sequence(self, payload: Payload) -> SequenceWatermark:
        return WorldCupEncoder(self.key, self.config, payload).start()

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        return self._detector.evidence(token_ids)

    def scored_indices(self, token_ids: Sequence[int]) -> list[int]:
        """Which tokens of a response this scheme scores (the others carry no evidence)."""
        return self._detector.scored_indices(token_ids)

    def detect(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DetectionResult:
        return self.detect_many([token_ids], num_bits, significance)[0]

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult:
        return self.decode_many([token_ids], num_bits, list_size, significance)[0]

    def detect_many(
        self,
        texts: Sequence[Sequence[int]],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> list[DetectionResult]:
        """:meth:`detect` for many texts; under v2 one vectorised pass serves them all."""
        return self._detector.detect_many(texts, num_bits, significance)

    def decode_many(
        self,
        texts: Sequence[Sequence[int]],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> list[DecodeResult]:
        """:meth:`decode` for many texts; under v2 one vectorised pass serves them all."""
        return self._detector.decode_many(texts, num_bits, list_size, significance)

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None:
        return _match_registry(self.config, self.evidence(token_ids), candidates)
