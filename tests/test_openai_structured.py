# ruff: noqa: F811  (the fixtures imported from test_openai_api are redefined as arguments)
"""Structured outputs, tools, sampling fields and logprobs on the /v1 routes (issue #26,
points 1-3), driven by the official ``openai`` SDK over real HTTP.

The server runs the tiny random-weight model (near-uniform next tokens), so a
grammar is what shapes the output, and a greedy reference computed here with
plain ``transformers`` is what "applied" is checked against.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from servers import LiveServer
from test_openai_api import (  # noqa: F401  (fixtures)
    MODEL,
    agree,
    client,
    decode,
    http,
    make_settings,
    registry,
    tenant,
    wm,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.schemas.openai.common import VLLM_UNSUPPORTED

NOTES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "minLength": 4, "maxLength": 16},
                    "text": {"type": "string", "minLength": 8, "maxLength": 160},
                    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                    "done": {"type": "boolean"},
                    "kind": {"enum": ["tide", "storm", "wave"]},
                },
                "required": ["title", "text", "priority", "done", "kind"],
                "additionalProperties": False,
            },
            "minItems": 4,
            "maxItems": 4,
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
FIXED: Any = {"watermark": {"payload": {"bits": "0110100110010110"}}}  # stream == plain


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(make_settings(tiny_model_dir, tmp_path_factory.mktemp("oas"))) as live:
        yield live


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[Any, Any]:
    """The served model and tokenizer, loaded independently of the service."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


# --------------------------------------------------------------------------- structured
def test_json_schema_answer_validates_and_decodes_to_its_registry_entry(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Four notes about the sea, as JSON."}],
        max_tokens=600,
        seed=11,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "notes", "schema": NOTES_SCHEMA, "strict": True},
        },
        extra_body={"watermark": {"metadata": {"app": "structured"}}},
    )
    (choice,) = out.choices
    assert choice.finish_reason == "stop", choice
    text = choice.message.content
    assert text is not None
    value = json.loads(text)
    jsonschema.validate(value, NOTES_SCHEMA)
    info = wm(choice)
    dec = decode(http, tenant, text, 16)
    assert dec["registry_match"]["message_id"] == info["message_id"], (dec, info)
    assert registry(http, tenant, info["message_id"])["metadata"] == {"app": "structured"}


def test_json_object_and_vllm_fields_constrain_the_output(client: openai.OpenAI) -> None:
    finished: list[str] = []

    def text(**extra: Any) -> str:
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=40, seed=3, extra_body=extra
        )
        content = out.choices[0].message.content
        assert content is not None
        finished.append(out.choices[0].finish_reason)
        return content

    for _ in range(2):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(guided_regex="[0-9]{3}-[a-z]{2}"))
    assert text(guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    assert text(structured_outputs={"choice": ["alpha", "beta"]}) in ("alpha", "beta")
    # an unbounded pattern may be cut by max_tokens, but only between or within its pairs
    pairs = text(structured_outputs={"regex": "(ab|cd)+"})
    cut = finished[-1] == "length" and re.fullmatch(r"(ab|cd)+[ac]", pairs)
    assert re.fullmatch(r"(ab|cd)+", pairs) or cut, (pairs, finished[-1])
    small = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    for extra in ({"guided_json": small}, {"structured_outputs": {"json": json.dumps(small)}}):
        jsonschema.validate(json.loads(text(**extra)), small)
    grammar = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]'
    assert re.fullmatch(r"\[[a-c](,[a-c])*\]", text(guided_grammar=grammar))
    obj = text(response_format={"type": "json_object"})
    assert obj.startswith("{")  # any object: it may run out of tokens before it closes


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
        ),  # fmt: skip
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),  # fmt: skip
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"abc": 5}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_invalid_structure_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert err.value.param is not None and err.value.param.startswith(param), err.value.body


# --------------------------------------------------------------------------- tools
def _args(call: Any) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(call.function.arguments)
    jsonschema.validate(value, WEATHER_TOOL["function"]["parameters"])
    return value


