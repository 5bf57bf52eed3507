"""WorldCup sampling: multi-bit watermarking for LLM text (pure algorithm library)."""

from worldcup_core.config import SamplingConfig, Variant, WatermarkConfig
from worldcup_core.decoder import DecodeResult, RegistryMatch
from worldcup_core.detector import DetectionResult
from worldcup_core.message import Payload
from worldcup_core.prf import SCHEME_V1, SCHEME_V2, SCHEME_VERSIONS, WatermarkKey
from worldcup_core.scheme import SequenceWatermark, WatermarkScheme, WorldCup

__version__ = "0.1.0"

__all__ = [
    "SCHEME_V1",
    "SCHEME_V2",
    "SCHEME_VERSIONS",
    "DecodeResult",
    "DetectionResult",
    "Payload",
    "RegistryMatch",
    "SamplingConfig",
    "SequenceWatermark",
    "Variant",
    "WatermarkConfig",
    "WatermarkKey",
    "WatermarkScheme",
    "WorldCup",
]
