"""The sampling pipeline's order: bans -> logit bias -> filter -> trim -> reweight.

Each test is a case where swapping two neighbouring stages gives another result, so
a reordering of :func:`worldcup_core.pipeline.watermarked_distribution` fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.batched import BatchedWorldCup
from worldcup_core.encoder import IntArray
from worldcup_core.pipeline import RowState, row_bans, watermarked_distribution
from worldcup_core.sampling import NGramBlocker, filter_logits_torch
from worldcup_core.tournament import FloatArray

VOCAB = 12


class _Bias:
    """A KGW-style scheme: adds ``delta`` to one token's logit; records what it saw."""

    modifies_logits = True

    def __init__(self, token: int, delta: float) -> None:
        self.token, self.delta = token, delta
        self.seen_logits: FloatArray | None = None
        self.seen_probs: FloatArray | None = None

    def process_logits(self, logits: FloatArray) -> FloatArray:
        self.seen_logits = logits.copy()
        out = logits.copy()
        out[self.token] += self.delta
        return out

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        self.seen_probs = probs.copy()
        return probs

    def observe(self, token: int) -> None:
        pass


class _Reverse:
    """A reweighting scheme: q is the filtered p reversed over the live candidates."""

    modifies_logits = False

    def __init__(self) -> None:
        self.seen: tuple[IntArray, FloatArray] | None = None

    def process_logits(self, logits: FloatArray) -> FloatArray:
        raise AssertionError("not called: modifies_logits is False")

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        self.seen = (candidates.copy(), probs.copy())
        return probs[::-1].copy()

    def observe(self, token: int) -> None:
        pass


def _logits(*rows: list[float]) -> torch.Tensor:
    out = torch.full((len(rows), VOCAB), -5.0)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def _dist(cand: torch.Tensor, q: torch.Tensor, row: int = 0) -> dict[int, float]:
    return {int(c): float(p) for c, p in zip(cand[row], q[row], strict=True) if p > 0}


@pytest.fixture
def batched() -> BatchedWorldCup:
    return BatchedWorldCup(torch.device("cpu"))


def test_bans_come_before_the_filter(batched: BatchedWorldCup) -> None:
    # top-k 1 after the ban keeps the best allowed token; the other way round the only
    # candidate would be the banned one
    cand, q = watermarked_distribution(
        _logits([5.0, 4.0, 3.0]), [RowState(banned={0}, top_k=1)], batched
    )
    assert _dist(cand, q) == {1: 1.0}


def test_the_logit_bias_comes_before_the_filter(batched: BatchedWorldCup) -> None:
    # the bias lifts token 2 above token 0, so top-k 1 keeps token 2; filtering first
    # would keep token 0 whatever the bias did
    cand, q = watermarked_distribution(
        _logits([5.0, 4.0, 3.0]), [RowState(top_k=1, watermark=_Bias(2, 10.0))], batched
    )
    assert _dist(cand, q) == {2: 1.0}


def test_bans_come_before_the_logit_bias(batched: BatchedWorldCup) -> None:
    # a banned token stays banned even where the bias lifts it, and the scheme sees
    # the ban; biasing first and banning after would give the same support but the
    # scheme would have seen a finite logit for the banned token
    bias = _Bias(0, 100.0)
    cand, q = watermarked_distribution(
        _logits([5.0, 4.0, 3.0]), [RowState(banned={0, 1}, watermark=bias)], batched
    )
    assert bias.seen_logits is not None
    assert np.isneginf(bias.seen_logits[[0, 1]]).all()
    assert np.isfinite(bias.seen_logits[2:]).all()
    assert 0 not in _dist(cand, q) and 1 not in _dist(cand, q)


def test_the_filter_comes_before_the_reweight(batched: BatchedWorldCup) -> None:
    # the scheme sees only top-k's survivors at the row's temperature, and its q is
    # returned as it is: a temperature or top-p after it would reshape q
    wm = _Reverse()
    logits = _logits([3.0, 2.0, 1.0, 0.5])
    cand, q = watermarked_distribution(
        logits, [RowState(temperature=0.5, top_k=3, top_p=1.0, watermark=wm)], batched
    )
    assert wm.seen is not None
    seen_cand, seen_p = wm.seen
    ref_cand, ref_p = filter_logits_torch(logits, [0.5], [3], [1.0])
    assert seen_cand.tolist() == ref_cand[0, :3].tolist()
    np.testing.assert_allclose(seen_p, ref_p[0, :3].numpy())
    assert _dist(cand, q) == pytest.approx(
        {int(c): float(p) for c, p in zip(seen_cand, seen_p[::-1], strict=True)}
    )
    # not re-filtered after the reweight: the least likely survivor now carries the most
    assert max(_dist(cand, q), key=_dist(cand, q).__getitem__) == 2


def test_trim_keeps_the_widest_rows_support_and_rows_keep_their_own_sampling(
    batched: BatchedWorldCup,
) -> None:
    logits = _logits([5.0, 4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 1.5])
    before = logits.clone()
    cand, q = watermarked_distribution(
        logits, [RowState(top_k=2), RowState(top_k=3, banned={2})], batched
    )
    assert torch.equal(logits, before)  # the caller's logits are left alone
    assert cand.shape == q.shape == (2, 3)  # width: the widest row's live candidates
    assert set(_dist(cand, q, 0)) == {0, 1}
    assert set(_dist(cand, q, 1)) == {0, 1, 3}  # 2 banned, its place taken by 0
    for row in range(2):
        assert float(q[row].sum()) == pytest.approx(1.0)


def test_a_batched_v2_row_is_reweighted_and_an_unwatermarked_row_is_not(
    batched: BatchedWorldCup,
) -> None:
    rng = np.random.default_rng(0)
    scheme = WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig(version="worldcup-v2"))
    batched.set_row(0, scheme, Payload("10110010"))
    ctx = torch.tensor(rng.integers(0, VOCAB, 8))
    for t in ctx:
        batched.append([0], t[None])
    logits = torch.tensor(rng.normal(size=(2, VOCAB)), dtype=torch.float32)
    cand, q = watermarked_distribution(logits, [RowState(slot=0), RowState()], batched)
    ref_cand, ref_p = filter_logits_torch(logits, [1.0, 1.0], [0, 0], [1.0, 1.0])
    assert torch.equal(cand, ref_cand)
    assert torch.equal(q[1], ref_p[1])  # no watermark: the filtered distribution
    assert not torch.allclose(q[0], ref_p[0])  # the v2 step moved row 0
    assert float(q[0].sum()) == pytest.approx(1.0)


def test_row_bans_add_eos_only_before_min_new_tokens() -> None:
    blocker = NGramBlocker(2, [4, 5, 4])
    assert row_bans(blocker, 0, 3, [7]) == {5, 7}
    assert row_bans(blocker, 3, 3, [7]) == {5}


def test_rows_and_states_must_match(batched: BatchedWorldCup) -> None:
    with pytest.raises(ValueError, match="row states"):
        watermarked_distribution(_logits([1.0]), [], batched)
