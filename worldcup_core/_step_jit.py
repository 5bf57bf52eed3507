"""The batched ``worldcup-v2`` step as one compiled loop over rows (numba): the CPU path.

On a CPU the tensor version of the step is a few hundred small kernels (the
SipHash rounds, then the m tournament layers one after another), each paying
torch's ~3 us dispatch, so it costs ~1 ms at batch 1 whatever the work. One
compiled loop per row does the whole step in registers, reading the slot tables
in place (:mod:`worldcup_core.step_layout`), exactly as the fused GPU kernel
(:mod:`worldcup_core._step_triton`) does:

1. the context (the row's last c tokens) and the rule that a context seen at an
   earlier step, or the first c tokens, leave ``p`` unchanged;
2. SipHash-1-3 of the context (the position, then the symbol) and of every
   (context, candidate, word) (the g-words), sharing the context's blocks: their
   state is computed once per row and key, then each candidate absorbs its last
   block(s) (bit-identical with :mod:`worldcup_core.siphash`);
3. the 2k-family, m-layer tournament ``q <- q * max(1 - E_q[g], 0) + q * g`` in
   the reference's order of operations, lambda, the combination, clipping,
   normalisation and the fallback.

Per-step Python is one call, whatever the batch. Kept apart and imported lazily,
like :mod:`worldcup_core._siphash_jit`: compiled on first use (a few seconds,
then cached on disk); without numba the tensor path runs.
``tests/test_batched.py`` checks it against the per-row reference to 1e-12.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import numpy.typing as npt
from numba import njit

from worldcup_core._siphash_jit import _round
from worldcup_core.step_layout import ALT_KEY, GVALUE_KEY, POSITION_KEY, Column, VariantCode

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]
U8 = npt.NDArray[np.uint8]
_U = np.uint64

# numba reads module globals as compile-time constants: plain ints from the shared enums
_GROUPS: Final = int(Column.GROUPS)
_LAYERS: Final = int(Column.LAYERS)
_WIDTH: Final = int(Column.WIDTH)
_SYMBOLS: Final = int(Column.SYMBOLS)
_VARIANT: Final = int(Column.VARIANT)
_LIVE: Final = int(Column.LIVE)
_NO_ENTROPY: Final = int(VariantCode.NO_ENTROPY)
_NO_SUBTRACTION: Final = int(VariantCode.NO_SUBTRACTION)
_RANDOM_SECOND: Final = int(VariantCode.RANDOM_SECOND)
_NONDISTORTIONARY: Final = int(VariantCode.NONDISTORTIONARY)
_POSITION: Final = POSITION_KEY
_GVALUE: Final = GVALUE_KEY
_ALT: Final = ALT_KEY
_MAX_WORDS: Final = 8  # ceil(k / (64 // m)) <= k <= 8


@njit(cache=True, nogil=True)
def context_live(history: I64, length: int, width: int, ctx: U64) -> bool:
    """The row's context (its last ``width`` tokens) into ``ctx``; whether the row is
    watermarked this step: at least ``width`` tokens, and a context not seen at an
    earlier step (the per-row reference's rule, which the detector mirrors)."""
    if length < width:
        return False
    end = length - width  # the contexts of the earlier steps >= width start before it
    for j in range(width):
        ctx[j] = _U(history[end + j])
    for start in range(end):
        same = True
        for j in range(width):
            if history[start + j] != history[end + j]:
                same = False
                break
        if same:
            return False
    return True


@njit(inline="always")
def _prefix(k0: np.uint64, k1: np.uint64, ctx: U64, width: int) -> tuple[_U, _U, _U, _U]:
    """SipHash's state after the message blocks made of context words alone (c // 2)."""
    v0 = k0 ^ _U(0x736F6D6570736575)
    v1 = k1 ^ _U(0x646F72616E646F6D)
    v2 = k0 ^ _U(0x6C7967656E657261)
    v3 = k1 ^ _U(0x7465646279746573)
    for i in range(width // 2):
        m = ctx[2 * i] | (ctx[2 * i + 1] << _U(32))
        v3 ^= m
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0 ^= m
    return v0, v1, v2, v3


@njit(inline="always")
def _finish(v0: _U, v1: _U, v2: _U, v3: _U, final: _U) -> _U:
    """The last block and SipHash-1-3's three finalisation rounds."""
    v3 ^= final
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0 ^= final
    v2 ^= _U(0xFF)
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@njit(inline="always")
def _gwords(k0: _U, k1: _U, ctx: U64, width: int, tokens: I64, words: int, out: U64) -> None:
    """``out[w, x] = SipHash(ctx || uint32(tokens[x]) || uint8(w))`` for w < ``words``."""
    p0, p1, p2, p3 = _prefix(k0, k1, ctx, width)
    odd = width % 2 == 1
    length = _U(4 * width + 5) << _U(56)
    for x in range(tokens.shape[0]):
        token = _U(tokens[x])
        v0, v1, v2, v3 = p0, p1, p2, p3
        if odd:  # the last context word and the token fill one more block
            m = ctx[width - 1] | (token << _U(32))
            v3 ^= m
            v0, v1, v2, v3 = _round(v0, v1, v2, v3)
            v0 ^= m
            rest = _U(0)
            tag_shift = _U(0)
        else:  # the token is the final block's first word, the tag its fifth byte
            rest = token
            tag_shift = _U(32)
        for w in range(words):
            out[w, x] = _finish(v0, v1, v2, v3, rest | (_U(w) << tag_shift) | length)


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
    slots: I64,
    cand: I64,
    probs: F64,
    keys: U64,
    config: I64,
    alpha: F64,
    bits: U8,
    history: I64,
    lengths: I64,
    out: F64,
) -> None:
    """``out[b]``: row b's watermarked distribution over ``cand[b]``, or ``probs[b]`` where
    the slot has no row (or is outside the tables), in its first c steps, or at a
    repeated context. The tables are :mod:`worldcup_core.step_layout`'s (``keys`` read
    as uint64)."""
    batch, n = probs.shape
    capacity = config.shape[0]
    horizon = history.shape[1]
    ctx = np.empty(8, dtype=np.uint64)
    raw = np.empty((_MAX_WORDS, n), dtype=np.uint64)
    raw_alt = np.empty((_MAX_WORDS, n), dtype=np.uint64)
    gw = raw.view(np.int64)
    gw_alt = raw_alt.view(np.int64)
    family = np.empty(n, dtype=np.int64)
    q = np.empty(n)
    g = np.empty(n)
    q_int = np.empty(n)
    q_other = np.empty(n)
    for b in range(batch):
        p = probs[b]
        slot = max(slots[b], 0)  # a slot outside the tables has no row: checked below
        cfg = config[min(slot, capacity - 1)]
        width = cfg[_WIDTH]
        live = 0 <= slots[b] < capacity and cfg[_LIVE] != 0
        if live:
            length = min(lengths[slot], horizon)
            live = context_live(history[slot], length, width, ctx)
        if not live:
            out[b, :] = p
            continue
        k = cfg[_GROUPS]
        m = cfg[_LAYERS]
        code = cfg[_VARIANT]
        per_word = 64 // m
        words = (k + per_word - 1) // per_word

        # the position, and the symbol it selects: ((p64 >> 32) * B) >> 32
        v0, v1, v2, v3 = _prefix(keys[slot, _POSITION, 0], keys[slot, _POSITION, 1], ctx, width)
        last = ctx[width - 1] if width % 2 == 1 else _U(0)
        position = _finish(v0, v1, v2, v3, last | (_U(4 * width) << _U(56)))
        symbol = ((position >> _U(32)) * _U(cfg[_SYMBOLS])) >> _U(32)

        row_tokens = cand[b]
        _gwords(keys[slot, _GVALUE, 0], keys[slot, _GVALUE, 1], ctx, width, row_tokens, words, raw)
        if code == _RANDOM_SECOND:
            _gwords(
                keys[slot, _ALT, 0], keys[slot, _ALT, 1], ctx, width, row_tokens, words, raw_alt
            )

        if code == _NO_SUBTRACTION or code == _NONDISTORTIONARY:
            lam = 0.0
        elif code == _NO_ENTROPY:
            lam = 1.0
        else:
            entropy = 0.0
            for x in range(n):
                if p[x] > 0.0:
                    entropy -= p[x] * math.log(p[x])
            lam = alpha[slot] * math.tanh(entropy)
        q_int[:] = 0.0
        q_other[:] = 0.0
        families = 2 if lam != 0.0 else 1  # lambda = 0: the other family adds nothing
        for j in range(k):
            w = j // per_word
            base = (j % per_word) * m
            bit = np.int64(bits[slot, symbol, j])
            for f in range(families):
                if code == _RANDOM_SECOND:  # bit 0: g against g'; bit 1: g' against g
                    source = gw if (f == 0) == (bit == 0) else gw_alt
                    for x in range(n):
                        family[x] = source[w, x]
                else:  # complementary: bit 0 plays g against 1 - g, bit 1 the reverse
                    flip = -(bit ^ f)  # all ones where this family is 1 - g
                    for x in range(n):
                        family[x] = gw[w, x] ^ flip
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
