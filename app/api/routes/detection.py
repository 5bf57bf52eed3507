"""POST /decode and /detect, and their bulk forms: model-free, tokenizer only."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import DecodeBatchKey, DecodeKey, DetectBatchKey, DetectKey, RuntimeDep
from app.schemas.common import error_responses
from app.schemas.exposure import DecodeVerdict, DetectVerdict
from app.schemas.watermark import (
    DecodeBatchRequest,
    DecodeBatchResponse,
    DecodeRequest,
    DecodeResponse,
    DetectBatchRequest,
    DetectBatchResponse,
    DetectRequest,
    DetectResponse,
)
from app.services import detection

router = APIRouter(tags=["watermark"])

_SCORING_ERRORS = (400, 401, 403, 413, 422, 429, 503)
_UNREADABLE = "A registry entry that cannot be returned exactly (`registry_entry_unreadable`)"


@router.post(
    "/decode",
    response_model=DecodeResponse | DecodeVerdict,
    responses=error_responses(
        *_SCORING_ERRORS, 404, 409, e404="No such key version", e409=_UNREADABLE
    ),
)
async def decode(
    body: DecodeRequest, runtime: RuntimeDep, principal: DecodeKey
) -> DecodeResponse | DecodeVerdict:
    """Recover the payload and, if it was issued from the registry, whose it is.
    A ``verdict`` key gets the verdict and the registry entry only; ``evidence`` is
    for a ``full`` key that also holds the ``provenance`` scope (an analyst's key)."""
    return await detection.decode(runtime, principal, body)


@router.post(
    "/detect",
    response_model=DetectResponse | DetectVerdict,
    responses=error_responses(*_SCORING_ERRORS),
)
async def detect(
    body: DetectRequest, runtime: RuntimeDep, principal: DetectKey
) -> DetectResponse | DetectVerdict:
    """Is this text watermarked with any of my keys? A calibrated, message-free test.
    A ``verdict`` key gets one word (see VERDICT_LEVELS) instead of the scores."""
    return await detection.detect(runtime, principal, body)


@router.post(
    "/decode/batch",
    response_model=DecodeBatchResponse,
    responses=error_responses(*_SCORING_ERRORS, 404, e404="No such key version"),
)
async def decode_batch(
    body: DecodeBatchRequest, runtime: RuntimeDep, principal: DecodeBatchKey
) -> DecodeBatchResponse:
    """Bulk /decode. Rate-limited and probe-counted per text; an invalid text fails
    only its own item."""
    return await detection.decode_batch(runtime, principal, body)


@router.post(
    "/detect/batch", response_model=DetectBatchResponse, responses=error_responses(*_SCORING_ERRORS)
)
async def detect_batch(
    body: DetectBatchRequest, runtime: RuntimeDep, principal: DetectBatchKey
) -> DetectBatchResponse:
    """Bulk /detect. Rate-limited and probe-counted per text; an invalid text fails
    only its own item."""
    return await detection.detect_batch(runtime, principal, body)