def test_forced_tool_call_parses_streamed_and_not(client: openai.OpenAI) -> None:
    kw: Any = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 60,
        "seed": 5,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "extra_body": FIXED,
    }
    out = client.chat.completions.create(**kw)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = _args(call)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].id.startswith("call_")
    assert deltas[0].function and deltas[0].function.name == "get_weather"
    streamed = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert json.loads(streamed) == args  # the same seeded sample, as deltas
    assert len(deltas) > 2  # the arguments came in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "watermark" in (chunks[-1].choices[0].model_extra or {})


def test_required_tool_call_and_auto(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, seed=8,
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", extra_body=FIXED,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)
    # the same, streamed: the call arrives whole when the choice ends
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=60,
            seed=8,
            stream=True,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required",
            extra_body=FIXED,
        )  # fmt: skip
    )
    (delta,) = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert delta.function is not None and delta.function.name == call.function.name
    assert delta.function.arguments == call.function.arguments

    # auto: the near-uniform tiny model answers in text; a multi-turn with a tool result works
    auto = client.chat.completions.create(
        model=MODEL, max_tokens=12, seed=2, tools=[WEATHER_TOOL],
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
             "type": "function", "function": {"name": "get_weather",
             "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
        ],
    )  # fmt: skip
    message = auto.choices[0].message
    assert message.content or message.tool_calls
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_auto_tool_grammar_takes_over_after_the_trigger(reference: Any) -> None:
    """``tool_choice: auto``: free text until ``<tool_call>``, then the grammar allows
    only the call's JSON (xgrammar's triggered tags); the reply is parsed back."""
    from app.engines import grammar
    from app.services.openai import tools

    _, tok = reference
    spec = grammar.GrammarSpec(
        "structural_tag", tools.auto_tool_tag([WEATHER_TOOL["function"]]), "tools"
    )
    constraint = grammar.GrammarConstraint(spec, grammar.compile_spec(tok, spec))
    free = constraint.allowed()
    assert free is not None and int(free.sum()) > 40_000  # plain text: nearly anything
    prefix = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "'
    for token in tok(prefix, add_special_tokens=False).input_ids:
        assert constraint.allowed()[token]  # type: ignore[index]
        constraint.accept(token)
    assert constraint.rejected == 0
    (hello,) = tok("hello", add_special_tokens=False).input_ids
    inside = constraint.allowed()
    assert inside is not None and inside[hello]  # a string's content is free
    for token in tok('Paris", "unit": "', add_special_tokens=False).input_ids:
        constraint.accept(token)
    enum = constraint.allowed()
    assert enum is not None and not enum[hello] and int(enum.sum()) < 50  # celsius|fahrenheit

    call_json = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    text = f"Sure. <tool_call>{call_json}</tool_call>"
    content, calls = tools.parse_calls("auto", text)
    assert content == "Sure."
    assert calls == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert tools.parse_calls("auto", "No call here.") == ("No call here.", [])


# --------------------------------------------------------------------------- sampling
def _greedy(reference: Any, prompt: str, steps: int, **f: Any) -> str:
    """Greedy decoding with OpenAI's penalties and logit_bias, written out here."""
    model, tok = reference
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            rp = f.get("repetition_penalty", 1.0)
            for t in set(prompt_ids) | set(out):
                logits[t] = logits[t] / rp if logits[t] > 0 else logits[t] * rp
            for t in set(out):
                logits[t] -= f.get("frequency_penalty", 0.0) * out.count(t)
                logits[t] -= f.get("presence_penalty", 0.0)
            for t, b in f.get("logit_bias", {}).items():
                logits[int(t)] += b
            nxt = int(logits.argmax())
            if nxt == tok.eos_token_id:
                break
            out.append(nxt)
            ids.append(nxt)
    return str(tok.decode(out, skip_special_tokens=True))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": -2.0},
    ],
)
def test_top_k_1_is_greedy_with_every_penalty_applied(
    client: openai.OpenAI, reference: Any, fields: dict[str, Any]
) -> None:
    """top_k 1 is greedy decoding (seed and payload cannot matter), and it equals greedy
    decoding with the penalties applied as written out in ``_greedy``; the prompt is one
    where the fields change the greedy text, so that ignoring them would fail."""
    prompts = ["The tide came in and", "tide tide tide tide", "A storm, a storm, a storm"]
    prompts += [f"{w} {w} {w}" for w in ("sea", "wave", "the", "and", "of", "a")]
    plain = {p: _greedy(reference, p, 24) for p in prompts}
    chosen = [(p, g) for p in prompts if (g := _greedy(reference, p, 24, **fields)) != plain[p]]
    if not fields:
        chosen = [(prompts[0], plain[prompts[0]])]
    assert chosen, "no prompt where the fields change greedy decoding"
    prompt, expected = chosen[0]
    texts = set()
    for seed, bits in ((1, "1" * 16), (2, "0" * 16)):  # seed and payload cannot matter
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, seed=seed,
            extra_body={**fields, "top_k": 1, "watermark": {"payload": {"bits": bits},
                        "no_repeat_ngram_size": 0}},
        )  # fmt: skip
        texts.add(out.choices[0].text)
    assert texts == {expected}


