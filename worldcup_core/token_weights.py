"""How much watermark each token of a text can carry, from the served model and the text alone.

At temperature 0.7 a fifth or more of a chat answer's tokens are near-deterministic:
the filtered next-token distribution holds one candidate, or one that takes almost
all the mass, and the tournament cannot move it. Their g-bits are then coin flips
even in a watermarked text, and counting them as much as the others dilutes the
evidence. A token's **informativeness** is

    a_t = 1 - sum_x p_t(x)^2,

``p_t`` the model's next-token distribution at t given the text's own prefix, filtered
as the service filters (:data:`DETECTION_SAMPLING`: the n-gram bans the text itself
implies, temperature, top-k, top-p; :func:`worldcup_core.sampling.filter_logits_torch`).
``a_t`` is the chance that two independent draws from ``p_t`` differ: a tournament
match between them is the only place a g-value can bias the choice, and the first
layer's expected g-value shift is exactly ``a_t / 4``. 0 for a forced token, near 1
for a flat one.

The weights depend on the text and the model only, never on the key: under H0 (a text
written without the key) the g-bits stay i.i.d. fair coins given the weights, so the
weighted statistics (:mod:`worldcup_core.detector_model`) keep their exact null laws,
whatever the model or the sampling assumed here. The text's true prompt and sampling
are unknown to a detector; better guesses only add power.

Numpy only; :mod:`worldcup_core.model_weights` runs the model (torch, batched).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from worldcup_core.config import SamplingConfig
from worldcup_core.sampling import NGramBlocker

F64 = npt.NDArray[np.float64]

# What a detector assumes about how a text was sampled: the service's chat settings
# (temperature 0.7, /generate's top-k, top-p and no-repeat n-gram size).
DETECTION_SAMPLING = SamplingConfig(
    temperature=0.7, top_k=50, top_p=0.95, no_repeat_ngram_size=4, max_new_tokens=1
)


def ngram_bans(token_ids: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """``bans[t]``: the ids that would repeat an n-gram of ``token_ids[:t]`` at position t
    (as the generator's :class:`~worldcup_core.sampling.NGramBlocker`, the text's own
    tokens only: a detector does not see the prompt)."""
    blocker = NGramBlocker(size, ())
    out: list[tuple[int, ...]] = []
    for tok in token_ids:
        out.append(tuple(sorted(blocker.banned())))
        blocker.push(int(tok))
    return out


def filtered_distributions(
    logits: npt.NDArray[np.floating], sampling: SamplingConfig = DETECTION_SAMPLING
) -> F64:
    """Rows (n, V) of logits, filtered as the service does: temperature, top-k, then
    top-p (the smallest prefix, by probability, whose mass before it is below
    ``top_p``; the first candidate always stays). Returns (n, K) probabilities sorted
    descending, 0 where filtered out, each row summing to 1 (as
    :func:`worldcup_core.sampling.filter_logits_torch`)."""
    x = np.asarray(logits, dtype=np.float64) / sampling.temperature
    vocab = x.shape[1]
    k = sampling.top_k if 0 < sampling.top_k < vocab else vocab
    top = np.partition(x, vocab - k, axis=1)[:, vocab - k :] if k < vocab else x
    top = -np.sort(-top, axis=1)
    with np.errstate(invalid="ignore"):
        z = np.exp(top - top[:, :1])
    z = np.nan_to_num(z, nan=0.0)
    probs = z / z.sum(axis=1, keepdims=True)
    before = np.cumsum(probs, axis=1) - probs
    cut = before >= sampling.top_p
    cut[:, 0] = False
    probs = np.where(cut, 0.0, probs)
    out: F64 = probs / probs.sum(axis=1, keepdims=True)
    return out


def informativeness(probs: npt.NDArray[np.floating]) -> F64:
    """``1 - sum p^2`` of each row of (..., K) probabilities (normalised first)."""
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum(axis=-1, keepdims=True)
    out: F64 = np.clip(1.0 - (p * p).sum(axis=-1), 0.0, 1.0)
    return out


def token_weights_from_logits(
    logits: npt.NDArray[np.floating],
    token_ids: Sequence[int],
    sampling: SamplingConfig = DETECTION_SAMPLING,
    first: int = 1,
) -> F64:
    """The informativeness of every token of a text, from the model's logits over it.

    ``logits[i]`` (n, V) is the model's next-token logits before token ``first + i``
    (given the text's tokens before it, and whatever fixed prefix the caller ran the
    model on). Returns one value per token of ``token_ids``: ``a_t`` in [0, 1] where a
    row of logits exists, NaN elsewhere (no model evidence: the statistics weigh such
    a token as the model-free statistic does). The n-gram bans the text implies are
    applied before filtering.
    """
    ids = [int(t) for t in token_ids]
    x = np.array(logits, dtype=np.float64, copy=True)
    if x.ndim != 2 or first < 0 or first + x.shape[0] > len(ids):
        raise ValueError(
            f"logits {x.shape} do not fit a text of {len(ids)} tokens from position {first}"
        )
    if sampling.no_repeat_ngram_size:
        bans = ngram_bans(ids, sampling.no_repeat_ngram_size)
        for i in range(x.shape[0]):
            banned = list(bans[first + i])
            if banned:
                saved = x[i].copy()
                x[i, banned] = -np.inf
                if not np.isfinite(x[i]).any():  # bans that leave nothing are lifted
                    x[i] = saved
    out = np.full(len(ids), np.nan)
    if x.shape[0]:
        out[first : first + x.shape[0]] = informativeness(filtered_distributions(x, sampling))
    return out


def token_weights_from_top(
    rows: Sequence[Sequence[tuple[int, float]] | None],
    token_ids: Sequence[int],
    sampling: SamplingConfig = DETECTION_SAMPLING,
    first: int = 1,
) -> F64:
    """:func:`token_weights_from_logits` from each position's top N alone (issue #44).

    ``rows[i]`` is None (no distribution: NaN there) or the (token id, log-prob) pairs
    of the ``N`` most likely tokens of the model's next-token distribution before token
    ``first + i`` (what vLLM's ``prompt_logprobs=N`` returns). Log-probs differ from
    logits by a constant per row, so the same computation runs on the sparse row: the
    text's n-gram bans drop their ids, then temperature, top-k and top-p filter what is
    left. The filter renormalises over the top k after the bans only, so the result is
    **exact** (to rounding) wherever a row holds that whole top k (``N >= top_k`` plus
    the row's bans); a shorter row misses candidates and ``a_t`` comes out lower. A row
    whose every entry is banned says nothing of the rest of the vocabulary: NaN there
    (the full-row function would have ranked the tokens beyond N).
    """
    ids = [int(t) for t in token_ids]
    if first < 0 or first + len(rows) > len(ids):
        raise ValueError(
            f"{len(rows)} rows do not fit a text of {len(ids)} tokens from position {first}"
        )
    size = sampling.no_repeat_ngram_size
    bans = ngram_bans(ids, size) if size else [()] * len(ids)
    kept: list[tuple[int, list[float]]] = []
    for i, row in enumerate(rows):
        if row is None:
            continue
        banned = set(bans[first + i])
        values = [float(v) for t, v in row if int(t) not in banned and np.isfinite(v)]
        if values:
            kept.append((first + i, values))
    out = np.full(len(ids), np.nan)
    if kept:
        width = max(len(v) for _, v in kept)
        x = np.full((len(kept), width), -np.inf)
        for j, (_, values) in enumerate(kept):
            x[j, : len(values)] = values
        at = np.array([t for t, _ in kept])
        out[at] = informativeness(filtered_distributions(x, sampling))
    return out
