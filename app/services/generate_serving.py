"""What POST /generate does: embed an explicit payload, or allocate a message id for
metadata, and answer in JSON or as Server-Sent Events.

The /generate protocol over :mod:`app.services.generation`, the generation path
it shares with the OpenAI routes (:mod:`app.services.openai`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.core.errors import APIError, envelope
from app.engines.base import Engine
from app.schemas.generation import (
    MAX_METADATA_BYTES,
    GenerateRequest,
    GenerateResponse,
    PayloadOut,
    Timing,
    Usage,
    metadata_bytes,
    prompt_chars_limit,
)
from app.services import generation as gen
from app.services.disclosure import redact_stored, reveals_generated
from app.services.runtime import Runtime
from app.services.tenants import KeyVersion
from app.stores.base import IdempotencyRecord
from worldcup_core import SamplingConfig
from worldcup_core.generation import GenerationResult

logger = logging.getLogger("worldcup.generate")


async def serve(
    runtime: Runtime,
    engine: Engine,
    tenant_id: str,
    body: GenerateRequest,
    request: Request,
    idempotency_key: str | None,
    scopes: frozenset[str] = frozenset(),
) -> Any:
    """A replayed response for a known Idempotency-Key; else the text generated with
    the tenant's newest key, as JSON or, when ``stream`` is true, as SSE."""
    settings = runtime.settings
    _check_limits(runtime, body)
    body_hash = gen.body_hash(body.model_dump(mode="json"))
    if idempotency_key is not None:
        stored = await gen.stored_response(runtime, tenant_id, idempotency_key, body_hash)
        if stored is not None:
            return _replay(stored, body.stream, scopes)
    gen.ensure_queue_room(runtime, engine)  # refuse before allocating a message id
    messages = [m.model_dump() for m in body.messages] if body.messages is not None else None
    prompt_ids = await runtime.offload(lambda: gen.prompt_ids(runtime, body.prompt, messages))
    if settings.debug_log_prompts:  # off by default: prompts are user data
        logger.debug("prompt", extra={"fields": {"prompt_ids": prompt_ids}})
    key = await runtime.tenants.version(tenant_id, None)
    claim = None
    if idempotency_key is not None:
        claimed = await gen.claim(runtime, tenant_id, idempotency_key, body_hash)
        if isinstance(claimed, IdempotencyRecord):
            return _replay(claimed, body.stream, scopes)
        claim = claimed
    try:
        return await _run(body, request, runtime, tenant_id, engine, key, prompt_ids, claim, scopes)
    except BaseException:
        if claim is not None:
            await claim.release()
        raise


def _check_limits(runtime: Runtime, body: GenerateRequest) -> None:
    """Beyond the schema: this server's ``max_new_tokens`` limit (the default is
    clamped to it) and the metadata's size as compact JSON."""
    settings = runtime.settings
    limit = prompt_chars_limit(settings)
    longest = max([len(m.content) for m in body.messages or []] + [len(body.prompt or "")])
    if longest > limit:
        field = "prompt" if body.prompt is not None else "a message"
        raise APIError(
            422, f"{field} is {longest} characters; the limit is {limit}", "prompt_too_long"
        )
    if "max_new_tokens" not in body.model_fields_set:  # the default, within this server's limit
        body.max_new_tokens = min(body.max_new_tokens, settings.max_new_tokens_limit)
        body.min_new_tokens = min(body.min_new_tokens, body.max_new_tokens)
    if body.max_new_tokens > settings.max_new_tokens_limit:
        raise APIError(
            422,
            f"max_new_tokens may be at most {settings.max_new_tokens_limit}",
            "max_new_tokens_too_large",
        )
    if body.metadata is not None and metadata_bytes(body.metadata) > MAX_METADATA_BYTES:
        raise APIError(
            422,
            f"metadata: more than {MAX_METADATA_BYTES} bytes as compact UTF-8 JSON",
            "metadata_too_large",
        )


def _sampling(body: GenerateRequest) -> SamplingConfig:
    return SamplingConfig(
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        max_new_tokens=body.max_new_tokens,
        min_new_tokens=body.min_new_tokens,
        no_repeat_ngram_size=body.no_repeat_ngram_size,
        seed=body.seed,
    )


