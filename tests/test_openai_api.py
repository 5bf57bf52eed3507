"""The OpenAI-compatible routes, driven by the official ``openai`` SDK over real HTTP.

A real uvicorn server (``servers.LiveServer``) runs the app over the tiny
random-weight model (near-uniform next tokens: a short text carries the
watermark strongly), so the SDK's own transport, SSE parser, error mapping and
stream closing are what is tested. Every generated text is decoded back with
``/decode`` against the payload the response reported.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from servers import LiveServer, free_port

import app.services.tenants as tenants_module
from app.core.config import Settings
from app.main import create_app

ADMIN_TOKEN = "openai-admin-token-0123456789"
MASTER_KEY = "ef" * 32
MODEL = "tiny-worldcup"
BITS16 = "0110100110010110"


def make_settings(model_dir: Path, db_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "env": "prod",
        "port": free_port(),
        "model_path": str(model_dir),
        "served_model_name": MODEL,
        "master_key": MASTER_KEY,
        "master_key_file": None,
        "admin_token": ADMIN_TOKEN,
        "admin_token_file": None,
        "redis_url": None,
        "sqlite_path": db_dir / "db.sqlite3",
        "device": "cpu",
        "log_level": "WARNING",
        "max_prompt_tokens": 256,
        "max_new_tokens_limit": 2048,
        "default_num_bits": 16,
        "request_timeout_s": 60.0,
        "drain_timeout_s": 2.0,
        "fixed_payload_repeats": 100_000,  # the cap: tests/test_fixed_payload.py
        # chosen payloads pin a text here (same seed and payload, same text: the
        # determinism checks); sealed ones, the default: tests/test_fixed_payload.py
        "seal_client_payloads": False,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(make_settings(tiny_model_dir, tmp_path_factory.mktemp("oa"))) as live:
        yield live


@contextmanager
def fixed_watermark_keys(seed: int) -> Iterator[None]:
    """Seeded tenant keys: with the seeded model and a request seed, every text (and
    so every statistical assertion on it) is the same on every run."""
    rng = random.Random(seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tenants_module, "secrets", SimpleNamespace(token_bytes=rng.randbytes))
        yield


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tenant(http: httpx.Client) -> dict[str, str]:
    with fixed_watermark_keys(4242):
        r = http.post(
            "/admin/tenants",
            # payload bits are shown to analysts' keys only (app.services.disclosure)
            json={"name": f"oa-{uuid.uuid4().hex[:8]}", "scopes": ["fixed_payload", "provenance"]},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
    assert r.status_code == 201, r.text
    return {"id": r.json()["tenant_id"], "key": r.json()["api_key"]}


@pytest.fixture(scope="module")
def client(server: LiveServer, tenant: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant["key"], max_retries=0) as c:
        yield c


def decode(http: httpx.Client, tenant: dict[str, str], text: str, num_bits: int) -> Any:
    r = http.post(
        "/decode",
        json={"text": text, "num_bits": num_bits},
        headers={"Authorization": f"Bearer {tenant['key']}"},
    )
    assert r.status_code == 200, r.text
    return r.json()


def registry(http: httpx.Client, tenant: dict[str, str], message_id: int) -> Any:
    r = http.get(
        f"/admin/tenants/{tenant['id']}/registry/{message_id}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return r.json()


def agree(a: str, b: str) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def wm(choice: Any) -> dict[str, Any]:
    """The ``watermark`` extension field of a choice (an extra field to the SDK)."""
    extra = choice.model_extra or {}
    assert "watermark" in extra, choice
    info: dict[str, Any] = extra["watermark"]
    return info


MESSAGES: Any = [
    {"role": "system", "content": "You write short notes."},
    {"role": "user", "content": "Write a note about tides."},
]


# --------------------------------------------------------------------------- models
def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


# --------------------------------------------------------------------------- chat
def test_chat_default_allocation_decodes_to_its_registry_entry(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    """No watermark object: the tenant default, a metadata allocation recording `user`."""
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=96, seed=3, user="u-17"
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model == MODEL and out.system_fingerprint and out.created > 0
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    info = wm(choice)
    assert info["scheme"] == "worldcup-v2" and info["num_bits"] == 16 and info["key_version"] == 1
    assert int(info["payload_hex"], 16) == int(info["payload_bits"], 2)
    assert out.usage is not None and out.usage.completion_tokens == 96
    assert out.usage.total_tokens == out.usage.prompt_tokens + 96
    assert out.usage.prompt_tokens > 10  # the chat template (with the system turn) was applied

    dec = decode(http, tenant, choice.message.content, 16)
    assert dec["is_watermarked"] is True and dec["p_value"] < 1e-6
    assert agree(dec["bits"], info["payload_bits"]) >= 14, (dec["bits"], info)
    assert dec["registry_match"]["message_id"] == info["message_id"]
    assert dec["registry_match"]["metadata"] == {"user": "u-17"}
    assert registry(http, tenant, info["message_id"])["metadata"] == {"user": "u-17"}


def test_chat_n2_with_metadata_each_choice_its_own_sample(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=96,
        n=2,
        seed=5,
        extra_body={"watermark": {"metadata": {"campaign": "spring"}, "num_bits": 16}},
    )
    assert [c.index for c in out.choices] == [0, 1]
    infos = [wm(c) for c in out.choices]
    assert infos[0]["message_id"] != infos[1]["message_id"]
    assert out.choices[0].message.content != out.choices[1].message.content
    assert out.usage is not None and out.usage.completion_tokens == 2 * 96
    for choice, info in zip(out.choices, infos, strict=True):
        assert choice.message.content is not None
        dec = decode(http, tenant, choice.message.content, 16)
        assert dec["registry_match"]["message_id"] == info["message_id"], (dec, info)
        entry = registry(http, tenant, info["message_id"])
        assert entry["metadata"] == {"campaign": "spring"}


def test_chat_explicit_payload_stream_equals_text(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    """Streamed deltas add up to the text the same (seeded) request returns unstreamed."""
    kw: Any = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_completion_tokens": 80,
        "seed": 9,
        "extra_body": {"watermark": {"payload": {"bits": BITS16}, "top_k": 20}},
    }
    plain = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert all(c.choices[0].finish_reason is None for c in middle)
    assert finish.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == 80
    info = wm(finish.choices[0])
    assert info["payload_bits"] == BITS16 and info["message_id"] is None
    assert all("watermark" not in (c.choices[0].model_extra or {}) or
               c.choices[0].model_extra["watermark"] is None for c in [first, *middle])  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert wm(plain.choices[0]) == info
    dec = decode(http, tenant, text, 16)
    assert agree(dec["bits"], BITS16) >= 14 and dec["is_watermarked"] is True


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    kw: Any = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "seed": 21}
    full = client.chat.completions.create(
        **kw, extra_body={"watermark": {"payload": {"bits": BITS16}}}
    )
    text = full.choices[0].message.content
    assert text is not None and len(text) > 20
    stop = text[10:14]
    cut = client.chat.completions.create(
        **kw, stop=[stop], extra_body={"watermark": {"payload": {"bits": BITS16}}}
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        **kw, stop=stop, stream=True, extra_body={"watermark": {"payload": {"bits": BITS16}}}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


# --------------------------------------------------------------------------- completions
def test_completions_list_prompt(
    client: openai.OpenAI, http: httpx.Client, tenant: dict[str, str]
) -> None:
    out = client.completions.create(
        model=MODEL, prompt=["The tide", "A storm"], max_tokens=96, seed=4
    )
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        info = wm(choice)
        dec = decode(http, tenant, choice.text, 16)
        assert dec["registry_match"]["message_id"] == info["message_id"]
        assert dec["registry_match"]["metadata"] == {}
    stream = client.completions.create(model=MODEL, prompt="The tide", max_tokens=8, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "watermark" in (chunks[-1].choices[0].model_extra or {})


# --------------------------------------------------------------------------- async
@pytest.mark.anyio
async def test_async_client(server: LiveServer, tenant: dict[str, str]) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=tenant["key"], max_retries=0
    ) as aclient:
        replies = await asyncio.gather(
            *(
                aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
                for _ in range(3)
            )
        )
        ids = {wm(r.choices[0])["message_id"] for r in replies}
        assert len(ids) == 3  # three allocations
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream=True
        )
        chunks = [c async for c in stream]
        assert chunks[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- errors
def test_wrong_key_is_authentication_error(server: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wc_wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    body = err.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert "wc_wrong" not in str(body)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"max_tokens": "5"}, "max_tokens"),  # strict: no string-to-int coercion
        ({"max_tokens": 5000}, "max_tokens"),  # above the server limit
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),  # (above max_tokens it is capped, as on /generate)
        ({"temperature": 3}, "temperature"),
        ({"watermark": {"enabled": False}}, "watermark.enabled"),
        ({"watermark": {"payload": {"bits": "012"}}}, "watermark.payload"),
        ({"watermark": {"metadata": {"a": 1}, "payload": {"bits": "1"}}}, "watermark"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stop": ""}, "stop"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_bad_field_is_bad_request_naming_it(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:  # extra_body: the SDK checks nothing
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra
        )
    assert err.value.status_code == 400
    assert err.value.param is not None and err.value.param.startswith(param), err.value.body
    assert param.split(".")[0] in err.value.message


def test_completion_choices_are_bounded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["Tides"] * 9, n=2, max_tokens=2)
    assert err.value.param == "n" and "16" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Tides", suffix="!", max_tokens=2)
    assert err.value.param == "suffix"


def test_ignored_fields_and_no_op_values_are_accepted(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi"},
        ],  # fmt: skip
        max_tokens=4,
        logprobs=False,
        presence_penalty=0,
        temperature=0,
        extra_body={"some_gateway_field": {"x": 1}, "top_k": 3},
    )
    assert out.choices[0].finish_reason in ("length", "stop")


def test_key_without_generate_scope_is_permission_denied(
    server: LiveServer, http: httpx.Client, tenant: dict[str, str]
) -> None:
    r = http.post(
        f"/admin/tenants/{tenant['id']}/api-keys",
        json={"name": "detector", "scopes": ["detect"]},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert r.status_code == 201, r.text
    key = r.json()["api_key"]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0) as detect_only:
        with pytest.raises(openai.PermissionDeniedError) as err:
            detect_only.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert err.value.code == "missing_scope" and "generate" in err.value.message
    assert key not in str(err.value.body)


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_full_queue_is_rate_limit_error(server: LiveServer, client: openai.OpenAI) -> None:
    batcher = server.app.state.runtime.engine
    old = batcher.max_queue
    batcher.max_queue = 0  # every slot of the waiting queue is taken
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    finally:
        batcher.max_queue = old
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.code == "queue_full"


# --------------------------------------------------------------------------- idempotency
def test_idempotency_key_replays(http: httpx.Client, tenant: dict[str, str]) -> None:
    headers = {"Authorization": f"Bearer {tenant['key']}", "Idempotency-Key": uuid.uuid4().hex}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6}
    first = http.post("/v1/chat/completions", json=body, headers=headers)
    again = http.post("/v1/chat/completions", json=body, headers=headers)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()  # same id, text and message id: nothing re-allocated
    other = http.post("/v1/chat/completions", json={**body, "max_tokens": 7}, headers=headers)
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"


# --------------------------------------------------------------------------- disconnect
def test_disconnect_mid_stream_cancels_generation(
    server: LiveServer, client: openai.OpenAI
) -> None:
    runtime = server.app.state.runtime
    counter = runtime.metrics.generated_tokens
    before = counter._value.get()
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while runtime.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.engine.in_flight == 0, "the generation kept running after the disconnect"
    made = counter._value.get() - before
    time.sleep(0.3)
    assert counter._value.get() - before == made  # nothing more was generated
    assert made < 2000, made


# --------------------------------------------------------------------------- rate limit
def test_rate_limit_charges_one_token_per_sample(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The tenant's token bucket of /generate; a request costs one token per choice."""
    settings = make_settings(tiny_model_dir, tmp_path, rate_limit_per_s=0.01, rate_limit_burst=3)
    with TestClient(create_app(settings), raise_server_exceptions=False) as tc:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        created = tc.post("/admin/tenants", json={"name": "limited"}, headers=admin)
        assert created.status_code == 201, created.text
        # the SDK over the in-process app (TestClient is an httpx.Client)
        sdk = openai.OpenAI(
            base_url="http://testserver/v1",
            api_key=created.json()["api_key"],
            http_client=tc,
            max_retries=0,
        )
        out = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=2)
        assert len(out.choices) == 2  # two tokens of three
        assert [m.id for m in sdk.models.list().data] == [MODEL]  # the third
        with pytest.raises(openai.RateLimitError) as err:
            sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert err.value.code == "rate_limited"
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_disconnect_without_stream_cancels_generation(
    server: LiveServer, tenant: dict[str, str]
) -> None:
    runtime = server.app.state.runtime
    counter = runtime.metrics.generated_tokens
    before = counter._value.get()
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=tenant["key"], max_retries=0, timeout=0.5
    ) as impatient:
        with pytest.raises(openai.APITimeoutError):  # the client gives up and hangs up
            # min_tokens: no end-of-sequence before 2 000 tokens, so the answer cannot end
            # before the client's 0.5 s however fast the CPU (it did on an idle AMX host)
            impatient.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=2000,
                extra_body={"min_tokens": 2000},
            )
    deadline = time.monotonic() + 10
    while runtime.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.engine.in_flight == 0, "the generation kept running after the disconnect"
    assert counter._value.get() - before < 2000


def test_idempotent_stream_replays_as_chunks(http: httpx.Client, tenant: dict[str, str]) -> None:
    headers = {"Authorization": f"Bearer {tenant['key']}", "Idempotency-Key": uuid.uuid4().hex}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "n": 2, "stream": True}

    def texts(r: httpx.Response) -> tuple[list[str], dict[int, Any]]:
        # each choice's text and receipt by its index: choices stream side by side,
        # so which one closes first varies from run to run; the replay goes in order
        assert r.status_code == 200, r.text
        events = [line.removeprefix("data: ") for line in r.text.split("\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        out = ["", ""]
        marks: dict[int, Any] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                out[choice["index"]] += choice["delta"].get("content") or ""
                if choice.get("watermark"):
                    assert choice["index"] not in marks, "a choice sent two receipts"
                    marks[choice["index"]] = choice["watermark"]
        return out, marks

    first = http.post("/v1/chat/completions", json=body, headers=headers)
    again = http.post("/v1/chat/completions", json=body, headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert texts(again) == texts(first)
    assert len({m["message_id"] for m in texts(first)[1].values()}) == 2
