"""SipHash-1-3 over whole arrays: one implementation, numpy on the CPU and torch on any device.

SipHash (Aumasson & Bernstein, 2012) is a keyed pseudo-random function with a
128-bit key and a 64-bit output, built for short inputs from add-rotate-xor on
64-bit words, so it vectorises: every lane of an array is an independent
evaluation with its own key and message. Scheme ``worldcup-v2`` draws all its
randomness from it (see :mod:`worldcup_core.prf` for why SipHash-1-3).

The rounds are written once, against a two-method lane adapter:

* numpy: ``uint64`` arrays, whose arithmetic wraps modulo 2**64 by definition;
* torch: ``int64`` tensors (torch has no usable ``uint64`` arithmetic), whose
  two's-complement addition wraps identically; right shifts are arithmetic, so
  rotations mask the bits shifted in. Values are bit patterns: a negative
  ``int64`` is the ``uint64`` with the top bit set.

On the CPU both run through one compiled loop when numba is installed
(:mod:`worldcup_core._siphash_jit`: ~8 ns per hash where the array rounds take
~55 ns, because each array operation is a pass over memory); a torch tensor on
the CPU is handed to it as a zero-copy numpy view. The array rounds stay as the
path for other devices and for machines without numba.

All paths give bit-identical outputs (published vectors and a random property
test across them in ``tests/test_prf_v2.py``). Messages are given as already
packed little-endian 64-bit blocks plus the final block, which carries the
last 0-7 bytes and the message length in its top byte, exactly as the
reference implementation builds it (:func:`message_blocks` does the packing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

C_ROUNDS: Final = 1
D_ROUNDS: Final = 3
_INIT: Final = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)
_CHUNK: Final = 32768  # numpy lanes per pass: the working set (~6 arrays) stays in L2

U64 = npt.NDArray[np.uint64]
Lanes = Any  # a uint64 ndarray or an int64 tensor, same shape everywhere


def as_signed(value: int) -> int:
    """The int64 bit pattern of a uint64 value (torch stores uint64 words as int64)."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


class _NumpyOps:
    _SHIFTS: Final = {b: (np.uint64(b), np.uint64(64 - b)) for b in (13, 16, 17, 21, 32)}

    def __init__(self, n: int) -> None:
        self.tmp = np.empty(n, dtype=np.uint64)

    @staticmethod
    def keyed(key: Lanes, constant: int) -> Lanes:
        return np.bitwise_xor(key, np.uint64(constant))

    @staticmethod
    def add(a: Lanes, b: Lanes) -> None:
        np.add(a, b, out=a)

    @staticmethod
    def xor(a: Lanes, b: Lanes | int) -> None:
        np.bitwise_xor(a, np.uint64(b) if isinstance(b, int) else b, out=a)

    def rotl(self, a: Lanes, bits: int) -> None:
        left, right = self._SHIFTS[bits]
        np.right_shift(a, right, out=self.tmp)
        np.left_shift(a, left, out=a)
        np.bitwise_or(a, self.tmp, out=a)


class _TorchOps:
    def __init__(self, like: torch.Tensor) -> None:
        self.tmp = torch.empty_like(like)

    @staticmethod
    def keyed(key: Lanes, constant: int) -> Lanes:
        return torch.bitwise_xor(key, as_signed(constant))

    @staticmethod
    def add(a: Lanes, b: Lanes) -> None:
        a.add_(b)

    @staticmethod
    def xor(a: Lanes, b: Lanes | int) -> None:
        a.bitwise_xor_(as_signed(b) if isinstance(b, int) else b)

    def rotl(self, a: Lanes, bits: int) -> None:
        torch.bitwise_right_shift(a, 64 - bits, out=self.tmp)
        self.tmp.bitwise_and_((1 << bits) - 1)  # arithmetic shift: drop the copied sign bits
        a.bitwise_left_shift_(bits)
        a.bitwise_or_(self.tmp)


def _sipround(ops: Any, v0: Lanes, v1: Lanes, v2: Lanes, v3: Lanes) -> None:
    ops.add(v0, v1)
    ops.rotl(v1, 13)
    ops.xor(v1, v0)
    ops.rotl(v0, 32)
    ops.add(v2, v3)
    ops.rotl(v3, 16)
    ops.xor(v3, v2)
    ops.add(v0, v3)
    ops.rotl(v3, 21)
    ops.xor(v3, v0)
    ops.add(v2, v1)
    ops.rotl(v1, 17)
    ops.xor(v1, v2)
    ops.rotl(v2, 32)


def _siphash(ops: Any, k0: Lanes, k1: Lanes, blocks: Sequence[Lanes], final: Lanes) -> Lanes:
    """The reference algorithm on lanes; ``k0``/``k1`` already have the lanes' shape."""
    v0, v1 = ops.keyed(k0, _INIT[0]), ops.keyed(k1, _INIT[1])
    v2, v3 = ops.keyed(k0, _INIT[2]), ops.keyed(k1, _INIT[3])
    for m in (*blocks, final):
        ops.xor(v3, m)
        for _ in range(C_ROUNDS):
            _sipround(ops, v0, v1, v2, v3)
        ops.xor(v0, m)
    ops.xor(v2, 0xFF)
    for _ in range(D_ROUNDS):
        _sipround(ops, v0, v1, v2, v3)
    ops.xor(v0, v1)
    ops.xor(v2, v3)
    ops.xor(v0, v2)
    return v0


