"""Token weights from a causal LM: one batched forward pass over many texts (torch).

:func:`model_token_weights` is what a detection engine calls: the texts (token ids of
the responses alone) are right-padded into batches, each batch runs one forward pass
with its attention mask, and every position's next-token distribution is filtered as
the service filters (:data:`~worldcup_core.token_weights.DETECTION_SAMPLING`, after the
n-gram bans the text implies) on the model's device, then reduced to ``1 - sum p^2``
(:mod:`worldcup_core.token_weights`, whose numpy :func:`token_weights_from_logits` is
the same computation on one text's logits). Only the (B, T) weights come back to the
CPU. Logits are taken ``chunk`` positions at a time, so memory stays at one chunk of
vocabulary-wide rows, not B x T of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from worldcup_core.config import SamplingConfig
from worldcup_core.sampling import filter_logits_torch
from worldcup_core.token_weights import DETECTION_SAMPLING, F64, ngram_bans

DEFAULT_BATCH = 8
DEFAULT_CHUNK = 512  # vocabulary-wide logit rows filtered at once


@torch.inference_mode()
def model_token_weights(
    model: Any,
    texts: Sequence[Sequence[int]],
    sampling: SamplingConfig = DETECTION_SAMPLING,
    prefix_ids: Sequence[int] = (),
    batch_size: int = DEFAULT_BATCH,
    pad_token_id: int = 0,
    chunk: int = DEFAULT_CHUNK,
) -> list[F64]:
    """The informativeness ``a_t`` of every token of every text (one array per text, as
    long as the text), from ``model``'s next-token distributions given ``prefix_ids``
    (may be empty) and the text's tokens before t.

    Without a prefix a text's first token has no distribution: NaN there (it is never
    scored under ``worldcup-v2``). ``model`` is any causal LM returning ``.logits``
    (Hugging Face ``AutoModelForCausalLM``); it stays on its own device.
    """
    if batch_size < 1 or chunk < 1:
        raise ValueError("batch_size and chunk must be >= 1")
    device = next(model.parameters()).device
    prefix = [int(t) for t in prefix_ids]
    out: list[F64] = []
    for start in range(0, len(texts), batch_size):
        batch = [[int(t) for t in text] for text in texts[start : start + batch_size]]
        out.extend(_batch_weights(model, batch, sampling, prefix, pad_token_id, chunk, device))
    return out


def _batch_weights(
    model: Any,
    batch: list[list[int]],
    sampling: SamplingConfig,
    prefix: list[int],
    pad: int,
    chunk: int,
    device: torch.device,
) -> list[F64]:
    rows = [prefix + text for text in batch]
    width = max((len(r) for r in rows), default=0)
    result = [np.full(len(text), np.nan) for text in batch]
    if width < 2 and not prefix:
        return result
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    hidden, head = _hidden_and_head(model, ids.to(device), mask.to(device))
    # position j of row i predicts token j + 1 of the row: text token t = j + 1 - len(prefix)
    off = len(prefix)
    where: list[tuple[int, int, int]] = []  # (row, position in the forward, text token)
    bans: list[tuple[int, ...]] = []
    for i, text in enumerate(batch):
        banned = ngram_bans(text, sampling.no_repeat_ngram_size)
        for t in range(max(0, 1 - off), len(text)):
            where.append((i, t + off - 1, t))
            bans.append(banned[t] if sampling.no_repeat_ngram_size else ())
    for s in range(0, len(where), chunk):
        part = where[s : s + chunk]
        r_idx = torch.tensor([w[0] for w in part], device=device)
        p_idx = torch.tensor([w[1] for w in part], device=device)
        logits = head(hidden[r_idx, p_idx]).float()
        flat_r = [j for j, b in enumerate(bans[s : s + chunk]) for _ in b]
        flat_c = [c for b in bans[s : s + chunk] for c in b]
        if flat_r:
            rows_t = torch.tensor(flat_r, device=device)
            banned = torch.unique(rows_t)
            saved = logits[banned].clone()  # only the rows with bans (few): not all of them
            logits[rows_t, torch.tensor(flat_c, device=device)] = -torch.inf
            empty = ~torch.isfinite(logits[banned]).any(dim=1)
            if bool(empty.any()):  # bans that leave nothing are lifted (as the sampler does)
                logits[banned[empty]] = saved[empty]
        n = len(part)
        _, probs = filter_logits_torch(
            logits, [sampling.temperature] * n, [sampling.top_k] * n, [sampling.top_p] * n
        )
        a = (1.0 - (probs * probs).sum(dim=1)).clamp(0.0, 1.0).cpu().numpy()
        for (i, _, t), value in zip(part, a.tolist(), strict=True):
            result[i][t] = value
    return result


def _hidden_and_head(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The last hidden states (B, T, H) and the output head that maps them to logits;
    models without a separable head return their logits and the identity."""
    decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is not None and head is not None and _plain_head(model):
        base = decoder()
        if base is not None:
            hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
            return hidden, head
    logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, lambda x: x


def _plain_head(model: Any) -> bool:
    """Whether logits are exactly ``head(hidden)`` (no soft-capping or scaling after it)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    if getattr(config, "final_logit_softcapping", None):
        return False
    return getattr(config, "logit_scale", None) in (None, 1.0) and config.model_type in {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "smollm3",
        "phi3",
    }
