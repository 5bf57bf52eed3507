"""Tenants, their watermark key versions and their API keys, on SQLite.

Uniqueness (tenant name, tenant API-key hash, API-key hash) is the schema's
``UNIQUE`` constraints; a violation is reported as :class:`Conflict`. Key versions
of a tenant are numbered 1, 2, ... without gaps, checked inside the write.
"""

from __future__ import annotations

import json
import sqlite3

from app.stores.base import (
    ApiKeyRecord,
    Conflict,
    KeyRecord,
    TenantRecord,
    api_key_from_json,
    api_key_to_json,
    check_tenant_id,
    compact_json,
)
from app.stores.sqlite_base import SQLiteBase

_TENANT_BY_ID = "SELECT * FROM tenants WHERE tenant_id = ?"
_API_KEY = "SELECT record, revoked_at FROM api_keys"


def _tenant(row: sqlite3.Row | None) -> TenantRecord | None:
    if row is None:
        return None
    return TenantRecord(
        tenant_id=row["tenant_id"],
        name=row["name"],
        api_key_hash=row["api_key_hash"],
        created_at=row["created_at"],
        scopes=tuple(json.loads(row["scopes"])),
    )


def _key(row: sqlite3.Row) -> KeyRecord:
    return KeyRecord(
        tenant_id=row["tenant_id"],
        version=row["version"],
        wrapped_key=bytes(row["wrapped_key"]),
        created_at=row["created_at"],
        groups=row["groups"],
        layers=row["layers"],
        alpha=row["alpha"],
        context_width=row["context_width"],
        scheme=row["scheme"],
        sketch_width_log2=row["sketch_width_log2"],
    )


def _api_key(row: sqlite3.Row | None) -> ApiKeyRecord | None:
    return None if row is None else api_key_from_json(row["record"], row["revoked_at"])


def _insert_key(c: sqlite3.Connection, key: KeyRecord) -> None:
    c.execute(
        "INSERT INTO keys (tenant_id, version, wrapped_key, created_at, groups, layers,"
        " alpha, context_width, scheme, sketch_width_log2)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            key.tenant_id,
            key.version,
            key.wrapped_key,
            key.created_at,
            key.groups,
            key.layers,
            key.alpha,
            key.context_width,
            key.scheme,
            key.sketch_width_log2,
        ),
    )


