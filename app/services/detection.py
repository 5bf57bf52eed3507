"""What /decode, /detect and their bulk forms do, from a parsed request to its answer.

Each request is checked (text length, batch size), tokenised off the event loop and
counted against the caller's probe budget (:mod:`app.services.intake`), scored
under the tenant's key versions (:mod:`app.services.watermark`) and answered in
full or, for a ``verdict`` key, as one word. The routes in
:mod:`app.api.routes.detection` only parse, call these and answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from app.core.errors import APIError
from app.schemas.exposure import DecodeVerdict, DetectVerdict, VerdictRegistryMatch
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
)
from app.services import intake
from app.services.cpu import TOKEN_CHARS
from app.services.probes import Sketch
from app.services.runtime import Runtime, charge
from app.services.tenants import Principal, UnknownKeyVersion
from app.services.watermark import DecodeOutcome, DetectOutcome, corrected
from worldcup_core.verdict import verdict_of


def _decode_response(runtime: Runtime, outcome: DecodeOutcome) -> DecodeResponse:
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
        registry_match=intake.registry_match(runtime, outcome),
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


def _check_batch(runtime: Runtime, texts: list[str]) -> None:
    limit = runtime.settings.max_batch_texts
    if len(texts) > limit:
        raise APIError(
            422, f"{len(texts)} texts in one batch; the limit is {limit}", "batch_too_large"
        )


_Answer = TypeVar("_Answer")


def _assemble(
    count: int, good: list[int], answers: list[_Answer], errors: dict[int, BatchItemError]
) -> list[tuple[int, _Answer | None, BatchItemError | None]]:
    """(index, answer, error) for every text of a batch."""
    by_index = dict(zip(good, answers, strict=True))
    return [(i, by_index.get(i), errors.get(i)) for i in range(count)]


def _decode_verdict(answer: DecodeResponse, detect_p_value: float) -> DecodeVerdict:
    """A verdict key's /decode: the verdict of the message-free statistic (``detect_p_value``,
    the one /detect reports) with the registry entry, so that one key's /decode and
    /detect of a text cannot disagree (issue 24, point 6)."""
    match = answer.registry_match
    return DecodeVerdict(
        verdict=verdict_of(detect_p_value),
        registry_match=None
        if match is None
        else VerdictRegistryMatch(
            message_id=match.message_id, metadata=match.metadata, issued_at=match.issued_at
        ),
    )


def _detect_verdict(answer: DetectResponse) -> DetectVerdict:
    return DetectVerdict(verdict=verdict_of(answer.p_value))


async def detect_p_values(
    runtime: Runtime, principal: Principal, ids: list[list[int]]
) -> list[float]:
    """/detect's message-free statistic for each tokenised text (one worker job)."""
    if not ids:
        return []
    scorer = await runtime.watermark.detector(
        principal.tenant.tenant_id, runtime.settings.significance
    )
    return await runtime.offload(lambda: [scorer(t).p_value for t in ids])


def _is_verdict(principal: Principal) -> bool:
    return principal.key.detail == "verdict"


def _check_evidence_allowed(principal: Principal) -> None:
    """Per-token evidence shows which tokens to edit: one query would do what the probe
    budget exists to prevent. So it is never given to ``verdict`` keys (public
    checkers) and, under ``full``, only to keys that also hold the ``provenance``
    scope, which the admin grants per tenant to its trust-and-safety analysts."""
    if principal.key.detail != "full" or "provenance" not in principal.scopes:
        raise APIError(
            403,
            "per-token evidence needs a 'full' API key that also holds the 'provenance' "
            "scope (granted by an admin)",
            "evidence_not_allowed",
        )


def _unknown_version(version: int | None) -> APIError:
    return APIError(404, f"no key version {version}", "unknown_key_version")


async def decode(
    runtime: Runtime, principal: Principal, body: DecodeRequest
) -> DecodeResponse | DecodeVerdict:
    """Recover the payload and, if it was issued from the registry, whose it is.
    A ``verdict`` key gets the verdict and the registry entry only; ``evidence`` is
    for a ``full`` key that also holds the ``provenance`` scope (an analyst's key)."""
    if body.evidence:
        _check_evidence_allowed(principal)
    ids, pieces, sketches = await intake.tokenise(runtime, principal, body.text, body.evidence)
    await intake.admit_one(runtime, principal, "decode", sketches)
    num_bits = body.num_bits or runtime.settings.default_num_bits
    try:
        outcome = (
            await runtime.watermark.decode_texts(
                principal.tenant.tenant_id, [ids], num_bits, body.key_version
            )
        )[0]
    except UnknownKeyVersion:
        raise _unknown_version(body.key_version) from None
    answer = _decode_response(runtime, outcome)
    if body.evidence:
        answer.evidence = await runtime.watermark.token_evidence(
            principal.tenant.tenant_id, outcome, ids, pieces
        )
    if _is_verdict(principal):
        return _decode_verdict(answer, (await detect_p_values(runtime, principal, [ids]))[0])
    return answer


