"""What /decode, /detect and their bulk forms do, from a parsed request to its answer.

Each request is checked (text length, batch size), tokenised off the event loop and
counted against the caller's probe budget (:mod:`app.services.intake`), scored
under the tenant's key versions (:mod:`app.services.watermark`) and answered in
full or, for a ``verdict`` key, as one word. The routes in
:mod:`app.api.routes.detection` only parse, call these and answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from app.core.errors import APIError
from app.schemas.exposure import (
    DecodeVerdict,
    DetailReason,
    DetectVerdict,
    VerdictRegistryMatch,
    reason_of_detail,
)
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
    verdict_fields,
)
from app.services import artifact, intake
from app.services.disclosure import sees_client_bits, sees_registry_bits
from app.services.evidence import coverage_out, issued_similarity
from app.services.registry import ambiguous_answer, expired_answer
from app.services.runtime import Runtime, charge
from app.services.tenants import Principal, UnknownKeyVersion
from app.services.watermark import Assessed, DecodeOutcome, best_length
from app.services.weights import Statistic
from app.stores.base import RegistryEntry
from worldcup_core import WatermarkKey
from worldcup_core.assess import Assessment
from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW


def _count(runtime: Runtime, assessment: Assessment, statistic: Statistic) -> None:
    """The detections metric, by verdict (the fixed 1e-6 level of "watermarked"), and
    the statistic each answer took."""
    runtime.metrics.detections.labels(assessment.verdict).inc()
    runtime.metrics.statistic.labels(statistic).inc()


def _decode_response(
    runtime: Runtime,
    principal: Principal,
    outcome: DecodeOutcome,
    assessment: Assessment,
    statistic: Statistic,
    withhold: bool = False,
) -> DecodeResponse:
    """A full /decode answer; the decoded bits and their per-bit confidence only to an
    analyst's key (:mod:`app.services.disclosure`), a matched client payload's bits only
    to keys that may choose payloads or are analysts."""
    result, det = outcome.result, outcome.result.detection
    _count(runtime, assessment, statistic)
    analyst = sees_registry_bits(principal.scopes)
    match = intake.registry_match(runtime, outcome, assessment)
    withheld = withhold and match is not None
    if withheld:
        match = None  # a flagged spoof artifact, and the gate is on: the verdict stands
    if match is not None and match.bits is not None and not sees_client_bits(principal.scopes):
        match.bits = None
    return DecodeResponse(
        **verdict_fields(assessment, statistic),
        bits=result.bits if analyst else None,
        bit_confidence=[
            BitConfidence(z=round(z, 4), p_value=p)
            for z, p in zip(result.bit_z, result.bit_p_values, strict=True)
        ]
        if analyst
        else None,
        num_bits=result.num_bits,
        erasures=list(result.erasures),
        is_watermarked=assessment.is_watermarked,
        num_tokens=det.num_tokens,
        num_scored_tokens=det.num_scored_tokens,
        key_version=outcome.key_version,
        registry_match=match,
        registry_expired=expired_answer(
            outcome.match, outcome.expired, assessment, runtime.settings
        ),
        registry_ambiguous=ambiguous_answer(outcome.match, assessment, runtime.settings),
        registry_withheld=withheld,
    )


def _detect_response(runtime: Runtime, assessed: Assessed) -> DetectResponse:
    outcome, assessment = assessed.detect, assessed.assessment
    _count(runtime, assessment, assessed.statistic)
    return DetectResponse(
        **verdict_fields(assessment, assessed.statistic),
        is_watermarked=assessment.is_watermarked,
        num_tokens=outcome.result.num_tokens,
        num_scored_tokens=outcome.result.num_scored_tokens,
        significance=VERDICT_WATERMARKED_BELOW,
        key_version=assessment.key_version if assessment.is_watermarked else None,
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


def _decode_verdict(answer: DecodeResponse, reason: DetailReason) -> DecodeVerdict:
    """A verdict-only /decode: the text's one verdict (as /detect's) with the registry
    entry where one may be named."""
    match = answer.registry_match
    return DecodeVerdict(
        verdict=answer.verdict,
        detail_reason=reason,
        registry_match=None
        if match is None
        else VerdictRegistryMatch(
            message_id=match.message_id,
            metadata=match.metadata,
            issued_at=match.issued_at,
            client_payload=match.client_payload,
        ),
    )


def _detect_verdict(answer: DetectResponse, reason: DetailReason) -> DetectVerdict:
    return DetectVerdict(verdict=answer.verdict, detail_reason=reason)


async def assess_ids(
    runtime: Runtime, principal: Principal, ids: list[list[int]], num_bits: int | None = None
) -> list[Assessed]:
    """Each tokenised text's one verdict for this asker (every test its tenant's keys
    and registry allow); ``num_bits`` is decoded too, for a /decode at that length."""
    if not ids:
        return []
    settings = runtime.settings
    tenant_id = principal.tenant.tenant_id
    assessed = await runtime.watermark.assess_texts(
        tenant_id, ids, settings.default_num_bits, settings.significance, num_bits
    )
    outcomes = await artifact.check(runtime, tenant_id, ids, assessed)
    return [replace(a, artifact=o) for a, o in zip(assessed, outcomes, strict=True)]


async def _decode_outcomes(
    runtime: Runtime,
    principal: Principal,
    ids: list[list[int]],
    num_bits: int | None,
    key_version: int | None,
) -> list[tuple[DecodeOutcome, Assessment, Statistic, bool]]:
    """(the decoding the route shows, the text's verdict, its statistic, whether its
    entry is withheld: :func:`app.services.artifact.withholds`) for each text, at ``num_bits``
    or, where the request names none, at the length of the tested ones (those the tenant
    issued entries at, else the default) whose entry is found (:func:`best_length`)."""
    assessed = await assess_ids(runtime, principal, ids, num_bits)
    lengths = [num_bits or best_length(a.decoded) for a in assessed]
    if key_version is None:
        shown = [a.decoded[n] for a, n in zip(assessed, lengths, strict=True)]
    else:
        by_index: dict[int, DecodeOutcome] = {}
        for n in sorted(set(lengths)):
            at = [i for i, m in enumerate(lengths) if m == n]
            given = [assessed[i].weights for i in at]
            weights = [w for w in given if w is not None]  # the ones the verdict took
            try:
                outs = await runtime.watermark.decode_texts(
                    principal.tenant.tenant_id,
                    [ids[i] for i in at],
                    n,
                    key_version,
                    weights if len(weights) == len(at) else None,
                )
            except UnknownKeyVersion:
                raise _unknown_version(key_version) from None
            by_index.update(zip(at, outs, strict=True))
        shown = [by_index[i] for i in range(len(ids))]
    return [
        (o, a.assessment, a.statistic, artifact.withholds(runtime, a.artifact))
        for o, a in zip(shown, assessed, strict=True)
    ]


def _reason(principal: Principal) -> DetailReason:
    """Why a verdict-only answer is one: the key's level, or (a ``full`` key) its text's
    full answers are spent (:func:`app.services.intake.admit_one`)."""
    return reason_of_detail(principal.key.detail)


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


async def _check_version(runtime: Runtime, principal: Principal, version: int | None) -> None:
    """A named key version the tenant lacks is refused before the probe accounting, so
    that a mistyped version spends none of the text's budget or full answers."""
    if version is None:
        return
    try:
        await runtime.tenants.version(principal.tenant.tenant_id, version)
    except UnknownKeyVersion:
        raise _unknown_version(version) from None


