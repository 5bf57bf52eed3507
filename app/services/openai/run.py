"""The run core every OpenAI API shares: plan a request (limits, constraint, sampling),
start its choices (a registry entry and an engine job each), and follow each choice as
text pieces cut at its stop strings.

An API (:mod:`.chat`, :mod:`.completions`) tokenises its own prompts and shapes its
own responses; everything between is here, the same for both.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request

from app.core.errors import APIError
from app.engines.base import Engine
from app.engines.grammar import GrammarConstraint, compile_spec
from app.schemas.generation import DEFAULT_NO_REPEAT_NGRAM
from app.schemas.openai.chat import ChatCompletionRequest
from app.schemas.openai.common import MAX_CHOICES, FinishReason, UsageInfo, WatermarkInfo
from app.schemas.openai.completions import CompletionRequest
from app.services import generation as gen
from app.services.disclosure import reveals_generated
from app.services.openai.constraints import Structure, bad
from app.services.openai.logprobs import Entries, before_cut
from app.services.openai.models import check_model, fingerprint, model_name
from app.services.runtime import Runtime
from worldcup_core import Payload, SamplingConfig
from worldcup_core.config import MIN_TEMPERATURE
from worldcup_core.generation import GenerationResult, PromptLogprobs

DEFAULT_MAX_TOKENS = 256  # capped by WORLDCUP_MAX_NEW_TOKENS_LIMIT
DEFAULT_TOP_K = 50  # as /generate; watermark.top_k overrides (0 disables)


# --------------------------------------------------------------------------- planning
@dataclass
class Pending:
    """The validated plan of one OpenAI request, before anything is allocated."""

    kind: Literal["chat", "completion"]
    body: ChatCompletionRequest | CompletionRequest
    prompts: list[list[int]]
    sampling: list[SamplingConfig]  # one per choice
    structure: Structure = field(default_factory=Structure)
    compiled: Any = None  # the grammar, compiled for the served tokenizer
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

    def body_hash(self) -> str:
        return gen.body_hash({"openai": self.kind, **self.body.model_dump(mode="json")})


def requested_tokens(
    runtime: Runtime, body: ChatCompletionRequest | CompletionRequest, param: str
) -> int | None:
    """Check the model and the token limit (400 naming ``param``); the request's maximum."""
    check_model(runtime, body.model)
    limit = runtime.settings.max_new_tokens_limit
    max_tokens = body.new_tokens
    if max_tokens is not None and max_tokens > limit:
        raise APIError(400, f"{param} may be at most {limit}", "max_tokens_too_large", param=param)
    return max_tokens


def new_tokens(runtime: Runtime, max_tokens: int | None) -> int:
    return min(max_tokens or DEFAULT_MAX_TOKENS, runtime.settings.max_new_tokens_limit)


async def tokenise(
    runtime: Runtime, prompt: str | None, messages: list[dict[str, str]] | None, param: str
) -> list[int]:
    """Off the event loop, in the CPU pool, as /generate does."""
    try:
        return await runtime.offload(lambda: gen.prompt_ids(runtime, prompt, messages))
    except APIError as exc:
        exc.param = param
        raise


async def plan(
    runtime: Runtime,
    kind: Literal["chat", "completion"],
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    structure: Structure,
    max_new: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    echo: list[str] | None = None,
    scored: bool = False,
) -> Pending:
    """The plan of a request whose prompts are tokenised: the number of choices, the
    grammar compiled (a 400 if invalid), one sampling configuration per choice."""
    n = body.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad(
            "n", f"n times the number of prompts may be at most {MAX_CHOICES}", "too_many_choices"
        )
    spec, compiled = structure.spec, None
    if spec is not None:
        compiled = await runtime.offload(lambda: compile_spec(runtime.tokenizer, spec))
    sampling = sampling_configs(
        runtime, body, max_new, len(prompts) * n, spec is not None, logprobs, prompt_logprobs
    )
    return Pending(kind, body, prompts, sampling, structure, compiled, echo or [], scored)


