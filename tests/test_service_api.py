"""Fast API tests of the service over a tiny random-weight model (seconds, not minutes).

The model is a 2-layer random Llama over the real SmolLM2 tokenizer
(``tiny_random_model``): its next-token distributions are close to uniform, so
the watermark is strong and a short text decodes reliably, while every
request runs through the real app — lifespan, batcher, SQLite store,
middlewares, error handlers — via ``TestClient``. Settings are passed
explicitly; nothing is read from the environment or a ``.env`` file.

Every error answer must be the envelope ``{"error": {"message", "type",
"code"}}``, and no request may ever produce a 500.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from servers import SERVICE_METRICS

import app.services.tenants as tenants_module
from app.core.config import Settings
from app.engines.base import GenerationJob
from app.main import create_app
from worldcup_core.generation import GenerationResult, StepEvent

ADMIN_TOKEN = "test-admin-token-0123456789"
MASTER_KEY = "ab" * 32
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PAYLOAD16 = "0110100110010110"

# every tenant id and API key this module creates: none may appear in a metric label
SECRETS_SEEN: set[str] = set()


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def make_settings(model_dir: Path, db_dir: Path, **overrides: Any) -> Settings:
    """Everything explicit: no ``.env``, and secrets/redis pinned so env vars cannot leak in."""
    values: dict[str, Any] = {
        "env": "prod",
        "model_path": str(model_dir),
        "master_key": MASTER_KEY,
        "master_key_file": None,
        "admin_token": ADMIN_TOKEN,
        "admin_token_file": None,
        "redis_url": None,
        "sqlite_path": db_dir / "db.sqlite3",
        "device": "cpu",
        "log_level": "WARNING",
        "max_text_chars": 2000,
        "max_prompt_tokens": 64,
        "max_body_bytes": 64 * 1024,
        "max_new_tokens_limit": 256,
        "request_timeout_s": 60.0,
        "drain_timeout_s": 2.0,
        # tests not about the cap reuse one payload freely (tests/test_fixed_payload.py)
        "fixed_payload_repeats": 100_000,
        # ... and ask about one text on every route, each with its p-value (the limit's
        # tests, tests/test_exposure.py and test_collection_service.py, set the default)
        "probe_full_answers": 0,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture(scope="module")
def app(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    return create_app(make_settings(model_dir, tmp_path_factory.mktemp("db")))


@pytest.fixture(scope="module")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def tenant(client: TestClient) -> tuple[str, dict[str, str]]:
    """A shared tenant for tests that do not count message ids (fixed watermark key)."""
    with fixed_watermark_keys(1234):
        return new_tenant(client, scopes=ANALYST)


STORE_TEST_REDIS_URL = "redis://127.0.0.1:6379/15"  # tests' own DB, each under its own prefix


@contextmanager
def store_client(
    store: str, model_dir: Path, db_dir: Path, label: str, **overrides: Any
) -> Iterator[TestClient]:
    """An app over ``store`` ("sqlite", or "redis" under a fresh ``label`` prefix that is
    deleted after), as a TestClient."""
    import secrets

    import redis

    prefix = None
    if store == "redis":
        prefix = f"{label}{secrets.token_hex(6)}"
        overrides |= {"redis_url": STORE_TEST_REDIS_URL, "redis_prefix": prefix}
    app = create_app(make_settings(model_dir, db_dir, **overrides))
    try:
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c
    finally:
        if prefix is not None:
            r = redis.Redis.from_url(STORE_TEST_REDIS_URL)
            keys = list(r.scan_iter(f"{prefix}*"))
            if keys:
                r.delete(*keys)
            r.close()


# --------------------------------------------------------------------------- helpers
@contextmanager
def fixed_watermark_keys(seed: int) -> Iterator[None]:
    """Tenant watermark keys from a seeded generator instead of ``secrets``.

    With the seeded tiny model and a request ``seed`` the generated text, and so
    every statistical assertion on it, is then the same on every run: a test
    that needs "decodes back" or "is not watermarked" cannot flake at the
    1 % false-positive rate of a random key.
    """
    rng = random.Random(seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tenants_module, "secrets", SimpleNamespace(token_bytes=rng.randbytes))
        yield


@contextmanager
def unsealed(app: Any) -> Iterator[None]:
    """Client-chosen payloads carried by the texts themselves, as before sealing (and as
    ``WORLDCUP_SEAL_CLIENT_PAYLOADS=false``): same seed and payload, same text. For
    tests of the engine's determinism, or that need a text to carry given bits."""
    settings = app.state.runtime.settings
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "seal_client_payloads", False)
        yield


# a tenant whose primary key sees payload bits (an analyst's: app.services.disclosure),
# for tests that compare decoded or issued bits
ANALYST = ("fixed_payload", "provenance")


def new_tenant(
    client: TestClient, name: str | None = None, scopes: tuple[str, ...] = ("fixed_payload",)
) -> tuple[str, dict[str, str]]:
    """A tenant (granted client-chosen payloads unless ``scopes`` says otherwise)."""
    body = {"name": name or f"t-{uuid.uuid4().hex[:12]}", "scopes": list(scopes)}
    r = client.post("/admin/tenants", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    body = r.json()
    SECRETS_SEEN.update((body["tenant_id"], body["api_key"]))
    return body["tenant_id"], {"Authorization": f"Bearer {body['api_key']}"}


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, str]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "code"}, err
    assert all(isinstance(v, str) and v for v in err.values()), err
    if code is not None:
        assert err["code"] == code, err
    return err


def gen_body(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": "Write about tides.", "max_new_tokens": 4}
    if "metadata" not in kw:
        body["payload"] = {"bits": PAYLOAD16}
    body.update(kw)
    return body


def raw_json(content: bytes | Any, auth: dict[str, str]) -> dict[str, Any]:
    return {"content": content, "headers": {**auth, "Content-Type": "application/json"}}


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) per SSE block."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        events.append((name, "\n".join(data)))
    return events


def bits_agree(a: str, b: str) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def metrics_text(client: TestClient) -> str:
    r = client.get("/metrics")
    assert r.status_code == 200
    return r.text


