"""Tenants, their API keys and their watermark key versions.

Key material is unwrapped (AES-256-GCM) on first use and kept only in process
memory, one :class:`~worldcup_core.WorldCup` per (tenant, key version). Every
version stays usable for decode and detect; only the newest one generates. What
is done with the keys (decode, detect, provenance) is
:mod:`app.services.watermark`.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from app.core.schemes import watermark_scheme
from app.core.security import KeyWrapper, hash_api_key, new_api_key, verify_api_key
from app.stores.base import (
    PRIMARY_KEY_ID,
    ApiKeyRecord,
    KeyRecord,
    RegistryEntry,
    RegistryFull,
    Store,
    TenantRecord,
)
from worldcup_core import Payload, WatermarkConfig, WorldCup
from worldcup_core.context_sketch import WIDTH_LOG2
from worldcup_core.message import MessageIdCodec


class UnknownTenant(LookupError):
    pass


class UnknownKeyVersion(LookupError):
    pass


class UnknownApiKey(LookupError):
    pass


ALL_SCOPES = ("generate", "detect", "decode", "provenance", "fixed_payload")
# also need the tenant's own grant (an admin's): searching every tenant, and choosing
# the payload a text carries (many texts under one payload teach a forger the watermark)
TENANT_GATED_SCOPES = frozenset({"provenance", "fixed_payload"})


def primary_key(tenant: TenantRecord) -> ApiKeyRecord:
    """The key a tenant was created with, as an API key record: every scope and
    ``full`` detail, today's behaviour (provenance still follows the tenant's scopes)."""
    return ApiKeyRecord(
        key_id=PRIMARY_KEY_ID,
        tenant_id=tenant.tenant_id,
        key_hash=tenant.api_key_hash,
        name=PRIMARY_KEY_ID,
        scopes=ALL_SCOPES,
        detail="full",
        created_at=tenant.created_at,
    )


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant and the API key it used."""

    tenant: TenantRecord
    key: ApiKeyRecord

    @property
    def scopes(self) -> frozenset[str]:
        """The key's scopes; the tenant-gated ones only while the tenant holds them too."""
        return frozenset(
            s for s in self.key.scopes if s not in TENANT_GATED_SCOPES or s in self.tenant.scopes
        )


class RegistryExhausted(Exception):
    """Every message id of this payload length is taken."""


@dataclass(frozen=True)
class KeyVersion:
    version: int
    scheme: WorldCup
    sketch_width_log2: int  # its context sketch's geometry (KeyRecord.sketch_width_log2)


