"""Admin endpoints (admin token): tenants, scopes, key rotation, master-key rotation,
registry lookup and the provenance audit log."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Path, Query

from app.api.deps import AdminDep, RuntimeDep
from app.core.errors import APIError
from app.schemas.admin import (
    AuditLog,
    CreateTenant,
    KeyRotated,
    RegistryEntryOut,
    RetentionOut,
    Rewrapped,
    SetRetention,
    SetScopes,
    SweepOut,
    TenantCreated,
    TenantList,
    TenantOut,
)
from app.schemas.common import ERROR_RESPONSES
from app.services import admin
from app.services.tenants import UnknownTenant
from app.stores.base import Conflict

router = APIRouter(prefix="/admin", tags=["admin"])

TenantId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="Tenant id")]


@router.post("/tenants", response_model=TenantCreated, status_code=201, responses=ERROR_RESPONSES)
async def create_tenant(body: CreateTenant, runtime: RuntimeDep, _: AdminDep) -> TenantCreated:
    scopes = tuple(dict.fromkeys(body.scopes))
    try:
        tenant_id, api_key = await runtime.tenants.create_tenant(body.name, scopes)
    except Conflict:
        raise APIError(409, f"a tenant named {body.name!r} exists", "tenant_exists") from None
    return TenantCreated(
        tenant_id=tenant_id, name=body.name, api_key=api_key, key_version=1, scopes=list(scopes)
    )


@router.get("/tenants", response_model=TenantList, responses=ERROR_RESPONSES)
async def list_tenants(
    runtime: RuntimeDep,
    _: AdminDep,
    narrow_context: Annotated[
        bool,
        Query(
            description="Only the tenants whose current key version has a narrower context "
            "than new key versions get: the ones to rotate (SECURITY.md, Forgery and framing)."
        ),
    ] = False,
) -> TenantList:
    """The tenants and their key versions (never a key's secret)."""
    return await admin.tenants(runtime, narrow_context)


@router.put("/tenants/{tenant_id}/scopes", response_model=TenantOut, responses=ERROR_RESPONSES)
async def set_scopes(
    tenant_id: TenantId, body: SetScopes, runtime: RuntimeDep, _: AdminDep
) -> TenantOut:
    """Grant or revoke scopes (the full list replaces the old one). Other replicas see
    the change within the tenant cache TTL."""
    try:
        tenant = await runtime.tenants.set_scopes(tenant_id, tuple(dict.fromkeys(body.scopes)))
    except UnknownTenant:
        raise APIError(404, "no such tenant", "unknown_tenant") from None
    return TenantOut(
        tenant_id=tenant.tenant_id,
        name=tenant.name,
        scopes=list(tenant.scopes),
        created_at=dt.datetime.fromtimestamp(tenant.created_at, tz=dt.UTC),
    )


@router.put(
    "/tenants/{tenant_id}/retention", response_model=RetentionOut, responses=ERROR_RESPONSES
)
async def set_retention(
    tenant_id: TenantId, body: SetRetention, runtime: RuntimeDep, _: AdminDep
) -> RetentionOut:
    """The tenant's registry retention: entries issued longer ago than this are deleted by
    the periodic sweep (``WORLDCUP_REGISTRY_SWEEP_INTERVAL_S``); their texts then decode
    as ``registry_expired``, never as another entry."""
    return await admin.set_retention(runtime, tenant_id, body.days)


@router.post("/registry/sweep", response_model=SweepOut, responses=ERROR_RESPONSES)
async def sweep_registry(runtime: RuntimeDep, _: AdminDep) -> SweepOut:
    """Run the registry retention sweep now (it also runs periodically)."""
    return await admin.sweep(runtime)


@router.post("/master-key/rewrap", response_model=Rewrapped, responses=ERROR_RESPONSES)
async def rewrap(runtime: RuntimeDep, _: AdminDep) -> Rewrapped:
    """Master-key rotation, step 2 of 3 (see SECURITY.md): with every replica running
    ``WORLDCUP_MASTER_KEY=<new>`` and ``WORLDCUP_MASTER_KEY_PREVIOUS=<old>``,
    re-encrypt every stored watermark key under the new master key. Watermark keys
    themselves do not change, so every issued text decodes as before. Idempotent."""
    rewrapped, current = await runtime.tenants.rewrap_all()
    return Rewrapped(rewrapped=rewrapped, already_current=current)


@router.get("/audit", response_model=AuditLog, responses=ERROR_RESPONSES)
async def audit_log(
    runtime: RuntimeDep,
    _: AdminDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> AuditLog:
    """Provenance queries, newest first: who asked, when, and what was found."""
    return await admin.audit_log(runtime, limit)


@router.post(
    "/tenants/{tenant_id}/rotate-key", response_model=KeyRotated, responses=ERROR_RESPONSES
)
async def rotate_key(tenant_id: TenantId, runtime: RuntimeDep, _: AdminDep) -> KeyRotated:
    """New texts use the new key; every old version stays usable for decode and detect."""
    try:
        version = await runtime.tenants.rotate_key(tenant_id)
    except UnknownTenant:
        raise APIError(404, "no such tenant", "unknown_tenant") from None
    return KeyRotated(tenant_id=tenant_id, key_version=version)


@router.get(
    "/tenants/{tenant_id}/registry/{message_id}",
    response_model=RegistryEntryOut,
    responses=ERROR_RESPONSES,
)
async def registry_entry(
    tenant_id: TenantId,
    message_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
    runtime: RuntimeDep,
    _: AdminDep,
) -> RegistryEntryOut:
    return await admin.registry_entry(runtime, tenant_id, message_id)
