"""``/v1/models``: the name clients send as ``model``, and the server's fingerprint."""

from __future__ import annotations

import hashlib
from pathlib import Path

from app.core.errors import APIError
from app.schemas.openai.common import ModelCard, ModelList
from app.services.runtime import Runtime
from worldcup_core import __version__
from worldcup_core.models import EMBEDDED_MODEL_ID

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def model_name(runtime: Runtime) -> str:
    """The id clients send as ``model``: the setting, or the model's short name."""
    settings = runtime.settings
    if settings.served_model_name:
        return settings.served_model_name
    if runtime.model_id == EMBEDDED_MODEL_ID:
        return EMBEDDED_NAME
    return Path(runtime.model_id).name or runtime.model_id


def model_list(runtime: Runtime, started: float) -> ModelList:
    if runtime.engine is None:  # the detector role generates nothing
        return ModelList(data=[])
    return ModelList(
        data=[ModelCard(id=model_name(runtime), created=int(started), owned_by="worldcup")]
    )


def check_model(runtime: Runtime, requested: str) -> None:
    if requested not in (model_name(runtime), runtime.model_id):
        raise APIError(
            404,
            f"the model '{requested}' does not exist on this server; see GET /v1/models",
            "model_not_found",
            param="model",
        )


def fingerprint(runtime: Runtime) -> str:
    """Changes when the app, the model or the scheme of new keys changes."""
    seed = f"{__version__}|{runtime.model_id}|{runtime.settings.scheme}"
    return "fp_" + hashlib.sha256(seed.encode()).hexdigest()[:12]


def model_card(runtime: Runtime, started: float, model: str) -> ModelCard:
    """``GET /v1/models/{model}``: the card of the served model, by either of its names."""
    for card in model_list(runtime, started).data:
        if model in (card.id, runtime.model_id):
            return card
    raise APIError(404, f"the model '{model}' does not exist", "model_not_found", param="model")