class TenantService:
    def __init__(
        self,
        store: Store,
        wrapper: KeyWrapper,
        defaults: WatermarkConfig,
        cache_ttl_s: float = 5.0,
    ) -> None:
        self.store = store
        self.wrapper = wrapper
        self.defaults = defaults
        self.cache_ttl_s = cache_ttl_s
        self._schemes: dict[tuple[str, int], WorldCup] = {}
        # Hot-path lookups, cached briefly: every /detect needs both, and a store
        # round trip costs as much as the detection itself. A rotation done on
        # another replica is seen within cache_ttl_s.
        self._records: dict[str, tuple[float, list[KeyRecord]]] = {}
        self._api_keys: dict[str, tuple[float, Principal]] = {}
        # Bumped by a local tenant creation or key rotation: the provenance key
        # bank (app.services.watermark) rebuilds when it sees a new epoch.
        self.key_epoch = 0

    async def authenticate(self, api_key: str) -> Principal | None:
        """The tenant and key behind an API key; None if unknown or revoked.

        Cached for ``cache_ttl_s``: a revocation on another replica takes effect
        there within that time (at once on the replica that revoked).
        """
        digest = hash_api_key(api_key)
        now = time.monotonic()
        hit = self._api_keys.get(digest)
        if hit is not None and now - hit[0] < self.cache_ttl_s:
            principal: Principal | None = hit[1]
        else:
            principal = await self._lookup(digest)
            if principal is not None:
                if len(self._api_keys) > 10_000:
                    self._api_keys.clear()
                self._api_keys[digest] = (now, principal)
        if principal is None or principal.key.revoked_at is not None:
            return None
        if not verify_api_key(api_key, principal.key.key_hash):
            return None
        return principal

    async def _lookup(self, digest: str) -> Principal | None:
        record = await self.store.api_key_by_hash(digest)
        if record is not None:
            tenant = await self.store.get_tenant(record.tenant_id)
            return None if tenant is None else Principal(tenant, record)
        tenant = await self.store.tenant_by_api_key_hash(digest)
        if tenant is None:
            return None
        return Principal(tenant, await self._ensure_primary(tenant))

    async def _ensure_primary(self, tenant: TenantRecord) -> ApiKeyRecord:
        """Tenants created before API keys existed get their key recorded on first use
        (idempotent; concurrent replicas write it once)."""
        record = primary_key(tenant)
        if await self.store.add_api_key(record):
            return record
        for stored in await self.store.api_keys(tenant.tenant_id):
            if stored.key_id == PRIMARY_KEY_ID:
                return stored
        return record

    async def _tenant(self, tenant_id: str) -> TenantRecord:
        tenant = await self.store.get_tenant(tenant_id)
        if tenant is None:
            raise UnknownTenant(tenant_id)
        return tenant

    async def create_api_key(
        self, tenant_id: str, name: str, scopes: tuple[str, ...], detail: str
    ) -> tuple[ApiKeyRecord, str]:
        """A new key for the tenant: (record, secret). The secret is shown once."""
        tenant = await self._tenant(tenant_id)
        await self._ensure_primary(tenant)
        secret = new_api_key()
        record = ApiKeyRecord(
            key_id=secrets.token_hex(8),
            tenant_id=tenant_id,
            key_hash=hash_api_key(secret),
            name=name,
            scopes=scopes,
            detail=detail,
            created_at=time.time(),
        )
        await self.store.add_api_key(record)
        return record, secret

    async def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        await self._ensure_primary(await self._tenant(tenant_id))
        return await self.store.api_keys(tenant_id)

    async def revoke_api_key(self, tenant_id: str, key_id: str) -> ApiKeyRecord:
        tenant = await self._tenant(tenant_id)
        if key_id == PRIMARY_KEY_ID:
            await self._ensure_primary(tenant)
        record = await self.store.revoke_api_key(tenant_id, key_id, time.time())
        if record is None:
            raise UnknownApiKey(key_id)
        self._api_keys.pop(record.key_hash, None)
        return record

    # admin ------------------------------------------------------------------
    async def create_tenant(self, name: str, scopes: tuple[str, ...] = ()) -> tuple[str, str]:
        """Returns (tenant_id, api_key). The API key is shown once, stored hashed."""
        tenant_id = uuid.uuid4().hex
        api_key = new_api_key()
        now = time.time()
        tenant = TenantRecord(tenant_id, name, hash_api_key(api_key), now, scopes)
        await self.store.create_tenant(tenant, self._new_key(tenant_id, 1, now))
        self.key_epoch += 1  # the provenance bank must include the new key
        return tenant_id, api_key

    async def set_scopes(self, tenant_id: str, scopes: tuple[str, ...]) -> TenantRecord:
        tenant = await self.store.set_scopes(tenant_id, scopes)
        if tenant is None:
            raise UnknownTenant(tenant_id)
        self._api_keys = {
            d: hit for d, hit in self._api_keys.items() if hit[1].tenant.tenant_id != tenant_id
        }
        return tenant

    async def rewrap_all(self) -> tuple[int, int]:
        """Master-key rotation: re-encrypt every stored key under the current master key.

        Returns (rewrapped, already current). Key material and every watermark
        are unchanged; only the encryption at rest moves to the new key. Safe to
        run while serving and to re-run (already current blobs are skipped).
        """
        records = await self.store.all_key_versions()
        stale = [
            r for r in records if not self.wrapper.is_current(r.tenant_id, r.version, r.wrapped_key)
        ]
        updated = [  # every other field as it was
            replace(
                r, wrapped_key=self.wrapper.rewrap_current(r.tenant_id, r.version, r.wrapped_key)
            )
            for r in stale
        ]
        for start in range(0, len(updated), 500):
            await self.store.replace_wrapped_keys(updated[start : start + 500])
        self._records.clear()
        return len(updated), len(records) - len(updated)

    async def rotate_key(self, tenant_id: str) -> int:
        versions = await self.store.key_versions(tenant_id)
        if not versions:
            raise UnknownTenant(tenant_id)
        version = versions[-1].version + 1
        await self.store.add_key_version(self._new_key(tenant_id, version, time.time()))
        self._records.pop(tenant_id, None)
        self.key_epoch += 1
        return version

    def _new_key(self, tenant_id: str, version: int, now: float) -> KeyRecord:
        secret = secrets.token_bytes(32)
        cfg = self.defaults
        return KeyRecord(
            tenant_id=tenant_id,
            version=version,
            wrapped_key=self.wrapper.wrap(tenant_id, version, secret),
            created_at=now,
            groups=cfg.groups,
            layers=cfg.layers,
            alpha=cfg.alpha,
            context_width=cfg.context_width,
            scheme=cfg.version,
            sketch_width_log2=WIDTH_LOG2,
        )

    # keys -------------------------------------------------------------------
    async def versions(self, tenant_id: str) -> list[KeyVersion]:
        now = time.monotonic()
        hit = self._records.get(tenant_id)
        if hit is not None and now - hit[0] < self.cache_ttl_s:
            records = hit[1]
        else:
            records = await self.store.key_versions(tenant_id)
            if records:
                self._records[tenant_id] = (now, records)
        if not records:
            raise UnknownTenant(tenant_id)
        return [KeyVersion(r.version, self.scheme(r), r.sketch_width_log2) for r in records]

    async def version(self, tenant_id: str, version: int | None) -> KeyVersion:
        versions = await self.versions(tenant_id)
        if version is None:
            return versions[-1]
        for v in versions:
            if v.version == version:
                return v
        raise UnknownKeyVersion(version)

    def scheme(self, record: KeyRecord) -> WorldCup:
        """The record's scheme, its key unwrapped once and cached in memory."""
        cache_key = (record.tenant_id, record.version)
        scheme = self._schemes.get(cache_key)
        if scheme is None:
            secret = self.wrapper.unwrap(record.tenant_id, record.version, record.wrapped_key)
            scheme = watermark_scheme(secret, record)
            self._schemes[cache_key] = scheme
        return scheme

    # registry ---------------------------------------------------------------
    async def allocate(
        self, tenant_id: str, key: KeyVersion, num_bits: int, metadata: dict[str, Any]
    ) -> tuple[RegistryEntry, Payload]:
        """Durably allocate a message id *before* generating, and derive its payload."""
        codec = MessageIdCodec(key.scheme.key, num_bits)
        try:
            entry = await self.store.allocate_message(
                tenant_id, key.version, num_bits, metadata, time.time(), codec.capacity - 1
            )
        except RegistryFull:
            raise RegistryExhausted(num_bits) from None
        return entry, codec.payload(entry.message_id)
