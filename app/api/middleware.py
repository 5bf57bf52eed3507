"""Pure-ASGI middlewares, so streaming responses pass through untouched."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.errors import OPENAI_PREFIX, envelope, openai_envelope
from app.core.logging import request_id_var
from app.core.metrics import Metrics

logger = logging.getLogger("worldcup.access")


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str,
    path: str = "",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """The error envelope (OpenAI's on ``/v1``) as a whole ASGI response."""
    openai = path.startswith(OPENAI_PREFIX)
    error = (
        openai_envelope(status, message, code, None) if openai else envelope(status, message, code)
    )
    body = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class SingleAuthorization:
    """400 for a request with more than one ``Authorization`` header.

    Starlette would silently use the first; a proxy or client in between might
    use the last. Refusing the ambiguity keeps everyone reading the same
    credential (and the error never echoes either value).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            count = sum(1 for name, _ in scope.get("headers", []) if name == b"authorization")
            if count > 1:
                await send_error(
                    send, 400, "more than one Authorization header", "duplicate_authorization",
                    str(scope.get("path", "")),
                )  # fmt: skip
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """413 before the app reads a body larger than ``max_bytes``.

    Bulk routes (paths ending in ``/batch``, and ``/provenance/collection``) get their
    own, larger limit. The 413 says what to do instead: on a route that scores one
    text, split it (``text_chars``, the per-text limit) or use the bulk routes; on a
    bulk route, send several batches.
    """

    SCORING = ("/decode", "/detect", "/provenance")
    BULK = ("/batch", "/provenance/collection")  # paths that take many texts

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_batch_bytes: int | None = None,
        text_chars: int | None = None,
    ) -> None:
        self.app, self.default_max = app, max_bytes
        self.batch_max = max_batch_bytes if max_batch_bytes is not None else max_bytes
        self.text_chars = text_chars

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = (
            self.batch_max if str(scope.get("path", "")).endswith(self.BULK) else self.default_max
        )
        await self._limited(scope, receive, send, limit)

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    await send_error(
                        send, 413, self._message(limit, scope["path"]), "request_too_large",
                        scope["path"],
                    )  # fmt: skip
                    return
        # No (or a lying) Content-Length: read the body here, before the app, and
        # count. An exception raised from inside the app's receive() is swallowed
        # by FastAPI's body parsing (an oversized chunked upload got a 400), so
        # the app gets the buffered body (at most max_bytes) replayed instead.
        chunks: list[bytes] = []
        seen = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                await send_error(
                    send, 413, self._message(limit, scope["path"]), "request_too_large",
                    scope["path"],
                )  # fmt: skip
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)
        replayed = False

        async def replay_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls: disconnect detection

        await self.app(scope, replay_receive, send)

    def _message(self, limit: int, path: str) -> str:
        said = f"request body exceeds {limit} bytes"
        if path.endswith("/collection"):
            return f"{said} (the bulk routes' limit): read fewer texts together"
        if path.endswith(self.BULK):
            return f"{said}: send the texts in several batches"
        if path in self.SCORING and self.text_chars is not None:
            return (
                f"{said}: split the text into parts of at most {self.text_chars} characters "
                "and score each; /decode/batch and /detect/batch take many texts in one "
                f"request (bodies up to {self.batch_max} bytes)"
            )
        return said


class RequestContext:
    """Request id, access log and the latency histogram (route template labels only)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming[:64] if incoming.isprintable() and incoming else uuid.uuid4().hex
        token = request_id_var.set(request_id)
        # for the 500 handler, which runs outside this middleware (after the reset)
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - start
            route: Any = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.request_duration.labels(endpoint, str(status)).observe(elapsed)
            logger.info(
                "request",
                extra={
                    "fields": {
                        "method": scope.get("method"),
                        "endpoint": endpoint,
                        "status": status,
                        "ms": round(elapsed * 1000, 2),
                    }
                },
            )
            request_id_var.reset(token)
