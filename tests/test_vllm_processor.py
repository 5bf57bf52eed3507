"""The vLLM logits processor gives, on fixed logits, the distribution the hf engine samples.

The reference is the hf engine itself: :meth:`ContinuousBatch._sample` with its
draw replaced by a spy that records the candidates and q it would sample from.
The processor is driven through vLLM's own ``BatchUpdate`` (adds, a removal, a
one-way move and a swap), rows mixing v2 keys, a v1 key, an unwatermarked
row and different temperature/top-k/top-p, bans and generated histories.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from app.engines.vllm_keys import EOS_ARGS_KEY, EXTRA_ARGS_KEY, RowSpec
from worldcup_core import Payload, SamplingConfig, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.generation import ContinuousBatch, GenerationRequest
from worldcup_core.sampling import filter_logits_torch
from worldcup_core.scheme import WatermarkScheme

pytestmark = pytest.mark.vllm

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


def test_processor_distribution_equals_the_hf_engine() -> None:
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from app.engines.vllm_processor import WorldCupLogitsProcessor

    requests = _requests()
    specs = {f"h{i}": RowSpec(r.sampling, EOS, r.scheme, r.payload) for i, r in enumerate(requests)}
    proc = WorldCupLogitsProcessor(None, torch.device("cpu"), False)
    proc._keys = _Keys(specs)  # the socket is tested end to end in test_engines
    outputs: list[list[int]] = [[] for _ in requests]
    # vLLM's persistent batch: index -> request; start with 0..3, a placeholder at 4
    added = [(i, _Params(f"h{i}"), list(r.prompt_ids), outputs[i]) for i, r in enumerate(requests)]
    added[4] = (4, _Params(None), [1, 2], [])  # no handle: left untouched
    proc.update_state(BatchUpdate(5, [], added, []))
    proc.apply(torch.zeros(5, VOCAB))  # a first step with no history
    # generate some history (vLLM appends to the live output lists), including a repeat
    rng = np.random.default_rng(11)
    for step in range(12):
        for i in range(4):
            outputs[i].append(int(rng.integers(10, 60)) if step % 5 else 42)
        proc.apply(torch.zeros(5, VOCAB))
    # async scheduling: a placeholder (-1) is not recorded; the real token is, once it lands
    outputs[0].append(-1)
    proc.apply(torch.zeros(5, VOCAB))
    outputs[0][-1] = 33
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
