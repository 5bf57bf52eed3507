"""End to end over real HTTP: uvicorn on loopback, the embedded SmolLM2, real Redis."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from servers import LiveServer, free_port

from app.core.config import Settings

pytestmark = pytest.mark.model

REDIS_URL = os.environ.get("WORLDCUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
ADMIN = "e2e-admin-token-9f3a1c"


def _redis_or_fail() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        message = f"Redis at {REDIS_URL} is unreachable ({exc.__class__.__name__})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run the service tests against Redis", pytrace=False)
        pytest.skip(message)
    return client


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    client = _redis_or_fail()
    prefix = f"wctest-e2e-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        port=free_port(),
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        master_key="5e" * 32,
        admin_token=ADMIN,
        max_batch_size=8,
        default_num_bits=16,
    )
    try:
        with LiveServer(settings) as server:
            yield server
    finally:
        keys = list(client.scan_iter(f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=180) as client:
        yield client


def _tenant(http: httpx.Client, name: str) -> dict[str, str]:
    r = http.post(
        "/admin/tenants",
        # decoded bits are shown to analysts' keys only (app.services.disclosure)
        json={"name": f"{name}-{uuid.uuid4().hex[:6]}", "scopes": ["fixed_payload", "provenance"]},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 201, r.text
    body = r.json()
    return {"id": body["tenant_id"], "auth": f"Bearer {body['api_key']}"}


@pytest.fixture(scope="module")
def acme(http: httpx.Client) -> dict[str, str]:
    return _tenant(http, "acme")


@pytest.fixture(scope="module")
def articles(data_dir: Path) -> list[str]:
    with (data_dir / "cnn_dailymail_test.jsonl").open() as fh:
        return [json.loads(line)["article"] for line in fh][:40]


def _prompt(article: str) -> str:
    return " ".join(article.split()[:30])


def _generate(http: httpx.Client, auth: str, **body: Any) -> dict[str, Any]:
    body.setdefault("max_new_tokens", 128)
    body.setdefault("min_new_tokens", 96)
    r = http.post("/generate", json=body, headers={"Authorization": auth})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.fixture(scope="module")
def issued(http: httpx.Client, acme: dict[str, str], articles: list[str]) -> list[dict[str, Any]]:
    """Four concurrent metadata generations: batched together, each with its own id."""

    def one(i: int) -> dict[str, Any]:
        return _generate(
            http, acme["auth"], prompt=_prompt(articles[i]), metadata={"user": f"u{i}"}, seed=i
        )

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(4)))


def _decode(http: httpx.Client, auth: str, text: str, **extra: Any) -> dict[str, Any]:
    r = http.post("/decode", json={"text": text, **extra}, headers={"Authorization": auth})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_explicit_payload_round_trip(
    http: httpx.Client, acme: dict[str, str], articles: list[str]
) -> None:
    bits = "1011001110001111"
    out = _generate(http, acme["auth"], prompt=_prompt(articles[10]), payload={"bits": bits})
    # sealed: the text carries its own registry entry's payload, which names the chosen
    assert out["payload"]["bits"] == bits and out["client_payload"] is True, out
    assert out["message_id"] is not None and out["num_bits"] == 16, out
    decoded = _decode(http, acme["auth"], out["text"], num_bits=16)
    assert decoded["is_watermarked"] and decoded["p_value"] < 1e-4
    match = decoded["registry_match"]
    assert match["message_id"] == out["message_id"] and match["bits"] == bits, match


def test_metadata_registry_round_trip(
    http: httpx.Client, acme: dict[str, str], issued: list[dict[str, Any]]
) -> None:
    ids = [g["message_id"] for g in issued]
    assert len(set(ids)) == len(ids)
    for i, g in enumerate(issued):
        decoded = _decode(http, acme["auth"], g["text"])
        match = decoded["registry_match"]
        assert match is not None, decoded
        assert match["message_id"] == g["message_id"] and match["metadata"] == {"user": f"u{i}"}
        assert match["p_value"] < 1e-6
        r = http.get(
            f"/admin/tenants/{acme['id']}/registry/{g['message_id']}",
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 200 and r.json()["metadata"] == {"user": f"u{i}"}


def test_openai_sdk_chat_with_the_real_model(live: LiveServer, http: httpx.Client) -> None:
    """The official SDK against SmolLM2-Instruct: chat template, n=2, registry round trip."""
    tenant = _tenant(http, "sdk")
    client = openai.OpenAI(
        base_url=f"{live.url}/v1", api_key=tenant["auth"].removeprefix("Bearer "), max_retries=0
    )
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Explain why the sea has tides."}],
        max_tokens=128,
        n=2,
        seed=3,
        temperature=1.0,
        extra_body={"min_tokens": 96, "watermark": {"metadata": {"team": "sdk"}}},
    )
    for choice in out.choices:
        info = (choice.model_extra or {})["watermark"]
        assert choice.message.content and info["num_bits"] == 16
        match = _decode(http, tenant["auth"], choice.message.content)["registry_match"]
        assert match is not None and match["message_id"] == info["message_id"], (match, info)
        assert match["metadata"] == {"team": "sdk"} and match["p_value"] < 1e-6
    client.close()


def test_detect_separates_generated_from_human(
    http: httpx.Client, acme: dict[str, str], issued: list[dict[str, Any]], articles: list[str]
) -> None:
    def detect(text: str) -> dict[str, Any]:
        r = http.post("/detect", json={"text": text}, headers={"Authorization": acme["auth"]})
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    generated = [detect(g["text"]) for g in issued]
    assert all(d["is_watermarked"] and d["p_value"] < 1e-4 for d in generated)
    human = [detect(" ".join(a.split()[100:220])) for a in articles[:20]]
    assert sum(d["is_watermarked"] for d in human) <= 2  # each is a 1% false-positive test
    assert max(d["p_value"] for d in generated) < min(d["p_value"] for d in human)


def test_streaming_sends_tokens_then_result_then_done(
    http: httpx.Client, acme: dict[str, str], articles: list[str]
) -> None:
    body = {
        "prompt": _prompt(articles[5]),
        "max_new_tokens": 48,
        "payload": {"hex": "b38f", "num_bits": 16},
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body, headers={"Authorization": acme["auth"]}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    result_at = lines.index("event: result")
    deltas = [json.loads(line[6:])["text"] for line in lines[:result_at]]
    result = json.loads(lines[result_at + 1][6:])
    assert "".join(deltas) == result["text"] and result["num_tokens"] >= len(deltas)
    assert result["payload"]["bits"] == format(0xB38F, "016b")


def test_idempotency(http: httpx.Client, acme: dict[str, str], articles: list[str]) -> None:
    key = uuid.uuid4().hex
    body = {"prompt": _prompt(articles[6]), "max_new_tokens": 16, "metadata": {"req": key}}
    headers = {"Authorization": acme["auth"], "Idempotency-Key": key}
    first = http.post("/generate", json=body, headers=headers)
    again = http.post("/generate", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.headers.get("idempotent-replayed") == "true"
    other = http.post("/generate", json={**body, "max_new_tokens": 17}, headers=headers)
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    fresh = _generate(
        http, acme["auth"], prompt="Next", max_new_tokens=2, min_new_tokens=0, metadata={}
    )
    assert fresh["message_id"] == first.json()["message_id"] + 1  # the replay allocated nothing


def test_tenants_are_isolated(
    http: httpx.Client, issued: list[dict[str, Any]], acme: dict[str, str]
) -> None:
    other = _tenant(http, "globex")
    decoded = _decode(http, other["auth"], issued[0]["text"])
    assert decoded["registry_match"] is None and not decoded["is_watermarked"]
    r = http.post(
        "/detect", json={"text": issued[0]["text"]}, headers={"Authorization": other["auth"]}
    )
    assert r.status_code == 200 and not r.json()["is_watermarked"]
    r = http.get(
        f"/admin/tenants/{acme['id']}/registry/{issued[0]['message_id']}",
        headers={"Authorization": other["auth"]},
    )
    assert r.status_code == 401


def test_key_rotation_keeps_old_texts_decodable(http: httpx.Client, articles: list[str]) -> None:
    tenant = _tenant(http, "initech")
    old = _generate(http, tenant["auth"], prompt=_prompt(articles[7]), metadata={"v": 1})
    r = http.post(
        f"/admin/tenants/{tenant['id']}/rotate-key", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert r.status_code == 200 and r.json()["key_version"] == 2
    new = _generate(http, tenant["auth"], prompt=_prompt(articles[8]), metadata={"v": 2})
    assert (old["key_version"], new["key_version"]) == (1, 2)
    for text, version, meta in ((old["text"], 1, {"v": 1}), (new["text"], 2, {"v": 2})):
        decoded = _decode(http, tenant["auth"], text)
        assert decoded["key_version"] == version and decoded["registry_match"]["metadata"] == meta
        r = http.post("/detect", json={"text": text}, headers={"Authorization": tenant["auth"]})
        assert r.json()["is_watermarked"] and r.json()["key_version"] == version


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b'{"text": ', {"content-type": "application/json"}, 400),  # invalid_json
        (json.dumps({"text": 12}).encode(), {"content-type": "application/json"}, 422),
        (json.dumps({"text": ""}).encode(), {"content-type": "application/json"}, 422),
        (json.dumps({"text": "x", "extra": 1}).encode(), {"content-type": "application/json"}, 422),
        (json.dumps({"text": "x" * 200_000}).encode(), {"content-type": "application/json"}, 422),
        (b"\xff\xfe\xfd", {"content-type": "application/json"}, 400),
        (b"x" * 2_000_000, {"content-type": "application/json"}, 413),
    ],
)
def test_bad_input_gets_a_clear_4xx(
    http: httpx.Client, acme: dict[str, str], content: bytes, headers: dict[str, str], status: int
) -> None:
    r = http.post("/decode", content=content, headers={**headers, "Authorization": acme["auth"]})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["message"]


@pytest.mark.parametrize("auth", [None, "Bearer wc_not-a-key", "Basic abc"])
def test_missing_or_invalid_auth(http: httpx.Client, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth else {}
    r = http.post("/detect", json={"text": "hello"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_ops_endpoints(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").status_code == 200
    assert http.get("/version").json()["scheme_version"] == "worldcup-v2"
    text = http.get("/metrics").text
    assert 'worldcup_request_duration_seconds_count{endpoint="/generate",status="200"}' in text
    assert "worldcup_generated_tokens_total" in text
