"""The batched ``worldcup-v2`` step as one fused Triton kernel: the CUDA path.

The tensor path costs a few hundred small kernel launches a step (the SipHash
rounds, then six or seven ops for each of the m tournament layers, one layer
after another), 1.5-3 ms at 5-10 us a launch whatever the batch. Here one
program per row does the whole step in registers, reading the slot tables in
place (:mod:`worldcup_core.step_layout`), as the CPU loops of
:mod:`worldcup_core._step_jit` do:

1. the context (the row's last c tokens, c per row) and the rule that the first c
   steps and a context seen at an earlier step leave ``p`` unchanged (the earlier
   windows are compared ``BLOCK_T`` at a time); such a row skips the rest;
2. SipHash-1-3, bit-exact with :mod:`worldcup_core.siphash`: the context's blocks
   are absorbed once per row and key, then every candidate absorbs its last
   block(s), for the g-value and the alt key at once; each group's g-word is the
   final block with its tag byte;
3. the symbol ``((p64 >> 32) * B) >> 32`` and its bits, then the m-layer tournament
   (``q <- q * max(1 - E_q[g], 0) + q * g``, the reference's order of operations)
   of both families of every group as one (2, groups, candidates) tile, so the
   chain of dependent reductions is m long whatever k; a row's k, m and variant are
   loop bounds and selects, so rows mix freely; lambda from the entropy per
   variant, the combination, clipping, normalisation and the fallback.

The launch depends on the batch, the candidate width and the table shapes only
(all known on the host), so a step can be captured in a CUDA graph; see
:meth:`worldcup_core.batched.BatchedWorldCup.step`. FP contraction is off, so
float64 rounding follows numpy's (the per-row reference's) to within the order
of the sums. ``TRITON_INTERPRET=1`` runs the same kernel on the CPU (how the
tests check it without a GPU).

Imported lazily: Triton is a dependency of CUDA torch builds and of the ``dev``
extra, not of the base install.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import triton
import triton.language as tl

from worldcup_core.step_layout import (
    ALT_KEY,
    CONFIG_COLUMNS,
    GVALUE_KEY,
    MAX_SYMBOLS,
    POSITION_KEY,
    Column,
    VariantCode,
)

MAX_CANDIDATES: Final = 8192  # one program holds a row's candidates; wider rows run the tensor path
_BLOCK_T: Final = 128  # earlier contexts compared at a time
_TILE_ELEMENTS: Final = 2048  # (group, candidate) pairs a program plays at once, at most

# Triton reads module globals only as constexprs
_NCOL = tl.constexpr(CONFIG_COLUMNS)
_NSYM = tl.constexpr(MAX_SYMBOLS)
_GROUPS = tl.constexpr(int(Column.GROUPS))
_LAYERS = tl.constexpr(int(Column.LAYERS))
_WIDTH = tl.constexpr(int(Column.WIDTH))
_SYMBOLS = tl.constexpr(int(Column.SYMBOLS))
_VARIANT = tl.constexpr(int(Column.VARIANT))
_LIVE = tl.constexpr(int(Column.LIVE))
_NO_ENTROPY = tl.constexpr(int(VariantCode.NO_ENTROPY))
_NO_SUBTRACTION = tl.constexpr(int(VariantCode.NO_SUBTRACTION))
_RANDOM_SECOND = tl.constexpr(int(VariantCode.RANDOM_SECOND))
_NONDISTORTIONARY = tl.constexpr(int(VariantCode.NONDISTORTIONARY))
_POSITION = tl.constexpr(POSITION_KEY)
_GVALUE = tl.constexpr(GVALUE_KEY)
_ALT = tl.constexpr(ALT_KEY)
_MAX_GROUPS = tl.constexpr(8)


@triton.jit
def _u64(x):
    """An int64 bit pattern (or a non-negative int) as uint64."""
    return x.to(tl.uint64, bitcast=x.dtype.primitive_bitwidth == 64)


@triton.jit
def _rotl(x, b: tl.constexpr):
    return (x << b) | (x >> (64 - b))


@triton.jit
def _sipround(v0, v1, v2, v3):
    v0 = v0 + v1
    v1 = _rotl(v1, 13)
    v1 = v1 ^ v0
    v0 = _rotl(v0, 32)
    v2 = v2 + v3
    v3 = _rotl(v3, 16)
    v3 = v3 ^ v2
    v0 = v0 + v3
    v3 = _rotl(v3, 21)
    v3 = v3 ^ v0
    v2 = v2 + v1
    v1 = _rotl(v1, 17)
    v1 = v1 ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@triton.jit
def _absorb(v0, v1, v2, v3, m):
    v3 = v3 ^ m
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 = v0 ^ m
    return v0, v1, v2, v3


@triton.jit
def _finish(v0, v1, v2, v3, final):
    """The final block and SipHash-1-3's three finalisation rounds."""
    v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, final)
    v2 = v2 ^ tl.full([], 0xFF, tl.uint64)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@triton.jit
