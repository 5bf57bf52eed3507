"""What the admin's registry routes do: the provenance audit log, one registry entry, a
tenant's registry retention and the retention sweep.

The routes in :mod:`app.api.routes.admin` parse, call these and answer; the store is
read here, and an entry's metadata is returned only when it reads back exactly
(:func:`app.services.intake.readable_metadata`).
"""

from __future__ import annotations

import datetime as dt
import time

from app.core.errors import APIError
from app.schemas.admin import AuditEntry, AuditLog, RegistryEntryOut, RetentionOut, SweepOut
from app.services.intake import readable_metadata
from app.services.registry import sweep_registries
from app.services.runtime import Runtime


async def audit_log(runtime: Runtime, limit: int) -> AuditLog:
    """Provenance queries, newest first: who asked, when, and what was found."""
    records = await runtime.store.audit_log(limit)
    return AuditLog(
        entries=[
            AuditEntry(
                id=r.id,
                at=dt.datetime.fromtimestamp(r.at, tz=dt.UTC),
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
        issued_at=dt.datetime.fromtimestamp(entry.issued_at, tz=dt.UTC),
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
