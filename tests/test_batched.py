"""The batched ``worldcup-v2`` step equals the per-row reference, on random batches.

The reference (:class:`worldcup_core.encoder.WorldCupSequenceV2`) reweights one
row at a time in numpy; the batched step does every row at once in torch. They
must agree to 1e-12 in float64 whatever the batch mixes: keys, payloads, k, m,
context widths, alpha, the four variants, sparse slots, padded candidates and
repeated contexts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

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
from worldcup_core.batched import BatchedWorldCup
from worldcup_core.generation import ContinuousBatch, GenerationRequest, generate
from worldcup_core.hf import WorldCupLogitsProcessor
from worldcup_core.models import LoadedModel, load_tokenizer, tiny_random_model

V2 = "worldcup-v2"


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


@pytest.fixture(params=["compiled", "tensor"])
def step_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The equality tests run on both CPU paths: numba's compiled loop and the tensor ops
    (which every other device runs)."""
    monkeypatch.setattr(batched, "JIT_ENABLED", request.param == "compiled")
    assert batched.compiled_step_active() == (request.param == "compiled")
    return str(request.param)


def test_the_compiled_step_is_active() -> None:
    """numba is a dependency: CPU steps must not silently fall back to the tensor path."""
    assert batched.compiled_step_active()


def test_warm_up_compiles_every_kernel_once() -> None:
    """Engines warm up at load; afterwards no batch size compiles a kernel again."""
    from worldcup_core import _siphash_jit, _step_jit

    batched.warm_up()
    kernels = (_step_jit.step_kernel, _step_jit.context_kernel, _siphash_jit._kernel)
    compiled = [len(k.signatures) for k in kernels]
    assert compiled[:2] == [1, 1]  # (the SipHash loop also serves other callers)
    rng = np.random.default_rng(0)
    for rows in (1, 3, 8):  # one row's arrays are C-contiguous whatever their strides
        batch = BatchedWorldCup(capacity=rows)
        for slot in range(rows):
            batch.set_row(slot, random_scheme(rng), Payload.random(16, rng))
        for _ in range(4):
            cand, probs = random_step(rng, rows, 7, 100)
            batch.step(list(range(rows)), torch.from_numpy(cand), torch.from_numpy(probs))
            batch.append(list(range(rows)), torch.from_numpy(cand[:, 0]))
    assert [len(k.signatures) for k in kernels] == compiled


@pytest.mark.parametrize("seed", range(12))
def test_batched_step_equals_the_per_row_reference(seed: int, step_path: str) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 10))
    n = int(rng.integers(1, 40))
    vocab = 24  # a small vocabulary: contexts repeat within a few steps
    batch = BatchedWorldCup(capacity=2, history=8)  # both grow on the way
    slots = [int(s) for s in rng.choice(64, rows, replace=False)]
    refs = []
    for slot in slots:
        scheme = random_scheme(rng)
        payload = Payload.random(int(rng.integers(1, 65)), rng)
        batch.set_row(slot, scheme, payload)
        refs.append(scheme.sequence(payload))
    worst, watermarked = 0.0, 0
    for _ in range(int(rng.integers(5, 20))):
        cand, probs = random_step(rng, rows, n, max(vocab, n))
        q = batch.step(slots, torch.from_numpy(cand), torch.from_numpy(probs)).numpy()
        for i, ref in enumerate(refs):
            expected = ref.reweight(cand[i], probs[i])
            worst = max(worst, float(np.abs(expected - q[i]).max()))
            watermarked += not np.array_equal(expected, probs[i])
            assert q[i].min() >= 0.0 and abs(q[i].sum() - 1.0) < 1e-12
        tokens = np.array([cand[i][rng.choice(n, p=probs[i])] for i in range(rows)])
        for i, ref in enumerate(refs):
            ref.observe(int(tokens[i]))
        batch.append(slots, torch.from_numpy(tokens))
    assert worst < 1e-12
    assert watermarked > 0  # the comparison covered watermarked steps, not only pass-throughs


def test_moves_swaps_and_clears_keep_rows_intact() -> None:
    """vLLM's persistent batch moves and swaps rows; each row keeps its own state."""
    rng = np.random.default_rng(7)
    schemes = [random_scheme(rng, context_width=2) for _ in range(3)]
    payloads = [Payload.random(16, rng) for _ in range(3)]
    batch = BatchedWorldCup()
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
    batch.move_row(1, 5)
    placement = [2, 5, 0]
    step_and_check()
    cand, probs = random_step(rng, 1, 12, 40)
    unchanged = batch.step([1], torch.from_numpy(cand), torch.from_numpy(probs))
    assert torch.equal(unchanged, torch.from_numpy(probs))  # the moved-from slot is empty
    batch.clear_row(5)
    assert torch.equal(batch.step([5], torch.from_numpy(cand), torch.from_numpy(probs)), unchanged)


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
