"""Server-Sent Events for the OpenAI APIs: a run's choices as chunks while they are
generated, and a stored response replayed as chunks.

The loop is the same for every API: each choice's opening chunks, its pieces as
they come (choices run side by side in one batch), its closing chunks with the
watermark, the usage chunk when asked for, then ``data: [DONE]``. An API's
:class:`Chunks` says what each of those chunks holds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from app.core.errors import APIError, openai_envelope
from app.engines.base import Engine
from app.schemas.openai.chat import ChatCompletion
from app.schemas.openai.common import UsageInfo
from app.schemas.openai.completions import Completion
from app.services import generation as gen
from app.services import receipt
from app.services.openai.logprobs import Entries
from app.services.openai.run import Outcome, Piece, Run, choice_watermark, follow, head
from app.stores.base import IdempotencyRecord
from worldcup_core.generation import PromptLogprobs

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _without_nulls(value: Any) -> Any:
    """A delta as OpenAI sends it: no null keys, at any depth (tool-call deltas)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class Chunks:
    """One streamed request's chunks; an API supplies their shape (``chunk``) and what
    a choice's opening, pieces and closing send."""

    prefix = ""  # of the response id: "chatcmpl", "cmpl"

    def __init__(self, run: Run, include_usage: bool) -> None:
        self.run, self.include_usage = run, include_usage
        self.head = head(run, self.prefix)

    def chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> BaseModel:
        raise NotImplementedError

    def opening(self, index: int) -> list[bytes]:
        return []

    def piece(self, index: int, piece: Piece) -> list[bytes]:
        raise NotImplementedError

    def closing(self, index: int, outcome: Outcome) -> list[bytes]:
        raise NotImplementedError

    def emit(self, choices: list[Any], usage: UsageInfo | None = None) -> bytes:
        # OpenAI sends "usage" (null until the last chunk) only when it was asked for
        exclude = None if self.include_usage else {"usage"}
        data = self.chunk(choices, usage).model_dump(mode="json", exclude=exclude)
        for choice in data["choices"]:  # as OpenAI: deltas without nulls
            if choice.get("watermark") is None:
                del choice["watermark"]  # only the choice's last chunk carries it
            if "delta" in choice:
                choice["delta"] = _without_nulls(choice["delta"])
        return sse(data)


async def _merge(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """Pieces of every choice as they come (choices run in one batch, side by side)."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    finished = object()

    async def pump(index: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put((index, piece))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, finished))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is finished:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, Piece)
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def stream(
    run: Run,
    request: Request,
    engine: Engine,
    claim: gen.IdempotencyClaim | None,
    chunks: Chunks,
    respond: Callable[[Run, list[Outcome]], ChatCompletion | Completion],
) -> StreamingResponse:
    """SSE: each choice's opening, pieces and closing (with the watermark), the usage
    chunk when asked for, then ``data: [DONE]``; ``respond`` makes the whole response
    (remembered under the Idempotency-Key, and the source of the usage)."""
    count = len(run.samples)
    stops = run.pending.body.stops()

    async def events() -> AsyncIterator[bytes]:
        texts = [""] * count
        entries: list[Entries] = [[] for _ in range(count)]
        outcomes: list[Outcome | None] = [None] * count
        seen: list[PromptLogprobs | None] = [None] * count  # prompt logprobs
        try:
            for i in range(count):
                for chunk in chunks.opening(i):
                    yield chunk
            async for i, piece in _merge([follow(s, engine, stops) for s in run.samples]):
                if await request.is_disconnected():
                    return
                if piece.prompt is not None:
                    seen[i] = piece.prompt
                texts[i] += piece.text
                entries[i] += piece.logprobs
                for chunk in chunks.piece(i, piece):
                    yield chunk
                if piece.finish is None:
                    continue
                outcome = Outcome(texts[i], piece.finish, piece.tokens, entries[i], seen[i])
                outcomes[i] = outcome
                for chunk in chunks.closing(i, outcome):
                    yield chunk
            response = respond(run, [o for o in outcomes if o is not None])
            if claim is not None:
                await claim.remember(response.model_dump(mode="json"))
            if chunks.include_usage:
                yield chunks.emit([], response.usage)
        except APIError as exc:
            yield sse(openai_envelope(exc.status, exc.message, exc.code, exc.param))
        except Exception:
            yield sse(openai_envelope(500, "generation failed", "generation_failed", None))
        finally:
            for sample in run.samples:
                if not sample.job.done:
                    engine.cancel(sample.job)
            if claim is not None:
                await claim.release()  # a no-op once the response is remembered
        yield sse("[DONE]")

    # the receipt is known before the first token: every message id is allocated
    infos = [choice_watermark(run, i) for i in range(count)]
    headers = {**SSE_HEADERS, **receipt.headers(infos)}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def replay(
    stored: IdempotencyRecord,
    include_usage: bool,
    chunk_object: str,
    delta: Callable[[dict[str, Any]], dict[str, Any]],
) -> StreamingResponse:
    """A stored response as one chunk per choice (and the usage chunk if the request
    asked for it); ``delta``: a stored choice's content as its chunk carries it."""
    headers = {"Idempotent-Replayed": "true", **receipt.of_response(stored.response)}
    response = stored.response
    head = {k: response[k] for k in ("id", "created", "model", "system_fingerprint")}

    async def events() -> AsyncIterator[bytes]:
        for choice in response["choices"]:
            last = {"index": choice["index"], **delta(choice), "logprobs": choice.get("logprobs")}
            last["finish_reason"] = choice["finish_reason"]
            if choice.get("watermark") is not None:  # as streamed: no null receipt
                last["watermark"] = choice["watermark"]
            yield sse({**head, "object": chunk_object, "choices": [last]})
        if include_usage:
            yield sse({**head, "object": chunk_object, "choices": [], "usage": response["usage"]})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
