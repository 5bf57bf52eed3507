"""The OpenAI protocol adapter: OpenAI requests in, OpenAI responses and SSE chunks out.

Everything that matters runs through :mod:`app.services.generation`, the path
``/generate`` uses: prompt limits, idempotency claims, registry allocation, the
continuous engine, deadlines and cancellation of a client that went away. What
is added here is only protocol: the model name, ``n`` samples per prompt (each
its own registry entry when metadata is allocated), stop strings, and the
response shapes.

Every completion is watermarked; there is no opt-out (see docs/openai.md). The one
exception returns no generated text: a completion with ``max_tokens`` 0 (echo and
logprobs: the prompt scored) runs one unwatermarked token for the prompt's forward
pass and drops it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
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
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UsageInfo,
    WatermarkInfo,
)
from app.schemas.watermark import DEFAULT_NO_REPEAT_NGRAM
from app.services import generation as gen
from app.services import grammar, receipt
from app.services.runtime import Runtime
from app.stores.base import IdempotencyRecord
from worldcup_core import Payload, SamplingConfig, __version__
from worldcup_core.generation import GenerationResult, PromptLogprobs, TokenLogprobs
from worldcup_core.models import EMBEDDED_MODEL_ID

DEFAULT_MAX_TOKENS = 256  # capped by WORLDCUP_MAX_NEW_TOKENS_LIMIT
DEFAULT_TOP_K = 50  # as /generate; watermark.top_k overrides (0 disables)
MIN_TEMPERATURE = 0.01  # temperature 0 means "as greedy as we sample"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
FinishReason = Literal["stop", "length", "tool_calls"]
ToolMode = Literal["named", "required", "auto"]
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token off the support reports this (as vLLM)
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
    spec: grammar.GrammarSpec | None = None
    compiled: Any = None  # the grammar, compiled for the served tokenizer
    tool_mode: ToolMode | None = None
    tool_name: str | None = None  # tool_mode "named"
    echo: list[str] = field(default_factory=list)  # completions with echo: the prompts
    scored: bool = False  # max_tokens 0 with echo and logprobs: the prompt scored, no text
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
    # max_tokens 0 (completions): score the prompt, generate nothing; the engine runs one
    # unwatermarked token for the prompt's forward pass, and it is dropped
    scored = max_tokens == 0
    if scored and not (
        isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None
    ):
        raise APIError(
            400, "max_tokens 0 scores the prompt without generating: it needs echo and logprobs",
            "invalid_request", param="max_tokens",
        )  # fmt: skip
    new_tokens = 1 if scored else min(max_tokens or DEFAULT_MAX_TOKENS, limit)
    # min_tokens above the maximum is capped at it, as /generate caps min_new_tokens:
    # a cross-field rule JSON Schema cannot state is not a refusal
    spec, tool_mode, tool_name = structure(body)
    if isinstance(body, ChatCompletionRequest):
        kind: Literal["chat", "completion"] = "chat"
        messages = chat_messages(body, tool_mode)
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
    compiled = None
    if spec is not None:
        compiled = await runtime.offload(lambda: grammar.compile_spec(runtime.tokenizer, spec))
    sampling = sampling_configs(runtime, body, new_tokens, len(prompts) * n, spec is not None)
    echo = body.prompts() if isinstance(body, CompletionRequest) and body.echo else []
    return Pending(
        kind, body, prompts, sampling, spec, compiled, tool_mode, tool_name, echo, scored
    )


def _bad(param: str, message: str, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code, param=param)


def sampling_configs(
    runtime: Runtime,
    body: ChatCompletionRequest | CompletionRequest,
    new_tokens: int,
    choices: int,
    constrained: bool,
) -> list[SamplingConfig]:
    """One :class:`SamplingConfig` per choice: every sampling field applied, or a 400."""
    wm = body.watermark
    temperature = 1.0 if body.temperature is None else max(body.temperature, MIN_TEMPERATURE)
    top_k = DEFAULT_TOP_K if wm is None or wm.top_k is None else wm.top_k
    if body.top_k is not None:
        if wm is not None and wm.top_k is not None and max(body.top_k, 0) != wm.top_k:
            raise _bad(
                "top_k",
                "top_k and watermark.top_k disagree; give one of them",
                "conflicting_fields",
            )
        top_k = max(body.top_k, 0)  # vLLM's -1 disables, as 0
    vocab = len(runtime.tokenizer)
    bias: list[tuple[int, float]] = []
    for token, value in (body.logit_bias or {}).items():
        if int(token) >= vocab:
            raise _bad(
                "logit_bias", f"logit_bias: token id {token} is not in the vocabulary",
                "token_not_in_vocabulary",
            )  # fmt: skip
        bias.append((int(token), float(value)))
    top: int | None = None
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs:
            top = body.top_logprobs or 0
    elif body.logprobs is not None:
        top = body.logprobs
    # vLLM's logprobs mode is engine-wide (WORLDCUP_VLLM_LOGPROBS_MODE); hf offers both
    fixed: str | None = getattr(runtime.engine, "logprobs_mode", None)
    mode = body.logprobs_mode or fixed or "sampled"
    if top is not None and fixed is not None and mode != fixed:
        raise _bad(
            "logprobs_mode",
            f"logprobs_mode '{mode}' is not served here: the vllm engine reports one mode "
            f"for every request, '{fixed}' (the setting WORLDCUP_VLLM_LOGPROBS_MODE)",
            "logprobs_mode_unavailable",
        )
    # echo with logprobs: the prompt's tokens too, under the model's own distribution
    prompt_top = top if isinstance(body, CompletionRequest) and body.echo else None
    # n-gram bans fight a grammar (JSON repeats its keys and separators): off by default
    default_ngram = 0 if constrained else DEFAULT_NO_REPEAT_NGRAM
    ngram = (
        default_ngram if wm is None or wm.no_repeat_ngram_size is None else wm.no_repeat_ngram_size
    )
    return [
        SamplingConfig(
            temperature=temperature,
            top_k=top_k,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_new_tokens=new_tokens,
            min_new_tokens=min(body.min_tokens or 0, new_tokens),
            no_repeat_ngram_size=ngram,
            # each choice its own sample: a seed makes the whole request repeatable
            seed=None if body.seed is None else (body.seed + i) % 2**63,
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=tuple(bias),
            logprobs=top,
            logprobs_mode=mode,
            prompt_logprobs=prompt_top,
        )
        for i in range(choices)
    ]


# the constraints whose value is the grammar spec as given, in vLLM's order of precedence:
# ``structured_outputs.<kind>`` and the older ``guided_<kind>``
PLAIN_SPECS: tuple[Literal["regex", "choice", "grammar"], ...] = ("regex", "choice", "grammar")


def structure(
    body: ChatCompletionRequest | CompletionRequest,
) -> tuple[grammar.GrammarSpec | None, ToolMode | None, str | None]:
    """The request's one output constraint, from whichever field gave it (a 400 for two)."""
    specs: list[grammar.GrammarSpec] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(grammar.GrammarSpec("json_object", None, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        specs.append(grammar.GrammarSpec("json_schema", schema, "response_format"))
    so = body.structured_outputs
    if so is not None:
        plain = [(k, getattr(so, k)) for k in PLAIN_SPECS if getattr(so, k) is not None]
        if so.json_ is not None:
            specs.append(_json_spec(so.json_, "structured_outputs.json"))
        elif plain:  # the first of regex, choice, grammar
            kind, value = plain[0]
            specs.append(grammar.GrammarSpec(kind, value, f"structured_outputs.{kind}"))
        elif so.json_object:
            specs.append(grammar.GrammarSpec("json_object", None, "structured_outputs.json_object"))
        elif so.structural_tag is not None:
            tag = so.structural_tag
            specs.append(
                grammar.GrammarSpec(
                    "structural_tag", _json_value(tag, "structured_outputs.structural_tag"),
                    "structured_outputs.structural_tag",
                )
            )  # fmt: skip
    if body.guided_json is not None:
        specs.append(_json_spec(body.guided_json, "guided_json"))
    for kind in PLAIN_SPECS:
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            specs.append(grammar.GrammarSpec(kind, value, f"guided_{kind}"))
    mode: ToolMode | None = None
    name: str | None = None
    if isinstance(body, ChatCompletionRequest):
        tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise _bad("tool_choice", "tool_choice needs tools", "tool_choice_needs_tools")
        names = [t["name"] for t in tools]
        if len(set(names)) != len(names):
            raise _bad("tools", "tool names must be unique", "duplicate_tool_names")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in names:
                raise _bad(
                    "tool_choice", f"tool_choice names '{name}', which is not in tools",
                    "unknown_tool",
                )  # fmt: skip
            tool = tools[names.index(name)]
            specs.append(grammar.GrammarSpec("json_schema", grammar.parameters(tool), "tools"))
            mode = "named"
        elif choice == "required":
            specs.append(
                grammar.GrammarSpec("json_schema", grammar.tool_call_schema(tools), "tools")
            )
            mode = "required"
        elif choice == "auto":
            specs.append(
                grammar.GrammarSpec("structural_tag", grammar.auto_tool_tag(tools), "tools")
            )
            mode = "auto"
    if len(specs) > 1:
        raise _bad(
            specs[1].param, f"give one output constraint; {specs[0].param} is already one",
            "conflicting_fields",
        )  # fmt: skip
    return (specs[0] if specs else None), mode, name


def _json_value(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise _bad(param, f"{param} is not valid JSON", "invalid_json") from None
    return value


def _json_spec(value: Any, param: str) -> grammar.GrammarSpec:
    schema = _json_value(value, param)
    if not isinstance(schema, dict | bool):
        raise _bad(param, f"{param} must be a JSON Schema object", "invalid_json")
    return grammar.GrammarSpec("json_schema", schema, param)


def chat_messages(body: ChatCompletionRequest, tool_mode: ToolMode | None) -> list[dict[str, str]]:
    """The messages for the chat template: developer as system, tool calls and tool
    results as text (the embedded model's template has no tool syntax), and, when
    tools may be called, a system text that shows them."""
    messages: list[dict[str, str]] = []
    for m in body.messages:
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = "".join(
                f'{grammar.TOOL_OPEN}{{"name": {json.dumps(c.function.name)}, '
                f'"arguments": {c.function.arguments}}}{grammar.TOOL_CLOSE}'
                for c in m.tool_calls
            )
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
        note = grammar.tool_prompt(tools, "auto" if tool_mode == "auto" else "forced")
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + note}
        else:
            messages.insert(0, {"role": "system", "content": note})
    return messages


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
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)  # this piece's
    prompt: PromptLogprobs | None = None  # echo with logprobs: on the choice's first piece


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
            if pending.scored:  # nothing generated is kept: no watermark, no registry entry
                samples.append(
                    gen.submit(runtime, engine, tenant_id, key, prompt, sampling, None, None)
                )
                continue
            if fixed is not None:
                payload, message_id = fixed, None
            else:
                payload, message_id = await gen.allocate(
                    runtime, tenant_id, key, metadata, None if wm is None else wm.num_bits
                )
            constraint = None
            if pending.spec is not None:  # each choice its own matcher state
                constraint = grammar.GrammarConstraint(pending.spec, pending.compiled)
            samples.append(
                gen.submit(
                    runtime, engine, tenant_id, key, prompt, sampling, payload, message_id,
                    constraint,
                )
            )  # fmt: skip
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
    """One choice as text pieces that add up to its final text, cut at a stop string;
    each piece carries the log-probabilities of the tokens it completes, if asked for.
    A sample without payload (max_tokens 0) is one empty piece with the prompt's scores."""
    tokenizer = sample.runtime.tokenizer
    deltas = gen.TextDeltas(tokenizer)
    shown = 0  # characters of deltas.sent already yielded
    logprobs: list[tuple[int, TokenLogprobs]] = []  # not yet handed out
    every: list[tuple[int, TokenLogprobs]] = []
    prompt: PromptLogprobs | None = None  # not yet handed out
    try:
        while True:
            item = await gen.next_event(sample)
            if isinstance(item, GenerationResult):
                text = tokenizer.decode(item.token_ids, skip_special_tokens=True)
                cut = _stop_at(text, stops)
                finish: FinishReason = "stop" if item.finish_reason == "eos" else "length"
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    logprobs = _within(tokenizer, every, cut, len(every) - len(logprobs))
                yield Piece(text[shown:], finish, len(item.token_ids), logprobs, prompt)
                return
            if item.prompt_logprobs is not None:
                prompt = item.prompt_logprobs
            if sample.payload is None:  # the prompt scored: its one token is dropped
                engine.cancel(sample.job)
                yield Piece("", "length", 0, [], prompt)
                return
            if item.finish == "eos":
                continue  # the closing EOS is not part of the text
            deltas.push(item.token)
            if item.logprobs is not None:
                logprobs.append((item.token, item.logprobs))
                every.append((item.token, item.logprobs))
            text = deltas.sent
            cut = _stop_at(text, stops)
            if cut is not None:
                engine.cancel(sample.job)  # the client has what it asked for
                kept = _within(tokenizer, every, cut, len(every) - len(logprobs))
                yield Piece(text[shown:cut], "stop", len(deltas.tokens), kept, prompt)
                return
            safe = len(text) - _held(text, stops)
            if safe > shown or prompt is not None:
                yield Piece(text[shown:safe], logprobs=logprobs, prompt=prompt)
                logprobs, prompt = [], None
                shown = max(shown, safe)
    except TimeoutError:
        raise gen.timed_out(sample, engine) from None


def _within(
    tokenizer: Any, every: list[tuple[int, TokenLogprobs]], cut: int, start: int
) -> list[tuple[int, TokenLogprobs]]:
    """The entries of ``every[start:]`` whose token starts before character ``cut``."""
    kept = []
    for j in range(start, len(every)):
        before = tokenizer.decode([t for t, _ in every[:j]], skip_special_tokens=True)
        if len(before) >= cut:
            break
        kept.append(every[j])
    return kept


def watermark_info(sample: gen.Sample) -> WatermarkInfo:
    assert sample.payload is not None
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
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    prompt: PromptLogprobs | None = None  # echo with logprobs: the prompt's entries


def _token_text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False))


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(tokenizer: Any, entries: list[tuple[int, TokenLogprobs]]) -> ChoiceLogprobs:
    content = []
    for token, lp in entries:
        text = _token_text(tokenizer, token)
        top = [
            TopLogprob(
                token=(t := _token_text(tokenizer, i)), logprob=_lp(v), bytes=list(t.encode())
            )
            for i, v in lp.top
        ]
        content.append(
            TokenLogprob(
                token=text, logprob=_lp(lp.logprob), bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any,
    entries: Sequence[tuple[int, TokenLogprobs | None]],
    offset: int = 0,
    prompt: Sequence[tuple[int, TokenLogprobs | None]] = (),
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs; with echo the ``prompt``'s entries come first, their
    offsets counted from 0 (the echoed text's start), the completion's from ``offset``
    (where the completion starts in the choice's text). An entry without log-probability
    (the prompt's first token) reports null, as OpenAI does."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    position = 0
    for k, (token, lp) in enumerate([*prompt, *entries]):
        if k == len(prompt):
            position = offset
        text = _token_text(tokenizer, token)
        tokens.append(text)
        offsets.append(position)
        position += len(text)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_lp(lp.logprob))
        top: dict[str, float] = {}
        for i, v in lp.top:
            top.setdefault(_token_text(tokenizer, i), _lp(v))
        tops.append(top)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
    )


def call_id(pending: Pending, index: int, k: int = 0) -> str:
    """A tool call's id: the same in a stream and in the response it adds up to."""
    return f"call_{pending.id[:20]}{index:02d}{k:02d}"


def tool_calls(pending: Pending, text: str, index: int) -> tuple[str | None, list[ToolCall]]:
    """The content and the tool calls of a chat choice's text, by its tool mode;
    text that does not parse as a call stays content."""
    mode = pending.tool_mode
    if mode is None:
        return text, []
    made: list[ToolCall] = []

    def call(name: str, arguments: Any) -> ToolCall:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        made.append(
            ToolCall(
                id=call_id(pending, index, len(made)),
                function=FunctionCall(name=name, arguments=args),
            )
        )
        return made[-1]

    if mode == "named":
        assert pending.tool_name is not None
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [call(pending.tool_name, text)]
    if mode == "required":
        try:
            obj = json.loads(text)
            return None, [call(str(obj["name"]), obj["arguments"])]
        except (ValueError, KeyError, TypeError):
            return text, []
    calls: list[ToolCall] = []
    rest: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            found = call(str(obj["name"]), obj["arguments"])
        except (ValueError, KeyError, TypeError):
            continue
        rest.append(text[position : match.start()])
        position = match.end()
        calls.append(found)
    rest.append(text[position:])
    content = "".join(rest).strip()
    return (content or None) if calls else text, calls


_TOOL_CALL = re.compile(
    re.escape(grammar.TOOL_OPEN) + r"(.*?)" + re.escape(grammar.TOOL_CLOSE), re.DOTALL
)


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
        watermark=watermark_info(run.samples[index]),
    )


def completion_choice(run: Run, index: int, outcome: Outcome) -> CompletionChoice:
    tokenizer = run.samples[index].runtime.tokenizer
    pending = run.pending
    prefix = pending.echo[index // pending.n] if pending.echo else ""
    logprobs = None
    if pending.sampling[index].logprobs is not None:
        scored = prompt_entries(pending, index, outcome.prompt)
        logprobs = completion_logprobs(tokenizer, outcome.logprobs, len(prefix), scored)
    return CompletionChoice(
        index=index,
        text=prefix + outcome.text,
        logprobs=logprobs,
        finish_reason=outcome.finish,
        watermark=choice_watermark(run, index),
    )


def choice_watermark(run: Run, index: int) -> WatermarkInfo | None:
    """A choice's receipt; None when nothing was generated (max_tokens 0)."""
    return None if run.pending.scored else watermark_info(run.samples[index])


def prompt_entries(
    pending: Pending, index: int, scores: PromptLogprobs | None
) -> list[tuple[int, TokenLogprobs | None]]:
    """A choice's prompt tokens with their log-probabilities (echo with logprobs)."""
    if pending.sampling[index].prompt_logprobs is None:
        return []
    if scores is None:  # the engine must have sent them with the first token
        raise APIError(500, "the engine returned no prompt logprobs", "generation_failed")
    ids = pending.prompts[index // pending.n]
    return list(zip(ids, scores, strict=True))


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
            choices=[chat_choice(run, i, o) for i, o in enumerate(outcomes)],
            usage=usage,
        )
    return Completion(
        id=f"cmpl-{pending.id}",
        created=pending.created,
        model=run.model,
        system_fingerprint=run.fingerprint,
        choices=[completion_choice(run, i, o) for i, o in enumerate(outcomes)],
        usage=usage,
    )


async def _outcome(pieces: AsyncIterator[Piece]) -> Outcome:
    text: list[str] = []
    logprobs: list[tuple[int, TokenLogprobs]] = []
    prompt: PromptLogprobs | None = None
    async for piece in pieces:
        text.append(piece.text)
        logprobs += piece.logprobs
        prompt = piece.prompt if piece.prompt is not None else prompt
        if piece.finish is not None:
            return Outcome("".join(text), piece.finish, piece.tokens, logprobs, prompt)
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


def _without_nulls(value: Any) -> Any:
    """A delta as OpenAI sends it: no null keys, at any depth (tool-call deltas)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


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
                choice["delta"] = _without_nulls(choice["delta"])
        return _sse(data)

    def choice(
        self,
        index: int,
        text: str | None,
        *,
        role: bool = False,
        finish: FinishReason | None = None,
        watermark: WatermarkInfo | None = None,
        logprobs: list[tuple[int, TokenLogprobs]] | None = None,
        offset: int = 0,
        tool_calls: list[ToolCallDelta] | None = None,
        prompt: Sequence[tuple[int, TokenLogprobs | None]] = (),
    ) -> bytes:
        tokenizer = self.run.samples[index].runtime.tokenizer
        if self.chat:
            delta = DeltaMessage(
                role="assistant" if role else None, content=text, tool_calls=tool_calls
            )
            chat_lp = None if logprobs is None else chat_logprobs(tokenizer, logprobs)
            chat = ChatChunkChoice(
                index=index, delta=delta, logprobs=chat_lp, finish_reason=finish,
                watermark=watermark,
            )  # fmt: skip
            return self._chunk([chat], None)
        plain_lp = (
            None if logprobs is None else completion_logprobs(tokenizer, logprobs, offset, prompt)
        )
        plain = CompletionChunkChoice(
            index=index, text=text or "", logprobs=plain_lp, finish_reason=finish,
            watermark=watermark,
        )  # fmt: skip
        return self._chunk([plain], None)

    def start(self, index: int) -> bytes | None:
        return self.choice(index, "", role=True) if self.chat else None

    def usage(self, usage: UsageInfo) -> bytes:
        return self._chunk([], usage)


def stream(
    run: Run, request: Request, engine: Engine, claim: gen.IdempotencyClaim | None
) -> StreamingResponse:
    """SSE: the role chunk, content deltas, each choice's finish chunk (with the
    watermark), the usage chunk when asked for, then ``data: [DONE]``.

    Tool calls stream as OpenAI's ``delta.tool_calls``: a named tool_choice sends the
    call's id and name first, then its arguments as they are generated; ``required``
    and ``auto`` send the parsed call (and any text beside it) when the choice ends.
    With ``logprobs`` each delta carries its tokens' entries; with ``echo`` a
    completion's first chunk starts with its prompt."""
    pending = run.pending
    body = pending.body
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = Chunks(run, include_usage)
    stops = body.stops()
    mode = pending.tool_mode
    wants_logprobs = [s.logprobs is not None for s in pending.sampling]
    scores_prompt = [s.prompt_logprobs is not None for s in pending.sampling]

    def opening(i: int) -> list[bytes]:
        out = []
        if (first := chunks.start(i)) is not None:
            out.append(first)
        if mode == "named":
            head = ToolCallDelta(
                index=0, id=call_id(pending, i), type="function",
                function=FunctionCallDelta(name=pending.tool_name, arguments=""),
            )  # fmt: skip
            out.append(chunks.choice(i, None, tool_calls=[head]))
        if pending.echo and not scores_prompt[i]:  # else with the prompt's logprobs, below
            out.append(chunks.choice(i, pending.echo[i // pending.n]))
        return out

    async def events() -> AsyncIterator[bytes]:
        texts = [""] * len(run.samples)
        entries: list[list[tuple[int, TokenLogprobs]]] = [[] for _ in run.samples]
        outcomes: list[Outcome | None] = [None] * len(run.samples)
        seen: list[PromptLogprobs | None] = [None] * len(run.samples)  # prompt logprobs
        offsets = [
            len(pending.echo[i // pending.n]) if pending.echo else 0
            for i in range(len(run.samples))
        ]
        try:
            for i in range(len(run.samples)):
                for chunk in opening(i):
                    yield chunk
            async for i, piece in _merge([follow(s, engine, stops) for s in run.samples]):
                if await request.is_disconnected():
                    return
                if piece.prompt is not None:
                    seen[i] = piece.prompt
                if scores_prompt[i] and piece.prompt is not None:  # echo: the first chunk
                    scored = prompt_entries(pending, i, piece.prompt)
                    echoed = pending.echo[i // pending.n]
                    yield chunks.choice(i, echoed, logprobs=[], prompt=scored)
                texts[i] += piece.text
                entries[i] += piece.logprobs
                lp = piece.logprobs if wants_logprobs[i] else None
                if mode == "named" and piece.text:
                    args = ToolCallDelta(index=0, function=FunctionCallDelta(arguments=piece.text))
                    yield chunks.choice(i, None, tool_calls=[args], logprobs=lp)
                elif mode is None and (piece.text or lp):
                    yield chunks.choice(i, piece.text, logprobs=lp, offset=offsets[i])
                    offsets[i] += len(piece.text)
                if piece.finish is None:
                    continue
                outcome = Outcome(texts[i], piece.finish, piece.tokens, entries[i], seen[i])
                outcomes[i] = outcome
                final = chat_choice(run, i, outcome) if pending.kind == "chat" else None
                if mode in ("required", "auto") and final is not None:
                    calls = [
                        ToolCallDelta(
                            index=k, id=c.id, type="function",
                            function=FunctionCallDelta(
                                name=c.function.name, arguments=c.function.arguments
                            ),
                        )
                        for k, c in enumerate(final.message.tool_calls or [])
                    ]  # fmt: skip
                    yield chunks.choice(
                        i, final.message.content, tool_calls=calls or None,
                        logprobs=entries[i] if wants_logprobs[i] else None,
                    )  # fmt: skip
                finish = final.finish_reason if final is not None else piece.finish
                info = choice_watermark(run, i)
                yield chunks.choice(i, None, finish=finish, watermark=info)
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
    infos = [choice_watermark(run, i) for i in range(len(run.samples))]
    headers = {**SSE_HEADERS, **receipt.headers(infos)}
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
                message = choice["message"]
                delta = {"role": "assistant", "content": message["content"]}
                if message.get("tool_calls"):
                    delta["tool_calls"] = [
                        {"index": k, **c} for k, c in enumerate(message["tool_calls"])
                    ]
                out = {"index": choice["index"], "delta": delta}
            else:
                out = {"index": choice["index"], "text": choice["text"]}
            last = {**out, "logprobs": choice.get("logprobs")}
            last["finish_reason"] = choice["finish_reason"]
            if choice.get("watermark") is not None:  # as streamed: no null receipt
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
