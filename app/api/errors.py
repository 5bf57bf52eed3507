"""The exception handlers: every error, rendered as the envelope of
:mod:`app.core.errors` (OpenAI's on the ``/v1/...`` routes)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from app.core.errors import OPENAI_PREFIX, APIError, envelope, openai_envelope, openai_status
from app.core.security import KeyUnwrapError
from app.services.cpu import Overloaded
from app.stores.base import StoreUnavailable

logger = logging.getLogger("worldcup.api")


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


_HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def allowed_methods(request: Request, fallback: str | None) -> str | None:
    """A 405's ``Allow``: every method the schema documents for this path.

    Starlette names only the methods of the first route whose path matches, and a
    path that two routes share (``GET`` and ``POST /admin/tenants/{id}/api-keys``)
    would then omit one the schema documents. A path the schema leaves out keeps
    Starlette's answer (``fallback``)."""
    paths = request.app.openapi().get("paths", {})
    for template, item in paths.items():
        regex, _, _ = compile_path(template)
        if regex.match(request.url.path):
            return ", ".join(m.upper() for m in _HTTP_METHODS if m in item)
    return fallback


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


def _json_error(exc: RequestValidationError) -> str | None:
    """Where a body that is not JSON broke, from the parser's error: ``body: malformed
    JSON at line L, column C (character P): reason``; None for any other error."""
    errors = exc.errors()
    if not errors or errors[0].get("type") != "json_invalid":
        return None
    err = errors[0]
    loc = err.get("loc", ())
    pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    reason = str(err.get("ctx", {}).get("error", "invalid JSON"))
    doc = exc.body if isinstance(exc.body, str) else None
    if pos is None or doc is None:
        return f"body: malformed JSON: {reason}"
    line = doc.count("\n", 0, pos) + 1
    column = pos - doc.rfind("\n", 0, pos)  # 1-based, as the json module counts
    return f"body: malformed JSON at line {line}, column {column} (character {pos}): {reason}"


def _not_utf8(exc: StarletteHTTPException) -> str | None:
    """A body that could not be read as JSON because it is not UTF-8: where it broke."""
    cause = exc.__cause__
    if exc.status_code != 400 or not isinstance(cause, UnicodeDecodeError):
        return None
    return f"body: not UTF-8 at byte {cause.start} ({cause.reason}); send UTF-8 JSON"


def _not_json(request: Request, exc: RequestValidationError) -> str | None:
    """What was declared instead, when a body was not read as JSON because its content
    type is not JSON's (or missing), or None."""
    if any(tuple(e.get("loc", ())) != ("body",) for e in exc.errors()[:1]):
        return None
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return None
    return f"got {media}" if media else "no Content-Type was sent"


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
        if (wrong := _not_json(request, exc)) is not None:  # curl -d sends a form
            message = f"body: send JSON, with the header Content-Type: application/json ({wrong})"
            return error_response(422, message, "invalid_request", path=path)
        if (broken := _json_error(exc)) is not None:  # not JSON at all: 400, as not UTF-8
            return error_response(400, broken, "invalid_json", path=path)
        return error_response(422, _describe(exc), "invalid_request", path=path, param=_param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if (not_utf8 := _not_utf8(exc)) is not None:
            code, message = "invalid_json", not_utf8
        elif exc.status_code == 400 and "parsing the body" in message:
            code, message = "malformed_body", "the body is not valid UTF-8 JSON"
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:
            allow = allowed_methods(request, (headers or {}).get("Allow"))
            headers = {**(headers or {}), **({"Allow": allow} if allow is not None else {})}
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
        message = (
            "this tenant has as many requests in progress as it may; retry shortly"
            if exc.scope == "share"
            else "the server is at capacity; retry shortly"
        )
        return error_response(
            503, message, "overloaded",
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
