"""What /decode, /detect and their bulk forms do, from a parsed request to its answer.

Each request is checked (text length, batch size), tokenised off the event loop,
counted against the caller's probe budget (:mod:`app.services.probes`), scored
under the tenant's key versions (:mod:`app.services.watermark`) and answered in
full or, for a ``verdict`` key, as one word. The routes in
:mod:`app.api.routes.detection` only parse, call these and answer.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, TypeVar

from app.core.errors import APIError
from app.core.logging import request_id_var
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
    RegistryMatchOut,
    check_metadata,
)
from app.services.cpu import TOKEN_CHARS
from app.services.probes import Sketch
from app.services.registry import expired_answer
from app.services.runtime import Runtime, charge
from app.services.tenants import Principal, UnknownKeyVersion
from app.services.watermark import DecodeOutcome, DetectOutcome, corrected
from app.stores.base import ProbeDecision
from worldcup_core.verdict import verdict_of


def check_text(runtime: Runtime, text: str) -> None:
    """Raise a 422 if a text to score is over the (published) limit (cheap: no tokenising).
    Empty and whitespace-only texts are refused before (the schemas, the corpus reader)."""
    limit = runtime.settings.text_chars_limit
    if len(text) > limit:
        raise APIError(
            422, f"text is {len(text)} characters; the limit is {limit}", "text_too_long"
        )


def readable_metadata(metadata: dict[str, Any], message_id: int) -> dict[str, Any]:
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


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts in one call. Runs in a worker thread: the fast
    tokenizer's Rust backend encodes the batch with the GIL released."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [list(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]


def token_pieces(tokenizer: Any, text: str) -> tuple[list[int], list[str]]:
    """Token ids of ``text`` and the characters of each token, as consecutive pieces
    that concatenate to ``text`` (the ids are those :func:`encode_texts` gives)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encoding = backend.encode(text, add_special_tokens=False)
        ids, ends = list(encoding.ids), [end for _, end in encoding.offsets]
    else:  # a slow tokenizer has no offsets: the decoded prefix lengths stand in
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    pieces, cut = [], 0
    for end in ends:
        stop = min(max(end, cut), len(text))  # byte-level tokens of one character share it
        pieces.append(text[cut:stop])
        cut = stop
    if pieces:
        pieces[-1] += text[cut:]
    return ids, pieces


async def token_ids(runtime: Runtime, text: str) -> list[int]:
    """Tokenise one text off the event loop, or raise a 422 about it."""
    check_text(runtime, text)
    return (await runtime.offload(lambda: encode_texts(runtime.tokenizer, [text])))[0]


def registry_match(runtime: Runtime, outcome: DecodeOutcome) -> RegistryMatchOut | None:
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
    return RegistryMatchOut(
        message_id=entry.message_id,
        metadata=readable_metadata(entry.metadata, entry.message_id),
        issued_at=dt.datetime.fromtimestamp(entry.issued_at, tz=dt.UTC),
        num_bits=entry.num_bits,
        confidence=found.posterior,
        p_value=found.p_value,
        exact=outcome.entry_bits == outcome.result.bits,
    )


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
        registry_match=registry_match(runtime, outcome),
        registry_expired=expired_answer(outcome.match, outcome.expired, runtime.settings),
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


def _check_all(runtime: Runtime, texts: list[str]) -> tuple[list[int], dict[int, BatchItemError]]:
    """(indices of good texts, errors by index), without tokenising."""
    good: list[int] = []
    errors: dict[int, BatchItemError] = {}
    for i, text in enumerate(texts):
        try:
            check_text(runtime, text)
            good.append(i)
        except APIError as exc:
            errors[i] = BatchItemError(code=exc.code, message=exc.message)
    return good, errors


_Answer = TypeVar("_Answer")


def _assemble(
    count: int, good: list[int], answers: list[_Answer], errors: dict[int, BatchItemError]
) -> list[tuple[int, _Answer | None, BatchItemError | None]]:
    """(index, answer, error) for every text of a batch."""
    by_index = dict(zip(good, answers, strict=True))
    return [(i, by_index.get(i), errors.get(i)) for i in range(count)]


def _sketcher(
    runtime: Runtime, principal: Principal
) -> Callable[[list[list[int]]], list[Sketch | None]] | None:
    """The fingerprinting function for a worker job; None when this key's detail
    level has no probe budget."""
    probes = runtime.probes
    if probes is None or probes.budget(principal.key.detail) <= 0:
        return None
    return probes.sketches


async def _account_sketches(
    runtime: Runtime, principal: Principal, route: str, sketches: list[Sketch | None] | None
) -> list[ProbeDecision]:
    """Count each fingerprinted query against its text's budget (None: accounting is
    off); refusals are audited and counted once per request."""
    probes = runtime.probes
    if sketches is None or probes is None:
        return [ProbeDecision(True, 0, 0.0)] * len(sketches or [])
    key = principal.key
    return await probes.account(
        principal.tenant.tenant_id, key.key_id, key.detail, route, sketches, request_id_var.get()
    )


async def _admit_one(
    runtime: Runtime, principal: Principal, route: str, sketches: list[Sketch | None] | None
) -> None:
    """Count a single query against its text's budget, or raise its 429."""
    probes = runtime.probes
    if sketches is None or probes is None:
        return
    key = principal.key
    await probes.admit_one(
        principal.tenant.tenant_id, key.key_id, key.detail, route, sketches[0], request_id_var.get()
    )


