"""The stealing attacker's learner and spoofer (Jovanović, Staab and Vechev, ICML 2024).

**What is counted.** For each answer the attacker collected, the tokens the scheme
biases: the first occurrence of each context (the last ``width`` generated tokens,
sentinel-padded, :func:`worldcup_core.prf.context_at`) in the answer; the scheme is
public, so the attacker knows repeated contexts are left alone. For a context ``x`` and
a token ``u`` it keeps

* ``n(x, u)``: how often ``u`` followed ``x`` in the watermarked answers;
* ``E(x, u)``: how often the base model would have put ``u`` there, the sum over the same
  positions of its sampling probability of ``u`` (softmax at temperature 1, cut to the
  top-p nucleus as the sampler cuts it, from the top-20 log-probabilities and the
  sampled token's own).

Their ratio, shrunk towards 1 by ``prior`` pseudo-counts, is the stealing signal:
``r = (n + prior) / (E + prior)``, and the score ``s = clip(log r / log rho, -1, 1)``
(``rho = 2``: a token twice as frequent as the base model makes it scores 1). A token
seen only once after a context (``n < min_count``) gets no positive score: boosting it
would replay that one answer verbatim, a copy of watermarked text (piggybacking,
measured apart) rather than a spoof learned from statistics. Counts
are kept at the full width and at every partial width (the last ``w < width`` tokens);
the spoofer backs off from the widest table that knows a context to narrower ones,
down-weighted (``partial_weight``), as the paper combines its partial contexts.

**Payload-conditioned counts.** Under per-request payloads a context's favoured tokens
depend on the payload bit its (secret) message position carries: averaged over random
payloads, nothing is favoured. Where the attacker knows its answers' payloads (the API
returns them) and they vary, it splits a frequent context's occurrences by each payload
bit ``j`` in turn and keeps the ``j`` under which the split explains the tokens best
(the largest gain in ``sum n log(n / E)``, a G-statistic): the bit the context most
plausibly carries. It then keeps the counts of each half. A spoof that aims at payload
``P`` scores a context with the half ``P[j]`` selects.

**The adaptive spoofer** (``SpoofPlan.steer``) knows of the service's spoof-artifact
check, which looks for a text's watermark in contexts the tenant's texts rarely use. On
top of the boost it adds ``steer`` logits to every token that leads into a context seen
in at least ``common_min`` of its answers (:meth:`Learned.common_next`), so its text
keeps to common contexts, where it learned the watermark.

Pure numpy over plain lists: no model, no key. The key stays with the judge.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from worldcup_core.baselines.cells import first_contexts
from worldcup_core.message import Payload
from worldcup_core.prf import Context, context_at
from worldcup_core.tournament import FloatArray

IntArray = npt.NDArray[np.int64]
Base = Sequence[Any]  # per position: [sampled logprob, [[id, logprob], ...top-20]]


@dataclass(frozen=True)
class Scores:
    """Scored tokens of one context: ids and their scores in [-1, 1]."""

    ids: IntArray
    scores: FloatArray
    occurrences: int


@dataclass(frozen=True)
class Conditioned:
    """A context's payload-conditioned scores: the bit it most plausibly carries, the
    scores under each value of that bit, and the G-gain that chose it."""

    bit: int
    ids: IntArray
    scores: tuple[FloatArray, FloatArray]
    occurrences: int
    gain: float


@dataclass(frozen=True)
class LearnerConfig:
    width: int = 2  # the scheme's context width (public)
    prior: float = 1.0  # pseudo-counts shrinking n/E towards 1
    rho: float = 2.0  # the ratio that scores 1
    top_p: float = 0.95  # the sampler's nucleus (the attacker's own request)
    min_conditioned: int = 8  # occurrences a context needs for a payload split
    min_count: int = 2  # a token is boosted only after this many sightings


@dataclass
class Learned:
    """What the attacker learned: one table per width (``tables[w]``, w = width..1) and
    the payload-conditioned table at the full width (empty without varying payloads)."""

    config: LearnerConfig
    tables: dict[int, dict[Context, Scores]] = field(default_factory=dict)
    conditioned: dict[Context, Conditioned] = field(default_factory=dict)
    positions: int = 0  # biased positions counted
    _common_next: dict[int, dict[Context, IntArray]] = field(default_factory=dict, repr=False)

    def common_next(self, min_answers: int) -> dict[Context, IntArray]:
        """Per full-width context's last ``width - 1`` tokens: the tokens that complete
        it into a context seen in at least ``min_answers`` answers (counted once an
        answer, as the service counts its texts)."""
        if min_answers not in self._common_next:
            index: dict[Context, list[int]] = {}
            for ctx, hit in self.tables.get(self.config.width, {}).items():
                if hit.occurrences >= min_answers:
                    index.setdefault(ctx[:-1], []).append(ctx[-1])
            self._common_next[min_answers] = {
                k: np.array(v, dtype=np.int64) for k, v in index.items()
            }
        return self._common_next[min_answers]

    def summary(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "contexts": {str(w): len(t) for w, t in self.tables.items()},
            "conditioned_contexts": len(self.conditioned),
            "conditioned_positions": sum(c.occurrences for c in self.conditioned.values()),
        }


def base_probs(base: Sequence[Any], token: int, top_p: float) -> dict[int, float]:
    """The sampler's probability of each known token at one position: the model's
    softmax (top 20, and the sampled ``token``), cut to the top-p nucleus and
    renormalised as the sampler does (the nucleus mass is ``top_p`` where the top 20 do
    not reach it)."""
    sampled_lp, top = base
    probs = sorted(((int(t), math.exp(float(lp))) for t, lp in top), key=lambda x: -x[1])
    kept: dict[int, float] = {}
    mass = 0.0
    for t, p in probs:
        kept[t] = p
        mass += p
        if mass >= top_p:
            break
    z = mass if mass >= top_p else top_p
    out = {t: p / z for t, p in kept.items()}
    if token not in out:
        out[token] = math.exp(float(sampled_lp)) / z
    return out


def _score(n: FloatArray, e: FloatArray, cfg: LearnerConfig) -> FloatArray:
    ratio = (n + cfg.prior) / (e + cfg.prior)
    out: FloatArray = np.clip(np.log(ratio) / math.log(cfg.rho), -1.0, 1.0)
    out[(n < cfg.min_count) & (out > 0)] = 0.0  # seen once: a copy, not a statistic
    return out


def learn(
    answers: Iterable[tuple[Sequence[int], Sequence[Any], str | None]],
    config: LearnerConfig,
) -> Learned:
    """Stealing counts from ``(tokens, base, payload bits or None)`` per answer."""
    width = config.width
    counts: dict[int, dict[Context, dict[int, list[float]]]] = {w: {} for w in range(1, width + 1)}
    occurrences: dict[Context, list[tuple[int, dict[int, float], str | None]]] = {}
    positions = 0
    for tokens, base, bits in answers:
        ids = [int(t) for t in tokens]
        for t, _ in first_contexts(ids, width):
            if t >= len(base):
                break
            probs = base_probs(base[t], ids[t], config.top_p)
            full = context_at(ids, t, width)
            positions += 1
            for w in range(1, width + 1):
                cell = counts[w].setdefault(full[width - w :], {})
                for u, p in probs.items():
                    cell.setdefault(u, [0.0, 0.0])[1] += p
                cell[ids[t]][0] += 1.0
            if bits is not None:
                occurrences.setdefault(full, []).append((ids[t], probs, bits))
    learned = Learned(config, positions=positions)
    for w, table in counts.items():
        out: dict[Context, Scores] = {}
        for ctx, cell in table.items():
            toks = np.fromiter(cell.keys(), dtype=np.int64, count=len(cell))
            ne = np.array(list(cell.values()), dtype=np.float64)
            out[ctx] = Scores(toks, _score(ne[:, 0], ne[:, 1], config), int(ne[:, 0].sum()))
        learned.tables[w] = out
    learned.conditioned = _conditioned(occurrences, config)
    return learned


def _conditioned(
    occurrences: dict[Context, list[tuple[int, dict[int, float], str | None]]],
    cfg: LearnerConfig,
) -> dict[Context, Conditioned]:
    """Per frequent context: the payload bit that best splits its tokens, and the
    scores of each half (see the module docstring)."""
    out: dict[Context, Conditioned] = {}
    for ctx, occ in occurrences.items():
        if len(occ) < cfg.min_conditioned:
            continue
        bits = np.array([[c == "1" for c in b or ""] for _, _, b in occ], dtype=np.float64)
        if bits.size == 0 or not (bits.min(axis=0) != bits.max(axis=0)).any():
            continue  # one payload only: nothing to split
        vocab = sorted({u for _, probs, _ in occ for u in probs})
        col = {u: i for i, u in enumerate(vocab)}
        onehot = np.zeros((len(occ), len(vocab)))
        expect = np.zeros((len(occ), len(vocab)))
        for i, (tok, probs, _) in enumerate(occ):
            onehot[i, col[tok]] = 1.0
            for u, p in probs.items():
                expect[i, col[u]] = p
        n1, e1 = onehot.T @ bits, expect.T @ bits  # (U, L): where bit j is 1
        n0, e0 = onehot.T @ (1.0 - bits), expect.T @ (1.0 - bits)
        gain = (_g(n1, e1, cfg.prior) + _g(n0, e0, cfg.prior)).sum(axis=0)
        gain[bits.min(axis=0) == bits.max(axis=0)] = -np.inf  # a bit that never varied
        j = int(np.argmax(gain))
        base_gain = float(_g(n0[:, j] + n1[:, j], e0[:, j] + e1[:, j], cfg.prior).sum())
        out[ctx] = Conditioned(
            bit=j,
            ids=np.array(vocab, dtype=np.int64),
            scores=(_score(n0[:, j], e0[:, j], cfg), _score(n1[:, j], e1[:, j], cfg)),
            occurrences=len(occ),
            gain=float(gain[j]) - base_gain,
        )
    return out


def _g(n: FloatArray, e: FloatArray, prior: float) -> FloatArray:
    """``n log(n / E)`` per cell, shrunk as the scores are."""
    out: FloatArray = n * np.log((n + prior) / (e + prior))
    return out


# ----------------------------------------------------------------------------- spoofing


@dataclass(frozen=True)
class SpoofPlan:
    """How the spoofer boosts: ``delta`` times the learned scores; ``conditioned``: aim
    at the payload of each request (the conditioned table, then ``fallback`` to the
    unconditioned ones where a context has no split)."""

    learned: Learned
    delta: float
    conditioned: bool = False
    fallback: bool = True
    partial_weight: float = 0.5
    # the adaptive spoofer: ``steer`` added to every token that leads into a context
    # the attacker saw in at least ``common_min`` answers, so that its text keeps to
    # contexts the service also counts as common (what the spoof-artifact check reads)
    steer: float = 0.0
    common_min: int = 5


class SpoofSequence:
    """Per-response hooks (a :class:`~worldcup_core.scheme.SequenceWatermark`): the
    boost goes on the full-vocabulary logits before the sampler's filters, at each
    fresh context (a repeated one is not scored by any detector)."""

    modifies_logits = True

    def __init__(self, plan: SpoofPlan, target: str | None, prefix: Sequence[int] = ()) -> None:
        self.plan = plan
        self.target = target
        self.generated: list[int] = []
        self._seen: set[Context] = set()
        self.boosted = 0
        for token in prefix:  # a text being edited: its contexts so far, as if generated
            self.observe(token)

    def boost(self) -> tuple[IntArray, FloatArray] | None:
        """(ids, added logits) at this step, or None."""
        plan, learned = self.plan, self.plan.learned
        width = learned.config.width
        full = context_at(self.generated, len(self.generated), width)
        if full in self._seen:
            return None
        if plan.conditioned and self.target is not None:
            cond = learned.conditioned.get(full)
            if cond is not None:
                value = int(self.target[cond.bit]) if cond.bit < len(self.target) else 0
                return cond.ids, plan.delta * cond.scores[value]
            if not plan.fallback:
                return None
        for w in range(width, 0, -1):
            hit = learned.tables.get(w, {}).get(full[width - w :])
            if hit is not None:
                weight = 1.0 if w == width else plan.partial_weight
                return hit.ids, plan.delta * weight * hit.scores
        return None

    def steering(self) -> IntArray | None:
        """The tokens the adaptive spoofer favours at this step (``plan.steer``): those
        whose next context the attacker saw in ``plan.common_min`` answers or more."""
        if self.plan.steer == 0.0:
            return None
        width = self.plan.learned.config.width
        prefix = context_at(self.generated, len(self.generated), width)[1:]
        return self.plan.learned.common_next(self.plan.common_min).get(prefix)

    def process_logits(self, logits: FloatArray) -> FloatArray:
        found, steer = self.boost(), self.steering()
        if found is None and steer is None:
            return logits
        out = logits.copy()
        if steer is not None:
            out[steer[steer < logits.shape[-1]]] += self.plan.steer
        if found is not None:
            ids, add = found
            keep = ids < logits.shape[-1]
            out[ids[keep]] += add[keep]
            self.boosted += 1
        return out

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        return probs

    def observe(self, token: int) -> None:
        width = self.plan.learned.config.width
        self._seen.add(context_at(self.generated, len(self.generated), width))
        self.generated.append(int(token))


class Spoofer:
    """The spoofer as a scheme the generation loop runs per row (its ``sequence``); the
    request's payload is the payload a conditioned spoof aims at."""

    name = "spoof"
    version = "stealing"

    def __init__(self, plan: SpoofPlan, prefix: Sequence[int] = ()) -> None:
        self.plan = plan
        self.prefix = tuple(prefix)  # the answer so far, when a span of a text is redrawn

    def sequence(self, payload: Payload) -> SpoofSequence:
        return SpoofSequence(self.plan, payload.bits, self.prefix)
