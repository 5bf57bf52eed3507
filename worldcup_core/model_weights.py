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

import copy
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from worldcup_core.config import SamplingConfig
from worldcup_core.token_weights import DETECTION_SAMPLING, F64, ngram_bans

DEFAULT_BATCH = 8
DEFAULT_CHUNK = 256  # vocabulary-wide logit rows filtered at once
WINDOW_TOKENS = 2048  # longer texts are read in windows, each from its own start
BLOCK = 64  # vocabulary block of top_values' first pass

WeightsDtype = Literal["auto", "float32", "bfloat16"]
WEIGHTS_DTYPES: tuple[WeightsDtype, ...] = ("auto", "float32", "bfloat16")


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively (AMX or AVX512-BF16 on a
    CPU, a CUDA GPU that supports it), i.e. faster than float32."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    cpu: Any = torch.cpu
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def emulated_bfloat16(name: str, device: torch.device | str) -> bool:
    """Whether the weights dtype ``name`` asks for bfloat16 where ``device`` does not
    compute it natively: on an AVX2-only CPU its forward passes are about 5 times
    slower than float32 (measured: 0.47 against 2.25 texts/s of 128 tokens, 2 cores)."""
    return name == "bfloat16" and not native_bfloat16(torch.device(device))


def weights_dtype(name: str, model: Any) -> torch.dtype:
    """The dtype detection's forward passes run in: ``float32`` or ``bfloat16`` as named;
    ``auto`` is bfloat16 where the model's device computes it natively
    (:func:`native_bfloat16`), else the model's own dtype."""
    if name not in WEIGHTS_DTYPES:
        raise ValueError(f"weights dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {name!r}")
    param = next(model.parameters())
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(param.device) else param.dtype
    return torch.float32 if name == "float32" else torch.bfloat16


def weights_model(model: Any, name: str = "auto") -> Any:
    """The model detection's forward passes use: ``model`` itself when it already is in
    :func:`weights_dtype`, else a copy in that dtype (the served model, which generation
    uses, is left as it is). A bfloat16 copy of SmolLM2-135M holds 270 MB."""
    dtype = weights_dtype(name, model)
    if next(model.parameters()).dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype).eval()


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


def windows(ids: Sequence[int], width: int) -> list[list[int]]:
    """A text cut into windows of at most ``width`` tokens (one window if it fits)."""
    tokens = [int(t) for t in ids]
    if len(tokens) <= width:
        return [tokens]
    return [tokens[i : i + width] for i in range(0, len(tokens), width)]


def join_windows(cut: Sequence[Sequence[object]], found: Sequence[F64]) -> list[F64]:
    """Each text's weights from its windows' (``found``: every text's windows in turn,
    as :func:`windows` cut them into ``cut``), joined back into one array per text."""
    joined: list[F64] = []
    at = 0
    for parts in cut:
        joined.append(np.concatenate(found[at : at + len(parts)]))
        at += len(parts)
    return joined


