"""Redis store: the deployment backend, shared by every API replica.

Runs on one Redis or on Redis Cluster (``cluster=True``) with one key layout
(:mod:`app.stores.redis_layout`): every script touches one hash tag, and global
indexes are never in a script or transaction with a tenant's keys. Parts:
:mod:`~app.stores.redis_base` (client, failure policy, acknowledged writes),
:mod:`~app.stores.redis_registry` (the message registry), :mod:`~app.stores.redis_cases`
(console cases), :mod:`~app.stores.redis_migrate` (from the legacy layout).

Uniqueness across slots uses claims: a tenant's name (``tenant-names``) and API-key
hash (``apikey:``), and an API key's hash (``keyhash:``), are claimed first with an
atomic set-if-absent on their one global key; only then is the tenant (or key)
written in its own slot. A conflict releases the claims made so far (compare and
delete). Readers reach a tenant only through its own keys, so a claim whose tenant
was never written is invisible; a name claim left by a creation that died half way is
taken over once its ``creating`` marker (TTL) has expired.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, cast

from app.stores.base import (
    COUNT_ONLY,
    SKETCH_WIDTH_LOG2_BEFORE,
    ApiKeyRecord,
    AuditRecord,
    Conflict,
    IdempotencyRecord,
    KeyRecord,
    ProbeCounting,
    ProbeDecision,
    RateDecision,
    StoreUnavailable,
    TenantRecord,
    api_key_from_json,
    api_key_to_json,
    audit_from_json,
    audit_to_json,
    compact_json,
)
from app.stores.redis_cases import RedisCases
from app.stores.redis_layout import LAYOUT_VERSION, glob_escape
from app.stores.redis_registry import RedisRegistry
from app.stores.redis_scripts import (
    ADD_KEY,
    COMMIT_TENANT,
    PROBE_HIT,
    PROBE_HIT_ALL,
    RELEASE_CLAIM,
    REPLACE_KEYS,
    RESERVE_TENANT,
    REVOKE_API_KEY,
    SET_SCOPES,
    SWAP_HASH_CLAIM,
    TAKE_TOKENS,
)

__all__ = ["RedisStore"]

_SCAN_COUNT = 1000  # keys a SCAN step visits (probe_clusters)
_MGET_KEYS = 1000  # keys per MGET of a listing

AUDIT_MAXLEN = 1_000_000  # approximate trim; older records go first
CREATING_TTL_MS = 60_000  # a creation older than this died half way: its claims are free


def key_to_json(key: KeyRecord) -> str:
    return compact_json(
        {
            "version": key.version,
            "wrapped_key": base64.b64encode(key.wrapped_key).decode("ascii"),
            "created_at": key.created_at,
            "groups": key.groups,
            "layers": key.layers,
            "alpha": key.alpha,
            "context_width": key.context_width,
            "scheme": key.scheme,
            "sketch_width_log2": key.sketch_width_log2,
        }
    )


def key_from_json(tenant_id: str, raw: str) -> KeyRecord:
    d = json.loads(raw)
    return KeyRecord(
        tenant_id=tenant_id,
        version=int(d["version"]),
        wrapped_key=base64.b64decode(d["wrapped_key"]),
        created_at=float(d["created_at"]),
        groups=int(d["groups"]),
        layers=int(d["layers"]),
        alpha=float(d["alpha"]),
        context_width=int(d["context_width"]),
        scheme=str(d.get("scheme", "worldcup-v1")),  # records written before v2 existed
        # ... and before the context sketch's width was recorded with the version
        sketch_width_log2=int(d.get("sketch_width_log2", SKETCH_WIDTH_LOG2_BEFORE)),
    )


def _tenant_from_hash(h: dict[str, str]) -> TenantRecord | None:
    if not h:
        return None
    return TenantRecord(
        tenant_id=h["tenant_id"],
        name=h["name"],
        api_key_hash=h["api_key_hash"],
        created_at=float(h["created_at"]),
        scopes=tuple(json.loads(h.get("scopes", "[]"))),
    )


class RedisStore(ProbeCounting, RedisRegistry, RedisCases):
    """:class:`~app.stores.base.Store` on Redis or Redis Cluster (redis-py asyncio)."""

    def __init__(
        self,
        url: str,
        prefix: str = "wc",
        timeout_s: float = 2.0,
        max_connections: int = 64,
        cluster: bool = False,
        wait_replicas: int | None = None,
        wait_timeout_ms: int = 500,
    ) -> None:
        super().__init__(
            url, prefix, timeout_s, max_connections, cluster, wait_replicas, wait_timeout_ms
        )
        self._init_registry()
        s = self._script
        self._reserve_tenant, self._commit_tenant = s(RESERVE_TENANT), s(COMMIT_TENANT)
        self._swap_hash_claim, self._release_claim = s(SWAP_HASH_CLAIM), s(RELEASE_CLAIM)
        self._add_key, self._replace_keys = s(ADD_KEY), s(REPLACE_KEYS)
        self._set_scopes, self._take_tokens = s(SET_SCOPES), s(TAKE_TOKENS)
        self._revoke_api_key, self._probe_hit = s(REVOKE_API_KEY), s(PROBE_HIT)
        self._probe_hit_all = s(PROBE_HIT_ALL)

    # -- lifecycle ------------------------------------------------------------

    async def ensure_marker(self, value: str) -> str:
        """The marker; a fresh deployment also records its key layout. A deployment with
        a marker but no layout record is in the legacy layout: refused until migrated."""
        g = self._keys.g

        async def call() -> tuple[Any, Any]:  # set-if-absent, then reads: safe to re-run
            if not await self._redis.exists(g("marker")):
                await self._redis.set(g("layout"), LAYOUT_VERSION, nx=True)
                await self._redis.set(g("marker"), value, nx=True)
            return await self._redis.get(g("layout")), await self._redis.get(g("marker"))

        layout, stored = await self._retry(call)
        if layout != LAYOUT_VERSION:
            raise StoreUnavailable(
                f"redis holds the legacy key layout ({layout or 'no layout record'}); "
                "run `worldcup migrate-store` first (docs/operations.md)"
            )
        return str(stored if stored is not None else value)

    async def marker(self) -> str | None:
        stored = await self._retry(lambda: self._redis.get(self._keys.g("marker")))
        return None if stored is None else str(stored)

    # -- tenants --------------------------------------------------------------

    async def _claim_name(self, name: str, tid: str) -> bool:
        """Set-if-absent in the global name index; takes over an abandoned claim."""
        names = self._keys.g("tenant-names")
        async with self._guard():
            if await self._redis.hsetnx(names, name, tid):
                return True
            holder = cast("str | None", await self._redis.hget(names, name))
            if holder is None:  # released meanwhile
                return bool(await self._redis.hsetnx(names, name, tid))
            if holder == tid:
                return True
            t = self._keys.t
            alive = await self._redis.exists(t(holder, "tenant"), t(holder, "creating"))
            if alive:
                return False
            return bool(int(await self._swap_hash_claim(keys=[names], args=[name, holder, tid])))

    async def _release(
        self, tenant: TenantRecord, name: bool, api_key: bool, ours: bool = True
    ) -> None:
        """Undo a creation's claims; ``ours``: the id was reserved by this creation."""
        tid, g = tenant.tenant_id, self._keys.g
        async with self._guard():
            if name:
                await self._swap_hash_claim(keys=[g("tenant-names")], args=[tenant.name, tid, ""])
            if api_key:
                await self._release_claim(keys=[g("apikey", tenant.api_key_hash)], args=[tid])
            if ours:
                await self._redis.srem(g("tenants"), tid)
                await self._redis.delete(self._keys.t(tid, "creating"))

    async def create_tenant(self, tenant: TenantRecord, key: KeyRecord) -> None:
        """Reserve the id (tenant slot), claim the name and API-key hash (global keys),
        list the id, then write the tenant (tenant slot). Any conflict undoes the claims."""
        if key.tenant_id != tenant.tenant_id or key.version != 1:
            raise ValueError("the first key must be version 1 of the same tenant")
        tid, t, g = tenant.tenant_id, self._keys.t, self._keys.g
        own = [t(tid, "tenant"), t(tid, "keys"), t(tid, "creating")]
        async with self._guard():
            reserved = await self._reserve_tenant(keys=own, args=[CREATING_TTL_MS])
        if reserved != "ok":
            raise Conflict(f"tenant id {tid!r} already exists")
        if not await self._claim_name(tenant.name, tid):
            await self._release(tenant, name=False, api_key=False)
            raise Conflict(f"tenant name {tenant.name!r} already exists")
        async with self._guard():
            api_key = g("apikey", tenant.api_key_hash)
            claimed = await self._redis.set(api_key, tid, nx=True)
        if not claimed:
            await self._release(tenant, name=True, api_key=False)
            raise Conflict("api key hash already in use")
        args: list[str | int] = [
            tenant.name,
            tid,
            tenant.api_key_hash,
            repr(float(tenant.created_at)),
            compact_json(list(tenant.scopes)),
            key.version,
            key_to_json(key),
        ]
        async with self._guard():
            await self._redis.sadd(g("tenants"), tid)  # before the tenant: always listed
            result = await self._eval_acked(self._commit_tenant, own, args)
        if result != "ok":
            await self._release(tenant, name=True, api_key=True, ours=False)
            raise Conflict(f"tenant id {tid!r} already exists")

    async def get_tenant(self, tenant_id: str) -> TenantRecord | None:
        key = self._keys.t(tenant_id, "tenant")
        h = cast("dict[str, str]", await self._retry(lambda: self._redis.hgetall(key)))
        return _tenant_from_hash(h)

    async def tenant_by_api_key_hash(self, api_key_hash: str) -> TenantRecord | None:
        async def call() -> dict[str, str]:
            tid = cast("str | None", await self._redis.get(self._keys.g("apikey", api_key_hash)))
            if tid is None:
                return {}
            return cast("dict[str, str]", await self._redis.hgetall(self._keys.t(tid, "tenant")))

        return _tenant_from_hash(await self._retry(call))

    async def _tenant_ids(self) -> list[str]:
        ids = await self._retry(lambda: self._redis.smembers(self._keys.g("tenants")))
        return sorted(cast("set[str]", ids))

    async def list_tenants(self) -> list[TenantRecord]:
        ids = await self._tenant_ids()
        hashes = await self._hashes([self._keys.t(tid, "tenant") for tid in ids])
        tenants = [t for h in hashes if (t := _tenant_from_hash(h)) is not None]
        return sorted(tenants, key=lambda t: (t.created_at, t.tenant_id))

    async def set_scopes(self, tenant_id: str, scopes: tuple[str, ...]) -> TenantRecord | None:
        key = self._keys.t(tenant_id, "tenant")
        async with self._guard():
            updated = await self._set_scopes(keys=[key], args=[compact_json(list(scopes))])
            if not int(updated):
                return None
            h = cast("dict[str, str]", await self._redis.hgetall(key))
        return _tenant_from_hash(h)

    # -- watermark keys -------------------------------------------------------

    async def add_key_version(self, key: KeyRecord) -> None:
        keys = [self._keys.t(key.tenant_id, "tenant"), self._keys.t(key.tenant_id, "keys")]
        async with self._guard():
            status, latest = await self._eval_acked(
                self._add_key, keys, [key.version, key_to_json(key)]
            )
        if int(status) == -1:
            raise Conflict(f"unknown tenant {key.tenant_id!r}")
        if int(status) == 0:
            raise Conflict(f"key version must be {int(latest) + 1}, got {key.version}")

    async def key_versions(self, tenant_id: str) -> list[KeyRecord]:
        key = self._keys.t(tenant_id, "keys")
        h = cast("dict[str, str]", await self._retry(lambda: self._redis.hgetall(key)))
        return sorted(
            (key_from_json(tenant_id, raw) for raw in h.values()), key=lambda k: k.version
        )

    async def replace_wrapped_keys(self, keys: list[KeyRecord]) -> None:
        """All-or-nothing per tenant (compare-and-set in the tenant's slot), every version
        checked first; Conflict if a version does not exist. Safe to re-run."""
        by_tenant: dict[str, list[KeyRecord]] = {}
        for k in keys:
            by_tenant.setdefault(k.tenant_id, []).append(k)
        for tid, records in by_tenant.items():  # check every tenant before writing any
            current = {k.version for k in await self.key_versions(tid)}
            missing = [k.version for k in records if k.version not in current]
            if missing:
                raise Conflict(f"no key version {missing[0]} for {tid!r}")
        for tid, records in by_tenant.items():
            hkey = self._keys.t(tid, "keys")
            while True:
                async with self._guard():
                    h = cast("dict[str, str]", await self._redis.hgetall(hkey))
                    args: list[str | int] = []
                    for k in records:
                        old = h.get(str(k.version))
                        if old is None:
                            raise Conflict(f"no key version {k.version} for {tid!r}")
                        d = json.loads(old)
                        d["wrapped_key"] = base64.b64encode(k.wrapped_key).decode("ascii")
                        args += [k.version, old, compact_json(d)]
                    done = int(await self._eval_acked(self._replace_keys, [hkey], args))
                if done == 1:
                    break
                if done < 0:
                    raise Conflict(f"no key version {-done} for {tid!r}")
                # 0: a concurrent writer changed a blob since it was read: re-read, retry

    async def all_key_versions(self) -> list[KeyRecord]:
        ids = await self._tenant_ids()
        hashes = await self._hashes([self._keys.t(tid, "keys") for tid in ids])
        return [
            key_from_json(tid, raw)
            for tid, h in zip(ids, hashes, strict=True)
            for raw in sorted(h.values(), key=lambda r: int(json.loads(r)["version"]))
        ]

    # -- registry: see redis_registry -----------------------------------------

    # -- audit log ------------------------------------------------------------

    async def append_audit(self, record: AuditRecord) -> None:
        data = audit_to_json(record)
        async with self._guard():
            await self._redis.xadd(
                self._keys.g("audit"), {"json": data}, maxlen=AUDIT_MAXLEN, approximate=True
            )

    async def audit_log(self, limit: int) -> list[AuditRecord]:
        rows = cast(
            "list[tuple[str, dict[str, str]]]",
            await self._retry(
                lambda: self._redis.xrevrange(self._keys.g("audit"), count=max(1, int(limit)))
            ),
        )
        return [audit_from_json(fields["json"], str(entry_id)) for entry_id, fields in rows]

    # -- API keys -------------------------------------------------------------

    async def add_api_key(self, key: ApiKeyRecord) -> bool:
        """Claim the hash (global key), then write the key (tenant slot)."""
        apikeys = self._keys.t(key.tenant_id, "apikeys")
        claim, ref = self._keys.g("keyhash", key.key_hash), f"{key.tenant_id} {key.key_id}"
        async with self._guard():
            if await self._redis.hexists(apikeys, key.key_id):
                return False
            claimed = bool(await self._redis.set(claim, ref, nx=True))
            if not claimed and await self._redis.get(claim) != ref:
                raise Conflict("api key hash already in use")
            written = bool(await self._redis.hsetnx(apikeys, key.key_id, api_key_to_json(key)))
            if not written and claimed:  # the key id was taken meanwhile
                await self._release_claim(keys=[claim], args=[ref])
        if written and key.revoked_at is not None:
            await self.revoke_api_key(key.tenant_id, key.key_id, key.revoked_at)
        return written

    async def _api_key(self, tenant_id: str, key_id: str) -> ApiKeyRecord | None:
        t = self._keys.t

        async def call() -> tuple[str | None, str | None]:
            raw = await self._redis.hget(t(tenant_id, "apikeys"), key_id)
            return raw, await self._redis.hget(t(tenant_id, "apikeys-revoked"), key_id)

        raw, revoked = await self._retry(call)
        if raw is None:
            return None
        return api_key_from_json(raw, None if revoked is None else float(revoked))

    async def api_key_by_hash(self, key_hash: str) -> ApiKeyRecord | None:
        key = self._keys.g("keyhash", key_hash)
        ref = cast("str | None", await self._retry(lambda: self._redis.get(key)))
        if ref is None:
            return None
        tenant_id, _, key_id = ref.partition(" ")
        return await self._api_key(tenant_id, key_id)

    async def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        raw, revoked = await self._hashes(
            [self._keys.t(tenant_id, "apikeys"), self._keys.t(tenant_id, "apikeys-revoked")]
        )
        keys = [
            api_key_from_json(v, float(revoked[k]) if k in revoked else None)
            for k, v in raw.items()
        ]
        return sorted(keys, key=lambda k: (k.created_at, k.key_id))

    async def revoke_api_key(self, tenant_id: str, key_id: str, at: float) -> ApiKeyRecord | None:
        keys = [self._keys.t(tenant_id, "apikeys"), self._keys.t(tenant_id, "apikeys-revoked")]
        async with self._guard():
            found = int(await self._revoke_api_key(keys=keys, args=[key_id, repr(float(at))]))
        if not found:
            return None
        return await self._api_key(tenant_id, key_id)

    # -- probe accounting -----------------------------------------------------

    def _probe(self, tenant_id: str, key_id: str, *parts: object) -> str:
        if not key_id or ":" in key_id:
            raise ValueError("invalid key id")
        return self._keys.t(tenant_id, "probe", key_id, *parts)

    async def probe_candidates(
        self, tenant_id: str, key_id: str, bands: list[str], limit: int = 8, min_hits: int = 1
    ) -> list[tuple[str, bytes]]:
        if not bands or limit <= 0:
            return []
        band = self._probe(tenant_id, key_id, "band", "")  # checked once, then joined
        band_keys = [band + b for b in bands]
        # one tenant's keys: one slot, so MGET is allowed
        refs = cast("list[str | None]", await self._retry(lambda: self._redis.mget(band_keys)))
        counts = Counter(r for r in refs if r is not None)
        hit = [c for c, n in counts.items() if n >= min_hits]
        ids = sorted(hit, key=lambda c: (-counts[c], c))[:limit]
        if not ids:
            return []
        sketch_keys = [self._probe(tenant_id, key_id, "sk", c) for c in ids]
        sketches = cast(
            "list[str | None]", await self._retry(lambda: self._redis.mget(sketch_keys))
        )
        return [
            (c, base64.b64decode(sk)) for c, sk in zip(ids, sketches, strict=True) if sk is not None
        ]

    async def probe_clusters(self, tenant_id: str, key_id: str) -> list[tuple[str, bytes]]:
        head = self._probe(tenant_id, key_id, "sk", "")
        found = await self._scan_tenant(tenant_id, glob_escape(head) + "*")
        ids = sorted(k[len(head) :] for k in found)
        out: list[tuple[str, bytes]] = []
        for i in range(0, len(ids), _MGET_KEYS):
            chunk = ids[i : i + _MGET_KEYS]
            names = [head + c for c in chunk]
            # one tenant's keys: one slot, so MGET is allowed
            sketches = cast(
                "list[str | None]",
                await self._retry(functools.partial(self._redis.mget, names)),
            )
            out += [
                (c, base64.b64decode(sk))
                for c, sk in zip(chunk, sketches, strict=True)
                if sk is not None  # expired since the SCAN saw it
            ]
        return out

    async def _scan_tenant(self, tenant_id: str, match: str) -> set[str]:
        """The keys ``match`` matches, ``match`` naming keys of this tenant only: a SCAN
        of the server, or of the cluster node that serves the tenant's slot; one step
        per round trip, each retried. Where another node serves the slot at a step (a
        failover), the SCAN starts again there (the keys found so far are kept)."""
        slot_key = self._keys.t(tenant_id, "tenant")
        found: set[str] = set()
        cursor, serving = 0, ""

        async def step(at: int, node_name: str) -> tuple[str, int, list[str]]:
            if not self._cluster:
                nxt, keys = await self._redis.scan(at, match=match, count=_SCAN_COUNT)
                return "", int(nxt), list(keys)
            node = self._redis.get_node_from_key(slot_key)
            if node.name != node_name:
                at = 0  # a cursor is one node's: start again on the node serving the slot
            cursors, keys = await self._redis.scan(
                at, match=match, count=_SCAN_COUNT, target_nodes=node
            )
            return str(node.name), int(cursors[node.name]), list(keys)

        while True:
            name, nxt, keys = await self._retry(functools.partial(step, cursor, serving))
            found.update(keys)
            cursor, serving = nxt, name
            if cursor == 0:
                return found

    async def probe_hit_all(
        self, tenant_id: str, key_id: str, hits: Mapping[str, int], window_s: float, budget: int
    ) -> bool:
        wanted = [(c, n) for c, n in hits.items() if n > 0]
        if not wanted:
            return True
        keys: list[str] = []
        for cluster_id, _ in wanted:  # one tenant's keys: one slot
            keys += [
                self._probe(tenant_id, key_id, "hits", cluster_id),
                self._probe(tenant_id, key_id, "sk", cluster_id),
            ]
        args: list[str | int] = [
            max(1, round(window_s * 1000)),
            int(budget),
            secrets.token_hex(8),  # this call's id: a retried call counts once
            base64.b64encode(COUNT_ONLY).decode("ascii"),
            *(int(n) for _, n in wanted),
        ]
        done = await self._retry(lambda: self._probe_hit_all(keys=keys, args=args))
        return int(done) == 1

    async def _probe_count(
        self,
        tenant_id: str,
        key_id: str,
        cluster_id: str,
        sketch: bytes | None,
        bands: list[str],
        window_s: float,
        budget: int,
        seen: Sequence[str],
        min_hits: int,
    ) -> ProbeDecision | None:
        """One PROBE_HIT call (the band keys and the cluster's share the tenant's slot)."""
        keys = [
            self._probe(tenant_id, key_id, "hits", cluster_id),
            self._probe(tenant_id, key_id, "sk", cluster_id),
        ]
        if sketch is not None:
            band = self._probe(tenant_id, key_id, "band", "")
            keys += [band + b for b in bands]
        args: list[str | int] = [
            max(1, round(window_s * 1000)),
            int(budget),
            cluster_id,
            base64.b64encode(sketch).decode("ascii") if sketch is not None else "",
            secrets.token_hex(8),  # this hit's id: a retried call counts it once
            int(min_hits),
            *seen,
        ]
        allowed, count, retry_ms = await self._retry(lambda: self._probe_hit(keys=keys, args=args))
        if int(allowed) < 0:
            return None  # its bands point to a cluster opened since the caller looked
        return ProbeDecision(int(allowed) > 0, int(count), max(0.0, float(retry_ms) / 1000))

    # -- rate limits ----------------------------------------------------------

    async def take_tokens(
        self, tenant_id: str, rate_per_s: float, burst: float, cost: float
    ) -> RateDecision:
        # this debit's record (tenant slot), kept past the call's deadline: a retried
        # call finds it and debits nothing more
        keys = [
            self._keys.t(tenant_id, "ratelimit"),
            self._keys.t(tenant_id, "ratelimit-op", secrets.token_hex(8)),
        ]
        args: list[str | int] = [
            repr(float(rate_per_s)),
            repr(float(burst)),
            repr(float(cost)),
            math.ceil(self._timeout_s * 1000) + 1000,
        ]
        allowed, retry, left = await self._retry(lambda: self._take_tokens(keys=keys, args=args))
        return RateDecision(bool(int(allowed)), max(0.0, float(retry)), float(left))

    # -- idempotency ----------------------------------------------------------

    async def idempotency_get(self, tenant_id: str, key: str) -> IdempotencyRecord | None:
        rkey = self._keys.t(tenant_id, "idem", key)
        raw = cast("str | None", await self._retry(lambda: self._redis.get(rkey)))
        if raw is None:
            return None
        d = json.loads(raw)
        return IdempotencyRecord(
            body_hash=d["body_hash"], status_code=int(d["status_code"]), response=d["response"]
        )

    async def idempotency_put(
        self,
        tenant_id: str,
        key: str,
        record: IdempotencyRecord,
        ttl_s: int,
        overwrite: bool = False,
    ) -> bool:
        rkey = self._keys.t(tenant_id, "idem", key)
        raw = compact_json(
            {
                "body_hash": record.body_hash,
                "status_code": record.status_code,
                "response": record.response,
            }
        )

        def call() -> Any:
            return self._redis.set(rkey, raw, nx=not overwrite, ex=max(1, int(ttl_s)))

        if overwrite:  # a plain SET: the same value twice is one write
            return bool(await self._retry(call))
        async with self._guard():  # set-if-absent: a second attempt would find its own
            ok = await call()
        return bool(ok)

    async def idempotency_delete(self, tenant_id: str, key: str) -> None:
        rkey = self._keys.t(tenant_id, "idem", key)
        await self._retry(lambda: self._redis.delete(rkey))

    # -- stored responses -----------------------------------------------------

    async def response_put(
        self, tenant_id: str, response_id: str, record: dict[str, Any], ttl_s: int
    ) -> None:
        rkey = self._keys.t(tenant_id, "response", response_id)
        raw = compact_json(record)
        await self._retry(lambda: self._redis.set(rkey, raw, ex=max(1, int(ttl_s))))

    async def response_get(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        rkey = self._keys.t(tenant_id, "response", response_id)
        raw = cast("str | None", await self._retry(lambda: self._redis.get(rkey)))
        if raw is None:
            return None
        record: dict[str, Any] = json.loads(raw)
        return record
