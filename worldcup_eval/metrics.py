"""Detection and extraction metrics, from scores where larger means "watermarked".

The score of a text is ``-log10 p`` of the scheme's calibrated p-value (log
space, so a p-value below the float range still ranks). AUC is the
Mann-Whitney statistic with ties counted half. TPR at a target FPR uses the
*fixed* threshold ``p < FPR`` that the calibration licenses, never a
threshold tuned on the negatives; the empirical FPR of the negatives at the
same threshold is reported beside it, which is the check that the
calibration holds. Best-F1 (a sweep over every threshold, optimistic by
construction) is reported only for comparison with the paper.

>>> auc([3.0, 2.0], [1.0, 0.0])
1.0
>>> auc([1.0], [1.0])
0.5
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

TARGET_FPRS = (0.01, 0.001)


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """P(score of a positive > score of a negative) + half the ties."""
    pos, neg = np.asarray(positives, float), np.asarray(negatives, float)
    if not len(pos) or not len(neg):
        return math.nan
    ranks = stats.rankdata(np.concatenate([pos, neg]))
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def roc_curve(
    positives: Sequence[float], negatives: Sequence[float]
) -> tuple[list[float], list[float]]:
    """(FPR, TPR) at every distinct threshold, from (0, 0) to (1, 1)."""
    pos, neg = np.asarray(positives, float), np.asarray(negatives, float)
    thresholds = np.unique(np.concatenate([pos, neg]))[::-1]
    fpr = [0.0] + [float((neg >= t).mean()) for t in thresholds]
    tpr = [0.0] + [float((pos >= t).mean()) for t in thresholds]
    return fpr, tpr


def best_f1(positives: Sequence[float], negatives: Sequence[float]) -> tuple[float, float]:
    """(best F1, its threshold) over every distinct score as the threshold ``score >= t``."""
    pos, neg = np.asarray(positives, float), np.asarray(negatives, float)
    best, at = 0.0, math.inf
    for t in np.unique(np.concatenate([pos, neg])):
        tp = int((pos >= t).sum())
        fp = int((neg >= t).sum())
        f1 = 2 * tp / (2 * tp + fp + (len(pos) - tp)) if tp else 0.0
        if f1 > best:
            best, at = f1, float(t)
    return best, at


def rate_above(scores: Sequence[float], fpr: float) -> float:
    """Fraction with p < ``fpr``, i.e. score > -log10(fpr)."""
    s = np.asarray(scores, float)
    return float((s > -math.log10(fpr)).mean()) if len(s) else math.nan


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided confidence interval for a binomial rate k/n."""
    if n == 0:
        return math.nan, math.nan
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def bit_accuracy(decoded: str, truth: str) -> float:
    """Share of payload bits recovered; an erasure ``?`` counts as wrong."""
    if len(decoded) != len(truth):
        raise ValueError(f"decoded {len(decoded)} bits, expected {len(truth)}")
    return sum(a == b for a, b in zip(decoded, truth, strict=True)) / len(truth)


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def standard_error(values: Sequence[float]) -> float:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
