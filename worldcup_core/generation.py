"""Batched generation with a KV cache; every row has its own key, payload and sampling.

:class:`ContinuousBatch` is the engine: one forward pass per step serves every
active row, rows join between steps (their prompts are prefilled and their KV
cache is left-padded into the batch's) and leave when they finish or are
cancelled. After the forward pass each row goes through the sampling pipeline
(:func:`worldcup_core.pipeline.watermarked_distribution`: bans -> logit bias ->
temperature/top-k/top-p -> the watermark) and a draw from its own seeded
generator. Rows watermarked with scheme
``worldcup-v2`` share one batched step on the model's device
(:class:`~worldcup_core.batched.BatchedWorldCup`); other schemes (v1 keys, the
baselines) reweight row by row. :func:`generate` is the static special case:
everything joins at once, the batch runs dry.

Works on any device the model is on: the filtering, the v2 watermark and the
draw stay there; only the sampled ids (and, for per-row schemes, their
candidates) come back to the CPU.
"""

from __future__ import annotations

import inspect
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from worldcup_core.batched import BatchedWorldCup
from worldcup_core.config import SamplingConfig
from worldcup_core.message import Payload
from worldcup_core.pipeline import RowState, row_bans, watermarked_distribution
from worldcup_core.sampling import NGramBlocker, sample_rows
from worldcup_core.scheme import SequenceWatermark, WatermarkScheme

TokenCallback = Callable[[int, int], None]
FinishReason = Literal["eos", "length", "cancelled"]


