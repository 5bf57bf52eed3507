"""The per-step sampling pipeline every engine runs: logits in, watermarked q out.

One function, :func:`watermarked_distribution`, so that the ``hf`` engine
(:class:`worldcup_core.generation.ContinuousBatch`), the vLLM logits processor
(:mod:`app.engines.vllm_processor`) and the ``model.generate`` processor
(:mod:`worldcup_core.hf`) cannot drift apart. For each row
of a batch, in this order:

1. **bans** -- the row's banned ids (repeated n-grams, and EOS before
   ``min_new_tokens``: :func:`row_bans`) get ``-inf``;
2. **logit bias** -- a scheme that biases full-vocabulary logits (KGW-style
   baselines, ``modifies_logits``) does so now, after the bans and before any
   filtering, so that the bias decides which tokens survive top-k/top-p;
3. **filter** -- the row's temperature, top-k and top-p
   (:func:`worldcup_core.sampling.filter_logits_torch`);
4. **trim** -- candidate columns filtered out in every row are dropped;
5. **reweight** -- the watermark on the final filtered distribution
   (:meth:`worldcup_core.batched.BatchedWorldCup.reweight_mixed`): rows with a
   slot take the batched v2 step together, rows with a host watermark reweight
   one by one, the rest keep their filtered probabilities.

The watermark must come last: anything that reshapes the distribution after
it (another top-p, a temperature) would undo its bias. ``tests/test_pipeline.py``
pins the order.
"""

from __future__ import annotations

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
    """Bans -> logit bias -> filter -> trim -> reweight, for a (B, V) batch of logits.

    Returns the candidate ids (B, K) int64 and the watermarked probabilities q (B, K)
    float64 over them (0 off each row's support), both on ``logits``'s device.
    ``logits`` itself is left unchanged.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} row states")
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, list(row.banned)] = -torch.inf
        wm = row.watermark
        if wm is not None and wm.modifies_logits:
            biased = wm.process_logits(logits[i].double().cpu().numpy())
            logits[i] = torch.from_numpy(biased).to(logits.device, logits.dtype)
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
