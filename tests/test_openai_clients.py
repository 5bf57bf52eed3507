"""The ``/v1`` routes as clients use them: the receipt headers, ``seed``, the Responses
API, and the client libraries people reach for (the official ``openai`` SDK's
``client.responses``, LangChain's ``ChatOpenAI``, LiteLLM's ``openai/`` provider).

A real uvicorn server (``servers.LiveServer``) on a loopback port runs the app over
the tiny random-weight model; every client is pointed at it with ``base_url``, so
nothing here touches the network. Texts are decoded back with ``/decode``.
"""

from __future__ import annotations

import os

# LiteLLM fetches its model price list at import unless told to use its bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from servers import LiveServer
from test_openai_api import (
    ADMIN_TOKEN,
    BITS16,
    MESSAGES,
    MODEL,
    agree,
    decode,
    fixed_watermark_keys,
    make_settings,
    registry,
    wm,
)

from app.main import create_app

RECEIPT = ("x-watermark-message-id", "x-watermark-key-version", "x-watermark-scheme")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # context_width 2: the 40-token seeded answers decoded below were chosen at c = 2
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("oc"), context_width=2)
    with LiveServer(settings) as live:
        yield live


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def new_tenant(http: httpx.Client, seed: int) -> dict[str, str]:
    with fixed_watermark_keys(seed):
        r = http.post(
            "/admin/tenants",
            # payload bits are shown to analysts' keys only (app.services.disclosure)
            json={"name": f"oc-{uuid.uuid4().hex[:8]}", "scopes": ["fixed_payload", "provenance"]},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
    assert r.status_code == 201, r.text
    return {"id": r.json()["tenant_id"], "key": r.json()["api_key"]}


@pytest.fixture(scope="module")
def tenant(http: httpx.Client) -> dict[str, str]:
    return new_tenant(http, 2626)


@pytest.fixture(scope="module")
def client(server: LiveServer, tenant: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant["key"], max_retries=0) as c:
        yield c


def auth(tenant: dict[str, str], **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant['key']}", **extra}


def receipt_of(headers: Any) -> dict[str, str | None]:
    return {name: headers.get(name) for name in RECEIPT}


def expected_receipt(infos: list[dict[str, Any]]) -> dict[str, str | None]:
    ids = [i["message_id"] for i in infos]
    return {
        "x-watermark-message-id": None if all(m is None for m in ids) else ",".join(map(str, ids)),
        "x-watermark-key-version": ",".join(str(i["key_version"]) for i in infos),
        "x-watermark-scheme": ",".join(i["scheme"] for i in infos),
    }


# --------------------------------------------------------------------------- point 4: headers
def test_receipt_headers_chat_n2_in_choice_order(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, n=2, seed=1
    )
    out = raw.parse()
    infos = [wm(c) for c in out.choices]
    assert infos[0]["message_id"] != infos[1]["message_id"]
    got = receipt_of(raw.headers)
    assert got == expected_receipt(infos)
    ids = got["x-watermark-message-id"]
    assert ids is not None and len(ids.split(",")) == 2
    # the header's first id is the registry entry the first choice's text decodes to
    text = out.choices[0].message.content
    assert text is not None
    dec = decode(http, tenant, text, 16)
    assert dec["registry_match"]["message_id"] == int(ids.split(",")[0])


def test_receipt_headers_stream_and_completions(client: openai.OpenAI) -> None:
    """Headers come before the first chunk: the ids were allocated before generating."""
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, n=2, stream=True
    ) as raw:
        got = receipt_of(raw.headers)
        chunks = list(raw.parse())
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    infos = [wm(c) for c in sorted(finals, key=lambda c: c.index)]
    assert got == expected_receipt(infos) and got["x-watermark-message-id"] is not None

    raw_c = client.completions.with_raw_response.create(
        model=MODEL, prompt=["The tide", "A storm"], max_tokens=8
    )
    completion = raw_c.parse()
    assert receipt_of(raw_c.headers) == expected_receipt([wm(c) for c in completion.choices])


