"""Run the app under uvicorn; SIGTERM flips readiness to 503 before the drain starts.

One process per accelerator: the model lives in this process and batching
happens inside it, so there is deliberately no ``--workers``.
"""

from __future__ import annotations

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

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        runtime = getattr(self._app.state, "runtime", None)
        if runtime is not None:
            runtime.draining = True
        super().handle_exit(sig, frame)


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
