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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import LogitsProcessor

from worldcup_core.message import Payload
from worldcup_core.sampling import filter_logits
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
        self._observed: list[int] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = input_ids.shape[0]
        if self._prompt_len is None:
            if batch != len(self.payloads):
                raise ValueError(f"batch has {batch} rows but {len(self.payloads)} payloads")
            self._prompt_len = int(input_ids.shape[1])
            self._rows = [self.scheme.sequence(p) for p in self.payloads]
            self._observed = [0] * batch
        new = input_ids[:, self._prompt_len :].tolist()
        logits = scores.clone()
        for i, row in enumerate(self._rows):
            for tok in new[i][self._observed[i] :]:
                row.observe(int(tok))
            self._observed[i] = len(new[i])
            if row.modifies_logits:
                biased = row.process_logits(logits[i].double().cpu().numpy())
                logits[i] = torch.from_numpy(biased).to(logits.device, logits.dtype)
        cand, probs = filter_logits(
            logits, [self.temperature] * batch, [self.top_k] * batch, [self.top_p] * batch
        )
        out = torch.full_like(scores, -torch.inf)
        for i, row in enumerate(self._rows):
            live = int(np.count_nonzero(probs[i]))
            q = row.reweight(cand[i, :live], probs[i, :live])
            with np.errstate(divide="ignore"):
                log_q = torch.from_numpy(np.log(q)).to(scores.device, scores.dtype)
            out[i, torch.from_numpy(cand[i, :live]).to(scores.device)] = log_q
        return out  # type: ignore[return-value]
