"""The m-layer, 2-leaf tournament of Algorithm 1, in closed form.

Appendix E (Theorem 2) gives the single-layer winner distribution; for N=2
leaves and binary g it reduces to ``q <- q * (1 + g_l - E_q[g_l])``, and the
m-layer distribution is that update applied layer after layer. Nobody has to
sample 2^m leaves. ``simulate_tournament`` runs Algorithm 1 literally and is
the brute-force reference the tests compare against.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def tournament_distribution(probs: FloatArray, g: npt.NDArray[np.generic]) -> FloatArray:
    """Exact winner distribution of the 2-leaf tournament.

    ``probs`` has shape (..., n); ``g`` has shape (..., m, n) with values in
    {0, 1} and broadcasts against ``probs``. Layer 0 is played first.

    >>> tournament_distribution(np.array([0.5, 0.5]), np.array([[1, 0]]))
    array([0.75, 0.25])
    """
    gf = np.asarray(g, dtype=np.float64)
    q = np.array(np.broadcast_to(probs, gf.shape[:-2] + gf.shape[-1:]), dtype=np.float64)
    for layer in range(gf.shape[-2]):
        # q(1 + g - E[g]) == q(1 - E[g]) + q g; method calls skip numpy's dispatch cost
        qg = q * gf[..., layer, :]
        # E_q[g] <= 1 exactly; rounding can give 1 + 2^-52, which would make the
        # g = 0 tokens' mass negative (and crash a sampler), so clamp at 0.
        q *= np.maximum(1.0 - qg.sum(axis=-1, keepdims=True), 0.0)
        q += qg
    return q


def simulate_tournament(
    probs: FloatArray, g: npt.NDArray[np.generic], rng: np.random.Generator, draws: int
) -> npt.NDArray[np.int64]:
    """Run Algorithm 1 ``draws`` times (2^m i.i.d. leaves each); return winners.

    Ties are broken uniformly at random, as in the paper.
    """
    layers = g.shape[0]
    leaves = rng.choice(len(probs), size=(draws, 2**layers), p=probs)
    for layer in range(layers):
        pairs = leaves.reshape(draws, -1, 2)
        scores = g[layer][pairs]
        pick_second = np.where(
            scores[..., 0] == scores[..., 1],
            rng.integers(0, 2, size=scores.shape[:-1]).astype(bool),
            scores[..., 1] > scores[..., 0],
        )
        leaves = np.where(pick_second, pairs[..., 1], pairs[..., 0])
    return leaves[:, 0]