async def detect(
    runtime: Runtime, principal: Principal, body: DetectRequest
) -> DetectResponse | DetectVerdict:
    """Is this text watermarked with any of my keys? A calibrated, message-free test.
    A ``verdict`` key gets one word (see VERDICT_LEVELS) instead of the scores."""
    intake.check_text(runtime, body.text)
    scorer = await runtime.watermark.detector(
        principal.tenant.tenant_id, runtime.settings.significance
    )
    sketcher = intake.sketcher(runtime, principal)

    def work() -> tuple[list[Sketch | None] | None, DetectOutcome]:
        """One worker job: tokenise, fingerprint and score (a query refused below
        was scored for nothing; the answer is withheld all the same)."""
        ids = intake.encode_texts(runtime.tokenizer, [body.text])
        return (sketcher(ids) if sketcher else None), scorer(ids[0])

    sketches, outcome = await runtime.offload(work)
    await intake.admit_one(runtime, principal, "detect", sketches)
    answer = _detect_response(runtime, outcome)
    return _detect_verdict(answer) if _is_verdict(principal) else answer


async def decode_batch(
    runtime: Runtime, principal: Principal, body: DecodeBatchRequest
) -> DecodeBatchResponse:
    """Bulk /decode. Rate-limited and probe-counted per text; an invalid text fails
    only its own item."""
    await _admit_batch(runtime, principal, body.texts)
    num_bits = body.num_bits or runtime.settings.default_num_bits
    good, ids, _, errors = await intake.take_batch(runtime, principal, "decode/batch", body.texts)
    try:
        outcomes = await runtime.watermark.decode_texts(
            principal.tenant.tenant_id, ids, num_bits, body.key_version
        )
    except UnknownKeyVersion:
        raise _unknown_version(body.key_version) from None
    answers: list[DecodeResponse] = []
    answered: list[int] = []
    answered_ids: list[list[int]] = []
    for index, outcome, text_ids in zip(good, outcomes, ids, strict=True):
        try:
            answers.append(_decode_response(runtime, outcome))
            answered.append(index)
            answered_ids.append(text_ids)
        except APIError as exc:  # an unreadable registry entry fails only its item
            errors[index] = BatchItemError(code=exc.code, message=exc.message)
    detect_p: dict[int, float] = {}
    if _is_verdict(principal):  # verdicts of /detect's statistic, as the single route
        p_values = await detect_p_values(runtime, principal, answered_ids)
        detect_p = {id(a): p for a, p in zip(answers, p_values, strict=True)}
    items, watermarked = _batch_results(
        principal,
        len(body.texts),
        answered,
        answers,
        errors,
        lambda a: _decode_verdict(a, detect_p[id(a)]),
    )
    return DecodeBatchResponse(
        results=[DecodeBatchItem(index=i, result=r, error=e) for i, r, e in items],
        num_watermarked=watermarked,
        num_errors=len(errors),
    )


async def detect_batch(
    runtime: Runtime, principal: Principal, body: DetectBatchRequest
) -> DetectBatchResponse:
    """Bulk /detect. Rate-limited and probe-counted per text; an invalid text fails
    only its own item."""
    tenant = principal.tenant
    await _admit_batch(runtime, principal, body.texts)
    scorer = await runtime.watermark.detector(tenant.tenant_id, runtime.settings.significance)
    # only the items the budget allows are scored: a refused item costs no scoring
    good, allowed, _, errors = await intake.take_batch(
        runtime, principal, "detect/batch", body.texts
    )
    outcomes = await runtime.offload_map(
        lambda chunk: [scorer(t) for t in chunk], allowed, lambda t: TOKEN_CHARS * len(t)
    )
    answers = [_detect_response(runtime, o) for o in outcomes]
    items, watermarked = _batch_results(
        principal, len(body.texts), good, answers, errors, _detect_verdict
    )
    return DetectBatchResponse(
        results=[DetectBatchItem(index=i, result=r, error=e) for i, r, e in items],
        num_watermarked=watermarked,
        num_errors=len(errors),
    )


async def _admit_batch(runtime: Runtime, principal: Principal, texts: list[str]) -> None:
    """A batch's size is checked, then its texts charged one rate token each."""
    _check_batch(runtime, texts)
    await charge(runtime, principal.tenant, len(texts))


_Full = TypeVar("_Full", DecodeResponse, DetectResponse)
_Word = TypeVar("_Word", DecodeVerdict, DetectVerdict)


def _batch_results(
    principal: Principal,
    count: int,
    good: list[int],
    answers: list[_Full],
    errors: dict[int, BatchItemError],
    verdict: Callable[[_Full], _Word],
) -> tuple[list[tuple[int, _Full | _Word | None, BatchItemError | None]], int]:
    """The shared tail of both bulk routes: every text's (index, answer, error), in
    full or as verdicts for a ``verdict`` key, and how many are watermarked."""
    shown: list[_Full | _Word]
    if _is_verdict(principal):
        verdicts = [verdict(a) for a in answers]
        shown, watermarked = list(verdicts), sum(v.verdict == "watermarked" for v in verdicts)
    else:
        shown, watermarked = list(answers), sum(a.is_watermarked for a in answers)
    return _assemble(count, good, shown, errors), watermarked
