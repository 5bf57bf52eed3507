"""POST /decode and /detect, and their bulk forms: model-free, tokenizer only."""

from __future__ import annotations

import datetime as dt
import math
from typing import TypeVar

from fastapi import APIRouter

from app.api.deps import CurrentTenant, Runtime, RuntimeDep, UnchargedTenant, charge
from app.api.errors import APIError
from app.schemas.common import error_responses
from app.schemas.watermark import (
    BatchItemError,
    BitConfidence,
    DecodeBatchItem,
    DecodeBatchRequest,
    DecodeBatchResponse,
    DecodeRequest,
    DecodeResponse,
    DetectBatchItem,
    DetectBatchRequest,
    DetectBatchResponse,
    DetectRequest,
    DetectResponse,
    RegistryMatchOut,
    check_metadata,
)
from app.services.tenants import DecodeOutcome, DetectOutcome, UnknownKeyVersion
from worldcup_core import WorldCup
from worldcup_core.detector import z_from_log_p
from worldcup_core.message import MessageIdCodec
from worldcup_core.scoring import sidak_log_p

router = APIRouter(tags=["watermark"])


def token_ids(runtime: Runtime, text: str) -> list[int]:
    """Tokenise a text to score, or raise a 422 if it is over the (published) limit.

    Whitespace-only text is scored like any other (JSON Schema cannot say "not only
    whitespace"): nothing in it is scored, so the answer is an ordinary "not
    watermarked" with p = 1 and z = 0.
    """
    limit = runtime.settings.max_text_chars
    if len(text) > limit:
        raise APIError(
            422, f"text is {len(text)} characters; the limit is {limit}", "text_too_long"
        )
    ids: list[int] = runtime.tokenizer(text, add_special_tokens=False).input_ids
    return ids


def readable_metadata(metadata: dict[str, object], message_id: int) -> dict[str, object]:
    """Stored metadata, or a clear 409 if an entry written before metadata was checked
    holds something that cannot be returned exactly (a lone surrogate, NaN)."""
    try:
        check_metadata(metadata)
    except ValueError:
        raise APIError(
            409,
            f"registry entry {message_id} holds metadata that cannot be returned exactly "
            "(written before metadata was validated)",
            "registry_entry_unreadable",
        ) from None
    return metadata


def corrected(log10_p: float, tests: int, num_scored: int) -> tuple[float, float]:
    """(p, z) of the best of ``tests`` key versions, Šidák-corrected: exact and uniform
    under H0 (independent keys), so z is standard normal there, never clipped."""
    log_p = sidak_log_p(log10_p * math.log(10.0), tests)
    return math.exp(log_p), z_from_log_p(log_p, num_scored)


def registry_match(
    runtime: Runtime, scheme: WorldCup, num_bits: int, outcome: DecodeOutcome
) -> RegistryMatchOut | None:
    """The registry entry, reported only when its agreement is significant (the search
    always has a best candidate, and any text, another tenant's or a human's, would
    otherwise "match" whichever entry happens to agree best) and clearly ahead of
    the other entries (``registry_min_confidence``)."""
    found, entry = outcome.match, outcome.entry
    settings = runtime.settings
    if found is None or entry is None or found.p_value >= settings.significance:
        return None
    if found.posterior < settings.registry_min_confidence:
        return None  # a close runner-up: too likely to name the wrong entry
    exact_bits = MessageIdCodec(scheme.key, num_bits).payload(entry.message_id).bits
    return RegistryMatchOut(
        message_id=entry.message_id,
        metadata=readable_metadata(entry.metadata, entry.message_id),
        issued_at=dt.datetime.fromtimestamp(entry.issued_at, tz=dt.UTC),
        num_bits=entry.num_bits,
        confidence=found.posterior,
        p_value=found.p_value,
        exact=exact_bits == outcome.result.bits,
    )


def _decode_response(
    runtime: Runtime, schemes: dict[int, WorldCup], num_bits: int, outcome: DecodeOutcome
) -> DecodeResponse:
    result, det = outcome.result, outcome.result.detection
    p_value, z_score = corrected(det.log10_p_value, outcome.versions_tried, det.num_scored_tokens)
    watermarked = p_value < runtime.settings.significance
    runtime.metrics.detections.labels("watermarked" if watermarked else "clean").inc()
    return DecodeResponse(
        bits=result.bits,
        bit_confidence=[
            BitConfidence(z=round(z, 4), p_value=p)
            for z, p in zip(result.bit_z, result.bit_p_values, strict=True)
        ],
        erasures=list(result.erasures),
        p_value=p_value,
        z_score=z_score,
        is_watermarked=watermarked,
        num_tokens=det.num_tokens,
        num_scored_tokens=det.num_scored_tokens,
        key_version=outcome.key_version,
        registry_match=registry_match(runtime, schemes[outcome.key_version], num_bits, outcome),
    )


def _detect_response(runtime: Runtime, outcome: DetectOutcome) -> DetectResponse:
    significance = runtime.settings.significance
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


async def _schemes(runtime: Runtime, tenant_id: str) -> dict[int, WorldCup]:
    return {v.version: v.scheme for v in await runtime.tenants.versions(tenant_id)}


def _check_batch(runtime: Runtime, texts: list[str]) -> None:
    limit = runtime.settings.max_batch_texts
    if len(texts) > limit:
        raise APIError(
            422, f"{len(texts)} texts in one batch; the limit is {limit}", "batch_too_large"
        )