def metric_value(text: str, sample_name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# --------------------------------------------------------------------------- 1. admin
def test_the_admin_token_on_a_tenant_route_says_what_it_is(
    client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    """The admin token is not an API key: a tenant route says so, instead of the 401 a
    wrong key gets; the admin token itself never appears in the answer."""
    for route, body in (("/detect", {"text": "x"}), ("/generate", gen_body())):
        r = client.post(route, json=body, headers=ADMIN)
        err = assert_error(r, 401, "invalid_api_key")
        assert "admin token, not an API key" in err["message"] and ADMIN_TOKEN not in r.text
        wrong = client.post(route, json=body, headers={"Authorization": "Bearer wc_wrong"})
        assert assert_error(wrong, 401, "invalid_api_key")["message"] == (
            "invalid or revoked API key"
        )
    r = client.post("/v1/completions", json={"model": "m", "prompt": "a"}, headers=ADMIN)
    assert r.status_code == 401 and "admin token" in r.json()["error"]["message"]


def test_a_body_that_is_not_json_gets_told_how_to_send_it(
    client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    """``curl -d`` sends a form, and a body without a content type is not read as JSON:
    the answer says to send JSON with its content type (not pydantic's "a valid
    dictionary or object")."""
    _, auth = tenant
    for content_type in ("application/x-www-form-urlencoded", "text/plain; charset=utf-8", None):
        headers = {**auth, "Content-Type": content_type} if content_type else auth
        r = client.post("/detect", content=b'{"text": "x"}', headers=headers)
        err = assert_error(r, 422, "invalid_request")
        assert "Content-Type: application/json" in err["message"], err
        assert (content_type or "no Content-Type").split(";")[0] in err["message"]
    r = client.post("/v1/completions", content=b"{}", headers=auth)
    assert r.status_code == 400 and "Content-Type" in r.json()["error"]["message"]
    r = client.post("/detect", content=b"[1]", headers={**auth, "Content-Type": "application/json"})
    assert "Content-Type" not in assert_error(r, 422, "invalid_request")["message"]


def test_admin_tenants_keys_and_registry(client: TestClient) -> None:
    name = f"acme-{uuid.uuid4().hex[:8]}"
    r = client.post(
        "/admin/tenants", json={"name": name, "scopes": ["fixed_payload"]}, headers=ADMIN
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["name"] == name and body["key_version"] == 1
    assert body["api_key"].startswith("wc_") and len(body["api_key"]) > 30
    tenant_id, key = body["tenant_id"], body["api_key"]
    SECRETS_SEEN.update((tenant_id, key))
    tenant_auth = {"Authorization": f"Bearer {key}"}

    assert_error(
        client.post("/admin/tenants", json={"name": name}, headers=ADMIN), 409, "tenant_exists"
    )

    for headers in ({}, {"Authorization": "Bearer not-the-admin-token"}, tenant_auth):
        r = client.post("/admin/tenants", json={"name": "other"}, headers=headers)
        assert_error(r, 401, "invalid_admin_token")
        assert r.headers["WWW-Authenticate"] == "Bearer"
        r = client.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=headers)
        assert_error(r, 401, "invalid_admin_token")
        assert_error(client.get(f"/admin/tenants/{tenant_id}/registry/1", headers=headers), 401)

    r = client.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"tenant_id": tenant_id, "key_version": 2}
    r = client.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN)
    assert r.json()["key_version"] == 3
    # the API key survives rotation; new text uses the newest version
    r = client.post("/generate", json=gen_body(), headers=tenant_auth)
    assert r.status_code == 200 and r.json()["key_version"] == 3

    assert_error(
        client.post(f"/admin/tenants/{'0' * 32}/rotate-key", headers=ADMIN), 404, "unknown_tenant"
    )
    assert_error(
        client.get(f"/admin/tenants/{tenant_id}/registry/12345", headers=ADMIN),
        404,
        "unknown_message",
    )
    assert_error(client.get(f"/admin/tenants/{'f' * 32}/registry/1", headers=ADMIN), 404)
    for bad in ("not-a-tenant", "A" * 32, "0" * 31, "0" * 33):
        err = assert_error(client.post(f"/admin/tenants/{bad}/rotate-key", headers=ADMIN), 422)
        assert "tenant_id" in err["message"]
        assert_error(client.get(f"/admin/tenants/{bad}/registry/1", headers=ADMIN), 422)
    assert_error(client.get(f"/admin/tenants/{tenant_id}/registry/0", headers=ADMIN), 422)
    assert_error(client.get(f"/admin/tenants/{tenant_id}/registry/x", headers=ADMIN), 422)
    assert_error(client.post("/admin/tenants", json={"name": ""}, headers=ADMIN), 422)
    assert_error(client.post("/admin/tenants", json={"name": "a", "x": 1}, headers=ADMIN), 422)


# --------------------------------------------------------------------------- 2. auth
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "wc_justthekey"},
        {"Authorization": "Bearer wc_not-a-real-key"},
        {"Authorization": f"Bearer {ADMIN_TOKEN}"},  # the admin token is not a tenant key
        {"Authorization": b"Bearer \xc3\xa9\xff"},  # not ASCII, not UTF-8
    ],
    ids=[
        "none",
        "empty",
        "bearer-only",
        "bearer-space",
        "basic",
        "no-scheme",
        "wrong",
        "admin",
        "bytes",
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/decode", "/detect"])
def test_tenant_endpoints_need_a_valid_bearer_key(
    client: TestClient, path: str, headers: dict[str, Any]
) -> None:
    body = gen_body() if path == "/generate" else {"text": "hello world"}
    r = client.post(path, json=body, headers=headers)
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["WWW-Authenticate"] == "Bearer"


# --------------------------------------------------------------------------- 3. bad input
DEEP = b"[" * 10_000 + b"]" * 10_000

BAD_JSON_CASES: list[tuple[str, Any, int, str | None, str]] = [
    # (path, body dict or raw bytes, status, code, substring of the message)
    ("/generate", b'{"prompt": "hi",', 400, "invalid_json", "at line 1, column 17 (character 16)"),
    ("/decode", b"{text: 'x'}", 400, "invalid_json", "at line 1, column 2 (character 1)"),
    ("/detect", b"", 422, None, ""),
    ("/detect", b"null", 422, None, ""),
    ("/detect", b"[1, 2]", 422, None, ""),
    ("/decode", {"text": 5}, 422, "invalid_request", "text"),
    ("/decode", {"text": "x", "num_bits": "sixteen"}, 422, "invalid_request", "num_bits"),
    ("/decode", {"text": "x", "num_bits": 0}, 422, "invalid_request", "num_bits"),
    ("/decode", {"text": "x", "num_bits": 65}, 422, "invalid_request", "num_bits"),
    ("/decode", {"text": "x", "key_version": 0}, 422, "invalid_request", "key_version"),
    ("/decode", {"text": "x", "extra": 1}, 422, "invalid_request", "extra: unknown field"),
    ("/detect", {"text": "x", "num_bits": 16}, 422, "invalid_request", "unknown field"),
    ("/detect", {}, 422, "invalid_request", "text"),
    ("/decode", {"text": ""}, 422, "invalid_request", "text"),
    ("/detect", {"text": ""}, 422, "invalid_request", "text"),
    ("/decode", {"text": "x", "key_version": "1"}, 422, "invalid_request", "key_version"),
    ("/decode", {"text": "x", "key_version": True}, 422, "invalid_request", "key_version"),
    ("/decode", {"text": "x", "num_bits": 16.5}, 422, "invalid_request", "num_bits"),
    ("/decode", {"text": "a" * 2001}, 422, "text_too_long", "limit is 2000"),
    ("/detect", {"text": "a" * 2001}, 422, "text_too_long", "split it into parts of at most 2000"),
    ("/generate", gen_body(temperature="hot"), 422, "invalid_request", "temperature"),
    ("/generate", gen_body(max_new_tokens=1.5), 422, "invalid_request", "max_new_tokens"),
    ("/generate", gen_body(stream="yes please"), 422, "invalid_request", "stream"),
    ("/generate", gen_body(unknown_field=1), 422, "invalid_request", "unknown field"),
    ("/generate", gen_body(payload={"bits": "1", "x": 1}), 422, "invalid_request", "unknown field"),
    ("/generate", gen_body(prompt=""), 422, "invalid_request", "prompt"),
    (
        "/generate",
        gen_body(messages=[{"role": "user", "content": "hi"}]),
        422,
        "invalid_request",
        "exactly one of prompt or messages",
    ),
    (
        "/generate",
        {"payload": {"bits": "1"}, "max_new_tokens": 4},
        422,
        "invalid_request",
        "exactly one of prompt or messages",
    ),
    (
        "/generate",
        gen_body(messages=[{"role": "wizard", "content": "hi"}], prompt=None),
        422,
        "invalid_request",
        "role",
    ),
    (
        "/generate",
        gen_body(metadata={"user": "u1"}, payload={"bits": "1"}),
        422,
        "invalid_request",
        "at most one of payload or metadata",
    ),
    ("/generate", gen_body(payload={"bits": "1"}, num_bits=8), 422, "invalid_request", "inside"),
    ("/generate", gen_body(payload={"bits": "012"}), 422, "invalid_request", "0 and 1"),
    ("/generate", gen_body(payload={"bits": ""}), 422, "invalid_request", "0 and 1"),
    ("/generate", gen_body(payload={"bits": "1" * 65}), 422, "invalid_request", "0 and 1"),
    ("/generate", gen_body(payload={"int": 5}), 422, "invalid_request", "needs payload.num_bits"),
    ("/generate", gen_body(payload={"int": -1, "num_bits": 4}), 422, "invalid_request", "int"),
    ("/generate", gen_body(payload={"int": 500, "num_bits": 4}), 422, "invalid_payload", "4 bits"),
    ("/generate", gen_body(payload={"hex": "xyz"}), 422, "invalid_request", "hexadecimal"),
    (
        "/generate",
        gen_body(payload={"bits": "1", "hex": "1"}),
        422,
        "invalid_request",
        "exactly one",
    ),
    ("/generate", gen_body(payload={}), 422, "invalid_request", "exactly one"),
    ("/generate", gen_body(payload={"bits": "1", "num_bits": 1}), 422, "invalid_request", "sizes"),
    ("/generate", gen_body(stream="true"), 422, "invalid_request", "stream"),
    ("/generate", gen_body(seed="7"), 422, "invalid_request", "seed"),
    (
        "/generate",
        gen_body(payload={"bits": "101", "num_bits": 4}),
        422,
        "invalid_request",
        "sizes hex and int",
    ),
    # one limit, the server's, however far over it a request goes
    ("/generate", gen_body(max_new_tokens=10**9), 422, "max_new_tokens_too_large", "at most 256"),
    ("/generate", gen_body(max_new_tokens=10**30), 422, "max_new_tokens_too_large", "at most 256"),
    ("/generate", gen_body(max_new_tokens=0), 422, "invalid_request", "max_new_tokens"),
    ("/generate", gen_body(max_new_tokens=300), 422, "max_new_tokens_too_large", "at most 256"),
    ("/generate", gen_body(temperature=0), 422, "invalid_request", "temperature"),
    ("/generate", gen_body(top_p=1.5), 422, "invalid_request", "top_p"),
    ("/generate", gen_body(seed=-1), 422, "invalid_request", "seed"),
    ("/generate", gen_body(num_bits=16), 422, "invalid_request", "num_bits"),
    ("/generate", gen_body(metadata={"u": 1}, num_bits=0), 422, "invalid_request", "num_bits"),
    ("/generate", gen_body(metadata=[1, 2]), 422, "invalid_request", "metadata"),
    ("/generate", gen_body(metadata={"blob": "x" * 5000}), 422, "invalid_request", "metadata.blob"),
    (
        "/generate",
        gen_body(metadata={f"k{i}": "x" * 500 for i in range(10)}),
        422,
        "metadata_too_large",
        "4096 bytes",
    ),
    (
        "/generate",
        gen_body(metadata={"a": {"b": {"c": {"d": {"e": 1}}}}}),
        422,
        "invalid_request",
        "nest at most 4",
    ),
    ("/generate", gen_body(metadata={"a": [[[[[1]]]]]}), 422, "invalid_request", "nest at most 4"),
    ("/generate", gen_body(prompt="hello " * 200), 422, "prompt_too_long", "limit is 64"),
    (
        "/generate",
        gen_body(prompt=None, messages=[{"role": "user", "content": "hello " * 200}]),
        422,
        "prompt_too_long",
        "limit is 64",
    ),
    (
        "/generate",
        b'{"prompt":"a","payload":{"bits":"1"},"temperature":NaN}',
        422,
        None,
        "temperature",
    ),
    ("/decode", b'{"text":"a","num_bits":1e400}', 422, None, "num_bits"),
    # a lone surrogate escape is valid JSON syntax but not a Unicode string
    ("/decode", b'{"text":"\\ud800 x"}', 422, None, "text"),
]


def test_decode_counts_the_tokens_of_the_text(
    client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    """Why /decode can count a few more tokens than /generate made (docs/api.md, "Token
    counts"): it sees only the text and tokenises it, and the model may emit a token the
    tokenizer never gives there. SmolLM2 writes a paragraph break before a word as one
    token, "\\n\\n"; the tokenizer's pre-tokenizer splits it in two."""
    _, auth = tenant
    backend = client.app.state.runtime.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    generated = [
        *backend.encode("Tides rise", add_special_tokens=False).ids,
        backend.token_to_id("ĊĊ"),
        *backend.encode("The moon pulls", add_special_tokens=False).ids,
    ]
    text = backend.decode(generated)
    assert text == "Tides rise\n\nThe moon pulls"
    r = client.post("/decode", json={"text": text}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["num_tokens"] == len(generated) + 1
    assert r.json()["num_tokens"] == len(backend.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "fragment"),
    BAD_JSON_CASES,
    ids=[f"{i}-{c[0].strip('/')}" for i, c in enumerate(BAD_JSON_CASES)],
)
def test_bad_input_is_a_clear_4xx(
    client: TestClient,
    tenant: tuple[str, dict[str, str]],
    path: str,
    body: Any,
    status: int,
    code: str | None,
    fragment: str,
) -> None:
    _, auth = tenant
    if isinstance(body, bytes):
        r = client.post(path, **raw_json(body, auth))
    else:
        r = client.post(path, json={k: v for k, v in body.items() if v is not None}, headers=auth)
    err = assert_error(r, status, code)
    assert fragment in err["message"], err


def test_body_limits_and_hostile_bodies(
    client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    _, auth = tenant
    big = b'{"prompt":"' + b"a" * 1_000_000 + b'"}'
    for path in ("/generate", "/decode", "/detect"):
        err = assert_error(client.post(path, **raw_json(big, auth)), 413, "request_too_large")
        assert "65536" in err["message"]
        # a text too big for one request: split it, or the bulk routes (their own limit)
        hint = "split the text into parts of at most" in err["message"]
        assert hint is (path != "/generate") and ("/decode/batch" in err["message"]) is hint

    # no Content-Length (chunked): the limit is enforced while reading
    def chunks() -> Iterator[bytes]:
        yield b'{"text":"'
        for _ in range(100):
            yield b"b" * 10_000
        yield b'"}'

    assert_error(client.post("/detect", **raw_json(chunks(), auth)), 413, "request_too_large")

    # 10 000 levels of nesting: refused as a 4xx, never a crash or a 500
    for path, body in (
        ("/decode", b'{"text":' + DEEP + b"}"),
        ("/detect", b'{"text":"x","n":' + DEEP + b"}"),
        ("/generate", b'{"prompt":"a","metadata":{"x":' + DEEP + b"}}"),
    ):
        r = client.post(path, **raw_json(body, auth))
        assert 400 <= r.status_code < 500, r.text
        assert_error(r, r.status_code)

    # invalid UTF-8, inside a string and before the JSON
    for body in (
        b'{"text":"\xff\xfe abc \xc3"}',
        b'\xff\xfe{"text":"x"}',
        b'{"text":"\xed\xa0\x80"}',
    ):
        r = client.post("/decode", **raw_json(body, auth))
        assert 400 <= r.status_code < 500, r.text
        assert_error(r, r.status_code)
    # not JSON, or not UTF-8: one status and code, and where it broke, as the parser says
    broken = b'{\n  "text": "x",\n  "num_bits" 16\n}'
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(broken)
    where = (
        f"line {parsed.value.lineno}, column {parsed.value.colno} (character {parsed.value.pos})"
    )
    err = assert_error(client.post("/decode", **raw_json(broken, auth)), 400, "invalid_json")
    assert where in err["message"] and parsed.value.msg in err["message"], err
    body = b'{"text":"\xff\xfe abc \xc3"}'
    err = assert_error(client.post("/decode", **raw_json(body, auth)), 400, "invalid_json")
    assert "not UTF-8 at byte 9" in err["message"], err

    # the wrong media type is not parsed as JSON
    r = client.post(
        "/detect", content=b'{"text":"x"}', headers={**auth, "Content-Type": "text/plain"}
    )
    assert_error(r, 422)

    # a too-long Idempotency-Key header
    r = client.post("/generate", json=gen_body(), headers={**auth, "Idempotency-Key": "k" * 129})
    assert_error(r, 422, "invalid_request")


@pytest.mark.parametrize(
    "text",
    [
        "a\x00b\x01c\x07\x1b[31mred\x1b[0m\x7f",
        "\u200b\u200c\u200d\ufeff\u2060",  # zero-width only
        "The c\u200bat s\u200dat on the m\u200cat.",
        # Cyrillic
        "\u0422\u0435\u0445\u0442 \u0440\u0430\u0443\u0440\u0430\u043b \u0441\u043e\u043f\u0440",
        "p\u0430yp\u0430l.com \u0455\u0441\u0430m",  # Latin/Cyrillic homoglyphs
        "e\u0301\u0301\u0301\u0301 \U0001f600\U0001f3f3\ufe0f\u200d\U0001f308 \u202e\u202dabc",
        "\ufffd\ufffd \U000e0041 \u2028\u2029 \U0010ffff",
    ],
    ids=["control", "zero-width-only", "zero-width", "cyrillic", "homoglyph", "combining", "odd"],
)
def test_decode_and_detect_accept_odd_unicode(
    client: TestClient, tenant: tuple[str, dict[str, str]], text: str
) -> None:
    _, auth = tenant
    r = client.post("/decode", json={"text": text, "num_bits": 16}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["bits"]) == 16 and set(body["bits"]) <= set("01?")
    assert len(body["bit_confidence"]) == 16
    assert 0.0 <= body["p_value"] <= 1.0 and body["num_tokens"] > 0
    # a verdict, not necessarily False: a fixed key has a 1 % false-positive rate per text
    assert isinstance(body["is_watermarked"], bool)
    assert body["registry_match"] is None
    r = client.post("/detect", json={"text": text}, headers=auth)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["is_watermarked"], bool) and 0.0 <= r.json()["p_value"] <= 1.0


# --------------------------------------------------------------------------- 4. generate
@pytest.mark.parametrize(
    "payload",
    [
        {"bits": PAYLOAD16},
        {"hex": "6996", "num_bits": 16},
        {"hex": "0x6996", "num_bits": 16},
        {"int": 0x6996, "num_bits": 16},
    ],
    ids=["bits", "hex", "hex-0x", "int"],
)
def test_generate_with_explicit_payload(
    client: TestClient, tenant: tuple[str, dict[str, str]], payload: dict[str, Any]
) -> None:
    _, auth = tenant
    r = client.post("/generate", json=gen_body(payload=payload, seed=1), headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["payload"] == {"bits": PAYLOAD16, "hex": "6996", "num_bits": 16}
    # sealed: an entry of its own carries a keyed payload of the same length
    assert body["client_payload"] is True and body["num_bits"] == 16, body
    assert body["message_id"] is not None and body["scheme"] == "worldcup-v2"
    assert body["num_tokens"] == body["usage"]["completion_tokens"] <= 4
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["num_tokens"]
    assert body["finish_reason"] in ("eos", "length")
    assert r.headers.get("x-request-id")


def test_generate_from_chat_messages(
    client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    _, auth = tenant
    body = gen_body(messages=[{"role": "user", "content": "Hi!"}])
    del body["prompt"]
    r = client.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 3  # the chat template was applied


def test_generated_payload_decodes_back(
    client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    _, auth = tenant
    body = gen_body(max_new_tokens=96, min_new_tokens=96, seed=7)
    r = client.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    gen = r.json()
    assert gen["num_tokens"] == 96 and gen["payload"]["bits"] == PAYLOAD16
    assert gen["timing"]["total_seconds"] > 0

    r = client.post("/decode", json={"text": gen["text"], "num_bits": 16}, headers=auth)
    assert r.status_code == 200, r.text
    dec = r.json()
    assert dec["p_value"] < 1e-6 and dec["is_watermarked"] is True
    assert dec["key_version"] == gen["key_version"]
    # sealed: the text names the entry that records the chosen payload
    match = dec["registry_match"]
    assert match["message_id"] == gen["message_id"] and match["client_payload"], match
    assert match["bits"] == PAYLOAD16 and match["metadata"] == {}, match

    r = client.post("/detect", json={"text": gen["text"]}, headers=auth)
    assert r.status_code == 200, r.text
    det = r.json()
    assert det["is_watermarked"] is True and det["p_value"] < 1e-6
    assert det["key_version"] == gen["key_version"] and det["significance"] == 1e-6


# --------------------------------------------------------------------------- 5. metadata
def test_concurrent_metadata_allocation(client: TestClient) -> None:
    tenant_id, auth = new_tenant(client, scopes=ANALYST)

    def one(i: int) -> httpx.Response:
        body = gen_body(metadata={"user": f"u{i}", "n": i}, max_new_tokens=2)
        return client.post("/generate", json=body, headers=auth)

    with ThreadPoolExecutor(max_workers=25) as pool:
        responses = list(pool.map(one, range(25)))
    assert [r.status_code for r in responses] == [200] * 25, [r.text for r in responses]
    ids = [r.json()["message_id"] for r in responses]
    assert sorted(ids) == list(range(1, 26))
    assert len({r.json()["payload"]["bits"] for r in responses}) == 25
    for i, r in enumerate(responses):
        assert r.json()["payload"]["num_bits"] == 32  # the server default
        entry = client.get(f"/admin/tenants/{tenant_id}/registry/{ids[i]}", headers=ADMIN)
        assert entry.status_code == 200, entry.text
        e = entry.json()
        assert e["metadata"] == {"user": f"u{i}", "n": i}
        assert e["tenant_id"] == tenant_id and e["message_id"] == ids[i]
        assert e["num_bits"] == 32 and e["key_version"] == 1 and e["issued_at"]


# --------------------------------------------------------------------------- 6. idempotency
def test_idempotency_key(client: TestClient) -> None:
    _, auth = new_tenant(client, scopes=ANALYST)
    _, auth_b = new_tenant(client, scopes=ANALYST)
    body = gen_body(metadata={"order": 1}, max_new_tokens=3)
    headers = {**auth, "Idempotency-Key": "order-1"}

    first = client.post("/generate", json=body, headers=headers)
    assert first.status_code == 200, first.text
    assert "Idempotent-Replayed" not in first.headers
    assert first.json()["message_id"] == 1

    again = client.post("/generate", json=body, headers=headers)
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()

    # the replay allocated nothing: the next allocation is id 2
    r = client.post(
        "/generate", json=gen_body(metadata={"order": 2}, max_new_tokens=2), headers=auth
    )
    assert r.json()["message_id"] == 2

    # same key, different body
    other = {**body, "metadata": {"order": 99}}
    assert_error(client.post("/generate", json=other, headers=headers), 409, "idempotency_conflict")
    # ... any field counts
    r = client.post("/generate", json={**body, "max_new_tokens": 4}, headers=headers)
    assert_error(r, 409, "idempotency_conflict")

    # another tenant's identical key is independent
    b1 = client.post("/generate", json=body, headers={**auth_b, "Idempotency-Key": "order-1"})
    assert b1.status_code == 200, b1.text
    assert "Idempotent-Replayed" not in b1.headers
    assert b1.json()["message_id"] == 1
    assert b1.json()["payload"] != first.json()["payload"]  # a different tenant key
    b2 = client.post("/generate", json=body, headers={**auth_b, "Idempotency-Key": "order-1"})
    assert b2.headers["Idempotent-Replayed"] == "true" and b2.json() == b1.json()
    # ... and tenant A's record is untouched
    assert client.post("/generate", json=body, headers=headers).json() == first.json()


def test_concurrent_requests_with_one_idempotency_key_run_once(client: TestClient) -> None:
    """The key is claimed before allocating: a concurrent duplicate gets 409 in-progress
    (or the replay, if it came after), never a second generation or message id."""
    _, auth = new_tenant(client)
    body = gen_body(metadata={"order": 7}, max_new_tokens=60, min_new_tokens=60)
    headers = {**auth, "Idempotency-Key": "order-7"}
    n = 4
    barrier = threading.Barrier(n)

    def one(_: int) -> httpx.Response:
        barrier.wait()
        return client.post("/generate", json=body, headers=headers)

    with ThreadPoolExecutor(max_workers=n) as pool:
        responses = list(pool.map(one, range(n)))
    fresh = [
        r for r in responses if r.status_code == 200 and "Idempotent-Replayed" not in r.headers
    ]
    assert len(fresh) == 1, [(r.status_code, r.text[:80]) for r in responses]
    for r in responses:
        if r.status_code == 409:
            assert_error(r, 409, "idempotency_in_progress")
            assert r.headers["Retry-After"] == "1"
        elif r is not fresh[0]:
            assert r.status_code == 200 and r.json() == fresh[0].json()
    # exactly one message id was issued: the next allocation is id 2
    r = client.post("/generate", json=gen_body(metadata={"n": 2}, max_new_tokens=2), headers=auth)
    assert r.json()["message_id"] == 2
    # and the key now replays the one result
    again = client.post("/generate", json=body, headers=headers)
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == fresh[0].json()


def test_failed_request_releases_its_idempotency_key(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that failed (here: the registry write) must not block its own retry."""
    from app.stores.base import StoreUnavailable

    _, auth = new_tenant(client)
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    body = gen_body(metadata={"order": 9}, max_new_tokens=3)
    headers = {**auth, "Idempotency-Key": "order-9"}

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("injected")

    with monkeypatch.context() as mp:
        mp.setattr(runtime.store, "allocate_message", down)
        assert_error(client.post("/generate", json=body, headers=headers), 503, "store_unavailable")
    retry = client.post("/generate", json=body, headers=headers)
    assert retry.status_code == 200, retry.text
    assert "Idempotent-Replayed" not in retry.headers and retry.json()["message_id"] == 1


# --------------------------------------------------------------------------- 7. streaming
def test_streaming_sse(client: TestClient, tenant: tuple[str, dict[str, str]]) -> None:
    _, auth = tenant
    body = gen_body(stream=True, max_new_tokens=24, min_new_tokens=24, seed=3)
    r = client.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip("\n").endswith("data: [DONE]")
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    names = [name for name, _ in events]
    assert names.count("result") == 1 and names[-2] == "result"
    tokens = [json.loads(data) for name, data in events[:-2]]
    assert all(name is None for name, _ in events[:-2])
    assert len([t for t in tokens if t["token_id"] is not None]) == 24
    result = json.loads(events[-2][1])
    assert result["num_tokens"] == 24 and result["payload"]["bits"] == PAYLOAD16
    assert "".join(t["text"] for t in tokens) == result["text"]


def test_streaming_deltas_keep_multibyte_characters_whole(
    app: FastAPI,
    client: TestClient,
    tenant: tuple[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Emoji and CJK span several byte tokens: no delta may carry a half character."""
    _, auth = tenant
    runtime = app.state.runtime
    text = "héllo 日本 🎉 ok 🎉"
    ids = runtime.tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.split())  # some characters are split across tokens

    def scripted_submit(request: Any) -> GenerationJob:
        job = GenerationJob(request=request, loop=asyncio.get_running_loop())
        for i, tok in enumerate(ids):
            job.events.put_nowait(StepEvent(0, tok, "length" if i == len(ids) - 1 else None))
        job.events.put_nowait(GenerationResult(list(ids), "length", len(request.prompt_ids), 0.01))
        job.first_token_at = job.last_token_at = job.admitted_at = job.enqueued_at
        job.done = True
        return job

    monkeypatch.setattr(runtime.engine, "submit", scripted_submit)
    r = client.post("/generate", json=gen_body(stream=True, max_new_tokens=len(ids)), headers=auth)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    deltas = [json.loads(data)["text"] for name, data in events[:-2]]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == json.loads(events[-2][1])["text"] == text


def test_generate_timeouts_are_counted_streamed_or_not(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation past the request deadline is a 504 (an ``event: error`` when
    streamed), its job is cancelled, and both forms count in the timeout metric.
    (An app of its own: this module's app must never answer a 5xx.)"""
    app = create_app(make_settings(model_dir, tmp_path, request_timeout_s=0.2))
    jobs: list[GenerationJob] = []

    def silent_submit(request: Any) -> GenerationJob:  # an engine that never answers
        jobs.append(GenerationJob(request=request, loop=asyncio.get_running_loop()))
        return jobs[-1]

    with TestClient(app, raise_server_exceptions=False) as client:
        _, auth = new_tenant(client)
        monkeypatch.setattr(app.state.runtime.engine, "submit", silent_submit)
        r = client.post("/generate", json=gen_body(max_new_tokens=4), headers=auth)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        r = client.post("/generate", json=gen_body(stream=True, max_new_tokens=4), headers=auth)
        assert r.status_code == 200  # the stream had started: the error is an event
        events = sse_events(r.text)
        assert events[-2][0] == "error"
        assert json.loads(events[-2][1])["error"]["code"] == "timeout"
        text = metrics_text(client)
    assert metric_value(text, "worldcup_request_rejections_total", reason="timeout") == 2
    assert len(jobs) == 2 and all(job.cancelled for job in jobs)


def test_streaming_idempotent_replay(client: TestClient) -> None:
    _, auth = new_tenant(client)
    headers = {**auth, "Idempotency-Key": "stream-1"}
    body = gen_body(stream=True, metadata={"s": 1}, max_new_tokens=6)
    first = client.post("/generate", json=body, headers=headers)
    assert first.status_code == 200
    replay = client.post("/generate", json=body, headers=headers)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["content-type"].startswith("text/event-stream")
    a, b = sse_events(first.text), sse_events(replay.text)
    assert json.loads(a[-2][1]) == json.loads(b[-2][1]) and b[-1] == (None, "[DONE]")
    assert "".join(json.loads(d)["text"] for _, d in b[:-2]) == json.loads(b[-2][1])["text"]


# --------------------------------------------------------------------------- 8. queue full
def test_queue_full_is_a_429(model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(model_dir, tmp_path, max_batch_size=1, max_queue=1)
    app = create_app(settings)
    n = 6
    with TestClient(app, raise_server_exceptions=False) as c:
        _, auth = new_tenant(c)
        barrier = threading.Barrier(n)

        def one(i: int) -> httpx.Response:
            barrier.wait()
            body = gen_body(max_new_tokens=40, min_new_tokens=40, seed=i)
            return c.post("/generate", json=body, headers=auth)

        with ThreadPoolExecutor(max_workers=n) as pool:
            responses = list(pool.map(one, range(n)))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) <= {200, 429}, [r.text for r in responses]
        assert 429 in statuses and 200 in statuses, statuses
        for r in responses:
            if r.status_code == 429:
                assert_error(r, 429, "queue_full")
                assert int(r.headers["Retry-After"]) >= 1
            else:
                assert r.json()["num_tokens"] == 40
        text = metrics_text(c)
        rejected = metric_value(text, "worldcup_request_rejections_total", reason="queue_full")
        assert rejected == statuses.count(429) >= 1


# --------------------------------------------------------------------------- 9. detector
def test_detector_role(model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(model_dir, tmp_path, role="detector")
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as c:
        assert app.state.runtime.engine is None
        assert c.get("/ready").status_code == 200
        assert c.get("/version").json()["role"] == "detector"
        with fixed_watermark_keys(99):
            _, auth = new_tenant(c, scopes=ANALYST)
        err = assert_error(c.post("/generate", json=gen_body(), headers=auth), 501, "detector_role")
        assert "detector" in err["message"] and "/decode" in err["message"]
        # auth still comes first
        assert_error(c.post("/generate", json=gen_body()), 401)
        text = "Plain human text about the tides and the moon, nothing hidden in it."
        r = c.post("/decode", json={"text": text, "num_bits": 8}, headers=auth)
        assert r.status_code == 200 and len(r.json()["bits"]) == 8
        assert r.json()["statistic"] == "model_free"  # no model loaded: said so
        r = c.post("/detect", json={"text": text}, headers=auth)
        assert r.status_code == 200 and r.json()["is_watermarked"] is False
        assert r.json()["statistic"] == "model_free"


# --------------------------------------------------------------------------- 10. readiness
def test_health_ready_version_and_draining(
    app: FastAPI, client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    _, auth = tenant
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    v = client.get("/version").json()
    assert v["scheme_version"] == "worldcup-v2" and v["role"] == "generator"
    assert v["model_id"] and v["app_version"]

    runtime = app.state.runtime
    runtime.draining = True
    try:
        assert_error(client.get("/ready"), 503, "draining")
        r = client.post("/generate", json=gen_body(), headers=auth)
        assert_error(r, 503, "draining")
        assert r.headers.get("Retry-After")
        # detection keeps answering while generations drain
        assert client.post("/detect", json={"text": "still here"}, headers=auth).status_code == 200
        assert client.get("/health").status_code == 200
    finally:
        runtime.draining = False
    assert client.get("/ready").status_code == 200


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_error(client.get("/nope"), 404, "not_found")
    assert_error(client.get("/generate"), 405, "method_not_allowed")


def test_metrics_names_and_labels(client: TestClient, tenant: tuple[str, dict[str, str]]) -> None:
    tenant_id, auth = tenant
    # exercise every code path that labels a metric, including a failing one with the id in the URL
    client.post("/generate", json=gen_body(max_new_tokens=3), headers=auth)
    client.post("/detect", json={"text": "some text"}, headers=auth)
    client.get(f"/admin/tenants/{tenant_id}/registry/424242", headers=ADMIN)
    client.get(f"/{tenant_id}")
    client.post("/detect", json={"text": "x"}, headers={"Authorization": "Bearer wc_leaked-key"})
    text = metrics_text(client)
    assert text.count("# TYPE ") >= len(SERVICE_METRICS)
    for name in SERVICE_METRICS:
        family = name.removesuffix("_total")  # older clients name the counter family without it
        assert re.search(rf"^# TYPE ({name}|{family}) (counter|histogram|gauge)$", text, re.M), name
    assert metric_value(text, "worldcup_generated_tokens_total") >= 3
    assert metric_value(text, "worldcup_generate_time_to_first_token_seconds_count") >= 1
    assert metric_value(text, "worldcup_detections_total") >= 1

    endpoints = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for value in sample.labels.values():
                assert not any(secret in value for secret in SECRETS_SEEN), (sample.name, value)
                assert "wc_" not in value and ADMIN_TOKEN not in value
            if "endpoint" in sample.labels:
                endpoints.add(sample.labels["endpoint"])
    assert "/admin/tenants/{tenant_id}/registry/{message_id}" in endpoints
    assert {"/generate", "/detect"} <= endpoints
    assert len(SECRETS_SEEN) >= 4


# --------------------------------------------------------------------------- 11. settings
def _settings(**kw: Any) -> Settings:
    values: dict[str, Any] = {
        "master_key": MASTER_KEY,
        "admin_token": ADMIN_TOKEN,
        "master_key_file": None,
        "admin_token_file": None,
        "env": "prod",
    }
    values.update(kw)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.mark.parametrize("placeholder", ["changeme", "CHANGEME", "", "changeme-please", "secret"])
@pytest.mark.parametrize("field", ["master_key", "admin_token"])
def test_settings_refuse_placeholder_secrets(field: str, placeholder: str) -> None:
    with pytest.raises(ValidationError) as info:
        _settings(**{field: placeholder})
    message = str(info.value)
    assert f"WORLDCUP_{field.upper()} is missing or a placeholder" in message
    assert "WORLDCUP_ENV=dev" in message
    with pytest.raises(ValidationError):
        _settings(**{field: None})

    dev = _settings(env="dev", **{field: placeholder})
    value = getattr(dev, field).get_secret_value()
    assert len(value) == 64 and value != placeholder
    assert len(dev.master_key_bytes) == 32


@pytest.mark.parametrize("bad", ["ab" * 16, "ab" * 33, "zz" * 32, "ab" * 31 + "a"])
def test_settings_refuse_a_malformed_master_key(bad: str) -> None:
    with pytest.raises(ValidationError, match="64 hex characters"):
        _settings(master_key=bad)


def test_settings_secrets_from_files(tmp_path: Path) -> None:
    key_file, token_file = tmp_path / "master_key", tmp_path / "admin_token"
    key_file.write_text("cd" * 32 + "\n")
    token_file.write_text("  file-admin-token-abcdefgh\n")
    s = _settings(
        master_key=None, admin_token=None, master_key_file=key_file, admin_token_file=token_file
    )
    assert s.master_key is not None and s.admin_token is not None
    assert s.master_key.get_secret_value() == "cd" * 32
    assert s.master_key_bytes == bytes.fromhex("cd" * 32)
    assert s.admin_token.get_secret_value() == "file-admin-token-abcdefgh"

    with pytest.raises(ValidationError, match="cannot read WORLDCUP_MASTER_KEY_FILE"):
        _settings(master_key_file=tmp_path / "missing")
    placeholder = tmp_path / "placeholder"
    placeholder.write_text("changeme\n")
    with pytest.raises(ValidationError, match="placeholder"):
        _settings(admin_token_file=placeholder)


def test_settings_repr_hides_secrets(tmp_path: Path) -> None:
    s = _settings(sqlite_path=tmp_path / "x.db")
    for rendered in (repr(s), str(s), s.model_dump_json(), repr(s.model_dump())):
        assert MASTER_KEY not in rendered and ADMIN_TOKEN not in rendered
    # nor does a validation error (startup logs): no input values in the message
    short_token = "tok-0123456789"
    with pytest.raises(ValidationError) as info:
        _settings(master_key="ab" * 16, admin_token=short_token)
    assert short_token not in str(info.value) and "abab" not in str(info.value)
    assert "64 hex characters" in str(info.value)


# --------------------------------------------------------------------------- 12. OpenAPI
def test_openapi_documents_the_error_envelope(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    for path in ("/generate", "/decode", "/detect", "/admin/tenants"):
        assert "post" in spec["paths"][path], path
    assert "ErrorEnvelope" in spec["components"]["schemas"]
    checked = 0
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status, response in op.get("responses", {}).items():
                if not status.startswith("4"):
                    continue
                schema = response["content"]["application/json"]["schema"]
                # the OpenAI-compatible routes answer in OpenAI's envelope (with "param")
                name = "OpenAIErrorEnvelope" if path.startswith("/v1/") else "ErrorEnvelope"
                assert schema == {"$ref": f"#/components/schemas/{name}"}, (
                    method,
                    path,
                    status,
                )
                checked += 1
    assert checked >= 4 * 10
    generate = spec["paths"]["/generate"]["post"]
    assert "text/event-stream" in generate["responses"]["200"]["content"]
    assert any(
        "bearer" in str(s).lower() for s in spec["components"].get("securitySchemes", {}).values()
    )


# --------------------------------------------------------------------------- 13. isolation
def test_tenant_isolation(client: TestClient) -> None:
    with fixed_watermark_keys(5678):
        tenant_a, auth_a = new_tenant(client, scopes=ANALYST)
        tenant_b, auth_b = new_tenant(client, scopes=ANALYST)
    body = gen_body(
        metadata={"owner": "A"}, num_bits=16, max_new_tokens=96, min_new_tokens=96, seed=11
    )
    r = client.post("/generate", json=body, headers=auth_a)
    assert r.status_code == 200, r.text
    text, message_id = r.json()["text"], r.json()["message_id"]
    issued = r.json()["payload"]["bits"]

    mine = client.post("/decode", json={"text": text, "num_bits": 16}, headers=auth_a).json()
    assert mine["is_watermarked"] is True
    assert mine["registry_match"] is not None
    assert mine["registry_match"]["message_id"] == message_id
    assert mine["registry_match"]["metadata"] == {"owner": "A"}
    # exact: the decoded bits are the payload issued for that entry, bit for bit
    assert mine["registry_match"]["exact"] is (mine["bits"] == issued)

    # B gets a message id of its own so its registry is not empty
    client.post("/generate", json={**body, "metadata": {"owner": "B"}}, headers=auth_b)
    theirs = client.post("/decode", json={"text": text, "num_bits": 16}, headers=auth_b)
    assert theirs.status_code == 200
    assert theirs.json()["registry_match"] is None
    assert theirs.json()["is_watermarked"] is False
    det = client.post("/detect", json={"text": text}, headers=auth_b).json()
    assert det["is_watermarked"] is False and det["key_version"] is None
    assert (
        client.post("/detect", json={"text": text}, headers=auth_a).json()["is_watermarked"] is True
    )
    # registry lookups are per tenant
    assert (
        client.get(f"/admin/tenants/{tenant_a}/registry/{message_id}", headers=ADMIN).status_code
        == 200
    )
    other = client.get(f"/admin/tenants/{tenant_b}/registry/{message_id}", headers=ADMIN)
    assert other.status_code == 200 and other.json()["metadata"] == {"owner": "B"}


# --------------------------------------------------------------------------- no 500s, ever
def test_no_request_in_this_module_returned_500(client: TestClient) -> None:
    """Runs last: the latency histogram counts every answer the shared app gave, by status."""
    text = metrics_text(client)
    assert metric_value(text, "worldcup_request_duration_seconds_count") > 0
    for status in ("500", "502", "504"):
        assert metric_value(text, "worldcup_request_duration_seconds_count", status=status) == 0


def test_unknown_query_parameters_are_refused(
    client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    """A typo such as ``?limt=5`` must not read as if it had applied: the schema lists
    every query parameter a route takes, and anything else is refused."""
    assert client.get("/admin/audit?limit=5", headers=ADMIN).status_code == 200
    r = client.get("/admin/audit?limt=5", headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_query_parameter"
    assert "'limt'" in r.json()["error"]["message"] and "limit" in r.json()["error"]["message"]
    _, auth = tenant
    assert client.post("/detect", json={"text": "tides"}, headers=auth).status_code == 200
    r = client.post("/detect?verbose=1", json={"text": "tides"}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_query_parameter"
    r = client.get("/v1/models?x=1", headers=auth)  # OpenAI's envelope and status there
    assert r.status_code == 400 and r.json()["error"]["param"] == "x"
