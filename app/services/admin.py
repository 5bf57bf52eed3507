"""What the admin's registry routes do: the provenance audit log, one registry entry, a
tenant's registry retention and the retention sweep; the tenants and their key versions.

The routes in :mod:`app.api.routes.admin` parse, call these and answer; the store is
read here, and an entry's metadata is returned only when it reads back exactly
(:func:`app.services.intake.readable_metadata`).
"""

from __future__ import annotations

import datetime as dt
import time

from app.core.errors import APIError
from app.schemas.admin import (
    AuditEntry,
    AuditLog,
    KeyVersionOut,
    RegistryEntryOut,
    RetentionOut,
    SweepOut,
    TenantKeys,
    TenantList,
)
from app.services.intake import readable_metadata
from app.services.registry import sweep_registries
from app.services.runtime import Runtime
from app.stores.base import KeyRecord


def _when(at: float) -> dt.datetime:
    """A store's epoch seconds as an aware UTC datetime (how every admin answer shows time)."""
    return dt.datetime.fromtimestamp(at, tz=dt.UTC)


async def audit_log(runtime: Runtime, limit: int) -> AuditLog:
    """Provenance queries, newest first: who asked, when, and what was found."""
    records = await runtime.store.audit_log(limit)
    return AuditLog(
        entries=[
            AuditEntry(
                id=r.id,
                at=_when(r.at),
                actor=r.actor,
                action=r.action,
                request_id=r.request_id,
                outcome=r.outcome,
            )
            for r in records
        ]
    )


async def registry_entry(runtime: Runtime, tenant_id: str, message_id: int) -> RegistryEntryOut:
    """One registry entry of a tenant, or a 404."""
    entry = await runtime.store.registry_entry(tenant_id, message_id)
    if entry is None:
        raise APIError(404, "no such registry entry", "unknown_message")
    return RegistryEntryOut(
        tenant_id=entry.tenant_id,
        message_id=entry.message_id,
        key_version=entry.key_version,
        num_bits=entry.num_bits,
        metadata=readable_metadata(entry.metadata, entry.message_id),
        issued_at=_when(entry.issued_at),
    )


async def set_retention(runtime: Runtime, tenant_id: str, days: float | None) -> RetentionOut:
    """Set a tenant's registry retention (None: keep forever), or a 404."""
    if await runtime.store.get_tenant(tenant_id) is None:
        raise APIError(404, "no such tenant", "unknown_tenant")
    await runtime.store.set_registry_retention(tenant_id, days)
    return RetentionOut(tenant_id=tenant_id, days=days)


async def sweep(runtime: Runtime) -> SweepOut:
    """Run the registry retention sweep now."""
    return SweepOut(expired=await sweep_registries(runtime.store, time.time()))


async def tenants(runtime: Runtime, narrow_only: bool) -> TenantList:
    """Every tenant with its key versions, oldest tenant first; ``narrow_only``: only
    those whose current key version has a narrower context than new ones get (the
    tenants to rotate). Never a key's secret."""
    width = runtime.tenants.defaults.context_width
    records = await runtime.store.list_tenants()
    versions: dict[str, list[KeyRecord]] = {}
    for key in await runtime.store.all_key_versions():
        versions.setdefault(key.tenant_id, []).append(key)
    out = []
    for t in records:
        keys = sorted(versions.get(t.tenant_id, []), key=lambda k: k.version)
        if not keys:  # a tenant being created: its key is written with it
            continue
        current = keys[-1]
        narrow = current.context_width < width
        if narrow_only and not narrow:
            continue
        out.append(
            TenantKeys(
                tenant_id=t.tenant_id,
                name=t.name,
                scopes=list(t.scopes),
                created_at=_when(t.created_at),
                key_version=current.version,
                narrow_context=narrow,
                key_versions=[
                    KeyVersionOut(
                        version=k.version,
                        created_at=_when(k.created_at),
                        context_width=k.context_width,
                        scheme=k.scheme,
                        current=k is current,
                    )
                    for k in keys
                ],
            )
        )
    return TenantList(tenants=out)
