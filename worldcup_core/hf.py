"""A Hugging Face ``LogitsProcessor`` so users of ``model.generate`` can watermark.

**Ordering.** The watermark must see the final filtered distribution; any
warper applied after it (temperature, top-k, top-p) would reshape the
tournament's output and weaken or break the watermark. ``generate`` runs
user processors *before* its own warpers, so this processor does the
filtering itself and must be the only thing shaping the distribution. Give
it your temperature/top_k/top_p and call ``generate`` with neutral warpers::

    proc = WorldCupLogitsProcessor(scheme, [payload], temperature=1.0, top_k=50, top_p=0.95)
    out = model.generate(
        input_ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        logits_processor=LogitsProcessorList([proc]),
    )

It returns log-probabilities: ``log q`` on the surviving candidates and
``-inf`` elsewhere, so HF's final softmax + multinomial samples exactly q.
Contexts are built from generated tokens only: the prompt length is taken
from the first call. Use one processor instance per ``generate`` call.

Each step runs the sampling pipeline both engines run
(:func:`worldcup_core.pipeline.watermarked_distribution`), without bans.
Scheme ``worldcup-v2`` runs the batched step on the model's device (one call
for the whole batch, :mod:`worldcup_core.batched`); other schemes reweight row
by row on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from worldcup_core.batched import BatchedWorldCup
from worldcup_core.message import Payload
from worldcup_core.pipeline import RowState, watermarked_distribution
from worldcup_core.scheme import SequenceWatermark, WatermarkScheme


class WorldCupLogitsProcessor(LogitsProcessor):
    """Watermarks every row of a batch with its own payload."""

    def __init__(
        self,
        scheme: WatermarkScheme,
        payloads: Sequence[Payload],
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 0.95,
    ) -> None:
        if not payloads:
            raise ValueError("payloads must name one payload per batch row")
        if not 0.0 < temperature or not 0.0 < top_p <= 1.0 or top_k < 0:
            raise ValueError(
                f"need temperature > 0, 0 < top_p <= 1 and top_k >= 0; "
                f"got {temperature}, {top_p}, {top_k}"
            )
        self.scheme = scheme
        self.payloads = list(payloads)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self._prompt_len: int | None = None
        self._rows: list[SequenceWatermark] = []
        self._observed = 0
        self._batched: BatchedWorldCup | None = None  # scheme worldcup-v2: its rows' slots
        self._steps: BatchedWorldCup | None = None  # what the sampling pipeline reweights with

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = input_ids.shape[0]
        if self._prompt_len is None:
            if batch != len(self.payloads):
                raise ValueError(f"batch has {batch} rows but {len(self.payloads)} payloads")
            self._prompt_len = int(input_ids.shape[1])
            if BatchedWorldCup.supports(self.scheme):
                self._batched = BatchedWorldCup(scores.device)
                for i, payload in enumerate(self.payloads):
                    self._batched.set_row(i, self.scheme, payload)  # type: ignore[arg-type]
            else:
                self._rows = [self.scheme.sequence(p) for p in self.payloads]
        new = input_ids[:, self._prompt_len + self._observed :]
        self._observed += int(new.shape[1])
        if self._batched is not None:
            for j in range(new.shape[1]):
                self._batched.append(range(batch), new[:, j])
        for i, row in enumerate(self._rows):
            for tok in new[i].tolist():
                row.observe(int(tok))
        if self._steps is None:
            self._steps = (
                self._batched if self._batched is not None else BatchedWorldCup(scores.device)
            )
        states = [
            RowState(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                watermark=self._rows[i] if self._rows else None,
                slot=i if self._batched is not None else None,
            )
            for i in range(batch)
        ]
        cand, q = watermarked_distribution(scores, states, self._steps)
        out = torch.full_like(scores, -torch.inf)
        out.scatter_(1, cand, torch.log(q).to(scores.dtype))  # log 0 = -inf off the support
        return out  # type: ignore[return-value]
