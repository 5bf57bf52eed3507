"""The Responses API (``/v1/responses``) as a translation onto the chat route's machinery.

A Responses request becomes the internal chat request the chat route runs
(:mod:`.chat` over :mod:`.run`: planning, allocation, the engine, stop
handling, cancellation), so what it gets is exactly what chat gets: the
watermark, the receipt, the sampling fields, and (where the chat route supports
them) structured outputs and function tools. What is added here is protocol:

* ``instructions`` become this request's system message (not carried over, as
  OpenAI's), and ``input`` items become messages;
* ``previous_response_id`` prepends the stored conversation of a response of the
  same tenant (store key: tenant id + response id, kept ``responses_ttl_s``); one
  of another tenant is simply not found;
* the output is OpenAI's Response object and, streamed, OpenAI's named events
  (``response.created`` ... ``response.completed``) with ``sequence_number``.

Every output is watermarked: ``watermark`` on the Response and the receipt
headers (:mod:`app.services.receipt`) carry its payload and registry entry.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from app.core.errors import APIError
from app.engines.base import Engine
from app.schemas.openai.chat import ChatCompletion, ChatCompletionRequest
from app.schemas.openai.common import WatermarkInfo
from app.schemas.openai.responses import (
    ContentPartEvent,
    ErrorEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    ItemStatus,
    MessageItem,
    OutputFunctionCall,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from app.services import generation as gen
from app.services import receipt
from app.services.disclosure import redact_stored
from app.services.openai import chat as chat_api
from app.services.openai import run as core
from app.services.openai.stream import SSE_HEADERS
from app.services.runtime import Runtime

MAX_MESSAGES = 64  # the chat route's limit

# a chat field's name -> the Responses field it came from (for the 400's param)
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
}


# --------------------------------------------------------------------------- translation
def _message(role: str, content: str | list[dict[str, str]]) -> dict[str, Any]:
    return {"role": role, "content": content}


def _content(item: MessageItem) -> str | list[dict[str, str]]:
    """As the chat route takes it: a string, or text parts (each within its limit)."""
    if isinstance(item.content, str):
        return item.content
    return [{"type": "text", "text": part.text} for part in item.content]


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as chat messages (function calls as assistant tool calls,
    their outputs as tool messages)."""
    if isinstance(body.input, str):
        return [_message("user", body.input)]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append(_message(item.role, _content(item)))
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def output_messages(output: list[OutputMessage | OutputFunctionCall]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a follow-up turn continues from."""
    messages: list[dict[str, Any]] = []
    text = "".join(part.text for item in output if isinstance(item, OutputMessage)
                   for part in item.content)  # fmt: skip
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        for item in output
        if isinstance(item, OutputFunctionCall)
    ]
    message: dict[str, Any] = _message("assistant", text)
    if calls:
        message["tool_calls"] = calls
    messages.append(message)
    return messages


def chat_body(body: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request a Responses request means."""
    messages = []
    if body.instructions is not None:
        messages.append(_message("system", body.instructions))
    messages += history + input_messages(body)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "user": body.user,
        "watermark": None if body.watermark is None else body.watermark.model_dump(
            by_alias=True, exclude_none=True
        ),
    }  # fmt: skip
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    if isinstance(body.tool_choice, str):
        chat["tool_choice"] = body.tool_choice
    elif body.tool_choice is not None:
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    if body.parallel_tool_calls is not None and body.tools:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    return {k: v for k, v in chat.items() if v is not None}


def _rename(param: str | None, message: str) -> tuple[str | None, str]:
    for chat_name, name in _PARAMS.items():
        message = message.replace(chat_name, name)
    if param is None:
        return None, message
    head, dot, rest = param.partition(".")
    if head == "messages":  # the turns are built from input and the stored conversation
        return "input", message
    return _PARAMS.get(head, head) + dot + rest, message


