"""One error envelope for everything: ``{"error": {"message", "type", "code"}}``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.core.security import KeyUnwrapError
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
        self, status: int, message: str, code: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers


def envelope(status: int, message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "code": code}}


def error_response(
    status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(envelope(status, message, code), status_code=status, headers=headers)


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
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, _describe(exc), "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            code, message = "malformed_body", "the body is not valid UTF-8 JSON"
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, message, code, headers)

    @app.exception_handler(StoreUnavailable)
    async def _store(_: Request, exc: StoreUnavailable) -> JSONResponse:
        logger.warning("store unavailable: %s", exc)
        return error_response(
            503, "the registry store is unavailable; retry shortly", "store_unavailable",
            {"Retry-After": "2"},
        )  # fmt: skip

    @app.exception_handler(KeyUnwrapError)
    async def _unwrap(_: Request, exc: KeyUnwrapError) -> JSONResponse:
        # A deployment fault (wrong or missing master key), not a client error. The
        # message names tenant and version only, never key material.
        logger.error("cannot unwrap a watermark key: %s", exc)
        return error_response(
            503, "watermark key material is unavailable on this server (master key mismatch)",
            "key_unavailable", {"Retry-After": "30"},
        )  # fmt: skip

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette runs this outside the middlewares, where the request id context is
        # already reset: take the id RequestContext left in the scope.
        request_id = str(request.scope.get("state", {}).get("request_id", "-"))
        logger.exception("unhandled error", extra={"fields": {"request_id": request_id}})
        return error_response(
            500, "internal error; it has been logged", "internal_error",
            {"x-request-id": request_id},
        )  # fmt: skip