def test_receipt_headers_explicit_payload_and_replay(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=8,
        extra_body={"watermark": {"payload": {"bits": BITS16}}},
    )  # fmt: skip
    got = receipt_of(raw.headers)
    assert got["x-watermark-message-id"] is None  # an explicit payload has no registry entry
    assert got["x-watermark-key-version"] == "1" and got["x-watermark-scheme"] == "worldcup-v2"

    headers = auth(tenant, **{"Idempotency-Key": uuid.uuid4().hex})
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "n": 2}
    first = http.post("/v1/chat/completions", json=body, headers=headers)
    again = http.post("/v1/chat/completions", json=body, headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    infos = [c["watermark"] for c in first.json()["choices"]]
    assert receipt_of(first.headers) == receipt_of(again.headers) == expected_receipt(infos)
    streamed = http.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
    assert streamed.status_code == 409  # another body under the same key


# --------------------------------------------------------------------------- point 5: seed
def test_seed_with_explicit_payload_repeats_the_text(client: openai.OpenAI) -> None:
    """Same explicit payload, prompt, sampling fields and seed: the same text, also at
    temperature 0 (read as 0.01), on chat, completions and responses."""
    kw: Any = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 40, "seed": 77,
        "extra_body": {"watermark": {"payload": {"bits": BITS16}}},
    }  # fmt: skip
    texts = [client.chat.completions.create(**kw).choices[0].message.content for _ in range(2)]
    assert texts[0] and texts[0] == texts[1]
    other = client.chat.completions.create(**{**kw, "seed": 78}).choices[0].message.content
    assert other != texts[0]  # the seed is what repeats it, not chance
    cold = [
        client.chat.completions.create(**kw, temperature=0).choices[0].message.content
        for _ in range(2)
    ]
    assert cold[0] and cold[0] == cold[1]
    plain = [
        client.completions.create(
            model=MODEL, prompt="The tide", max_tokens=30, seed=5,
            extra_body={"watermark": {"payload": {"hex": "69a5", "num_bits": 16}}},
        ).choices[0].text
        for _ in range(2)
    ]  # fmt: skip
    assert plain[0] and plain[0] == plain[1]
    resp = [
        client.responses.create(
            model=MODEL, input="Write a note about tides.", max_output_tokens=30,
            extra_body={"seed": 5, "watermark": {"payload": {"bits": BITS16}}},
        ).output_text
        for _ in range(2)
    ]  # fmt: skip
    assert resp[0] and resp[0] == resp[1]


def test_seed_with_metadata_allocates_anew_so_the_text_differs(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    """What the docs say: an allocation gives every call its own message id, so its own
    payload and text, seed or not; an Idempotency-Key returns the stored answer."""
    kw: Any = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 40, "seed": 77,
        "extra_body": {"watermark": {"metadata": {"doc": "seed"}}},
    }  # fmt: skip
    a, b = (client.chat.completions.create(**kw).choices[0] for _ in range(2))
    assert wm(a)["message_id"] != wm(b)["message_id"]
    assert a.message.content != b.message.content
    for choice in (a, b):
        assert choice.message.content is not None
        dec = decode(http, tenant, choice.message.content, 16)
        assert dec["registry_match"]["message_id"] == wm(choice)["message_id"]


