"""``POST /v1/completions``: plain prompts (several per request), ``echo``, the legacy
logprobs, and the completion's response and stream shapes, over the shared run core.

``max_tokens`` 0 with ``echo`` and ``logprobs`` scores the prompt and generates
nothing (the engine runs one unwatermarked token for the prompt's forward pass,
and it is dropped)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.core.errors import APIError
from app.schemas.openai.common import FinishReason, UsageInfo, WatermarkInfo
from app.schemas.openai.completions import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
)
from app.services.openai import run as core
from app.services.openai.constraints import format_specs, one_constraint
from app.services.openai.logprobs import Entries, completion_logprobs
from app.services.openai.run import Outcome, Pending, Piece, Run
from app.services.openai.serve import Dialect
from app.services.openai.stream import Chunks
from app.services.runtime import Runtime
from worldcup_core.generation import PromptLogprobs, TokenLogprobs

PREFIX = "cmpl"  # of a completion's id


async def plan(runtime: Runtime, body: CompletionRequest) -> Pending:
    """Check the model and the limits, tokenise; 400 naming the field otherwise."""
    max_tokens = core.requested_tokens(runtime, body, "max_tokens")
    # max_tokens 0: score the prompt, generate nothing; the engine runs one
    # unwatermarked token for the prompt's forward pass, and it is dropped
    scored = max_tokens == 0
    if scored and not (body.echo and body.logprobs is not None):
        raise APIError(
            400, "max_tokens 0 scores the prompt without generating: it needs echo and logprobs",
            "invalid_request", param="max_tokens",
        )  # fmt: skip
    # min_tokens above the maximum is capped at it, as /generate caps min_new_tokens:
    # a cross-field rule JSON Schema cannot state is not a refusal
    structure = one_constraint(format_specs(body))
    prompts = [await core.tokenise(runtime, p, None, "prompt") for p in body.prompts()]
    # echo with logprobs: the prompt's tokens too, under the model's own distribution
    top = body.logprobs
    prompt_top = top if body.echo else None
    max_new = 1 if scored else core.new_tokens(runtime, max_tokens)
    echo = body.prompts() if body.echo else []
    return await core.plan(
        runtime, "completion", body, prompts, structure, max_new, top, prompt_top, echo, scored
    )


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


def _echoed(pending: Pending, index: int) -> str:
    return pending.echo[index // pending.n] if pending.echo else ""


def completion_choice(run: Run, index: int, outcome: Outcome) -> CompletionChoice:
    tokenizer = run.samples[index].runtime.tokenizer
    pending = run.pending
    prefix = _echoed(pending, index)
    logprobs = None
    if pending.sampling[index].logprobs is not None:
        scored = prompt_entries(pending, index, outcome.prompt)
        logprobs = completion_logprobs(tokenizer, outcome.logprobs, len(prefix), scored)
    return CompletionChoice(
        index=index,
        text=prefix + outcome.text,
        logprobs=logprobs,
        finish_reason=outcome.finish,
        watermark=core.choice_watermark(run, index),
    )


def response(run: Run, outcomes: list[Outcome]) -> Completion:
    return Completion(
        **core.head(run, PREFIX),
        choices=[completion_choice(run, i, o) for i, o in enumerate(outcomes)],
        usage=core.usage(run, outcomes),
    )


class CompletionChunks(Chunks):
    """Completions' chunks: text deltas, each with its tokens' logprobs when asked for;
    with ``echo`` a choice's first chunk starts with its prompt (scored, with logprobs)."""

    prefix = PREFIX

    def __init__(self, run: Run, include_usage: bool) -> None:
        super().__init__(run, include_usage)
        pending = run.pending
        # where each choice's next text starts in its whole text (logprobs' text_offset)
        self.offsets = [len(_echoed(pending, i)) for i in range(len(run.samples))]

    def chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> CompletionChunk:
        return CompletionChunk(**self.head, choices=choices, usage=usage)

    def choice(
        self,
        index: int,
        text: str | None,
        *,
        finish: FinishReason | None = None,
        watermark: WatermarkInfo | None = None,
        logprobs: Entries | None = None,
        offset: int = 0,
        prompt: Sequence[tuple[int, TokenLogprobs | None]] = (),
    ) -> bytes:
        tokenizer = self.run.samples[index].runtime.tokenizer
        plain_lp = (
            None if logprobs is None else completion_logprobs(tokenizer, logprobs, offset, prompt)
        )
        plain = CompletionChunkChoice(
            index=index, text=text or "", logprobs=plain_lp, finish_reason=finish,
            watermark=watermark,
        )  # fmt: skip
        return self.emit([plain])

    def _scores_prompt(self, index: int) -> bool:
        return self.run.pending.sampling[index].prompt_logprobs is not None

    def opening(self, index: int) -> list[bytes]:
        if self.run.pending.echo and not self._scores_prompt(index):
            return [self.choice(index, _echoed(self.run.pending, index))]
        return []  # else with the prompt's logprobs, on the first piece

    def piece(self, index: int, piece: Piece) -> list[bytes]:
        pending, out = self.run.pending, []
        if self._scores_prompt(index) and piece.prompt is not None:  # echo: the first chunk
            scored = prompt_entries(pending, index, piece.prompt)
            out.append(self.choice(index, _echoed(pending, index), logprobs=[], prompt=scored))
        lp = piece.logprobs if pending.sampling[index].logprobs is not None else None
        if piece.text or lp:
            out.append(self.choice(index, piece.text, logprobs=lp, offset=self.offsets[index]))
            self.offsets[index] += len(piece.text)
        return out

    def closing(self, index: int, outcome: Outcome) -> list[bytes]:
        watermark = core.choice_watermark(self.run, index)
        return [self.choice(index, None, finish=outcome.finish, watermark=watermark)]


COMPLETIONS = Dialect(response, CompletionChunks, "text_completion", lambda c: {"text": c["text"]})
