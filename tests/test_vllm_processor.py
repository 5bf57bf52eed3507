"""The vLLM logits processor gives, on fixed logits, the distribution the hf engine samples.

The reference is the hf engine itself: :meth:`ContinuousBatch._sample` with its
draw replaced by a spy that records the candidates and q it would sample from.
The processor is driven through vLLM's own ``BatchUpdate`` (adds, a removal, a
one-way move and a swap), rows mixing v2 keys, a v1 key, an unwatermarked
row and different temperature/top-k/top-p, bans and generated histories.

Also: its slot tables follow vLLM's ``max_num_seqs`` and grow on swaps and moves
far beyond them (the batched step's part of that runs in the base suite, without
vLLM); a token placeholder (async scheduling) never gets watermarked on a stale
context; bf16 and fp16 logits give what float32 gives. Tests that import vLLM
carry the ``vllm`` mark (``make test-vllm``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from app.engines.vllm_keys import EOS_ARGS_KEY, EXTRA_ARGS_KEY, Fault, RowSpec
from worldcup_core import Payload, SamplingConfig, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.generation import ContinuousBatch, GenerationRequest
from worldcup_core.sampling import filter_logits_torch
from worldcup_core.scheme import WatermarkScheme
from worldcup_core.step_layout import Column

VOCAB = 400
EOS = (7,)


class _Keys:
    def __init__(self, specs: dict[str, RowSpec]) -> None:
        self.specs = specs

    def fetch(self, handle: str) -> RowSpec | None:
        return self.specs.get(handle)


class _Params:
    def __init__(self, handle: str | None) -> None:
        self.extra_args = None if handle is None else {EXTRA_ARGS_KEY: handle, EOS_ARGS_KEY: [7]}


def _scheme(seed: int, version: str = "worldcup-v2") -> WatermarkScheme:
    rng = np.random.default_rng(seed)
    return WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig(version=version))


def _requests() -> list[GenerationRequest]:
    rng = np.random.default_rng(3)
    rows = []
    configs = [
        (SamplingConfig(temperature=1.0, top_k=50, top_p=0.95), _scheme(1)),
        (SamplingConfig(temperature=0.7, top_k=0, top_p=0.9, no_repeat_ngram_size=2), _scheme(2)),
        (SamplingConfig(temperature=1.3, top_k=20, top_p=1.0, min_new_tokens=50), _scheme(3)),
        (SamplingConfig(temperature=1.0, top_k=40, top_p=0.95), _scheme(4, "worldcup-v1")),
        (SamplingConfig(temperature=0.9, top_k=30, top_p=0.8), None),
    ]
    for i, (sampling, scheme) in enumerate(configs):
        payload = Payload.from_int(int(rng.integers(0, 2**16)), 16) if scheme else None
        prompt = [int(t) for t in rng.integers(10, VOCAB, size=5 + i)]
        rows.append(GenerationRequest(prompt, sampling, scheme, payload))
    return rows


def _hf_distributions(
    requests: list[GenerationRequest], histories: list[list[int]], logits: torch.Tensor
) -> list[torch.Tensor]:
    """Dense q per row, from the hf engine's own sampling step."""

    class _Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    batch = ContinuousBatch(_Model(), list(EOS), 0)
    batch._rows = [batch._start_row(r, time.perf_counter()) for r in requests]
    for row, history in zip(batch._rows, histories, strict=True):
        for tok in history:
            row.tokens.append(tok)
            row.blocker.push(tok)
            if row.watermark is not None:
                row.watermark.observe(tok)
            if row.slot is not None:
                batch._batched.append([row.slot], torch.tensor([tok]))
    seen: dict[str, Any] = {}

    def spy(cand: torch.Tensor, q: torch.Tensor, uniforms: Any) -> list[int]:
        seen["cand"], seen["q"] = cand, q
        return [0] * len(uniforms)

    import worldcup_core.generation as generation

    original = generation.sample_rows
    generation.sample_rows = spy
    try:
        batch._sample(logits)
    finally:
        generation.sample_rows = original
    out = []
    for i in range(len(requests)):
        dense = torch.zeros(VOCAB, dtype=torch.float64)
        dense[seen["cand"][i]] = seen["q"][i].double()
        out.append(dense)
    return out


@pytest.mark.vllm
def test_processor_distribution_equals_the_hf_engine() -> None:
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from app.engines.vllm_processor import WorldCupLogitsProcessor

    requests = _requests()
    specs = {f"h{i}": RowSpec(r.sampling, EOS, r.scheme, r.payload) for i, r in enumerate(requests)}
    proc = WorldCupLogitsProcessor(None, torch.device("cpu"), False)
    proc._keys = _Reports(specs)  # the socket is tested end to end in test_engines
    outputs: list[list[int]] = [[] for _ in requests]
    # vLLM's persistent batch: index -> request; start with 0..3, a placeholder at 4
    added = [(i, _Params(f"h{i}"), list(r.prompt_ids), outputs[i]) for i, r in enumerate(requests)]
    added[4] = (4, _Params(None), [1, 2], [])  # no handle: left untouched
    proc.update_state(BatchUpdate(5, [], added, []))
    # some history (vLLM appends each step's token to the live output lists), including
    # a repeat; each token is one the step before gave mass to (its logits favour it)
    rng = np.random.default_rng(11)
    history = [[int(rng.integers(10, 60)) if step % 5 else 42] * 4 for step in range(12)]
    for i in range(4):
        for step in range(12):
            history[step][i] = int(rng.integers(10, 60)) if step % 5 else 42
    proc.apply(_favour(history[0] + [0]))  # a first step with no history
    for step in range(12):
        for i in range(4):
            outputs[i].append(history[step][i])
        proc.apply(_favour(history[step + 1] + [0]) if step < 11 else torch.zeros(5, VOCAB))
    # the unwatermarked request leaves, request 4 (no watermark, filtering only) joins at 4,
    # then request 0 moves to 5 one way and 1 and 2 swap
    outputs[4] = [int(t) for t in rng.integers(10, 60, size=3)]
    update = BatchUpdate(
        6,
        [4],
        [(4, _Params("h4"), list(requests[4].prompt_ids), outputs[4])],
        [(0, 5, MoveDirectionality.UNIDIRECTIONAL), (1, 2, MoveDirectionality.SWAP)],
    )
    proc.update_state(update)
    index_of = {5: 0, 2: 1, 1: 2, 3: 3, 4: 4}  # batch index -> request
    logits = torch.from_numpy(np.random.default_rng(5).normal(0, 3, (6, VOCAB))).float()
    got = proc.apply(logits.clone())
    order = [index_of[b] for b in sorted(index_of)]
    hf = _hf_distributions(
        [requests[r] for r in order],
        [outputs[r] for r in order],
        logits[sorted(index_of)],
    )
    for k, b in enumerate(sorted(index_of)):
        q = torch.softmax(got[b].double(), dim=-1)  # what vLLM samples at temperature 1
        assert torch.allclose(q, hf[k], atol=1e-6), (b, (q - hf[k]).abs().max())
    assert torch.isneginf(got[1, EOS[0]])  # request 2 is below its min_new_tokens
    # not vacuous: the watermark did reshape the v2 rows (q is not the filtered p)
    for b in (5, 2, 1):
        s = requests[index_of[b]].sampling
        cand, p = filter_logits_torch(logits[b : b + 1], [s.temperature], [s.top_k], [s.top_p])
        plain = torch.zeros(VOCAB, dtype=torch.float64)
        plain[cand[0]] = p[0]
        q = torch.softmax(got[b].double(), dim=-1)
        if b != 1:  # row 1 also bans EOS, which changes p anyway
            assert (q - plain).abs().max() > 1e-3, b
    # the row vLLM vacated (0) is no longer processed: its logits pass through unchanged
    assert torch.equal(got[0], logits[0])
    assert proc._keys.reported == []  # every guard held


