"""Issue 15, points 2 and 3: a responsive server under bulk load, and detection that
can be exposed (API keys with scopes and detail levels, probe budgets).

Over the tiny random-weight model through the real app (``TestClient``). The
load tests hold a worker job on a ``threading.Event`` instead of sleeping: the
probes are sent while the bulk request is provably in flight.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_service_api import ADMIN, assert_error, make_settings, new_tenant

import app.api.routes.detection as detection_module
from app.main import create_app

TEXT = (
    "The storm reached the coast late on Tuesday, and by morning the harbour "
    "was full of broken boats and the streets were under water."
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def app(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    return create_app(
        make_settings(
            model_dir,
            tmp_path_factory.mktemp("db"),
            cpu_workers=1,
            cpu_max_pending=1,
            max_body_bytes=256 * 1024,
        )
    )


@pytest.fixture(scope="module")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


class Gate:
    """Replaces the tokenizer call of the scoring routes: the first call signals
    ``entered`` and blocks until ``release`` is set; later calls run normally."""

    def __init__(self, real: Callable[[Any, list[str]], list[list[int]]]) -> None:
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self._first = True
        self._lock = threading.Lock()

    def __call__(self, tokenizer: Any, texts: list[str]) -> list[list[int]]:
        with self._lock:
            first, self._first = self._first, False
        if first:
            self.entered.set()
            assert self.release.wait(30), "the test never released the gate"
        return self.real(tokenizer, texts)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(detection_module.encode_texts)
    monkeypatch.setattr(detection_module, "encode_texts", g)
    yield g
    g.release.set()


def test_probes_answer_while_a_bulk_request_is_in_flight(client: TestClient, gate: Gate) -> None:
    _, auth = new_tenant(client)
    with ThreadPoolExecutor(4) as pool:
        bulk = pool.submit(
            client.post, "/decode/batch", json={"texts": [TEXT * 10] * 50}, headers=auth
        )
        assert gate.entered.wait(30), "the bulk request never reached its worker"
        for path in ("/health", "/ready", "/metrics"):
            probe = pool.submit(client.get, path)
            r = probe.result(timeout=10)  # blocked event loop: TimeoutError here
            assert r.status_code == 200, (path, r.text)
            assert not bulk.done(), "the bulk request must still be in flight"
        gate.release.set()
        r = bulk.result(timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 50


def test_overload_is_shed_at_once_with_retry_after(client: TestClient, gate: Gate) -> None:
    """One admitted job at most (``cpu_max_pending=1``): while it runs, the next
    request is refused at once instead of queueing behind it."""
    _, auth = new_tenant(client)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.post, "/detect", json={"text": TEXT}, headers=auth)
        assert gate.entered.wait(30)
        r = client.post("/detect/batch", json={"texts": [TEXT]}, headers=auth)
        err = assert_error(r, 503, "overloaded")
        assert "capacity" in err["message"]
        assert r.headers["Retry-After"] == "1"
        gate.release.set()
        assert first.result(timeout=60).status_code == 200
    assert client.post("/detect", json={"text": TEXT}, headers=auth).status_code == 200
    metrics = client.get("/metrics").text
    assert 'worldcup_request_rejections_total{reason="overloaded"}' in metrics


def test_duplicate_authorization_headers_are_refused(client: TestClient) -> None:
    _, auth = new_tenant(client)
    headers = [
        ("Authorization", auth["Authorization"]),
        ("Authorization", f"Bearer wc_{uuid.uuid4().hex}"),
    ]
    r = client.post("/detect", json={"text": TEXT}, headers=headers)
    assert_error(r, 400, "duplicate_authorization")
    r = client.post("/admin/tenants", json={"name": "x"}, headers=[*headers, *ADMIN.items()])
    assert_error(r, 400, "duplicate_authorization")
    assert client.post("/detect", json={"text": TEXT}, headers=auth).status_code == 200


def test_batch_encoding_equals_the_tokenizer_call(smollm2_tokenizer: Any) -> None:
    """The worker encodes through the Rust backend; ids must equal the slow path's."""
    texts = [
        TEXT,
        "  leading and trailing spaces  ",
        "naïve café — “quotes” and emoji 🌊\nnew line\ttab",
        "x" * 3000,
        "日本語のテキストと English mixed",
    ]
    expected = [smollm2_tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert detection_module.encode_texts(smollm2_tokenizer, texts) == expected
