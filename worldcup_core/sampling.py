"""Logits processing before the watermark: bans, temperature, top-k, top-p.

Order matters: the watermark must see the *final* filtered distribution,
because anything that reshapes probabilities after it (another top-p, a
temperature) would undo the tournament's bias. So this module runs first and
the scheme's ``reweight`` last, on the surviving candidates only -- which also
keeps PRF work to ~top_k hashes per step instead of the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch


def filter_logits_torch(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row temperature, top-k (0 = off) and top-p over a (B, V) batch, on its device.

    Returns candidate ids (int64) and float64 probabilities of shape (B, K), sorted
    by probability; filtered-out slots have probability exactly 0 and come last.
    """
    batch, vocab = logits.shape
    device = logits.device
    temp = torch.tensor(temperature, dtype=torch.float32, device=device)[:, None]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    width = max(ks)
    values, ids = torch.topk(logits.float() / temp, width, dim=-1)
    rank = torch.arange(width, device=device)[None, :]
    values = values.masked_fill(rank >= torch.tensor(ks, device=device)[:, None], -torch.inf)
    probs = torch.softmax(values, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    cut = before >= torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
    cut[:, 0] = False
    probs64 = probs.masked_fill(cut, 0.0).double()
    probs64 /= probs64.sum(dim=1, keepdim=True)
    return ids, probs64


def filter_logits(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """:func:`filter_logits_torch`, returned as numpy arrays on the CPU."""
    ids, probs = filter_logits_torch(logits, temperature, top_k, top_p)
    return ids.cpu().numpy().astype(np.int64), probs.cpu().numpy()


def sample_rows(
    candidates: torch.Tensor, probs: torch.Tensor, uniforms: Sequence[float]
) -> list[int]:
    """One draw per row from ``probs`` over ``candidates`` by inverse CDF.

    With ``uniforms[i] = rng.random()`` this is exactly what numpy's
    ``rng.choice(n, p=p)`` does (cumulative sum, normalised, ``searchsorted`` on the
    right), for the whole batch in one pass on the device.
    """
    cdf = probs.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    u = torch.tensor(list(uniforms), dtype=cdf.dtype, device=cdf.device)[:, None]
    index = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)
    out: list[int] = candidates.gather(1, index)[:, 0].tolist()
    return out


class NGramBlocker:
    """Bans tokens that would repeat an n-gram (as HF's no_repeat_ngram_size)."""

    def __init__(self, size: int, prefix: Sequence[int]) -> None:
        self.size = size
        self._tokens: list[int] = []
        self._next: dict[tuple[int, ...], set[int]] = {}
        for tok in prefix:
            self.push(int(tok))

    def push(self, token: int) -> None:
        self._tokens.append(token)
        if self.size and len(self._tokens) >= self.size:
            gram = tuple(self._tokens[-self.size :])
            self._next.setdefault(gram[:-1], set()).add(gram[-1])

    def banned(self) -> set[int]:
        if not self.size or len(self._tokens) < self.size - 1:
            return set()
        key = tuple(self._tokens[len(self._tokens) - self.size + 1 :])
        return self._next.get(key, set())
