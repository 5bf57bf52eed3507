"""Batched generation with a KV cache; every row has its own key, payload and sampling.

One forward pass per step serves the whole batch (left-padded prompts,
explicit position ids). After the forward pass each row goes through
bans -> temperature/top-k/top-p (:mod:`worldcup_core.sampling`) -> its scheme's
``reweight`` -> a draw from its own seeded generator. Finished rows keep
feeding their pad token until the batch is done; nothing they produce after
finishing is recorded. Works on any device the model is on: only the top-k
slice of each row (and the full row for logit-biasing baselines) comes back
to the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from worldcup_core.config import SamplingConfig
from worldcup_core.message import Payload
from worldcup_core.sampling import NGramBlocker, filter_logits
from worldcup_core.scheme import SequenceWatermark, WatermarkScheme

TokenCallback = Callable[[int, int], None]


@dataclass
class GenerationRequest:
    """One row: prompt token ids, sampling, and optionally a scheme + payload."""

    prompt_ids: Sequence[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    scheme: WatermarkScheme | None = None
    payload: Payload | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if (self.scheme is None) != (self.payload is None):
            raise ValueError("scheme and payload go together: give both or neither")


@dataclass
class GenerationResult:
    token_ids: list[int]  # the response, without the closing EOS
    finish_reason: Literal["eos", "length"]
    prompt_tokens: int
    seconds: float


@dataclass
class _Row:
    request: GenerationRequest
    rng: np.random.Generator
    blocker: NGramBlocker
    watermark: SequenceWatermark | None
    tokens: list[int] = field(default_factory=list)
    finish: Literal["eos", "length"] | None = None


def _start_row(request: GenerationRequest) -> _Row:
    s = request.sampling
    wm = None
    if request.scheme is not None and request.payload is not None:
        wm = request.scheme.sequence(request.payload)
    return _Row(
        request=request,
        rng=np.random.default_rng(s.seed),
        blocker=NGramBlocker(s.no_repeat_ngram_size, request.prompt_ids),
        watermark=wm,
    )


@torch.inference_mode()
def generate(
    model: Any,
    requests: Sequence[GenerationRequest],
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    on_token: TokenCallback | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[GenerationResult]:
    """Generate all ``requests`` as one batch; ``on_token(row, token)`` streams.

    ``should_stop`` is polled once per step; when it returns True every
    unfinished row ends with finish reason ``length``.
    """
    if not requests:
        return []
    start = time.perf_counter()
    rows = [_start_row(r) for r in requests]
    device = next(model.parameters()).device
    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(requests):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(list(r.prompt_ids), dtype=torch.long)
        mask[i, width - len(r.prompt_ids) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    eos = list(eos_token_ids)
    max_steps = max(r.sampling.max_new_tokens for r in requests)
    for step in range(max_steps):
        next_tokens = _sample_step(rows, out.logits[:, -1, :], eos, step)
        for i, row in enumerate(rows):
            if row.finish is not None:
                continue
            tok = next_tokens[i]
            row.tokens.append(tok)
            row.blocker.push(tok)
            if row.watermark is not None:
                row.watermark.observe(tok)
            if on_token is not None:
                on_token(i, tok)
            if tok in eos:
                row.finish = "eos"
            elif len(row.tokens) >= row.request.sampling.max_new_tokens:
                row.finish = "length"
        if should_stop is not None and should_stop():
            for row in rows:
                row.finish = row.finish or "length"
        if all(row.finish is not None for row in rows):
            break
        feed = torch.tensor(
            [pad_token_id if r.finish else r.tokens[-1] for r in rows], device=device
        )[:, None]
        mask = torch.cat([mask, torch.ones_like(feed)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=feed,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    elapsed = time.perf_counter() - start
    return [
        GenerationResult(
            token_ids=row.tokens[:-1] if row.finish == "eos" else list(row.tokens),
            finish_reason=row.finish or "length",
            prompt_tokens=len(row.request.prompt_ids),
            seconds=elapsed,
        )
        for row in rows
    ]


def _sample_step(rows: list[_Row], logits: torch.Tensor, eos: list[int], step: int) -> list[int]:
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.finish is not None:
            continue
        banned = row.blocker.banned()
        if step < row.request.sampling.min_new_tokens:
            banned = banned | set(eos)
        if banned:
            logits[i, list(banned)] = -torch.inf
        wm = row.watermark
        if wm is not None and wm.modifies_logits:
            biased = wm.process_logits(logits[i].double().cpu().numpy())
            logits[i] = torch.from_numpy(biased).to(logits.device, logits.dtype)
    samplings = [r.request.sampling for r in rows]
    cand, probs = filter_logits(
        logits,
        [s.temperature for s in samplings],
        [s.top_k for s in samplings],
        [s.top_p for s in samplings],
    )
    chosen: list[int] = []
    for i, row in enumerate(rows):
        if row.finish is not None:
            chosen.append(-1)
            continue
        live = int(np.count_nonzero(probs[i]))
        c, p = cand[i, :live], probs[i, :live]
        if row.watermark is not None:
            p = row.watermark.reweight(c, p)
        chosen.append(int(c[row.rng.choice(live, p=p)]))
    return chosen