class TokenConstraint(Protocol):
    """A structured-output constraint (a grammar matcher), one per row.

    An engine that samples itself (:class:`ContinuousBatch`) asks it for the allowed
    ids before each step (a bool tensor of the tokenizer's vocabulary, or None for no
    restriction) and tells it the token that was sampled. An engine with a grammar
    backend of its own (vLLM's structured outputs) is handed ``spec`` instead, what
    the output must match as the constraint's maker describes it, and also bans
    ``banned``: ids the constraint refuses in every state (``allowed`` leaves them out
    too, unless nothing else would be left). Implementations live outside this
    package (:mod:`app.engines.grammar` wraps xgrammar).
    """

    @property
    def spec(self) -> Any: ...

    @property
    def banned(self) -> tuple[int, ...]: ...

    def allowed(self) -> torch.Tensor | None: ...

    def accept(self, token: int) -> None: ...


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the ``top`` alternatives (id, logprob),
    under the distribution ``SamplingConfig.logprobs_mode`` names."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationRequest:
    """One row: prompt token ids, sampling, and optionally a scheme + payload."""

    prompt_ids: Sequence[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    scheme: WatermarkScheme | None = None
    payload: Payload | None = None
    constraint: TokenConstraint | None = None  # structured output (grammar), stateful

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if (self.scheme is None) != (self.payload is None):
            raise ValueError("scheme and payload go together: give both or neither")


@dataclass
class GenerationResult:
    token_ids: list[int]  # the response, without the closing EOS
    finish_reason: FinishReason
    prompt_tokens: int
    seconds: float


PromptLogprobs = tuple[TokenLogprobs | None, ...]  # one per prompt token, the first None


@dataclass(frozen=True)
class StepEvent:
    """One sampled token of one row; ``finish`` is set on the row's last event.

    A row's first event carries ``prompt_logprobs`` when its sampling asked for them."""

    row_id: int
    token: int
    finish: FinishReason | None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _Row:
    row_id: int
    request: GenerationRequest
    rng: np.random.Generator
    blocker: NGramBlocker
    watermark: SequenceWatermark | None  # a per-row scheme (v1 keys, baselines)
    next_position: int
    started: float
    tokens: list[int] = field(default_factory=list)
    slot: int | None = None  # the row's slot in the batched v2 step
    prompt_logprobs: PromptLogprobs | None = None  # handed out with the first event


class ContinuousBatch:
    """Rows join and leave between steps; one forward pass per step for all.

    Not thread-safe: one owner (a generation thread) calls ``add``, ``step``
    and ``cancel``.
    """

    def __init__(self, model: Any, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        self.model = model
        self._cache_arg = _cache_argument(model)
        self.eos = list(eos_token_ids)
        self.pad = pad_token_id
        self.device = next(model.parameters()).device
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # (B, T): 0 over left padding
        self._logits: torch.Tensor | None = None  # (B, V): next-token logits
        self._ids = itertools.count()
        self._batched = BatchedWorldCup(self.device)
        self._free_slots: list[int] = []
        self._next_slot = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def row_ids(self) -> list[int]:
        return [r.row_id for r in self._rows]

    @torch.inference_mode()
    def add(self, requests: Sequence[GenerationRequest]) -> list[int]:
        """Prefill ``requests`` and merge them into the running batch."""
        if not requests:
            return []
        now = time.perf_counter()
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(list(r.prompt_ids))
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        rows = [self._start_row(r, now) for r in requests]
        for i, (row, r) in enumerate(zip(rows, requests, strict=True)):
            if r.sampling.prompt_logprobs is not None:  # the prefill's logits, already here
                n = len(r.prompt_ids)
                row.prompt_logprobs = prompt_token_logprobs(
                    out.logits[i, width - n :], r.prompt_ids, r.sampling.prompt_logprobs
                )
        self._merge(_returned_cache(out), mask, out.logits[:, -1, :], rows)
        return [r.row_id for r in rows]

    def _start_row(self, request: GenerationRequest, now: float) -> _Row:
        s = request.sampling
        wm, slot = None, None
        if request.scheme is not None and request.payload is not None:
            if BatchedWorldCup.supports(request.scheme):
                slot = self._free_slots.pop() if self._free_slots else self._take_slot()
                self._batched.set_row(slot, request.scheme, request.payload)  # type: ignore[arg-type]
            else:
                wm = request.scheme.sequence(request.payload)
        return _Row(
            row_id=next(self._ids),
            request=request,
            rng=np.random.default_rng(s.seed),
            blocker=NGramBlocker(s.no_repeat_ngram_size, request.prompt_ids),
            watermark=wm,
            next_position=len(request.prompt_ids),
            started=now,
            slot=slot,
        )

    def _take_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def _release(self, rows: Sequence[_Row]) -> None:
        for row in rows:
            if row.slot is not None:
                self._batched.clear_row(row.slot)
                self._free_slots.append(row.slot)
                row.slot = None

    def _merge(
        self, cache: Any, mask: torch.Tensor, logits: torch.Tensor, rows: list[_Row]
    ) -> None:
        if self._cache is None or self._mask is None or self._logits is None:
            self._cache, self._mask, self._logits, self._rows = cache, mask, logits, rows
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self._mask = torch.cat([_left_pad(self._mask, width, dim=1), _left_pad(mask, width, dim=1)])
        self._logits = torch.cat([self._logits, logits])
        self._rows = self._rows + rows

    def cancel(self, row_ids: Sequence[int]) -> None:
        """Drop rows (client gone, timeout) before the next step."""
        drop = set(row_ids)
        self._keep([i for i, r in enumerate(self._rows) if r.row_id not in drop])

    def _keep(self, index: list[int]) -> None:
        if len(index) == len(self._rows):
            return
        kept = set(index)
        self._release([r for i, r in enumerate(self._rows) if i not in kept])
        if not index:
            self._rows, self._cache, self._mask, self._logits = [], None, None, None
            return
        assert self._cache is not None and self._mask is not None and self._logits is not None
        sel = torch.tensor(index, device=self.device)
        self._cache.batch_select_indices(sel)
        mask, logits = self._mask[sel], self._logits[sel]
        live = int(mask.any(dim=0).nonzero()[0])  # drop columns that are padding everywhere
        if live:
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, live:], layer.values[:, :, live:]
            mask = mask[:, live:]
        self._mask, self._logits = mask, logits
        self._rows = [self._rows[i] for i in index]

    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The sampling pipeline (:mod:`worldcup_core.pipeline`) and one draw per row,
        with each row's log-probabilities when it asked for them."""
        rows = self._rows
        states = [
            row_state(r.request, r.tokens, r.blocker, self.eos, r.watermark, r.slot) for r in rows
        ]
        cand, q = watermarked_distribution(logits, states, self._batched)
        tokens = sample_rows(cand, q, [r.rng.random() for r in rows])
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        for i, (r, tok) in enumerate(zip(rows, tokens, strict=True)):
            s = r.request.sampling
            if s.logprobs is not None:
                logprobs[i] = token_logprobs(
                    logits[i], cand[i], q[i], tok, s.logprobs, s.logprobs_mode
                )
        return tokens, logprobs

    def result(self, row_id: int, finish: FinishReason) -> GenerationResult:
        row = next(r for r in self._rows if r.row_id == row_id)
        return _result(row, finish)

    @torch.inference_mode()
    def step(self) -> tuple[list[StepEvent], list[GenerationResult]]:
        """Sample one token for every row, retire finished rows, run the forward pass.

        Returns the step's events and the results of rows that finished.
        """
        if not self._rows or self._logits is None or self._mask is None:
            return [], []
        tokens, logprobs = self._sample(self._logits)
        events: list[StepEvent] = []
        finished: list[GenerationResult] = []
        keep: list[int] = []
        batched = [
            (r.slot, t) for r, t in zip(self._rows, tokens, strict=True) if r.slot is not None
        ]
        if batched:
            self._batched.append([s for s, _ in batched], torch.tensor([t for _, t in batched]))
        for i, (row, tok) in enumerate(zip(self._rows, tokens, strict=True)):
            row.tokens.append(tok)
            row.blocker.push(tok)
            if row.request.constraint is not None:
                row.request.constraint.accept(tok)
            if row.watermark is not None:
                row.watermark.observe(tok)
            finish: FinishReason | None = None
            if tok in self.eos:
                finish = "eos"
            elif len(row.tokens) >= row.request.sampling.max_new_tokens:
                finish = "length"
            prompt, row.prompt_logprobs = row.prompt_logprobs, None
            events.append(StepEvent(row.row_id, tok, finish, logprobs[i], prompt))
            if finish is None:
                keep.append(i)
            else:
                finished.append(_result(row, finish))
        self._keep(keep)
        if self._rows:
            assert self._mask is not None
            feed = torch.tensor([[r.tokens[-1]] for r in self._rows], device=self.device)
            positions = torch.tensor([[r.next_position] for r in self._rows], device=self.device)
            self._mask = torch.cat([self._mask, torch.ones_like(feed)], dim=1)
            out = self.model(
                input_ids=feed,
                attention_mask=self._mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: self._cache},
            )
            self._cache, self._logits = _returned_cache(out), out.logits[:, -1, :]
            for r in self._rows:
                r.next_position += 1
        return events, finished


