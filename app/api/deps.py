"""Dependencies as ``Annotated`` aliases: handlers read like typed signatures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.errors import APIError
from app.core.config import Role, Settings
from app.core.metrics import Metrics  # noqa: F401  (Runtime field type)
from app.core.security import tokens_equal
from app.services.batcher import Batcher
from app.services.tenants import TenantService
from app.stores.base import Store, TenantRecord

bearer = HTTPBearer(auto_error=False, description="Tenant API key, or the admin token")


@dataclass
class Runtime:
    """What the lifespan builds once and every request shares."""

    settings: Settings
    metrics: Metrics
    store: Store
    tenants: TenantService
    tokenizer: Any
    model_id: str
    batcher: Batcher | None = None  # None in the detector role
    warm: bool = False
    draining: bool = False


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


async def get_current_tenant(runtime: RuntimeDep, credentials: Credentials) -> TenantRecord:
    """The tenant comes only from the API key, never from the request body."""
    if credentials is None:
        raise _unauthorized("missing Authorization: Bearer <api key>")
    tenant = await runtime.tenants.tenant_for_api_key(credentials.credentials)
    if tenant is None:
        raise _unauthorized("invalid API key")
    return tenant


async def require_admin(runtime: RuntimeDep, credentials: Credentials) -> None:
    token = runtime.settings.admin_token
    assert token is not None
    if credentials is None or not tokens_equal(credentials.credentials, token.get_secret_value()):
        raise APIError(
            401, "admin token required", "invalid_admin_token", {"WWW-Authenticate": "Bearer"}
        )


def require_generator(runtime: RuntimeDep) -> Batcher:
    if runtime.settings.role is not Role.GENERATOR or runtime.batcher is None:
        raise APIError(
            501, "this deployment is detector-only: it serves /decode and /detect", "detector_role"
        )
    if runtime.draining:
        raise APIError(503, "the server is shutting down", "draining", {"Retry-After": "5"})
    return runtime.batcher


CurrentTenant = Annotated[TenantRecord, Depends(get_current_tenant)]
AdminDep = Annotated[None, Depends(require_admin)]
BatcherDep = Annotated[Batcher, Depends(require_generator)]