def windowed_token_weights(
    model: Any,
    texts: Sequence[Sequence[int]],
    width: int = WINDOW_TOKENS,
    batch_size: int = DEFAULT_BATCH,
    pad_token_id: int = 0,
) -> list[F64]:
    """:func:`model_token_weights` as the service's HF engine computes them: texts
    longer than ``width`` tokens read in windows, each from its own start, and the
    windows batched longest first (like lengths, little padding). The weights still
    depend on the text and the model only."""
    cut = [windows(t, width) for t in texts]
    flat = [w for parts in cut for w in parts]
    order = sorted(range(len(flat)), key=lambda i: -len(flat[i]))
    found = model_token_weights(
        model, [flat[i] for i in order], batch_size=batch_size, pad_token_id=pad_token_id
    )
    out: list[F64] = [np.empty(0)] * len(flat)
    for i, w in zip(order, found, strict=True):
        out[i] = w
    return join_windows(cut, out)


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
    first = max(0, 1 - off)
    spans = [(i, len(text) - first) for i, text in enumerate(batch) if len(text) > first]
    if not spans:
        return result
    r_all = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in spans])
    p_all = torch.cat([torch.arange(first + off - 1, len(batch[i]) + off - 1) for i, _ in spans])
    # the n-gram bans as (row of the flat list, banned id) pairs
    ban_r: list[int] = []
    ban_c: list[int] = []
    at = 0
    for i, n in spans:
        if sampling.no_repeat_ngram_size:
            for j, banned in enumerate(ngram_bans(batch[i], sampling.no_repeat_ngram_size)[first:]):
                ban_r.extend([at + j] * len(banned))
                ban_c.extend(banned)
        at += n
    ban_at = np.asarray(ban_r, dtype=np.int64)
    ban_rows = torch.tensor(ban_r, dtype=torch.long)
    ban_cols = torch.tensor(ban_c, dtype=torch.long)
    values = np.empty(at)
    for s in range(0, at, chunk):
        e = min(at, s + chunk)
        # in the model's dtype: bfloat16 to float32 is exact and monotone, so the top-k
        # values are the same found before the conversion (half the memory traffic)
        logits = head(hidden[r_all[s:e].to(device), p_all[s:e].to(device)])
        lo, hi = np.searchsorted(ban_at, [s, e]).tolist()
        if hi > lo:
            r_idx = (ban_rows[lo:hi] - s).to(device)
            banned_rows = torch.unique(r_idx)
            saved = logits[banned_rows].clone()  # only the rows with bans (few)
            logits[r_idx, ban_cols[lo:hi].to(device)] = -torch.inf
            empty = ~torch.isfinite(logits[banned_rows]).any(dim=1)
            if bool(empty.any()):  # bans that leave nothing are lifted (as the sampler does)
                logits[banned_rows[empty]] = saved[empty]
        values[s:e] = informativeness_torch(logits, sampling).cpu().numpy()
    at = 0
    for i, n in spans:
        result[i][first:] = values[at : at + n]
        at += n
    return result


def top_values(x: torch.Tensor, k: int, block: int = BLOCK) -> torch.Tensor:
    """``torch.topk(x, k).values`` of each row of (R, V), exactly, at a fraction of its
    cost for k much smaller than V: the rows are cut into blocks of ``block``, and the k
    blocks with the largest maxima hold the k largest values (ties included: every
    block whose maximum is among the k largest values is one of them, or k others at
    least as large are), so topk runs over k * block candidates, not V."""
    rows, vocab = x.shape
    blocks = -(-vocab // block)
    if k >= vocab or blocks <= 2 * k:
        return torch.topk(x, min(k, vocab), dim=-1).values
    if blocks * block != vocab:
        x = torch.cat([x, x.new_full((rows, blocks * block - vocab), -torch.inf)], dim=1)
    cut = x.view(rows, blocks, block)
    _, best = torch.topk(cut.amax(dim=-1), k, dim=-1)
    picked = cut[torch.arange(rows, device=x.device)[:, None], best]
    return torch.topk(picked.reshape(rows, k * block), k, dim=-1).values


def informativeness_torch(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``1 - sum p^2`` of each row of (R, V) logits (float32 or narrower) filtered as the
    service filters (temperature, top-k, top-p; as
    :func:`worldcup_core.sampling.filter_logits_torch`: the same operations on the same
    values, so the same float64 result), from the top-k values alone
    (:func:`top_values`)."""
    rows, vocab = logits.shape
    device = logits.device
    k = sampling.top_k if 0 < sampling.top_k < vocab else vocab
    temp = torch.tensor([sampling.temperature], dtype=torch.float32, device=device)[:, None]
    values = top_values(logits, k).float() / temp
    probs = torch.softmax(values, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    cut = before >= torch.tensor([sampling.top_p], dtype=torch.float32, device=device)[:, None]
    cut[:, 0] = False
    probs64 = probs.masked_fill(cut, 0.0).double()
    probs64 /= probs64.sum(dim=1, keepdim=True)
    out: torch.Tensor = (1.0 - (probs64 * probs64).sum(dim=1)).clamp(0.0, 1.0)
    return out


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
