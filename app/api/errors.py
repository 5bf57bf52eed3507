"""One error envelope for everything: ``{"error": {"message", "type", "code"}}``.

The OpenAI-compatible routes (``/v1/...``) get OpenAI's envelope instead,
``{"error": {"message", "type", "param", "code"}}``, and 400 where the rest of
the service says 422: the OpenAI SDKs map status codes to exception types.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.security import KeyUnwrapError
from app.services.cpu import Overloaded
from app.stores.base import StoreUnavailable

logger = logging.getLogger("worldcup.api")

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
    """Raised by routes and dependencies; rendered as the envelope."""

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


def error_response(
    status: int,
    message: str,
    code: str,
    headers: dict[str, str] | None = None,
    *,
    path: str = "",
    param: str | None = None,
) -> JSONResponse:
    if path.startswith(OPENAI_PREFIX):
        body = openai_envelope(status, message, code, param)
        return JSONResponse(body, status_code=openai_status(status), headers=headers)
    return JSONResponse(envelope(status, message, code), status_code=status, headers=headers)


def _param(exc: RequestValidationError) -> str | None:
    """The field a validation error is about, OpenAI style (``messages.0.role``).

    Pydantic puts the branch of a union into the location (``stop.constrained-str``,
    ``content.list[TextPart].0.type``): those parts are not fields and are dropped.
    """
    for err in exc.errors()[:1]:
        if err.get("type") == "json_invalid":
            return None
        fields = []
        for part in (str(p) for p in err.get("loc", ()) if p != "body"):
            if any(c in part for c in "[]()-") or part in _UNION_TAGS:
                continue
            fields.append(part)
        return ".".join(fields) or None
    return None


_UNION_TAGS = {"str", "list", "dict", "bool", "float"}  # not "int": payload.int is a field


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "json_invalid":
            loc, msg = "body", "malformed JSON"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        path = request.url.path
        return error_response(
            exc.status, exc.message, exc.code, exc.headers, path=path, param=exc.param
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        return error_response(422, _describe(exc), "invalid_request", path=path, param=_param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            code, message = "malformed_body", "the body is not valid UTF-8 JSON"
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, message, code, headers, path=request.url.path)

    @app.exception_handler(StoreUnavailable)
    async def _store(request: Request, exc: StoreUnavailable) -> JSONResponse:
        logger.warning("store unavailable: %s", exc)
        return error_response(
            503, "the registry store is unavailable; retry shortly", "store_unavailable",
            {"Retry-After": "2"}, path=request.url.path,
        )  # fmt: skip

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        # Shed at once: a job admitted now would wait behind max_pending others.
        request.app.state.metrics.rejections.labels("overloaded").inc()
        return error_response(
            503, "the server is at capacity; retry shortly", "overloaded",
            {"Retry-After": str(exc.retry_after_s)}, path=request.url.path,
        )  # fmt: skip

    @app.exception_handler(KeyUnwrapError)
    async def _unwrap(request: Request, exc: KeyUnwrapError) -> JSONResponse:
        # A deployment fault (wrong or missing master key), not a client error. The
        # message names tenant and version only, never key material.
        logger.error("cannot unwrap a watermark key: %s", exc)
        return error_response(
            503, "watermark key material is unavailable on this server (master key mismatch)",
            "key_unavailable", {"Retry-After": "30"}, path=request.url.path,
        )  # fmt: skip

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette runs this outside the middlewares, where the request id context is
        # already reset: take the id RequestContext left in the scope.
        request_id = str(request.scope.get("state", {}).get("request_id", "-"))
        logger.exception("unhandled error", extra={"fields": {"request_id": request_id}})
        return error_response(
            500, "internal error; it has been logged", "internal_error",
            {"x-request-id": request_id}, path=request.url.path,
        )  # fmt: skip
