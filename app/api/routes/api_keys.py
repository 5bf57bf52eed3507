"""Admin endpoints for a tenant's API keys: create (secret shown once), list (never
a secret or its hash), revoke one key without touching the others."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Path

from app.api.deps import AdminDep, RuntimeDep
from app.api.routes.admin import TenantId
from app.core.errors import APIError
from app.schemas.api_keys import ApiKeyCreated, ApiKeyList, ApiKeyOut, CreateApiKey
from app.schemas.common import ERROR_RESPONSES
from app.services.tenants import UnknownApiKey, UnknownTenant
from app.stores.base import ApiKeyRecord

router = APIRouter(prefix="/admin", tags=["admin"])

KeyId = Annotated[str, Path(pattern=r"^([0-9a-f]{16}|primary)$", description="API key id")]


def _time(ts: float | None) -> dt.datetime | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, tz=dt.UTC)


def _out(key: ApiKeyRecord) -> ApiKeyOut:
    return ApiKeyOut(
        key_id=key.key_id,
        name=key.name,
        scopes=list(key.scopes),
        detail="verdict" if key.detail == "verdict" else "full",
        created_at=dt.datetime.fromtimestamp(key.created_at, tz=dt.UTC),
        revoked_at=_time(key.revoked_at),
    )


def _no_tenant() -> APIError:
    return APIError(404, "no such tenant", "unknown_tenant")


@router.post(
    "/tenants/{tenant_id}/api-keys",
    response_model=ApiKeyCreated,
    status_code=201,
    responses=ERROR_RESPONSES,
)
async def create_api_key(
    tenant_id: TenantId, body: CreateApiKey, runtime: RuntimeDep, _: AdminDep
) -> ApiKeyCreated:
    """A new API key for the tenant, with its scopes and detail level. The secret is
    in this answer only; the store keeps its SHA-256."""
    try:
        record, secret = await runtime.tenants.create_api_key(
            tenant_id, body.name, tuple(dict.fromkeys(body.scopes)), body.detail
        )
    except UnknownTenant:
        raise _no_tenant() from None
    return ApiKeyCreated(**_out(record).model_dump(), api_key=secret)


@router.get("/tenants/{tenant_id}/api-keys", response_model=ApiKeyList, responses=ERROR_RESPONSES)
async def list_api_keys(tenant_id: TenantId, runtime: RuntimeDep, _: AdminDep) -> ApiKeyList:
    """Every key of the tenant, revoked ones included, oldest first. ``primary`` is
    the key the tenant was created with."""
    try:
        keys = await runtime.tenants.api_keys(tenant_id)
    except UnknownTenant:
        raise _no_tenant() from None
    return ApiKeyList(keys=[_out(k) for k in keys])


@router.delete(
    "/tenants/{tenant_id}/api-keys/{key_id}", response_model=ApiKeyOut, responses=ERROR_RESPONSES
)
async def revoke_api_key(
    tenant_id: TenantId, key_id: KeyId, runtime: RuntimeDep, _: AdminDep
) -> ApiKeyOut:
    """Revoke one key (idempotent: the first revocation time stays). Other replicas
    refuse it within the tenant cache TTL (``WORLDCUP_CACHE_TTL_S``, 5 s)."""
    try:
        record = await runtime.tenants.revoke_api_key(tenant_id, key_id)
    except UnknownTenant:
        raise _no_tenant() from None
    except UnknownApiKey:
        raise APIError(404, "no such API key", "unknown_api_key") from None
    return _out(record)