def _tokenise_all(
    runtime: Runtime, texts: list[str]
) -> tuple[list[int], list[list[int]], dict[int, BatchItemError]]:
    """(indices of good texts, their token ids, errors by index)."""
    good: list[int] = []
    ids: list[list[int]] = []
    errors: dict[int, BatchItemError] = {}
    for i, text in enumerate(texts):
        try:
            ids.append(token_ids(runtime, text))
            good.append(i)
        except APIError as exc:
            errors[i] = BatchItemError(code=exc.code, message=exc.message)
    return good, ids, errors


_Answer = TypeVar("_Answer", DecodeResponse, DetectResponse)


def _assemble(
    count: int, good: list[int], answers: list[_Answer], errors: dict[int, BatchItemError]
) -> tuple[list[tuple[int, _Answer | None, BatchItemError | None]], int]:
    """(index, answer, error) for every text of a batch, and how many were watermarked."""
    by_index = dict(zip(good, answers, strict=True))
    items = [(i, by_index.get(i), errors.get(i)) for i in range(count)]
    return items, sum(a.is_watermarked for a in answers)


_SCORING_ERRORS = (400, 401, 403, 413, 422, 429, 503)
_UNREADABLE = "A registry entry that cannot be returned exactly (`registry_entry_unreadable`)"


@router.post(
    "/decode",
    response_model=DecodeResponse,
    responses=error_responses(
        *_SCORING_ERRORS, 404, 409, e404="No such key version", e409=_UNREADABLE
    ),
)
async def decode(body: DecodeRequest, runtime: RuntimeDep, tenant: CurrentTenant) -> DecodeResponse:
    """Recover the payload and, if it was issued from the registry, whose it is."""
    ids = token_ids(runtime, body.text)
    num_bits = body.num_bits or runtime.settings.default_num_bits
    try:
        outcome = await runtime.tenants.decode(tenant.tenant_id, ids, num_bits, body.key_version)
    except UnknownKeyVersion:
        raise APIError(404, f"no key version {body.key_version}", "unknown_key_version") from None
    schemes = await _schemes(runtime, tenant.tenant_id)
    return _decode_response(runtime, schemes, num_bits, outcome)


@router.post("/detect", response_model=DetectResponse, responses=error_responses(*_SCORING_ERRORS))
async def detect(body: DetectRequest, runtime: RuntimeDep, tenant: CurrentTenant) -> DetectResponse:
    """Is this text watermarked with any of my keys? A calibrated, message-free test."""
    ids = token_ids(runtime, body.text)
    outcome = await runtime.tenants.detect(tenant.tenant_id, ids, runtime.settings.significance)
    return _detect_response(runtime, outcome)


@router.post(
    "/decode/batch",
    response_model=DecodeBatchResponse,
    responses=error_responses(*_SCORING_ERRORS, 404, e404="No such key version"),
)
async def decode_batch(
    body: DecodeBatchRequest, runtime: RuntimeDep, tenant: UnchargedTenant
) -> DecodeBatchResponse:
    """Bulk /decode. Rate-limited per text; an invalid text fails only its own item."""
    _check_batch(runtime, body.texts)
    await charge(runtime, tenant, len(body.texts))
    num_bits = body.num_bits or runtime.settings.default_num_bits
    good, ids, errors = _tokenise_all(runtime, body.texts)
    try:
        outcomes = await runtime.tenants.decode_many(
            tenant.tenant_id, ids, num_bits, body.key_version
        )
    except UnknownKeyVersion:
        raise APIError(404, f"no key version {body.key_version}", "unknown_key_version") from None
    schemes = await _schemes(runtime, tenant.tenant_id)
    answers: list[DecodeResponse] = []
    answered: list[int] = []
    for i, outcome in zip(good, outcomes, strict=True):
        try:
            answers.append(_decode_response(runtime, schemes, num_bits, outcome))
            answered.append(i)
        except APIError as exc:  # an unreadable registry entry fails only its item
            errors[i] = BatchItemError(code=exc.code, message=exc.message)
    results, watermarked = _assemble(len(body.texts), answered, answers, errors)
    return DecodeBatchResponse(
        results=[DecodeBatchItem(index=i, result=r, error=e) for i, r, e in results],
        num_watermarked=watermarked,
        num_errors=len(errors),
    )


@router.post(
    "/detect/batch", response_model=DetectBatchResponse, responses=error_responses(*_SCORING_ERRORS)
)
async def detect_batch(
    body: DetectBatchRequest, runtime: RuntimeDep, tenant: UnchargedTenant
) -> DetectBatchResponse:
    """Bulk /detect. Rate-limited per text; an invalid text fails only its own item."""
    _check_batch(runtime, body.texts)
    await charge(runtime, tenant, len(body.texts))
    good, ids, errors = _tokenise_all(runtime, body.texts)
    outcomes = await runtime.tenants.detect_many(
        tenant.tenant_id, ids, runtime.settings.significance
    )
    answers = [_detect_response(runtime, o) for o in outcomes]
    results, watermarked = _assemble(len(body.texts), good, answers, errors)
    return DetectBatchResponse(
        results=[DetectBatchItem(index=i, result=r, error=e) for i, r, e in results],
        num_watermarked=watermarked,
        num_errors=len(errors),
    )
