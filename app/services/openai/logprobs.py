"""Log-probabilities in OpenAI's two shapes: chat's ``logprobs.content`` and
completions' legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

The engine reports each sampled token's entry (:class:`~worldcup_core.generation.
TokenLogprobs`) under the distribution ``logprobs_mode`` names; here they become text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.schemas.openai.chat import ChoiceLogprobs, TokenLogprob, TopLogprob
from app.schemas.openai.completions import CompletionLogprobs
from worldcup_core.generation import TokenLogprobs

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token off the support reports this (as vLLM)
Entries = list[tuple[int, TokenLogprobs]]  # (token id, its entry), in order


def _token_text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False))


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(tokenizer: Any, entries: Entries) -> ChoiceLogprobs:
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


def before_cut(tokenizer: Any, every: Entries, cut: int, start: int) -> Entries:
    """The entries of ``every[start:]`` whose token starts before character ``cut`` (a
    stop string's): the ones whose text is kept."""
    kept = []
    for j in range(start, len(every)):
        before = tokenizer.decode([t for t, _ in every[:j]], skip_special_tokens=True)
        if len(before) >= cut:
            break
        kept.append(every[j])
    return kept
