"""The batched ``worldcup-v2`` step's compiled loops (numba): the CPU path.

On a CPU the tensor version of the tournament is about 200 small kernels a step
(30 sequential layers of six or seven), each paying torch's ~3 us dispatch, so
the step costs ~1 ms at batch 1 whatever the work. One compiled loop per row
runs the same arithmetic in registers: the family words, the m-layer tournament
``q <- q * max(1 - E_q[g], 0) + q * g`` in the reference's order of operations,
lambda, the combination, clipping and normalisation (``step_kernel``), and the
context and repeated-context rule (``context_kernel``). Neither hashes: the CPU
path calls the PRF's own array functions (:mod:`worldcup_core.prf`) between them.

Kept apart and imported lazily, like :mod:`worldcup_core._siphash_jit`: compiled
on first use (a few seconds, then cached on disk); without numba the tensor
path runs. ``tests/test_batched.py`` checks both paths against the per-row
reference to 1e-12.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
from numba import njit

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]

# Variant codes of ``batched._VARIANTS``: worldcup, no-entropy, no-subtraction,
# random-second, nondistortionary.
_NO_ENTROPY = 1
_NO_SUBTRACTION = 2
_RANDOM_SECOND = 3
_NONDISTORTIONARY = 4


@njit(cache=True, nogil=True)
def context_kernel(
    history: I64, lengths: I64, slots: I64, width: int, ctx: I64, live: Bools
) -> None:
    """Each row's context (its last ``width`` tokens) into ``ctx`` (B, width), and whether the
    row is watermarked this step: at least ``width`` tokens and a context not seen at an
    earlier step (the per-row reference's rule, which the detector mirrors)."""
    for b in range(slots.shape[0]):
        row = history[slots[b]]
        length = min(lengths[slots[b]], row.shape[0])
        live[b] = length >= width
        for j in range(width):
            ctx[b, j] = row[max(length - width + j, 0)]
        if not live[b]:
            continue
        for start in range(length - width):  # contexts of the earlier steps >= width
            same = True
            for j in range(width):
                if row[start + j] != ctx[b, j]:
                    same = False
                    break
            if same:
                live[b] = False
                break


@njit(cache=True, nogil=True)
def _tournament(probs: F64, words: I64, base: int, layers: int, q: F64, g: F64) -> None:
    """The 2-leaf tournament over ``layers`` layers into ``q``; layer l is bit base + l."""
    n = probs.shape[0]
    for x in range(n):
        q[x] = probs[x]
    for layer in range(layers):
        shift = base + layer
        expected = 0.0
        for x in range(n):
            bit = float((words[x] >> shift) & 1)
            g[x] = bit
            expected += q[x] * bit
        factor = max(1.0 - expected, 0.0)  # E_q[g] can round to 1 + 2^-52
        for x in range(n):
            q[x] = q[x] * factor + q[x] * g[x]


@njit(cache=True, nogil=True)
def step_kernel(
    words: I64,
    alt: I64,
    sym_bits: I64,
    groups: I64,
    layers: I64,
    variant: I64,
    alpha: F64,
    probs: F64,
    live: Bools,
    out: F64,
) -> None:
    """``out[b]``: the watermarked distribution of row b, or ``probs[b]`` where not live.

    ``words`` (W, B, n) are the g-words of every (row, candidate), ``alt`` (W', B, n)
    the random-second ablation's (W' = 0 when no row plays it), ``sym_bits`` (B, K)
    the bits of each row's symbol; per-row ``groups``, ``layers``, ``variant``
    codes and ``alpha``.
    """
    batch, n = probs.shape
    family = np.empty(n, dtype=np.int64)
    q = np.empty(n)
    g = np.empty(n)
    q_int = np.empty(n)
    q_other = np.empty(n)
    for b in range(batch):
        p = probs[b]
        if not live[b]:
            out[b, :] = p
            continue
        k = groups[b]
        m = layers[b]
        per_word = 64 // m
        code = variant[b]
        if code == _NO_SUBTRACTION or code == _NONDISTORTIONARY:
            lam = 0.0
        elif code == _NO_ENTROPY:
            lam = 1.0
        else:
            entropy = 0.0
            for x in range(n):
                if p[x] > 0.0:
                    entropy -= p[x] * math.log(p[x])
            lam = alpha[b] * math.tanh(entropy)
        q_int[:] = 0.0
        q_other[:] = 0.0
        families = 2 if lam != 0.0 else 1  # lambda = 0: the other family adds nothing
        for j in range(k):
            w = j // per_word
            base = (j % per_word) * m
            bit = sym_bits[b, j]
            for f in range(families):
                if code == _RANDOM_SECOND:  # bit 0: g against g'; bit 1: g' against g
                    source = words if (f == 0) == (bit == 0) else alt
                    for x in range(n):
                        family[x] = source[w, b, x]
                else:  # complementary: bit 0 plays g against 1 - g, bit 1 the reverse
                    flip = -np.int64(bit ^ f)  # all ones where this family is 1 - g
                    for x in range(n):
                        family[x] = words[w, b, x] ^ flip
                _tournament(p, family, base, m, q, g)
                target = q_int if f == 0 else q_other
                for x in range(n):
                    target[x] += q[x]
        total = 0.0
        for x in range(n):
            score = max(q_int[x] - lam * q_other[x], 0.0)
            out[b, x] = score
            total += score
        if total > 0.0:
            for x in range(n):
                out[b, x] /= total
        else:  # the reference's fallback: the intended families alone
            mass = 0.0
            for x in range(n):
                mass += q_int[x]
            for x in range(n):
                out[b, x] = q_int[x] / mass
