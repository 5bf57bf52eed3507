"""WorldCup as a vLLM Model Runner V2 (MRv2) logits processor.

MRv2 (``vllm/v1/worker/gpu/sample/logits_processor/interface.py``) gives each request
a stable slot: :meth:`add_request` is called with the slot and the request's
``SamplingParams`` whenever a request enters the batch (a new one, or a preempted one
coming back: MRv2 removes a preempted request and adds it again, with its tokens so
far as part of its prefill), and :meth:`apply` once a step with the logits and the
step's layout (row -> slot). There is no move/swap bookkeeping and no remove call: a
slot's state is replaced on its next add. The committed token history stays in
vLLM's request state on the device (``all_token_ids`` up to ``total_len``), with no
``-1`` placeholders: under async scheduling vLLM's own ``post_update`` writes each
sampled token there, on the device, before the next step's sampler runs.

What the processor does is the V1 processor's (:mod:`app.engines.vllm_processor`:
the same :class:`~app.engines.vllm_processor.RowBook`, pipeline and guards); only
the bookkeeping differs:

* the request's handle, EOS ids and spec come through ``extra_args`` in
  :meth:`add_request`; the prompt and any tokens a re-added request already has are
  read at the first step that follows (vLLM writes them to the device after the add);
  a request that misses a step leaves the batched step and replays from the device
  when it is back (MRv2 does not tell a processor when a request finishes);
* each step reads the row's ``total_len`` (one host read for the batch) and the new
  token (one more): after that first sync a row grows by 0 or 1 a step and never
  shrinks, and a new token must have had mass in the row's previous q, else the row
  fails closed (:class:`~app.engines.vllm_keys.Fault`);
* rows are logits rows: one per request, as the engine refuses speculative decoding.
  A step whose rows are not one per request fails the processor's rows
  (``Fault.LAYOUT``) rather than guess.

**Pipeline order.** MRv2 runs vLLM's logit bias, penalties, bad words and the
grammar's bitmask *before* custom processors, temperature, min-p and top-k/top-p
after them, and thinking-budget forcing after ``apply`` (it wins for a request
whose budget is spent). The engine sets none of vLLM's own sampling options, so
the processor sees the model's logits with only the grammar's bitmask, as on V1,
and vLLM samples exactly q. A forced token (thinking budget) falls outside q's
support: the guard fails that request.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from app.engines.vllm_keys import EOS_ARGS_KEY, EXTRA_ARGS_KEY, Fault
from app.engines.vllm_processor import RowBook, _Row, validate_handle


class WorldCupMRv2Processor(RowBook, LogitsProcessor):  # type: ignore[misc]
    """The MRv2 runner's processor (module docstring)."""

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
        self._req = req_states
        self._init_book(torch.device(req_states.device), int(req_states.max_num_reqs))

    def __repr__(self) -> str:
        return f"WorldCupMRv2Processor({len(self._rows)} rows on {self.device})"

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_handle(sampling_params)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        self._drop(req_idx)  # the slot's previous occupant, if any
        extra = sampling_params.extra_args or {}
        handle = extra.get(EXTRA_ARGS_KEY)
        if handle is None:
            return False  # not ours: apply leaves the row alone
        eos = [int(t) for t in extra.get(EOS_ARGS_KEY, [])]
        self._rows[req_idx] = self._new_row(req_idx, str(handle), [], [], eos)
        return True

    # ------------------------------------------------------------------ the step
    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self._rows:
            return logits
        slots = [int(s) for s in ctx.idx_mapping_np.tolist()]
        picked = [(r, s) for r, s in enumerate(slots) if s in self._rows]
        if not picked:
            return logits
        if logits.shape[0] != len(slots):  # several rows a request (speculative decoding)
            for _, s in picked:
                self._fail(s, self._rows[s], Fault.LAYOUT)
            return logits
        mine = [s for _, s in picked]
        self._park(set(mine))
        self._sync(mine)
        index = torch.tensor([r for r, _ in picked], device=logits.device)
        out = self.process([self._rows[s] for s in mine], mine, logits[index])
        logits[index] = out.to(logits.dtype)
        return logits

    def _park(self, present: set[int]) -> None:
        """Rows absent from this step: MRv2 tells no processor when a request finishes,
        so a slot's row leaves the batched step as soon as its request misses a step
        (else the step's history tables would keep growing for requests long gone);
        should it come back, it starts afresh from vLLM's device history, the ground
        truth (:meth:`_replay`)."""
        for slot, row in self._rows.items():
            if slot not in present and not row.fresh and row.fault is None:
                if row.batched:
                    self._batched.clear_row(slot)
                row.fresh = True

    def _sync(self, slots: list[int]) -> None:
        """Bring each row of this step up to its committed tokens, through the guards."""
        req = self._req
        where = torch.tensor(slots, device=req.total_len.gpu.device)
        totals = [int(t) for t in req.total_len.gpu[where].tolist()]
        prompt_lens = [int(req.prompt_len.np[s]) for s in slots]
        grown: list[tuple[int, _Row, int]] = []  # (slot, row, position of its new token)
        for slot, total, prompt_len in zip(slots, totals, prompt_lens, strict=True):
            row = self._rows[slot]
            committed = total - prompt_len
            if row.fresh:  # after an add: the prompt, and a re-added request's tokens so far
                self._replay(slot, row, prompt_len, total)
            elif committed < row.seen:
                self._fail(slot, row, Fault.SHRANK)
                del row.output[committed:]
                row.seen = committed
            elif committed - row.seen > 1:
                self._fail(slot, row, Fault.GREW)
                self._catch_up(slot, row, prompt_len, total)
            elif committed == row.seen + 1:
                grown.append((slot, row, total - 1))
        if grown:
            rows_at = torch.tensor([s for s, _, _ in grown], device=where.device)
            cols_at = torch.tensor([c for _, _, c in grown], device=where.device)
            tokens = [int(t) for t in req.all_token_ids.gpu[rows_at, cols_at].tolist()]
            due = []
            for (slot, row, _), tok in zip(grown, tokens, strict=True):
                row.output.append(tok)
                if row.fault is None:
                    due.append((slot, row, tok))
                self._record(slot, row, [tok])
            self._check_candidates(due)
        self._flush()

    def _replay(self, slot: int, row: _Row, prompt_len: int, total: int) -> None:
        """A row's state from scratch, from vLLM's device history (after an add, or a
        step the request missed): its prompt, and the tokens it already has."""
        ids = [int(t) for t in self._req.all_token_ids.gpu[slot, :total].tolist()]
        fresh = self._row_of(slot, row.handle, row.spec, ids[:prompt_len], [], row.eos)
        self._rows[slot] = fresh
        if total > prompt_len:
            self._note_replay(row.handle, total - prompt_len)
        fresh.output.extend(ids[prompt_len:])
        self._record(slot, fresh, ids[prompt_len:])

    def _catch_up(self, slot: int, row: _Row, prompt_len: int, total: int) -> None:
        """A failed row's tokens, for its (unwatermarked) bans and penalties."""
        start = prompt_len + row.seen
        new = [int(t) for t in self._req.all_token_ids.gpu[slot, start:total].tolist()]
        row.output.extend(new)
        self._record(slot, row, new)
