"""Admin endpoints (admin token): tenants, key rotation, registry lookup."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import Field

from app.api.deps import AdminDep, RuntimeDep
from app.api.errors import APIError
from app.schemas.common import ERROR_RESPONSES, StrictModel
from app.services.tenants import UnknownTenant
from app.stores.base import Conflict

router = APIRouter(prefix="/admin", tags=["admin"])

TenantId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="Tenant id")]


class CreateTenant(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w .@-]+$")]


class TenantCreated(StrictModel):
    tenant_id: str
    name: str
    api_key: str = Field(description="Shown once; only its hash is stored.")
    key_version: int


class KeyRotated(StrictModel):
    tenant_id: str
    key_version: int


class RegistryEntryOut(StrictModel):
    tenant_id: str
    message_id: int
    key_version: int
    num_bits: int
    metadata: dict[str, Any]
    issued_at: dt.datetime


@router.post("/tenants", response_model=TenantCreated, status_code=201, responses=ERROR_RESPONSES)
async def create_tenant(body: CreateTenant, runtime: RuntimeDep, _: AdminDep) -> TenantCreated:
    try:
        tenant_id, api_key = await runtime.tenants.create_tenant(body.name)
    except Conflict:
        raise APIError(409, f"a tenant named {body.name!r} exists", "tenant_exists") from None
    return TenantCreated(tenant_id=tenant_id, name=body.name, api_key=api_key, key_version=1)


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
    entry = await runtime.store.registry_entry(tenant_id, message_id)
    if entry is None:
        raise APIError(404, "no such registry entry", "unknown_message")
    return RegistryEntryOut(
        tenant_id=entry.tenant_id,
        message_id=entry.message_id,
        key_version=entry.key_version,
        num_bits=entry.num_bits,
        metadata=entry.metadata,
        issued_at=dt.datetime.fromtimestamp(entry.issued_at, tz=dt.UTC),
    )