class SQLiteTenants(SQLiteBase):
    # -- tenants --------------------------------------------------------------

    async def create_tenant(self, tenant: TenantRecord, key: KeyRecord) -> None:
        if key.tenant_id != tenant.tenant_id or key.version != 1:
            raise ValueError("the first key must be version 1 of the same tenant")
        check_tenant_id(tenant.tenant_id)

        def op(c: sqlite3.Connection) -> None:
            if c.execute("SELECT 1 FROM tenants WHERE name = ?", (tenant.name,)).fetchone():
                raise Conflict(f"tenant name {tenant.name!r} already exists")
            try:
                c.execute(
                    "INSERT INTO tenants VALUES (?, ?, ?, ?, ?)",
                    (
                        tenant.tenant_id,
                        tenant.name,
                        tenant.api_key_hash,
                        tenant.created_at,
                        compact_json(list(tenant.scopes)),
                    ),
                )
            except sqlite3.IntegrityError:
                raise Conflict("tenant id or api key hash already exists") from None
            _insert_key(c, key)

        await self._write(op)

    async def get_tenant(self, tenant_id: str) -> TenantRecord | None:
        return _tenant(await self._one(_TENANT_BY_ID, (check_tenant_id(tenant_id),)))

    async def tenant_by_api_key_hash(self, api_key_hash: str) -> TenantRecord | None:
        return _tenant(
            await self._one("SELECT * FROM tenants WHERE api_key_hash = ?", (api_key_hash,))
        )

    async def list_tenants(self) -> list[TenantRecord]:
        rows = await self._all("SELECT * FROM tenants ORDER BY created_at, tenant_id")
        return [t for r in rows if (t := _tenant(r)) is not None]

    async def set_scopes(self, tenant_id: str, scopes: tuple[str, ...]) -> TenantRecord | None:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> TenantRecord | None:
            c.execute(
                "UPDATE tenants SET scopes = ? WHERE tenant_id = ?",
                (compact_json(list(scopes)), tenant_id),
            )
            return _tenant(c.execute(_TENANT_BY_ID, (tenant_id,)).fetchone())

        return await self._write(op)

    # -- watermark keys -------------------------------------------------------

    async def add_key_version(self, key: KeyRecord) -> None:
        check_tenant_id(key.tenant_id)

        def op(c: sqlite3.Connection) -> None:
            if c.execute(_TENANT_BY_ID, (key.tenant_id,)).fetchone() is None:
                raise Conflict(f"unknown tenant {key.tenant_id!r}")
            (latest,) = c.execute(
                "SELECT COALESCE(MAX(version), 0) FROM keys WHERE tenant_id = ?",
                (key.tenant_id,),
            ).fetchone()
            if key.version != latest + 1:
                raise Conflict(f"key version must be {latest + 1}, got {key.version}")
            _insert_key(c, key)

        await self._write(op)

    async def key_versions(self, tenant_id: str) -> list[KeyRecord]:
        rows = await self._all(
            "SELECT * FROM keys WHERE tenant_id = ? ORDER BY version", (check_tenant_id(tenant_id),)
        )
        return [_key(r) for r in rows]

    async def replace_wrapped_keys(self, keys: list[KeyRecord]) -> None:
        """All-or-nothing; Conflict if a version does not exist."""

        def op(c: sqlite3.Connection) -> None:
            for k in keys:
                cur = c.execute(
                    "UPDATE keys SET wrapped_key = ? WHERE tenant_id = ? AND version = ?",
                    (k.wrapped_key, k.tenant_id, k.version),
                )
                if cur.rowcount != 1:
                    raise Conflict(f"no key version {k.version} for {k.tenant_id!r}")

        await self._write(op)

    async def all_key_versions(self) -> list[KeyRecord]:
        rows = await self._all("SELECT * FROM keys ORDER BY tenant_id, version")
        return [_key(r) for r in rows]

    # -- API keys -------------------------------------------------------------

    async def add_api_key(self, key: ApiKeyRecord) -> bool:
        check_tenant_id(key.tenant_id)
        data = api_key_to_json(key)

        def op(c: sqlite3.Connection) -> bool:
            exists = c.execute(
                "SELECT 1 FROM api_keys WHERE tenant_id = ? AND key_id = ?",
                (key.tenant_id, key.key_id),
            ).fetchone()
            if exists:
                return False
            try:
                c.execute(
                    "INSERT INTO api_keys VALUES (?, ?, ?, ?, ?)",
                    (key.tenant_id, key.key_id, key.key_hash, data, key.revoked_at),
                )
            except sqlite3.IntegrityError:
                raise Conflict("api key hash already in use") from None
            return True

        return await self._write(op)

    async def api_key_by_hash(self, key_hash: str) -> ApiKeyRecord | None:
        return _api_key(await self._one(f"{_API_KEY} WHERE key_hash = ?", (key_hash,)))

    async def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        rows = await self._all(f"{_API_KEY} WHERE tenant_id = ?", (check_tenant_id(tenant_id),))
        keys = [k for r in rows if (k := _api_key(r)) is not None]
        return sorted(keys, key=lambda k: (k.created_at, k.key_id))

    async def revoke_api_key(self, tenant_id: str, key_id: str, at: float) -> ApiKeyRecord | None:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> ApiKeyRecord | None:
            c.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE tenant_id = ? AND key_id = ?"
                " AND revoked_at IS NULL",
                (at, tenant_id, key_id),
            )
            return _api_key(
                c.execute(
                    f"{_API_KEY} WHERE tenant_id = ? AND key_id = ?", (tenant_id, key_id)
                ).fetchone()
            )

        return await self._write(op)