def test_logit_bias_forces_a_token_and_min_p_1_is_greedy(
    client: openai.OpenAI, reference: Any
) -> None:
    _, tok = reference
    (target,) = tok(" sea", add_special_tokens=False).input_ids
    out = client.completions.create(
        model=MODEL, prompt="The tide", max_tokens=6, seed=3, logit_bias={str(target): 100},
        extra_body={"watermark": {"no_repeat_ngram_size": 0}},
    )  # fmt: skip
    assert out.choices[0].text == " sea" * 6
    greedy = client.completions.create(
        model=MODEL, prompt="The tide", max_tokens=12, seed=1,
        extra_body={"top_k": 1, "watermark": {"no_repeat_ngram_size": 0}},
    )  # fmt: skip
    min_p = client.completions.create(
        model=MODEL, prompt="The tide", max_tokens=12, seed=7,
        extra_body={"min_p": 1.0, "watermark": {"no_repeat_ngram_size": 0}},
    )  # fmt: skip
    assert min_p.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize(("name", "value"), [(k, "x") for k in VLLM_UNSUPPORTED])
def test_unimplemented_vllm_fields_are_refused(
    client: openai.OpenAI, name: str, value: Any
) -> None:
    for create in (
        lambda: client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={name: value}
        ),
        lambda: client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, extra_body={name: value}
        ),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        assert err.value.param == name and name in err.value.message