async def decode(
    runtime: Runtime, principal: Principal, body: DecodeRequest
) -> DecodeResponse | DecodeVerdict:
    """Recover the payload and, if it was issued from the registry, whose it is.
    A ``verdict`` key gets the verdict and the registry entry only; ``evidence`` is
    for a ``full`` key that also holds the ``provenance`` scope (an analyst's key)."""
    if body.evidence:
        _check_evidence_allowed(principal)
    await _check_version(runtime, principal, body.key_version)
    ids, pieces, sketches = await intake.tokenise(runtime, principal, body.text, body.evidence)
    full = await intake.admit_one(runtime, principal, "decode", sketches)
    outcome, assessment, statistic, withhold = (
        await _decode_outcomes(runtime, principal, [ids], body.num_bits, body.key_version)
    )[0]
    answer = _decode_response(runtime, principal, outcome, assessment, statistic, withhold)
    if not full:  # a verdict key, or a full key's text asked about too often: no evidence
        return _decode_verdict(answer, _reason(principal))
    await _add_coverage(
        runtime, principal, [answer], [ids], [outcome.result.num_bits],
        [(outcome.entry, body.text)],
    )  # fmt: skip
    if body.evidence:
        answer.evidence = await runtime.watermark.token_evidence(
            principal.tenant.tenant_id, outcome, ids, pieces
        )
    return answer


async def detect(
    runtime: Runtime, principal: Principal, body: DetectRequest
) -> DetectResponse | DetectVerdict:
    """Is this text watermarked with any of my keys? A calibrated, message-free test.
    A ``verdict`` key gets one word (see VERDICT_LEVELS) instead of the scores, as does a
    ``full`` key past its text's full answers (:func:`app.services.intake.admit_one`)."""
    ids, _, sketches = await intake.tokenise(runtime, principal, body.text, False)
    full = await intake.admit_one(runtime, principal, "detect", sketches)
    answer = _detect_response(runtime, (await assess_ids(runtime, principal, [ids]))[0])
    if not full:
        return _detect_verdict(answer, _reason(principal))
    await _add_coverage(runtime, principal, [answer], [ids], [runtime.settings.default_num_bits])
    return answer