def row_state(
    request: GenerationRequest,
    output: Sequence[int],
    blocker: NGramBlocker,
    eos: Sequence[int],
    watermark: SequenceWatermark | None,
    slot: int | None,
) -> RowState:
    """A row's :class:`~worldcup_core.pipeline.RowState` for this step."""
    s = request.sampling
    return RowState(
        banned=row_bans(blocker, len(output), s.min_new_tokens, eos),
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        watermark=watermark,
        slot=slot,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=s.logit_bias,
        prompt=request.prompt_ids if s.repetition_penalty != 1.0 else (),
        output=output,
        allowed=None if request.constraint is None else request.constraint.allowed(),
    )


def token_logprobs(
    logits: torch.Tensor, cand: torch.Tensor, q: torch.Tensor, token: int, top: int, mode: str
) -> TokenLogprobs:
    """``token``'s log-probability and the ``top`` most likely ids, under ``mode``:
    ``"sampled"``, the watermarked q it was drawn from (``cand``/``q``, 0 elsewhere,
    so ``-inf``); ``"model"``, the log-softmax of the model's raw ``logits``."""
    if mode == "model":
        logp = torch.log_softmax(logits.double(), dim=-1)
        values, ids = torch.topk(logp, top) if top else (logp[:0], cand[:0])
        return TokenLogprobs(
            float(logp[token]),
            tuple((int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist(), strict=True)),
        )
    support = q > 0
    ids_c, q_c = cand[support], q[support].double()
    hit = (ids_c == token).nonzero()
    value = float(q_c[int(hit[0])].log()) if len(hit) else -math.inf
    order = torch.argsort(q_c, descending=True)[:top]
    return TokenLogprobs(
        value,
        tuple((int(ids_c[j]), float(q_c[j].log())) for j in order.tolist()),
    )


