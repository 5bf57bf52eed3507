"""WorldCup as a vLLM logits processor (it runs in vLLM's engine core): what both of
vLLM's model runners share (:class:`RowBook`) and the legacy V1 runner's processor
(:class:`WorldCupLogitsProcessor`). The Model Runner V2 processor is
:mod:`app.engines.vllm_mrv2`; the engine picks one at start (:mod:`app.engines.vllm`).

**Ordering.** vLLM applies temperature, min-p, top-k and top-p *after* the logits
processors (on both runners), and anything that reshapes the distribution after the
watermark weakens or breaks it. So the processor runs the same sampling pipeline as
the ``hf`` engine (:func:`worldcup_core.pipeline.watermarked_distribution`):

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
   device (:class:`worldcup_core.batched.BatchedWorldCup`, slots = vLLM's batch
   indices); other schemes (v1 keys) reweight row by row;

and returns ``log q`` on the candidates, ``-inf`` elsewhere. The engine sends
these requests to vLLM with temperature 1, top-k and top-p off, min_p 0 and
no penalties or logit bias of vLLM's own, so vLLM's softmax and draw sample
exactly q.

Rows whose ``SamplingParams.extra_args`` carry no WorldCup handle are left
untouched. The handle is opaque; the key material comes over a private
channel (:mod:`app.engines.vllm_keys`).

**Guards (fail closed).** The watermark is only as good as the context it is
computed on, and the processor keeps its own record of each row's tokens. Every
step checks that record against vLLM's: after the first step that follows an add
(a re-added, preempted row replays the tokens it already has), a row grows by 0 or
1 tokens a step and never shrinks; each new token had mass in the q the previous
step gave the row; no registered row lacks a logits row; no token is a placeholder.
A row that fails one is sampled unwatermarked from then on and reported over the
key channel with its :class:`~app.engines.vllm_keys.Fault`; the engine fails its
request (counted in ``worldcup_watermark_faults_total``). With ``WORLDCUP_VLLM_SCORES``
set to a file, every watermarked row's step is appended to it (debug; token ids are
user data): the context the step used, the entropy of the filtered distribution and
how far the watermark moved it, so that a weak text can be told apart from a sync bug
(:func:`app.engines.vllm_keys.score_summary`).

**V1 specifics.** Each step reads the row's tokens from vLLM's live output list,
slots are vLLM's persistent-batch indices, moved and swapped with them; the tables
are sized from ``max_num_seqs`` and grow on any index beyond. Async scheduling
leaves ``-1`` placeholders in those lists (vLLM issue 52461), so the engine keeps
it off on this runner and refuses a configuration that has it on.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import torch
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from app.engines.vllm_keys import (
    EOS_ARGS_KEY,
    EXTRA_ARGS_KEY,
    SCORES_ENV,
    Fault,
    KeyClient,
    RowSpec,
)
from worldcup_core.batched import BatchedWorldCup, warm_up
from worldcup_core.pipeline import RowState, row_bans, watermarked_distribution
from worldcup_core.sampling import NGramBlocker
from worldcup_core.scheme import SequenceWatermark

logger = logging.getLogger("worldcup.engine.vllm")


PLACEHOLDER = -1  # async scheduling's not-yet-known token id in vLLM's output lists


@dataclass(eq=False)
class _Row:
    handle: str
    spec: RowSpec | None  # None: the handle was unknown (fail closed: EOS only)
    output: list[int]  # the request's generated tokens (V1: vLLM's live list)
    blocker: NGramBlocker
    watermark: SequenceWatermark | None  # per-row scheme (v1 keys)
    batched: bool  # the row has a slot in the batched v2 step
    eos: list[int] = field(default_factory=list)  # forced when ``spec`` is None
    seen: int = 0  # tokens of ``output`` already recorded
    pending: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # for the repetition penalty
    banned: torch.Tensor | None = None  # RowSpec.banned, as a tensor (JSON specs)
    fresh: bool = True  # added, not yet synced: its first sync may replay many tokens
    fault: Fault | None = None  # the guard that failed (the row is unwatermarked since)
    last: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (cand, q, i) last step

    @property
    def width(self) -> int:
        scheme = self.spec.scheme if self.spec is not None else None
        return int(getattr(getattr(scheme, "config", None), "context_width", 0) or 0)


class RowBook:
    """The per-request state and the step both runners' processors share: rows keyed by
    slot (V1: persistent-batch index; V2: request slot), the batched v2 step, the key
    channel, the guards and the debug record."""

    def _init_book(self, device: torch.device, capacity: int) -> None:
        self.device = torch.device(device)
        self._batched = BatchedWorldCup(self.device, capacity=capacity)
        warm_up(self.device)  # compiled CPU loops now, while vLLM loads, not on a request
        self._rows: dict[int, _Row] = {}
        self._keys: Any = KeyClient()
        path = os.environ.get(SCORES_ENV)
        self._scores: TextIO | None = open(path, "a") if path else None  # noqa: SIM115

    def _new_row(
        self, index: int, handle: str, prompt: list[int], output: list[int], eos: list[int]
    ) -> _Row:
        """The row for a request entering the batch at ``index`` (its slot)."""
        spec = self._keys.fetch(handle)
        if spec is None:
            logger.error("unknown WorldCup handle: the row is ended at once (fail closed)")
        return self._row_of(index, handle, spec, prompt, output, eos)

    def _row_of(
        self,
        index: int,
        handle: str,
        spec: RowSpec | None,
        prompt: list[int],
        output: list[int],
        eos: list[int],
    ) -> _Row:
        wm, batched = None, False
        if spec is not None and spec.scheme is not None and spec.payload is not None:
            if BatchedWorldCup.supports(spec.scheme):
                self._batched.set_row(index, spec.scheme, spec.payload)  # type: ignore[arg-type]
                batched = True
            else:
                wm = spec.scheme.sequence(spec.payload)
        size = spec.sampling.no_repeat_ngram_size if spec is not None else 0
        banned = None
        if spec is not None and spec.banned:
            banned = torch.tensor(spec.banned, dtype=torch.long, device=self.device)
        return _Row(
            handle,
            spec,
            output,
            NGramBlocker(size, prompt),
            wm,
            batched,
            eos=eos,
            prompt=list(prompt),
            banned=banned,
        )

    def _drop(self, index: int) -> None:
        if self._rows.pop(index, None) is not None:
            self._batched.clear_row(index)

    def _note_replay(self, handle: str, tokens: int) -> None:
        """A request came back with ``tokens`` generated (preempted; on MRv2 also after a
        missed step): logged, and recorded in the debug file (the engine core's INFO logs
        go nowhere by default)."""
        logger.info("a row replays the %d tokens it already has", tokens)
        if self._scores is not None:
            self._scores.write(json.dumps({"handle": handle, "replay": tokens}) + "\n")
            self._scores.flush()

    # ------------------------------------------------------------------ guards
    def _fail(self, index: int, row: _Row, fault: Fault) -> None:
        """From now on the row is sampled unwatermarked (bans and filtering stay), and
        the service is told, so that it counts the row and fails its request rather
        than return it as watermarked."""
        if row.fault is not None:
            return
        row.fault = fault
        if row.spec is None:  # fail-closed rows only ever emit EOS
            return
        logger.error(
            "WorldCup guard %s on a row: it is sampled unwatermarked and its request fails",
            fault.value,
        )
        if row.batched:
            self._batched.clear_row(index)
        row.batched, row.watermark, row.last = False, None, None
        row.pending.clear()
        self._keys.report_fault(row.handle, fault)

    def _record(self, index: int, row: _Row, new: list[int]) -> None:
        """Record ``new`` tokens of a row (``row.output`` already holds them)."""
        row.seen += len(new)
        row.fresh = False
        for tok in new:
            row.blocker.push(tok)
            if row.watermark is not None:
                row.watermark.observe(tok)
        if row.batched:
            row.pending.extend(new)

    def _check_growth(
        self, index: int, row: _Row, new: list[int], due: list[tuple[int, _Row, int]]
    ) -> None:
        """The growth guard for a row past its first sync: 0 or 1 new tokens a step (a
        new one is queued for :meth:`_check_candidates`)."""
        if row.fault is not None or row.fresh:
            return
        if len(new) > 1:
            self._fail(index, row, Fault.GREW)
        elif new:
            due.append((index, row, new[0]))

    def _check_candidates(self, due: list[tuple[int, _Row, int]]) -> None:
        """Each (index, row, token): the token had mass in the row's previous q. One host
        read per group of rows whose last step shared a tensor (usually one a step)."""
        groups: dict[int, list[tuple[int, _Row, int]]] = {}
        for item in due:
            last = item[1].last
            if last is not None:
                groups.setdefault(id(last[0]), []).append(item)
        for items in groups.values():
            first = items[0][1].last
            assert first is not None
            cand, q = first[0], first[1]
            at = torch.tensor([r.last[2] for _, r, _ in items if r.last], device=cand.device)
            toks = torch.tensor([t for _, _, t in items], device=cand.device)
            hit = ((cand[at] == toks[:, None]) & (q[at] > 0)).any(dim=1).tolist()
            for (index, row, _), ok in zip(items, hit, strict=True):
                if not ok:
                    self._fail(index, row, Fault.OUTSIDE)

    def _flush(self) -> None:
        """Append the recorded tokens to the batched step's histories, one a slot a call."""
        while True:
            due = [(i, r) for i, r in self._rows.items() if r.batched and r.pending]
            if not due:
                return
            tokens = torch.tensor([r.pending.pop(0) for _, r in due])
            self._batched.append([i for i, _ in due], tokens)

    # ------------------------------------------------------------------ the step
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
            banned = row_bans(row.blocker, row.seen, s.min_new_tokens, spec.eos_token_ids)
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
            elif row.fault is None:
                row.last = (cand, q, i)
        if self._scores is not None:
            self._write_scores(rows, logits, states, cand, q)
        return out

    def _write_scores(
        self,
        rows: list[_Row],
        logits: torch.Tensor,
        states: list[RowState],
        cand: torch.Tensor,
        q: torch.Tensor,
    ) -> None:
        """Debug: one JSON line per watermarked row (module docstring)."""
        assert self._scores is not None
        plain = [replace(s, slot=None, watermark=None) for s in states]
        pcand, p = watermarked_distribution(logits, plain, self._batched)
        for i, row in enumerate(rows):
            if row.spec is None or row.spec.scheme is None or row.fault is not None:
                continue
            dense_p = torch.zeros(logits.shape[1], dtype=torch.float64)
            dense_q = torch.zeros(logits.shape[1], dtype=torch.float64)
            dense_p[pcand[i].cpu()] = p[i].double().cpu()
            dense_q[cand[i].cpu()] = q[i].double().cpu()
            live = dense_p[dense_p > 0]
            record = {
                "handle": row.handle,
                "pos": row.seen,
                "ctx": row.output[max(0, row.seen - row.width) : row.seen],
                "entropy": float(-(live * live.log()).sum()),
                "tv": float((dense_p - dense_q).abs().sum() / 2),
                "candidates": int(live.numel()),
            }
            self._scores.write(json.dumps(record) + "\n")
        self._scores.flush()


