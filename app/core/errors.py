"""One error envelope for everything: ``{"error": {"message", "type", "code"}}``.

The OpenAI-compatible routes (``/v1/...``) get OpenAI's envelope instead,
``{"error": {"message", "type", "param", "code"}}``, and 400 where the rest of
the service says 422: the OpenAI SDKs map status codes to exception types.

The error type and the envelopes live here, below every layer that raises or
renders them; the exception handlers that turn them into responses are in
:mod:`app.api.errors`.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """Raised by services, routes and dependencies; rendered as the envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,  # the offending request field (OpenAI envelope only)
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers
        self.param = param


def envelope(status: int, message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "code": code}}


OPENAI_PREFIX = "/v1/"


def openai_status(status: int) -> int:
    return 400 if status == 422 else status


def openai_envelope(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    kind = _TYPES.get(openai_status(status), "server_error" if status >= 500 else "api_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
