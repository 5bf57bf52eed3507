"""Redis store: the deployment backend, shared by every API replica.

Layout (``p`` = prefix, ``t`` = tenant id)::

    p:tenants                 set   tenant ids
    p:tenant-names            hash  name -> tenant id (uniqueness)
    p:apikey:{sha256}         str   tenant id (authentication lookup)
    p:t:tenant                hash  TenantRecord fields
    p:t:keys                  hash  version -> KeyRecord JSON (wrapped key in base64)
    p:t:msgseq                str   last allocated message id (INCR)
    p:t:msgs                  hash  message id -> RegistryEntry JSON
    p:t:msgidx:{kv}:{bits}    zset  message ids issued under (key version, payload bits)
    p:t:msgbits:{kv}          set   payload lengths issued under a key version
    p:t:msgexp:{kv}:{bits}    str   entries of that index the retention sweep deleted
    p:t:msgexpired            str   the retention watermark: every id below it is expired
    p:t:retention             str   registry retention in days (absent: keep forever)
    p:t:ratelimit             hash  token bucket (tokens, ts), expires when full
    p:keyhash:{sha256}        str   "tenant id key id" of an API key (authentication lookup)
    p:t:apikeys               hash  key id -> ApiKeyRecord JSON
    p:t:apikeys-revoked       hash  key id -> revocation time
    p:t:probe:{k}:band:{b}    str   cluster id an anchor hash b of account k points to (TTL)
    p:t:probe:{k}:sk:{c}      str   the cluster's bottom-k sketches, base64 (TTL)
    p:t:probe:{k}:hits:{c}    zset  times of the cluster's counted queries (TTL)
    p:audit                   stream provenance audit log (one JSON field per entry)
    p:t:idem:{key}            str   IdempotencyRecord JSON, with a TTL
    p:marker                  str   the service's marker (written at first start)
    p:case:{id}               str   CaseRecord JSON (its text too, if kept), expiring at retention
    p:cases:all               zset  case ids by creation time (every case)
    p:cases:t:{t}             zset  case ids of tenant t (``-`` for the admin's)
    p:cases:b:{batch}         zset  case ids of one console batch

Every write that must be atomic is one Lua script (or WATCH/MULTI), so
concurrent API replicas can never hand out the same message id or create two
tenants with one name. All scripts declare the keys they touch.

Failure policy: fail fast. Each store call has a hard deadline of ``timeout_s``
(pool wait + connect + command), redis-py's own retries are disabled, and any
connection-level error becomes :class:`StoreUnavailable` whose message never
contains the URL or its password. Broken pooled connections are re-opened on
their next use, so the store recovers by itself when Redis comes back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from app.stores.base import (
    ApiKeyRecord,
    AuditRecord,
    CaseRecord,
    Conflict,
    IdempotencyRecord,
    KeyRecord,
    ProbeDecision,
    RateDecision,
    RegistryEntry,
    RegistryFull,
    RegistrySize,
    StoreUnavailable,
    TenantRecord,
    api_key_from_json,
    api_key_to_json,
    audit_from_json,
    audit_to_json,
    case_from_json,
    case_to_json,
    check_tenant_id,
    compact_json,
)

__all__ = ["RedisStore"]

# Errors that mean "the backend is not usable right now" (as opposed to a bug).
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # includes AuthenticationError, BusyLoadingError, pool exhaustion
    RedisTimeoutError,
    ReadOnlyError,  # failover in progress: we are talking to a replica
    OSError,
    TimeoutError,  # our own per-call deadline (asyncio.timeout)
)

# KEYS: names, tenants, apikey, tenant hash, keys hash
# ARGV: name, tenant_id, api_key_hash, created_at, scopes_json, key_version, key_json
_CREATE_TENANT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 'name' end
if redis.call('EXISTS', KEYS[3]) == 1 then return 'apikey' end
if redis.call('EXISTS', KEYS[4]) == 1 or redis.call('EXISTS', KEYS[5]) == 1 then
  return 'id'
end
redis.call('HSET', KEYS[4], 'tenant_id', ARGV[2], 'name', ARGV[1],
           'api_key_hash', ARGV[3], 'created_at', ARGV[4], 'scopes', ARGV[5])
redis.call('HSET', KEYS[5], ARGV[6], ARGV[7])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[2])
return 'ok'
"""

