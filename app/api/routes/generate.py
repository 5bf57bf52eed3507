"""POST /generate: embed an explicit payload, or allocate a message id for metadata."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.api.deps import CurrentTenant, EngineDep, Runtime, RuntimeDep
from app.api.errors import APIError, envelope
from app.engines.base import Engine, EngineStopped, GenerationJob, QueueFull
from app.schemas.common import ERROR_RESPONSES
from app.schemas.watermark import GenerateRequest, GenerateResponse, PayloadOut, Timing, Usage
from app.services.tenants import KeyVersion, RegistryExhausted
from app.stores.base import IDEMPOTENCY_PENDING, IdempotencyRecord, StoreUnavailable
from worldcup_core import Payload, SamplingConfig
from worldcup_core.generation import GenerationRequest, GenerationResult, StepEvent

router = APIRouter(tags=["watermark"])
logger = logging.getLogger("worldcup.generate")

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        max_length=128,
        description="Retries with the same key and body return the stored response.",
    ),
]


def _payload(body: GenerateRequest) -> Payload:
    assert body.payload is not None
    p = body.payload
    try:
        if p.bits is not None:
            return Payload.from_bits(p.bits)
        if p.hex is not None:
            return Payload.from_hex(p.hex, p.num_bits)
        assert p.integer is not None and p.num_bits is not None
        return Payload.from_int(p.integer, p.num_bits)
    except ValueError as exc:
        raise APIError(422, f"payload: {exc}", "invalid_payload") from None


def _prompt_ids(runtime: Runtime, body: GenerateRequest) -> list[int]:
    tok = runtime.tokenizer
    if body.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise APIError(422, "this model has no chat template; send prompt", "no_chat_template")
        rendered = tok.apply_chat_template(
            [m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=True
        )
        ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    else:
        assert body.prompt is not None
        ids = tok(body.prompt, add_special_tokens=False).input_ids
    ids = list(ids)
    limit = runtime.settings.max_prompt_tokens
    if not ids:
        raise APIError(422, "the prompt is empty after tokenisation", "empty_prompt")
    if len(ids) > limit:
        raise APIError(422, f"prompt is {len(ids)} tokens; the limit is {limit}", "prompt_too_long")
    return ids


def _queue_full(runtime: Runtime) -> APIError:
    runtime.metrics.rejections.labels("queue_full").inc()
    return APIError(
        429, "the generation queue is full; retry shortly", "queue_full", {"Retry-After": "1"}
    )


def _body_hash(body: GenerateRequest) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


async def _next_event(job: GenerationJob, deadline: float) -> StepEvent | GenerationResult:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    item = await asyncio.wait_for(job.events.get(), timeout=remaining)
    if isinstance(item, EngineStopped):
        raise APIError(503, "the server is shutting down", "draining", {"Retry-After": "5"})
    if isinstance(item, BaseException):
        raise APIError(500, "generation failed; it has been logged", "generation_failed")
    return item


async def _watch_disconnect(request: Request, engine: Engine, job: GenerationJob) -> None:
    """Stop generating for a client that went away."""
    while not job.done:
        if await request.is_disconnected():
            engine.cancel(job)
            return
        await asyncio.sleep(0.25)


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={
        **ERROR_RESPONSES,
        200: {
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string"},
                    "example": 'data: {"token_id": 42, "text": "Hi"}\n\ndata: [DONE]\n\n',
                }
            },
            "description": "JSON, or Server-Sent Events when stream is true.",
        },
    },
    summary="Generate watermarked text",
)
async def generate(
    body: GenerateRequest,
    request: Request,
    runtime: RuntimeDep,
    tenant: CurrentTenant,
    engine: EngineDep,
    idempotency_key: IdempotencyKey = None,
) -> Any:
    settings = runtime.settings
    if body.max_new_tokens > settings.max_new_tokens_limit:
        raise APIError(
            422,
            f"max_new_tokens may be at most {settings.max_new_tokens_limit}",
            "max_new_tokens_too_large",
        )
    body_hash = _body_hash(body)
    if idempotency_key is not None:
        stored = await runtime.store.idempotency_get(tenant.tenant_id, idempotency_key)
        if stored is not None:
            return _replay_or_refuse(stored, body_hash, body.stream)
    if engine.queue_depth >= engine.max_queue:  # refuse before allocating a message id
        raise _queue_full(runtime)
    prompt_ids = _prompt_ids(runtime, body)
    if settings.debug_log_prompts:  # off by default: prompts are user data
        logger.debug("prompt", extra={"fields": {"prompt_ids": prompt_ids}})
    key = await runtime.tenants.version(tenant.tenant_id, None)
    claim = None
    if idempotency_key is not None:
        # Claim the key before allocating or generating, so that two concurrent
        # requests with one key cannot both run (one would issue a second message
        # id). The claim expires on its own if this replica dies mid-request.
        claim = (idempotency_key, body_hash)
        pending = IdempotencyRecord(body_hash, IDEMPOTENCY_PENDING, {})
        ttl = int(settings.request_timeout_s) + 30
        if not await runtime.store.idempotency_put(tenant.tenant_id, idempotency_key, pending, ttl):
            stored = await runtime.store.idempotency_get(tenant.tenant_id, idempotency_key)
            if stored is None:  # it expired in between: the client may simply retry
                raise _in_progress()
            return _replay_or_refuse(stored, body_hash, body.stream)
    try:
        return await _run(body, request, runtime, tenant.tenant_id, engine, key, prompt_ids, claim)
    except BaseException:
        if claim is not None:
            await _release(runtime, tenant.tenant_id, claim[0])
        raise


def _in_progress() -> APIError:
    return APIError(
        409,
        "a request with this Idempotency-Key is still running; retry shortly",
        "idempotency_in_progress",
        {"Retry-After": "1"},
    )


def _replay_or_refuse(stored: IdempotencyRecord, body_hash: str, stream: bool) -> Any:
    if stored.body_hash != body_hash:
        raise APIError(
            409, "Idempotency-Key was used with a different body", "idempotency_conflict"
        )
    if stored.status_code == IDEMPOTENCY_PENDING:
        raise _in_progress()
    return _replay(stored, stream)


async def _release(runtime: Runtime, tenant_id: str, key: str) -> None:
    """Drop the claim of a request that failed, so that its retry can run."""
    with contextlib.suppress(StoreUnavailable):  # otherwise it expires by itself
        await runtime.store.idempotency_delete(tenant_id, key)


async def _run(
    body: GenerateRequest,
    request: Request,
    runtime: Runtime,
    tenant_id: str,
    engine: Engine,
    key: KeyVersion,
    prompt_ids: list[int],
    claim: tuple[str, str] | None,
) -> Any:
    settings = runtime.settings
    message_id = None
    if body.metadata is not None:
        try:
            entry, payload = await runtime.tenants.allocate(
                tenant_id, key, body.num_bits or settings.default_num_bits, body.metadata
            )
        except RegistryExhausted:
            raise APIError(
                409, "every message id of this payload length is taken", "registry_full"
            ) from None
        message_id = entry.message_id
    else:
        payload = _payload(body)
    sampling = SamplingConfig(
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        max_new_tokens=body.max_new_tokens,
        min_new_tokens=body.min_new_tokens,
        no_repeat_ngram_size=body.no_repeat_ngram_size,
        seed=body.seed,
    )
    try:
        job = engine.submit(GenerationRequest(prompt_ids, sampling, key.scheme, payload))
    except QueueFull:
        raise _queue_full(runtime) from None
    except EngineStopped:
        raise APIError(503, "the server is shutting down", "draining") from None
    context = _Context(runtime, tenant_id, key, payload, message_id, prompt_ids, job)
    context.idempotency = claim
    if body.stream:
        return StreamingResponse(
            _stream(context, request, engine),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    watcher = asyncio.create_task(_watch_disconnect(request, engine, job))
    try:
        result = await _collect(context, engine)
    finally:
        watcher.cancel()
    response = _response(context, result)
    await _remember(context, response)
    return response


class _Context:
    def __init__(
        self,
        runtime: Runtime,
        tenant_id: str,
        key: KeyVersion,
        payload: Payload,
        message_id: int | None,
        prompt_ids: list[int],
        job: GenerationJob,
    ) -> None:
        self.runtime, self.tenant_id, self.key = runtime, tenant_id, key
        self.payload, self.message_id, self.prompt_ids, self.job = (
            payload,
            message_id,
            prompt_ids,
            job,
        )
        self.deadline = time.monotonic() + runtime.settings.request_timeout_s
        self.idempotency: tuple[str, str] | None = None
        self.remembered = False  # the final response replaced the idempotency claim


async def _collect(ctx: _Context, engine: Engine) -> GenerationResult:
    try:
        while True:
            item = await _next_event(ctx.job, ctx.deadline)
            if isinstance(item, GenerationResult):
                return item
    except TimeoutError:
        engine.cancel(ctx.job)
        ctx.runtime.metrics.rejections.labels("timeout").inc()
        raise APIError(504, "generation timed out", "timeout") from None


def _response(ctx: _Context, result: GenerationResult) -> GenerateResponse:
    job = ctx.job
    text = ctx.runtime.tokenizer.decode(result.token_ids, skip_special_tokens=True)
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
            bits=ctx.payload.bits,
            hex=format(ctx.payload.to_int(), "x"),
            num_bits=ctx.payload.num_bits,
        ),
        message_id=ctx.message_id,
        key_version=ctx.key.version,
        scheme=ctx.key.scheme.version,
        usage=Usage(
            prompt_tokens=len(ctx.prompt_ids),
            completion_tokens=n,
            total_tokens=len(ctx.prompt_ids) + n,
        ),
        timing=Timing(
            queue_seconds=round(queue, 4),
            time_to_first_token_seconds=round(ttft, 4) if ttft is not None else None,
            total_seconds=round(total, 4),
            tokens_per_second=round(n / gen_time, 2) if gen_time > 0 and n else None,
        ),
    )


async def _remember(ctx: _Context, response: GenerateResponse) -> None:
    if ctx.idempotency is None:
        return
    key, body_hash = ctx.idempotency
    record = IdempotencyRecord(body_hash, 200, response.model_dump(mode="json"))
    await ctx.runtime.store.idempotency_put(
        ctx.tenant_id, key, record, ctx.runtime.settings.idempotency_ttl_s, overwrite=True
    )
    ctx.remembered = True


def _sse(data: str, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


async def _stream(ctx: _Context, request: Request, engine: Engine) -> AsyncIterator[bytes]:
    tok = ctx.runtime.tokenizer
    tokens: list[int] = []
    sent = ""
    try:
        while True:
            if await request.is_disconnected():
                engine.cancel(ctx.job)
                return
            item = await _next_event(ctx.job, ctx.deadline)
            if isinstance(item, GenerationResult):
                response = _response(ctx, item)
                await _remember(ctx, response)
                if response.text != sent and response.text.startswith(sent):
                    # flush a character still held back (the text ended inside it)
                    rest = response.text[len(sent) :]
                    yield _sse(json.dumps({"token_id": None, "text": rest}))
                yield _sse(response.model_dump_json(), "result")
                break
            if item.finish == "eos":
                continue  # the closing EOS is not part of the text
            tokens.append(item.token)
            text = tok.decode(tokens, skip_special_tokens=True)
            delta = ""
            if not text.endswith("\ufffd"):
                # a multi-byte character split across tokens decodes as U+FFFD until
                # its last byte arrives: hold it back so the deltas add up to the text
                delta, sent = text[len(sent) :], text
            yield _sse(json.dumps({"token_id": item.token, "text": delta}))
    except TimeoutError:
        engine.cancel(ctx.job)
        yield _sse(json.dumps(envelope(504, "generation timed out", "timeout")), "error")
    except APIError as exc:
        yield _sse(json.dumps(envelope(exc.status, exc.message, exc.code)), "error")
    except Exception:
        engine.cancel(ctx.job)
        yield _sse(json.dumps(envelope(500, "generation failed", "generation_failed")), "error")
    finally:
        if not ctx.job.done:
            engine.cancel(ctx.job)
        if ctx.idempotency is not None and not ctx.remembered:
            await _release(ctx.runtime, ctx.tenant_id, ctx.idempotency[0])
    yield b"data: [DONE]\n\n"


def _replay(stored: IdempotencyRecord, stream: bool) -> Any:
    headers = {"Idempotent-Replayed": "true"}
    if not stream:
        return JSONResponse(stored.response, status_code=stored.status_code, headers=headers)

    async def events() -> AsyncIterator[bytes]:
        yield _sse(json.dumps({"token_id": None, "text": stored.response.get("text", "")}))
        yield _sse(json.dumps(stored.response), "result")
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
