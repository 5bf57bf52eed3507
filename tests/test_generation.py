"""Plumbing of the batched generation loop and the HF adapter, on a tiny random model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

from worldcup_core import Payload, SamplingConfig, WatermarkKey, WorldCup
from worldcup_core.baselines import MPAC
from worldcup_core.generation import ContinuousBatch, GenerationRequest, generate
from worldcup_core.hf import WorldCupLogitsProcessor
from worldcup_core.models import LoadedModel, load_tokenizer, tiny_random_model
from worldcup_core.sampling import NGramBlocker, filter_logits


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_random_model(load_tokenizer())


def _prompt(tiny: LoadedModel, text: str) -> list[int]:
    ids: list[int] = tiny.tokenizer(text, add_special_tokens=False).input_ids
    return ids


def _run(tiny: LoadedModel, requests: list[GenerationRequest], **kw: Any) -> list[Any]:
    return generate(tiny.model, requests, tiny.eos_token_ids, tiny.pad_token_id, **kw)


def test_batch_rows_keep_their_own_key_payload_and_sampling(tiny: LoadedModel) -> None:
    keys = [WatermarkKey(bytes([i]) * 32) for i in range(3)]
    payloads = [Payload("1010110011110000"), Payload("0000111100001111"), Payload("1" * 16)]
    requests = [
        GenerationRequest(
            _prompt(tiny, f"Story number {i} begins"),
            SamplingConfig(max_new_tokens=48 + 8 * i, min_new_tokens=48 + 8 * i, seed=i),
            WorldCup(k),
            p,
        )
        for i, (k, p) in enumerate(zip(keys, payloads, strict=True))
    ]
    results = _run(tiny, requests)
    assert [len(r.token_ids) for r in results] == [48, 56, 64]
    correct = 0
    for i, (r, p) in enumerate(zip(results, payloads, strict=True)):
        own = WorldCup(keys[i]).decode(r.token_ids, 16)
        assert own.detection.p_value < 1e-6
        correct += sum(a == b for a, b in zip(own.bits, p.bits, strict=True))
        other = WorldCup(keys[(i + 1) % 3]).detect(r.token_ids, 16)
        assert other.p_value > 1e-3
    assert correct >= 44  # of 48 bits


def test_seeded_generation_is_reproducible(tiny: LoadedModel) -> None:
    def once() -> list[int]:
        req = GenerationRequest(
            _prompt(tiny, "Hello there"),
            SamplingConfig(max_new_tokens=20, seed=7),
            WorldCup(WatermarkKey(bytes(32))),
            Payload("0110"),
        )
        return list(_run(tiny, [req])[0].token_ids)

    assert once() == once()


class _EosFavoured(torch.nn.Module):
    """Wraps a model so EOS is by far the most likely token at every step."""

    def __init__(self, inner: Any, eos: int) -> None:
        super().__init__()
        self.inner, self.eos = inner, eos

    def forward(self, **kw: Any) -> Any:
        out = self.inner(**kw)
        out.logits[..., self.eos] += 100.0
        return out


def test_min_new_tokens_suppresses_eos_and_eos_ends_the_row(tiny: LoadedModel) -> None:
    eos = tiny.eos_token_ids[0]
    model = _EosFavoured(tiny.model, eos)
    req = GenerationRequest(
        _prompt(tiny, "Once"), SamplingConfig(max_new_tokens=30, min_new_tokens=12, seed=1)
    )
    (res,) = generate(model, [req], tiny.eos_token_ids, tiny.pad_token_id)
    assert res.finish_reason == "eos"
    assert len(res.token_ids) == 12  # EOS at the first allowed step, and not returned
    assert eos not in res.token_ids


def test_no_repeat_ngram_is_enforced(tiny: LoadedModel) -> None:
    prompt = _prompt(tiny, "a b a b a b")
    req = GenerationRequest(
        prompt, SamplingConfig(max_new_tokens=60, top_k=3, seed=3, no_repeat_ngram_size=2)
    )
    (res,) = _run(tiny, [req])
    seq = prompt + res.token_ids
    grams = [tuple(seq[i : i + 2]) for i in range(len(seq) - 1)]
    assert len(grams[len(prompt) - 1 :]) == len(set(grams[len(prompt) - 1 :]))
    assert not set(grams[len(prompt) - 1 :]) & set(grams[: len(prompt) - 1])


def test_ngram_blocker_matches_definition() -> None:
    blocker = NGramBlocker(3, [1, 2, 3, 1, 2])
    assert blocker.banned() == {3}
    blocker.push(4)
    assert blocker.banned() == set()
    assert NGramBlocker(0, [1, 1, 1]).banned() == set()


def test_filter_logits_applies_temperature_top_k_top_p_per_row() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    ids, probs = filter_logits(logits, [1.0, 1.0], [3, 0], [0.75, 1.0])
    assert ids[0, :2].tolist() == [0, 1]
    np.testing.assert_allclose(probs[0], [0.625, 0.375, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(probs[1], [0.25] * 4, atol=1e-6)
    _, hot = filter_logits(logits[:1], [0.5], [0], [1.0])
    expected = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(hot[0], expected / expected.sum(), atol=1e-6)


def test_stop_callback_and_streaming(tiny: LoadedModel) -> None:
    seen: list[tuple[int, int]] = []
    req = GenerationRequest(_prompt(tiny, "Stream"), SamplingConfig(max_new_tokens=50, seed=0))
    (res,) = _run(
        tiny, [req], on_token=lambda i, t: seen.append((i, t)), should_stop=lambda: len(seen) >= 5
    )
    assert res.token_ids == [t for _, t in seen] and len(seen) == 5
    assert res.finish_reason == "cancelled"


def test_mpac_runs_through_the_same_loop(tiny: LoadedModel) -> None:
    scheme = MPAC(WatermarkKey(bytes(range(32))))
    payload = Payload("10110010")
    req = GenerationRequest(
        _prompt(tiny, "Baseline"),
        SamplingConfig(max_new_tokens=80, min_new_tokens=80, seed=5),
        scheme,
        payload,
    )
    (res,) = _run(tiny, [req])
    decoded = scheme.decode(res.token_ids, 8)
    assert decoded.detection.p_value < 1e-4
    assert sum(a == b for a, b in zip(decoded.bits, payload.bits, strict=True)) >= 7


def test_hf_logits_processor_watermarks_model_generate(tiny: LoadedModel) -> None:
    scheme = WorldCup(WatermarkKey(bytes(range(32))))
    payloads = [Payload("1100101011110000"), Payload("0011010100001111")]
    proc = WorldCupLogitsProcessor(scheme, payloads, temperature=1.0, top_k=50, top_p=0.95)
    prompt = torch.tensor([_prompt(tiny, "Two rows of the same")] * 2)
    torch.manual_seed(0)
    out = tiny.model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=64,
        min_new_tokens=64,
        logits_processor=LogitsProcessorList([proc]),
        pad_token_id=tiny.pad_token_id,
    )
    correct = 0
    for row, payload in zip(out[:, prompt.shape[1] :].tolist(), payloads, strict=True):
        decoded = scheme.decode(row, 16)
        assert decoded.detection.p_value < 1e-6
        correct += sum(a == b for a, b in zip(decoded.bits, payload.bits, strict=True))
    assert correct >= 28  # of 32 bits


def test_hf_logits_processor_validates_batch() -> None:
    scheme = WorldCup(WatermarkKey(bytes(32)))
    with pytest.raises(ValueError, match="payloads"):
        WorldCupLogitsProcessor(scheme, [])
    proc = WorldCupLogitsProcessor(scheme, [Payload("01")])
    with pytest.raises(ValueError, match="2 rows but 1 payloads"):
        proc(torch.zeros((2, 3), dtype=torch.long), torch.zeros((2, 10)))


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        GenerationRequest([])
    with pytest.raises(ValueError, match="both or neither"):
        GenerationRequest([1], scheme=WorldCup(WatermarkKey(bytes(32))))
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingConfig(max_new_tokens=4, min_new_tokens=5)


def _solo(tiny: LoadedModel, req: GenerationRequest) -> list[int]:
    return list(_run(tiny, [req])[0].token_ids)


def test_rows_join_and_leave_between_steps(tiny: LoadedModel) -> None:
    """A row's tokens do not depend on who else is in the batch, or when it joined."""
    scheme = WorldCup(WatermarkKey(bytes(range(32))))

    def req(text: str, n: int, seed: int) -> GenerationRequest:
        return GenerationRequest(
            _prompt(tiny, text),
            SamplingConfig(max_new_tokens=n, min_new_tokens=n, seed=seed),
            scheme,
            Payload("10110011"),
        )

    first, second, third = (
        req("A long first prompt here", 30, 1),
        req("Hi", 12, 2),
        req("Third one", 20, 3),
    )
    batch = ContinuousBatch(tiny.model, tiny.eos_token_ids, tiny.pad_token_id)
    (a,) = batch.add([first])
    tokens: dict[int, list[int]] = {}
    for step in range(30):
        if step == 5:
            (b,) = batch.add([second])
        if step == 9:
            (c,) = batch.add([third])
        if step == 14:
            batch.cancel([c])
        events, _ = batch.step()
        for ev in events:
            tokens.setdefault(ev.row_id, []).append(ev.token)
    assert len(batch) == 0
    assert tokens[a] == _solo(tiny, first)
    assert tokens[b] == _solo(tiny, second)
    assert tokens[c] == _solo(tiny, third)[:5]  # cancelled after 5 steps


