"""worldcup_core.context_sketch: the counts of issued texts' contexts and the spoof-artifact
test read against them (issue #45). The sketch against exact counts (brute force), its
keyed cells, and the rule on synthetic evidence."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from worldcup_core.context_sketch import (
    MAX_COUNT,
    ContextSketch,
    Split,
    conservative_update,
    context_cells,
    leave_one_out,
    split_evidence,
    spoof_artifact,
)
from worldcup_core.prf import WatermarkKey

KEY = WatermarkKey(bytes(range(32)))


def _texts(rng: np.random.Generator, n: int, vocab: int) -> list[list[tuple[int, int]]]:
    """Texts of width-2 contexts drawn Zipf-like (a few common, most rare)."""
    out = []
    for _ in range(n):
        a = np.minimum(rng.zipf(1.3, 60), vocab) - 1
        b = rng.integers(0, 3, 60)
        out.append(list(zip(a.tolist(), b.tolist(), strict=True)))
    return out


def _cells(key: WatermarkKey, contexts: list[tuple[int, int]], width_log2: int) -> np.ndarray:
    ids = [t for ctx in contexts for t in (*ctx, 0)]  # each context, then a scored token
    return context_cells(key, ids, [3 * i + 2 for i in range(len(contexts))], 2, 4, width_log2)


def test_the_sketch_never_undercounts_and_is_exact_when_roomy() -> None:
    """Against exact per-text counts (each context once per text): a crowded sketch only
    overcounts; a roomy one is exact for nearly every context; conservative update
    overcounts less than plain count-min over the same cells."""
    rng = np.random.default_rng(7)
    texts = _texts(rng, 400, 5000)
    exact = Counter(ctx for text in texts for ctx in set(text))
    contexts = sorted(exact)
    true = np.array([exact[c] for c in contexts])
    for width_log2, exact_share in ((6, 0.0), (16, 0.99)):
        sketch = ContextSketch(4, width_log2)
        plain = np.zeros((4, 1 << width_log2), dtype=np.int64)
        for text in texts:
            cells = _cells(KEY, text, width_log2)
            sketch.add_text(cells)
            unique = np.unique(cells, axis=0)
            np.add.at(plain, (np.broadcast_to(np.arange(4), unique.shape), unique), 1)
        cells = _cells(KEY, contexts, width_log2)
        est = sketch.counts(cells)
        plain_est = plain[np.arange(4), cells].min(axis=1)
        assert (est >= np.minimum(true, MAX_COUNT)).all()
        assert (est <= plain_est).all()
        assert np.mean(est == true) >= exact_share
        if width_log2 == 6:  # crowded: conservative update's gain is visible
            assert (est - true).mean() < 0.8 * (plain_est - true).mean()


def test_a_text_counts_its_contexts_once_and_counters_saturate() -> None:
    sketch = ContextSketch(4, 10)
    cells = _cells(KEY, [(1, 2), (1, 2), (3, 4)], 10)
    sketch.add_text(cells)
    assert sketch.counts(cells).tolist() == [1, 1, 1]
    for _ in range(MAX_COUNT + 20):
        sketch.add_text(cells[:1])
    assert sketch.counts(cells[:1]).tolist() == [MAX_COUNT]
    assert conservative_update(np.array([[3, 5, 9, 3]])).tolist() == [[4, 5, 9, 4]]
    assert conservative_update(np.array([[MAX_COUNT] * 4])).tolist() == [[MAX_COUNT] * 4]
    assert leave_one_out([0, 1, 7]) == [0, 0, 6]


def test_cells_are_keyed_uniform_and_refuse_a_missing_context() -> None:
    """Cells depend on the key and the context's tokens only (not on the token scored);
    over many contexts each row's cells are uniform (chi-square)."""
    ids = [5, 6, 7, 5, 6, 9]
    one = context_cells(KEY, ids, [2, 5], 2)
    assert one.shape == (2, 4) and (one[0] == one[1]).all()  # context (5, 6) both times
    other = context_cells(WatermarkKey(bytes(32)), ids, [2], 2)
    assert not (other[0] == one[0]).all()
    assert not (context_cells(KEY, ids, [3], 3)[0] == context_cells(KEY, ids, [3], 2)[0]).all()
    rng = np.random.default_rng(3)
    many = context_cells(KEY, rng.integers(0, 50_000, 8001).tolist(), range(1, 8001), 1, 4, 6)
    for row in range(4):
        counts = np.bincount(many[:, row], minlength=64)
        assert stats.chisquare(counts).pvalue > 1e-4
    with pytest.raises(ValueError, match="no 2 tokens before it"):
        context_cells(KEY, ids, [1], 2)
    with pytest.raises(ValueError, match="width_log2"):
        ContextSketch(4, 40)


def test_the_rule_flags_evidence_in_common_contexts_only() -> None:
    """R is about N(0, 1) when rare contexts carry no watermark (KS); a genuine text
    (evidence everywhere) is not flagged, a spoof (common contexts only) is; no rare
    token, or no common one, is never flagged."""
    rng = np.random.default_rng(11)
    seen = [0] * 40 + [9] * 40
    null_r = [
        split_evidence(rng.normal(0, 1, 80).tolist(), rng.integers(0, 10, 80).tolist()).r
        for _ in range(400)
    ]
    assert stats.kstest(null_r, "norm").pvalue > 1e-3
    genuine = [split_evidence(rng.normal(0.8, 1, 80).tolist(), seen) for _ in range(200)]
    spoofs = [
        split_evidence(np.r_[rng.normal(0, 1, 40), rng.normal(1.6, 1, 40)].tolist(), seen)
        for _ in range(200)
    ]
    assert sum(map(spoof_artifact, genuine)) <= 2
    assert sum(map(spoof_artifact, spoofs)) >= 150
    assert not spoof_artifact(Split(0, 50, math.nan, math.nan))
    assert not spoof_artifact(Split(50, 0, -1.0, math.nan))
