"""Does a text read like the model's own sampling? A spoof-artifact test, not adopted (#45).

**The idea.** A stealing spoofer (:mod:`worldcup_eval.forgery`) writes with the model's
logits *boosted* towards the tokens it learned to be green (at boost ``delta`` a
learned token gains up to ``e^delta`` in odds), so it might surprise the served model
more than the model's own text does. A genuine answer was drawn from the served model
at temperature <= 1 (top-k, top-p and n-gram bans only remove unlikely candidates).

**The statistic.** At each token t with the model's next-token distribution ``p_t``
(temperature 1, unfiltered: the most permissive sampling the service offers at
temperature <= 1) let

    e_t = -log p_t(x_t) - H(p_t),     v_t = Var_{x ~ p_t}[-log p_t(x)]

(the token's surprisal above the distribution's entropy, and the varentropy). For a
text drawn from ``p`` itself the ``e_t`` are martingale differences with conditional
variances ``v_t``, so ``z = sum e_t / sqrt(sum v_t)`` is about N(0, 1). Drawing cooler
(``p^(1/T)``, T < 1) or truncated moves every draw towards likelier tokens and lowers
each ``e_t``'s mean: ``z`` only goes down. A boosted draw moves it up
(``tests/test_spoof_artifacts.py`` checks all three on synthetic distributions).

**Why it is not a gate** (:mod:`worldcup_eval.fluency_study`,
``docs/results/forgery/fluency-gate.md``). The spoofer boosts *before* the service's
top-k and top-p filters, so every boosted token is still one of the boosted
distribution's likely candidates: on the embedded model its stolen ``delta = 4`` drafts
have ``z`` about -2.1, the same as the service's own answers at its settings (about
-2.7), while the model's own untruncated draws at temperature 1, read without their
prompt, sit at +1.3. No line takes the spoofs and leaves genuine text alone.

Numpy only; the forward pass that gives the logits is the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Surprisal:
    """Per token of a text: the surprisal above entropy ``excess`` (``e_t``) and the
    varentropy ``variance`` (``v_t``); NaN where the model gave no distribution."""

    excess: F64
    variance: F64

    def __post_init__(self) -> None:
        if self.excess.shape != self.variance.shape or self.excess.ndim != 1:
            raise ValueError("excess and variance must be 1-D arrays of one length")


def surprisal_rows(logits: npt.NDArray[np.floating], tokens: npt.ArrayLike) -> tuple[F64, F64]:
    """``(e, v)`` of rows (n, V) of next-token logits at temperature 1 and the n tokens
    that followed them. A token the model gives probability 0 (a logit of -inf) has
    ``e = +inf``: no draw from the model could have produced it."""
    x = np.asarray(logits, dtype=np.float64)
    ids = np.asarray(tokens, dtype=np.int64)
    if x.ndim != 2 or ids.shape != (x.shape[0],):
        raise ValueError(f"logits {x.shape} do not fit {ids.shape} tokens")
    if ids.size and (ids.min() < 0 or ids.max() >= x.shape[1]):
        raise ValueError("a token id is outside the vocabulary")
    top = x.max(axis=1, keepdims=True)
    shifted = x - top
    w = np.exp(shifted)
    z = w.sum(axis=1, keepdims=True)
    logp = shifted - np.log(z)
    p = w / z
    finite = np.where(p > 0, logp, 0.0)
    entropy = -(p * finite).sum(axis=1)
    second = (p * finite * finite).sum(axis=1)
    variance = np.maximum(second - entropy * entropy, 0.0)
    chosen = logp[np.arange(len(ids)), ids]
    excess = -chosen - entropy
    return excess, variance


def surprisal_from_logits(
    logits: npt.NDArray[np.floating], token_ids: Sequence[int], first: int = 1
) -> Surprisal:
    """A text's :class:`Surprisal` from the model's logits over it: ``logits[i]`` is
    the next-token distribution before token ``first + i`` (as
    :func:`worldcup_core.token_weights.token_weights_from_logits`); NaN elsewhere."""
    ids = [int(t) for t in token_ids]
    x = np.asarray(logits)
    if x.ndim != 2 or first < 0 or first + x.shape[0] > len(ids):
        raise ValueError(
            f"logits {x.shape} do not fit a text of {len(ids)} tokens from position {first}"
        )
    excess = np.full(len(ids), np.nan)
    variance = np.full(len(ids), np.nan)
    if x.shape[0]:
        e, v = surprisal_rows(x, ids[first : first + x.shape[0]])
        excess[first : first + x.shape[0]] = e
        variance[first : first + x.shape[0]] = v
    return Surprisal(excess, variance)


def fluency_sums(
    surprisal: Surprisal | None, mask: npt.ArrayLike | None = None
) -> tuple[float, float] | None:
    """``(sum e_t, sum v_t)`` over the tokens with a distribution (and in ``mask``
    where given); ``sum e_t`` is +inf where a token is one the model never draws.
    None for None (no reading). Sums of several texts pool into one ``z``."""
    if surprisal is None:
        return None
    e = surprisal.excess
    v = surprisal.variance
    live = np.isfinite(v) & ~np.isnan(e)
    if mask is not None:
        live &= np.asarray(mask, dtype=bool)
    if np.isposinf(e[live]).any():
        return math.inf, float(v[live].sum())
    return float(e[live].sum()), float(v[live].sum())


def fluency_z(surprisal: Surprisal, mask: npt.ArrayLike | None = None) -> float:
    """``z = sum e_t / sqrt(sum v_t)`` over the tokens with a distribution (and in
    ``mask`` where given): above 0, the text surprises the model more than its own
    draws would. 0 where no token has a spread distribution; +inf where a token is
    one the model never draws."""
    z = pooled_z([fluency_sums(surprisal, mask)])
    assert z is not None
    return z


def pooled_z(sums: Sequence[tuple[float, float] | None]) -> float | None:
    """One ``z`` over texts read together (a collection): their :func:`fluency_sums`
    pooled; None where there are none or any text has no reading."""
    if not sums or any(s is None for s in sums):
        return None
    total_e = sum(s[0] for s in sums if s is not None)
    total_v = sum(s[1] for s in sums if s is not None)
    if math.isinf(total_e):
        return math.inf
    return 0.0 if total_v <= 0.0 else total_e / math.sqrt(total_v)


def fluency_p(z: float) -> float:
    """The one-sided tail ``P(Z >= z)`` of N(0, 1): what ``z`` would mean were the
    null exact (it is not quite: the text is read without its prompt)."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))
