"""A real uvicorn server on a loopback port, for tests that need true HTTP."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from app.core.config import Settings
from app.main import create_app
from app.server import DrainingServer

# The metric names (+ the two gauges): the dashboard, the exporter and
# the API tests all check against this one list.
SERVICE_METRICS = (
    "worldcup_request_duration_seconds",
    "worldcup_generate_time_to_first_token_seconds",
    "worldcup_generate_inter_token_latency_seconds",
    "worldcup_generate_queue_time_seconds",
    "worldcup_generated_tokens_total",
    "worldcup_request_rejections_total",
    "worldcup_detections_total",
    "worldcup_queue_depth",
    "worldcup_active_sequences",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """The real app under uvicorn in a thread, on a loopback port."""

    def __init__(self, settings: Settings, startup_timeout_s: float = 180) -> None:
        self.app = create_app(settings)
        self.startup_timeout_s = startup_timeout_s
        self.port = settings.port
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        )
        self.server = DrainingServer(config, self.app)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            assert self.thread.is_alive(), "server thread died during startup"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
