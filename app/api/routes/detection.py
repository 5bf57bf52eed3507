"""POST /decode and POST /detect: model-free, tokenizer only."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter

from app.api.deps import CurrentTenant, Runtime, RuntimeDep
from app.api.errors import APIError
from app.schemas.common import ERROR_RESPONSES
from app.schemas.watermark import (
    BitConfidence,
    DecodeRequest,
    DecodeResponse,
    DetectRequest,
    DetectResponse,
    RegistryMatchOut,
)
from app.services.tenants import UnknownKeyVersion
from worldcup_core.message import MessageIdCodec

router = APIRouter(tags=["watermark"])


def _token_ids(runtime: Runtime, text: str) -> list[int]:
    limit = runtime.settings.max_text_chars
    if len(text) > limit:
        raise APIError(
            422, f"text is {len(text)} characters; the limit is {limit}", "text_too_long"
        )
    if not text.strip():
        raise APIError(422, "text is empty", "empty_text")
    ids: list[int] = runtime.tokenizer(text, add_special_tokens=False).input_ids
    return ids


@router.post("/decode", response_model=DecodeResponse, responses=ERROR_RESPONSES)
async def decode(body: DecodeRequest, runtime: RuntimeDep, tenant: CurrentTenant) -> DecodeResponse:
    """Recover the payload and, if it was issued from the registry, whose it is."""
    ids = _token_ids(runtime, body.text)
    num_bits = body.num_bits or runtime.settings.default_num_bits
    try:
        outcome = await runtime.tenants.decode(tenant.tenant_id, ids, num_bits, body.key_version)
    except UnknownKeyVersion:
        raise APIError(404, f"no key version {body.key_version}", "unknown_key_version") from None
    result, det = outcome.result, outcome.result.detection
    runtime.metrics.detections.labels("watermarked" if det.is_watermarked else "clean").inc()
    match = None
    # The registry search always has a best candidate; report it only when the
    # agreement is significant, or any text (another tenant's, a human's) would
    # "match" whichever entry happens to agree best.
    found = outcome.match
    if found is not None and found.p_value >= runtime.settings.significance:
        found = None
    if found is not None and outcome.entry is not None:
        entry = outcome.entry
        versions = await runtime.tenants.versions(tenant.tenant_id)
        scheme = next(v.scheme for v in versions if v.version == outcome.key_version)
        exact_bits = MessageIdCodec(scheme.key, num_bits).payload(entry.message_id).bits
        match = RegistryMatchOut(
            message_id=entry.message_id,
            metadata=entry.metadata,
            issued_at=dt.datetime.fromtimestamp(entry.issued_at, tz=dt.UTC),
            num_bits=entry.num_bits,
            confidence=found.posterior,
            p_value=found.p_value,
            exact=exact_bits == result.bits,
        )
    return DecodeResponse(
        bits=result.bits,
        bit_confidence=[
            BitConfidence(z=round(z, 4), p_value=p)
            for z, p in zip(result.bit_z, result.bit_p_values, strict=True)
        ],
        erasures=list(result.erasures),
        p_value=det.p_value,
        z_score=det.z_score,
        is_watermarked=det.is_watermarked,
        num_tokens=det.num_tokens,
        num_scored_tokens=det.num_scored_tokens,
        key_version=outcome.key_version,
        registry_match=match,
    )


@router.post("/detect", response_model=DetectResponse, responses=ERROR_RESPONSES)
async def detect(body: DetectRequest, runtime: RuntimeDep, tenant: CurrentTenant) -> DetectResponse:
    """Is this text watermarked with any of my keys? A calibrated, message-free test."""
    ids = _token_ids(runtime, body.text)
    significance = runtime.settings.significance
    outcome = await runtime.tenants.detect(tenant.tenant_id, ids, significance)
    watermarked = outcome.p_value < significance
    runtime.metrics.detections.labels("watermarked" if watermarked else "clean").inc()
    return DetectResponse(
        is_watermarked=watermarked,
        p_value=outcome.p_value,
        z_score=outcome.z_score,
        num_tokens=outcome.result.num_tokens,
        num_scored_tokens=outcome.result.num_scored_tokens,
        significance=significance,
        key_version=outcome.key_version,
    )