def renamed(exc: APIError) -> APIError:
    exc.param, exc.message = _rename(exc.param, exc.message)
    return exc


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """Validated by the chat route's own model: what it refuses is refused here, with
    ``param`` naming the Responses field."""
    chat = chat_body(body, history)
    if len(chat["messages"]) > MAX_MESSAGES:
        raise APIError(
            400, f"the conversation would have more than {MAX_MESSAGES} messages",
            "conversation_too_long", param="previous_response_id" if history else "input",
        )  # fmt: skip
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        err = exc.errors()[0]
        fields = [str(p) for p in err.get("loc", ()) if not any(c in str(p) for c in "[]()-")]
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        param, message = _rename(".".join(fields) or None, message)
        where = param or "body"
        raise APIError(400, f"{where}: {message}", "invalid_request", param=param) from None


async def history(runtime: Runtime, tenant_id: str, response_id: str | None) -> list[Any]:
    if response_id is None:
        return []
    stored = await runtime.store.response_get(tenant_id, response_id)
    if stored is None:  # another tenant's is not found either: ids are per tenant
        raise APIError(
            404, f"no stored response '{response_id[:128]}' (expired, not stored, or unknown)",
            "response_not_found", param="previous_response_id",
        )  # fmt: skip
    messages: list[Any] = stored["messages"]
    return messages


# --------------------------------------------------------------------------- building
@dataclass
class Turn:
    """One Responses request on its way: the chat run and the response's fixed parts."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    run: core.Run
    messages: list[dict[str, Any]]  # the conversation up to this turn's output
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    @property
    def watermark(self) -> WatermarkInfo:
        return core.watermark_info(self.run.samples[0])

    def response(
        self,
        status: str,
        output: list[OutputMessage | OutputFunctionCall],
        usage: ResponseUsage | None = None,
    ) -> ResponseObject:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,  # type: ignore[arg-type]
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.run.model,
            output=output,
            parallel_tool_calls=True
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls,  # fmt: skip
            previous_response_id=body.previous_response_id,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            tool_choice=(body.tool_choice or "auto")
            if isinstance(body.tool_choice, str | None)
            else body.tool_choice.model_dump(),  # fmt: skip
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            text={
                "format": {"type": "text"}
                if fmt is None
                else fmt.model_dump(by_alias=True, exclude_none=True)
            },  # fmt: skip
            store=body.store is not False,
            metadata=body.metadata or {},
            user=body.user,
            usage=usage,
            watermark=self.watermark,
        )

    def usage(self, output_tokens: int) -> ResponseUsage:
        prompt = sum(len(p) for p in self.run.pending.prompts)
        return ResponseUsage(
            input_tokens=prompt, output_tokens=output_tokens, total_tokens=prompt + output_tokens
        )


def _function_calls(completion: ChatCompletion) -> list[OutputFunctionCall]:
    """The chat answer's tool calls (once the chat route makes them) as output items."""
    calls = completion.choices[0].message.tool_calls or []
    return [
        OutputFunctionCall(
            id=f"fc_{uuid.uuid4().hex}",
            call_id=call.id,
            name=call.function.name,
            arguments=call.function.arguments,
            status="completed",
        )
        for call in calls
    ]


def finished(
    turn: Turn, completion: ChatCompletion
) -> tuple[ResponseObject, list[OutputMessage | OutputFunctionCall]]:
    choice = completion.choices[0]
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    output: list[OutputMessage | OutputFunctionCall] = []
    text = choice.message.content or ""
    calls = _function_calls(completion)
    if text or not calls:
        item_status: ItemStatus = "incomplete" if status == "incomplete" else "completed"
        output.append(
            OutputMessage(id=turn.message_id, status=item_status, content=[OutputText(text=text)])
        )
    output.extend(calls)
    usage = turn.usage(completion.usage.completion_tokens)
    return turn.response(status, output, usage), output


async def remember(runtime: Runtime, tenant_id: str, turn: Turn, response: ResponseObject) -> None:
    if turn.body.store is False:
        return
    record = {
        "messages": turn.messages + output_messages(response.output),
        "response": response.model_dump(mode="json"),
    }
    await runtime.store.response_put(tenant_id, turn.id, record, runtime.settings.responses_ttl_s)


