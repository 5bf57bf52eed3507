"""Tenant keys and the watermark operations the routes call.

Key material is unwrapped (AES-256-GCM) on first use and kept only in process
memory, one :class:`~worldcup_core.WorldCup` per (tenant, key version). Every
version stays usable for decode and detect; only the newest one generates.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from app.core.security import KeyWrapper, hash_api_key, new_api_key, verify_api_key
from app.services.cpu import CpuPool
from app.stores.base import (
    PRIMARY_KEY_ID,
    ApiKeyRecord,
    KeyRecord,
    RegistryEntry,
    RegistryFull,
    Store,
    TenantRecord,
)
from worldcup_core import (
    DecodeResult,
    DetectionResult,
    Payload,
    WatermarkConfig,
    WatermarkKey,
    WorldCup,
)
from worldcup_core.decoder import RegistryMatch
from worldcup_core.detector import z_from_log_p
from worldcup_core.message import MessageIdCodec
from worldcup_core.provenance import KeyBank, ProvenanceResult
from worldcup_core.scoring import sidak_log_p

T = TypeVar("T")


class UnknownTenant(LookupError):
    pass


class UnknownKeyVersion(LookupError):
    pass


class UnknownApiKey(LookupError):
    pass


ALL_SCOPES = ("generate", "detect", "decode", "provenance")
TENANT_GATED_SCOPES = frozenset({"provenance"})  # also need the tenant's own grant


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
        """The key's scopes; provenance only while the tenant holds it too."""
        return frozenset(
            s for s in self.key.scopes if s not in TENANT_GATED_SCOPES or s in self.tenant.scopes
        )


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
    versions_tried: int = 1  # the best of these; its p-value is corrected for them


@dataclass(frozen=True)
class DetectOutcome:
    key_version: int | None
    result: DetectionResult
    p_value: float  # corrected for the number of key versions tried
    z_score: float  # the normal quantile of the corrected p-value


@dataclass(frozen=True)
class ProvenanceOutcome:
    result: ProvenanceResult
    significant: bool
    tenant: TenantRecord | None  # the best key's owner, when significant
    key_version: int | None
    decoded: DecodeOutcome | None  # payload and registry entry under the best key
    num_tenants: int
    scan_seconds: float
    scheme: WorldCup | None  # the best key (for admin-only per-token scores)
    candidates: list[tuple[str, int, float]]  # (tenant id, key version, log10 p), best first


@dataclass
class _Bank:
    built_at: float
    bank: KeyBank
    refs: list[tuple[str, int]]  # (tenant id, key version) per bank entry