# --------------------------------------------------------------------------- logprobs
def test_sampled_logprobs_add_up_to_the_watermarked_distribution(client: openai.OpenAI) -> None:
    """Default mode: the distribution each token was drawn from (after the watermark).
    With top-k 5 its whole support is in top_logprobs: exp sums to 1."""
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=16, seed=6, logprobs=True, top_logprobs=5,
        extra_body={"watermark": {"top_k": 5, **FIXED["watermark"]}},
    )  # fmt: skip
    content = out.choices[0].logprobs and out.choices[0].logprobs.content
    assert content and len(content) == 16
    text = "".join(entry.token for entry in content)
    assert text == out.choices[0].message.content
    for entry in content:
        assert 1 <= len(entry.top_logprobs) <= 5
        assert math.isclose(sum(math.exp(t.logprob) for t in entry.top_logprobs), 1, abs_tol=1e-6)
        mine = [t.logprob for t in entry.top_logprobs if t.token == entry.token]
        assert mine and math.isclose(mine[0], entry.logprob, abs_tol=1e-9)
        assert entry.bytes == list(entry.token.encode())
    # streamed, the same seeded sample carries the same entries, chunk by chunk
    chunks = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=16, seed=6, logprobs=True, top_logprobs=5,
        stream=True, extra_body={"watermark": {"top_k": 5, **FIXED["watermark"]}},
    )  # fmt: skip
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_model_logprobs_are_the_models_own_distribution(
    client: openai.OpenAI, reference: Any
) -> None:
    """``logprobs_mode: model``: the model's log-softmax before anything reshapes it. With
    top-k 1 the text is the greedy chain, computed here, so every entry can be checked."""
    model, tok = reference
    prompt = "A storm over the bay"
    ids = tok(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        chain: list[int] = []
        for _ in range(8):
            chain.append(int(model(torch.tensor([ids + chain])).logits[0, -1].argmax()))
        logp = torch.log_softmax(model(torch.tensor([ids + chain])).logits[0].double(), dim=-1)
    kw: Any = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "seed": 2, "logprobs": 5}
    body = {"top_k": 1, "watermark": {"no_repeat_ngram_size": 0}}
    out = client.completions.create(**kw, extra_body={**body, "logprobs_mode": "model"})
    assert out.choices[0].text == tok.decode(chain)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens or []) == out.choices[0].text
    for k, token in enumerate(chain):
        row = logp[len(ids) + k - 1]
        assert math.isclose(lp.token_logprobs[k] or 0, float(row[token]), abs_tol=1e-4)
        assert lp.token_logprobs[k] < -1  # near-uniform over 49k ids: far from certain
        top = sorted((lp.top_logprobs[k] or {}).values(), reverse=True)
        best = torch.topk(row, 5).values.tolist()
        assert math.isclose(top[0], best[0], abs_tol=1e-4) and len(top) <= 5
    assert lp.text_offset and lp.text_offset[0] == 0
    # the default ("sampled") reports what was drawn from: top-k 1 leaves one token, p = 1
    sampled = client.completions.create(**kw, extra_body=body)
    assert sampled.choices[0].logprobs is not None
    assert sampled.choices[0].logprobs.token_logprobs == [0.0] * 8


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The tide", max_tokens=4, echo=True)
    assert out.choices[0].text.startswith("The tide") and len(out.choices[0].text) > 8
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The tide", max_tokens=4, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("The tide")


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, reference: Any) -> None:
    """``echo`` with ``logprobs``: the prompt's tokens come first, the first with a null
    logprob (as OpenAI), each next one with the model's own log-probability given the
    ones before it (an independent forward pass here), then the completion's entries.
    Streamed, the first chunk is the prompt with its entries; the chunks add up to the
    response. ``max_tokens`` 0 scores the prompt alone (OpenAI's "score this text" call):
    no text, no watermark, no receipt; without echo and logprobs it is a 400."""
    model, tok = reference
    prompt = "The storm rolled over the quiet harbour"
    ids = tok(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    kw: Any = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "seed": 5, "logprobs": 2}
    out = client.completions.create(**kw, echo=True, extra_body=FIXED)
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    n = len(ids)
    assert len(lp.tokens) == n + 3 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.tokens[:n] == [tok.decode([i]) for i in ids]
    assert choice.text == prompt + "".join(lp.tokens[n:])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])] and lp.text_offset[n] == len(prompt)
    for j in range(1, n):
        row = logp[j - 1]
        value = lp.token_logprobs[j]
        assert value is not None and math.isclose(value, float(row[ids[j]]), abs_tol=1e-4)
        top = lp.top_logprobs[j] or {}
        best = torch.topk(row, 2)
        assert len(top) == 2
        for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert math.isclose(top[tok.decode([t])], v, abs_tol=1e-4)
        assert max(top.values()) >= value - 1e-9  # the best alternatives bound the token
    # the completion's entries are those the same request reports without echo
    plain = client.completions.create(**kw, extra_body=FIXED).choices[0]
    assert plain.text == choice.text[len(prompt) :]
    assert plain.logprobs is not None
    assert plain.logprobs.token_logprobs == lp.token_logprobs[n:]
    assert [o + len(prompt) for o in plain.logprobs.text_offset or []] == lp.text_offset[n:]
    chunks = [
        c for c in client.completions.create(**kw, echo=True, stream=True, extra_body=FIXED)
        if c.choices
    ]  # fmt: skip
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs is not None
    assert first.logprobs.token_logprobs == lp.token_logprobs[:n]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [v for c in chunks if c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs or []]  # fmt: skip
    assert streamed == lp.token_logprobs
    # max_tokens 0: the prompt scored, nothing generated, so nothing watermarked
    raw = client.completions.with_raw_response.create(**{**kw, "max_tokens": 0}, echo=True)
    scored = raw.parse()
    only = scored.choices[0]
    assert only.text == prompt and only.finish_reason == "length"
    assert only.logprobs is not None and only.logprobs.token_logprobs == lp.token_logprobs[:n]
    assert only.logprobs.top_logprobs == lp.top_logprobs[:n]
    assert (only.model_extra or {}).get("watermark") is None
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert "x-watermark-scheme" not in raw.headers
    # replayed under its Idempotency-Key, plain and streamed: the same, still no receipt
    key = {"Idempotency-Key": f"score-{scored.id}"}
    first_call = client.completions.with_raw_response.create(
        **{**kw, "max_tokens": 0}, echo=True, extra_headers=key
    )
    again = client.completions.with_raw_response.create(
        **{**kw, "max_tokens": 0}, echo=True, extra_headers=key
    )
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.parse().choices[0].text == first_call.parse().choices[0].text == prompt
    assert "x-watermark-scheme" not in again.headers
    streamed_key = {"Idempotency-Key": f"score-stream-{scored.id}"}
    for _ in range(2):  # the second is the replay (one chunk per choice)
        replayed = [
            c for c in client.completions.create(
                **{**kw, "max_tokens": 0}, echo=True, stream=True, extra_headers=streamed_key)
            if c.choices
        ]  # fmt: skip
        assert "".join(c.choices[0].text for c in replayed) == prompt
        assert all((c.choices[0].model_extra or {}).get("watermark") is None for c in replayed)
    streamed_only = [
        c for c in client.completions.create(
            **{**kw, "max_tokens": 0}, echo=True, stream=True) if c.choices
    ]  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed_only) == prompt
    assert streamed_only[0].choices[0].logprobs is not None
    assert streamed_only[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert streamed_only[-1].choices[0].finish_reason == "length"
    for extra in ({"echo": True}, {"logprobs": 2}):  # without both it is a 400 naming it
        ask = {k: v for k, v in kw.items() if k != "logprobs"}
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**{**ask, "max_tokens": 0, **extra})
        assert err.value.param == "max_tokens" and "echo and logprobs" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # chat has no such call
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=0)
    assert err.value.param == "max_tokens"


