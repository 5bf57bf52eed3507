"""The per-step sampling pipeline every engine runs: logits in, watermarked q out.

One function, :func:`watermarked_distribution`, so that the ``hf`` engine
(:class:`worldcup_core.generation.ContinuousBatch`), the vLLM logits processor
(:mod:`app.engines.vllm_processor`) and the ``model.generate`` processor
(:mod:`worldcup_core.hf`) cannot drift apart. For each row
of a batch, in this order:

1. **penalties** -- the request's repetition penalty (over prompt and output
   tokens, as HF and vLLM: positive logits divided, negative multiplied), then
   presence and frequency penalties (over output tokens, as OpenAI);
2. **logit_bias** -- the request's per-token biases (OpenAI ``logit_bias``);
3. **bans** -- the row's banned ids (repeated n-grams, and EOS before
   ``min_new_tokens``: :func:`row_bans`) get ``-inf``;
4. **grammar** -- a structured-output row's allowed-token mask (``allowed``:
   the grammar engine's bitmask, see ``app/engines/grammar.py``) sets every
   other id to ``-inf``. Should bans leave a row nothing (with a grammar that
   allows only banned ids), the bans are lifted for that step: the grammar wins;
5. **scheme logit bias** -- a scheme that biases full-vocabulary logits
   (KGW-style baselines, ``modifies_logits``) does so now, before any
   filtering, so that the bias decides which tokens survive top-k/top-p;
6. **filter** -- the row's temperature, min-p (relative to the most likely
   token, after temperature, as vLLM), top-k and top-p
   (:func:`worldcup_core.sampling.filter_logits_torch`);
7. **trim** -- candidate columns filtered out in every row are dropped;
8. **reweight** -- the watermark on the final filtered distribution
   (:meth:`worldcup_core.batched.BatchedWorldCup.reweight_mixed`): rows with a
   slot take the batched v2 step together, rows with a host watermark reweight
   one by one, the rest keep their filtered probabilities.

So the watermark chooses among the tokens everything before it allows: a
grammar's tokens only, never one it forbids.

The watermark must come last: anything that reshapes the distribution after
it (another top-p, a temperature) would undo its bias. ``tests/test_pipeline.py``
pins the order.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from worldcup_core.batched import BatchedWorldCup
from worldcup_core.sampling import NGramBlocker, filter_logits_torch
from worldcup_core.scheme import SequenceWatermark


@dataclass(frozen=True)
class RowState:
    """One row's sampling state for one step.

    ``slot`` is the row's slot in the batched v2 step (None: not batched);
    ``watermark`` a per-row scheme (v1 keys, the baselines; None: none).
    """

    banned: Collection[int] = frozenset()
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    watermark: SequenceWatermark | None = None
    slot: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Sequence[tuple[int, float]] = ()
    prompt: Sequence[int] = ()  # for the repetition penalty
    output: Sequence[int] = ()  # the row's generated tokens (all penalties)
    allowed: torch.Tensor | None = None  # bool (V',): the grammar's allowed ids

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def row_bans(
    blocker: NGramBlocker, generated: int, min_new_tokens: int, eos_token_ids: Iterable[int]
) -> set[int]:
    """The ids a row may not sample next: the n-grams that would repeat, and the EOS
    ids while fewer than ``min_new_tokens`` tokens have been generated."""
    banned = blocker.banned()
    if generated < min_new_tokens:
        banned = banned | set(eos_token_ids)
    return banned


def watermarked_distribution(
    logits: torch.Tensor, rows: Sequence[RowState], batched: BatchedWorldCup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Penalties -> logit_bias -> bans -> grammar -> scheme bias -> filter -> trim ->
    reweight, for a (B, V) batch of logits.

    Returns the candidate ids (B, K) int64 and the watermarked probabilities q (B, K)
    float64 over them (0 off each row's support), both on ``logits``'s device.
    ``logits`` itself is left unchanged.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} row states")
    original, logits = logits, logits.clone()
    for i, row in enumerate(rows):
        _shape(logits, i, row, bans=True)
    # bans (n-grams, EOS before min_new_tokens) that leave a row nothing (a grammar
    # allows only banned ids, or vLLM's grammar bitmask already did): lifted this step
    for i in (~torch.isfinite(logits).any(dim=1)).nonzero().flatten().tolist():
        if rows[i].banned:
            logits[i] = original[i]
            _shape(logits, i, rows[i], bans=False)
    cand, probs = filter_logits_torch(
        logits,
        [r.temperature for r in rows],
        [r.top_k for r in rows],
        [r.top_p for r in rows],
    )
    width = int((probs > 0).sum(dim=1).max())  # drop columns filtered in every row
    cand, probs = cand[:, :width], probs[:, :width]
    q = batched.reweight_mixed([r.slot for r in rows], [r.watermark for r in rows], cand, probs)
    return cand, q


def _shape(logits: torch.Tensor, i: int, row: RowState, bans: bool) -> None:
    """Steps 1-6 (before the filter's top-k/top-p) on row ``i``, in place."""
    vocab = logits.shape[1]
    if row.penalised:
        _penalise(logits, i, row)
    if row.logit_bias:
        ids = [t for t, _ in row.logit_bias if t < vocab]
        bias = [b for t, b in row.logit_bias if t < vocab]
        if ids:
            logits[i, ids] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if bans and row.banned:
        logits[i, list(row.banned)] = -torch.inf
    if row.allowed is not None:
        mask = _allowed(row.allowed, vocab, logits.device)
        logits[i] = logits[i].masked_fill(~mask, -torch.inf)
    wm = row.watermark
    if wm is not None and wm.modifies_logits:
        biased = wm.process_logits(logits[i].double().cpu().numpy())
        logits[i] = torch.from_numpy(biased).to(logits.device, logits.dtype)
    if row.min_p > 0.0:
        # p_j >= min_p * p_max  <=>  l_j >= l_max + T log(min_p)   (after temperature)
        floor = logits[i].max() + row.temperature * math.log(row.min_p)
        logits[i] = logits[i].masked_fill(logits[i] < floor, -torch.inf)


def _allowed(allowed: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """The (V,) bool mask of ``allowed`` (V' ids; ids beyond V' are not allowed)."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    width = min(vocab, allowed.shape[0])
    mask[:width] = allowed[:width].to(device)
    return mask


PENALISED_LOGIT_BOUND = 1e4  # over the lowest temperature (0.01): 1e6, finite in float32


def _penalise(logits: torch.Tensor, i: int, row: RowState) -> None:
    """Repetition (prompt and output), presence and frequency (output) penalties, in place."""
    vocab = logits.shape[1]
    device = logits.device
    if row.repetition_penalty != 1.0:
        seen = sorted({t for t in (*row.prompt, *row.output) if 0 <= t < vocab})
        if seen:
            idx = torch.tensor(seen, device=device)
            vals = logits[i, idx]
            penalised = torch.where(
                vals > 0, vals / row.repetition_penalty, vals * row.repetition_penalty
            )
            # a penalty near 0 (schema-valid: (0, 2]) would divide to inf and the softmax
            # to NaN: saturate at a bound no real logit reaches, finite after temperature
            logits[i, idx] = penalised.clamp(-PENALISED_LOGIT_BOUND, PENALISED_LOGIT_BOUND)
    if row.output and (row.presence_penalty != 0.0 or row.frequency_penalty != 0.0):
        out = torch.tensor([t for t in row.output if 0 <= t < vocab], device=device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        logits[i] -= row.frequency_penalty * counts + row.presence_penalty * (counts > 0).to(
            logits.dtype
        )