class TenantService:
    def __init__(
        self,
        store: Store,
        wrapper: KeyWrapper,
        defaults: WatermarkConfig,
        cache_ttl_s: float = 5.0,
        cpu: CpuPool | None = None,
    ) -> None:
        self.store = store
        self.cpu = cpu
        self.wrapper = wrapper
        self.defaults = defaults
        self.cache_ttl_s = cache_ttl_s
        self._schemes: dict[tuple[str, int], WorldCup] = {}
        # Hot-path lookups, cached briefly: every /detect needs both, and a store
        # round trip costs as much as the detection itself. A rotation done on
        # another replica is seen within cache_ttl_s.
        self._records: dict[str, tuple[float, list[KeyRecord]]] = {}
        self._api_keys: dict[str, tuple[float, Principal]] = {}
        self._bank: _Bank | None = None
        self._bank_lock = asyncio.Lock()
        self.provenance_refresh_s = 30.0

    async def offload(self, fn: Callable[[], T]) -> T:
        """Run scoring work off the event loop: in the bounded CPU pool (which may
        refuse it with Overloaded), or in a plain thread when there is none."""
        if self.cpu is not None:
            return await self.cpu.run(fn)
        return await asyncio.to_thread(fn)

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
        self._bank = None  # the provenance bank must include the new key
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
        updated = [
            KeyRecord(
                tenant_id=r.tenant_id,
                version=r.version,
                wrapped_key=self.wrapper.rewrap_current(r.tenant_id, r.version, r.wrapped_key),
                created_at=r.created_at,
                groups=r.groups,
                layers=r.layers,
                alpha=r.alpha,
                context_width=r.context_width,
                scheme=r.scheme,
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
        self._bank = None
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
                version=record.scheme,
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
        try:
            entry = await self.store.allocate_message(
                tenant_id, key.version, num_bits, metadata, time.time(), codec.capacity - 1
            )
        except RegistryFull:
            raise RegistryExhausted(num_bits) from None
        return entry, codec.payload(entry.message_id)

    # decode / detect --------------------------------------------------------
    async def decode(
        self, tenant_id: str, token_ids: list[int], num_bits: int, key_version: int | None
    ) -> DecodeOutcome:
        return (await self.decode_many(tenant_id, [token_ids], num_bits, key_version))[0]

    async def decode_many(
        self,
        tenant_id: str,
        texts: Sequence[list[int]],
        num_bits: int,
        key_version: int | None,
    ) -> list[DecodeOutcome]:
        """Decode under each candidate key version, keep the most significant, and
        match it against that version's registry. Store reads happen once per batch."""
        versions = (
            [await self.version(tenant_id, key_version)]
            if key_version is not None
            else await self.versions(tenant_id)
        )
        # Ids at or above the payload's capacity cannot be encoded; older releases
        # could leave such entries behind a 409 registry_full, so skip them.
        registry = {
            v.version: [
                i
                for i in await self.store.message_ids(tenant_id, v.version, num_bits)
                if i < 2**num_bits
            ]
            for v in versions
        }

        def work() -> list[tuple[DecodeOutcome, int | None]]:
            candidates = {
                v.version: [MessageIdCodec(v.scheme.key, num_bits).payload(i).bits for i in ids]
                for v in versions
                if (ids := registry[v.version])
            }
            out = []
            for token_ids in texts:
                best: DecodeOutcome | None = None
                for v in versions:
                    result = v.scheme.decode(token_ids, num_bits)
                    if best is None or (
                        result.detection.log10_p_value < best.result.detection.log10_p_value
                    ):
                        best = DecodeOutcome(v.version, result, None, None)
                assert best is not None
                scheme = next(v.scheme for v in versions if v.version == best.key_version)
                cands = candidates.get(best.key_version)
                match = scheme.match(token_ids, cands) if cands else None
                message_id = registry[best.key_version][match.index] if match else None
                out.append((DecodeOutcome(best.key_version, best.result, match, None), message_id))
            return out

        decoded = await self.offload(work)
        outcomes = []
        for outcome, message_id in decoded:
            entry = None
            if message_id is not None:
                entry = await self.store.registry_entry(tenant_id, message_id)
            outcomes.append(
                DecodeOutcome(
                    outcome.key_version, outcome.result, outcome.match, entry, len(versions)
                )
            )
        return outcomes

    async def detect(
        self, tenant_id: str, token_ids: list[int], significance: float
    ) -> DetectOutcome:
        return (await self.detect_many(tenant_id, [token_ids], significance))[0]

    async def detect_many(
        self, tenant_id: str, texts: Sequence[list[int]], significance: float
    ) -> list[DetectOutcome]:
        """Message-free test under every key version, Bonferroni over versions."""
        versions = await self.versions(tenant_id)

        def one(token_ids: list[int]) -> DetectOutcome:
            results = [
                (v.version, v.scheme.detect(token_ids, None, significance)) for v in versions
            ]
            version, best = min(results, key=lambda r: r[1].log10_p_value)
            # Šidák, not Bonferroni: exact (uniform under H0) and never clipped at 1,
            # so z is standard normal on unwatermarked text
            log_p = sidak_log_p(best.log10_p_value * math.log(10), len(results))
            p_value = math.exp(log_p)
            z = z_from_log_p(log_p, best.num_scored_tokens)
            return DetectOutcome(version if p_value < significance else None, best, p_value, z)

        return await self.offload(lambda: [one(t) for t in texts])

    # provenance -------------------------------------------------------------
    async def key_bank(self) -> tuple[KeyBank, list[tuple[str, int]]]:
        """Every tenant's every key version, unwrapped and prepared once.

        Rebuilt after a local tenant creation or rotation, and at most every
        ``provenance_refresh_s`` seconds otherwise (changes made on another
        replica are picked up then).
        """
        async with self._bank_lock:
            now = time.monotonic()
            cached = self._bank
            if cached is not None and now - cached.built_at < self.provenance_refresh_s:
                return cached.bank, cached.refs
            records = await self.store.all_key_versions()

            def build() -> _Bank:
                schemes = [self._scheme(r) for r in records]
                refs = [(r.tenant_id, r.version) for r in records]
                return _Bank(now, KeyBank(schemes), refs)

            self._bank = await asyncio.to_thread(build)
            return self._bank.bank, self._bank.refs

    async def provenance(
        self, token_ids: list[int], significance: float, default_num_bits: int
    ) -> ProvenanceOutcome:
        """Which tenant and key version watermarked this text, and for which registry entry?"""
        bank, refs = await self.key_bank()
        started = time.perf_counter()
        result = await self.offload(lambda: bank.search(token_ids))
        elapsed = time.perf_counter() - started
        num_tenants = len({t for t, _ in refs})
        candidates = [(*refs[c.index], c.log10_p_value) for c in result.top]
        significant = result.best is not None and result.p_value < significance
        if not significant or result.best is None:
            return ProvenanceOutcome(
                result, False, None, None, None, num_tenants, elapsed, None, candidates
            )
        tenant_id, version = refs[result.best.index]
        tenant = await self.store.get_tenant(tenant_id)
        lengths = await self.store.registry_bit_lengths(tenant_id, version) or [default_num_bits]
        decoded: DecodeOutcome | None = None
        for bits in lengths:
            outcome = await self.decode(tenant_id, token_ids, bits, version)
            if decoded is None or _better(outcome, decoded):
                decoded = outcome
        return ProvenanceOutcome(
            result,
            True,
            tenant,
            version,
            decoded,
            num_tenants,
            elapsed,
            bank.schemes[result.best.index],
            candidates,
        )


def _better(a: DecodeOutcome, b: DecodeOutcome) -> bool:
    """Prefer a registry match, then the more significant one, then the decode p-value."""
    if (a.entry is None) != (b.entry is None):
        return a.entry is not None
    if a.match is not None and b.match is not None and a.match.p_value != b.match.p_value:
        return a.match.p_value < b.match.p_value
    return a.result.detection.log10_p_value < b.result.detection.log10_p_value