def _favour(tokens: list[int]) -> torch.Tensor:
    """Logits whose row i makes ``tokens[i]`` all but certain (so that a test's chosen
    next token is one the step gives mass to, as vLLM's draw always is)."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[range(len(tokens)), tokens] = 12.0
    return logits


# --------------------------------------------------------------------------- slot tables
def _v2_row(batch: Any, slot: int, seed: int, history: list[int]) -> None:
    batch.set_row(slot, _scheme(seed), Payload.from_int(0xBEEF, 16))
    for tok in history:
        batch.append([slot], torch.tensor([tok]))


def test_batched_swap_and_move_far_beyond_capacity() -> None:
    """vLLM swaps and moves rows that never set a v2 row (v1 keys, fail-closed rows) at any
    batch index: the tables grow, and the rows keep their keys and histories."""
    from worldcup_core.batched import BatchedWorldCup

    rng = np.random.default_rng(0)
    hist_a = [int(t) for t in rng.integers(10, VOCAB, 9)]
    hist_b = [int(t) for t in rng.integers(10, VOCAB, 9)]
    ref = BatchedWorldCup("cpu", capacity=4)
    _v2_row(ref, 0, 1, hist_a)
    _v2_row(ref, 1, 2, hist_b)
    moved = BatchedWorldCup("cpu", capacity=4)
    _v2_row(moved, 2, 1, hist_a)
    _v2_row(moved, 3, 2, hist_b)
    moved.swap_rows(200, 300)  # two indices that never held a row, far beyond capacity
    assert moved.capacity > 300
    moved.swap_rows(2, 250)  # a v2 row to a never-seen index
    moved.move_row(3, 1000)  # one way, beyond the grown tables
    moved.swap_rows(1000, 7)
    assert moved.capacity > 1000
    cand = torch.from_numpy(rng.permutation(VOCAB)[None, :50].repeat(2, 0))
    probs = torch.from_numpy(rng.dirichlet(np.ones(50), size=2))
    q_ref = ref.step([0, 1], cand, probs)
    q_moved = moved.step([250, 7], cand, probs)
    assert torch.equal(q_ref, q_moved)
    assert not torch.equal(q_ref[0], probs[0])  # the watermark did act


def test_engine_args_follow_the_runner() -> None:
    """V1 reads vLLM's output-token lists, where async scheduling leaves -1 placeholders
    (see app.engines.vllm): off, explicitly, on every device. MRv2 keeps the committed
    tokens on the device: async scheduling on where vLLM runs it (CUDA). Each runner
    registers its own processor class."""
    from app.core.config import Settings
    from app.engines.vllm import PROCESSORS, engine_args

    for device in ("cpu", "cuda"):
        settings = Settings(_env_file=None, env="dev", device=device, max_batch_size=200)  # type: ignore[call-arg]
        for runner in ("v1", "v2"):
            args = engine_args(settings, "/models/x", runner=runner)
            assert args["async_scheduling"] is (runner == "v2" and device == "cuda")
            assert args["max_num_seqs"] == 200
            assert args["logits_processors"] == [PROCESSORS[runner]]
        assert "logits_processors" not in engine_args(settings, "/m", watermark=False)


def test_engine_args_map_the_logprobs_mode_setting() -> None:
    """vLLM's logprobs mode is engine-wide: WORLDCUP_VLLM_LOGPROBS_MODE picks it
    (sampled: processed_logprobs, the watermarked q; model: raw_logprobs)."""
    from app.core.config import Settings
    from app.engines.vllm import engine_args

    for mode, vllm_mode in (("sampled", "processed_logprobs"), ("model", "raw_logprobs")):
        settings = Settings(_env_file=None, env="dev", vllm_logprobs_mode=mode)  # type: ignore[call-arg]
        assert engine_args(settings, "/models/x")["logprobs_mode"] == vllm_mode
    assert Settings(_env_file=None, env="dev").vllm_logprobs_mode == "sampled"  # type: ignore[call-arg]


class _Stoppable:
    def shutdown(self) -> None: ...

    def close(self) -> None: ...


@pytest.mark.anyio
async def test_detection_weights_are_bounded_windowed_and_stop() -> None:
    """VLLMEngine.token_weights without vLLM (its prompt log-probs faked): the weights
    are token_weights_from_top's on each text's rows, a 1-token text is NaN, a long
    text is read in windows; at most weights_texts requests run at once (detection
    keeps off half of vLLM's slots: max_batch_size // 2), and stop() fails the
    waiting callers with EngineStopped."""
    import asyncio

    from app.core.metrics import Metrics
    from app.engines.base import EngineStopped
    from app.engines.vllm import WEIGHT_LOGPROBS, VLLMEngine
    from worldcup_core.token_weights import token_weights_from_top

    engine = VLLMEngine(_Stoppable(), _Stoppable(), [0], Metrics(), 4, 8)  # type: ignore[arg-type]
    assert engine.weights_texts == 2 and engine.weigher is engine
    engine.weights_window = 30
    engine.start()
    running, most, seen = 0, 0, []
    hold = asyncio.Event()
    hold.set()

    def rows_of(ids: list[int]) -> list[list[tuple[int, float]] | None]:
        rng = np.random.default_rng(len(ids))
        return [
            [(int(t), float(-v)) for t, v in enumerate(rng.exponential(2.0, size=WEIGHT_LOGPROBS))]
            for _ in ids[1:]
        ]

    async def fake(ids: list[int]) -> list[list[tuple[int, float]] | None]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        seen.append(len(ids))
        await hold.wait()
        await asyncio.sleep(0.01)
        running -= 1
        return rows_of(ids)

    engine._prompt_top = fake  # type: ignore[method-assign]
    texts = [list(range(100, 112)), [5], list(range(200, 270)), list(range(300, 320))]
    got = await engine.token_weights(texts)
    assert most == 2 and sorted(seen) == [10, 12, 20, 30, 30]
    assert [len(w) for w in got] == [12, 1, 70, 20]
    assert np.isnan(got[1]).all()
    want = token_weights_from_top(rows_of(texts[0]), texts[0])
    np.testing.assert_array_equal(got[0], want)
    long = got[2]  # windows of 30, each from its own start: NaN at 0, 30, 60
    assert np.flatnonzero(np.isnan(long)).tolist() == [0, 30, 60]
    hold.clear()
    pending = asyncio.ensure_future(engine.token_weights(texts))
    await asyncio.sleep(0.05)
    assert running == 2
    engine.stop()
    with pytest.raises(EngineStopped):
        await pending
    with pytest.raises(EngineStopped):
        await engine.token_weights(texts)


@pytest.mark.anyio
async def test_detection_takes_its_time_share_while_generation_runs() -> None:
    """With generation in flight, detection's prompt-log-prob requests run one at a time
    and each waits until generation has had its share (d (1 - s) / s after a request of
    d seconds): 6 requests of >= 40 ms at s = 1/2 take >= 6 * 40 + 5 * 40 ms, where the
    same 6 with nothing generating run 2 at a time. A share of 0.8 waits a quarter."""
    import asyncio
    import time

    from app.core.metrics import Metrics
    from app.engines.vllm import WEIGHT_LOGPROBS, VLLMEngine

    engine = VLLMEngine(_Stoppable(), _Stoppable(), [0], Metrics(), 4, 8)  # type: ignore[arg-type]
    engine.start()
    running, most = 0, 0

    async def fake(ids: list[int]) -> list[list[tuple[int, float]] | None]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.04)
        running -= 1
        return [[(t, -float(t + 1)) for t in range(WEIGHT_LOGPROBS)] for _ in ids[1:]]

    engine._prompt_top = fake  # type: ignore[method-assign]
    texts = [list(range(100 + 20 * i, 110 + 20 * i)) for i in range(6)]

    async def timed() -> float:
        nonlocal most
        most = 0
        started = time.perf_counter()
        await engine.token_weights(texts)
        return time.perf_counter() - started

    alone = await timed()
    assert most == 2  # weights_texts: half of the 4 slots
    generation = asyncio.ensure_future(asyncio.sleep(60))  # a row in flight
    engine._tasks[object()] = generation  # type: ignore[index]
    try:
        beside = await timed()
        assert most == 1
        assert beside >= 0.44 - 1e-3, beside  # 6 x 40 ms run + 5 x 40 ms generation's turn
        assert beside > alone
        engine.weights_time_share = 0.8
        engine._weigh_due = 0.0
        quick = await timed()
        assert most == 1 and quick >= 0.24 + 5 * 0.01 - 1e-3, quick
    finally:
        generation.cancel()
        engine._tasks.clear()
    # generation over: full concurrency again, no wait
    await timed()
    assert most == 2
    engine.stop()


@pytest.mark.vllm
def test_every_grammar_kind_reaches_vllm_through_the_one_table() -> None:
    """The vllm engine reads a request's grammar from its constraint's ``spec`` and
    ``GRAMMARS`` (the table the hf engine compiles from): each kind sets its own field
    of ``StructuredOutputsParams``, JSON kinds as the same schema xgrammar compiles."""
    from types import SimpleNamespace

    from app.engines.grammar import ANY_OBJECT, GRAMMARS, GrammarSpec
    from app.engines.vllm import structured_outputs

    values = {
        "json_schema": ({"type": "object"}, "json", {"type": "object"}),
        "json_object": (None, "json", ANY_OBJECT),
        "regex": ("[ab]+", "regex", "[ab]+"),
        "choice": (["north", "south"], "choice", ["north", "south"]),
        "grammar": ('root ::= "x"', "grammar", 'root ::= "x"'),
        "structural_tag": (
            {"type": "structural_tag"},
            "structural_tag",
            '{"type": "structural_tag"}',
        ),
    }
    assert set(values) == set(GRAMMARS)
    for kind, (value, field, expected) in values.items():
        constraint = SimpleNamespace(spec=GrammarSpec(kind, value, "x"), banned=())  # type: ignore[arg-type]
        params = structured_outputs(GenerationRequest([1], constraint=constraint))  # type: ignore[arg-type]
        assert getattr(params, field) == expected, kind
    assert structured_outputs(GenerationRequest([1])) is None


class _Reports(_Keys):
    def __init__(self, specs: dict[str, RowSpec]) -> None:
        super().__init__(specs)
        self.reported: list[tuple[str, Fault]] = []

    def report_fault(self, handle: str, fault: Fault) -> None:
        self.reported.append((handle, fault))


def _processor(specs: dict[str, RowSpec], max_num_seqs: int = 8) -> Any:
    from types import SimpleNamespace

    from app.engines.vllm_processor import WorldCupLogitsProcessor

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))
    proc = WorldCupLogitsProcessor(config, torch.device("cpu"), False)
    proc._keys = _Reports(specs)
    return proc


def _spec(scheme: WatermarkScheme | None, seed: int = 0) -> RowSpec:
    payload = Payload.from_int(0x1234, 16) if scheme is not None else None
    return RowSpec(SamplingConfig(temperature=0.9, top_k=40, top_p=0.95), EOS, scheme, payload)


@pytest.mark.vllm
def test_processor_tables_follow_max_num_seqs_and_survive_far_swaps() -> None:
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    assert _processor({}, max_num_seqs=256)._batched.capacity == 256
    specs = {"v2": _spec(_scheme(1)), "v1": _spec(_scheme(2, "worldcup-v1")), "no": _spec(None)}
    far, near = _processor(specs, max_num_seqs=4), _processor(specs, max_num_seqs=4)
    outs: dict[str, list[int]] = {h: [] for h in specs}
    for proc, where in ((near, {"v2": 0, "v1": 1, "no": 2}), (far, {"v2": 1, "v1": 2, "no": 3})):
        added = [(i, _Params(h), [11, 12, 13], outs[h]) for h, i in where.items()]
        proc.update_state(BatchUpdate(4, [], added, []))
    # the far batch's rows go to indices far above its 4 slots: the v1 row (no slot of its
    # own) and an empty index first, as the IndexError did at 200
    far.update_state(
        BatchUpdate(
            701,
            [],
            [],
            [
                (2, 200, MoveDirectionality.SWAP),  # the v1 row, which set no v2 slot
                (1, 500, MoveDirectionality.SWAP),  # the v2 row
                (3, 700, MoveDirectionality.UNIDIRECTIONAL),  # the unwatermarked row
            ],
        )
    )
    assert far._batched.capacity > 500
    rng = np.random.default_rng(4)
    for _ in range(6):
        for h in specs:
            outs[h].append(int(rng.integers(20, 300)))
        near.apply(torch.zeros(3, VOCAB))
        far.apply(torch.zeros(701, VOCAB))
    logits = torch.from_numpy(rng.normal(0, 3, (3, VOCAB))).float()
    wide = torch.zeros(701, VOCAB)
    wide[[500, 200, 700]] = logits
    got_near = near.apply(logits.clone())
    got_far = far.apply(wide.clone())
    assert torch.equal(got_far[[500, 200, 700]], got_near)


@pytest.mark.vllm
def test_a_placeholder_is_never_watermarked_on_a_stale_context() -> None:
    """A -1 (async scheduling's placeholder) reaching the step: the row is sampled from
    its filtered distribution, unwatermarked from then on, and reported once; the other
    rows are untouched."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    specs = {"a": _spec(_scheme(1)), "b": _spec(_scheme(2)), "plain": _spec(None)}
    proc = _processor(specs)
    outs: dict[str, list[int]] = {h: [] for h in specs}
    added = [(i, _Params(h), [5, 6, 7], outs[h]) for i, h in enumerate(specs)]
    proc.update_state(BatchUpdate(3, [], added, []))
    rng = np.random.default_rng(8)

    def step(tok_a: int, tok_b: int) -> None:  # the plain row mirrors a's history, logits
        outs["a"].append(tok_a)
        outs["plain"].append(tok_a)
        outs["b"].append(tok_b)

    toks = [(int(rng.integers(20, 300)), int(rng.integers(20, 300))) for _ in range(7)]
    proc.apply(_favour([toks[0][0], toks[0][1], toks[0][0]]))
    for k in range(5):
        step(*toks[k])
        proc.apply(_favour([toks[k + 1][0], toks[k + 1][1], toks[k + 1][0]]))
    logits = torch.from_numpy(rng.normal(0, 3, (3, VOCAB))).float()
    logits[2] = logits[0]  # so the plain row's q is row a's q without the watermark
    step(*toks[5])
    before = proc.apply(logits.clone())
    assert not torch.allclose(before[0], before[2])  # a is watermarked
    outs["a"].append(-1)  # a's latest token is not known yet
    outs["b"].append(int(torch.argmax(before[1])))
    got = proc.apply(logits.clone())
    assert proc._keys.reported == [("a", Fault.PLACEHOLDER)]
    assert torch.equal(got[0], got[2])  # a: the filtered distribution, no watermark
    assert not torch.allclose(got[1], got[2])  # b keeps its watermark
    landed = int(torch.argmax(got[2]))  # the real token lands: a stays unwatermarked
    outs["a"][-1] = landed
    outs["plain"].append(landed)
    again = proc.apply(logits.clone())
    assert torch.equal(again[0], again[2])
    assert proc._keys.reported == [("a", Fault.PLACEHOLDER)]


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype: torch.dtype) -> None:
    """As a GPU may hand them over: bf16/fp16 logits give the float32 result on the same
    values, rounded once to the input dtype (the work itself is never done in half
    precision), with the same support and no NaN."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    specs = {
        "v2": _spec(_scheme(1)),
        "v1": _spec(_scheme(2, "worldcup-v1")),
        "plain": _spec(None),
    }
    runs = {}
    for name in ("half", "full"):
        proc = _processor(specs)
        outs: dict[str, list[int]] = {h: [11, 12, 40, 41, 42] for h in specs}
        added = [(i, _Params(h), [5, 6, 7], outs[h]) for i, h in enumerate(specs)]
        proc.update_state(BatchUpdate(3, [], added, []))
        runs[name] = proc
    logits = torch.from_numpy(np.random.default_rng(2).normal(0, 4, (3, VOCAB))).to(dtype)
    half = runs["half"].apply(logits.clone())
    full = runs["full"].apply(logits.float())
    assert half.dtype == dtype and full.dtype == torch.float32
    assert torch.equal(half, full.to(dtype))
    assert not torch.isnan(half).any()
    assert torch.equal(torch.isfinite(half), torch.isfinite(full))
    q_half = torch.softmax(half.float(), dim=-1)
    q_full = torch.softmax(full, dim=-1)
    assert (q_half - q_full).abs().max() < 0.02  # one rounding of log q to 8 (11) bits


@pytest.mark.vllm
def test_engine_fails_a_request_whose_row_lost_its_watermark() -> None:
    """The service side of the placeholder case: a row the processor reported (over the
    real key socket) fails its request and is counted; the text is never returned as
    watermarked. A request with no report finishes normally."""
    import asyncio
    from types import SimpleNamespace

    from app.core.metrics import Metrics
    from app.engines.vllm import UnwatermarkedError, VLLMEngine
    from app.engines.vllm_keys import KeyClient, KeyServer
    from worldcup_core.generation import GenerationResult

    keys = KeyServer()
    report = {"yes"}

    class _LLM:
        async def generate(self, prompt: Any, params: Any, handle: str) -> Any:
            assert params.extra_args[EXTRA_ARGS_KEY] == handle
            yield SimpleNamespace(  # as vLLM's RequestOutput (prompt_logprobs None unless asked)
                finished=False,
                prompt_logprobs=None,
                outputs=[SimpleNamespace(token_ids=[21, 22], finish_reason=None, logprobs=None)],
            )
            if report.pop() == "yes":  # what the processor does in the engine core
                KeyClient(keys.path).report_fault(handle, Fault.SHRANK)
            yield SimpleNamespace(
                finished=True,
                prompt_logprobs=None,
                outputs=[SimpleNamespace(token_ids=[23], finish_reason="length", logprobs=None)],
            )

    async def run(request: GenerationRequest) -> Any:
        job = engine.submit(request)
        while True:
            item = await asyncio.wait_for(job.events.get(), 30)
            if isinstance(item, GenerationResult | BaseException):
                return item

    metrics = Metrics()
    engine = VLLMEngine(_LLM(), keys, list(EOS), metrics, 8, 8)
    engine.start()
    request = _requests()[0]
    try:
        failed = asyncio.run(run(request))
        assert isinstance(failed, UnwatermarkedError) and failed.reason == "shrink"
        report.add("no")
        done = asyncio.run(run(request))
        assert isinstance(done, GenerationResult) and done.token_ids == [21, 22, 23]
    finally:
        keys.close()
    assert metrics.registry.get_sample_value("worldcup_unwatermarked_rows_total") == 1
    faults = "worldcup_watermark_faults_total"
    assert metrics.registry.get_sample_value(faults, {"reason": "shrink"}) == 1
    assert len(keys) == 0  # both handles forgotten


@pytest.mark.vllm
def test_vllm_cpu_forces_async_scheduling_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why async scheduling cannot be shown safe here: vllm-cpu 0.32 turns it off even when
    asked for (vllm/platforms/cpu.py), so the GPU-only placeholder path never runs on this
    machine. The engine therefore sets it off on every device (engine_args)."""
    from vllm.engine.arg_utils import EngineArgs

    from worldcup_core.models import resolve_model_dir

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # as the engine runs it
    model = str(resolve_model_dir(None, None, need_model=True))
    asked = EngineArgs(
        model=model, tokenizer=model, dtype="float32", max_model_len=1024, async_scheduling=True
    )
    assert asked.create_engine_config().scheduler_config.async_scheduling is False


@pytest.mark.vllm
def test_json_rows_ban_control_character_tokens_unless_nothing_else_is_left() -> None:
    """A row whose spec is JSON (RowSpec.banned, the hf grammar mask's control-character
    tokens) never samples one while the grammar allows anything else; when the grammar
    allows only banned ids they stay (as the hf mask keeps them); other rows are as
    they were."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    banned = (11, 12, 13)
    plain = RowSpec(SamplingConfig(temperature=1.0, top_k=0, top_p=1.0), EOS)
    json_row = RowSpec(plain.sampling, EOS, banned=banned)
    proc = _processor({"json": json_row, "plain": plain})
    outs: dict[str, list[int]] = {"json": [], "plain": []}
    added = [(i, _Params(h), [5, 6], outs[h]) for i, h in enumerate(outs)]
    proc.update_state(BatchUpdate(2, [], added, []))
    logits = torch.full((2, VOCAB), -torch.inf)
    logits[:, [11, 12, 13, 40, 41]] = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])  # the grammar's
    got = proc.apply(logits.clone())
    assert torch.isneginf(got[0, list(banned)]).all()
    assert torch.isfinite(got[0, [40, 41]]).all()
    assert torch.isfinite(got[1, [11, 12, 13, 40, 41]]).all()  # no JSON spec: no ban
    only = torch.full((2, VOCAB), -torch.inf)
    only[:, [11, 12]] = 1.0  # the grammar allows banned ids only: they stay
    kept = proc.apply(only.clone())
    assert torch.isfinite(kept[0, [11, 12]]).all()


# --------------------------------------------------------------------------- V1 guards
def _v1_rows(specs: dict[str, RowSpec], history: int = 3) -> tuple[Any, dict[str, list[int]]]:
    """A V1 processor with one row per spec, each past ``history`` synced steps."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    proc = _processor(specs)
    outs: dict[str, list[int]] = {h: [] for h in specs}
    added = [(i, _Params(h), [5, 6, 7], outs[h]) for i, h in enumerate(specs)]
    proc.update_state(BatchUpdate(len(specs), [], added, []))
    rng = np.random.default_rng(1)
    for _ in range(history):
        got = proc.apply(torch.from_numpy(rng.normal(0, 2, (len(specs), VOCAB))).float())
        for i, h in enumerate(specs):  # as vLLM does: a token from the row's q
            outs[h].append(int(torch.argmax(got[i])))
    return proc, outs


def _plain_q(history: list[int], logits: torch.Tensor) -> torch.Tensor:
    """log q of an unwatermarked row with ``history`` (added fresh: a replay)."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    plain = _processor({"p": _spec(None)})
    plain.update_state(BatchUpdate(1, [], [(0, _Params("p"), [5, 6, 7], list(history))], []))
    return plain.apply(logits[None].clone())[0]


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["growth", "shrink", "outside", "skipped"])
def test_v1_guards_fail_the_row_closed(case: str) -> None:
    """Each guard: the row goes unwatermarked at once (its q is an unwatermarked row's on
    the same logits and history), is reported once with its reason, and the other row
    keeps its watermark. The old processor accepted all four silently."""
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    specs = {"a": _spec(_scheme(1)), "b": _spec(_scheme(2))}
    proc, outs = _v1_rows(specs)
    logits = torch.from_numpy(np.random.default_rng(9).normal(0, 3, (2, VOCAB))).float()
    last = proc.apply(logits.clone())
    outs["b"].append(int(torch.argmax(last[1])))
    good = int(torch.argmax(last[0]))
    rows = 2
    if case == "growth":  # two tokens in one step
        outs["a"] += [good, 33]
    elif case == "shrink":  # vLLM truncated the row (its KV-load failure path)
        del outs["a"][-2:]
    elif case == "outside":  # a token the last q gave no mass
        outs["a"].append(int(torch.nonzero(torch.isneginf(last[0]))[0]))
    else:  # row a moves to index 1, and vLLM's batch hands over one row
        outs["a"].append(good)
        proc.update_state(BatchUpdate(2, [], [], [(0, 1, MoveDirectionality.SWAP)]))
        rows = 1
    got = proc.apply(logits[:rows].clone())
    assert proc._keys.reported == [("a", _fault_of(case))]
    if case != "skipped":
        assert torch.equal(got[0], _plain_q(outs["a"], logits[0]))  # a: filtered only
        assert not torch.allclose(got[1], _plain_q(outs["b"], logits[1]))  # b: watermarked
    proc.apply(logits[:rows].clone())
    assert proc._keys.reported == [("a", _fault_of(case))]  # reported once


def _fault_of(case: str) -> Fault:
    return {
        "growth": Fault.GREW,
        "shrink": Fault.SHRANK,
        "outside": Fault.OUTSIDE,
        "skipped": Fault.SKIPPED,
    }[case]


@pytest.mark.vllm
def test_v1_a_re_added_row_replays_its_tokens_without_a_fault() -> None:
    """A preempted request comes back with the tokens it has (the first sync after an
    add replays them: no growth fault), then grows one token a step; its q equals that of
    a row that generated the same tokens without a preemption."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    specs = {"a": _spec(_scheme(1)), "twin": _spec(_scheme(1))}
    proc = _processor(specs)
    history = [int(t) for t in np.random.default_rng(2).integers(20, 300, 12)]
    twin: list[int] = []
    proc.update_state(BatchUpdate(1, [], [(0, _Params("twin"), [5, 6, 7], twin)], []))
    for tok in history:
        proc.apply(_favour([tok]))
        twin.append(tok)
    assert proc._keys.reported == []
    resumed = list(history)  # re-added with its 12 tokens
    proc.update_state(BatchUpdate(2, [], [(1, _Params("a"), [5, 6, 7], resumed)], []))
    logits = torch.from_numpy(np.random.default_rng(3).normal(0, 3, (2, VOCAB))).float()
    logits[1] = logits[0]
    got = proc.apply(logits.clone())
    assert torch.equal(got[0], got[1])
    tok = int(torch.argmax(got[0]))
    resumed.append(tok)
    twin.append(tok)
    got = proc.apply(logits.clone())
    assert torch.equal(got[0], got[1])
    assert proc._keys.reported == []


# --------------------------------------------------------------------------- runners
@pytest.mark.vllm
def test_select_runner_follows_the_setting_and_refuses_a_contradiction() -> None:
    from vllm.triton_utils import HAS_TRITON

    from app.engines.vllm import UnsupportedConfiguration, select_runner

    assert select_runner("v1", {}) == "v1"
    assert select_runner("v2", {}) == "v2"
    assert select_runner("auto", {}) == ("v2" if HAS_TRITON else "v1")
    assert select_runner("auto", {"VLLM_USE_V2_MODEL_RUNNER": "1"}) == "v2"
    assert select_runner("auto", {"VLLM_USE_V2_MODEL_RUNNER": "0"}) == "v1"
    assert select_runner("v2", {"VLLM_USE_V2_MODEL_RUNNER": "1"}) == "v2"
    with pytest.raises(UnsupportedConfiguration, match="unset one of them"):
        select_runner("v1", {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert not HAS_TRITON  # vllm-cpu 0.32: no Triton CPU backend, so auto is v1 here


def _config(**kw: Any) -> Any:
    from types import SimpleNamespace

    values: dict[str, Any] = {
        "use_v2_model_runner": False,
        "watermark_config": None,
        "speculative_config": None,
        "scheduler_config": SimpleNamespace(async_scheduling=False),
    }
    values.update(kw)
    return SimpleNamespace(**values)


@pytest.mark.parametrize(
    ("runner", "config", "refused"),
    [
        ("v1", {}, None),
        ("v2", {"use_v2_model_runner": True}, None),
        ("v2", {}, "V1 model runner"),
        ("v1", {"use_v2_model_runner": True}, "V2 model runner"),
        ("v2", {"use_v2_model_runner": True, "watermark_config": object()}, "two watermarks"),
        ("v1", {"speculative_config": object()}, "speculative decoding"),
        ("v2", {"use_v2_model_runner": True, "speculative_config": object()}, "speculative"),
        (
            "v1",
            {"scheduler_config": _config().scheduler_config.__class__(async_scheduling=True)},
            "async",
        ),
    ],
)
def test_check_engine_config_refuses_what_the_processor_cannot_watermark(
    runner: str, config: dict[str, Any], refused: str | None
) -> None:
    from app.engines.vllm import UnsupportedConfiguration, check_engine_config

    if refused is None:
        check_engine_config(_config(**config), runner)
        return
    with pytest.raises(UnsupportedConfiguration, match=refused):
        check_engine_config(_config(**config), runner)


@pytest.mark.vllm
def test_vllm_cpu_cannot_build_model_runner_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    """The evidence for keeping V1 on vllm-cpu 0.32: with V2 asked for, vLLM refuses to
    build its config (MRv2 needs Triton, and vllm-cpu ships no Triton CPU backend), so
    the MRv2 processor is tested here by driving it as MRv2's runner does (below). A
    real V1 configuration with the processor passes the engine's start-up check."""
    from vllm.engine.arg_utils import EngineArgs

    from app.engines.vllm import PROCESSORS, check_engine_config
    from worldcup_core.models import resolve_model_dir

    model = str(resolve_model_dir(None, None, need_model=True))
    base = {"model": model, "tokenizer": model, "dtype": "float32", "max_model_len": 1024}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    v2 = EngineArgs(**base, logits_processors=[PROCESSORS["v2"]])
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
        v2.create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    v1 = EngineArgs(**base, logits_processors=[PROCESSORS["v1"]], async_scheduling=False)
    check_engine_config(v1.create_engine_config(), "v1")


# --------------------------------------------------------------------------- MRv2
class _OnDevice:
    """A request-state buffer as the MRv2 processor may read it: ``gpu`` (device); with
    ``host``, also ``np`` (vLLM's host mirror of prompt_len)."""

    def __init__(self, tensor: torch.Tensor, host: bool = False) -> None:
        self.gpu = tensor
        if host:
            self.np = tensor.numpy()


class _MRv2Runner:
    """Drives a processor as vLLM's MRv2 model runner does (vllm/v1/worker/gpu/
    model_runner.py, states.py, sample/sampler.py): slots from a free list; add_request
    at admission and again after a preemption (the request is removed and re-added with
    its prompt and tokens so far as its prefill); one apply a step with the rows in the
    batch's order, a partial-prefill row sampled and discarded; each sampled token
    committed to all_token_ids / total_len on the device (post_update) before the next
    step's sampler. ``async_scheduling``: the next step's layout is built before the
    previous step's tokens are committed (vLLM's async scheduling; the commit still
    precedes the next apply, in stream order), and no host mirror of total_len exists."""

    def __init__(self, specs: dict[str, RowSpec], async_scheduling: bool, slots: int = 6):
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

        from app.engines.vllm_mrv2 import WorldCupMRv2Processor

        self.all = torch.zeros(slots, 256, dtype=torch.int32)
        self.total = torch.zeros(slots, dtype=torch.int32)
        self.prompt_len = torch.zeros(slots, dtype=torch.int32)
        state = LogitsProcRequestState(
            device=torch.device("cpu"),
            max_num_reqs=slots,
            vocab_size=VOCAB,
            all_token_ids=_OnDevice(self.all),  # type: ignore[arg-type]
            prompt_len=_OnDevice(self.prompt_len, host=True),  # type: ignore[arg-type]
            prefill_len=_OnDevice(torch.zeros(slots, dtype=torch.int32), host=True),  # type: ignore[arg-type]
            total_len=_OnDevice(self.total),  # type: ignore[arg-type]
        )
        self.proc = WorldCupMRv2Processor(None, state)
        self.proc._keys = _Reports(specs)
        self.free = list(range(slots))
        self.slot: dict[str, int] = {}
        self.prompts: dict[str, list[int]] = {}
        self.committed: dict[str, list[int]] = {}
        self.async_scheduling = async_scheduling
        self.uncommitted: list[tuple[str, int]] = []
        self.rng = np.random.default_rng(21)

    def add(self, req: str, prompt: list[int], handle: str | None) -> int:
        slot = self.free.pop()  # as RequestState.add_request
        self.slot[req] = slot
        self.prompts[req] = prompt
        ids = prompt + self.committed.setdefault(req, [])
        self.all[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.prompt_len[slot] = len(prompt)
        self.total[slot] = len(ids)
        taken = self.proc.add_request(slot, _Params(handle))
        assert taken is (handle is not None)
        return slot

    def preempt(self, req: str) -> None:  # finish_requests: the slot is freed, no callback
        self.free.append(self.slot.pop(req))

    def commit(self) -> None:  # post_update on the device
        for req, tok in self.uncommitted:
            if req in self.slot:
                slot = self.slot[req]
                self.all[slot, int(self.total[slot])] = tok
                self.total[slot] += 1
                self.committed[req].append(tok)
        self.uncommitted.clear()

    def step(
        self,
        reqs: list[str],
        logits: torch.Tensor,
        partial: Any = frozenset(),
        sample: bool = True,
    ) -> dict[str, torch.Tensor]:
        """One step: rows in a shuffled order; returns each request's processed row."""
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        order = [reqs[i] for i in self.rng.permutation(len(reqs))]
        slots = np.array([self.slot[r] for r in order], dtype=np.int32)
        n = len(order)
        ctx = LogitsContext(
            expanded_idx_mapping=torch.from_numpy(slots),
            idx_mapping=torch.from_numpy(slots),
            idx_mapping_np=slots,
            expanded_local_pos=torch.zeros(n, dtype=torch.int32),
            input_ids=torch.zeros(n, dtype=torch.int64),
            pos=torch.zeros(n, dtype=torch.int64),
            seq_lens_upper_bound_np=np.zeros(n, dtype=np.int32),
        )
        if self.async_scheduling:
            self.commit()  # after the layout, before the sampler (stream order)
        rows = torch.stack([logits[reqs.index(r)] for r in order])
        out = self.proc.apply(rows.clone(), ctx)
        for r, row in zip(order, out, strict=True):
            if r in partial or not sample:
                continue  # a partial prefill's sample is discarded
            q = torch.softmax(row.double(), dim=-1).numpy()
            tok = int(self.rng.choice(VOCAB, p=q / q.sum()))
            self.uncommitted.append((r, tok))
        if not self.async_scheduling:
            self.commit()
        return dict(zip(order, out, strict=True))


@pytest.mark.vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mrv2_processor_under_its_runner(async_scheduling: bool) -> None:
    """The MRv2 processor driven as MRv2's runner drives it, with and without async
    scheduling: rows reordered every step, partial prefills, a request preempted and
    re-added at another slot (its slot reused meanwhile by a request without a handle),
    a late joiner, a request that misses a step, one that finishes (its slot leaves the
    batched step: MRv2 tells no processor). The processor sees each committed token
    exactly once (its record and
    the batched step's history equal vLLM's committed tokens), no guard fires, and the
    final step's distribution equals the hf engine's for every row."""
    requests = _requests()
    names = [f"r{i}" for i in range(len(requests))]
    specs = {
        n: RowSpec(r.sampling, EOS, r.scheme, r.payload)
        for n, r in zip(names, requests, strict=True)
    }
    run = _MRv2Runner(specs, async_scheduling)
    rng = np.random.default_rng(5)
    for n, r in zip(names[:4], requests[:4], strict=True):
        run.add(n, list(r.prompt_ids), n)
    live = names[:4]
    for step in range(30):
        if step == 6:
            run.preempt("r1")
            live = [n for n in live if n != "r1"]
            run.add("other", [1, 2, 3], None)  # takes r1's slot: not ours
            live.append("other")
        if step == 9:
            run.add("r1", list(requests[1].prompt_ids), "r1")  # replays its tokens
            live.append("r1")
            run.preempt("other")
            live.remove("other")
        if step == 12:
            run.add("r4", list(requests[4].prompt_ids), "r4")
            live.append("r4")
        if step == 20:  # r3 finishes: its slot is freed, and MRv2 tells no processor
            finished = run.slot["r3"]
            run.preempt("r3")
            live.remove("r3")
        partial = {"r4"} if step in (12, 13) else ({"r1"} if step == 9 else set())
        batch = [n for n in live if not (step == 16 and n == "r0")]  # r0 misses a step
        logits = torch.from_numpy(rng.normal(0, 3, (len(batch), VOCAB))).float()
        last = run.step(batch, logits, partial)
    run.commit()
    # the final step, unsampled: against the hf engine on the histories as committed
    mine = [n for n in live if n != "other"]
    logits = torch.from_numpy(rng.normal(0, 3, (len(mine), VOCAB))).float()
    got = run.step(mine, logits, sample=False)
    assert run.proc._keys.reported == []
    assert not run.proc._batched._host[finished, Column.LIVE]  # released after a step
    for n in mine:  # each committed token recorded exactly once
        row = run.proc._rows[run.slot[n]]
        assert row.output == run.committed[n] and row.seen == len(row.output), n
        if row.batched:
            slot = run.slot[n]
            length = int(run.proc._batched._length[slot])
            assert run.proc._batched._history[slot, :length].tolist() == run.committed[n]
    assert len(run.committed["r1"]) > 10 and run.slot["r1"] != 4  # moved slots
    hf = _hf_distributions(
        [requests[names.index(n)] for n in mine], [run.committed[n] for n in mine], logits
    )
    for k, n in enumerate(mine):
        q = torch.softmax(got[n].double(), dim=-1)
        assert torch.allclose(q, hf[k], atol=1e-6), (n, (q - hf[k]).abs().max())
    assert last  # the loop ran


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["growth", "shrink", "outside", "layout"])
def test_mrv2_guards_fail_the_row_closed(case: str) -> None:
    """The same guards on MRv2's device history: a row that grows by 2 between steps,
    shrinks, gets a token its q gave no mass, or a step with several rows a request
    (speculative decoding) is reported with its reason; the other row is untouched."""
    specs = {"a": _spec(_scheme(1)), "b": _spec(_scheme(2))}
    run = _MRv2Runner(specs, async_scheduling=False)
    run.add("a", [5, 6, 7], "a")
    run.add("b", [5, 6, 8], "b")
    rng = np.random.default_rng(3)
    for _ in range(4):
        out = run.step(["a", "b"], torch.from_numpy(rng.normal(0, 3, (2, VOCAB))).float())
    slot = run.slot["a"]
    if case == "growth":
        run.uncommitted = [("a", int(torch.argmax(out["a"]))), ("a", 11)]
        run.commit()
    elif case == "shrink":
        run.total[slot] -= 2
    elif case == "outside":
        run.total[slot] -= 1  # replace a's last token by one it had no mass for
        run.committed["a"].pop()
        run.uncommitted = [("a", int(torch.nonzero(torch.isneginf(out["a"]))[0]))]
        run.commit()
    logits = torch.from_numpy(rng.normal(0, 3, (2, VOCAB))).float()
    if case == "layout":
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        slots = np.array([slot], dtype=np.int32)
        two = torch.zeros(2, dtype=torch.int64)
        ctx = LogitsContext(two, torch.from_numpy(slots), slots, two, two, two, slots)
        run.proc.apply(logits.clone(), ctx)  # two rows for one request
    else:
        run.step(["a", "b"], logits)
    assert run.proc._keys.reported == [("a", _fault_of_mrv2(case))]
    run.step(["a", "b"], logits)
    assert run.proc._keys.reported == [("a", _fault_of_mrv2(case))]  # once


def _fault_of_mrv2(case: str) -> Fault:
    return {
        "growth": Fault.GREW,
        "shrink": Fault.SHRANK,
        "outside": Fault.OUTSIDE,
        "layout": Fault.LAYOUT,
    }[case]


def test_readback_lost_counts_the_tokens_a_reader_of_the_text_does_not_get_back() -> None:
    """The debug summary's readback: a non-canonical whitespace split (``"  " + "eggs"``
    where the tokenizer writes ``" " + " eggs"``) is lost to a reader of the text, a
    canonical sequence is not; the summary carries the count (base suite, no vLLM)."""
    from app.engines.vllm_keys import readback_lost, score_summary
    from worldcup_core.models import load_tokenizer

    tok = load_tokenizer()
    text = "The eggs  \nThe  eggs  \nI will  \n"
    canonical = tok(text, add_special_tokens=False).input_ids
    assert readback_lost(canonical, canonical) == 0
    split = tok.convert_tokens_to_ids(["ĠĠ"]) + tok("eggs", add_special_tokens=False).input_ids
    assert tok.decode(split) == "  eggs"
    generated = tok("The", add_special_tokens=False).input_ids + split + canonical
    retokenized = tok(tok.decode(generated), add_special_tokens=False).input_ids
    assert retokenized != generated
    lost = readback_lost(generated, retokenized)
    assert 1 <= lost < len(generated) // 4  # the split and its neighbours, not the rest
    assert score_summary([], generated, retokenized)["readback_lost"] == lost
    assert score_summary([], generated)["readback_lost"] is None