JIT_ENABLED = True  # tests switch the compiled loop off to check the array rounds


@cache
def _load_jit() -> Callable[..., U64] | None:
    try:
        from worldcup_core._siphash_jit import siphash13_jit
    except ImportError:  # numba missing or unusable here: the array rounds do the work
        return None
    return siphash13_jit


def _jit() -> Callable[..., U64] | None:
    return _load_jit() if JIT_ENABLED else None


def jit_active() -> bool:
    """Whether CPU hashing runs through the compiled loop (reported by the benchmarks)."""
    return _jit() is not None


def siphash13(k0: Lanes | int, k1: Lanes | int, blocks: Sequence[Lanes], final: Lanes) -> Lanes:
    """SipHash-1-3 of every lane: ``final`` (and each block) is a uint64 ndarray or an
    int64 tensor of shape (N,); the keys are scalars or arrays of the same shape.

    >>> k0, k1 = 0x0706050403020100, 0x0F0E0D0C0B0A0908  # key bytes 00..0f
    >>> msg = np.array([0x0706050403020100], dtype=np.uint64)  # bytes 00..07 ...
    >>> final = np.array([8 << 56], dtype=np.uint64)  # ... and the length, 8
    >>> hex(int(siphash13(k0, k1, [msg], final)[0]))
    '0x369095118d299a8e'
    """
    jit = _jit()
    if isinstance(final, torch.Tensor):
        if jit is not None and final.device.type == "cpu":
            return _siphash_torch_cpu(jit, k0, k1, blocks, final)
        return _siphash_torch(k0, k1, blocks, final)
    if jit is not None:
        return jit(k0, k1, list(blocks), final)
    return _siphash_numpy(k0, k1, blocks, final)


def _siphash_torch_cpu(
    jit: Callable[..., U64],
    k0: Lanes | int,
    k1: Lanes | int,
    blocks: Sequence[Lanes],
    final: torch.Tensor,
) -> torch.Tensor:
    """CPU tensors through the compiled loop: int64 storage read as uint64, no copies."""

    def u64(t: Lanes | int) -> U64 | int:
        return t.numpy().view(np.uint64) if isinstance(t, torch.Tensor) else t

    out = jit(u64(k0), u64(k1), [u64(b) for b in blocks], u64(final))
    return torch.from_numpy(out.view(np.int64))


def _siphash_torch(
    k0: Lanes | int, k1: Lanes | int, blocks: Sequence[Lanes], final: torch.Tensor
) -> torch.Tensor:
    def lanes(k: Lanes | int) -> torch.Tensor:
        if isinstance(k, torch.Tensor):
            return k.expand_as(final)
        return torch.full_like(final, as_signed(int(k)))

    out: torch.Tensor = _siphash(_TorchOps(final), lanes(k0), lanes(k1), blocks, final)
    return out


def _siphash_numpy(k0: Lanes | int, k1: Lanes | int, blocks: Sequence[Lanes], final: U64) -> U64:
    n = int(final.shape[0])
    out = np.empty(n, dtype=np.uint64)

    def part(x: Lanes | int, lo: int, hi: int) -> Lanes:
        """A view of this chunk of an input (inputs are only read); a scalar key as lanes."""
        if isinstance(x, np.ndarray):
            return np.broadcast_to(x, (n,))[lo:hi]
        return np.full(hi - lo, int(x) & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)

    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        out[lo:hi] = _siphash(
            _NumpyOps(hi - lo),
            part(k0, lo, hi),
            part(k1, lo, hi),
            [part(b, lo, hi) for b in blocks],
            part(final, lo, hi),
        )
    return out


def message_blocks(words: Sequence[Lanes], tag: int | None = None) -> tuple[list[Lanes], Lanes]:
    """Pack a message of 32-bit words (little-endian) and an optional trailing tag byte.

    Each ``words[i]`` holds values in [0, 2**32) as uint64 ndarray or int64 tensor
    lanes. Returns SipHash's full 8-byte blocks and its final block (the 0-7
    bytes left, and the message length in the top byte).
    """
    if not words:
        raise ValueError("a message needs at least one word")
    length = 4 * len(words) + (tag is not None)
    blocks = [words[i] | (words[i + 1] << 32) for i in range(0, len(words) - 1, 2)]
    rest = words[-1] if len(words) % 2 else None
    top = (length & 0xFF) << 56
    tag_bits = 0 if tag is None else (tag & 0xFF) << (32 if rest is not None else 0)
    constant = top | tag_bits
    if isinstance(words[0], torch.Tensor):
        c = as_signed(constant)
        final = rest | c if rest is not None else torch.full_like(words[0], c)
    else:
        c64 = np.uint64(constant)
        final = rest | c64 if rest is not None else np.full(words[0].shape, c64, dtype=np.uint64)
    return blocks, final