# --------------------------------------------------------------------------- point 6: responses
def test_responses_create_decodes_to_its_registry_entry(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Write a note about tides.", instructions="You write short notes.",
        max_output_tokens=96, user="u-26", metadata={"ticket": "26"},
    )  # fmt: skip
    resp = raw.parse()
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.model == MODEL and resp.instructions == "You write short notes."
    assert resp.metadata == {"ticket": "26"} and resp.user == "u-26"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"
    assert resp.output_text == item.content[0].text and resp.output_text
    assert resp.usage is not None and resp.usage.output_tokens == 96
    assert resp.usage.total_tokens == resp.usage.input_tokens + 96
    info = (resp.model_extra or {})["watermark"]
    assert receipt_of(raw.headers) == expected_receipt([info])
    dec = decode(http, tenant, resp.output_text, 16)
    assert dec["is_watermarked"] is True and dec["p_value"] < 1e-6
    assert agree(dec["bits"], info["payload_bits"]) >= 14
    assert dec["registry_match"]["message_id"] == info["message_id"]
    assert registry(http, tenant, info["message_id"])["metadata"] == {"user": "u-26"}

    # the instructions are a system turn: the prompt is the chat route's for these messages
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat.usage is not None and resp.usage.input_tokens == chat.usage.prompt_tokens
    # the stored response comes back from GET
    again = client.responses.with_raw_response.retrieve(resp.id)
    assert again.parse().id == resp.id and again.parse().output_text == resp.output_text
    assert receipt_of(again.headers) == receipt_of(raw.headers)


def test_responses_previous_response_id_per_tenant(
    server: LiveServer, client: openai.OpenAI, http: httpx.Client
) -> None:
    first = client.responses.create(
        model=MODEL, input="Name a sea.", instructions="Be brief.", max_output_tokens=12
    )
    assert first.usage is not None
    follow = client.responses.create(
        model=MODEL, input="And a river?", previous_response_id=first.id, max_output_tokens=4
    )
    assert follow.previous_response_id == first.id and follow.usage is not None
    # the follow-up's prompt is the whole conversation, without the first instructions
    conversation: Any = [
        {"role": "user", "content": "Name a sea."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a river?"},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=1)
    assert chat.usage is not None and follow.usage.input_tokens == chat.usage.prompt_tokens
    alone = client.responses.create(model=MODEL, input="And a river?", max_output_tokens=1)
    assert alone.usage is not None and alone.usage.input_tokens < chat.usage.prompt_tokens
    # and a third turn carries both earlier ones
    third = client.responses.create(
        model=MODEL, input="Thanks.", previous_response_id=follow.id, max_output_tokens=1
    )
    conversation += [
        {"role": "assistant", "content": follow.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    chat = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=1)
    assert third.usage is not None and chat.usage is not None
    assert third.usage.input_tokens == chat.usage.prompt_tokens

    other = new_tenant(http, 2727)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=other["key"], max_retries=0) as them:
        with pytest.raises(openai.NotFoundError) as err:
            them.responses.create(
                model=MODEL, input="Hi", previous_response_id=first.id, max_output_tokens=2
            )
        assert err.value.code == "response_not_found"
        assert err.value.param == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            them.responses.retrieve(first.id)

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_stream_events(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    kw: Any = {
        "model": MODEL, "input": [{"role": "user", "content": "Write a note about tides."}],
        "max_output_tokens": 40,
        "extra_body": {"seed": 12, "watermark": {"payload": {"bits": BITS16}}},
    }  # fmt: skip
    plain = client.responses.create(**kw)
    with client.responses.with_streaming_response.create(**kw, stream=True) as raw:
        headers = receipt_of(raw.headers)
        events = list(raw.parse())
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens reached, as OpenAI ends such a stream
    ]
    assert len(deltas) >= 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, last = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == plain.output_text  # the seeded run, streamed
    assert last.response.output_text == text and last.response.id == created.response.id
    info = (last.response.model_extra or {})["watermark"]
    assert info["payload_bits"] == BITS16 and headers == expected_receipt([info])
    assert {d.item_id for d in deltas} == {last.response.output[0].id}
    dec = decode(http, tenant, text, 16)
    assert agree(dec["bits"], BITS16) >= 14
    # a stream that ends on its own is response.completed
    done = list(client.responses.create(**{**kw, "max_output_tokens": 400}, stream=True))
    if done[-1].type == "response.completed":
        assert done[-1].response.status == "completed"
    else:  # the tiny model rarely ends a text; then it is still a well-formed end
        assert done[-1].type == "response.incomplete"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"watermark": {"enabled": False}}, "watermark.enabled"),
        ({"model": "gpt-4o"}, "model"),
    ],
)
def test_responses_unsupported_is_bad_request_naming_it(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as err:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, extra_body=extra)
    assert err.value.status_code == (404 if param == "model" else 400), err.value.body
    assert isinstance(err.value, openai.APIStatusError)
    body_param = err.value.body.get("param") if isinstance(err.value.body, dict) else None
    assert body_param is not None and body_param.startswith(param), err.value.body