def prompt_token_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], top: int
) -> PromptLogprobs:
    """The model's log-probability of each prompt token given the ones before it, with
    the ``top`` most likely ids there; ``logits`` (T, V) are the prefill's, position j
    predicting token j + 1. The first token has no context: None (as OpenAI)."""
    entries: list[TokenLogprobs | None] = [None]
    ids = torch.tensor(list(prompt_ids[1:]), device=logits.device, dtype=torch.long)
    for start in range(0, len(ids), PROMPT_LOGPROBS_CHUNK):  # a long prompt: bounded memory
        stop = start + PROMPT_LOGPROBS_CHUNK
        logp = torch.log_softmax(logits[start:stop].double(), dim=-1)
        chosen = logp.gather(1, ids[start:stop].unsqueeze(1)).squeeze(1).tolist()
        values, best = torch.topk(logp, top, dim=-1) if top else (logp[:, :0], logp[:, :0])
        for j, value in enumerate(chosen):
            pairs = zip(best[j].tolist(), values[j].tolist(), strict=True)
            entries.append(TokenLogprobs(float(value), tuple((int(t), float(v)) for t, v in pairs)))
    return tuple(entries)


PROMPT_LOGPROBS_CHUNK = 128  # prompt positions per log-softmax (x vocabulary, in float64)


def _left_pad(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _result(row: _Row, finish: FinishReason) -> GenerationResult:
    return GenerationResult(
        token_ids=row.tokens[:-1] if finish == "eos" else list(row.tokens),
        finish_reason=finish,
        prompt_tokens=len(row.request.prompt_ids),
        seconds=time.perf_counter() - row.started,
    )


def generate(
    model: Any,
    requests: Sequence[GenerationRequest],
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    on_token: TokenCallback | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[GenerationResult]:
    """Generate all ``requests`` as one batch; ``on_token(index, token)`` streams.

    ``should_stop`` is polled once per step; when it returns True every
    unfinished row ends with finish reason ``cancelled``.
    """
    batch = ContinuousBatch(model, eos_token_ids, pad_token_id)
    index = {row_id: i for i, row_id in enumerate(batch.add(requests))}
    results: dict[int, GenerationResult] = {}
    while len(batch):
        events, finished = batch.step()
        if on_token is not None:
            for ev in events:
                on_token(index[ev.row_id], ev.token)
        for ev, res in zip([e for e in events if e.finish], finished, strict=True):
            results[index[ev.row_id]] = res
        if should_stop is not None and should_stop() and len(batch):
            for row_id in batch.row_ids:
                results[index[row_id]] = batch.result(row_id, "cancelled")
            batch.cancel(batch.row_ids)
    return [results[i] for i in range(len(requests))]


def _cache_argument(model: Any) -> str:
    """The forward argument that takes the KV cache: transformers renamed
    ``past_key_values`` to ``cache`` in 5.2x, keeping the old name, deprecated, until 5.40."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # not introspectable: the name every 5.x accepts
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out: Any) -> Any:
    """The KV cache a forward returned, under either name (see :func:`_cache_argument`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
