"""Token evidence and the exact binomial statistics shared by decoder and detector.

Model-free: only token ids and the key are needed. Each scored token adds,
for every group j, the number of its g-bits that favour bit 0 (``ones``) out
of ``trials_per_token`` bits: m for the complementary variants (bit 0 <=> high
g, bit 1 <=> high g_bar = 1 - g), 2m for the random-second ablation
(``sum g_A + sum (1 - g_B)``). Under H0 -- text written without this key --
scored pairs are distinct, so every cell's count is *exactly*
Binomial(trials, 1/2) given the positions.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import special

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.prf import PRF, unpack_g

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
_LOG2 = math.log(2.0)


@dataclass(frozen=True)
class TokenEvidence:
    """Per scored token: its position hash and per-group counts."""

    position_u64: npt.NDArray[np.uint64]  # (n_scored,)
    ones: I64  # (n_scored, k)
    trials_per_token: int
    num_tokens: int
    text_digest: bytes

    @property
    def num_scored(self) -> int:
        return int(self.position_u64.shape[0])

    @property
    def groups(self) -> int:
        return int(self.ones.shape[1])

    def positions(self, num_symbols: int) -> I64:
        return (self.position_u64 % np.uint64(num_symbols)).astype(np.int64)

    def cells(self, num_symbols: int) -> tuple[I64, I64, I64]:
        """(ones, trials) per (position, group), and tokens per position."""
        pos = self.positions(num_symbols)
        counts = np.bincount(pos, minlength=num_symbols).astype(np.int64)
        ones = np.zeros((num_symbols, self.groups), dtype=np.int64)
        np.add.at(ones, pos, self.ones)
        trials = np.repeat(counts[:, None] * self.trials_per_token, self.groups, axis=1)
        return ones, trials, counts


def extract_evidence(prf: PRF, config: WatermarkConfig, token_ids: Sequence[int]) -> TokenEvidence:
    """Hash a response (response tokens only, never the prompt)."""
    ids = [int(t) for t in token_ids]
    alternate = config.variant is Variant.RANDOM_SECOND
    hashes = prf.scan(ids, config.context_width, alternate=alternate)
    return evidence_from_hashes(config, hashes, len(ids), text_digest(ids))


def text_digest(token_ids: Sequence[int]) -> bytes:
    """Unkeyed digest of the token ids; seeds the per-text tie-break stream."""
    ids = [int(t) for t in token_ids]
    return hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=16).digest()


def evidence_from_hashes(
    config: WatermarkConfig,
    hashes: tuple[list[int], bytes, bytes],
    num_tokens: int,
    digest: bytes,
) -> TokenEvidence:
    """Counts per scored token from :meth:`PRF.scan` / :meth:`PRF.hash_items` output."""
    positions, g_raw, alt_raw = hashes
    n = len(positions)
    k, m = config.groups, config.layers
    ones = unpack_g(g_raw, n, k, m).sum(axis=2, dtype=np.int64)
    trials = m
    if config.variant is Variant.RANDOM_SECOND:
        ones = ones + m - unpack_g(alt_raw, n, k, m).sum(axis=2, dtype=np.int64)
        trials = 2 * m
    return TokenEvidence(
        position_u64=np.array(positions, dtype=np.uint64).reshape(n),
        ones=ones.reshape(n, k),
        trials_per_token=trials,
        num_tokens=num_tokens,
        text_digest=digest,
    )


_TAIL_TERMS = 512


def log_binom_half_cdf(k: I64, n: I64) -> F64:
    """``log P(X <= k)`` for ``X ~ Binomial(n, 1/2)``, finite deep in the tail.

    ``scipy.stats.binom.logcdf`` is ``log(cdf)`` and returns ``-inf`` once the
    cdf underflows (around 1e-308), which long watermarked texts reach. There
    we sum the series ``pmf(k) * sum_j prod_{t<j} (k-t)/(n-k+t+1)`` in log
    space, adding a geometric bound on the terms left out (an upper bound, so
    the p-value stays conservative).
    """
    k = np.asarray(k, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    with np.errstate(divide="ignore"):
        out = np.where(k < 0, -np.inf, np.log(special.bdtr(np.maximum(k, 0), n, 0.5)))
    deep = (out < -600.0) & (k >= 0)
    if deep.any():
        kd, nd = k[deep][:, None].astype(np.float64), n[deep][:, None].astype(np.float64)
        j = np.arange(_TAIL_TERMS, dtype=np.float64)[None, :]
        ratios = np.clip((kd - j) / (nd - kd + j + 1.0), 0.0, None)
        terms = np.cumprod(ratios, axis=1)
        last = ratios[:, -1]
        rest = np.where(last < 1.0, terms[:, -1] * last / np.maximum(1.0 - last, 1e-300), np.inf)
        series = 1.0 + terms.sum(axis=1) + rest
        out[deep] = log_binom_half_pmf(k[deep], n[deep]) + np.log(series)
    result: F64 = np.asarray(out, dtype=np.float64)
    return result


def log_binom_half_pmf(k: I64, n: I64) -> F64:
    out: F64 = (
        special.gammaln(n + 1.0)
        - special.gammaln(k + 1.0)
        - special.gammaln(n - k + 1.0)
        - n * _LOG2
    )
    return out


def _two_sided_parts(ones: I64, trials: I64) -> tuple[F64, F64]:
    """log P(strictly more extreme), log P(equally extreme) under Bin(t, 1/2)."""
    lo = np.minimum(ones, trials - ones)
    centre = 2 * lo == trials
    log_pmf = log_binom_half_pmf(lo, trials)
    with np.errstate(divide="ignore"):
        strict = np.where(
            centre, np.log1p(-np.exp(log_pmf)), _LOG2 + log_binom_half_cdf(lo - 1, trials)
        )
    equal = np.where(centre, 0.0, _LOG2) + log_pmf
    return np.asarray(strict, dtype=np.float64), np.asarray(equal, dtype=np.float64)


def two_sided_log_pvalues(ones: I64, trials: I64) -> F64:
    """Exact (conservative) two-sided binomial log p-values of each cell."""
    strict, equal = _two_sided_parts(ones, trials)
    return np.minimum(np.logaddexp(strict, equal), 0.0)


def randomized_log_pvalues(ones: I64, trials: I64, uniforms: F64) -> F64:
    """Two-sided randomised p-values: exactly Uniform(0, 1) under H0.

    ``p = P(more extreme) + U * P(equally extreme)`` (Lehmann & Romano,
    Testing Statistical Hypotheses, Sec. 3.2).
    """
    strict, equal = _two_sided_parts(ones, trials)
    return np.minimum(np.logaddexp(strict, np.log(uniforms) + equal), 0.0)


def fisher_log_sf(statistic: F64, num_pvalues: I64) -> F64:
    """``log P(chi2_{2C} >= T)``, exact and finite for any T.

    For even degrees of freedom the chi-square tail is a Poisson cdf:
    ``P(chi2_{2C} >= T) = exp(-T/2) * sum_{i<C} (T/2)^i / i!``; summed in log
    space it never underflows (``scipy.stats.chi2.logsf`` does, near 1e-308).
    """
    t = np.asarray(statistic, dtype=np.float64)
    c = np.asarray(num_pvalues, dtype=np.int64)
    width = int(c.max(initial=0))
    if width == 0:
        return np.zeros_like(t)
    y = np.maximum(t / 2.0, 1e-300)
    i = np.arange(width, dtype=np.float64)
    terms = i[None, :] * np.log(y)[:, None] - special.gammaln(i + 1.0)[None, :]
    terms = np.where(i[None, :] < c[:, None], terms, -np.inf)
    with np.errstate(divide="ignore"):
        out = np.where(c > 0, -y + special.logsumexp(terms, axis=1), 0.0)
    result: F64 = np.minimum(out, 0.0)
    return result
