"""The OpenAI protocol adapter: OpenAI requests in, OpenAI responses and SSE chunks out.

Everything that matters runs through :mod:`app.services.generation`, the path
``/generate`` uses: prompt limits, idempotency claims, registry allocation, the
continuous engine, deadlines and cancellation of a client that went away. What
is added here is only protocol: the model name, ``n`` samples per prompt (each
its own registry entry when metadata is allocated), stop strings, and the
response shapes.

Every completion is watermarked; there is no opt-out (see docs/openai.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.core.errors import APIError, openai_envelope
from app.engines.base import Engine
from app.schemas.openai import (
    MAX_CHOICES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    WatermarkInfo,
)
from app.schemas.watermark import DEFAULT_NO_REPEAT_NGRAM
from app.services import generation as gen
from app.services import receipt
from app.services.runtime import Runtime
from app.stores.base import IdempotencyRecord
from worldcup_core import Payload, SamplingConfig, __version__
from worldcup_core.generation import GenerationResult
from worldcup_core.models import EMBEDDED_MODEL_ID

DEFAULT_MAX_TOKENS = 256  # capped by WORLDCUP_MAX_NEW_TOKENS_LIMIT
DEFAULT_TOP_K = 50  # as /generate; watermark.top_k overrides (0 disables)
MIN_TEMPERATURE = 0.01  # temperature 0 means "as greedy as we sample"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
FinishReason = Literal["stop", "length"]
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# --------------------------------------------------------------------------- models
def model_name(runtime: Runtime) -> str:
    """The id clients send as ``model``: the setting, or the model's short name."""
    settings = runtime.settings
    if settings.served_model_name:
        return settings.served_model_name
    if runtime.model_id == EMBEDDED_MODEL_ID:
        return EMBEDDED_NAME
    return Path(runtime.model_id).name or runtime.model_id


def model_list(runtime: Runtime, started: float) -> ModelList:
    if runtime.engine is None:  # the detector role generates nothing
        return ModelList(data=[])
    return ModelList(
        data=[ModelCard(id=model_name(runtime), created=int(started), owned_by="worldcup")]
    )


def check_model(runtime: Runtime, requested: str) -> None:
    if requested not in (model_name(runtime), runtime.model_id):
        raise APIError(
            404,
            f"the model '{requested}' does not exist on this server; see GET /v1/models",
            "model_not_found",
            param="model",
        )


def fingerprint(runtime: Runtime) -> str:
    """Changes when the app, the model or the scheme of new keys changes."""
    seed = f"{__version__}|{runtime.model_id}|{runtime.settings.scheme}"
    return "fp_" + hashlib.sha256(seed.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- requests
@dataclass
class Pending:
    """The validated plan of one OpenAI request, before anything is allocated."""

    kind: Literal["chat", "completion"]
    body: ChatCompletionRequest | CompletionRequest
    prompts: list[list[int]]
    sampling: list[SamplingConfig]  # one per choice
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.body.n or 1

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


async def plan(runtime: Runtime, body: ChatCompletionRequest | CompletionRequest) -> Pending:
    """Check the model and the limits, tokenise; 400 naming the field otherwise."""
    settings = runtime.settings
    check_model(runtime, body.model)
    limit = settings.max_new_tokens_limit
    max_tokens = body.new_tokens
    if max_tokens is not None and max_tokens > limit:
        name = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None)
            else "max_tokens"
        )
        raise APIError(400, f"{name} may be at most {limit}", "max_tokens_too_large", param=name)
    new_tokens = min(max_tokens or DEFAULT_MAX_TOKENS, limit)
    # min_tokens above the maximum is capped at it, as /generate caps min_new_tokens:
    # a cross-field rule JSON Schema cannot state is not a refusal
    if isinstance(body, ChatCompletionRequest):
        kind: Literal["chat", "completion"] = "chat"
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        prompts = [await _tokenise(runtime, None, messages, "messages")]
    else:
        kind = "completion"
        prompts = [await _tokenise(runtime, p, None, "prompt") for p in body.prompts()]
    n = body.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(
            400, f"n times the number of prompts may be at most {MAX_CHOICES}",
            "too_many_choices", param="n",
        )  # fmt: skip
    wm = body.watermark
    temperature = 1.0 if body.temperature is None else max(body.temperature, MIN_TEMPERATURE)
    sampling = [
        SamplingConfig(
            temperature=temperature,
            top_k=DEFAULT_TOP_K if wm is None or wm.top_k is None else wm.top_k,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_new_tokens=new_tokens,
            min_new_tokens=min(body.min_tokens or 0, new_tokens),
            no_repeat_ngram_size=DEFAULT_NO_REPEAT_NGRAM
            if wm is None or wm.no_repeat_ngram_size is None
            else wm.no_repeat_ngram_size,
            # each choice its own sample: a seed makes the whole request repeatable
            seed=None if body.seed is None else (body.seed + i) % 2**63,
        )
        for i in range(len(prompts) * n)
    ]
    return Pending(kind, body, prompts, sampling)


