"""The batched watermark step of scheme ``worldcup-v2``: one call per decoding step, on the
model's device, for every row of a batch.

:class:`BatchedWorldCup` keeps per-row state in slots of device tensors (each
row's SipHash subkeys, configuration, payload bits and generated tokens), so
that a decoding step is a fixed sequence of tensor operations whatever the
batch size: no Python loop over rows. Callers that keep a persistent batch
(vLLM) use batch indices as slots and move or swap them; callers that compact
their batch (``ContinuousBatch``) hand out slots from a free list.

What a step computes, all in torch on the device, for rows ``b`` with
candidates ``x`` and filtered probabilities ``p`` of shape (B, n):

1. the context (last c generated tokens) and whether it was seen before in the
   row (then, and for the first c tokens, ``p`` is returned unchanged: the
   per-row reference's rule, which the detector mirrors);
2. SipHash-1-3 of the context (the position) and of every (context, candidate)
   (the g-words), in one pass over all lanes;
3. the 2k-family, m-layer tournament in closed form over (B, 2k, m, n), the
   layer loop vectorised over rows, families and candidates;
4. ``lambda = alpha * tanh(H)`` (per variant), ``sum q_int - lambda sum q_other``,
   clipping and normalisation (with the reference's fallback).

Rows may mix keys, payloads, k, m, alpha and variants; layers beyond a row's m
are played with g = 0 everywhere, which leaves q unchanged.

On the CPU the same step runs through two compiled loops
(:mod:`worldcup_core._step_jit`, numba) over numpy views of the same slot
tensors, with the PRF's own array functions in between: on one CPU thread each
of the tensor path's ~300 small kernels costs ~3 us to dispatch, which made
the step ~1.3 ms at batch 1 and 28 us a row at batch 64; the compiled loops
take ~0.2 ms and ~8 us. Any other device (CUDA) runs the tensor path, and so
does a CPU without numba.

The per-row reference (:class:`worldcup_core.encoder.WorldCupSequenceV2`) stays
the readable definition; ``tests/test_batched.py`` checks both paths equal it to 1e-12 in
float64 on random batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.message import Payload
from worldcup_core.prf import (
    PRFV2,
    SCHEME_V2,
    WatermarkKey,
    gvalue_words,
    v2_gwords,
    v2_positions,
)
from worldcup_core.scheme import SequenceWatermark, WorldCup
from worldcup_core.scoring import symbol_index
from worldcup_core.siphash import as_signed, message_blocks, siphash13

_VARIANTS: Final = (
    Variant.WORLDCUP,
    Variant.NO_ENTROPY,
    Variant.NO_SUBTRACTION,
    Variant.RANDOM_SECOND,
    Variant.NONDISTORTIONARY,
)
_MAX_SYMBOLS: Final = 64
JIT_ENABLED = True  # tests switch the compiled CPU loop off to check the tensor path
_MAX_GROUPS: Final = 8


_Kernels = tuple[Callable[..., None], Callable[..., None]]


@cache
def _load_kernels() -> _Kernels | None:
    try:
        from worldcup_core._step_jit import context_kernel, step_kernel
    except ImportError:  # numba missing or unusable here: the tensor path does the work
        return None
    return context_kernel, step_kernel


def _kernels() -> _Kernels | None:
    return _load_kernels() if JIT_ENABLED else None


def compiled_step_active() -> bool:
    """Whether CPU steps run through the compiled loops (reported by the benchmarks)."""
    return _kernels() is not None


def warm_up(device: str | torch.device = "cpu") -> float:
    """One throwaway step, so that numba compiles the CPU loops now (~10 s; ~1 s from its
    disk cache) rather than on the first watermarked request. Returns the seconds taken.

    >>> warm_up() >= 0.0
    True
    """
    start = time.perf_counter()
    scheme = WorldCup(WatermarkKey(bytes(32)), WatermarkConfig(version=SCHEME_V2))
    batch = BatchedWorldCup(device, capacity=1)
    batch.set_row(0, scheme, Payload("01"))
    for token in (1, 2):  # past the first c tokens, so the whole step runs
        batch.append([0], torch.tensor([token]))
    batch.step([0], torch.tensor([[3, 4]]), torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    return time.perf_counter() - start


@dataclass(frozen=True)
class _Row:
    """What the step needs to know about a slot without reading device memory."""

    width: int
    groups: int
    layers: int
    variant: Variant
    start: int  # the append counter when the row was set


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
        self._rows: list[_Row | None] = []
        self._appends = 0
        empty = torch.zeros(0, device=self.device)
        self._keys: torch.Tensor = empty  # (C, 3, 2) SipHash subkeys: position, g, alt
        self._config: torch.Tensor = empty  # (C, 5): k, m, c, symbols, variant
        self._alpha: torch.Tensor = empty  # (C,)
        self._bits: torch.Tensor = empty  # (C, 64, 8): the payload's symbol bits
        self._history: torch.Tensor = empty  # (C, T): generated tokens
        self._length: torch.Tensor = empty  # (C,)
        self._alloc(max(1, capacity), max(8, history))

    def __repr__(self) -> str:
        live = sum(r is not None for r in self._rows)
        return f"BatchedWorldCup({live} rows on {self.device})"

    @staticmethod
    def supports(scheme: object) -> bool:
        """True for WorldCup schemes of version ``worldcup-v2`` (others step per row)."""
        return isinstance(scheme, WorldCup) and scheme.version == SCHEME_V2

    # ------------------------------------------------------------------ slots
    def _alloc(self, capacity: int, history: int) -> None:
        dev = self.device
        old = len(self._rows)
        self._rows += [None] * (capacity - old)

        def grow(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            new = torch.zeros(shape, dtype=dtype, device=dev)
            if t.numel():
                new[tuple(slice(0, s) for s in t.shape)] = t
            return new

        self._keys = grow(self._keys, (capacity, 3, 2), torch.int64)
        self._config = grow(self._config, (capacity, 5), torch.int64)
        self._alpha = grow(self._alpha, (capacity,), self.dtype)
        self._bits = grow(self._bits, (capacity, _MAX_SYMBOLS, _MAX_GROUPS), torch.uint8)
        self._history = grow(self._history, (capacity, history), torch.int64)
        self._length = grow(self._length, (capacity,), torch.int64)

    @property
    def capacity(self) -> int:
        return len(self._rows)

    def _reserve(self, slot: int) -> None:
        """Grow the slot tables (at least doubling) so that ``slot`` is a valid index."""
        if slot >= self.capacity:
            self._alloc(max(slot + 1, 2 * self.capacity), self._history.shape[1])

    def set_row(self, slot: int, scheme: WorldCup, payload: Payload) -> None:
        """Start a fresh sequence in ``slot`` (its generated history is empty)."""
        if not self.supports(scheme):
            raise ValueError("the batched step serves worldcup-v2 WorldCup schemes only")
        self._reserve(slot)
        cfg = scheme.config
        prf = scheme.prf
        assert isinstance(prf, PRFV2)
        keys = [prf.position_key, prf.gvalue_key, prf.alt_key]
        self._keys[slot] = torch.tensor(
            [[as_signed(k0), as_signed(k1)] for k0, k1 in keys], dtype=torch.int64
        )
        symbol_bits = payload.bit_array(cfg.groups)  # (B, k)
        bits = torch.zeros((_MAX_SYMBOLS, _MAX_GROUPS), dtype=torch.uint8)
        bits[: symbol_bits.shape[0], : cfg.groups] = torch.from_numpy(symbol_bits)
        self._bits[slot] = bits
        variant = _VARIANTS.index(cfg.variant)
        self._config[slot] = torch.tensor(
            [cfg.groups, cfg.layers, cfg.context_width, symbol_bits.shape[0], variant]
        )
        self._alpha[slot] = cfg.alpha
        self._length[slot] = 0
        self._rows[slot] = _Row(
            cfg.context_width, cfg.groups, cfg.layers, cfg.variant, self._appends
        )

    def clear_row(self, slot: int) -> None:
        if slot < self.capacity:
            self._rows[slot] = None

    def move_row(self, src: int, dst: int) -> None:
        """vLLM's one-way move: ``dst`` takes over ``src``'s row; ``src`` is emptied."""
        self._reserve(max(src, dst))
        for t in (self._keys, self._config, self._alpha, self._bits, self._history, self._length):
            t[dst] = t[src]
        self._rows[dst], self._rows[src] = self._rows[src], None

    def swap_rows(self, a: int, b: int) -> None:
        """vLLM's swap of two batch indices (either may never have held a row)."""
        self._reserve(max(a, b))
        idx = torch.tensor([a, b], device=self.device)
        rev = torch.tensor([b, a], device=self.device)
        for t in (self._keys, self._config, self._alpha, self._bits, self._history, self._length):
            t[idx] = t[rev]
        self._rows[a], self._rows[b] = self._rows[b], self._rows[a]

    def append(self, slots: Sequence[int], tokens: torch.Tensor) -> None:
        """Record one sampled token per slot (the step's rows, in order)."""
        if not len(slots):
            return
        self._appends += 1
        live = [r.start for r in self._rows if r is not None]
        longest = self._appends - min(live) if live else 0
        if longest >= self._history.shape[1]:
            self._alloc(self.capacity, 2 * self._history.shape[1])
        idx = torch.as_tensor(list(slots), device=self.device)
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
        take the batched step together; rows with a ``host`` watermark (v1, baselines)
        reweight one by one on the host over their live candidates; the rest keep
        ``probs``. Returns ``probs`` itself when no row is watermarked."""
        q = probs
        on_device = [i for i, s in enumerate(slots) if s is not None]
        if len(on_device) == len(slots):
            q = self.step([s for s in slots if s is not None], candidates, probs)
        elif on_device:
            index = torch.tensor(on_device, device=probs.device)
            q = probs.clone()
            picked = [s for s in (slots[i] for i in on_device) if s is not None]
            q[index] = self.step(picked, candidates[index], probs[index]).to(q.dtype)
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

    @torch.inference_mode()
    def step(
        self, slots: Sequence[int], candidates: torch.Tensor, probs: torch.Tensor
    ) -> torch.Tensor:
        """The watermarked distribution q (B, n) over ``candidates`` (B, n) int64 token ids,
        given the filtered probabilities ``probs`` (B, n) (0 marks padding). Slots without
        a row, first-c and repeated-context steps get ``probs`` back."""
        out = probs.to(self.device, self.dtype).clone()
        capacity = self.capacity
        rows = [self._rows[s] if s < capacity else None for s in slots]
        by_width: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if r is not None:
                by_width.setdefault(r.width, []).append(i)
        cand = candidates.to(self.device, torch.int64)
        for width, members in by_width.items():
            picked = [rows[i] for i in members]
            assert all(r is not None for r in picked)
            if len(members) == len(slots):
                index = None
                sl, c, p = list(slots), cand, out
            else:
                index = torch.tensor(members, device=self.device)
                sl, c, p = [slots[i] for i in members], cand[index], out[index]
            q = self._step(sl, [r for r in picked if r is not None], width, c, p)
            if index is None:
                out = q
            else:
                out[index] = q
        return out

    def _step(
        self,
        slots: list[int],
        rows: list[_Row],
        width: int,
        cand: torch.Tensor,
        probs: torch.Tensor,
    ) -> torch.Tensor:
        dev = self.device
        words_needed = max(gvalue_words(r.groups, r.layers) for r in rows)
        any_alt = any(r.variant is Variant.RANDOM_SECOND for r in rows)
        kernels = _kernels() if dev.type == "cpu" else None
        if kernels is not None:
            return self._step_cpu(kernels, slots, width, words_needed, any_alt, cand, probs)
        batch, n = cand.shape
        idx = torch.tensor(slots, device=dev)
        cfg = self._config[idx]  # (B, 5): k, m, c, B, variant
        k_row, m_row, nsym, variant = cfg[:, 0], cfg[:, 1], cfg[:, 3], cfg[:, 4]
        big_k = max(r.groups for r in rows)
        big_m = max(r.layers for r in rows)
        length = self._length[idx]

        # 1. context, eligibility (t >= c and the context not seen at an earlier step >= c)
        longest = max(self._appends - r.start for r in rows)
        span = max(width + 1, min(self._history.shape[1], longest + 1))
        hist = self._history[idx, :span]  # (B, T)
        at = (length[:, None] - width + torch.arange(width, device=dev)).clamp(min=0)
        ctx = hist.gather(1, at)  # (B, c)
        windows = span - width + 1
        same = torch.ones((batch, windows), dtype=torch.bool, device=dev)
        for j in range(width):
            same &= hist[:, j : j + windows] == ctx[:, j : j + 1]
        earlier = torch.arange(windows, device=dev)[None, :] < (length - width)[:, None]
        seen = (same & earlier).any(dim=1)
        live = (length >= width) & ~seen  # (B,)

        # 2. positions and g-words: SipHash over B + B*n lanes (one pass when c is even)
        keys = self._keys[idx]  # (B, 3, 2)
        ctx_cols = [ctx[:, j] for j in range(width)]
        flat_tokens = cand.reshape(-1)
        ctx_rep = [col.repeat_interleave(n) for col in ctx_cols]
        pos64, gwords, altwords = self._hash(
            keys, ctx_cols, ctx_rep, flat_tokens, n, words_needed, any_alt
        )

        # 3. symbol, its bits, and each family's m g-bits as one integer per
        #    (row, family, group, candidate): bit l is layer l, families 0 = intended.
        hi = (pos64 >> 32) & 0xFFFFFFFF
        symbol = (hi * nsym) >> 32  # multiply-shift: the symbol of a B-symbol payload
        sym_bits = self._bits[idx, symbol, :big_k].to(torch.int64)  # (B, K)
        mask = torch.where(m_row >= 64, -1, (1 << m_row.clamp(max=63)) - 1)[:, None, None]
        g = self._group_words(gwords, m_row, big_k, batch, n) & mask  # (B, K, n)
        flip = -sym_bits[:, :, None] & mask  # all m bits set where the symbol bit is 1
        intended = g ^ flip
        other = intended ^ mask  # the complementary family: 1 - g
        if any_alt:
            g_alt = self._group_words(altwords, m_row, big_k, batch, n) & mask
            alt_rows = (variant == 3)[:, None, None]
            bit_one = sym_bits[:, :, None] == 1
            intended = torch.where(alt_rows, torch.where(bit_one, g_alt, g), intended)
            other = torch.where(alt_rows, torch.where(bit_one, g, g_alt), other)
        words = torch.stack([intended, other], dim=1)  # (B, 2, K, n)

        # 4. the tournament, every row, family and candidate at once:
        #    q <- q * (1 - E_q[g] + g), layer after layer (seven small tensor ops a
        #    layer, peeling bit l off each family's word). Layers beyond a row's m have g = 0
        #    (masked above), which leaves q unchanged. The reference clamps
        #    1 - E_q[g] at 0 against rounding (E_q[g] = 1 + 2^-52); here such a
        #    token's mass can end at -1e-16 instead of 0, which the final clipping removes.
        q = probs[:, None, None, :].expand(batch, 2, big_k, n).contiguous()
        bits = words.clone()
        low = torch.empty_like(bits)
        g_l = torch.empty_like(q)
        for _ in range(big_m):
            torch.bitwise_and(bits, 1, out=low)
            g_l.copy_(low)
            bits.bitwise_right_shift_(1)  # the masked words are >= 0: a logical shift
            expected = torch.linalg.vecdot(q, g_l)[..., None]
            q.addcmul_(q, g_l.sub_(expected))
        if len({r.groups for r in rows}) > 1:  # groups beyond a row's k take no part
            group_on = (torch.arange(big_k, device=dev)[None, :] < k_row[:, None]).to(q.dtype)
            q = q * group_on[:, None, :, None]
        q_int, q_other = q[:, 0].sum(dim=1), q[:, 1].sum(dim=1)  # (B, n)

        # 5. lambda per variant, combination, clipping and normalisation
        lam = self._alpha[idx] * torch.tanh(torch.special.entr(probs).sum(dim=-1))
        fixed = (Variant.NO_ENTROPY, Variant.NO_SUBTRACTION, Variant.NONDISTORTIONARY)
        if any(r.variant in fixed for r in rows):
            lam = torch.where(variant == 1, torch.ones_like(lam), lam)
            lam = torch.where((variant == 2) | (variant == 4), torch.zeros_like(lam), lam)
        scores = torch.addcmul(q_int, lam[:, None], q_other, value=-1.0).clamp_(min=0.0)
        total = scores.sum(dim=-1, keepdim=True)
        fallback = q_int.clamp(min=0.0)
        fallback /= fallback.sum(dim=-1, keepdim=True)
        watermarked = torch.where(total > 0, scores / total.clamp(min=1e-300), fallback)
        return torch.where(live[:, None], watermarked, probs)

    def _step_cpu(
        self,
        kernels: _Kernels,
        slots: list[int],
        width: int,
        words: int,
        any_alt: bool,
        cand: torch.Tensor,
        probs: torch.Tensor,
    ) -> torch.Tensor:
        """The same step on the CPU: numpy views of the slot tensors, the PRF's own array
        functions, and two compiled loops (:mod:`worldcup_core._step_jit`) where the tensor
        path would dispatch ~300 small kernels."""
        context_kernel, step_kernel = kernels
        batch, n = cand.shape
        idx = np.asarray(slots, dtype=np.int64)
        ctx = np.empty((batch, width), dtype=np.int64)
        live = np.empty(batch, dtype=np.bool_)
        context_kernel(self._history.numpy(), self._length.numpy(), idx, width, ctx, live)

        keys = self._keys.numpy().view(np.uint64)[idx]  # (B, 3, 2)
        # (5, B): k, m, c, symbols, variant; each kernel argument C-contiguous, so numba
        # compiles one specialisation for every batch size
        cfg = np.ascontiguousarray(self._config.numpy()[idx].T)
        context = [col.view(np.uint64) for col in ctx.T.copy()]  # c lanes of (B,)
        position = v2_positions((keys[:, 0, 0], keys[:, 0, 1]), context)
        symbol = symbol_index(position, cfg[3].astype(np.uint64), SCHEME_V2)
        sym_bits = self._bits.numpy()[idx, symbol].astype(np.int64)  # (B, 8)

        repeated = [np.repeat(col, n) for col in context]
        tokens = cand.contiguous().numpy().reshape(-1).view(np.uint64)

        def planes(key: int) -> npt.NDArray[np.int64]:
            lanes = (np.repeat(keys[:, key, 0], n), np.repeat(keys[:, key, 1], n))
            out = v2_gwords(lanes, repeated, tokens, words)
            return np.stack(out).view(np.int64).reshape(words, batch, n)

        gwords = planes(1)
        alt = planes(2) if any_alt else np.zeros((0, batch, n), dtype=np.int64)
        p64 = probs.to(torch.float64).contiguous()
        out = torch.empty_like(p64)
        alpha = self._alpha.numpy()[idx].astype(np.float64)
        step_kernel(
            gwords, alt, sym_bits, cfg[0], cfg[1], cfg[4], alpha, p64.numpy(), live, out.numpy()
        )
        return out.to(self.dtype)

    def _hash(
        self,
        keys: torch.Tensor,
        ctx_cols: list[torch.Tensor],
        ctx_rep: list[torch.Tensor],
        tokens: torch.Tensor,
        n: int,
        words: int,
        alt: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Positions (B,), g-words and alt-words (lists of (B*n,)) in as few passes as possible."""
        batch = keys.shape[0]
        gkey = (keys[:, 1, 0].repeat_interleave(n), keys[:, 1, 1].repeat_interleave(n))
        pkey = (keys[:, 0, 0], keys[:, 0, 1])
        jobs: list[tuple[tuple[torch.Tensor, torch.Tensor], list[torch.Tensor], int | None]] = [
            (pkey, ctx_cols, None)
        ]
        jobs += [(gkey, [*ctx_rep, tokens], i) for i in range(words)]
        if alt:
            akey = (keys[:, 2, 0].repeat_interleave(n), keys[:, 2, 1].repeat_interleave(n))
            jobs += [(akey, [*ctx_rep, tokens], i) for i in range(words)]
        packed = [message_blocks(msg, tag) for _, msg, tag in jobs]
        if len({len(b) for b, _ in packed}) == 1:  # same block count: one SipHash pass
            k0 = torch.cat([k[0] for k, _, _ in jobs])
            k1 = torch.cat([k[1] for k, _, _ in jobs])
            blocks = [torch.cat([b[i] for b, _ in packed]) for i in range(len(packed[0][0]))]
            out = siphash13(k0, k1, blocks, torch.cat([f for _, f in packed]))
            parts = list(out.split([batch] + [batch * n] * (len(jobs) - 1)))
        else:
            parts = [
                siphash13(k[0], k[1], b, f) for (k, _, _), (b, f) in zip(jobs, packed, strict=True)
            ]
        return parts[0], parts[1 : 1 + words], parts[1 + words :]

    def _group_words(
        self, words: list[torch.Tensor], m_row: torch.Tensor, big_k: int, batch: int, n: int
    ) -> torch.Tensor:
        """Each group's m g-bits shifted down to bit 0: (B, K, n) int64, per-row layout."""
        dev = self.device
        stacked = torch.stack(words, dim=-1).reshape(batch, n, len(words))  # (B, n, W)
        j = torch.arange(big_k, device=dev)[None, :]
        per_word = 64 // m_row[:, None]  # (B, 1)
        word_of = (j // per_word).clamp(max=len(words) - 1)  # (B, K)
        group_words = stacked.gather(2, word_of[:, None, :].expand(batch, n, big_k))  # (B, n, K)
        base = ((j % per_word) * m_row[:, None])[:, None, :]  # the group's first bit
        return (group_words >> base).permute(0, 2, 1)  # arithmetic shift: callers mask
