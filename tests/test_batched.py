"""The batched ``worldcup-v2`` step equals the per-row reference, on random batches.

The reference (:class:`worldcup_core.encoder.WorldCupSequenceV2`) reweights one
row at a time in numpy; the batched step does every row at once, on one of three
paths (:class:`worldcup_core.batched.StepPath`): numba's compiled loop (the CPU),
the torch tensor ops (any device) and the fused Triton kernel (CUDA; here on the
CPU through Triton's interpreter, ``TRITON_INTERPRET=1``). Each must agree with
the reference to 1e-12 in float64 whatever the batch mixes: keys, payloads, k, m,
context widths, alpha, every variant, sparse and missing slots, padded candidates
and repeated contexts. The interpreter runs the kernel op by op, so the cases are
sized for it: one batch of 512 rows with small m and n, and small batches with
any m.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from steplib import fewer_patches, use_interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from worldcup_core import (
    Payload,
    SamplingConfig,
    Variant,
    WatermarkConfig,
    WatermarkKey,
    WorldCup,
    batched,
)
from worldcup_core.baselines import MPAC
from worldcup_core.batched import BatchedWorldCup, StepPath
from worldcup_core.generation import ContinuousBatch, GenerationRequest, generate
from worldcup_core.hf import WorldCupLogitsProcessor
from worldcup_core.models import LoadedModel, load_tokenizer, tiny_random_model
from worldcup_core.step_layout import VariantCode

use_interpreter()  # before worldcup_core._step_triton is first imported

V2 = "worldcup-v2"
PATHS = [StepPath.COMPILED, StepPath.TENSOR, StepPath.FUSED]


def random_scheme(rng: np.random.Generator, **fixed: Any) -> WorldCup:
    config = {
        "groups": int(rng.integers(1, 9)),
        "layers": int(rng.integers(1, 65)),
        "context_width": int(rng.integers(1, 4)),
        "variant": list(Variant)[int(rng.integers(0, len(Variant)))],
        "alpha": float(rng.uniform(0.0, 3.0)),
        "version": V2,
    }
    config.update(fixed)
    return WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig(**config))


def random_step(
    rng: np.random.Generator, rows: int, n: int, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    cand = np.stack([rng.choice(vocab, n, replace=False) for _ in range(rows)]).astype(np.int64)
    probs = rng.dirichlet(np.full(n, 0.5), size=rows)
    probs[:, n // 2 :][rng.random((rows, n - n // 2)) < 0.3] = 0.0  # filtered-out padding
    return cand, probs / probs.sum(axis=1, keepdims=True)


@pytest.fixture
def step_path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StepPath]:
    """Every step of the test takes this path (the fused kernel through the interpreter
    where there is no GPU)."""
    path = StepPath(request.param)
    monkeypatch.setattr(batched, "FORCE_PATH", path)
    if path is StepPath.FUSED:
        with fewer_patches():
            yield path
    else:
        yield path


def test_each_device_takes_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba and Triton are dependencies here: no path may silently fall back."""
    assert batched.compiled_step_active()
    assert batched.step_path("cpu") is StepPath.COMPILED
    assert batched.step_path("cuda") is StepPath.FUSED  # chosen by device type, no GPU needed
    assert batched.step_path("meta") is StepPath.TENSOR
    monkeypatch.setattr(batched, "JIT_ENABLED", False)
    assert batched.step_path("cpu") is StepPath.TENSOR
    from worldcup_core import _step_triton

    interpreted = type(_step_triton._step_kernel).__name__ == "InterpretedFunction"
    assert interpreted == (not torch.cuda.is_available())


def test_variant_codes_cover_every_variant() -> None:
    """The three paths branch on VariantCode, never on bare integers (and numba reads
    the same values as plain module constants)."""
    from worldcup_core import _step_jit

    codes = {VariantCode.of(v) for v in Variant}
    assert len(codes) == len(Variant) == len(VariantCode)
    assert _step_jit._RANDOM_SECOND == VariantCode.of(Variant.RANDOM_SECOND)
    assert _step_jit._NONDISTORTIONARY == VariantCode.of(Variant.NONDISTORTIONARY)