async def decode_batch(
    runtime: Runtime, principal: Principal, body: DecodeBatchRequest
) -> DecodeBatchResponse:
    """Bulk /decode. Rate-limited and probe-counted per text; an invalid text fails
    only its own item."""
    await _check_version(runtime, principal, body.key_version)
    await _admit_batch(runtime, principal, body.texts)
    batch = await intake.take_batch(runtime, principal, "decode/batch", body.texts)
    errors = batch.errors
    outcomes = await _decode_outcomes(
        runtime, principal, batch.ids, body.num_bits, body.key_version
    )
    answers: list[DecodeResponse] = []
    answered: list[int] = []
    full: list[bool] = []
    covered: list[tuple[DecodeResponse, list[int], int, tuple[RegistryEntry | None, str]]] = []
    for index, text_ids, in_full, (outcome, assessment, statistic, withhold) in zip(
        batch.good, batch.ids, batch.full, outcomes, strict=True
    ):
        try:
            answer = _decode_response(runtime, principal, outcome, assessment, statistic, withhold)
        except APIError as exc:  # an unreadable registry entry fails only its item
            errors[index] = BatchItemError(code=exc.code, message=exc.message)
            continue
        answers.append(answer)
        answered.append(index)
        full.append(in_full)
        if in_full:
            issued = (outcome.entry, body.texts[index])
            covered.append((answer, text_ids, outcome.result.num_bits, issued))
    if covered:
        await _add_coverage(
            runtime,
            principal,
            [c[0] for c in covered],
            [c[1] for c in covered],
            [c[2] for c in covered],
            [c[3] for c in covered],
        )
    items, watermarked = _batch_results(
        principal, len(body.texts), answered, answers, full, errors, _decode_verdict
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
    await _admit_batch(runtime, principal, body.texts)
    # only the items the budget allows are scored: a refused item costs no scoring
    batch = await intake.take_batch(runtime, principal, "detect/batch", body.texts)
    assessed = await assess_ids(runtime, principal, batch.ids)
    answers = [_detect_response(runtime, a) for a in assessed]
    shown = [(a, ids) for a, ids, f in zip(answers, batch.ids, batch.full, strict=True) if f]
    if shown:
        bits = [runtime.settings.default_num_bits] * len(shown)
        await _add_coverage(
            runtime, principal, [a for a, _ in shown], [ids for _, ids in shown], bits
        )
    items, watermarked = _batch_results(
        principal, len(body.texts), batch.good, answers, batch.full, batch.errors, _detect_verdict
    )
    return DetectBatchResponse(
        results=[DetectBatchItem(index=i, result=r, error=e) for i, r, e in items],
        num_watermarked=watermarked,
        num_errors=len(batch.errors),
    )


async def _add_coverage(
    runtime: Runtime,
    principal: Principal,
    answers: Sequence[DecodeResponse | DetectResponse],
    ids: list[list[int]],
    lengths: list[int],
    issued: Sequence[tuple[RegistryEntry | None, str]] | None = None,
) -> None:
    """Each watermarked answer's ``coverage``: how much of its text carries the
    watermark, under the key version that decided (whether or not evidence was asked).
    ``issued``: each decode answer's registry entry and submitted text; where the answer
    names an entry that has a fingerprint, the text's similarity to the issued one
    decides 'whole' too (issue #45)."""
    tenant_id = principal.tenant.tenant_id
    want: list[int] = []
    items: list[tuple[list[int], int, int]] = []
    for i, a in enumerate(answers):
        if a.verdict == "watermarked" and a.key_version is not None:
            want.append(i)
            items.append((ids[i], a.key_version, lengths[i]))
    if not want:
        return
    found = await runtime.watermark.coverage(tenant_id, items)
    checks: list[tuple[int, WatermarkKey, RegistryEntry, str]] = []
    for i in want:
        answer = answers[i]
        if issued is None or not isinstance(answer, DecodeResponse):
            continue
        entry, text = issued[i]
        match = answer.registry_match
        if entry is None or entry.fingerprint is None or match is None:
            continue
        if match.message_id == entry.message_id:
            key = (await runtime.tenants.version(tenant_id, entry.key_version)).scheme.key
            checks.append((i, key, entry, text))
    sims: dict[int, float | None] = {}
    if checks:
        got = await runtime.offload(lambda: [issued_similarity(k, e, t) for _, k, e, t in checks])
        sims = {i: s for (i, *_), s in zip(checks, got, strict=True)}
    for i, cov in zip(want, found, strict=True):
        answer = answers[i]
        named = isinstance(answer, DecodeResponse) and answer.registry_match is not None
        answer.coverage = coverage_out(cov, named, sims.get(i))


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
    full: list[bool],
    errors: dict[int, BatchItemError],
    verdict: Callable[[_Full, DetailReason], _Word],
) -> tuple[list[tuple[int, _Full | _Word | None, BatchItemError | None]], int]:
    """The shared tail of both bulk routes: every text's (index, answer, error), each in
    full or as its verdict (``full``: :func:`app.services.intake.admit_one`), and how many
    are watermarked."""
    reason = _reason(principal)
    shown: list[_Full | _Word] = [
        a if f else verdict(a, reason) for a, f in zip(answers, full, strict=True)
    ]
    watermarked = sum(a.verdict == "watermarked" for a in answers)
    return _assemble(count, good, shown, errors), watermarked