def test_json_grammars_never_allow_a_raw_control_character(reference: Any) -> None:
    """xgrammar's JSON grammar admits some raw control characters inside strings, which
    strict parsers refuse; the constraint masks every token that holds one (compact JSON
    never needs them: a string escapes them as \\u00XX)."""
    from app.engines import grammar

    _, tokenizer = reference
    spec = grammar.GrammarSpec(
        "json_schema", {"type": "object", "properties": {"s": {"type": "string"}}}, "x"
    )
    constraint = grammar.GrammarConstraint(spec, grammar.compile_spec(tokenizer, spec))
    info = grammar.compile_spec(tokenizer, spec).tokenizer_info
    control = torch.tensor(
        [any(b < 0x20 or b == 0x7F for b in t) for t in info.decoded_vocab]
        + [False] * max(0, info.vocab_size - len(info.decoded_vocab))
    )[: info.vocab_size]
    assert bool(control.any())  # the vocabulary has such tokens
    for token in tokenizer.encode('{"s":"', add_special_tokens=False):
        constraint.accept(token)
    allowed = constraint.allowed()
    assert allowed is not None and bool(allowed.any())
    assert not bool((allowed & control).any())  # inside the string: none of them
    # the same ids are the constraint's ``banned``, which the vllm engine hands its processor
    assert constraint.banned == tuple(int(i) for i in control.nonzero().flatten())
    # a regex spec is left as the grammar says (its author may want any character)
    regex = grammar.GrammarSpec("regex", "[\\x00-\\x7f]{1,3}", "x")
    loose = grammar.GrammarConstraint(regex, grammar.compile_spec(tokenizer, regex))
    free = loose.allowed()
    assert free is not None and bool((free & control).any()) and loose.banned == ()