# KEYS: tenant hash, keys hash. ARGV: version, key_json.
# Versions are contiguous from 1, so HLEN is the latest version.
# Returns {1, latest} on success, {0, latest} on a version mismatch, {-1, 0} if no tenant.
_ADD_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local latest = redis.call('HLEN', KEYS[2])
if tonumber(ARGV[1]) ~= latest + 1 then return {0, latest} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {1, latest}
"""

# KEYS: msgseq, msgs hash, index zset, bit-length set. ARGV: entry JSON without
# the id, num_bits, max id (-1: none). Returns the id, or -1 (nothing written) at
# the max. INCR + write + index in one script: no two callers can get the same
# id, and an id is never visible without its entry.
_ALLOCATE = """
local max = tonumber(ARGV[3])
if max >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') >= max then return -1 end
local id = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], id, ARGV[1])
redis.call('ZADD', KEYS[3], id, id)
redis.call('SADD', KEYS[4], ARGV[2])
return id
"""

# Registry retention. KEYS: the watermark. ARGV: the new watermark (it never goes back).
_ADVANCE_WATERMARK = """
if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""

# KEYS: an index zset, its expired counter. ARGV: lowest, highest id to expire.
# Counts each removed id once, even with two sweeps running.
_EXPIRE_INDEX = """
local n = redis.call('ZREMRANGEBYSCORE', KEYS[1], ARGV[1], ARGV[2])
if n > 0 then redis.call('INCRBY', KEYS[2], n) end
return n
"""

# KEYS: an index zset. ARGV: ids separated by spaces (negative ones never match).
# Returns the 1-based positions of the ids in the index: a few integers, however many
# were asked (ZMSCORE would send back, and redis-py parse, one reply per id).
_ISSUED_AMONG = """
local out, i = {}, 0
for id in string.gmatch(ARGV[1], '%S+') do
  i = i + 1
  if redis.call('ZSCORE', KEYS[1], id) then out[#out + 1] = i end
end
return out
"""

# KEYS: tenant hash. ARGV: scopes JSON. 1 if updated, 0 if no such tenant.
_SET_SCOPES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'scopes', ARGV[1])
return 1
"""

# Token bucket. KEYS: bucket hash. ARGV: rate per second, burst, cost.
# Redis's own clock (TIME) so every replica of the API shares one time base.
# Returns {allowed, retry_after_s, tokens_left} (floats as strings).
_TAKE_TOKENS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(h[1]), tonumber(h[2])
if tokens == nil or ts == nil then tokens, ts = burst, now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed, retry = 0, (cost - tokens) / rate
if tokens >= cost then
  tokens, allowed, retry = tokens - cost, 1, 0
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens),
           'ts', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, string.format('%.6f', retry), string.format('%.6f', tokens)}
"""

# KEYS: apikeys hash, keyhash lookup. ARGV: key id, record JSON, "tenant key" ref.
# 0 if the key id exists, -1 if the hash is taken, 1 when written.
_ADD_API_KEY = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
return 1
"""

# KEYS: apikeys hash, revoked hash. ARGV: key id, time. 0 if no such key.
_REVOKE_API_KEY = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# Sliding-window probe counter. KEYS: hits zset, sketch key, band keys...
# ARGV: window ms, budget, cluster id, sketch ('' keeps the old one), member nonce.
# Redis's clock, so every replica shares one time base.
# Returns {allowed, count, retry_after_ms}.
_PROBE_HIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
if count >= budget then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local retry = window
  if oldest[2] then retry = tonumber(oldest[2]) + window - now end
  return {0, count, retry}
end
redis.call('ZADD', KEYS[1], now, now .. ':' .. ARGV[5])
redis.call('PEXPIRE', KEYS[1], window)
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', window)
  for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[3], 'PX', window) end
else
  redis.call('PEXPIRE', KEYS[2], window)
end
return {1, count + 1, 0}
"""

AUDIT_MAXLEN = 1_000_000  # approximate trim; older records go first


def _key_to_json(key: KeyRecord) -> str:
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
        }
    )


def _key_from_json(tenant_id: str, raw: str) -> KeyRecord:
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