def test_responses_ttl(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A stored response lives responses_ttl_s, then previous_response_id is not found."""
    settings = make_settings(tiny_model_dir, tmp_path, responses_ttl_s=1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as tc:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        created = tc.post("/admin/tenants", json={"name": "ttl"}, headers=admin)
        assert created.status_code == 201, created.text
        sdk = openai.OpenAI(
            base_url="http://testserver/v1", api_key=created.json()["api_key"],
            http_client=tc, max_retries=0,
        )  # fmt: skip
        first = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        sdk.responses.create(
            model=MODEL, input="Again", previous_response_id=first.id, max_output_tokens=2
        )
        time.sleep(1.3)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(
                model=MODEL, input="Again", previous_response_id=first.id, max_output_tokens=2
            )


# --------------------------------------------------------------------------- LangChain
def chat_model(server: LiveServer, tenant: dict[str, str], **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key=tenant["key"],  # type: ignore[arg-type]
        max_retries=0, include_response_headers=True, **kw,
    )  # fmt: skip


def lc_receipt(metadata: dict[str, Any]) -> dict[str, str | None]:
    headers = {k.lower(): v for k, v in metadata["headers"].items()}
    return {name: headers.get(name) for name in RECEIPT}


def test_langchain_chat_headers_in_response_metadata(
    server: LiveServer, http: httpx.Client, tenant: dict[str, str]
) -> None:
    """LangChain drops choices[i].watermark, but keeps the headers: the receipt."""
    llm = chat_model(server, tenant, max_tokens=64, seed=4)
    reply = llm.invoke([("system", "You write short notes."), ("human", "Write about tides.")])
    assert isinstance(reply.content, str) and reply.content
    assert "watermark" not in reply.response_metadata  # why the headers are needed
    got = lc_receipt(reply.response_metadata)
    message_id = got["x-watermark-message-id"]
    assert message_id is not None and got["x-watermark-scheme"] == "worldcup-v2"
    dec = decode(http, tenant, reply.content, 16)
    assert dec["registry_match"]["message_id"] == int(message_id)
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] == 64

    chunks = list(llm.stream("Write about tides."))
    text = "".join(str(c.content) for c in chunks)
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    streamed = lc_receipt(merged.response_metadata)
    assert streamed["x-watermark-message-id"] is not None
    dec = decode(http, tenant, text, 16)
    assert dec["registry_match"]["message_id"] == int(streamed["x-watermark-message-id"])


def test_langchain_responses_api(
    server: LiveServer, http: httpx.Client, tenant: dict[str, str]
) -> None:
    # seeded (our extension, in the body): the same texts on every run
    llm = chat_model(server, tenant, max_tokens=64, use_responses_api=True, extra_body={"seed": 6})
    reply = llm.invoke([("system", "You write short notes."), ("human", "Write about tides.")])
    assert reply.response_metadata["id"].startswith("resp_")
    assert reply.text and reply.usage_metadata is not None
    got = lc_receipt(reply.response_metadata)
    assert got["x-watermark-message-id"] is not None
    dec = decode(http, tenant, reply.text, 16)
    assert dec["registry_match"]["message_id"] == int(got["x-watermark-message-id"])
    # a second turn through LangChain's history (the assistant turn sent back as input)
    follow = llm.invoke([("human", "Write about tides."), reply, ("human", "And rivers?")])
    assert follow.text and follow.response_metadata["id"] != reply.response_metadata["id"]
    # and through previous_response_id
    chained = chat_model(server, tenant, max_tokens=8, use_responses_api=True,
                         use_previous_response_id=True)  # fmt: skip
    turn = chained.invoke([("human", "Write about tides."), reply, ("human", "And rivers?")])
    assert turn.text
    stored = http.get(f"/v1/responses/{turn.response_metadata['id']}", headers=auth(tenant)).json()
    assert stored["previous_response_id"] == reply.response_metadata["id"]

    chunks = list(llm.stream("Write about tides."))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.text and merged.response_metadata["id"].startswith("resp_")
    streamed = lc_receipt(merged.response_metadata)["x-watermark-message-id"]
    assert streamed is not None
    dec = decode(http, tenant, merged.text, 16)
    assert dec["registry_match"]["message_id"] == int(streamed)


# --------------------------------------------------------------------------- LiteLLM
def test_litellm_openai_provider(
    server: LiveServer, http: httpx.Client, tenant: dict[str, str]
) -> None:
    import litellm

    common: Any = {
        "model": f"openai/{MODEL}", "api_base": f"{server.url}/v1", "api_key": tenant["key"],
        "max_retries": 0,
    }  # fmt: skip
    out = litellm.completion(messages=MESSAGES, max_tokens=64, seed=2, **common)
    text = out.choices[0].message.content
    assert text
    hidden = out._hidden_params["additional_headers"]
    message_id = hidden["llm_provider-x-watermark-message-id"]
    assert hidden["llm_provider-x-watermark-scheme"] == "worldcup-v2"
    dec = decode(http, tenant, text, 16)
    assert dec["registry_match"]["message_id"] == int(message_id)
    assert out.usage.completion_tokens == 64

    stream = litellm.completion(messages=MESSAGES, max_tokens=16, stream=True, **common)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    assert streamed


# --------------------------------------------------------------------------- structure, tools
SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["tide", "storm", "wave"]}},
    "required": ["ok", "kind"],
    "additionalProperties": False,
}
NOTES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    # free text enough to carry 16 bits: with 4-16 characters the tiny
                    # model's JSON (~110 tokens) decoded to its entry in 4 of 8 seeds,
                    # with 40-80 in 8 of 8 (p 1e-13 .. 2e-4)
                    "title": {"type": "string", "minLength": 40, "maxLength": 80},
                    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                    "kind": {"enum": ["tide", "storm", "wave"]},
                },
                "required": ["title", "priority", "kind"],
                "additionalProperties": False,
            },
            "minItems": 4,
            "maxItems": 4,
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
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
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


def weather_args(arguments: str) -> dict[str, Any]:
    import jsonschema

    value: dict[str, Any] = json.loads(arguments)
    jsonschema.validate(value, WEATHER["parameters"])
    return value


def test_responses_json_schema_validates_and_decodes(
    server: LiveServer, http: httpx.Client
) -> None:
    """A fresh tenant with seeded keys and a seeded request: the same text every run.
    (Over 16 seeds, this schema's ~150-token answers decoded to their registry entry in
    14; xgrammar's JSON strings admit raw control characters, and one seed of 16 drew
    one, which is not JSON: both are what a near-uniform model makes of a grammar.)"""
    import jsonschema

    tenant = new_tenant(http, 2828)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant["key"], max_retries=0) as c:
        resp = c.responses.create(
            model=MODEL, input="Four notes about the sea, as JSON.", max_output_tokens=400,
            text={"format": {"type": "json_schema", "name": "notes", "schema": NOTES_SCHEMA,
                             "strict": True}},
            extra_body={"seed": 11, "watermark": {"metadata": {"app": "responses-json"}}},
        )  # fmt: skip
        small = c.responses.create(
            model=MODEL, input="Is the sea calm?", max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "calm", "schema": SMALL_SCHEMA}},
            stream=True,
        )  # fmt: skip
        events = list(small)
    assert resp.status == "completed", resp.incomplete_details
    assert resp.text is not None and resp.text.format is not None
    assert resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(resp.output_text), NOTES_SCHEMA)
    info = (resp.model_extra or {})["watermark"]
    dec = decode(http, tenant, resp.output_text, 16)
    assert dec["registry_match"]["message_id"] == info["message_id"], (dec, info)
    assert registry(http, tenant, info["message_id"])["metadata"] == {"app": "responses-json"}
    assert events[-1].type == "response.completed"
    jsonschema.validate(json.loads(events[-1].response.output_text), SMALL_SCHEMA)


def test_responses_forced_function_call_stream_and_not(client: openai.OpenAI) -> None:
    kw: Any = {
        "model": MODEL, "input": "What is the weather in Paris?", "max_output_tokens": 60,
        "tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "name": "get_weather"},
    }  # fmt: skip
    resp = client.responses.create(**kw)
    assert resp.status == "completed"
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    weather_args(call.arguments)
    assert call.call_id and resp.tools[0].type == "function"

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments and done.name == "get_weather"
    weather_args(done.arguments)
    final = events[-1].response.output[0]
    assert final.type == "function_call" and final.arguments == done.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))

    required = client.responses.create(**{**kw, "tool_choice": "required"})
    (call,) = required.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    json.loads(call.arguments)

    # the call's output sent back: the next turn is a message (tool_choice none)
    answer = client.responses.create(
        model=MODEL, max_output_tokens=8, tools=[WEATHER], tool_choice="none",
        previous_response_id=resp.id,
        input=[{"type": "function_call_output", "call_id": resp.output[0].call_id,
                "output": '{"sky": "clear"}'}],
    )  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text


def test_langchain_structured_output_and_tools(server: LiveServer, tenant: dict[str, str]) -> None:
    from pydantic import BaseModel, Field

    class Calm(BaseModel):
        """Whether the sea is calm."""

        ok: bool
        kind: str = Field(json_schema_extra={"enum": ["tide", "storm", "wave"]})

    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["celsius", "kelvin"]) -> str:
        """The weather in a city."""  # enums: the tiny model fills a free string to the limit
        return "clear"

    for responses_api in (False, True):
        llm = chat_model(server, tenant, max_tokens=200, use_responses_api=responses_api)
        for method in ("json_schema", "function_calling"):
            structured = llm.with_structured_output(Calm, method=method, include_raw=True)
            out = structured.invoke("Is the sea calm?")
            calm = out["parsed"]
            assert isinstance(calm, Calm), (responses_api, method, out)
            assert calm.kind in ("tide", "storm", "wave")
        bound = llm.bind_tools([get_weather], tool_choice="get_weather")
        reply = bound.invoke("What is the weather in Paris?")
        assert len(reply.tool_calls) == 1, (responses_api, reply)
        (call,) = reply.tool_calls
        assert call["name"] == "get_weather" and set(call["args"]) >= {"city", "unit"}
        assert call["id"]


def test_litellm_tools(server: LiveServer, tenant: dict[str, str]) -> None:
    import litellm

    tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    out = litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key=tenant["key"],
        max_retries=0, max_tokens=60,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    weather_args(call.function.arguments)
    assert out.choices[0].finish_reason == "tool_calls"


def test_responses_disconnect_mid_stream_cancels_generation(
    server: LiveServer, client: openai.OpenAI
) -> None:
    runtime = server.app.state.runtime
    counter = runtime.metrics.generated_tokens
    before = counter._value.get()
    stream = client.responses.create(
        model=MODEL, input="Write a long note.", max_output_tokens=2000, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 6:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while runtime.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.engine.in_flight == 0, "the generation kept running after the disconnect"
    made = counter._value.get() - before
    time.sleep(0.3)
    assert counter._value.get() - before == made and made < 2000, made
