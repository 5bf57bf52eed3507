"""The OpenAI sampling fields and the grammar mask in the one sampling pipeline
(:func:`worldcup_core.pipeline.watermarked_distribution`): each applied before the
watermark, each with the effect its definition says."""

from __future__ import annotations

import math

import numpy as np
import torch

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.batched import BatchedWorldCup
from worldcup_core.pipeline import RowState, watermarked_distribution

VOCAB = 16


def _dist(
    logits: torch.Tensor, row: RowState, batched: BatchedWorldCup | None = None
) -> dict[int, float]:
    cand, q = watermarked_distribution(
        logits[None].clone(), [row], batched or BatchedWorldCup(torch.device("cpu"))
    )
    return {int(c): float(p) for c, p in zip(cand[0], q[0], strict=True) if p > 0}


def _logits() -> torch.Tensor:
    return torch.linspace(2.0, -1.0, VOCAB)  # token 0 most likely, then 1, ...


def test_grammar_mask_comes_before_the_watermark() -> None:
    """The watermarked q (a v2 slot) has its support inside the grammar's allowed ids,
    even where the watermark would favour a forbidden one."""
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[3, 7, 11]] = True
    batched = BatchedWorldCup(torch.device("cpu"))
    scheme = WorldCup(WatermarkKey(bytes(range(32))), WatermarkConfig())
    for seed in range(20):
        batched.set_row(0, scheme, Payload.random(16, np.random.default_rng(seed)))
        batched.append([0], torch.tensor([seed % VOCAB]))
        q = _dist(torch.randn(VOCAB), RowState(top_k=0, slot=0, allowed=allowed), batched)
        assert set(q) <= {3, 7, 11} and math.isclose(sum(q.values()), 1.0)
        batched.clear_row(0)


def test_bans_are_lifted_when_the_grammar_allows_only_banned_ids() -> None:
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[5] = True
    q = _dist(_logits(), RowState(top_k=0, banned={5}, allowed=allowed))
    assert q == {5: 1.0}
    # without a grammar, bans stay
    assert 5 not in _dist(_logits(), RowState(top_k=0, banned={5}))


def test_penalties_logit_bias_and_min_p() -> None:
    base = _dist(_logits(), RowState(top_k=0))
    biased = _dist(_logits(), RowState(top_k=0, logit_bias=((9, 100.0),)))
    assert max(biased, key=biased.__getitem__) == 9 and biased[9] > 0.999
    # frequency: token 0 seen twice, penalty 1 -> its logit drops by 2 (a factor e^2 vs the rest)
    freq = _dist(_logits(), RowState(top_k=0, frequency_penalty=1.0, output=(0, 0)))
    assert math.isclose(freq[0] / freq[1], base[0] / base[1] * math.exp(-2), rel_tol=1e-4)
    pres = _dist(_logits(), RowState(top_k=0, presence_penalty=1.0, output=(0, 0)))
    assert math.isclose(pres[0] / pres[1], base[0] / base[1] * math.exp(-1), rel_tol=1e-4)
    # repetition: token 0's positive logit 2.0 is halved (prompt tokens count too)
    rep = _dist(_logits(), RowState(top_k=0, repetition_penalty=2.0, prompt=(0,)))
    l0, l1 = 2.0, float(_logits()[1])
    assert math.isclose(rep[0] / rep[1], math.exp(l0 / 2 - l1), rel_tol=1e-4)
    # min_p: keep p >= min_p * p_max (after temperature)
    kept = _dist(_logits(), RowState(top_k=0, min_p=0.5))
    assert set(kept) == {j for j, p in base.items() if p >= 0.5 * base[0] - 1e-12}
    assert set(_dist(_logits(), RowState(top_k=0, min_p=1.0))) == {0}


def test_a_repetition_penalty_near_zero_saturates_instead_of_overflowing() -> None:
    """(0, 2] is the field's range: a penalty of 1e-265 divided a positive logit to inf and
    the softmax to NaN (a 500, found by schemathesis). The penalised logits saturate at a
    finite bound: the seen token with the positive logit takes (nearly) all the mass, at
    the lowest temperature too."""
    for temperature in (1.0, 0.01):
        dist = _dist(
            _logits(),
            RowState(top_k=0, temperature=temperature, repetition_penalty=3.9e-265, prompt=(0,)),
        )
        assert all(math.isfinite(p) for p in dist.values())
        assert dist[0] > 0.999
