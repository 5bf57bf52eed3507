"""``POST /v1/chat/completions``: messages through the model's chat template, function
tools, and the chat's response and stream shapes, over the shared run core."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from app.engines.base import Engine
from app.schemas.openai.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from app.schemas.openai.common import FinishReason, UsageInfo, WatermarkInfo
from app.services.openai import run as core
from app.services.openai.constraints import format_specs, one_constraint, tool_use
from app.services.openai.logprobs import Entries, chat_logprobs
from app.services.openai.run import Outcome, Pending, Piece, Run
from app.services.openai.serve import Dialect
from app.services.openai.stream import Chunks
from app.services.openai.tools import ToolMode, call_text, parse_calls, tool_prompt
from app.services.runtime import Runtime

PREFIX = "chatcmpl"  # of a chat completion's id


async def plan(runtime: Runtime, body: ChatCompletionRequest) -> Pending:
    """Check the model and the limits, tokenise; 400 naming the field otherwise."""
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = core.requested_tokens(runtime, body, param)
    structure = one_constraint(format_specs(body), tool_use(body))
    messages = chat_messages(body, structure.tool_mode)
    prompts = [await core.tokenise(runtime, None, messages, "messages")]
    top = (body.top_logprobs or 0) if body.logprobs else None
    max_new = core.new_tokens(runtime, max_tokens)
    return await core.plan(runtime, "chat", body, prompts, structure, max_new, top)


def chat_messages(body: ChatCompletionRequest, tool_mode: ToolMode | None) -> list[dict[str, str]]:
    """The messages for the chat template: developer as system, tool calls and tool
    results as text (the embedded model's template has no tool syntax), and, when
    tools may be called, a system text that shows them."""
    messages: list[dict[str, str]] = []
    for m in body.messages:
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = "".join(call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            messages.append({"role": "assistant", "content": text + calls})
        elif m.role == "tool":
            messages.append(
                {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
            )
        else:
            messages.append(
                {"role": "system" if m.role == "developer" else m.role, "content": text}
            )
    if tool_mode is not None and body.tools:
        tools = [t.function.model_dump(exclude_none=True) for t in body.tools]
        note = tool_prompt(tools, "auto" if tool_mode == "auto" else "forced")
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + note}
        else:
            messages.insert(0, {"role": "system", "content": note})
    return messages


def call_id(pending: Pending, index: int, k: int = 0) -> str:
    """A tool call's id: the same in a stream and in the response it adds up to."""
    return f"call_{pending.id[:20]}{index:02d}{k:02d}"


def tool_calls(pending: Pending, text: str, index: int) -> tuple[str | None, list[ToolCall]]:
    """The content and the tool calls of a choice's text, by its tool mode; text that
    does not parse as a call stays content."""
    mode = pending.structure.tool_mode
    if mode is None:
        return text, []
    content, calls = parse_calls(mode, text, pending.structure.tool_name)
    return content, [
        ToolCall(
            id=call_id(pending, index, k),
            function=FunctionCall(
                name=name, arguments=args if isinstance(args, str) else json.dumps(args)
            ),
        )
        for k, (name, args) in enumerate(calls)
    ]


def chat_choice(run: Run, index: int, outcome: Outcome) -> ChatChoice:
    tokenizer = run.samples[index].runtime.tokenizer
    content, calls = tool_calls(run.pending, outcome.text, index)
    finish = outcome.finish
    if calls and finish == "stop":
        finish = "tool_calls"
    logprobs = None
    if run.pending.sampling[index].logprobs is not None:
        logprobs = chat_logprobs(tokenizer, outcome.logprobs)
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=content, tool_calls=calls or None),
        logprobs=logprobs,
        finish_reason=finish,
        watermark=core.watermark_info(run.samples[index]),
    )


def response(run: Run, outcomes: list[Outcome]) -> ChatCompletion:
    return ChatCompletion(
        **core.head(run, PREFIX),
        choices=[chat_choice(run, i, o) for i, o in enumerate(outcomes)],
        usage=core.usage(run, outcomes),
    )


async def complete(run: Run, request: Request, engine: Engine) -> ChatCompletion:
    """Every choice to its end, as one response."""
    return response(run, await core.outcomes(run, request, engine))


class ChatChunks(Chunks):
    """Chat's chunks: a role chunk first, content deltas, and tool calls as OpenAI's
    ``delta.tool_calls``. A named tool_choice sends the call's id and name first, then
    its arguments as they are generated; ``required`` and ``auto`` send the parsed call
    (and any text beside it) when the choice ends. With ``logprobs`` each delta
    carries its tokens' entries."""

    prefix = PREFIX

    def chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.head, choices=choices, usage=usage)

    def choice(
        self,
        index: int,
        text: str | None,
        *,
        role: bool = False,
        finish: FinishReason | None = None,
        watermark: WatermarkInfo | None = None,
        logprobs: Entries | None = None,
        tool_calls: list[ToolCallDelta] | None = None,
    ) -> bytes:
        tokenizer = self.run.samples[index].runtime.tokenizer
        delta = DeltaMessage(
            role="assistant" if role else None, content=text, tool_calls=tool_calls
        )
        chat_lp = None if logprobs is None else chat_logprobs(tokenizer, logprobs)
        chat = ChatChunkChoice(
            index=index, delta=delta, logprobs=chat_lp, finish_reason=finish,
            watermark=watermark,
        )  # fmt: skip
        return self.emit([chat])

    def _logprobs(self, index: int, entries: Entries) -> Entries | None:
        return entries if self.run.pending.sampling[index].logprobs is not None else None

    def opening(self, index: int) -> list[bytes]:
        pending = self.run.pending
        out = [self.choice(index, "", role=True)]
        if pending.structure.tool_mode == "named":
            head = ToolCallDelta(
                index=0, id=call_id(pending, index), type="function",
                function=FunctionCallDelta(name=pending.structure.tool_name, arguments=""),
            )  # fmt: skip
            out.append(self.choice(index, None, tool_calls=[head]))
        return out

    def piece(self, index: int, piece: Piece) -> list[bytes]:
        mode = self.run.pending.structure.tool_mode
        lp = self._logprobs(index, piece.logprobs)
        if mode == "named" and piece.text:
            args = ToolCallDelta(index=0, function=FunctionCallDelta(arguments=piece.text))
            return [self.choice(index, None, tool_calls=[args], logprobs=lp)]
        if mode is None and (piece.text or lp):
            return [self.choice(index, piece.text, logprobs=lp)]
        return []  # required, auto: the call is parsed when the choice ends

    def closing(self, index: int, outcome: Outcome) -> list[bytes]:
        final = chat_choice(self.run, index, outcome)
        out = []
        if self.run.pending.structure.tool_mode in ("required", "auto"):
            calls = [
                ToolCallDelta(
                    index=k, id=c.id, type="function",
                    function=FunctionCallDelta(
                        name=c.function.name, arguments=c.function.arguments
                    ),
                )
                for k, c in enumerate(final.message.tool_calls or [])
            ]  # fmt: skip
            out.append(
                self.choice(
                    index,
                    final.message.content,
                    tool_calls=calls or None,
                    logprobs=self._logprobs(index, outcome.logprobs),
                )  # fmt: skip
            )
        watermark = core.choice_watermark(self.run, index)
        out.append(self.choice(index, None, finish=final.finish_reason, watermark=watermark))
        return out


def _replayed(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice["message"]
    delta = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
    return {"delta": delta}


CHAT = Dialect(response, ChatChunks, "chat.completion.chunk", _replayed)
