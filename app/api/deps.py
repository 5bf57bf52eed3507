"""Dependencies as ``Annotated`` aliases: handlers read like typed signatures."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.core.config import Role
from app.core.errors import APIError
from app.core.security import tokens_equal
from app.engines.base import Engine
from app.services.cpu import ADMIN_SHARE, set_share
from app.services.disclosure import FIXED_PAYLOAD_SCOPE, PROVENANCE_SCOPE
from app.services.provenance import Investigator
from app.services.runtime import Runtime, charge
from app.services.tenants import Principal
from app.stores.base import TenantRecord

TENANT_GRANTED = (PROVENANCE_SCOPE, FIXED_PAYLOAD_SCOPE)

bearer = HTTPBearer(auto_error=False, description="Tenant API key, or the admin token")


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


async def get_principal(runtime: RuntimeDep, credentials: Credentials) -> Principal:
    """The tenant comes only from the API key, never from the request body."""
    if credentials is None:
        raise _unauthorized("missing Authorization: Bearer <api key>")
    principal = await runtime.tenants.authenticate(credentials.credentials)
    if principal is None and _admin_token(runtime, credentials):
        raise _unauthorized(
            "this is the admin token, not an API key: tenant routes take one of a tenant's "
            "API keys (POST /admin/tenants creates a tenant and returns its first key)"
        )
    if principal is None:
        raise _unauthorized("invalid or revoked API key")
    set_share(principal.tenant.tenant_id)  # this request's share of the CPU pool
    return principal


def _check_scope(principal: Principal, scope: str) -> None:
    if scope not in principal.scopes:
        hint = " (and the tenant's grant)" if scope in TENANT_GRANTED else ""
        raise APIError(
            403,
            f"this API key lacks the '{scope}' scope; an admin can issue a key with it{hint}",
            "missing_scope",
        )


def scoped_key(scope: str, charged: bool = True) -> Callable[..., Awaitable[Principal]]:
    """A dependency: an API key holding ``scope``; charged one rate token unless
    the route charges per item itself (bulk routes)."""

    async def dependency(runtime: RuntimeDep, credentials: Credentials) -> Principal:
        principal = await get_principal(runtime, credentials)
        _check_scope(principal, scope)
        if charged:
            await charge(runtime, principal.tenant)
        return principal

    return dependency


def _admin_token(runtime: Runtime, credentials: HTTPAuthorizationCredentials | None) -> bool:
    token = runtime.settings.admin_token
    assert token is not None
    return credentials is not None and tokens_equal(
        credentials.credentials, token.get_secret_value()
    )


def is_admin(runtime: Runtime, credentials: HTTPAuthorizationCredentials | None) -> bool:
    """Whether the credentials are the admin token (constant-time compare)."""
    admin = _admin_token(runtime, credentials)
    if admin:
        set_share(ADMIN_SHARE)  # admin work has its own share of the CPU pool
    return admin


async def require_admin(runtime: RuntimeDep, credentials: Credentials) -> None:
    if not is_admin(runtime, credentials):
        raise APIError(
            401, "admin token required", "invalid_admin_token", {"WWW-Authenticate": "Bearer"}
        )


async def rate_limited_key(runtime: RuntimeDep, credentials: Credentials) -> Principal:
    """Generation routes: a key with the ``generate`` scope, charged one token."""
    principal = await get_principal(runtime, credentials)
    _check_scope(principal, "generate")
    await charge(runtime, principal.tenant)
    return principal


async def rate_limited_tenant(runtime: RuntimeDep, credentials: Credentials) -> TenantRecord:
    """As :func:`rate_limited_key`, for routes that need only the tenant."""
    return (await rate_limited_key(runtime, credentials)).tenant


async def generating_key(runtime: RuntimeDep, credentials: Credentials) -> Principal:
    """Generation routes that charge per sample themselves (OpenAI ``n``): a key with
    the ``generate`` scope, not yet charged."""
    principal = await get_principal(runtime, credentials)
    _check_scope(principal, "generate")
    return principal


async def require_provenance(runtime: RuntimeDep, credentials: Credentials) -> Investigator:
    if is_admin(runtime, credentials):
        return Investigator("admin", True)
    principal = await get_principal(runtime, credentials)
    _check_scope(principal, PROVENANCE_SCOPE)
    tenant = principal.tenant
    await charge(runtime, tenant)
    return Investigator(f"tenant:{tenant.tenant_id}", False, principal)


def require_generator(runtime: RuntimeDep) -> Engine:
    if runtime.settings.role is not Role.GENERATOR or runtime.engine is None:
        raise APIError(
            501, "this deployment is detector-only: it serves /decode and /detect", "detector_role"
        )
    if runtime.draining:
        raise APIError(503, "the server is shutting down", "draining", {"Retry-After": "5"})
    return runtime.engine


def _query_names(dependant: Any) -> set[str]:
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def known_query_parameters(request: Request) -> None:
    """Refuse query parameters the route does not declare: the schema is the contract,
    and a silently ignored one (``?limt=5``) reads as if it had applied."""
    if not request.query_params:
        return
    dependant = getattr(request.scope.get("route"), "dependant", None)
    if dependant is None:
        return
    allowed = _query_names(dependant)
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) or "none"
        raise APIError(
            422,
            f"unknown query parameter {unknown[0]!r} (this route takes: {takes})",
            "unknown_query_parameter",
            param=unknown[0],
        )


AdminDep = Annotated[None, Depends(require_admin)]
# generate scope, charged one token
CurrentTenant = Annotated[TenantRecord, Depends(rate_limited_tenant)]
# generate scope, as the key that asks (its other scopes decide client-chosen payloads)
GeneratingKey = Annotated[Principal, Depends(rate_limited_key)]
UnchargedKey = Annotated[Principal, Depends(generating_key)]
DetectKey = Annotated[Principal, Depends(scoped_key("detect"))]
DecodeKey = Annotated[Principal, Depends(scoped_key("decode"))]
# bulk routes charge per text themselves
DetectBatchKey = Annotated[Principal, Depends(scoped_key("detect", charged=False))]
DecodeBatchKey = Annotated[Principal, Depends(scoped_key("decode", charged=False))]
InvestigatorDep = Annotated[Investigator, Depends(require_provenance)]
EngineDep = Annotated[Engine, Depends(require_generator)]
