"""The way every OpenAI request goes, whatever its API: a replayed response for a known
Idempotency-Key; else the run started and answered as JSON or, when ``stream`` is
true, as Server-Sent Events. An API gives its shapes as a :class:`Dialect`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.engines.base import Engine
from app.schemas.openai.chat import ChatCompletion
from app.schemas.openai.completions import Completion
from app.services import generation as gen
from app.services import receipt
from app.services.disclosure import redact_stored
from app.services.openai.run import Outcome, Pending, Run, outcomes, start
from app.services.openai.stream import Chunks, replay, stream
from app.services.runtime import Runtime
from app.stores.base import IdempotencyRecord


@dataclass(frozen=True)
class Dialect:
    """What one API gives the shared path: its response, its chunks, and a stored
    choice's content as a replayed chunk carries it."""

    respond: Callable[[Run, list[Outcome]], ChatCompletion | Completion]
    chunks: Callable[[Run, bool], Chunks]
    chunk_object: str
    replayed: Callable[[dict[str, Any]], dict[str, Any]]


async def serve(
    runtime: Runtime,
    engine: Engine,
    tenant_id: str,
    pending: Pending,
    request: Request,
    idempotency_key: str | None,
    dialect: Dialect,
    scopes: frozenset[str] = frozenset(),
) -> Any:
    """A replayed response for a known Idempotency-Key; else the completion, as JSON
    or, when ``stream`` is true, as OpenAI's Server-Sent Events. ``pending``: the
    request as its API planned it (``chat.plan``, ``completions.plan``)."""
    body = pending.body
    digest = pending.body_hash()
    if idempotency_key is not None:
        stored = await gen.stored_response(runtime, tenant_id, idempotency_key, digest)
        if stored is not None:
            return _replay(stored, pending, dialect, scopes)
    gen.ensure_queue_room(runtime, engine, pending.choices)  # before allocating
    claim = None
    if idempotency_key is not None:
        claimed = await gen.claim(runtime, tenant_id, idempotency_key, digest)
        if isinstance(claimed, IdempotencyRecord):
            return _replay(claimed, pending, dialect, scopes)
        claim = claimed
    try:
        run = await start(runtime, engine, tenant_id, pending, scopes)
        if body.stream:
            chunks = dialect.chunks(run, _include_usage(pending))
            return stream(run, request, engine, claim, chunks, dialect.respond)
        response = dialect.respond(run, await outcomes(run, request, engine))
        content = response.model_dump(mode="json")
        if claim is not None:
            await claim.remember(content)
        return JSONResponse(content, headers=receipt.headers(c.watermark for c in response.choices))
    except BaseException:
        if claim is not None:
            await claim.release()
        raise


def _include_usage(pending: Pending) -> bool:
    options = pending.body.stream_options
    return bool(options and options.include_usage)


def _replay(
    stored: IdempotencyRecord, pending: Pending, dialect: Dialect, scopes: frozenset[str]
) -> JSONResponse | StreamingResponse:
    """A stored response again (same Idempotency-Key and body), as it was asked for and
    as this key may see it (:func:`app.services.disclosure.redact_stored`)."""
    stored = replace(stored, response=redact_stored(stored.response, scopes))
    if pending.body.stream:
        return replay(stored, _include_usage(pending), dialect.chunk_object, dialect.replayed)
    headers = {"Idempotent-Replayed": "true", **receipt.of_response(stored.response)}
    return JSONResponse(stored.response, status_code=stored.status_code, headers=headers)
