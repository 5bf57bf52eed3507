"""Small operational guarantees: private store files, the active-sequences gauge after a
cancel, the request id on every error log line, and readiness on a wiped store."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from test_service_api import ADMIN, make_settings, new_tenant
from typer.testing import CliRunner

from app.core.logging import JsonFormatter
from app.core.metrics import Metrics
from app.engines.hf import HFEngine
from app.main import create_app
from app.stores.sqlite import SQLiteStore
from worldcup_cli.main import app as cli
from worldcup_core import SamplingConfig
from worldcup_core.generation import GenerationRequest, GenerationResult
from worldcup_core.models import load_model

REDIS_URL = "redis://127.0.0.1:6379/15"


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The most permissive umask: files must still come out 0600."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------- file modes
@pytest.mark.anyio
async def test_store_files_are_private_whatever_the_umask(
    tmp_path: Path, loose_umask: None
) -> None:
    path = tmp_path / "registry.sqlite3"
    store = SQLiteStore(path)
    try:
        await store.ensure_marker("m")  # a write: the WAL and shared-memory files exist
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(f.exists() for f in files), list(tmp_path.iterdir())
        assert {f.name: oct(mode(f)) for f in files} == {f.name: "0o600" for f in files}
    finally:
        await store.close()


def test_keygen_file_is_private_whatever_the_umask(tmp_path: Path, loose_umask: None) -> None:
    out = tmp_path / "my.key"
    result = CliRunner().invoke(cli, ["keygen", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert mode(out) == 0o600 and len(out.read_text().strip()) == 64


# --------------------------------------------------------------------------- the gauge
@pytest.mark.anyio
async def test_active_sequences_gauge_is_right_after_a_cancel(tiny_model_dir: Path) -> None:
    lm = load_model(str(tiny_model_dir))
    metrics = Metrics()
    engine = HFEngine(lm.model, lm.eos_token_ids, lm.pad_token_id, metrics, 4, 8)
    engine.start()

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("worldcup_active_sequences")

    try:
        sampling = SamplingConfig(max_new_tokens=10_000, min_new_tokens=10_000, seed=1)
        job = engine.submit(GenerationRequest([1, 2, 3], sampling))
        await asyncio.wait_for(job.events.get(), timeout=30)  # running: one token out
        assert gauge() == 1.0
        engine.cancel(job)
        while not job.done:  # the engine drops it between two steps
            await asyncio.sleep(0.01)
        # no other job runs, so no later step would have refreshed it
        assert gauge() == 0.0
    finally:
        engine.stop()


@pytest.mark.anyio
async def test_the_engine_thread_survives_a_failure_outside_a_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure in admission or a cancel's cleanup fails the running jobs (their
    requests answer 500) and the engine goes on serving the next ones; it used to kill
    the thread, and every later request waited for its deadline."""
    lm = load_model(str(tiny_model_dir))
    engine = HFEngine(lm.model, lm.eos_token_ids, lm.pad_token_id, Metrics(), 4, 8)
    engine.start()
    try:
        sampling = SamplingConfig(max_new_tokens=10_000, min_new_tokens=10_000, seed=1)
        job = engine.submit(GenerationRequest([1, 2, 3], sampling))
        await asyncio.wait_for(job.events.get(), timeout=30)

        def broken(rows: Any) -> None:
            raise RuntimeError("cleanup failed")

        monkeypatch.setattr(engine._batch, "cancel", broken)  # noqa: SLF001
        engine.cancel(job)
        item = None
        while not isinstance(item, BaseException):
            item = await asyncio.wait_for(job.events.get(), timeout=30)
        assert isinstance(item, RuntimeError) and job.done and engine.in_flight == 0
        short = SamplingConfig(max_new_tokens=4, min_new_tokens=4, seed=2)
        after = engine.submit(GenerationRequest([1, 2, 3], short))
        results = []
        while not results:
            event = await asyncio.wait_for(after.events.get(), timeout=30)
            if isinstance(event, GenerationResult):
                results.append(event)
        assert len(results[0].token_ids) == 4
    finally:
        engine.stop()


# --------------------------------------------------------------------------- logs
class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


def test_every_error_log_line_carries_the_request_id(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(make_settings(tiny_model_dir, tmp_path))
    with TestClient(app, raise_server_exceptions=False) as client:
        _, auth = new_tenant(client)
        collect = Collect()
        logging.getLogger("worldcup").addHandler(collect)
        try:

            async def broken(*_: Any, **__: Any) -> Any:
                raise RuntimeError("boom")

            monkeypatch.setattr(app.state.runtime.watermark, "detector", broken)
            r = client.post(
                "/detect", json={"text": "x"}, headers={**auth, "X-Request-ID": "req-e-1"}
            )
        finally:
            logging.getLogger("worldcup").removeHandler(collect)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["x-request-id"] == "req-e-1"
    errors = [line for line in collect.lines if line["level"] == "error"]
    assert [line["msg"] for line in errors] == ["unhandled error"], collect.lines
    assert all(line["request_id"] == "req-e-1" for line in errors), errors
    assert "boom" in errors[0]["exc"]


# --------------------------------------------------------------------------- readiness
def test_ready_fails_when_the_sqlite_store_lost_the_marker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = make_settings(tiny_model_dir, tmp_path)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert client.get("/ready").status_code == 200
        with sqlite3.connect(settings.sqlite_path) as conn:
            conn.execute("DELETE FROM marker")
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_marker_lost", r.text
        assert "wiped" in r.json()["error"]["message"]
    # a fresh start on the (empty) store writes a new marker: ready again
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert client.get("/ready").status_code == 200


def test_ready_fails_when_redis_comes_back_empty(tiny_model_dir: Path, tmp_path: Path) -> None:
    prefix = f"hard{secrets.token_hex(6)}"
    settings = make_settings(tiny_model_dir, tmp_path, redis_url=REDIS_URL, redis_prefix=prefix)
    raw = redis.Redis.from_url(REDIS_URL)
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            _, auth = new_tenant(client)
            assert client.get("/ready").status_code == 200
            wiped = list(raw.scan_iter(match=f"{prefix}:*"))
            assert wiped and raw.delete(*wiped) == len(wiped)  # Redis restarted empty
            r = client.get("/ready")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_marker_lost"
            # ... and this is why: every tenant is gone
            assert client.post("/detect", json={"text": "x"}, headers=auth).status_code == 401
            assert client.get("/admin/audit", headers=ADMIN).status_code == 200
    finally:
        left = list(raw.scan_iter(match=f"{prefix}:*"))
        if left:
            raw.delete(*left)
        raw.close()