def _prefix(key_ptr, ctx_ptr, width):
    """SipHash's state after the blocks made of context words alone (c // 2 of them)."""
    k0 = _u64(tl.load(key_ptr))
    k1 = _u64(tl.load(key_ptr + 1))
    v0 = k0 ^ tl.full([], 0x736F6D6570736575, tl.uint64)
    v1 = k1 ^ tl.full([], 0x646F72616E646F6D, tl.uint64)
    v2 = k0 ^ tl.full([], 0x6C7967656E657261, tl.uint64)
    v3 = k1 ^ tl.full([], 0x7465646279746573, tl.uint64)
    for i in range(width // 2):
        lo = _u64(tl.load(ctx_ptr + 2 * i))
        hi = _u64(tl.load(ctx_ptr + 2 * i + 1))
        v0, v1, v2, v3 = _absorb(v0, v1, v2, v3, lo | (hi << 32))
    return v0, v1, v2, v3


@triton.jit(do_not_specialize=["n", "cand_stride", "probs_stride", "out_stride", "capacity"])
def _step_kernel(
    slots_ptr,
    cand_ptr,
    probs_ptr,
    out_ptr,
    keys_ptr,
    config_ptr,
    alpha_ptr,
    bits_ptr,
    hist_ptr,
    length_ptr,
    n,
    cand_stride,
    probs_stride,
    out_stride,
    capacity,
    horizon,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP_TILE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    inside = offs < n
    p = tl.load(probs_ptr + b * probs_stride + offs, mask=inside, other=0.0)

    # the slot's row: a slot outside the tables, or without a row, returns p
    requested = tl.load(slots_ptr + b).to(tl.int64)
    valid = (requested >= 0) & (requested < capacity)
    slot = tl.where(valid, requested, 0)
    cfg = config_ptr + slot * _NCOL
    k = tl.load(cfg + _GROUPS).to(tl.int32)
    m = tl.load(cfg + _LAYERS).to(tl.int32)
    width = tl.load(cfg + _WIDTH).to(tl.int32)
    symbols = tl.load(cfg + _SYMBOLS)
    code = tl.load(cfg + _VARIANT)
    live = valid & (tl.load(cfg + _LIVE) != 0)

    # 1. the context, the first c steps and repeated contexts
    length = tl.minimum(tl.load(length_ptr + slot), horizon).to(tl.int32)
    live = live & (length >= width)
    end = tl.maximum(length - width, 0)  # the context's first token; earlier ones start before
    row = hist_ptr + slot * horizon
    ctx_ptr = row + end
    scan = tl.where(live, end, 0)
    seen = (length * 0).to(tl.int32)
    for start in range(0, scan, BLOCK_T):
        at = start + tl.arange(0, BLOCK_T)
        same = at < scan
        for j in range(width):
            token = tl.load(row + at + j, mask=same, other=-1)
            same = same & (token == tl.load(ctx_ptr + j))
        seen = seen | tl.max(same.to(tl.int32), axis=0)
    live = live & (seen == 0)

    q = p
    if live:  # (a branch taken or not by the whole program)
        # 2. the position and the symbol
        keys = keys_ptr + slot * 6
        odd = (width % 2) == 1
        last = tl.where(odd, _u64(tl.load(ctx_ptr + width - 1)), 0)
        v0, v1, v2, v3 = _prefix(keys + 2 * _POSITION, ctx_ptr, width)
        position = _finish(v0, v1, v2, v3, last | ((4 * width).to(tl.uint64) << 56))
        symbol = ((position >> 32) * _u64(symbols)) >> 32
        sym_bits = bits_ptr + slot * (_NSYM * _MAX_GROUPS) + symbol.to(tl.int64) * _MAX_GROUPS

        # every candidate's state before the final block of its g-words
        # ctx || uint32(x) || uint8(tag), for both families' keys (g, g') along axis 0
        pair = tl.arange(0, 2)[:, None]
        family = pair[:, :, None]
        column = offs[None, None, :]
        tokens = _u64(tl.load(cand_ptr + b * cand_stride + column, mask=column < n, other=0))
        key = keys + 2 * tl.where(family == 0, _GVALUE, _ALT)
        v0, v1, v2, v3 = _prefix(key, ctx_ptr, width)
        a0, a1, a2, a3 = _absorb(v0, v1, v2, v3, last | (tokens << 32))  # c odd: one more block
        v0 = tl.where(odd, a0, v0 + tokens * 0)
        v1 = tl.where(odd, a1, v1 + tokens * 0)
        v2 = tl.where(odd, a2, v2 + tokens * 0)
        v3 = tl.where(odd, a3, v3 + tokens * 0)
        rest = tl.where(odd, 0, tokens)  # c even: the token opens the final block ...
        tag_shift = tl.where(odd, 0, 32).to(tl.uint64)  # ... and the tag is its fifth byte
        length_bits = (4 * width + 5).to(tl.uint64) << 56
        alternate = code == _RANDOM_SECOND
        ones = tl.full([], 0xFFFFFFFFFFFFFFFF, tl.uint64)

        # 3. the tournament of both families of GROUP_TILE groups at once (all 8 unless
        #    the rows are wide): group j is g-word j // G (G = 64 // m), its layer l bit
        #    (j % G) * m + l. Family 0 is the intended one: g where the symbol's bit is 0,
        #    the second family (1 - g, or g' in the ablation) where it is 1; family 1 is
        #    the other. Groups past the row's k are played but not counted.
        per_word = 64 // m
        q_int = tl.zeros([BLOCK_N], dtype=p.dtype)
        q_other = tl.zeros([BLOCK_N], dtype=p.dtype)
        for first in range(0, k, GROUP_TILE):
            j = first + tl.arange(0, GROUP_TILE)[None, :, None]
            counted = j < k
            final = rest | ((j // per_word).to(tl.uint64) << tag_shift) | length_bits
            words = _finish(v0, v1, v2, v3, final)  # (2, G, n): g and g'
            g = tl.sum(tl.where(family == 0, words, 0), axis=0)[None, :, :]
            if alternate:
                second = tl.sum(tl.where(family == 1, words, 0), axis=0)[None, :, :]
            else:
                second = g ^ ones
            bit = tl.load(sym_bits + j, mask=counted, other=0) != 0
            played = tl.where((family == 0) != bit, g, second)
            base = (j % per_word) * m
            q_tile = tl.broadcast_to(p[None, None, :], (2, GROUP_TILE, BLOCK_N))
            for layer in range(m):
                g_l = ((played >> (base + layer).to(tl.uint64)) & 1).to(p.dtype)
                expected = tl.sum(q_tile * g_l, axis=2)[:, :, None]
                # E_q[g] can round to 1 + 2^-52: the reference clamps 1 - E at 0
                q_tile = q_tile * tl.maximum(1.0 - expected, 0.0) + q_tile * g_l
            summed = tl.sum(tl.where(counted, q_tile, 0.0), axis=1)  # (2, n)
            q_int += tl.sum(tl.where(pair == 0, summed, 0.0), axis=0)
            q_other += tl.sum(tl.where(pair == 1, summed, 0.0), axis=0)

        # 4. lambda per variant, the combination, clipping, normalisation, the fallback
        positive = p > 0
        entropy = -tl.sum(tl.where(positive, p * tl.log(tl.where(positive, p, 1.0)), 0.0), axis=0)
        decay = tl.exp(-2.0 * entropy)
        lam = tl.load(alpha_ptr + slot).to(p.dtype) * ((1.0 - decay) / (1.0 + decay))  # tanh(H)
        lam = tl.where(code == _NO_ENTROPY, 1.0, lam)
        lam = tl.where((code == _NO_SUBTRACTION) | (code == _NONDISTORTIONARY), 0.0, lam)
        scores = tl.maximum(q_int - lam * q_other, 0.0)
        total = tl.sum(scores, axis=0)
        mass = tl.sum(q_int, axis=0)
        normalised = scores / tl.where(total > 0, total, 1.0)
        fallback = q_int / tl.where(mass > 0, mass, 1.0)  # the intended families alone
        q = tl.where(total > 0, normalised, fallback)
    tl.store(out_ptr + b * out_stride + offs, q, mask=inside)


def _launch_shape(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, GROUP_TILE, num_warps) for rows of ``n`` candidates (untuned: no GPU has
    timed them yet)."""
    block = max(16, triton.next_power_of_2(n))
    tile = max(1, min(8, _TILE_ELEMENTS // block))
    return block, tile, min(8, max(1, tile * block // 128))


def fused_step(
    slots: torch.Tensor,
    candidates: torch.Tensor,
    probs: torch.Tensor,
    out: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
) -> None:
    """Launch the step: ``out`` (B, n) from ``slots`` (B,), ``candidates`` and ``probs``
    (B, n, last dimension contiguous) and the slot tables (keys, config, alpha, bits,
    history, length), every one on the same device."""
    batch, n = probs.shape
    if batch == 0 or n == 0:
        return
    keys, config, alpha, bits, history, length = tables
    block, tile, warps = _launch_shape(n)
    options: dict[str, Any] = {"num_warps": warps}
    if probs.device.type == "cuda":
        options["enable_fp_fusion"] = False
    _step_kernel[(batch,)](
        slots,
        candidates,
        probs,
        out,
        keys,
        config,
        alpha,
        bits,
        history,
        length,
        n,
        candidates.stride(0),
        probs.stride(0),
        out.stride(0),
        config.shape[0],
        history.shape[1],
        BLOCK_N=block,
        BLOCK_T=_BLOCK_T,
        GROUP_TILE=tile,
        **options,
    )


def compile_for_cuda(
    capability: int, dtype: torch.dtype = torch.float64, candidates: int = 64
) -> bytes:
    """The kernel compiled ahead of time for a CUDA compute capability (80: A100, 90: H100),
    without a GPU (Triton ships ptxas): the cubin. The tests check with it that the kernel
    lowers for the GPUs it will run on. Needs Triton's compiler, so not under
    ``TRITON_INTERPRET=1``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block, tile, warps = _launch_shape(candidates)
    real = {torch.float64: "*fp64", torch.float32: "*fp32"}[dtype]
    pointers = [
        "slots",
        "cand",
        "probs",
        "out",
        "keys",
        "config",
        "alpha",
        "bits",
        "hist",
        "length",
    ]
    types = ["*i64", "*i64", real, real, "*i64", "*i64", "*fp64", "*u8", "*i64", "*i64"]
    signature = {f"{name}_ptr": kind for name, kind in zip(pointers, types, strict=True)}
    for name in ("n", "cand_stride", "probs_stride", "out_stride", "capacity", "horizon"):
        signature[name] = "i32"
    constants = {"BLOCK_N": block, "BLOCK_T": _BLOCK_T, "GROUP_TILE": tile}
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = ASTSource(fn=_step_kernel, signature=signature, constexprs=constants)
    options = {"num_warps": warps, "enable_fp_fusion": False}
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    cubin: bytes = compiled.asm["cubin"]
    return cubin