def test_prompt_logprobs_come_with_the_first_event_from_the_prefill(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SamplingConfig.prompt_logprobs``: a row's first event carries each prompt token's
    log-probability given the tokens before it (the first None) and the top ids, from
    the prefill's logits, whatever the row's padding in the batch; later events carry
    none. The log-softmax runs in chunks of positions: any chunk size gives the same."""
    import worldcup_core.generation as generation

    short = _prompt(tiny, "The tide")
    long = _prompt(tiny, "A long storm rolled over the quiet harbour and the boats")
    with torch.no_grad():
        ref = torch.log_softmax(tiny.model(torch.tensor([long])).logits[0].double(), dim=-1)
    rows = [
        GenerationRequest(short, SamplingConfig(max_new_tokens=2, seed=1)),
        GenerationRequest(long, SamplingConfig(max_new_tokens=2, seed=1, prompt_logprobs=3)),
    ]
    got = []
    for chunk in (128, 3):
        monkeypatch.setattr(generation, "PROMPT_LOGPROBS_CHUNK", chunk)
        batch = ContinuousBatch(tiny.model, tiny.eos_token_ids, tiny.pad_token_id)
        short_id, long_id = batch.add(rows)  # the long prompt is the unpadded one
        first, _ = batch.step()
        second, _ = batch.step()
        by_row = {e.row_id: e for e in first}
        assert by_row[short_id].prompt_logprobs is None
        scores = by_row[long_id].prompt_logprobs
        assert scores is not None and len(scores) == len(long) and scores[0] is None
        assert all(e.prompt_logprobs is None for e in second)
        got.append(scores)
    assert got[0] == got[1]
    for j in range(1, len(long)):
        entry = got[0][j]
        assert entry is not None and abs(entry.logprob - float(ref[j - 1, long[j]])) < 1e-4
        best = torch.topk(ref[j - 1], 3)
        assert [t for t, _ in entry.top] == best.indices.tolist()
    padded = ContinuousBatch(tiny.model, tiny.eos_token_ids, tiny.pad_token_id)
    rows[0] = GenerationRequest(short, SamplingConfig(max_new_tokens=1, prompt_logprobs=0))
    rows[1] = GenerationRequest(long, SamplingConfig(max_new_tokens=1))
    first_id, _ = padded.add(rows)  # now the short prompt is left-padded
    events, _ = padded.step()
    scores = next(e for e in events if e.row_id == first_id).prompt_logprobs
    with torch.no_grad():
        alone = torch.log_softmax(tiny.model(torch.tensor([short])).logits[0].double(), dim=-1)
    assert scores is not None and scores[0] is None
    for j in range(1, len(short)):
        entry = scores[j]
        assert entry is not None and entry.top == ()
        assert abs(entry.logprob - float(alone[j - 1, short[j]])) < 1e-4


def test_the_kv_cache_goes_by_the_name_the_model_takes(tiny: LoadedModel) -> None:
    """transformers renamed ``past_key_values`` to ``cache`` (the old name warns, and goes
    in 5.40): a model whose forward names ``cache`` gets it so; one that names neither
    gets the old name, which every 5.x model takes (an unknown keyword would be dropped
    into ``**kwargs`` and the cache silently lost)."""
    import inspect
    import types

    from worldcup_core.generation import _cache_argument, _returned_cache

    params = inspect.signature(tiny.model.forward).parameters
    expected = "cache" if "cache" in params else "past_key_values"
    assert _cache_argument(tiny.model) == expected
    assert _cache_argument(_EosFavoured(tiny.model, 0)) == "past_key_values"
    new, old = types.SimpleNamespace(cache=1), types.SimpleNamespace(past_key_values=2)
    assert _returned_cache(new) == 1 and _returned_cache(old) == 2
