"""Graceful shutdown: SIGTERM flips readiness, in-flight generations finish, then exit."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import LiveServer, free_port

from app.core.config import Settings

ADMIN = "shutdown-admin-token-1a2b3c"


def _settings(model_dir: Path, tmp_path: Path, **overrides: Any) -> Settings:
    """A loopback server on the tiny model and a private SQLite file; nothing from env."""
    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        port=free_port(),
        model_path=str(model_dir),
        sqlite_path=tmp_path / "db.sqlite3",
        redis_url=None,
        master_key="7c" * 32,
        admin_token=ADMIN,
        **overrides,
    )


def test_sigterm_drains_in_flight_stream(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = _settings(tiny_model_dir, tmp_path, drain_timeout_s=20)
    server = LiveServer(settings).__enter__()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post(
                "/admin/tenants",
                json={"name": "t", "scopes": ["fixed_payload"]},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
            body = {
                "prompt": "Once upon a time",
                "max_new_tokens": 400,
                "min_new_tokens": 400,
                "payload": {"bits": "10110011"},
                "stream": True,
            }
            lines: list[str] = []
            first_token = threading.Event()

            def consume() -> None:
                with http.stream("POST", "/generate", json=body, headers=auth) as resp:
                    for line in resp.iter_lines():
                        if line:
                            lines.append(line)
                            first_token.set()

            reader = threading.Thread(target=consume)
            reader.start()
            assert first_token.wait(30), "no token streamed"
            server.server.handle_exit(signal.SIGTERM, None)
            runtime = server.app.state.runtime
            assert runtime.draining  # readiness flips before anything else

            async def during_drain() -> tuple[int, httpx.Response]:
                transport = httpx.ASGITransport(app=server.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
                    ready = (await c.get("/ready")).status_code
                    fresh = await c.post("/generate", json={**body, "stream": False}, headers=auth)
                    return ready, fresh

            ready, fresh = asyncio.run(during_drain())
            assert ready == 503
            # a new generation is refused while the old one finishes
            assert fresh.status_code == 503, fresh.text
            assert fresh.json()["error"]["code"] == "draining"
            assert fresh.headers["Retry-After"] == "5"
            reader.join(timeout=60)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]"
        result = json.loads(lines[lines.index("event: result") + 1][6:])
        assert result["num_tokens"] == 400  # finished, not cut off
        started = time.monotonic()
        server.thread.join(timeout=30)
        assert not server.thread.is_alive() and time.monotonic() - started < 30
    finally:
        server.__exit__()


def test_client_disconnect_stops_its_sequence(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = _settings(tiny_model_dir, tmp_path)
    with LiveServer(settings) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post(
            "/admin/tenants",
            json={"name": "t", "scopes": ["fixed_payload"]},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
        engine = server.app.state.runtime.engine
        for stream in (True, False):
            body = {
                "prompt": "Tell me everything",
                "max_new_tokens": 1000,
                "min_new_tokens": 1000,
                "payload": {"bits": "1011"},
                "stream": stream,
            }
            with httpx.Client(base_url=server.url, timeout=60) as client:
                if stream:
                    with client.stream("POST", "/generate", json=body, headers=auth) as resp:
                        next(resp.iter_lines())
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        client.post("/generate", json=body, headers=auth, timeout=1.0)
                assert engine.in_flight == 1
            deadline = time.monotonic() + 10
            while engine.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.in_flight == 0, "the sequence kept generating for a gone client"


def test_the_server_says_where_it_listens_once_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    """`make run` (worldcup serve) prints one "listening on http://HOST:PORT" line on
    stderr once the socket is bound, with the port it really got (0 asks for any)."""
    import uvicorn
    from fastapi import FastAPI

    from app.server import DrainingServer

    app = FastAPI()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off")
    server = DrainingServer(config, app)

    async def start_and_ask() -> tuple[int, int]:
        serving = asyncio.create_task(server.serve())
        try:
            async with asyncio.timeout(30):
                while not server.started:
                    await asyncio.sleep(0.01)
            port = int(server.servers[0].sockets[0].getsockname()[1])
            async with httpx.AsyncClient() as client:
                status = (await client.get(f"http://127.0.0.1:{port}/docs")).status_code
        finally:
            server.should_exit = True
            await serving
        return port, status

    port, status = asyncio.run(start_and_ask())
    lines = [line for line in capsys.readouterr().err.splitlines() if "listening" in line]
    assert lines == [
        f"listening on http://127.0.0.1:{port} (API docs: http://127.0.0.1:{port}/docs)"
    ]
    assert port > 0 and status == 200
