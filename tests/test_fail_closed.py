"""A generation the engine could not watermark fails closed, on every route.

The vLLM engine fails a request whose row broke a processor guard
(:class:`~app.engines.base.UnwatermarkedError`; the guards themselves are tested in
``tests/test_vllm_processor.py``). What the service then does is engine-independent,
so it is tested here on the real app (tiny hf model) with an engine that streams two
tokens and then fails a row the way the vLLM engine does:

* a non-streamed ``/generate`` answers 500 ``watermark_failed``, saying the text is not
  watermarked;
* a stream gets a ``receipt`` event (``watermarked: false``) and an ``error`` event;
* the registry entry allocated before generation is voided: ``/decode`` of the text
  never matches it, the admin route no longer returns it, and its id is never handed
  out again; ``worldcup_registry_voided_total`` counts it;
* the OpenAI route answers 500 ``watermark_failed`` as well.

On the old code (no voiding, a generic ``generation_failed``) every test here fails.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.engines.base import GenerationJob, UnwatermarkedError
from app.main import create_app
from worldcup_core.generation import GenerationRequest, StepEvent

ADMIN = "fail-closed-admin-token-1a2b3c4d"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        env="prod",
        model_path=str(tiny_model_dir),
        master_key="5a" * 32,
        master_key_file=None,
        admin_token=ADMIN,
        admin_token_file=None,
        redis_url=None,
        sqlite_path=tmp_path_factory.mktemp("db") / "db.sqlite3",
        device="cpu",
        log_level="WARNING",
    )
    return create_app(settings)


@pytest.fixture(scope="module")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def faulty(app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> list[GenerationRequest]:
    """The engine streams two tokens, then fails the row as the vLLM engine does."""
    import asyncio

    engine = app.state.runtime.engine
    seen: list[GenerationRequest] = []

    def submit(request: GenerationRequest) -> GenerationJob:
        seen.append(request)
        job = GenerationJob(request=request, loop=asyncio.get_running_loop())
        job._push(StepEvent(0, 100, None))
        job._push(StepEvent(0, 101, None))
        job._push(UnwatermarkedError("growth"))
        job.done = True
        return job

    monkeypatch.setattr(engine, "submit", submit)
    return seen


def _tenant(client: TestClient) -> dict[str, str]:
    r = client.post("/admin/tenants", json={"name": "fail-closed"}, headers=ADMIN_AUTH)
    if r.status_code == 409:  # module-scoped app: the name exists from an earlier test
        r = client.post(
            "/admin/tenants", json={"name": f"fc-{uuid.uuid4().hex}"}, headers=ADMIN_AUTH
        )
    assert r.status_code == 201, r.text
    body = r.json()
    return {"tenant": body["tenant_id"], "Authorization": f"Bearer {body['api_key']}"}


def _voided(app: FastAPI) -> float:
    registry = app.state.runtime.metrics.registry
    return float(registry.get_sample_value("worldcup_registry_voided_total") or 0.0)


def _entry(client: TestClient, tenant: str, message_id: int) -> int:
    return client.get(
        f"/admin/tenants/{tenant}/registry/{message_id}", headers=ADMIN_AUTH
    ).status_code


def test_non_streamed_generate_is_a_500_and_its_entry_is_voided(
    client: TestClient, app: FastAPI, faulty: list[GenerationRequest]
) -> None:
    who = _tenant(client)
    auth = {"Authorization": who["Authorization"]}
    before = _voided(app)
    body = {"prompt": "hello", "max_new_tokens": 8, "metadata": {"user": "u1"}}
    r = client.post("/generate", json=body, headers=auth)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "watermark_failed"
    assert "NOT watermarked" in error["message"] and "growth" in error["message"]
    assert "registry entry 1 is voided" in error["message"]
    assert faulty and faulty[0].scheme is not None  # it was a watermarked request
    assert _voided(app) == before + 1
    assert _entry(client, who["tenant"], 1) == 404  # withdrawn
    # the id is never handed out again: the next entry is 2
    store = app.state.runtime.store
    assert client.portal.call(store.message_ids, who["tenant"], 1, 32) == []  # type: ignore[union-attr]
    entry = client.portal.call(  # type: ignore[union-attr]
        store.allocate_message, who["tenant"], 1, 32, {}, 0.0
    )
    assert entry.message_id == 2


def test_a_stream_gets_a_receipt_that_says_not_watermarked(
    client: TestClient, app: FastAPI, faulty: list[GenerationRequest]
) -> None:
    who = _tenant(client)
    auth = {"Authorization": who["Authorization"]}
    body = {"prompt": "hello", "max_new_tokens": 8, "metadata": {"u": 2}, "stream": True}
    with client.stream("POST", "/generate", json=body, headers=auth) as r:
        assert r.status_code == 200
        events = _sse(r.iter_lines())
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == [None, None]  # the two tokens streamed before the fault
    receipt = next(data for kind, data in events if kind == "receipt")
    assert receipt == {"watermarked": False, "message_id": 1}
    error = next(data for kind, data in events if kind == "error")
    assert error["error"]["code"] == "watermark_failed"
    assert "result" not in kinds
    assert _entry(client, who["tenant"], 1) == 404


def test_the_openai_route_fails_closed_too(
    client: TestClient, app: FastAPI, faulty: list[GenerationRequest]
) -> None:
    who = _tenant(client)
    auth = {"Authorization": who["Authorization"]}
    before = _voided(app)
    body: dict[str, Any] = {
        "model": app.state.runtime.model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "watermark": {"metadata": {"via": "openai"}},
    }
    r = client.post("/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "watermark_failed"
    assert _voided(app) == before + 1
    assert _entry(client, who["tenant"], 1) == 404


def _sse(lines: Iterator[str]) -> list[tuple[str | None, Any]]:
    events: list[tuple[str | None, Any]] = []
    kind: str | None = None
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
            if data != "[DONE]":
                events.append((kind, json.loads(data)))
            kind = None
    return events