async def _run(
    body: GenerateRequest,
    request: Request,
    runtime: Runtime,
    tenant_id: str,
    engine: Engine,
    key: KeyVersion,
    prompt_ids: list[int],
    claim: gen.IdempotencyClaim | None,
    scopes: frozenset[str],
) -> Any:
    chosen = None
    if body.payload is not None:  # sealed in a registry entry of its own
        p = body.payload
        spelled = (p.bits, p.hex, p.integer, p.num_bits)
        chosen = await gen.fixed_payload(runtime, scopes, tenant_id, key, spelled)
        payload, message_id = await gen.allocate_sealed(runtime, tenant_id, key, chosen)
    else:  # a registry entry; a bare request records empty metadata, as /v1 does
        metadata = body.metadata if body.metadata is not None else {}
        payload, message_id = await gen.allocate(runtime, tenant_id, key, metadata, body.num_bits)
    sampling = _sampling(body)
    reveal = reveals_generated(scopes)
    sample = gen.submit(
        runtime, engine, tenant_id, key, prompt_ids, sampling, payload, message_id,
        reveal_payload=reveal, chosen=chosen,
    )  # fmt: skip
    if body.stream:
        return StreamingResponse(
            _stream(sample, claim, request, engine),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    watcher = asyncio.create_task(gen.watch_disconnect(request, engine, [sample.job]))
    try:
        result = await gen.collect(sample, engine)
    finally:
        watcher.cancel()
    response = _response(sample, result)
    await gen.record_issued(sample, response.text)
    if claim is not None:
        await claim.remember(response.model_dump(mode="json"))
    return response


def _response(sample: gen.Sample, result: GenerationResult) -> GenerateResponse:
    job = sample.job
    assert sample.payload is not None  # /generate always watermarks
    shown = sample.shown_payload()
    text = sample.runtime.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    total = time.perf_counter() - job.enqueued_at
    n = len(result.token_ids)
    queue = (job.admitted_at or job.enqueued_at) - job.enqueued_at
    ttft = job.first_token_at - job.enqueued_at if job.first_token_at else None
    gen_time = (job.last_token_at or 0) - (job.admitted_at or 0)
    return GenerateResponse(
        text=text,
        num_tokens=n,
        finish_reason="eos" if result.finish_reason == "eos" else "length",
        payload=PayloadOut(
            bits=shown.bits, hex=format(shown.to_int(), "x"), num_bits=shown.num_bits
        )
        if shown is not None
        else None,
        client_payload=sample.chosen is not None,
        num_bits=sample.payload.num_bits,
        message_id=sample.message_id,
        key_version=sample.key.version,
        scheme=sample.key.scheme.version,
        usage=Usage(
            prompt_tokens=len(sample.prompt_ids),
            completion_tokens=n,
            total_tokens=len(sample.prompt_ids) + n,
        ),
        timing=Timing(
            queue_seconds=round(queue, 4),
            time_to_first_token_seconds=round(ttft, 4) if ttft is not None else None,
            total_seconds=round(total, 4),
            tokens_per_second=round(n / gen_time, 2) if gen_time > 0 and n else None,
        ),
    )


def _sse(data: str, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


async def _stream(
    sample: gen.Sample,
    claim: gen.IdempotencyClaim | None,
    request: Request,
    engine: Engine,
) -> AsyncIterator[bytes]:
    deltas = gen.TextDeltas(sample.runtime.tokenizer)
    try:
        while True:
            if await request.is_disconnected():
                engine.cancel(sample.job)
                return
            item = await gen.next_event(sample)
            if isinstance(item, GenerationResult):
                response = _response(sample, item)
                await gen.record_issued(sample, response.text)
                if claim is not None:
                    await claim.remember(response.model_dump(mode="json"))
                if rest := deltas.rest(response.text):
                    # flush a character still held back (the text ended inside it)
                    yield _sse(json.dumps({"token_id": None, "text": rest}))
                yield _sse(response.model_dump_json(), "result")
                break
            if item.finish == "eos":
                continue  # the closing EOS is not part of the text
            yield _sse(json.dumps({"token_id": item.token, "text": deltas.push(item.token)}))
    except TimeoutError:
        exc = gen.timed_out(sample, engine)  # cancels the job and counts the timeout
        yield _sse(json.dumps(envelope(exc.status, exc.message, exc.code)), "error")
    except APIError as exc:
        if exc.code == gen.WATERMARK_FAILED:  # the receipt: not watermarked, entry voided
            receipt = {"watermarked": False, "message_id": sample.message_id}
            yield _sse(json.dumps(receipt), "receipt")
        yield _sse(json.dumps(envelope(exc.status, exc.message, exc.code)), "error")
    except Exception:
        engine.cancel(sample.job)
        yield _sse(json.dumps(envelope(500, "generation failed", "generation_failed")), "error")
    finally:
        if not sample.job.done:
            engine.cancel(sample.job)
        if claim is not None:
            await claim.release()
    yield b"data: [DONE]\n\n"


def _replay(stored: IdempotencyRecord, stream: bool, scopes: frozenset[str]) -> Any:
    headers = {"Idempotent-Replayed": "true"}
    response = redact_stored(stored.response, scopes)  # as this key may see it
    if not stream:
        return JSONResponse(response, status_code=stored.status_code, headers=headers)

    async def events() -> AsyncIterator[bytes]:
        yield _sse(json.dumps({"token_id": None, "text": response.get("text", "")}))
        yield _sse(json.dumps(response), "result")
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