async def _tokenise(
    runtime: Runtime, principal: Principal, text: str, pieces: bool
) -> tuple[list[int], list[str], list[Sketch | None] | None]:
    """One worker job: the text's token ids (and, for evidence, each token's
    characters) and its fingerprint for probe accounting; a 422 if it is too long."""
    check_text(runtime, text)
    sketcher = _sketcher(runtime, principal)

    def work() -> tuple[list[int], list[str], list[Sketch | None] | None]:
        if pieces:
            ids, parts = token_pieces(runtime.tokenizer, text)
        else:
            ids, parts = encode_texts(runtime.tokenizer, [text])[0], []
        return ids, parts, (sketcher([ids]) if sketcher else None)

    return await runtime.offload(work)


async def _tokenise_all(
    runtime: Runtime, principal: Principal, texts: list[str]
) -> tuple[list[int], list[list[int]], list[Sketch | None] | None, dict[int, BatchItemError]]:
    """(indices of good texts, their token ids, their fingerprints, errors by index);
    the tokenising and fingerprinting run in one worker job."""
    good, errors = _check_all(runtime, texts)
    chosen = [texts[i] for i in good]
    sketcher = _sketcher(runtime, principal)

    ids, sketches = await _fingerprint_all(runtime, sketcher, chosen)
    return good, ids, sketches, errors


async def _fingerprint_all(
    runtime: Runtime,
    sketcher: Callable[[list[list[int]]], list[Sketch | None]] | None,
    texts: list[str],
) -> tuple[list[list[int]], list[Sketch | None] | None]:
    """Token ids and fingerprints of a batch's texts, in chunks of bounded size (one
    worker job each, so one bulk request does not hold the CPU pool for long)."""

    def work(chunk: list[str]) -> list[tuple[list[int], Sketch | None]]:
        ids = encode_texts(runtime.tokenizer, chunk)
        return list(zip(ids, sketcher(ids) if sketcher else [None] * len(ids), strict=True))

    pairs = await runtime.offload_map(work, texts)
    return [i for i, _ in pairs], ([s for _, s in pairs] if sketcher else None)


_Item = TypeVar("_Item")


def _keep_allowed(
    runtime: Runtime,
    principal: Principal,
    good: list[int],
    items: list[_Item],
    decisions: list[ProbeDecision],
    errors: dict[int, BatchItemError],
) -> tuple[list[int], list[_Item]]:
    """Batch items count one by one; a refused item becomes that item's error."""
    kept_good, kept = [], []
    for index, item, decision in zip(good, items, decisions, strict=True):
        if decision.allowed:
            kept_good.append(index)
            kept.append(item)
        else:
            assert runtime.probes is not None
            message = runtime.probes.budget_message(principal.key.detail)
            errors[index] = BatchItemError(code="probe_budget_exceeded", message=message)
    return kept_good, kept


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
    ids, pieces, sketches = await _tokenise(runtime, principal, body.text, body.evidence)
    await _admit_one(runtime, principal, "decode", sketches)
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
    check_text(runtime, body.text)
    scorer = await runtime.watermark.detector(
        principal.tenant.tenant_id, runtime.settings.significance
    )
    sketcher = _sketcher(runtime, principal)

    def work() -> tuple[list[Sketch | None] | None, DetectOutcome]:
        """One worker job: tokenise, fingerprint and score (a query refused below
        was scored for nothing; the answer is withheld all the same)."""
        ids = encode_texts(runtime.tokenizer, [body.text])
        return (sketcher(ids) if sketcher else None), scorer(ids[0])

    sketches, outcome = await runtime.offload(work)
    await _admit_one(runtime, principal, "detect", sketches)
    answer = _detect_response(runtime, outcome)
    return _detect_verdict(answer) if _is_verdict(principal) else answer


async def decode_batch(
    runtime: Runtime, principal: Principal, body: DecodeBatchRequest
) -> DecodeBatchResponse:
    """Bulk /decode. Rate-limited and probe-counted per text; an invalid text fails
    only its own item."""
    await _admit_batch(runtime, principal, body.texts)
    num_bits = body.num_bits or runtime.settings.default_num_bits
    good, ids, sketches, errors = await _tokenise_all(runtime, principal, body.texts)
    decisions = await _account_sketches(runtime, principal, "decode/batch", sketches)
    if sketches is None:
        decisions = [ProbeDecision(True, 0, 0.0)] * len(ids)
    good, ids = _keep_allowed(runtime, principal, good, ids, decisions, errors)
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
    good, errors = _check_all(runtime, body.texts)
    chosen = [body.texts[i] for i in good]
    scorer = await runtime.watermark.detector(tenant.tenant_id, runtime.settings.significance)
    sketcher = _sketcher(runtime, principal)
    ids, sketches = await _fingerprint_all(runtime, sketcher, chosen)
    decisions = await _account_sketches(runtime, principal, "detect/batch", sketches)
    if sketches is None:
        decisions = [ProbeDecision(True, 0, 0.0)] * len(ids)
    # only the items the budget allows are scored: a refused item costs no scoring
    good, allowed = _keep_allowed(runtime, principal, good, ids, decisions, errors)
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
