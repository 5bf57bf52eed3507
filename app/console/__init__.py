"""The provenance console: ``/console``, a page for trust-and-safety analysts.

Server-rendered (Jinja2, autoescaped) with a few small plain-JavaScript ES modules
(``static/console.js`` imports the others) and one stylesheet, all served from this
package: no build step, nothing fetched from elsewhere at run time. The page holds the
credential in ``sessionStorage`` only and calls the JSON API (``/provenance``,
``/decode``, ``/detect``, ``/admin/audit``) with it; every text it shows goes in
through ``textContent``.

Every response under ``/console`` carries :data:`SECURITY_HEADERS`: a strict
Content-Security-Policy (scripts and styles from this origin only, no inline
script), no framing and no referrer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from pydantic import Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.deps import Credentials, RuntimeDep, get_principal, is_admin
from app.api.routes.cases import router as cases_router
from app.schemas.common import StrictModel
from app.services.runtime import Runtime, charge_client
from worldcup_core import __version__

__all__ = ["SECURITY_HEADERS", "ConsoleHeaders", "install_console"]

HERE = Path(__file__).parent
PREFIX = "/console"

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'self'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Opener-Policy": "same-origin",
}

_templates = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
)


class ConsoleHeaders:
    """ASGI middleware: the security headers on every response under ``/console``
    (the page, its static files and its session check, errors included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if k.decode("latin-1").lower() not in _LOWER
                ]
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                if path == PREFIX:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


_LOWER = {k.lower() for k in SECURITY_HEADERS}


def render_console(**context: Any) -> str:
    """The page; every value is autoescaped."""
    return _templates.get_template("console.html").render(**context)


router = APIRouter(prefix=PREFIX, include_in_schema=False)
# The page itself forgives query parameters it does not know: links arrive with tracking
# tags (``?utm_source=slack``). The API routes, the session check included, still refuse.
page_router = APIRouter(prefix=PREFIX, include_in_schema=False)


def _page(runtime: Runtime, case_id: str = "") -> HTMLResponse:
    settings = runtime.settings
    return HTMLResponse(
        render_console(
            version=__version__,
            model=runtime.model_id,
            max_chars=settings.text_chars_limit,
            groups=settings.groups,
            significance=settings.significance,
            case_id=case_id,
            batch_limit=settings.console_batch_limit,
        )
    )


@page_router.get("", response_class=HTMLResponse)
async def console_page(request: Request, runtime: RuntimeDep) -> HTMLResponse:
    return _page(runtime)


class ConsoleSession(StrictModel):
    role: str = Field(description="admin or api_key")
    tenant_id: str | None = None
    tenant_name: str | None = None
    scopes: list[str] = Field(default_factory=list)
    detail: str | None = None


@page_router.get("/cases/{case_id}", response_class=HTMLResponse)
async def case_page(case_id: str, request: Request, runtime: RuntimeDep) -> HTMLResponse:
    """A case's stable link: the console page, which opens the case once signed in
    (the credential never travels in the link). Who may see it is checked by
    ``/console/api/cases/{id}``."""
    return _page(runtime, case_id if _CASE_ID.match(case_id) else "")


_CASE_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}$")


@router.get("/session", response_model=ConsoleSession)
async def console_session(
    request: Request, runtime: RuntimeDep, credentials: Credentials
) -> ConsoleSession:
    """Who the pasted credential is (the sign-in check): rate-limited per client
    address (the API's rate and burst; a bad credential costs a token too, so it
    cannot be guessed at will); nothing is logged, and nothing secret is returned."""
    await charge_client(runtime, request.client.host if request.client else None)
    if is_admin(runtime, credentials):
        return ConsoleSession(role="admin", scopes=["provenance"])
    principal = await get_principal(runtime, credentials)
    return ConsoleSession(
        role="api_key",
        tenant_id=principal.tenant.tenant_id,
        tenant_name=principal.tenant.name,
        scopes=sorted(principal.scopes),
        detail=principal.key.detail,
    )


def install_console(app: Any, dependencies: list[Any]) -> None:
    """Mount the page, its static files and the session check on ``app``; ``dependencies``
    apply to the session check, not to the page (see ``page_router``)."""
    app.include_router(page_router)
    app.include_router(router, dependencies=dependencies)
    app.include_router(cases_router, dependencies=dependencies)
    app.mount(PREFIX + "/static", StaticFiles(directory=HERE / "static"), name="console-static")
