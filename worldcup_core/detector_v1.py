"""worldcup-v1's detection and decoding: one text at a time.

Under v1 the keyed functions are BLAKE2b over each scored token
(:class:`~worldcup_core.prf.PRF`) and positions are ``mod B``, so the unknown-length
test scans every symbol count (see :mod:`worldcup_core.detector`). Texts issued under
v1 decode through this module, unchanged, for as long as they exist.
"""

from __future__ import annotations

from collections.abc import Sequence

from worldcup_core.config import WatermarkConfig
from worldcup_core.decoder import DecodeResult, decode
from worldcup_core.detector import DetectionResult, detect
from worldcup_core.prf import PRF, ScoredItems, WatermarkKey
from worldcup_core.scoring import TokenEvidence, extract_evidence


class DetectorV1:
    """Detection and decoding under ``worldcup-v1`` for one key and configuration."""

    def __init__(self, key: WatermarkKey, config: WatermarkConfig) -> None:
        self.config = config
        self.prf = PRF(key)

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        return extract_evidence(self.prf, self.config, token_ids)

    def scored_indices(self, token_ids: Sequence[int]) -> list[int]:
        return list(ScoredItems.of(token_ids, self.config.context_width).indices)

    def detect_many(
        self, texts: Sequence[Sequence[int]], num_bits: int | None, significance: float
    ) -> list[DetectionResult]:
        return [
            detect(self.prf, self.config, self.evidence(t), num_bits, significance) for t in texts
        ]

    def decode_many(
        self, texts: Sequence[Sequence[int]], num_bits: int, list_size: int, significance: float
    ) -> list[DecodeResult]:
        out = []
        for t in texts:
            ev = self.evidence(t)
            detection = detect(self.prf, self.config, ev, num_bits, significance)
            out.append(decode(self.config, ev, num_bits, detection, list_size))
        return out
