"""Run the app under uvicorn; SIGTERM flips readiness to 503 before the drain starts.

One process per accelerator: the model lives in this process and batching
happens inside it, so there is deliberately no ``--workers``.
"""

from __future__ import annotations

import socket
import sys
import types

import uvicorn
from fastapi import FastAPI

from app.core.config import Settings
from app.main import create_app


class DrainingServer(uvicorn.Server):
    """Marks the runtime as draining the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start (the app's lifespan first: the model loads there), then say where the
        service listens, once it does: one line on stderr, the port as bound."""
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            bound = [s.getsockname() for server in self.servers for s in server.sockets or ()]
            if bound:
                url = listening_url(self.config.host, int(bound[0][1]), self.config.is_ssl)
                sys.stderr.write(f"listening on {url} (API docs: {url}/docs)\n")
                sys.stderr.flush()

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        runtime = getattr(self._app.state, "runtime", None)
        if runtime is not None:
            runtime.draining = True
        super().handle_exit(sig, frame)


def listening_url(host: str | None, port: int, ssl: bool = False) -> str:
    """``http://HOST:PORT`` as a client types it (an IPv6 host in brackets)."""
    name = host or "0.0.0.0"
    return f"{'https' if ssl else 'http'}://{f'[{name}]' if ':' in name else name}:{port}"


def run(settings: Settings) -> None:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        proxy_headers=True,
    )
    DrainingServer(config, app).run()