class WorldCupLogitsProcessor(RowBook, LogitsProcessor):  # type: ignore[misc]
    """The V1 runner's processor: per-row filtering and the WorldCup step for the rows
    that carry a handle, with the guards (module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # one slot per persistent-batch index; grown on any index beyond (swap_rows too)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        capacity = int(getattr(scheduler, "max_num_seqs", None) or 64)
        self._init_book(device, capacity)

    def __repr__(self) -> str:
        return f"WorldCupLogitsProcessor({len(self._rows)} rows on {self.device})"

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_handle(sampling_params)

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
                if output_ids:
                    self._note_replay(str(handle), len(output_ids))
                eos = [int(t) for t in (params.extra_args or {}).get(EOS_ARGS_KEY, [])]
                # a re-added (preempted) request replays the tokens it already has
                self._rows[index] = self._new_row(
                    index, str(handle), prompt_ids or [], output_ids, eos
                )
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

    def _sync(self) -> None:
        """Record the tokens sampled since the last step (vLLM appends to ``output``),
        through the guards."""
        due: list[tuple[int, _Row, int]] = []
        for index, row in self._rows.items():
            if len(row.output) < row.seen:  # a truncation (KV-load failure) we missed
                self._fail(index, row, Fault.SHRANK)
                row.seen = len(row.output)
                continue
            new = row.output[row.seen :]
            if PLACEHOLDER in new:  # the context is not known: never watermark on it
                new = new[: new.index(PLACEHOLDER)]
                self._fail(index, row, Fault.PLACEHOLDER)
            self._check_growth(index, row, new, due)
            self._record(index, row, new)
        self._check_candidates(due)
        self._flush()

    # ------------------------------------------------------------------ the step
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self._sync()
        rows = []
        for i, row in self._rows.items():
            if i < logits.shape[0]:
                rows.append(i)
            else:  # vLLM's batch and this processor's bookkeeping disagree
                self._fail(i, row, Fault.SKIPPED)
        if not rows:
            return logits
        rows.sort()
        index = torch.tensor(rows, device=logits.device)
        out = self.process([self._rows[i] for i in rows], rows, logits[index])
        logits[index] = out.to(logits.dtype)
        return logits


def validate_handle(sampling_params: Any) -> None:
    """A handle in ``extra_args`` is an opaque alphanumeric string (both runners)."""
    handle = (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY)
    if handle is not None and not (isinstance(handle, str) and handle.isalnum()):
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be an alphanumeric handle")


def _ban_if_others_remain(logits: torch.Tensor, banned: torch.Tensor) -> None:
    """Set ``banned`` ids of one row to -inf in place, unless no finite logit would be
    left (the grammar allows nothing else: the hf engine's mask keeps them then too)."""
    kept = logits.clone()
    kept[banned[banned < logits.shape[0]].to(logits.device)] = -torch.inf
    if bool(torch.isfinite(kept).any()):
        logits.copy_(kept)