async def _tokenise(
    runtime: Runtime, prompt: str | None, messages: list[dict[str, str]] | None, param: str
) -> list[int]:
    """Off the event loop, in the CPU pool, as /generate does."""
    try:
        return await runtime.offload(lambda: gen.prompt_ids(runtime, prompt, messages))
    except APIError as exc:
        exc.param = param
        raise


def body_hash(pending: Pending) -> str:
    return gen.body_hash({"openai": pending.kind, **pending.body.model_dump(mode="json")})


# --------------------------------------------------------------------------- running
@dataclass
class Piece:
    """New text of one choice; ``finish`` is set on its last piece."""

    text: str
    finish: FinishReason | None = None
    tokens: int = 0


@dataclass
class Run:
    pending: Pending
    samples: list[gen.Sample]
    model: str
    fingerprint: str


async def start(runtime: Runtime, engine: Engine, tenant_id: str, pending: Pending) -> Run:
    """Allocate (one registry entry per choice) and submit every choice to the engine."""
    body = pending.body
    key = await runtime.tenants.version(tenant_id, None)
    wm = body.watermark
    fixed: Payload | None = None
    if wm is not None and wm.payload is not None:
        p = wm.payload
        fixed = gen.parse_payload(p.bits, p.hex, p.integer, p.num_bits)
    if wm is not None and wm.metadata is not None:
        metadata: dict[str, Any] = wm.metadata
    else:
        metadata = {"user": body.user} if body.user is not None else {}
    samples: list[gen.Sample] = []
    try:
        for i, sampling in enumerate(pending.sampling):
            prompt = pending.prompts[i // pending.n]
            if fixed is not None:
                payload, message_id = fixed, None
            else:
                payload, message_id = await gen.allocate(
                    runtime, tenant_id, key, metadata, None if wm is None else wm.num_bits
                )
            samples.append(
                gen.submit(runtime, engine, tenant_id, key, prompt, sampling, payload, message_id)
            )
    except BaseException:
        for sample in samples:
            engine.cancel(sample.job)
        raise
    return Run(pending, samples, model_name(runtime), fingerprint(runtime))


def _stop_at(text: str, stops: list[str]) -> int | None:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def _held(text: str, stops: list[str]) -> int:
    """How many trailing characters could be the start of a stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


async def follow(sample: gen.Sample, engine: Engine, stops: list[str]) -> AsyncIterator[Piece]:
    """One choice as text pieces that add up to its final text, cut at a stop string."""
    deltas = gen.TextDeltas(sample.runtime.tokenizer)
    shown = 0  # characters of deltas.sent already yielded
    try:
        while True:
            item = await gen.next_event(sample)
            if isinstance(item, GenerationResult):
                text = sample.runtime.tokenizer.decode(item.token_ids, skip_special_tokens=True)
                cut = _stop_at(text, stops)
                finish: FinishReason = "stop" if item.finish_reason == "eos" else "length"
                if cut is not None:
                    text, finish = text[:cut], "stop"
                yield Piece(text[shown:], finish, len(item.token_ids))
                return
            if item.finish == "eos":
                continue  # the closing EOS is not part of the text
            deltas.push(item.token)
            text = deltas.sent
            cut = _stop_at(text, stops)
            if cut is not None:
                engine.cancel(sample.job)  # the client has what it asked for
                yield Piece(text[shown:cut], "stop", len(deltas.tokens))
                return
            safe = len(text) - _held(text, stops)
            if safe > shown:
                yield Piece(text[shown:safe])
                shown = safe
    except TimeoutError:
        raise gen.timed_out(sample, engine) from None


def watermark_info(sample: gen.Sample) -> WatermarkInfo:
    return WatermarkInfo(
        message_id=sample.message_id,
        key_version=sample.key.version,
        scheme=sample.key.scheme.version,
        num_bits=sample.payload.num_bits,
        payload_hex=format(sample.payload.to_int(), "x"),
        payload_bits=sample.payload.bits,
    )


@dataclass
class Outcome:
    text: str
    finish: FinishReason
    tokens: int


def assemble(run: Run, outcomes: list[Outcome]) -> ChatCompletion | Completion:
    pending = run.pending
    usage = UsageInfo(
        prompt_tokens=sum(len(p) for p in pending.prompts),
        completion_tokens=sum(o.tokens for o in outcomes),
        total_tokens=sum(len(p) for p in pending.prompts) + sum(o.tokens for o in outcomes),
    )
    if pending.kind == "chat":
        return ChatCompletion(
            id=f"chatcmpl-{pending.id}",
            created=pending.created,
            model=run.model,
            system_fingerprint=run.fingerprint,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=o.text),
                    finish_reason=o.finish,
                    watermark=watermark_info(s),
                )
                for i, (o, s) in enumerate(zip(outcomes, run.samples, strict=True))
            ],
            usage=usage,
        )
    return Completion(
        id=f"cmpl-{pending.id}",
        created=pending.created,
        model=run.model,
        system_fingerprint=run.fingerprint,
        choices=[
            CompletionChoice(
                index=i, text=o.text, finish_reason=o.finish, watermark=watermark_info(s)
            )
            for i, (o, s) in enumerate(zip(outcomes, run.samples, strict=True))
        ],
        usage=usage,
    )


async def _outcome(pieces: AsyncIterator[Piece]) -> Outcome:
    text: list[str] = []
    async for piece in pieces:
        text.append(piece.text)
        if piece.finish is not None:
            return Outcome("".join(text), piece.finish, piece.tokens)
    raise AssertionError("a choice ended without a finish reason")


async def complete(run: Run, request: Request, engine: Engine) -> ChatCompletion | Completion:
    """Every choice to its end; a client that goes away cancels them all."""
    stops = run.pending.body.stops()
    jobs = [s.job for s in run.samples]
    watcher = asyncio.create_task(gen.watch_disconnect(request, engine, jobs))
    tasks = [asyncio.create_task(_outcome(follow(s, engine, stops))) for s in run.samples]
    try:
        outcomes = await asyncio.gather(*tasks)
    finally:
        watcher.cancel()
        for task in tasks:  # one choice failed: the others have nobody to answer
            task.cancel()
        for job in jobs:
            if not job.done:
                engine.cancel(job)
    return assemble(run, list(outcomes))


# --------------------------------------------------------------------------- streaming
_DONE = object()


async def _merge(
    streams: list[AsyncIterator[Piece]],
) -> AsyncIterator[tuple[int, Piece]]:
    """Pieces of every choice as they come (choices run in one batch, side by side)."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put((index, piece))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, Piece)
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class Chunks:
    """OpenAI's chunk shapes for one streamed request."""

    def __init__(self, run: Run, include_usage: bool) -> None:
        self.run, self.include_usage = run, include_usage
        self.chat = run.pending.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{run.pending.id}"

    def _chunk(
        self, choices: list[ChatChunkChoice] | list[CompletionChunkChoice], usage: UsageInfo | None
    ) -> bytes:
        run = self.run
        head = (self.id, run.pending.created, run.model, run.fingerprint)
        chunk: ChatCompletionChunk | CompletionChunk
        if self.chat:
            chunk = ChatCompletionChunk(
                id=head[0], created=head[1], model=head[2], system_fingerprint=head[3],
                choices=[c for c in choices if isinstance(c, ChatChunkChoice)], usage=usage,
            )  # fmt: skip
        else:
            chunk = CompletionChunk(
                id=head[0], created=head[1], model=head[2], system_fingerprint=head[3],
                choices=[c for c in choices if isinstance(c, CompletionChunkChoice)], usage=usage,
            )  # fmt: skip
        # OpenAI sends "usage" (null until the last chunk) only when it was asked for
        exclude = None if self.include_usage else {"usage"}
        data = chunk.model_dump(mode="json", exclude=exclude)
        for choice in data["choices"]:  # as OpenAI: deltas without nulls
            if choice.get("watermark") is None:
                del choice["watermark"]  # only the choice's last chunk carries it
            if "delta" in choice:
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return _sse(data)

    def choice(
        self,
        index: int,
        text: str | None,
        *,
        role: bool = False,
        finish: FinishReason | None = None,
        watermark: WatermarkInfo | None = None,
    ) -> bytes:
        if self.chat:
            delta = DeltaMessage(role="assistant" if role else None, content=text)
            chat = ChatChunkChoice(
                index=index, delta=delta, finish_reason=finish, watermark=watermark
            )
            return self._chunk([chat], None)
        plain = CompletionChunkChoice(
            index=index, text=text or "", finish_reason=finish, watermark=watermark
        )
        return self._chunk([plain], None)

    def start(self, index: int) -> bytes | None:
        return self.choice(index, "", role=True) if self.chat else None

    def usage(self, usage: UsageInfo) -> bytes:
        return self._chunk([], usage)


def stream(
    run: Run, request: Request, engine: Engine, claim: gen.IdempotencyClaim | None
) -> StreamingResponse:
    """SSE: the role chunk, content deltas, each choice's finish chunk (with the
    watermark), the usage chunk when asked for, then ``data: [DONE]``."""
    body = run.pending.body
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = Chunks(run, include_usage)
    stops = body.stops()

    async def events() -> AsyncIterator[bytes]:
        texts = [""] * len(run.samples)
        outcomes: list[Outcome | None] = [None] * len(run.samples)
        try:
            for i in range(len(run.samples)):
                if (first := chunks.start(i)) is not None:
                    yield first
            async for i, piece in _merge([follow(s, engine, stops) for s in run.samples]):
                if await request.is_disconnected():
                    return
                texts[i] += piece.text
                if piece.text:
                    yield chunks.choice(i, piece.text)
                if piece.finish is not None:
                    outcomes[i] = Outcome(texts[i], piece.finish, piece.tokens)
                    info = watermark_info(run.samples[i])
                    yield chunks.choice(i, None, finish=piece.finish, watermark=info)
            done = [o for o in outcomes if o is not None]
            response = assemble(run, done)
            if claim is not None:
                await claim.remember(response.model_dump(mode="json"))
            if include_usage:
                yield chunks.usage(response.usage)
        except APIError as exc:
            error = openai_envelope(exc.status, exc.message, exc.code, exc.param)
            yield _sse(error)
        except Exception:
            yield _sse(openai_envelope(500, "generation failed", "generation_failed", None))
        finally:
            for sample in run.samples:
                if not sample.job.done:
                    engine.cancel(sample.job)
            if claim is not None:
                await claim.release()  # a no-op once the response is remembered
        yield _sse("[DONE]")

    # the receipt is known before the first token: every message id is allocated
    headers = {**SSE_HEADERS, **receipt.headers(watermark_info(s) for s in run.samples)}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def replay(
    stored: IdempotencyRecord, body: ChatCompletionRequest | CompletionRequest
) -> JSONResponse | StreamingResponse:
    """A stored response again (same Idempotency-Key and body); a stream as one chunk
    per choice (and the usage chunk if the request asked for it)."""
    streamed = bool(body.stream)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    headers = {"Idempotent-Replayed": "true", **receipt.of_response(stored.response)}
    if not streamed:
        return JSONResponse(stored.response, status_code=stored.status_code, headers=headers)
    response = stored.response
    chat = response.get("object") == "chat.completion"
    head = {k: response[k] for k in ("id", "created", "model", "system_fingerprint")}
    kind = "chat.completion.chunk" if chat else "text_completion"

    async def events() -> AsyncIterator[bytes]:
        for choice in response["choices"]:
            if chat:
                delta = {"role": "assistant", "content": choice["message"]["content"]}
                out = {"index": choice["index"], "delta": delta}
            else:
                out = {"index": choice["index"], "text": choice["text"]}
            last = {**out, "logprobs": None, "finish_reason": choice["finish_reason"]}
            last["watermark"] = choice["watermark"]
            yield _sse({**head, "object": kind, "choices": [last]})
        if include_usage:
            yield _sse({**head, "object": kind, "choices": [], "usage": response["usage"]})
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


async def serve(
    runtime: Runtime,
    engine: Engine,
    tenant_id: str,
    body: ChatCompletionRequest | CompletionRequest,
    request: Request,
    idempotency_key: str | None,
) -> Any:
    """A replayed response for a known Idempotency-Key; else the completion, as JSON
    or, when ``stream`` is true, as OpenAI's Server-Sent Events."""
    pending = await plan(runtime, body)
    digest = body_hash(pending)
    streamed = bool(body.stream)
    if idempotency_key is not None:
        stored = await gen.stored_response(runtime, tenant_id, idempotency_key, digest)
        if stored is not None:
            return replay(stored, body)
    gen.ensure_queue_room(runtime, engine, pending.choices)  # before allocating
    claim = None
    if idempotency_key is not None:
        claimed = await gen.claim(runtime, tenant_id, idempotency_key, digest)
        if isinstance(claimed, IdempotencyRecord):
            return replay(claimed, body)
        claim = claimed
    try:
        run = await start(runtime, engine, tenant_id, pending)
        if streamed:
            return stream(run, request, engine, claim)
        response = await complete(run, request, engine)
        content = response.model_dump(mode="json")
        if claim is not None:
            await claim.remember(content)
        return JSONResponse(content, headers=receipt.headers(c.watermark for c in response.choices))
    except BaseException:
        if claim is not None:
            await claim.release()
        raise
