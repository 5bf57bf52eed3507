"""The batched watermark step of scheme ``worldcup-v2``: one call per decoding step, on the
model's device, for every row of a batch.

:class:`BatchedWorldCup` keeps per-row state in slot tables on the device (each
row's SipHash subkeys, its configuration k, m, c, B, variant and a live flag,
alpha, its payload's symbol bits and its generated tokens; layout in
:mod:`worldcup_core.step_layout`). A step reads them by slot, so its Python
work is the same whatever the batch size: no list of rows, no grouping by
context width, no host synchronisation. Callers that keep a persistent batch
(vLLM) use batch indices as slots and move or swap them; callers that compact
their batch (``ContinuousBatch``) hand out slots from a free list.

What a step computes for rows ``b`` with candidates ``x`` and filtered
probabilities ``p`` of shape (B, n):

1. the context (the row's last c generated tokens) and whether it was seen at an
   earlier step (then, and for the first c tokens, ``p`` is returned unchanged:
   the per-row reference's rule, which the detector mirrors);
2. SipHash-1-3 of the context (the position, then the symbol) and of every
   (context, candidate, word) (the g-words);
3. the 2k-family, m-layer tournament;
4. ``lambda = alpha * tanh(H)`` (per variant), ``sum q_int - lambda sum q_other``,
   clipping and normalisation (with the reference's fallback).

Rows may mix keys, payloads, k, m, c, alpha and variants. Three paths compute it,
one per kind of device (:class:`StepPath`):

* ``fused`` (CUDA): one Triton kernel, one program per row
  (:mod:`worldcup_core._step_triton`); the launch depends only on host-known
  shapes, so the step can be captured in a CUDA graph (see :meth:`BatchedWorldCup.step`);
* ``compiled`` (CPU): the same algorithm as one numba loop over rows
  (:mod:`worldcup_core._step_jit`); on one CPU thread each of the tensor
  path's small kernels costs ~3 us to dispatch;
* ``tensor`` (any other device, or without numba/Triton): torch ops over the
  whole batch, sized by the live rows' largest k, m and c (kept on the host as
  rows come and go); layers beyond a row's m are played with g = 0, which
  leaves q unchanged.

The per-row reference (:class:`worldcup_core.encoder.WorldCupSequenceV2`) stays
the readable definition; ``tests/test_batched.py`` checks all three paths equal
it to 1e-12 in float64 on random batches (the fused kernel under
``TRITON_INTERPRET=1`` where there is no GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from worldcup_core.config import WatermarkConfig
from worldcup_core.message import Payload
from worldcup_core.prf import MAX_GROUPS, PRFV2, SCHEME_V2, WatermarkKey
from worldcup_core.scheme import SequenceWatermark, WorldCup
from worldcup_core.siphash import as_signed
from worldcup_core.step_layout import (
    ALT_KEY,
    CONFIG_COLUMNS,
    GVALUE_KEY,
    MAX_SYMBOLS,
    POSITION_KEY,
    Column,
    VariantCode,
)


class StepPath(StrEnum):
    """How a step is computed (module docstring)."""

    FUSED = "fused"  # one Triton kernel: CUDA (or the CPU under TRITON_INTERPRET=1)
    COMPILED = "compiled"  # one numba loop: the CPU
    TENSOR = "tensor"  # torch ops: any device


# None: each device's own path. Tests and benchmarks force one (the fused kernel on the
# CPU needs TRITON_INTERPRET=1 set before Triton is first imported).
FORCE_PATH: StepPath | None = None
JIT_ENABLED = True  # False: the CPU runs the tensor path (as without numba)

# A float32 step (``dtype=torch.float32``) against the float64 reference: within this
# absolute tolerance for tournaments of up to FLOAT32_MAX_LAYERS layers (the default m is
# 30; at worst 1.5e-5 over 13,000 random rows on the tensor path, 1.7e-6 over 400 on the
# fused kernel). Deeper tournaments can push a token's mass below float32's resolution
# (1 - E_q[g] rounds to 0) and crown another winner: run them in float64, the default.
FLOAT32_TOLERANCE: Final = 1e-4
FLOAT32_MAX_LAYERS: Final = 48

_Kernel = Callable[..., None]


@cache
def _compiled_kernel() -> _Kernel | None:
    try:
        from worldcup_core._step_jit import step_kernel
    except ImportError:  # numba missing or unusable here: the tensor path does the work
        return None
    return step_kernel


@cache
def _fused_kernel() -> _Kernel | None:
    try:
        from worldcup_core._step_triton import fused_step
    except ImportError:  # Triton missing (a CPU-only install): the tensor path does the work
        return None
    return fused_step


def step_path(device: str | torch.device) -> StepPath:
    """The path a step on ``device`` takes (reported by the benchmarks)."""
    if FORCE_PATH is not None:
        return FORCE_PATH
    kind = torch.device(device).type
    if kind == "cpu" and JIT_ENABLED and _compiled_kernel() is not None:
        return StepPath.COMPILED
    if kind == "cuda" and _fused_kernel() is not None:
        return StepPath.FUSED
    return StepPath.TENSOR


def compiled_step_active() -> bool:
    """Whether CPU steps run through the compiled loop (reported by the benchmarks)."""
    return step_path("cpu") is StepPath.COMPILED


def warm_up(device: str | torch.device = "cpu") -> float:
    """Throwaway steps, so that numba (CPU) or Triton (CUDA) compiles the step now (~10 s;
    ~1 s from their disk caches) rather than on the first watermarked request; on CUDA
    for the candidate widths of the usual top-k (up to 16, 32 and 64). Returns the
    seconds taken.

    >>> warm_up() >= 0.0
    True
    """
    start = time.perf_counter()
    scheme = WorldCup(WatermarkKey(bytes(32)), WatermarkConfig(version=SCHEME_V2))
    batch = BatchedWorldCup(device, capacity=1)
    batch.set_row(0, scheme, Payload("01"))
    for token in (1, 2):  # past the first c tokens, so the whole step runs
        batch.append([0], torch.tensor([token]))
    widths = (16, 32, 64) if step_path(device) is StepPath.FUSED else (2,)
    for n in widths:
        cand = torch.arange(3, 3 + n)[None, :]
        batch.step([0], cand, torch.full((1, n), 1.0 / n, dtype=torch.float64))
    return time.perf_counter() - start


@dataclass(frozen=True)
class _Live:
    """What the tensor path and the history's growth need to know about the live rows,
    kept on the host and recomputed only when rows come or go."""

    rows: int
    width: int  # the largest c
    groups: int  # the largest k
    layers: int  # the largest m
    words: int  # the most g-words a row needs
    alternate: bool  # a row plays the random-second ablation
    mixed_groups: bool
    first_append: int  # the append count when the oldest live row was set


# the host copy of each slot's configuration: Column's columns, then the append count at set
_START: Final = CONFIG_COLUMNS
_EMPTY_LIVE: Final = _Live(0, 0, 0, 0, 0, False, False, 0)


class BatchedWorldCup:
    """Device-resident watermark state for many rows; see the module docstring.

    >>> import numpy as np
    >>> from worldcup_core import WatermarkConfig, WatermarkKey, Payload, WorldCup
    >>> wc = WorldCup(WatermarkKey(bytes(32)), WatermarkConfig(version="worldcup-v2"))
    >>> batch = BatchedWorldCup()
    >>> batch.set_row(0, wc, Payload("0110"))
    >>> batch.append([0], torch.tensor([5])); batch.append([0], torch.tensor([9]))
    >>> q = batch.step([0], torch.tensor([[3, 4]]), torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    >>> bool(abs(float(q.sum()) - 1.0) < 1e-12) and q.shape == (1, 2)
    True
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float64,
        capacity: int = 64,
        history: int = 256,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.layout_version = 0  # bumped whenever a table is reallocated (see step)
        self._appends = 0
        self._host = np.zeros((0, CONFIG_COLUMNS + 1), dtype=np.int64)
        self._live: _Live | None = _EMPTY_LIVE
        self._ranges: dict[tuple[int, int, int], torch.Tensor] = {}
        self._device_path: tuple[bool, StepPath] | None = None
        empty = torch.zeros(0, device=self.device)
        self._keys: torch.Tensor = empty  # (C, 3, 2) SipHash subkeys: position, g, alt
        self._config: torch.Tensor = empty  # (C, CONFIG_COLUMNS): Column's columns
        self._alpha: torch.Tensor = empty  # (C,) float64
        self._bits: torch.Tensor = empty  # (C, 64, 8): the payload's symbol bits
        self._history: torch.Tensor = empty  # (C, T): generated tokens
        self._length: torch.Tensor = empty  # (C,)
        self._alloc(max(1, capacity), max(8, history))

    def __repr__(self) -> str:
        live = int(self._host[:, Column.LIVE].sum())
        return f"BatchedWorldCup({live} rows on {self.device})"

    @staticmethod
    def supports(scheme: object) -> bool:
        """True for WorldCup schemes of version ``worldcup-v2`` (others step per row)."""
        return isinstance(scheme, WorldCup) and scheme.version == SCHEME_V2

    @property
    def path(self) -> StepPath:
        if FORCE_PATH is not None:
            return FORCE_PATH
        if self._device_path is None or self._device_path[0] != JIT_ENABLED:
            self._device_path = (JIT_ENABLED, step_path(self.device))  # once, not per step
        return self._device_path[1]

    # ------------------------------------------------------------------ slots
    def _alloc(self, capacity: int, history: int) -> None:
        dev = self.device

        def grow(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            # Always a normal tensor, even when the growth happens inside an engine's
            # torch.inference_mode() step: an inference tensor could not be updated in
            # place afterwards outside it (a cancel, a clear_row) and the engine thread
            # would die with "Inplace update to inference tensor outside InferenceMode".
            with torch.inference_mode(False):
                new = torch.zeros(shape, dtype=dtype, device=dev)
                if t.numel():
                    new[tuple(slice(0, s) for s in t.shape)] = t
            return new

        self._keys = grow(self._keys, (capacity, 3, 2), torch.int64)
        self._config = grow(self._config, (capacity, CONFIG_COLUMNS), torch.int64)
        self._alpha = grow(self._alpha, (capacity,), torch.float64)
        self._bits = grow(self._bits, (capacity, MAX_SYMBOLS, MAX_GROUPS), torch.uint8)
        self._history = grow(self._history, (capacity, history), torch.int64)
        self._length = grow(self._length, (capacity,), torch.int64)
        host = np.zeros((capacity, CONFIG_COLUMNS + 1), dtype=np.int64)
        host[: self._host.shape[0]] = self._host
        self._host = host
        self._views: tuple[npt.NDArray[Any], ...] | None = None
        self._table_tuple = (
            self._keys,
            self._config,
            self._alpha,
            self._bits,
            self._history,
            self._length,
        )
        self.layout_version += 1

    def reserve(self, capacity: int, history: int | None = None) -> None:
        """Grow the tables now to at least ``capacity`` slots and ``history`` tokens a row,
        e.g. before capturing steps in a CUDA graph (a growth reallocates the tables)."""
        horizon = self._history.shape[1]
        if capacity > self.capacity or (history is not None and history > horizon):
            self._alloc(max(capacity, self.capacity), max(history or 0, horizon))

    def _fit(self, *slots: int) -> None:
        """Every table holds ``slots`` (adds, moves and swaps may name any index)."""
        top = max(slots)
        if top >= self.capacity:
            self._alloc(max(top + 1, 2 * self.capacity), self._history.shape[1])

    @property
    def capacity(self) -> int:
        return int(self._host.shape[0])

    def set_row(self, slot: int, scheme: WorldCup, payload: Payload) -> None:
        """Start a fresh sequence in ``slot`` (its generated history is empty)."""
        if not self.supports(scheme):
            raise ValueError("the batched step serves worldcup-v2 WorldCup schemes only")
        if slot < 0:
            raise ValueError(f"a slot is a non-negative index, got {slot}")
        self._fit(slot)
        cfg = scheme.config
        prf = scheme.prf
        assert isinstance(prf, PRFV2)
        keys = [prf.position_key, prf.gvalue_key, prf.alt_key]
        self._keys[slot] = torch.tensor(
            [[as_signed(k0), as_signed(k1)] for k0, k1 in keys], dtype=torch.int64
        )
        symbol_bits = payload.bit_array(cfg.groups)  # (B, k)
        bits = torch.zeros((MAX_SYMBOLS, MAX_GROUPS), dtype=torch.uint8)
        bits[: symbol_bits.shape[0], : cfg.groups] = torch.from_numpy(symbol_bits)
        self._bits[slot] = bits
        row = [0] * CONFIG_COLUMNS
        row[Column.GROUPS], row[Column.LAYERS] = cfg.groups, cfg.layers
        row[Column.WIDTH], row[Column.SYMBOLS] = cfg.context_width, symbol_bits.shape[0]
        row[Column.VARIANT], row[Column.LIVE] = VariantCode.of(cfg.variant), 1
        self._config[slot] = torch.tensor(row)
        self._alpha[slot] = cfg.alpha
        self._length[slot] = 0
        self._host[slot] = [*row, self._appends]
        self._live = None

    def clear_row(self, slot: int) -> None:
        if 0 <= slot < self.capacity and self._host[slot, Column.LIVE]:
            self._config[slot, Column.LIVE] = 0
            self._host[slot, Column.LIVE] = 0
            self._live = None

    def _tables(self) -> tuple[torch.Tensor, ...]:
        return self._table_tuple  # made once per allocation (the step's launch reads it)

    def move_row(self, src: int, dst: int) -> None:
        """vLLM's one-way move: ``dst`` takes over ``src``'s row; ``src`` is emptied."""
        self._fit(src, dst)
        if src == dst:
            return
        for t in self._tables():
            t[dst] = t[src]
        self._host[dst] = self._host[src]
        self.clear_row(src)
        self._live = None

    def swap_rows(self, a: int, b: int) -> None:
        self._fit(a, b)
        idx = torch.tensor([a, b], device=self.device)
        rev = torch.tensor([b, a], device=self.device)
        for t in self._tables():
            t[idx] = t[rev]
        self._host[[a, b]] = self._host[[b, a]]
        self._live = None

    def _index(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The step's slots as an int64 tensor on the device. A device tensor is used as
        it is; a ``range`` (the HF processor's) is cached; a list is copied over."""
        if isinstance(slots, torch.Tensor):
            if slots.dtype == torch.int64 and slots.device == self.device:
                return slots  # no dispatch at all for the usual caller
            return slots.to(self.device, torch.int64)
        if isinstance(slots, range):
            key = (slots.start, slots.stop, slots.step)
            cached = self._ranges.get(key)
            if cached is None:
                cached = torch.arange(*key, device=self.device)
                self._ranges[key] = cached
            return cached
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def _live_rows(self) -> _Live:
        if self._live is None:
            host = self._host[self._host[:, Column.LIVE] != 0]
            if not host.shape[0]:
                self._live = _EMPTY_LIVE
            else:
                k, m = host[:, Column.GROUPS], host[:, Column.LAYERS]
                self._live = _Live(
                    rows=int(host.shape[0]),
                    width=int(host[:, Column.WIDTH].max()),
                    groups=int(k.max()),
                    layers=int(m.max()),
                    words=int((-(-k // (64 // m))).max()),  # prf.gvalue_words, per row
                    alternate=bool((host[:, Column.VARIANT] == VariantCode.RANDOM_SECOND).any()),
                    mixed_groups=bool(k.min() != k.max()),
                    first_append=int(host[:, _START].min()),
                )
        return self._live

    def append(self, slots: Sequence[int] | torch.Tensor, tokens: torch.Tensor) -> None:
        """Record one sampled token per slot (the step's rows, in order). The tables grow
        to hold every slot of a list or range; a tensor's slots must lie within them
        (checking would read it back from the device)."""
        if not len(slots):
            return
        if not isinstance(slots, torch.Tensor):
            low, high = _bounds(slots)
            if low < 0:
                raise ValueError(f"a slot is a non-negative index, got {low}")
            self._fit(high)
        self._appends += 1
        live = self._live_rows()
        horizon = self._history.shape[1]
        longest = self._appends - live.first_append if live.rows else 0
        if longest >= horizon:
            self._alloc(self.capacity, max(2 * horizon, longest + 1))
        idx = self._index(slots)
        pos = self._length[idx].clamp(max=self._history.shape[1] - 1)
        self._history[idx, pos] = tokens.to(self.device, torch.int64)
        self._length[idx] += 1

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def reweight_mixed(
        self,
        slots: Sequence[int | None],
        host: Sequence[SequenceWatermark | None],
        candidates: torch.Tensor,
        probs: torch.Tensor,
    ) -> torch.Tensor:
        """q for a batch that mixes schemes, as every engine's batch may: rows with a slot
        take the batched step together (one call; a row without one gets its ``probs``
        back from it); rows with a ``host`` watermark (v1, baselines) reweight one by one
        on the host over their live candidates; the rest keep ``probs``. Returns
        ``probs`` itself when no row is watermarked."""
        q = probs
        if any(s is not None for s in slots):
            q = self.step([-1 if s is None else s for s in slots], candidates, probs)
        per_row = [i for i, wm in enumerate(host) if wm is not None]
        if per_row:
            q = q.clone() if q is probs else q
            cand_np, probs_np = candidates.cpu().numpy(), probs.cpu().numpy()
            for i in per_row:
                wm = host[i]
                assert wm is not None
                live = int(np.count_nonzero(probs_np[i]))
                reweighted = wm.reweight(cand_np[i, :live], probs_np[i, :live])
                q[i, :live] = torch.from_numpy(reweighted).to(q.device, q.dtype)
        return q

    def step(
        self,
        slots: Sequence[int] | torch.Tensor,
        candidates: torch.Tensor,
        probs: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The watermarked distribution q (B, n) over ``candidates`` (B, n) int64 token ids,
        given the filtered probabilities ``probs`` (B, n) (0 marks padding). Slots without
        a row (a negative slot, one past the tables, a cleared one), first-c and
        repeated-context steps get ``probs`` back. ``out``: a preallocated (B, n)
        contiguous tensor of this object's dtype to write q into (and return).

        The step's Python work does not depend on B. On the fused path (CUDA) it is one
        kernel launch and nothing else when the caller hands over what the kernel reads
        as it is: ``slots`` an int64 device tensor (a list is copied from the host),
        ``candidates`` and ``probs`` device tensors with their last dimension contiguous
        (``probs`` in this object's dtype, else a conversion runs) and ``out``
        preallocated (else one allocation). It never synchronises with the host nor
        allocates by data, so it can be captured in a CUDA graph for a fixed (B, n)
        bucket, provided the tables do not grow while the graph is in use: :meth:`reserve`
        them first, and re-capture whenever ``layout_version`` changes.
        """
        idx = self._index(slots)
        path = self.path
        if path is StepPath.FUSED and candidates.shape[1] <= _max_fused_candidates():
            return self._step_fused(idx, candidates, probs, out)
        with torch.inference_mode():
            if path is StepPath.COMPILED:
                q = self._step_compiled(idx, candidates, probs)
            else:
                q = self._step_tensor(idx, candidates, probs)
        if out is None:
            return q
        out.copy_(q)
        return out

    def _step_fused(
        self,
        idx: torch.Tensor,
        candidates: torch.Tensor,
        probs: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        kernel = _fused_kernel()
        assert kernel is not None
        p = probs
        if p.dtype != self.dtype or p.device != self.device:
            p = p.to(self.device, self.dtype)
        if p.stride(-1) != 1:
            p = p.contiguous()
        cand = candidates if candidates.device == self.device else candidates.to(self.device)
        if cand.stride(-1) != 1:
            cand = cand.contiguous()
        if out is None:
            out = torch.empty_like(p, memory_format=torch.contiguous_format)
        elif out.shape != p.shape or out.dtype != p.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {tuple(p.shape)} {p.dtype} tensor")
        kernel(idx, cand, p, out, self._table_tuple)
        return out

    def _step_compiled(
        self, idx: torch.Tensor, candidates: torch.Tensor, probs: torch.Tensor
    ) -> torch.Tensor:
        kernel = _compiled_kernel()
        assert kernel is not None
        p64 = probs.to(torch.float64).contiguous()
        out = torch.empty_like(p64)
        if self._views is None:  # numpy views of the tables, once per allocation
            keys, *rest = self._tables()
            self._views = (keys.numpy().view(np.uint64), *(t.numpy() for t in rest))
        cand = candidates.to(torch.int64).contiguous().numpy()
        kernel(idx.contiguous().numpy(), cand, p64.numpy(), *self._views, out.numpy())
        return out.to(self.dtype)

    def _step_tensor(
        self, idx: torch.Tensor, candidates: torch.Tensor, probs: torch.Tensor
    ) -> torch.Tensor:
        """The step in torch ops over the whole batch, sized by the live rows' largest
        c, k and m; each row's own are tensors, applied by masks."""
        live_rows = self._live_rows()
        p = probs.to(self.device, self.dtype)
        if not live_rows.rows:
            return p.clone()
        dev = self.device
        batch, n = candidates.shape
        cand = candidates.to(dev, torch.int64)
        valid = (idx >= 0) & (idx < self.capacity)
        slot = torch.where(valid, idx, 0)
        cfg = self._config[slot]
        k_row, width = cfg[:, Column.GROUPS], cfg[:, Column.WIDTH]
        m_row = cfg[:, Column.LAYERS].clamp(min=1)  # an empty slot's 0 (its row passes p)
        nsym, variant = cfg[:, Column.SYMBOLS], cfg[:, Column.VARIANT]
        horizon = self._history.shape[1]
        length = self._length[slot].clamp(max=horizon)

        # 1. context (left-aligned in (B, c_max), zeros past a row's c), eligibility
        c_max = live_rows.width
        longest = self._appends - live_rows.first_append
        span = min(horizon, max(c_max + 1, longest + 1))
        hist = self._history[slot, :span]
        j = torch.arange(c_max, device=dev)
        in_ctx = j[None, :] < width[:, None]
        end = length - width
        at = (end[:, None] + j).clamp(0, span - 1)
        ctx = torch.where(in_ctx, hist.gather(1, at), 0)
        padded = F.pad(hist, (0, c_max), value=-1)
        same = torch.ones((batch, span), dtype=torch.bool, device=dev)
        for i in range(c_max):
            same &= (padded[:, i : i + span] == ctx[:, i : i + 1]) | ~in_ctx[:, i : i + 1]
        earlier = torch.arange(span, device=dev)[None, :] < end[:, None]
        seen = (same & earlier).any(dim=1)
        live = valid & (cfg[:, Column.LIVE] != 0) & (length >= width) & ~seen

        # 2. SipHash: the context's blocks once per row and key, then per candidate
        keys = self._keys[slot]  # (B, 3, 2)
        state = _sip_init(keys[:, :, 0].T, keys[:, :, 1].T)  # (3, B) lanes
        for i in range(c_max // 2):
            block = ctx[:, 2 * i] | (ctx[:, 2 * i + 1] << 32)
            state = _where(i < width // 2, _absorb(state, block), state)
        odd = width % 2 == 1
        last = torch.where(odd, ctx.gather(1, (width - 1).clamp(min=0)[:, None])[:, 0], 0)
        position = _finish([v[POSITION_KEY] for v in state], last | ((4 * width) << 56))
        families = [GVALUE_KEY, ALT_KEY] if live_rows.alternate else [GVALUE_KEY]
        lanes = [v[families][:, :, None].expand(-1, -1, n) for v in state]  # (F, B, n)
        lanes = _where(odd[:, None], _absorb(lanes, last[:, None] | (cand << 32)), lanes)
        rest = torch.where(odd[:, None], 0, cand)
        tag_shift = torch.where(odd, 0, 32)[:, None]
        length_bits = ((4 * width + 5) << 56)[:, None]
        tags = torch.arange(live_rows.words, device=dev)[:, None, None, None]
        final = rest | (tags << tag_shift) | length_bits  # (W, 1, B, n)
        words = _finish([v[None] for v in lanes], final)  # (W, F, B, n)

        # 3. symbol, its bits, and each family's m g-bits as one integer per
        #    (row, family, group, candidate): bit l is layer l, families 0 = intended.
        hi = (position >> 32) & 0xFFFFFFFF
        symbol = (hi * nsym) >> 32  # multiply-shift: the symbol of a B-symbol payload
        big_k, big_m = live_rows.groups, live_rows.layers
        sym_bits = self._bits[slot, symbol, :big_k].to(torch.int64)  # (B, K)
        mask = torch.where(m_row >= 64, -1, (1 << m_row.clamp(max=63)) - 1)[:, None, None]
        g = _group_words(words[:, 0], m_row, big_k) & mask  # (B, K, n)
        flip = -sym_bits[:, :, None] & mask  # all m bits set where the symbol bit is 1
        intended = g ^ flip
        other = intended ^ mask  # the complementary family: 1 - g
        if live_rows.alternate:
            g_alt = _group_words(words[:, 1], m_row, big_k) & mask
            alt_rows = (variant == VariantCode.RANDOM_SECOND)[:, None, None]
            bit_one = sym_bits[:, :, None] == 1
            intended = torch.where(alt_rows, torch.where(bit_one, g_alt, g), intended)
            other = torch.where(alt_rows, torch.where(bit_one, g, g_alt), other)
        both = torch.stack([intended, other], dim=1)  # (B, 2, K, n)

        # 4. the tournament, every row, family and candidate at once:
        #    q <- q * (1 - E_q[g] + g), layer after layer (seven small tensor ops a
        #    layer, peeling bit l off each family's word). Layers beyond a row's m have g = 0
        #    (masked above), which leaves q unchanged. The reference clamps
        #    1 - E_q[g] at 0 against rounding (E_q[g] = 1 + 2^-52); here such a
        #    token's mass can end at -1e-16 instead of 0, which the final clipping removes.
        q = p[:, None, None, :].expand(batch, 2, big_k, n).contiguous()
        low = torch.empty_like(both)
        g_l = torch.empty_like(q)
        for _ in range(big_m):
            torch.bitwise_and(both, 1, out=low)
            g_l.copy_(low)
            both.bitwise_right_shift_(1)  # the masked words are >= 0: a logical shift
            expected = torch.linalg.vecdot(q, g_l)[..., None]
            q.addcmul_(q, g_l.sub_(expected))
        if live_rows.mixed_groups:  # groups beyond a row's k take no part
            group_on = (torch.arange(big_k, device=dev)[None, :] < k_row[:, None]).to(q.dtype)
            q = q * group_on[:, None, :, None]
        q_int, q_other = q[:, 0].sum(dim=1), q[:, 1].sum(dim=1)  # (B, n)

        # 5. lambda per variant, combination, clipping and normalisation
        alpha = self._alpha[slot].to(self.dtype)
        lam = alpha * torch.tanh(torch.special.entr(p).sum(dim=-1))
        lam = torch.where(variant == VariantCode.NO_ENTROPY, 1.0, lam)
        no_subtraction = (variant == VariantCode.NO_SUBTRACTION) | (
            variant == VariantCode.NONDISTORTIONARY
        )
        lam = torch.where(no_subtraction, 0.0, lam)
        scores = torch.addcmul(q_int, lam[:, None], q_other, value=-1.0).clamp_(min=0.0)
        total = scores.sum(dim=-1, keepdim=True)
        fallback = q_int.clamp(min=0.0)
        fallback /= fallback.sum(dim=-1, keepdim=True).clamp(min=1e-300)
        watermarked = torch.where(total > 0, scores / total.clamp(min=1e-300), fallback)
        return torch.where(live[:, None], watermarked, p)


def _bounds(slots: Sequence[int]) -> tuple[int, int]:
    """The smallest and the largest slot (a range's without walking it)."""
    ends = (slots[0], slots[-1]) if isinstance(slots, range) else (min(slots), max(slots))
    return min(ends), max(ends)


@cache
def _max_fused_candidates() -> int:
    from worldcup_core._step_triton import MAX_CANDIDATES

    return MAX_CANDIDATES


# --------------------------------------------------------------------------- the tensor path's
# SipHash-1-3 on int64 lanes (the bit patterns of uint64 words), starting from any state,
# so that the context's blocks are absorbed once per row; bit-identical with siphash.py
_State = list[torch.Tensor]
_INIT: Final = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)


def _rotl(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x << bits) | ((x >> (64 - bits)) & ((1 << bits) - 1))  # >> is arithmetic: mask


def _sipround(v: _State) -> _State:
    v0, v1, v2, v3 = v
    v0 = v0 + v1
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = v2 + v3
    v3 = _rotl(v3, 16) ^ v2
    v0 = v0 + v3
    v3 = _rotl(v3, 21) ^ v0
    v2 = v2 + v1
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return [v0, v1, v2, v3]


def _sip_init(k0: torch.Tensor, k1: torch.Tensor) -> _State:
    return [k0 ^ _INIT[0], k1 ^ _INIT[1], k0 ^ _INIT[2], k1 ^ _INIT[3]]


def _absorb(v: _State, block: torch.Tensor) -> _State:
    v0, v1, v2, v3 = _sipround([v[0], v[1], v[2], v[3] ^ block])
    return [v0 ^ block, v1, v2, v3]


def _where(cond: torch.Tensor | bool, a: _State, b: _State) -> _State:
    if isinstance(cond, bool):
        return a if cond else b
    return [torch.where(cond, x, y) for x, y in zip(a, b, strict=True)]


def _finish(v: _State, final: torch.Tensor) -> torch.Tensor:
    v = _absorb(v, final)
    v[2] = v[2] ^ 0xFF
    for _ in range(3):
        v = _sipround(v)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def _group_words(words: torch.Tensor, m_row: torch.Tensor, big_k: int) -> torch.Tensor:
    """Each group's m g-bits shifted down to bit 0: (B, K, n) int64, from ``words``
    (W, B, n); group j is word j // (64 // m), its layer l bit (j % (64 // m)) * m + l."""
    num_words, batch, n = words.shape
    stacked = words.permute(1, 2, 0)  # (B, n, W)
    j = torch.arange(big_k, device=words.device)[None, :]
    per_word = 64 // m_row[:, None]  # (B, 1)
    word_of = (j // per_word).clamp(max=num_words - 1)  # (B, K)
    group_words = stacked.gather(2, word_of[:, None, :].expand(batch, n, big_k))  # (B, n, K)
    base = ((j % per_word) * m_row[:, None])[:, None, :]  # the group's first bit
    return (group_words >> base).permute(0, 2, 1)  # arithmetic shift: callers mask
