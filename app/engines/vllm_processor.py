"""WorldCup as a vLLM v1 batch-level logits processor (it runs in vLLM's engine core).

**Ordering.** vLLM applies temperature, top-k and top-p *after* the logits
processors, and anything that reshapes the distribution after the watermark
weakens or breaks it. So this processor runs the same sampling pipeline as the
``hf`` engine (:func:`worldcup_core.pipeline.watermarked_distribution`):

0. (vLLM) a structured-output request's grammar bitmask: vLLM's own backend
   (xgrammar) applies it to the logits before any logits processor runs, so the
   watermark below only ever chooses among the grammar's tokens; for a JSON spec
   the processor then bans the tokens with a raw control character (xgrammar's
   JSON grammar lets them into strings; ``RowSpec.banned``), as the ``hf``
   engine's grammar mask does, unless nothing else would be left;
1. the request's repetition/presence/frequency penalties and ``logit_bias``;
   bans: n-grams that would repeat (``no_repeat_ngram_size``) and, before
   ``min_new_tokens``, the EOS ids (lifted for a step where they would leave the
   grammar nothing); then any scheme's full-vocabulary logit bias;
2. the request's temperature, min-p, top-k and top-p
   (:func:`worldcup_core.sampling.filter_logits_torch`);
3. the watermark: scheme ``worldcup-v2`` rows share one batched step on the
   device (:class:`worldcup_core.batched.BatchedWorldCup`, slots = vLLM's
   persistent-batch indices, moved and swapped with them); other schemes (v1
   keys) reweight row by row;

and returns ``log q`` on the candidates, ``-inf`` elsewhere. The engine sends
these requests to vLLM with temperature 1, top-k and top-p off, min_p 0 and
no penalties or logit bias (vLLM applies its own penalties *after* the logits
processors, which would reshape q), so vLLM's softmax and draw sample exactly q.

Rows whose ``SamplingParams.extra_args`` carry no WorldCup handle are left
untouched. The handle is opaque; the key material comes over a private
channel (:mod:`app.engines.vllm_keys`). Needs the v1 model runner
(``VLLM_USE_V2_MODEL_RUNNER=0``), which the engine sets.

**Slots.** The batched step's tables are sized from vLLM's ``max_num_seqs``
(the persistent batch's size) and grow on any add, move or swap beyond them.

**The context must be current.** Each step watermarks on the row's tokens so
far, read from vLLM's live output list. Under async scheduling vLLM appends
``-1`` placeholders there and repairs them just before the sampler, only when
it thinks a processor needs the ids (vLLM issue 52461). The engine turns async
scheduling off (:func:`app.engines.vllm.engine_args`), so placeholders never
reach this processor; should one reach it anyway, the row's context is not
known and it is never watermarked on a stale one: the row loses its watermark
from that step on (it is sampled from the filtered distribution), and the
processor reports it over the key channel, so the engine counts it and fails
that request instead of returning an unwatermarked text as watermarked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from app.engines.vllm_keys import EOS_ARGS_KEY, EXTRA_ARGS_KEY, KeyClient, RowSpec
from worldcup_core.batched import BatchedWorldCup, warm_up
from worldcup_core.pipeline import RowState, row_bans, watermarked_distribution
from worldcup_core.sampling import NGramBlocker
from worldcup_core.scheme import SequenceWatermark

logger = logging.getLogger("worldcup.engine.vllm")


PLACEHOLDER = -1  # async scheduling's not-yet-known token id in vLLM's output lists


@dataclass
class _Row:
    handle: str
    spec: RowSpec | None  # None: the handle was unknown (fail closed: EOS only)
    output: list[int]  # vLLM's live reference to the request's generated tokens
    blocker: NGramBlocker
    watermark: SequenceWatermark | None  # per-row scheme (v1 keys)
    batched: bool  # the row has a slot in the batched v2 step
    eos: list[int] = field(default_factory=list)  # forced when ``spec`` is None
    seen: int = 0  # tokens of ``output`` already recorded
    pending: list[int] = field(default_factory=list)
    stale: bool = False  # a placeholder reached a step: watermark dropped, reported
    prompt: list[int] = field(default_factory=list)  # for the repetition penalty
    banned: torch.Tensor | None = None  # RowSpec.banned, as a tensor (JSON specs)


class WorldCupLogitsProcessor(LogitsProcessor):  # type: ignore[misc]
    """Per-row filtering and the WorldCup step for the rows that carry a handle."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        # one slot per persistent-batch index; grown on any index beyond (swap_rows too)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        capacity = int(getattr(scheduler, "max_num_seqs", None) or 64)
        self._batched = BatchedWorldCup(self.device, capacity=capacity)
        warm_up(self.device)  # compiled CPU loops now, while vLLM loads, not on a request
        self._rows: dict[int, _Row] = {}
        self._keys = KeyClient()

    def __repr__(self) -> str:
        return f"WorldCupLogitsProcessor({len(self._rows)} rows on {self.device})"

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        handle = (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if handle is not None and not (isinstance(handle, str) and handle.isalnum()):
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be an alphanumeric handle")

    def is_argmax_invariant(self) -> bool:
        return False  # it bans, filters and reweights

    # ------------------------------------------------------------------ batch state
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._drop(index)
        for index, params, prompt_ids, output_ids in batch_update.added:
            self._drop(index)
            handle = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
            if handle is not None:
                eos = [int(t) for t in (params.extra_args or {}).get(EOS_ARGS_KEY, [])]
                self._add(index, str(handle), prompt_ids or [], output_ids, eos)
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                ra, rb = self._rows.pop(a, None), self._rows.pop(b, None)
                if ra is not None:
                    self._rows[b] = ra
                if rb is not None:
                    self._rows[a] = rb
                self._batched.swap_rows(a, b)
            else:  # one-way: b takes a's row
                self._drop(b)
                row = self._rows.pop(a, None)
                if row is not None:
                    self._rows[b] = row
                    if row.batched:
                        self._batched.move_row(a, b)

    def _drop(self, index: int) -> None:
        if self._rows.pop(index, None) is not None:
            self._batched.clear_row(index)

    def _add(
        self, index: int, handle: str, prompt: list[int], output: list[int], eos: list[int]
    ) -> None:
        spec = self._keys.fetch(handle)
        if spec is None:
            logger.error("unknown WorldCup handle: the row is ended at once (fail closed)")
        sampling_size = spec.sampling.no_repeat_ngram_size if spec is not None else 0
        wm, batched = None, False
        if spec is not None and spec.scheme is not None and spec.payload is not None:
            if BatchedWorldCup.supports(spec.scheme):
                self._batched.set_row(index, spec.scheme, spec.payload)  # type: ignore[arg-type]
                batched = True
            else:
                wm = spec.scheme.sequence(spec.payload)
        # a re-added (preempted) request replays the tokens it already has
        blocker = NGramBlocker(sampling_size, prompt)
        banned = None
        if spec is not None and spec.banned:
            banned = torch.tensor(spec.banned, dtype=torch.long, device=self.device)
        self._rows[index] = _Row(
            handle, spec, output, blocker, wm, batched, eos=eos, prompt=list(prompt), banned=banned
        )

    def _sync(self) -> None:
        """Record the tokens sampled since the last step (vLLM appends to ``output``)."""
        for index, row in self._rows.items():
            new = row.output[row.seen :]
            if PLACEHOLDER in new:  # the context is not known: never watermark on it
                new = new[: new.index(PLACEHOLDER)]
                if not row.stale:
                    self._unwatermark(index, row)
            row.seen += len(new)
            for tok in new:
                row.blocker.push(tok)
                if row.watermark is not None:
                    row.watermark.observe(tok)
            if row.batched:
                row.pending.extend(new)
        while True:
            due = [(i, r) for i, r in self._rows.items() if r.batched and r.pending]
            if not due:
                return
            tokens = torch.tensor([r.pending.pop(0) for _, r in due])
            self._batched.append([i for i, _ in due], tokens)

    def _unwatermark(self, index: int, row: _Row) -> None:
        """A placeholder reached the step: from now on the row is sampled unwatermarked
        (bans and filtering stay), and the service is told, so that it counts the row and
        fails its request rather than return it as watermarked."""
        row.stale = True
        if row.spec is None:  # fail-closed rows only ever emit EOS
            return
        logger.error(
            "a token placeholder reached the WorldCup step (async scheduling?): the row is "
            "sampled unwatermarked and its request fails"
        )
        if row.batched:
            self._batched.clear_row(index)
        row.batched, row.watermark = False, None
        row.pending.clear()
        self._keys.report_unwatermarked(row.handle)

    # ------------------------------------------------------------------ the step
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self._sync()
        rows = sorted(i for i in self._rows if i < logits.shape[0])
        if not rows:
            return logits
        index = torch.tensor(rows, device=logits.device)
        out = self.process([self._rows[i] for i in rows], rows, logits[index])
        logits[index] = out.to(logits.dtype)
        return logits

    def process(self, rows: list[_Row], slots: list[int], logits: torch.Tensor) -> torch.Tensor:
        """log q for ``rows`` (B, V): the sampling pipeline
        (:func:`worldcup_core.pipeline.watermarked_distribution`) on vLLM's rows."""
        logits = logits.float().clone()
        states: list[RowState] = []
        for i, row in enumerate(rows):
            spec = row.spec
            if spec is None:  # fail closed: only EOS may follow
                logits[i] = -torch.inf
                logits[i, row.eos or [0]] = 0.0
                states.append(RowState(top_k=1))
                continue
            s = spec.sampling
            banned = row_bans(row.blocker, len(row.output), s.min_new_tokens, spec.eos_token_ids)
            if row.banned is not None:  # a JSON spec's control-character tokens, as hf
                _ban_if_others_remain(logits[i], row.banned)
            # the grammar's bitmask (vLLM's structured-output backend) is already in
            # ``logits`` as -inf: vLLM applies it before any logits processor
            states.append(
                RowState(
                    banned=banned,
                    temperature=s.temperature,
                    top_k=s.top_k,
                    top_p=s.top_p,
                    watermark=row.watermark,
                    slot=slots[i] if row.batched else None,
                    min_p=s.min_p,
                    repetition_penalty=s.repetition_penalty,
                    presence_penalty=s.presence_penalty,
                    frequency_penalty=s.frequency_penalty,
                    logit_bias=s.logit_bias,
                    prompt=row.prompt if s.repetition_penalty != 1.0 else (),
                    output=row.output[: row.seen],
                )
            )
        cand, q = watermarked_distribution(logits, states, self._batched)
        out = torch.full_like(logits, -torch.inf)
        out.scatter_(1, cand.to(logits.device), q.log().to(logits.device, logits.dtype))
        for i, row in enumerate(rows):
            if row.spec is None:
                out[i] = logits[i]
        return out


def _ban_if_others_remain(logits: torch.Tensor, banned: torch.Tensor) -> None:
    """Set ``banned`` ids of one row to -inf in place, unless no finite logit would be
    left (the grammar allows nothing else: the hf engine's mask keeps them then too)."""
    kept = logits.clone()
    kept[banned[banned < logits.shape[0]].to(logits.device)] = -torch.inf
    if bool(torch.isfinite(kept).any()):
        logits.copy_(kept)