# --------------------------------------------------------------------------- serving
async def serve(
    runtime: Runtime,
    engine: Engine,
    tenant_id: str,
    body: ResponsesRequest,
    request: Request,
    scopes: frozenset[str] = frozenset(),
) -> JSONResponse | StreamingResponse:
    """The Response as JSON, or, when ``stream`` is true, OpenAI's named events."""
    previous = await history(runtime, tenant_id, body.previous_response_id)
    chat = to_chat(body, previous)
    try:
        pending = await chat_api.plan(runtime, chat)
    except APIError as exc:  # named as the client named it
        raise renamed(exc) from None
    gen.ensure_queue_room(runtime, engine, pending.choices)
    run = await core.start(runtime, engine, tenant_id, pending, scopes)
    # what a follow-up continues from: instructions are this request's only
    turn = Turn(body, chat, run, previous + input_messages(body))
    headers = receipt.headers([turn.watermark])
    if body.stream:
        return StreamingResponse(
            events(runtime, engine, tenant_id, turn, request),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    completion = await chat_api.complete(run, request, engine)
    response, _ = finished(turn, completion)
    await remember(runtime, tenant_id, turn, response)
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


def _sse(event: Any, turn: Turn) -> bytes:
    event.sequence_number = turn.sequence
    turn.sequence += 1
    data = json.dumps(event.model_dump(mode="json"), separators=(",", ":"))
    return f"event: {event.type}\ndata: {data}\n\n".encode()


def _live_text(turn: Turn) -> bool:
    """Text deltas can go out as they come unless the answer may be a tool call (its
    arguments are parsed from the whole text): then the output items follow the end."""
    body = turn.body
    return not body.tools or body.tool_choice == "none"


async def events(
    runtime: Runtime, engine: Engine, tenant_id: str, turn: Turn, request: Request
) -> AsyncIterator[bytes]:
    """response.created, response.in_progress, then per output item its added/delta/done
    events, then response.completed (or .incomplete); an error as an ``error`` event."""
    run = turn.run
    sample = run.samples[0]
    try:
        yield _sse(ResponseLifecycleEvent(
            type="response.created", sequence_number=0, response=turn.response("in_progress", [])
        ), turn)  # fmt: skip
        yield _sse(ResponseLifecycleEvent(
            type="response.in_progress", sequence_number=0,
            response=turn.response("in_progress", []),
        ), turn)  # fmt: skip
        if _live_text(turn):
            async for chunk in _stream_text(turn, engine, request, sample):
                if chunk is None:
                    return  # the client went away
                if isinstance(chunk, ResponseObject):
                    await remember(runtime, tenant_id, turn, chunk)
                    kind = "response.completed" if chunk.status == "completed" else (
                        "response.incomplete")  # fmt: skip
                    yield _sse(ResponseLifecycleEvent(
                        type=kind, sequence_number=0, response=chunk  # type: ignore[arg-type]
                    ), turn)  # fmt: skip
                else:
                    yield chunk
        else:
            completion = await chat_api.complete(run, request, engine)
            response, output = finished(turn, completion)
            for index, item in enumerate(output):
                for event in _item_events(turn, index, item):
                    yield event
            await remember(runtime, tenant_id, turn, response)
            kind = "response.completed" if response.status == "completed" else (
                "response.incomplete")  # fmt: skip
            yield _sse(ResponseLifecycleEvent(
                type=kind, sequence_number=0, response=response  # type: ignore[arg-type]
            ), turn)  # fmt: skip
    except APIError as exc:
        yield _sse(ErrorEvent(
            type="error", sequence_number=0, code=exc.code, message=exc.message, param=exc.param
        ), turn)  # fmt: skip
    except Exception:
        yield _sse(ErrorEvent(
            type="error", sequence_number=0, code="generation_failed",
            message="generation failed", param=None,
        ), turn)  # fmt: skip
    finally:
        if not sample.job.done:
            engine.cancel(sample.job)


def _message_opening(turn: Turn, index: int) -> list[bytes]:
    item = OutputMessage(id=turn.message_id, status="in_progress", content=[])
    added = OutputItemEvent(
        type="response.output_item.added", sequence_number=0, output_index=index, item=item
    )
    part = ContentPartEvent(
        type="response.content_part.added", sequence_number=0, item_id=turn.message_id,
        output_index=index, content_index=0, part=OutputText(text=""),
    )  # fmt: skip
    return [_sse(added, turn), _sse(part, turn)]


def _delta(turn: Turn, index: int, text: str) -> bytes:
    return _sse(OutputTextDeltaEvent(
        type="response.output_text.delta", sequence_number=0, item_id=turn.message_id,
        output_index=index, content_index=0, delta=text,
    ), turn)  # fmt: skip


def _message_closing(turn: Turn, index: int, item: OutputMessage) -> list[bytes]:
    text = "".join(part.text for part in item.content)
    return [
        _sse(OutputTextDoneEvent(
            type="response.output_text.done", sequence_number=0, item_id=item.id,
            output_index=index, content_index=0, text=text,
        ), turn),
        _sse(ContentPartEvent(
            type="response.content_part.done", sequence_number=0, item_id=item.id,
            output_index=index, content_index=0, part=OutputText(text=text),
        ), turn),
        _sse(OutputItemEvent(
            type="response.output_item.done", sequence_number=0, output_index=index, item=item
        ), turn),
    ]  # fmt: skip


def _item_events(turn: Turn, index: int, item: OutputMessage | OutputFunctionCall) -> list[bytes]:
    """Every event of one finished output item (the buffered path)."""
    if isinstance(item, OutputMessage):
        text = "".join(part.text for part in item.content)
        out = _message_opening(turn, index)
        if text:
            out.append(_delta(turn, index, text))
        return out + _message_closing(turn, index, item)
    opening = item.model_copy(update={"status": "in_progress", "arguments": ""})
    return [
        _sse(OutputItemEvent(
            type="response.output_item.added", sequence_number=0, output_index=index,
            item=opening,
        ), turn),
        _sse(FunctionCallArgumentsDeltaEvent(
            type="response.function_call_arguments.delta", sequence_number=0, item_id=item.id,
            output_index=index, delta=item.arguments,
        ), turn),
        _sse(FunctionCallArgumentsDoneEvent(
            type="response.function_call_arguments.done", sequence_number=0, item_id=item.id,
            output_index=index, name=item.name, arguments=item.arguments,
        ), turn),
        _sse(OutputItemEvent(
            type="response.output_item.done", sequence_number=0, output_index=index, item=item
        ), turn),
    ]  # fmt: skip


async def _stream_text(
    turn: Turn, engine: Engine, request: Request, sample: gen.Sample
) -> AsyncIterator[bytes | ResponseObject | None]:
    """The message item's events as its text comes, then the finished Response."""
    for event in _message_opening(turn, 0):
        yield event
    text: list[str] = []
    async for piece in core.follow(sample, engine, turn.chat.stops()):
        if await request.is_disconnected():
            engine.cancel(sample.job)
            yield None
            return
        if piece.text:
            text.append(piece.text)
            yield _delta(turn, 0, piece.text)
        if piece.finish is not None:
            status: ItemStatus = "incomplete" if piece.finish == "length" else "completed"
            item = OutputMessage(
                id=turn.message_id, status=status, content=[OutputText(text="".join(text))]
            )
            for event in _message_closing(turn, 0, item):
                yield event
            yield turn.response(status, [item], turn.usage(piece.tokens))
            return


async def retrieve(
    runtime: Runtime, tenant_id: str, response_id: str, scopes: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """A stored Response of this tenant, as the asking key may see it (its payload bits
    only to an analyst's key or where the client chose them: app.services.disclosure)."""
    stored = await runtime.store.response_get(tenant_id, response_id)
    if stored is None:
        raise APIError(
            404, f"no stored response '{response_id[:128]}' (expired, not stored, or unknown)",
            "response_not_found", param="response_id",
        )  # fmt: skip
    return redact_stored(stored["response"], scopes)
