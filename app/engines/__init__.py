"""Generation engines behind one protocol (:mod:`app.engines.base`); ``WORLDCUP_ENGINE``
picks one. The vLLM engine is imported only when asked for: the base install has no vLLM."""

from __future__ import annotations

from typing import Any

from app.core.config import Settings
from app.core.metrics import Metrics
from app.engines.base import Engine, EngineStopped, GenerationJob, QueueFull

__all__ = ["Engine", "EngineStopped", "GenerationJob", "QueueFull", "load_engine"]


def load_engine(settings: Settings, metrics: Metrics) -> tuple[Engine, Any, str]:
    """Build the configured engine (blocking: loads the model); returns it, the
    tokenizer and the model id."""
    if settings.engine == "vllm":
        from app.engines.vllm import VLLMEngine

        return VLLMEngine.load(settings, metrics)
    from app.engines.hf import HFEngine

    return HFEngine.load(settings, metrics)
