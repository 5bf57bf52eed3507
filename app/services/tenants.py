"""Tenant keys and the watermark operations the routes call.

Key material is unwrapped (AES-256-GCM) on first use and kept only in process
memory, one :class:`~worldcup_core.WorldCup` per (tenant, key version). Every
version stays usable for decode and detect; only the newest one generates.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from scipy import special

from app.core.security import KeyWrapper, hash_api_key, new_api_key, verify_api_key
from app.stores.base import KeyRecord, RegistryEntry, Store, TenantRecord
from worldcup_core import (
    DecodeResult,
    DetectionResult,
    Payload,
    WatermarkConfig,
    WatermarkKey,
    WorldCup,
)
from worldcup_core.decoder import RegistryMatch
from worldcup_core.message import MessageIdCodec


class UnknownTenant(LookupError):
    pass


class UnknownKeyVersion(LookupError):
    pass


class RegistryExhausted(Exception):
    """Every message id of this payload length is taken."""


@dataclass(frozen=True)
class KeyVersion:
    version: int
    scheme: WorldCup


@dataclass(frozen=True)
class DecodeOutcome:
    key_version: int
    result: DecodeResult
    match: RegistryMatch | None
    entry: RegistryEntry | None


@dataclass(frozen=True)
class DetectOutcome:
    key_version: int | None
    result: DetectionResult
    p_value: float  # corrected for the number of key versions tried
    z_score: float  # the normal quantile of the corrected p-value


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
        self._api_keys: dict[str, tuple[float, TenantRecord]] = {}

    async def tenant_for_api_key(self, api_key: str) -> TenantRecord | None:
        digest = hash_api_key(api_key)
        now = time.monotonic()
        hit = self._api_keys.get(digest)
        if hit is not None and now - hit[0] < self.cache_ttl_s:
            tenant: TenantRecord | None = hit[1]
        else:
            tenant = await self.store.tenant_by_api_key_hash(digest)
            if tenant is not None:
                if len(self._api_keys) > 10_000:
                    self._api_keys.clear()
                self._api_keys[digest] = (now, tenant)
        if tenant is None or not verify_api_key(api_key, tenant.api_key_hash):
            return None
        return tenant

    # admin ------------------------------------------------------------------
    async def create_tenant(self, name: str, scopes: tuple[str, ...] = ()) -> tuple[str, str]:
        """Returns (tenant_id, api_key). The API key is shown once, stored hashed."""
        tenant_id = uuid.uuid4().hex
        api_key = new_api_key()
        now = time.time()
        tenant = TenantRecord(tenant_id, name, hash_api_key(api_key), now, scopes)
        await self.store.create_tenant(tenant, self._new_key(tenant_id, 1, now))
        return tenant_id, api_key

    async def rotate_key(self, tenant_id: str) -> int:
        versions = await self.store.key_versions(tenant_id)
        if not versions:
            raise UnknownTenant(tenant_id)
        version = versions[-1].version + 1
        await self.store.add_key_version(self._new_key(tenant_id, version, time.time()))
        self._records.pop(tenant_id, None)
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
        return [KeyVersion(r.version, self._scheme(r)) for r in records]

    async def version(self, tenant_id: str, version: int | None) -> KeyVersion:
        versions = await self.versions(tenant_id)
        if version is None:
            return versions[-1]
        for v in versions:
            if v.version == version:
                return v
        raise UnknownKeyVersion(version)

    def _scheme(self, record: KeyRecord) -> WorldCup:
        cache_key = (record.tenant_id, record.version)
        scheme = self._schemes.get(cache_key)
        if scheme is None:
            secret = self.wrapper.unwrap(record.tenant_id, record.version, record.wrapped_key)
            config = WatermarkConfig(
                groups=record.groups,
                layers=record.layers,
                alpha=record.alpha,
                context_width=record.context_width,
            )
            scheme = WorldCup(WatermarkKey(secret), config)
            self._schemes[cache_key] = scheme
        return scheme

    # registry ---------------------------------------------------------------
    async def allocate(
        self, tenant_id: str, key: KeyVersion, num_bits: int, metadata: dict[str, Any]
    ) -> tuple[RegistryEntry, Payload]:
        """Durably allocate a message id *before* generating, and derive its payload."""
        codec = MessageIdCodec(key.scheme.key, num_bits)
        entry = await self.store.allocate_message(
            tenant_id, key.version, num_bits, metadata, time.time()
        )
        if entry.message_id >= codec.capacity:
            raise RegistryExhausted(num_bits)
        return entry, codec.payload(entry.message_id)

    # decode / detect --------------------------------------------------------
    async def decode(
        self, tenant_id: str, token_ids: list[int], num_bits: int, key_version: int | None
    ) -> DecodeOutcome:
        """Decode under each candidate key version; keep the most significant."""
        versions = (
            [await self.version(tenant_id, key_version)]
            if key_version is not None
            else await self.versions(tenant_id)
        )
        best: DecodeOutcome | None = None
        for v in versions:
            result = v.scheme.decode(token_ids, num_bits)
            if best is None or result.detection.log10_p_value < best.result.detection.log10_p_value:
                best = DecodeOutcome(v.version, result, None, None)
        assert best is not None
        return await self._with_registry(tenant_id, token_ids, num_bits, best, versions)

    async def _with_registry(
        self,
        tenant_id: str,
        token_ids: list[int],
        num_bits: int,
        outcome: DecodeOutcome,
        versions: list[KeyVersion],
    ) -> DecodeOutcome:
        scheme = next(v.scheme for v in versions if v.version == outcome.key_version)
        ids = await self.store.message_ids(tenant_id, outcome.key_version, num_bits)
        if not ids:
            return outcome
        codec = MessageIdCodec(scheme.key, num_bits)
        candidates = [codec.payload(i).bits for i in ids]
        match = scheme.match(token_ids, candidates)
        if match is None:
            return outcome
        entry = await self.store.registry_entry(tenant_id, ids[match.index])
        return DecodeOutcome(outcome.key_version, outcome.result, match, entry)

    async def detect(
        self, tenant_id: str, token_ids: list[int], significance: float
    ) -> DetectOutcome:
        """Message-free test under every key version, Bonferroni over versions."""
        versions = await self.versions(tenant_id)
        results = [(v.version, v.scheme.detect(token_ids, None, significance)) for v in versions]
        version, best = min(results, key=lambda r: r[1].log10_p_value)
        log_p = min(best.log10_p_value * math.log(10) + math.log(len(results)), 0.0)
        p_value = math.exp(log_p)
        z = float(-special.ndtri_exp(min(log_p, -1e-16)))
        return DetectOutcome(version if p_value < significance else None, best, p_value, z)
