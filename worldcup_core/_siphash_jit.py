"""SipHash-1-3 as one compiled loop over lanes (numba), the CPU fast path of :mod:`siphash`.

The array rounds in :mod:`worldcup_core.siphash` cost about 26 full passes over
memory per round, so on the CPU they run at ~55 ns per hash whatever the
vectorisation; a compiled loop keeps the four state words in registers and
runs at ~8 ns. Same algorithm, same packing (``message_blocks``), so the
outputs are bit-identical; ``tests/test_prf_v2.py`` checks it against the
published vectors and both array backends.

Kept apart and imported lazily: numba compiles ``_kernel`` on first use (about
2 s, then cached on disk), and a machine without numba keeps the array rounds.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

U64 = npt.NDArray[np.uint64]
_U = np.uint64


@njit(inline="always")
def _rotl(x: np.uint64, b: int) -> np.uint64:
    return (x << _U(b)) | (x >> _U(64 - b))


@njit(inline="always")
def _round(
    v0: np.uint64, v1: np.uint64, v2: np.uint64, v3: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    v0 += v1
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 += v3
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 += v1
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@njit(cache=True, nogil=True)
def _kernel(k0: U64, k1: U64, kstride: int, blocks: U64, final: U64, out: U64) -> None:
    """``out[i] = SipHash-1-3(k0[i*kstride], k1[i*kstride]; blocks[:, i], final[i])``."""
    for i in range(final.shape[0]):
        a = k0[i * kstride]
        b = k1[i * kstride]
        v0 = a ^ _U(0x736F6D6570736575)
        v1 = b ^ _U(0x646F72616E646F6D)
        v2 = a ^ _U(0x6C7967656E657261)
        v3 = b ^ _U(0x7465646279746573)
        for j in range(blocks.shape[0]):
            m = blocks[j, i]
            v3 ^= m
            v0, v1, v2, v3 = _round(v0, v1, v2, v3)
            v0 ^= m
        m = final[i]
        v3 ^= m
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0 ^= m
        v2 ^= _U(0xFF)
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        out[i] = v0 ^ v1 ^ v2 ^ v3


def _lanes(key: U64 | int, n: int) -> U64:
    """A key as n contiguous uint64 lanes (copied only when it must be)."""
    if isinstance(key, np.ndarray) and key.shape == (n,):
        return np.ascontiguousarray(key, dtype=np.uint64)
    return np.ascontiguousarray(np.broadcast_to(np.asarray(key, dtype=np.uint64), (n,)))


def siphash13_jit(k0: U64 | int, k1: U64 | int, blocks: list[U64], final: U64) -> U64:
    """SipHash-1-3 of every lane: uint64 arrays of shape (N,), or scalar keys."""
    n = int(final.shape[0])
    if isinstance(k0, np.ndarray) or isinstance(k1, np.ndarray):
        key0, key1 = _lanes(k0, n), _lanes(k1, n)
        stride = 1
    else:
        key0 = np.array([int(k0) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        key1 = np.array([int(k1) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        stride = 0
    packed = np.empty((len(blocks), n), dtype=np.uint64)
    for j, block in enumerate(blocks):
        packed[j] = block
    out = np.empty(n, dtype=np.uint64)
    _kernel(key0, key1, stride, packed, np.ascontiguousarray(final, dtype=np.uint64), out)
    return out
