"""worldcup_core.evidence: per-token evidence for the console's heatmap.

Checked against a brute-force loop, for calibration on null text (the leave-one-out
agreement of a token is exactly Binomial(trials, 1/2) there: chi-square), and for
power (a watermarked island inside random text is where the marks say it is).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from scipy import stats

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.evidence import TokenMark, text_evidence, token_marks
from worldcup_core.scoring import TokenEvidence

VOCAB = 49152
KEY = WatermarkKey(bytes(range(32)))


@pytest.fixture(params=["worldcup-v1", "worldcup-v2"])
def scheme(request: pytest.FixtureRequest) -> WorldCup:
    return WorldCup(KEY, WatermarkConfig(version=str(request.param)))


def simulate(wc: WorldCup, payload: Payload, length: int, rng: np.random.Generator) -> list[int]:
    """Watermarked generation over random Dirichlet(0.5) distributions on 50 candidates."""
    seq: Any = wc.sequence(payload)
    for _ in range(length):
        p = rng.dirichlet(np.ones(50) * 0.5)
        cand = rng.choice(VOCAB, 50, replace=False)
        seq.observe(int(cand[rng.choice(50, p=seq.reweight(cand, p))]))
    tokens: list[int] = seq.generated
    return tokens


def brute_force(evidence: TokenEvidence, indices: list[int], symbols: int) -> list[TokenMark]:
    """The definition, token by token."""
    pos = evidence.positions(symbols).tolist()
    tau, k = evidence.trials_per_token, evidence.groups
    marks = []
    for t in range(evidence.num_scored):
        agree = trials = 0
        for j in range(k):
            rest = [u for u in range(evidence.num_scored) if u != t and pos[u] == pos[t]]
            others = sum(int(evidence.ones[u, j]) for u in rest)
            mine = int(evidence.ones[t, j])
            if 2 * others > len(rest) * tau:
                agree, trials = agree + mine, trials + tau
            elif 2 * others < len(rest) * tau:
                agree, trials = agree + tau - mine, trials + tau
        g = tuple(int(evidence.ones[t, j]) / tau for j in range(k))
        marks.append(TokenMark(indices[t], pos[t], g, agree, trials))
    return marks


def test_marks_equal_brute_force(scheme: WorldCup) -> None:
    rng = np.random.default_rng(7)
    for length, bits in [(40, 8), (120, 16), (300, 32), (3, 4)]:
        ids = rng.integers(0, VOCAB, length).tolist()
        ev = scheme.evidence(ids)
        idx = scheme.scored_indices(ids)
        symbols = scheme.config.symbols_for(bits)
        assert token_marks(ev, idx, symbols) == brute_force(ev, idx, symbols)
        assert text_evidence(scheme, ids, bits) == brute_force(ev, idx, symbols)


def test_unscored_tokens_get_no_mark(scheme: WorldCup) -> None:
    """The first c tokens (v2) and repeated contexts carry no evidence, so no mark."""
    ids = [5, 6, 7, 8, 5, 6, 7, 9, 10, 11]  # context (5, 6) repeats at index 6
    marks = text_evidence(scheme, ids, 16)
    indices = [m.index for m in marks]
    assert indices == scheme.scored_indices(ids)
    assert 6 not in indices
    if scheme.version == "worldcup-v2":
        assert min(indices) == 2
    assert all(len(m.g_mean) == 2 and all(0 <= g <= 1 for g in m.g_mean) for m in marks)
    assert text_evidence(scheme, [], 16) == []
    with pytest.raises(ValueError, match="indices"):
        token_marks(scheme.evidence(ids), indices[:-1], 8)


def test_a_token_alone_in_its_cells_has_no_z() -> None:
    ev = TokenEvidence(
        position_u64=np.array([0, 1, 1], dtype=np.uint64),
        ones=np.array([[30, 30], [20, 15], [25, 3]], dtype=np.int64),
        trials_per_token=30,
        num_tokens=3,
        text_digest=b"",
    )
    lone, a, b = token_marks(ev, [0, 1, 2], 2)
    assert lone.trials == 0 and lone.z is None and lone.g_mean == (1.0, 1.0)
    # a's reference is b: group 0 leans to bit 0 (25 > 15), group 1 to bit 1 (3 < 15)
    assert (a.agree, a.trials) == (20 + 30 - 15, 60)
    assert a.z == pytest.approx((2 * 35 - 60) / math.sqrt(60))
    assert (b.agree, b.trials) == (25, 30)  # group 1: a's 15 of 30 is a tie, no reference


def test_null_agreement_is_exactly_binomial(scheme: WorldCup) -> None:
    """On random text each fully referenced token agrees Binomial(k m, 1/2): chi-square
    over the pooled counts (power: a shift of the mean by 0.4 g-bit is detected)."""
    rng = np.random.default_rng(11)
    agree = []
    for _ in range(40):
        ids = rng.integers(0, VOCAB, 200).tolist()
        for m in text_evidence(scheme, ids, 16):
            if m.trials == 60:
                agree.append(m.agree)
    counts = np.bincount(np.asarray(agree), minlength=61)
    assert counts.sum() > 5000
    expected = stats.binom.pmf(np.arange(61), 60, 0.5) * counts.sum()
    # pool the tails so every bin expects at least 5
    lo, hi = (
        np.searchsorted(np.cumsum(expected), 5),
        60 - np.searchsorted(np.cumsum(expected[::-1]), 5),
    )
    obs = np.concatenate([[counts[:lo].sum()], counts[lo:hi], [counts[hi:].sum()]])
    exp = np.concatenate([[expected[:lo].sum()], expected[lo:hi], [expected[hi:].sum()]])
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    z = (2 * np.asarray(agree) - 60) / math.sqrt(60)
    assert abs(z.mean()) < 4 / math.sqrt(len(z))  # mean 0 within 4 standard errors
    assert abs(z.var() - 1.0) < 0.1
    # power: the same chi-square rejects agreements biased by 0.5 g-bit per token
    shifted = stats.binom.rvs(60, 0.5 + 0.5 / 60, size=len(agree), random_state=1)
    obs_s = np.bincount(shifted, minlength=61)
    obs_s = np.concatenate([[obs_s[:lo].sum()], obs_s[lo:hi], [obs_s[hi:].sum()]])
    assert stats.chisquare(obs_s, exp).pvalue < 1e-3


def smooth(marks: list[TokenMark], length: int, width: int = 25) -> np.ndarray[Any, Any]:
    """Mean z over a window of tokens (no reference counts as 0)."""
    z = np.zeros(length)
    for m in marks:
        z[m.index] = m.z or 0.0
    return np.convolve(z, np.ones(width) / width, mode="same")


def test_a_watermarked_island_is_located(scheme: WorldCup) -> None:
    """human + watermarked + human: the tokens with high smoothed z are the island."""
    rng = np.random.default_rng(3)
    payload = Payload.random(16, rng)
    human1 = rng.integers(0, VOCAB, 150).tolist()
    island = simulate(scheme, payload, 120, rng)
    human2 = rng.integers(0, VOCAB, 150).tolist()
    ids = human1 + island + human2
    marks = text_evidence(scheme, ids, 16)
    inside = [m.z for m in marks if 150 <= m.index < 270 and m.z is not None]
    outside = [m.z for m in marks if not 150 <= m.index < 270 and m.z is not None]
    assert np.mean(inside) > 1.0, np.mean(inside)
    assert abs(np.mean(outside)) < 0.35, np.mean(outside)
    hot = np.flatnonzero(smooth(marks, len(ids)) > 0.8)  # 4 sd of a null window
    assert len(hot) > 80
    assert np.mean((hot >= 150 - 12) & (hot < 270 + 12)) > 0.95  # half a window