def test_warm_up_compiles_the_cpu_loop_once() -> None:
    """Engines warm up at load; afterwards no batch size compiles the loop again."""
    from worldcup_core import _step_jit

    batched.warm_up()
    assert len(_step_jit.step_kernel.signatures) == 1
    rng = np.random.default_rng(0)
    for rows in (1, 3, 8):  # one row's arrays are C-contiguous whatever their strides
        batch = BatchedWorldCup(capacity=rows)
        for slot in range(rows):
            batch.set_row(slot, random_scheme(rng), Payload.random(16, rng))
        for _ in range(4):
            cand, probs = random_step(rng, rows, 7, 100)
            batch.step(list(range(rows)), torch.from_numpy(cand), torch.from_numpy(probs))
            batch.append(list(range(rows)), torch.from_numpy(cand[:, 0]))
    assert len(_step_jit.step_kernel.signatures) == 1


# --------------------------------------------------------------------------- equality
class Rows:
    """A batch under test and its per-row references, stepped side by side."""

    def __init__(self, rng: np.random.Generator, capacity: int = 2, history: int = 8) -> None:
        self.rng = rng
        self.batch = BatchedWorldCup(capacity=capacity, history=history)  # both grow
        self.refs: dict[int, Any] = {}
        self.worst = 0.0
        self.watermarked = 0
        self.steps = 0

    def add(self, slot: int, scheme: WorldCup, payload: Payload) -> None:
        self.batch.set_row(slot, scheme, payload)
        self.refs[slot] = scheme.sequence(payload)

    def step(self, slots: list[int], cand: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """One step of the batch (``slots`` may name empty slots: they pass ``probs``)."""
        q = self.batch.step(slots, torch.from_numpy(cand), torch.from_numpy(probs))
        out = q.numpy()
        for i, slot in enumerate(slots):
            ref = self.refs.get(slot)
            expected = probs[i] if ref is None else ref.reweight(cand[i], probs[i])
            self.worst = max(self.worst, float(np.abs(expected - out[i]).max(initial=0.0)))
            self.watermarked += not np.array_equal(expected, probs[i])
            assert out[i].min(initial=0.0) >= 0.0 and abs(out[i].sum() - 1.0) < 1e-12
        self.steps += 1
        return out

    def append(self, slots: list[int], tokens: np.ndarray) -> None:
        """Record the sampled tokens of the rows (as callers do: not of empty slots)."""
        rows = [i for i, slot in enumerate(slots) if slot in self.refs]
        for i in rows:
            self.refs[slots[i]].observe(int(tokens[i]))
        self.batch.append([slots[i] for i in rows], torch.from_numpy(tokens[rows]))


def mixed_small_batch(seed: int) -> Rows:
    """A few rows of any k, m, c, alpha and variant, scattered slots, a small vocabulary
    (contexts repeat within a few steps), for 5-13 steps."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 10))
    n = int(rng.integers(1, 40))
    test = Rows(rng)
    slots = [int(s) for s in rng.choice(64, rows, replace=False)]
    for slot in slots:
        test.add(slot, random_scheme(rng), Payload.random(int(rng.integers(1, 65)), rng))
    if seed % 2:  # a slot that never had a row, one cleared, one past the tables, one < 0
        test.add(70, random_scheme(rng), Payload.random(8, rng))
        test.batch.clear_row(70)
        del test.refs[70]
        slots += [65, 70, 10_000, -1]
        rows += 4
    for _ in range(int(rng.integers(5, 14))):
        cand, probs = random_step(rng, rows, n, max(24, n))
        test.step(slots, cand, probs)
        test.append(slots, np.array([cand[i][rng.choice(n, p=probs[i])] for i in range(rows)]))
    return test


def batch_of_512() -> Rows:
    """512 rows, every variant, k 1-8, c 1-8, and m 1-3 (the interpreter plays every layer
    op by op): some in their first c steps, some at a repeated context (a 3-token
    vocabulary), a few slots empty, cleared or past the tables; one step after a history."""
    rng = np.random.default_rng(512)
    test = Rows(rng, capacity=16)
    slots = [int(s) for s in rng.permutation(600)[:512]]
    for slot in slots[:496]:
        config = {"layers": int(rng.integers(1, 4)), "context_width": int(rng.integers(1, 9))}
        test.add(slot, random_scheme(rng, **config), Payload.random(int(rng.integers(1, 65)), rng))
    for slot in slots[496:504]:
        test.add(slot, random_scheme(rng), Payload.random(8, rng))
        test.batch.clear_row(slot)
        del test.refs[slot]
    slots[504:] = [-1, 700, 10_000, *slots[504:509]]
    for _ in range(int(rng.integers(2, 6))):  # histories of 2-5 tokens
        test.append(slots, rng.integers(0, 3, 512))
    cand, probs = random_step(rng, 512, 5, 40)
    test.step(slots, cand, probs)
    return test


CASES: dict[str, Callable[[], Rows]] = {
    f"mixed-{seed}": (lambda s=seed: mixed_small_batch(s)) for seed in range(8)
}
CASES["batch-512"] = batch_of_512


@pytest.mark.parametrize("step_path", PATHS, indirect=True)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_path_equals_the_per_row_reference(case: str, step_path: StepPath) -> None:
    test = CASES[case]()
    assert test.worst < 1e-12
    assert test.watermarked > test.steps  # watermarked steps were compared, not only pass-throughs


@pytest.mark.parametrize("step_path", [StepPath.TENSOR, StepPath.FUSED], indirect=True)
def test_float32_steps_stay_within_the_documented_tolerance(step_path: StepPath) -> None:
    rng = np.random.default_rng(32)
    rows, n = 6, 24
    batch = BatchedWorldCup(dtype=torch.float32)
    refs = []
    for slot in range(rows):
        scheme = random_scheme(rng, layers=int(rng.integers(20, batched.FLOAT32_MAX_LAYERS + 1)))
        payload = Payload.random(32, rng)
        batch.set_row(slot, scheme, payload)
        refs.append(scheme.sequence(payload))
    slots, worst = list(range(rows)), 0.0
    for _ in range(4):
        cand, probs = random_step(rng, rows, n, 1000)
        q = batch.step(slots, torch.from_numpy(cand), torch.from_numpy(probs).float())
        assert q.dtype == torch.float32
        for i, ref in enumerate(refs):
            worst = max(worst, float(np.abs(ref.reweight(cand[i], probs[i]) - q[i].numpy()).max()))
            ref.observe(int(cand[i, 0]))
        batch.append(slots, torch.from_numpy(cand[:, 0]))
    assert 1e-12 < worst < batched.FLOAT32_TOLERANCE


@pytest.mark.parametrize("step_path", PATHS, indirect=True)
def test_moves_swaps_and_clears_keep_rows_intact(step_path: StepPath) -> None:
    """vLLM's persistent batch moves and swaps rows, to any index: the tables grow to
    hold it (#23), and each row keeps its own state."""
    rng = np.random.default_rng(7)
    schemes = [random_scheme(rng, context_width=2, layers=8) for _ in range(3)]
    payloads = [Payload.random(16, rng) for _ in range(3)]
    batch = BatchedWorldCup(capacity=4)
    refs = []
    for slot, (scheme, payload) in enumerate(zip(schemes, payloads, strict=True)):
        batch.set_row(slot, scheme, payload)
        refs.append(scheme.sequence(payload))
    placement = [0, 1, 2]  # placement[i] = slot of reference row i

    def step_and_check() -> None:
        cand, probs = random_step(rng, 3, 12, 40)
        q = batch.step(placement, torch.from_numpy(cand), torch.from_numpy(probs)).numpy()
        tokens = np.array([cand[i][0] for i in range(3)])
        for i, ref in enumerate(refs):
            assert np.abs(ref.reweight(cand[i], probs[i]) - q[i]).max() < 1e-12
            ref.observe(int(tokens[i]))
        batch.append(placement, torch.from_numpy(tokens))

    for _ in range(3):
        step_and_check()
    batch.swap_rows(0, 2)
    placement = [2, 1, 0]
    step_and_check()
    batch.swap_rows(2, 900)  # far past the capacity: the tables grow
    assert batch.capacity > 900
    placement = [900, 1, 0]
    step_and_check()
    batch.move_row(1, 5000)
    placement = [900, 5000, 0]
    step_and_check()
    cand, probs = random_step(rng, 1, 12, 40)
    unchanged = batch.step([1], torch.from_numpy(cand), torch.from_numpy(probs))
    assert torch.equal(unchanged, torch.from_numpy(probs))  # the moved-from slot is empty
    batch.move_row(7000, 5000)  # a slot past the tables holds no row: 5000 is emptied
    assert torch.equal(
        batch.step([5000], torch.from_numpy(cand), torch.from_numpy(probs)), unchanged
    )
    batch.clear_row(900)
    assert torch.equal(
        batch.step([900], torch.from_numpy(cand), torch.from_numpy(probs)), unchanged
    )


def test_reserved_tables_do_not_move() -> None:
    """A CUDA graph keeps the tables' addresses: after reserve(), rows up to the
    reservation reallocate nothing, and a growth is visible in layout_version."""
    rng = np.random.default_rng(3)
    batch = BatchedWorldCup(capacity=2, history=8)
    batch.reserve(64, history=128)
    version = batch.layout_version
    for slot in range(64):
        batch.set_row(slot, random_scheme(rng), Payload.random(8, rng))
    for _ in range(100):
        batch.append(range(64), torch.from_numpy(rng.integers(0, 1000, 64)))
    assert batch.layout_version == version
    batch.append(range(64), torch.zeros(64, dtype=torch.int64))  # past the reservation
    batch.set_row(64, random_scheme(rng), Payload.random(8, rng))
    assert batch.layout_version > version


# --------------------------------------------------------------------------- the glue
class OpCounter(TorchDispatchMode):
    """The aten ops a step dispatches (what its Python issues), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


# ops that wait for the device (a host read of device memory) or allocate by data
SYNCING = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2"}


@pytest.mark.parametrize("path", PATHS)
def test_the_step_issues_the_same_work_at_any_batch(
    path: StepPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-step Python does not grow with the batch: the same ops at batch 1, 8 and 64
    (the compiled and fused kernels replaced by stubs that count their launches), none of
    them a host synchronisation."""
    monkeypatch.setattr(batched, "FORCE_PATH", path)
    launches: list[int] = []

    def stub(*args: Any) -> None:
        launches.append(len(args))

    if path is StepPath.COMPILED:
        monkeypatch.setattr(batched, "_compiled_kernel", lambda: stub)
    if path is StepPath.FUSED:
        monkeypatch.setattr(batched, "_fused_kernel", lambda: stub)
    rng = np.random.default_rng(1)
    counts = []
    for rows in (1, 8, 64):
        batch = BatchedWorldCup(capacity=rows)
        config = WatermarkConfig(groups=2, layers=6, variant=Variant.RANDOM_SECOND)
        for slot in range(rows):
            batch.set_row(slot, WorldCup(WatermarkKey(rng.bytes(32)), config), Payload("0110"))
        slots = torch.arange(rows)
        for _ in range(3):
            batch.append(slots, torch.from_numpy(rng.integers(0, 100, rows)))
        cand, probs = (torch.from_numpy(a) for a in random_step(rng, rows, 10, 100))
        with OpCounter() as counter:
            batch.step(slots, cand, probs)
        counts.append(counter.ops)
        assert not SYNCING & set(counter.ops), counter.ops
    assert counts[0] == counts[1] == counts[2]
    if path is not StepPath.TENSOR:
        assert len(launches) == 3  # one kernel call a step


def test_the_fused_step_is_one_launch_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fused path's caller can hand over as the kernel reads it (int64 device
    slots, contiguous candidates, probs in the step's dtype, a preallocated ``out``)
    costs one launch and not a single other dispatched op; ``out`` of the wrong shape
    is refused, and the other paths write into ``out`` too."""
    monkeypatch.setattr(batched, "FORCE_PATH", StepPath.FUSED)
    launches: list[tuple[Any, ...]] = []
    monkeypatch.setattr(batched, "_fused_kernel", lambda: lambda *a: launches.append(a))
    rng = np.random.default_rng(4)
    batch = BatchedWorldCup(capacity=4)
    for slot in range(4):
        batch.set_row(slot, random_scheme(rng), Payload("0110"))
    slots = torch.arange(4)
    cand, probs = (torch.from_numpy(a) for a in random_step(rng, 4, 10, 100))
    out = torch.empty_like(probs)
    with OpCounter() as counter:
        got = batch.step(slots, cand, probs, out)
    assert counter.ops == [] and len(launches) == 1 and got is out
    assert launches[0][3] is out
    with pytest.raises(ValueError, match="contiguous"):
        batch.step(slots, cand, probs, torch.empty(4, 9, dtype=probs.dtype))
    monkeypatch.setattr(batched, "FORCE_PATH", StepPath.TENSOR)
    written = torch.empty_like(probs)
    assert batch.step(slots, cand, probs, written) is written
    assert torch.equal(written, batch.step(slots, cand, probs))


def test_the_fused_kernel_compiles_for_cuda() -> None:
    """Without a GPU, the kernel still goes through Triton's CUDA compiler (and its ptxas)
    for the A100 (sm_80) and the H100 (sm_90), in both dtypes and for wide rows: a GPU
    run cannot fail on lowering."""
    script = (
        "import torch\n"
        "from worldcup_core._step_triton import compile_for_cuda\n"
        "f64, f32 = torch.float64, torch.float32\n"
        "for cc, dtype, n in ((90, f64, 50), (90, f32, 50), (80, f64, 1000)):\n"
        "    assert len(compile_for_cuda(cc, dtype, n)) > 10_000\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_batched_step_refuses_other_schemes() -> None:
    batch = BatchedWorldCup()
    with pytest.raises(ValueError, match="worldcup-v2"):
        v1 = WorldCup(WatermarkKey(bytes(32)), WatermarkConfig(version="worldcup-v1"))
        batch.set_row(0, v1, Payload("1"))
    assert not BatchedWorldCup.supports(MPAC(WatermarkKey(bytes(32))))
    assert BatchedWorldCup.supports(WorldCup(WatermarkKey(bytes(32)), WatermarkConfig(version=V2)))


# --------------------------------------------------------------------------- the loops
@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_random_model(load_tokenizer())


def requests_mixing_schemes(tiny: LoadedModel) -> list[GenerationRequest]:
    prompt = tiny.tokenizer("The storm hit the coast", add_special_tokens=False).input_ids
    key = WatermarkKey(bytes(range(32)))
    v2 = WorldCup(key, WatermarkConfig(version=V2))
    v1 = WorldCup(key, WatermarkConfig(version="worldcup-v1"))
    sampling = [SamplingConfig(max_new_tokens=24, min_new_tokens=24, seed=s) for s in range(5)]
    return [
        GenerationRequest(prompt, sampling[0], v2, Payload("1011001110001111")),
        GenerationRequest(prompt, sampling[1], v1, Payload("0110")),
        GenerationRequest(prompt, sampling[2]),
        GenerationRequest(prompt, sampling[3], MPAC(key), Payload("0110")),
        GenerationRequest(prompt, sampling[4], v2, Payload("11110000")),
    ]


def test_rows_generate_the_same_alone_or_in_a_mixed_batch(tiny: LoadedModel) -> None:
    """A v2 row shares the batched step with other v2 rows and sits beside per-row
    schemes; each row's text depends only on its own request and seed."""
    reqs = requests_mixing_schemes(tiny)
    together = generate(tiny.model, reqs, tiny.eos_token_ids, tiny.pad_token_id)
    alone = [generate(tiny.model, [r], tiny.eos_token_ids, tiny.pad_token_id)[0] for r in reqs]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
    v2 = reqs[0].scheme
    assert isinstance(v2, WorldCup)
    assert v2.detect(together[0].token_ids).p_value < 1e-3


def test_v2_rows_free_their_slots_when_they_leave(tiny: LoadedModel) -> None:
    reqs = requests_mixing_schemes(tiny)
    batch = ContinuousBatch(tiny.model, tiny.eos_token_ids, tiny.pad_token_id)
    first = batch.add(reqs)
    for _ in range(3):
        batch.step()
    batch.cancel(first[:1])  # a v2 row leaves early; its slot is reused
    batch.add([reqs[4]])
    while len(batch):
        batch.step()
    # two v2 rows at first; the one added after the cancel reused the freed slot
    assert batch._next_slot == 2  # noqa: SLF001
    assert sorted(batch._free_slots) == [0, 1]  # noqa: SLF001 (and every row is gone)


def test_tables_grown_inside_inference_mode_stay_writable_outside_it() -> None:
    """Engines step under torch.inference_mode(); a table that grows there (the history
    past its horizon, a slot past the capacity) must still take a cancel's clear_row, a
    new row and appends outside it. (An inference tensor there killed the HF engine's
    thread on the first cancelled request of more than 256 tokens.)"""
    scheme = WorldCup(WatermarkKey(bytes(range(32))), WatermarkConfig(version=V2))
    batch = BatchedWorldCup(capacity=1, history=8)
    batch.set_row(0, scheme, Payload("1011"))
    with torch.inference_mode():
        for t in range(20):  # history 8 -> 16 -> 32, inside inference mode
            batch.append([0], torch.tensor([t]))
        batch.set_row(3, scheme, Payload("0110"))  # capacity 1 -> 4
    assert batch.capacity >= 4 and batch._history.shape[1] >= 20  # noqa: SLF001
    assert not any(t.is_inference() for t in batch._tables())  # noqa: SLF001
    batch.clear_row(0)  # outside inference mode, as ContinuousBatch.cancel runs
    batch.set_row(1, scheme, Payload("1111"))
    batch.append([1, 3], torch.tensor([7, 9]))
    cand = torch.tensor([[3, 4, 5]] * 2)
    q = batch.step([1, 3], cand, torch.full((2, 3), 1 / 3, dtype=torch.float64))
    assert torch.allclose(q.sum(dim=1), torch.ones(2, dtype=torch.float64))


def test_hf_processor_uses_the_batched_step(tiny: LoadedModel) -> None:
    key = WatermarkKey(bytes(range(32)))
    scheme = WorldCup(key, WatermarkConfig(version=V2))
    payloads = [Payload("1011001110001111"), Payload("0000111100001111")]
    prompt = tiny.tokenizer(["Tides rise", "Tides rise"], return_tensors="pt")
    proc = WorldCupLogitsProcessor(scheme, payloads, temperature=1.0, top_k=50, top_p=0.95)
    torch.manual_seed(0)
    out = tiny.model.generate(
        **prompt,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=48,
        min_new_tokens=48,
        logits_processor=[proc],
        pad_token_id=tiny.pad_token_id,
    )
    assert proc._batched is not None  # noqa: SLF001
    for row in out[:, prompt.input_ids.shape[1] :].tolist():
        assert scheme.detect(row).p_value < 1e-3