class RedisStore:
    """:class:`~app.stores.base.Store` on Redis (redis-py asyncio, bounded blocking pool)."""

    def __init__(
        self,
        url: str,
        prefix: str = "wc",
        timeout_s: float = 2.0,
        max_connections: int = 64,
    ) -> None:
        if not prefix or ":" in prefix:
            raise ValueError("prefix must be non-empty and contain no ':'")
        parts = urlsplit(url)
        # Kept only to scrub it from error messages; never logged or shown.
        self._password = parts.password or ""
        self._where = f"{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path or ''}"
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._pool: BlockingConnectionPool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,  # waiting for a free pooled connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast; the caller answers 503
            # Off: with maintenance notifications on, redis-py skips its check for dead
            # pooled sockets (so the first calls after an outage fail again) and may
            # relax timeouts to many seconds during server maintenance.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
            decode_responses=True,
        )
        self._redis: Redis = Redis.from_pool(self._pool)
        self._create_tenant = self._redis.register_script(_CREATE_TENANT)
        self._add_key = self._redis.register_script(_ADD_KEY)
        self._allocate = self._redis.register_script(_ALLOCATE)
        self._advance_watermark = self._redis.register_script(_ADVANCE_WATERMARK)
        self._expire_index = self._redis.register_script(_EXPIRE_INDEX)
        self._issued_among = self._redis.register_script(_ISSUED_AMONG)
        self._set_scopes = self._redis.register_script(_SET_SCOPES)
        self._take_tokens = self._redis.register_script(_TAKE_TOKENS)
        self._add_api_key = self._redis.register_script(_ADD_API_KEY)
        self._revoke_api_key = self._redis.register_script(_REVOKE_API_KEY)
        self._probe_hit = self._redis.register_script(_PROBE_HIT)

    def __repr__(self) -> str:
        return f"RedisStore({self._where!r}, prefix={self._prefix!r})"

    # -- plumbing -------------------------------------------------------------

    def _t(self, tenant_id: str, *parts: object) -> str:
        return ":".join([self._prefix, check_tenant_id(tenant_id), *map(str, parts)])

    def _g(self, *parts: object) -> str:
        return ":".join([self._prefix, *map(str, parts)])

    def _reason(self, exc: BaseException) -> str:
        text = str(exc) or type(exc).__name__
        if self._password:
            text = text.replace(self._password, "***")
        return f"{type(exc).__name__}: {text}"[:200]

    @contextlib.asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        """Bound the whole call by ``timeout_s`` and map outages to StoreUnavailable."""
        try:
            async with asyncio.timeout(self._timeout_s):
                yield
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis unavailable: {self._reason(exc)}") from None

    # -- lifecycle ------------------------------------------------------------

    async def ping(self) -> None:
        async with self._guard():
            await self._redis.ping()

    async def ensure_marker(self, value: str) -> str:
        async with self._guard():
            await self._redis.set(self._g("marker"), value, nx=True)
            stored = await self._redis.get(self._g("marker"))
        return str(stored if stored is not None else value)

    async def marker(self) -> str | None:
        async with self._guard():
            stored = await self._redis.get(self._g("marker"))
        return None if stored is None else str(stored)

    async def close(self) -> None:
        # Closing the client closes the pool too (it was created with from_pool).
        with contextlib.suppress(*_UNAVAILABLE):
            await self._redis.aclose()

    # -- tenants --------------------------------------------------------------

    async def create_tenant(self, tenant: TenantRecord, key: KeyRecord) -> None:
        if key.tenant_id != tenant.tenant_id or key.version != 1:
            raise ValueError("the first key must be version 1 of the same tenant")
        tid = tenant.tenant_id
        keys = [
            self._g("tenant-names"),
            self._g("tenants"),
            self._g("apikey", tenant.api_key_hash),
            self._t(tid, "tenant"),
            self._t(tid, "keys"),
        ]
        args: list[str | int] = [
            tenant.name,
            tid,
            tenant.api_key_hash,
            repr(float(tenant.created_at)),
            compact_json(list(tenant.scopes)),
            key.version,
            _key_to_json(key),
        ]
        async with self._guard():
            result = await self._create_tenant(keys=keys, args=args)
        if result == "name":
            raise Conflict(f"tenant name {tenant.name!r} already exists")
        if result == "apikey":
            raise Conflict("api key hash already in use")
        if result == "id":
            raise Conflict(f"tenant id {tid!r} already exists")

    async def get_tenant(self, tenant_id: str) -> TenantRecord | None:
        key = self._t(tenant_id, "tenant")
        async with self._guard():
            h = cast("dict[str, str]", await self._redis.hgetall(key))
        return _tenant_from_hash(h)

    async def tenant_by_api_key_hash(self, api_key_hash: str) -> TenantRecord | None:
        async with self._guard():
            tid = cast("str | None", await self._redis.get(self._g("apikey", api_key_hash)))
            if tid is None:
                return None
            h = cast("dict[str, str]", await self._redis.hgetall(self._t(tid, "tenant")))
        return _tenant_from_hash(h)

    async def list_tenants(self) -> list[TenantRecord]:
        async with self._guard():
            ids = cast("set[str]", await self._redis.smembers(self._g("tenants")))
            async with self._redis.pipeline(transaction=False) as pipe:
                for tid in sorted(ids):
                    pipe.hgetall(self._t(tid, "tenant"))
                hashes: list[dict[str, str]] = await pipe.execute()
        tenants = [t for h in hashes if (t := _tenant_from_hash(h)) is not None]
        return sorted(tenants, key=lambda t: (t.created_at, t.tenant_id))

    async def set_scopes(self, tenant_id: str, scopes: tuple[str, ...]) -> TenantRecord | None:
        key = self._t(tenant_id, "tenant")
        async with self._guard():
            updated = await self._set_scopes(keys=[key], args=[compact_json(list(scopes))])
            if not int(updated):
                return None
            h = cast("dict[str, str]", await self._redis.hgetall(key))
        return _tenant_from_hash(h)

    # -- watermark keys -------------------------------------------------------

    async def add_key_version(self, key: KeyRecord) -> None:
        keys = [self._t(key.tenant_id, "tenant"), self._t(key.tenant_id, "keys")]
        async with self._guard():
            status, latest = await self._add_key(keys=keys, args=[key.version, _key_to_json(key)])
        if int(status) == -1:
            raise Conflict(f"unknown tenant {key.tenant_id!r}")
        if int(status) == 0:
            raise Conflict(f"key version must be {int(latest) + 1}, got {key.version}")

    async def key_versions(self, tenant_id: str) -> list[KeyRecord]:
        key = self._t(tenant_id, "keys")
        async with self._guard():
            h = cast("dict[str, str]", await self._redis.hgetall(key))
        return sorted(
            (_key_from_json(tenant_id, raw) for raw in h.values()), key=lambda k: k.version
        )

    async def replace_wrapped_keys(self, keys: list[KeyRecord]) -> None:
        """All-or-nothing (WATCH/MULTI); Conflict if a version does not exist."""
        if not keys:
            return
        hashes = sorted({self._t(k.tenant_id, "keys") for k in keys})
        async with self._guard(), self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(*hashes)
                    updates: list[tuple[str, int, str]] = []
                    for k in keys:
                        hkey = self._t(k.tenant_id, "keys")
                        raw = cast("str | None", await pipe.hget(hkey, str(k.version)))
                        if raw is None:
                            raise Conflict(f"no key version {k.version} for {k.tenant_id!r}")
                        d = json.loads(raw)
                        d["wrapped_key"] = base64.b64encode(k.wrapped_key).decode("ascii")
                        updates.append((hkey, k.version, compact_json(d)))
                    pipe.multi()  # type: ignore[no-untyped-call]
                    for hkey, version, raw in updates:
                        pipe.hset(hkey, str(version), raw)
                    await pipe.execute()
                    return
                except WatchError:
                    continue  # a concurrent writer touched the keys: re-read and retry

    async def all_key_versions(self) -> list[KeyRecord]:
        async with self._guard():
            ids = sorted(cast("set[str]", await self._redis.smembers(self._g("tenants"))))
            async with self._redis.pipeline(transaction=False) as pipe:
                for tid in ids:
                    pipe.hgetall(self._t(tid, "keys"))
                hashes: list[dict[str, str]] = await pipe.execute()
        return [
            _key_from_json(tid, raw)
            for tid, h in zip(ids, hashes, strict=True)
            for raw in sorted(h.values(), key=lambda r: int(json.loads(r)["version"]))
        ]

    # -- registry -------------------------------------------------------------

    async def allocate_message(
        self,
        tenant_id: str,
        key_version: int,
        num_bits: int,
        metadata: dict[str, Any],
        issued_at: float,
        max_id: int | None = None,
    ) -> RegistryEntry:
        """One Lua script; the reply comes after Redis applied (and, per its AOF policy,
        persisted) the write, so a returned id is always backed by an entry."""
        payload = compact_json(
            {
                "key_version": key_version,
                "num_bits": num_bits,
                "metadata": metadata,
                "issued_at": issued_at,
            }
        )
        keys = [
            self._t(tenant_id, "msgseq"),
            self._t(tenant_id, "msgs"),
            self._t(tenant_id, "msgidx", key_version, num_bits),
            self._t(tenant_id, "msgbits", key_version),
        ]
        async with self._guard():
            limit = -1 if max_id is None else int(max_id)
            message_id = int(await self._allocate(keys=keys, args=[payload, num_bits, limit]))
        if message_id < 0:
            raise RegistryFull(f"no message id left below {max_id}")
        return RegistryEntry(
            tenant_id=tenant_id,
            message_id=message_id,
            key_version=key_version,
            num_bits=num_bits,
            metadata=json.loads(compact_json(metadata)),  # same shape a later read returns
            issued_at=issued_at,
        )

    async def registry_entry(self, tenant_id: str, message_id: int) -> RegistryEntry | None:
        key = self._t(tenant_id, "msgs")
        async with self._guard():
            raw = cast("str | None", await self._redis.hget(key, str(int(message_id))))
        if raw is None:
            return None
        d = json.loads(raw)
        return RegistryEntry(
            tenant_id=tenant_id,
            message_id=int(message_id),
            key_version=int(d["key_version"]),
            num_bits=int(d["num_bits"]),
            metadata=d["metadata"],
            issued_at=float(d["issued_at"]),
        )

    async def message_ids(
        self, tenant_id: str, key_version: int, num_bits: int, after: int = 0
    ) -> list[int]:
        key = self._t(tenant_id, "msgidx", int(key_version), int(num_bits))
        async with self._guard():
            if after > 0:
                got = await self._redis.zrangebyscore(key, f"({int(after)}", "+inf")
            else:
                got = await self._redis.zrange(key, 0, -1)
            ids = cast("list[str]", got)
        return [int(i) for i in ids]

    async def registry_bit_lengths(self, tenant_id: str, key_version: int) -> list[int]:
        key = self._t(tenant_id, "msgbits", int(key_version))
        async with self._guard():
            bits = cast("set[str]", await self._redis.smembers(key))
        return sorted(int(b) for b in bits)

    async def void_message(self, tenant_id: str, message_id: int, reason: str) -> bool:
        entry = await self.registry_entry(tenant_id, message_id)
        if entry is None:
            return False
        index = self._t(tenant_id, "msgidx", entry.key_version, entry.num_bits)
        async with self._guard():  # msgseq is untouched: the id is never handed out again
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hdel(self._t(tenant_id, "msgs"), str(int(message_id)))
                pipe.zrem(index, str(int(message_id)))
                removed, _ = await pipe.execute()
        return bool(removed)

    # -- registry lookup and retention (issue #36) -----------------------------

    async def registry_size(self, tenant_id: str, key_version: int, num_bits: int) -> RegistrySize:
        kv, bits = int(key_version), int(num_bits)
        async with self._guard():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zcard(self._t(tenant_id, "msgidx", kv, bits))
                pipe.get(self._t(tenant_id, "msgexp", kv, bits))
                pipe.get(self._t(tenant_id, "msgexpired"))
                pipe.get(self._t(tenant_id, "msgseq"))
                live, expired, below, last = await pipe.execute()
        return RegistrySize(int(live), int(expired or 0), int(below or 0), int(last or 0))

    async def issued_among(
        self, tenant_id: str, key_version: int, num_bits: int, message_ids: list[int]
    ) -> list[bool]:
        if not message_ids:
            return []
        key = self._t(tenant_id, "msgidx", int(key_version), int(num_bits))
        wanted = " ".join(str(int(i)) for i in message_ids)
        async with self._guard():  # one string argument, hits only back: ~1 us an id
            hits = cast("list[int]", await self._issued_among(keys=[key], args=[wanted]))
        found = [False] * len(message_ids)
        for i in hits:
            found[int(i) - 1] = True
        return found

    async def allocate_messages(
        self,
        tenant_id: str,
        key_version: int,
        num_bits: int,
        metadata: dict[str, Any],
        issued_at: float,
        count: int,
    ) -> range:
        """``count`` entries at once, with the writes ``allocate_message`` makes (one
        INCRBY takes the ids; no ``max_id`` check): for ``worldcup bench-registry`` and
        bulk imports. Redis only; not part of the Store protocol."""
        entry = compact_json(
            {
                "key_version": int(key_version),
                "num_bits": int(num_bits),
                "metadata": metadata,
                "issued_at": issued_at,
            }
        )
        async with self._guard():
            last = int(await self._redis.incrby(self._t(tenant_id, "msgseq"), int(count)))
            ids = range(last - int(count) + 1, last + 1)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._t(tenant_id, "msgs"), mapping={str(i): entry for i in ids})
                index = self._t(tenant_id, "msgidx", int(key_version), int(num_bits))
                pipe.zadd(index, {str(i): i for i in ids})
                pipe.sadd(self._t(tenant_id, "msgbits", int(key_version)), str(int(num_bits)))
                await pipe.execute()
        return ids

    async def set_registry_retention(self, tenant_id: str, days: float | None) -> None:
        key = self._t(tenant_id, "retention")
        async with self._guard():
            if days is None:
                await self._redis.delete(key)
            else:
                await self._redis.set(key, repr(float(days)))

    async def registry_retention(self, tenant_id: str) -> float | None:
        async with self._guard():
            raw = cast("str | None", await self._redis.get(self._t(tenant_id, "retention")))
        return None if raw is None else float(raw)

    async def _first_issued_at_or_after(self, tenant_id: str, lo: int, hi: int, t: float) -> int:
        """The first id in [lo, hi) issued at or after ``t`` (hi if none), by binary
        search over the time-ordered ids; voided (absent) ids are stepped over."""
        msgs = self._t(tenant_id, "msgs")
        while lo < hi:
            mid = (lo + hi) // 2
            found: tuple[int, float] | None = None
            start = mid
            while found is None and start < hi:
                window = list(range(start, min(start + 64, hi)))
                async with self._guard():
                    raws = cast("list[str | None]", await self._redis.hmget(msgs, window))
                for i, raw in zip(window, raws, strict=True):
                    if raw is not None:
                        found = (i, float(json.loads(raw)["issued_at"]))
                        break
                start = window[-1] + 1
            if found is None or found[1] >= t:
                hi = mid  # nothing live in [mid, first new id): the boundary is at most mid
            else:
                lo = found[0] + 1
        return lo

    async def expire_registry(self, tenant_id: str, issued_before: float) -> int:
        async with self._guard():
            below_raw, seq_raw, versions = await asyncio.gather(
                self._redis.get(self._t(tenant_id, "msgexpired")),
                self._redis.get(self._t(tenant_id, "msgseq")),
                self._redis.hkeys(self._t(tenant_id, "keys")),
            )
        old = max(int(below_raw or 0), 1)
        seq = int(seq_raw or 0)
        new = await self._first_issued_at_or_after(tenant_id, old, seq + 1, issued_before)
        if new <= old:
            return 0
        indexes = []
        for kv in sorted(int(v) for v in cast("list[str]", versions)):
            async with self._guard():
                lengths = cast(
                    "set[str]", await self._redis.smembers(self._t(tenant_id, "msgbits", kv))
                )
            indexes += [(kv, int(b)) for b in lengths]
        async with self._guard():  # the watermark first: these ids now answer "expired"
            await self._advance_watermark(keys=[self._t(tenant_id, "msgexpired")], args=[new])
        deleted = 0
        for kv, bits in indexes:
            keys = [self._t(tenant_id, "msgidx", kv, bits), self._t(tenant_id, "msgexp", kv, bits)]
            async with self._guard():
                deleted += int(await self._expire_index(keys=keys, args=[old, new - 1]))
        for start in range(old, new, 10_000):
            ids = [str(i) for i in range(start, min(start + 10_000, new))]
            async with self._guard():
                await self._redis.hdel(self._t(tenant_id, "msgs"), *ids)
        return deleted

    # -- audit log ------------------------------------------------------------

    async def append_audit(self, record: AuditRecord) -> None:
        data = audit_to_json(record)
        async with self._guard():
            await self._redis.xadd(
                self._g("audit"), {"json": data}, maxlen=AUDIT_MAXLEN, approximate=True
            )

    async def audit_log(self, limit: int) -> list[AuditRecord]:
        async with self._guard():
            rows = cast(
                "list[tuple[str, dict[str, str]]]",
                await self._redis.xrevrange(self._g("audit"), count=max(1, int(limit))),
            )
        return [audit_from_json(fields["json"], str(entry_id)) for entry_id, fields in rows]

    # -- rate limits ----------------------------------------------------------

    # -- API keys -------------------------------------------------------------

    async def add_api_key(self, key: ApiKeyRecord) -> bool:
        keys = [self._t(key.tenant_id, "apikeys"), self._g("keyhash", key.key_hash)]
        args = [key.key_id, api_key_to_json(key), f"{key.tenant_id} {key.key_id}"]
        async with self._guard():
            result = int(await self._add_api_key(keys=keys, args=args))
        if result == -1:
            raise Conflict("api key hash already in use")
        if result == 1 and key.revoked_at is not None:
            await self.revoke_api_key(key.tenant_id, key.key_id, key.revoked_at)
        return result == 1

    async def _api_key(self, tenant_id: str, key_id: str) -> ApiKeyRecord | None:
        async with self._guard():
            raw = cast("str | None", await self._redis.hget(self._t(tenant_id, "apikeys"), key_id))
            revoked = cast(
                "str | None", await self._redis.hget(self._t(tenant_id, "apikeys-revoked"), key_id)
            )
        if raw is None:
            return None
        return api_key_from_json(raw, None if revoked is None else float(revoked))

    async def api_key_by_hash(self, key_hash: str) -> ApiKeyRecord | None:
        async with self._guard():
            ref = cast("str | None", await self._redis.get(self._g("keyhash", key_hash)))
        if ref is None:
            return None
        tenant_id, _, key_id = ref.partition(" ")
        return await self._api_key(tenant_id, key_id)

    async def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        async with self._guard():
            raw = cast("dict[str, str]", await self._redis.hgetall(self._t(tenant_id, "apikeys")))
            revoked = cast(
                "dict[str, str]", await self._redis.hgetall(self._t(tenant_id, "apikeys-revoked"))
            )
        keys = [
            api_key_from_json(v, float(revoked[k]) if k in revoked else None)
            for k, v in raw.items()
        ]
        return sorted(keys, key=lambda k: (k.created_at, k.key_id))

    async def revoke_api_key(self, tenant_id: str, key_id: str, at: float) -> ApiKeyRecord | None:
        keys = [self._t(tenant_id, "apikeys"), self._t(tenant_id, "apikeys-revoked")]
        async with self._guard():
            found = int(await self._revoke_api_key(keys=keys, args=[key_id, repr(float(at))]))
        if not found:
            return None
        return await self._api_key(tenant_id, key_id)

    # -- probe accounting -----------------------------------------------------

    def _probe(self, tenant_id: str, key_id: str, *parts: object) -> str:
        if not key_id or ":" in key_id:
            raise ValueError("invalid key id")
        return self._t(tenant_id, "probe", key_id, *parts)

    async def probe_candidates(
        self, tenant_id: str, key_id: str, bands: list[str], limit: int = 8, min_hits: int = 1
    ) -> list[tuple[str, bytes]]:
        if not bands or limit <= 0:
            return []
        band = self._probe(tenant_id, key_id, "band", "")  # checked once, then joined
        band_keys = [band + b for b in bands]
        async with self._guard():
            refs = cast("list[str | None]", await self._redis.mget(band_keys))
            counts = Counter(r for r in refs if r is not None)
            hit = [c for c, n in counts.items() if n >= min_hits]
            ids = sorted(hit, key=lambda c: (-counts[c], c))[:limit]
            if not ids:
                return []
            sketches = cast(
                "list[str | None]",
                await self._redis.mget([self._probe(tenant_id, key_id, "sk", c) for c in ids]),
            )
        return [
            (c, base64.b64decode(sk)) for c, sk in zip(ids, sketches, strict=True) if sk is not None
        ]

    async def probe_hit(
        self,
        tenant_id: str,
        key_id: str,
        cluster_id: str,
        sketch: bytes | None,
        bands: list[str],
        window_s: float,
        budget: int,
    ) -> ProbeDecision:
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
            secrets.token_hex(6),
        ]
        async with self._guard():
            allowed, count, retry_ms = await self._probe_hit(keys=keys, args=args)
        return ProbeDecision(bool(int(allowed)), int(count), max(0.0, float(retry_ms) / 1000))

    async def take_tokens(
        self, tenant_id: str, rate_per_s: float, burst: float, cost: float
    ) -> RateDecision:
        key = self._t(tenant_id, "ratelimit")
        async with self._guard():
            allowed, retry, left = await self._take_tokens(
                keys=[key], args=[repr(float(rate_per_s)), repr(float(burst)), repr(float(cost))]
            )
        return RateDecision(bool(int(allowed)), max(0.0, float(retry)), float(left))

    # -- idempotency ----------------------------------------------------------

    async def idempotency_get(self, tenant_id: str, key: str) -> IdempotencyRecord | None:
        rkey = self._t(tenant_id, "idem", key)
        async with self._guard():
            raw = cast("str | None", await self._redis.get(rkey))
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
        rkey = self._t(tenant_id, "idem", key)
        raw = compact_json(
            {
                "body_hash": record.body_hash,
                "status_code": record.status_code,
                "response": record.response,
            }
        )
        async with self._guard():
            ok = await self._redis.set(rkey, raw, nx=not overwrite, ex=max(1, int(ttl_s)))
        return bool(ok)

    async def idempotency_delete(self, tenant_id: str, key: str) -> None:
        rkey = self._t(tenant_id, "idem", key)
        async with self._guard():
            await self._redis.delete(rkey)

    # -- console cases --------------------------------------------------------

    def _case_indexes(self, case: CaseRecord) -> list[str]:
        owner = check_tenant_id(case.tenant_id) if case.tenant_id is not None else "-"
        keys = [self._g("cases", "all"), self._g("cases", "t", owner)]
        if case.batch_id is not None:
            keys.append(self._g("cases", "b", check_tenant_id(case.batch_id)))
        return keys

    async def put_case(self, case: CaseRecord) -> None:
        key = self._g("case", check_tenant_id(case.case_id))
        async with self._guard():
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(key, case_to_json(case))
            if case.expires_at is not None:
                pipe.pexpireat(key, int(case.expires_at * 1000))
            for index in self._case_indexes(case):
                pipe.zadd(index, {case.case_id: case.created_at})
            await pipe.execute()

    async def get_case(self, case_id: str, now: float) -> CaseRecord | None:
        try:
            key = self._g("case", check_tenant_id(case_id))
        except ValueError:
            return None
        async with self._guard():
            raw = cast("str | None", await self._redis.get(key))
        if raw is None:
            return None
        case = case_from_json(raw)
        if case.expires_at is not None and case.expires_at <= now:
            return None
        return case

    async def list_cases(
        self, tenant_id: str | None, batch_id: str | None, limit: int, now: float
    ) -> list[CaseRecord]:
        if batch_id is not None:
            index = self._g("cases", "b", check_tenant_id(batch_id))
        elif tenant_id is not None:
            index = self._g("cases", "t", check_tenant_id(tenant_id))
        else:
            index = self._g("cases", "all")
        out: list[CaseRecord] = []
        gone: list[str] = []
        start, page = 0, 200
        while len(out) < limit:  # newest first, a page of ids at a time
            async with self._guard():
                chunk = cast(
                    "list[str]", await self._redis.zrevrange(index, start, start + page - 1)
                )
                if not chunk:
                    break
                raws = cast(
                    "list[str | None]",
                    await self._redis.mget([self._g("case", c) for c in chunk]),
                )
            start += page
            for case_id, raw in zip(chunk, raws, strict=True):
                case = case_from_json(raw) if raw is not None else None
                if case is None or (case.expires_at is not None and case.expires_at <= now):
                    gone.append(case_id)
                    continue
                if tenant_id is not None and case.tenant_id != tenant_id:
                    continue
                out.append(case)
                if len(out) >= limit:
                    break
        if gone:  # expired: their index entries go too
            async with self._guard():
                pipe = self._redis.pipeline(transaction=False)
                pipe.zrem(index, *gone)
                pipe.zrem(self._g("cases", "all"), *gone)
                await pipe.execute()
        return out

    async def delete_case(self, case_id: str) -> bool:
        try:
            key = self._g("case", check_tenant_id(case_id))
        except ValueError:
            return False
        async with self._guard():
            raw = cast("str | None", await self._redis.get(key))
            if raw is None:
                return False
            case = case_from_json(raw)
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            for index in self._case_indexes(case):
                pipe.zrem(index, case_id)
            await pipe.execute()
        return True

    # -- stored responses -----------------------------------------------------

    async def response_put(
        self, tenant_id: str, response_id: str, record: dict[str, Any], ttl_s: int
    ) -> None:
        rkey = self._t(tenant_id, "response", response_id)
        async with self._guard():
            await self._redis.set(rkey, compact_json(record), ex=max(1, int(ttl_s)))

    async def response_get(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        rkey = self._t(tenant_id, "response", response_id)
        async with self._guard():
            raw = cast("str | None", await self._redis.get(rkey))
        if raw is None:
            return None
        record: dict[str, Any] = json.loads(raw)
        return record