def sampling_configs(
    runtime: Runtime,
    body: ChatCompletionRequest | CompletionRequest,
    max_new: int,
    choices: int,
    constrained: bool,
    top: int | None,
    prompt_top: int | None,
) -> list[SamplingConfig]:
    """One :class:`SamplingConfig` per choice: every sampling field applied, or a 400.
    ``top``: the alternatives each token's logprobs report (None: no logprobs);
    ``prompt_top``: the same for the prompt's tokens (completions' echo)."""
    wm = body.watermark
    temperature = 1.0 if body.temperature is None else max(body.temperature, MIN_TEMPERATURE)
    top_k = DEFAULT_TOP_K if wm is None or wm.top_k is None else wm.top_k
    if body.top_k is not None:
        if wm is not None and wm.top_k is not None and max(body.top_k, 0) != wm.top_k:
            raise bad(
                "top_k",
                "top_k and watermark.top_k disagree; give one of them",
                "conflicting_fields",
            )
        top_k = max(body.top_k, 0)  # vLLM's -1 disables, as 0
    vocab = len(runtime.tokenizer)
    bias: list[tuple[int, float]] = []
    for token, value in (body.logit_bias or {}).items():
        if int(token) >= vocab:
            raise bad(
                "logit_bias", f"logit_bias: token id {token} is not in the vocabulary",
                "token_not_in_vocabulary",
            )  # fmt: skip
        bias.append((int(token), float(value)))
    # vLLM's logprobs mode is engine-wide (WORLDCUP_VLLM_LOGPROBS_MODE); hf offers both
    fixed = None if runtime.engine is None else runtime.engine.logprobs_mode
    mode = body.logprobs_mode or fixed or "sampled"
    if top is not None and fixed is not None and mode != fixed:
        raise bad(
            "logprobs_mode",
            f"logprobs_mode '{mode}' is not served here: the vllm engine reports one mode "
            f"for every request, '{fixed}' (the setting WORLDCUP_VLLM_LOGPROBS_MODE)",
            "logprobs_mode_unavailable",
        )
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
            max_new_tokens=max_new,
            min_new_tokens=min(body.min_tokens or 0, max_new),
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


# --------------------------------------------------------------------------- running
@dataclass
class Run:
    pending: Pending
    samples: list[gen.Sample]
    model: str
    fingerprint: str


async def start(
    runtime: Runtime,
    engine: Engine,
    tenant_id: str,
    pending: Pending,
    scopes: frozenset[str] = frozenset(),
) -> Run:
    """Allocate (one registry entry per choice) and submit every choice to the engine;
    a client-chosen payload needs the asking key's ``fixed_payload`` scope."""
    body = pending.body
    key = await runtime.tenants.version(tenant_id, None)
    wm = body.watermark
    fixed: Payload | None = None
    if wm is not None and wm.payload is not None and not pending.scored:
        p = wm.payload
        spelled = (p.bits, p.hex, p.integer, p.num_bits)
        fixed = await gen.fixed_payload(runtime, scopes, tenant_id, key, spelled, pending.choices)
    if wm is not None and wm.metadata is not None:
        metadata: dict[str, Any] = wm.metadata
    else:
        metadata = {"user": body.user} if body.user is not None else {}
    spec = pending.structure.spec
    reveal = reveals_generated(scopes)
    samples: list[gen.Sample] = []
    try:
        for i, sampling in enumerate(pending.sampling):
            prompt = pending.prompts[i // pending.n]
            if pending.scored:  # nothing generated is kept: no watermark, no registry entry
                samples.append(
                    gen.submit(runtime, engine, tenant_id, key, prompt, sampling, None, None)
                )
                continue
            if fixed is not None:  # sealed: each choice its own entry
                payload, message_id = await gen.allocate_sealed(runtime, tenant_id, key, fixed)
            else:
                payload, message_id = await gen.allocate(
                    runtime, tenant_id, key, metadata, None if wm is None else wm.num_bits
                )
            # each choice its own matcher state
            constraint = None if spec is None else GrammarConstraint(spec, pending.compiled)
            samples.append(
                gen.submit(
                    runtime, engine, tenant_id, key, prompt, sampling, payload, message_id,
                    constraint, reveal_payload=reveal, chosen=fixed,
                )
            )  # fmt: skip
    except BaseException:
        for sample in samples:
            engine.cancel(sample.job)
        raise
    return Run(pending, samples, model_name(runtime), fingerprint(runtime))


def head(run: Run, prefix: str) -> dict[str, Any]:
    """What a run's response and each of its chunks start with; ``prefix`` is the API's
    (``chatcmpl``, ``cmpl``)."""
    return {
        "id": f"{prefix}-{run.pending.id}",
        "created": run.pending.created,
        "model": run.model,
        "system_fingerprint": run.fingerprint,
    }


def usage(run: Run, outcomes: list[Outcome]) -> UsageInfo:
    prompt = sum(len(p) for p in run.pending.prompts)
    completion = sum(o.tokens for o in outcomes)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def watermark_info(sample: gen.Sample) -> WatermarkInfo:
    assert sample.payload is not None
    shown = sample.shown_payload()
    return WatermarkInfo(
        message_id=sample.message_id,
        key_version=sample.key.version,
        scheme=sample.key.scheme.version,
        num_bits=sample.payload.num_bits,
        payload_hex=format(shown.to_int(), "x") if shown is not None else None,
        payload_bits=shown.bits if shown is not None else None,
        client_payload=sample.chosen is not None,
    )


def choice_watermark(run: Run, index: int) -> WatermarkInfo | None:
    """A choice's receipt; None when nothing was generated (max_tokens 0)."""
    return None if run.pending.scored else watermark_info(run.samples[index])


# --------------------------------------------------------------------------- following
@dataclass
class Piece:
    """New text of one choice; ``finish`` is set on its last piece."""

    text: str
    finish: FinishReason | None = None
    tokens: int = 0
    logprobs: Entries = field(default_factory=list)  # this piece's
    prompt: PromptLogprobs | None = None  # echo with logprobs: on the choice's first piece


@dataclass
class Outcome:
    """One choice, whole."""

    text: str
    finish: FinishReason
    tokens: int
    logprobs: Entries = field(default_factory=list)
    prompt: PromptLogprobs | None = None  # echo with logprobs: the prompt's entries


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
    logprobs: Entries = []  # not yet handed out
    every: Entries = []
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
                    logprobs = before_cut(tokenizer, every, cut, len(every) - len(logprobs))
                await gen.record_issued(sample, text)  # the choice's whole text
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
                await gen.record_issued(sample, text[:cut])
                kept = before_cut(tokenizer, every, cut, len(every) - len(logprobs))
                yield Piece(text[shown:cut], "stop", len(deltas.tokens), kept, prompt)
                return
            safe = len(text) - _held(text, stops)
            if safe > shown or prompt is not None:
                yield Piece(text[shown:safe], logprobs=logprobs, prompt=prompt)
                logprobs, prompt = [], None
                shown = max(shown, safe)
    except TimeoutError:
        raise gen.timed_out(sample, engine) from None


async def _outcome(pieces: AsyncIterator[Piece]) -> Outcome:
    text: list[str] = []
    logprobs: Entries = []
    prompt: PromptLogprobs | None = None
    async for piece in pieces:
        text.append(piece.text)
        logprobs += piece.logprobs
        prompt = piece.prompt if piece.prompt is not None else prompt
        if piece.finish is not None:
            return Outcome("".join(text), piece.finish, piece.tokens, logprobs, prompt)
    raise AssertionError("a choice ended without a finish reason")


async def outcomes(run: Run, request: Request, engine: Engine) -> list[Outcome]:
    """Every choice to its end; a client that goes away cancels them all."""
    stops = run.pending.body.stops()
    jobs = [s.job for s in run.samples]
    watcher = asyncio.create_task(gen.watch_disconnect(request, engine, jobs))
    tasks = [asyncio.create_task(_outcome(follow(s, engine, stops))) for s in run.samples]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        watcher.cancel()
        for task in tasks:  # one choice failed: the others have nobody to answer
            task.cancel()
        for job in jobs:
            if not job.done:
                engine.cancel(job)
    return list(done)
