"""``worldcup migrate-store``: a legacy-layout Redis namespace into the cluster layout.

The legacy layout (before cluster support) kept a tenant's keys as ``p:t:<name>`` and
its whole registry in one hash, ``p:t:msgs``; the current one (redis_layout) tags a
tenant's keys ``p:{t}:…`` and buckets the registry by id range. Global keys keep their
names. The migration reads the source (one Redis, legacy layout) and writes the target
(the same Redis, another one, or a Redis Cluster):

- every tenant's keys are copied under their new names (``DUMP``/``RESTORE``, TTLs
  kept); rate-limit buckets and probe counters (short-lived) are left behind, but
  not the probe tables' durable records (recorded client payloads, repeat counts);
- the registry's entries and indexes are re-written bucket by bucket, and each
  index's live counter is set from its size; message ids, the id counter and key
  versions are unchanged, so every text issued before decodes to its entry afterwards;
- global keys are copied only when the target is another server (in place they stay);
- last, ``p:layout`` is written: the service refuses a namespace without it.

Re-running is safe (every write overwrites with the same value). Stop the API
replicas while it runs: writes made meanwhile would not be copied. The legacy keys are
kept unless ``delete_legacy`` is set (after a successful copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from app.stores.client_payloads import durable_probe_key
from app.stores.redis import RedisStore
from app.stores.redis_layout import LAYOUT_VERSION, Layout, bucket_of, glob_escape

# short-lived per-tenant keys that are not carried over
_SKIPPED = ("ratelimit", "probe")
# global keys (exact names and prefixes) copied when the target is another server
_GLOBAL_KEYS = ("tenants", "tenant-names", "audit", "marker")
_GLOBAL_PATTERNS = ("apikey:*", "keyhash:*", "case:*", "cases:*")
_BATCH = 1000


@dataclass
class MigrationReport:
    tenants: int = 0
    entries: int = 0
    keys_copied: int = 0
    global_keys: int = 0
    legacy_deleted: int = 0
    already_migrated: bool = False


async def _scan(client: Any, pattern: str) -> list[bytes]:
    return [k async for k in client.scan_iter(match=pattern, count=1000)]


async def _copy(src: Any, dst: Any, old: bytes | str, new: str) -> bool:
    payload = await src.dump(old)
    if payload is None:
        return False
    ttl = int(await src.pttl(old))
    await dst.restore(new, max(0, ttl), payload, replace=True)
    return True


async def migrate_store(
    source_url: str,
    prefix: str = "wc",
    target_url: str | None = None,
    target_cluster: bool = False,
    delete_legacy: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> MigrationReport:
    """Copy ``prefix``'s legacy-layout keys at ``source_url`` into the current layout at
    ``target_url`` (default: the same Redis)."""
    layout = Layout(prefix)
    in_place = (target_url is None or target_url == source_url) and not target_cluster
    src: Any = Redis.from_url(source_url, decode_responses=False)  # bytes: DUMP payloads
    target = RedisStore(target_url or source_url, prefix=prefix, cluster=target_cluster)
    dst: Any = target._redis  # the store's own client: one connection setup, cluster-aware
    report = MigrationReport()
    try:
        if in_place and (await src.get(layout.g("layout"))) == LAYOUT_VERSION.encode():
            report.already_migrated = True
            return report
        tenant_ids = sorted(t.decode() for t in await src.smembers(layout.g("tenants")))
        legacy: list[bytes] = []
        for tid in tenant_ids:
            copied, entries, old = await _migrate_tenant(src, dst, layout, tid)
            report.tenants += 1
            report.keys_copied += copied
            report.entries += entries
            legacy += old
            progress(f"tenant {tid}: {entries} registry entries, {copied} keys")
        if not in_place:
            for name in _GLOBAL_KEYS:
                report.global_keys += await _copy(src, dst, layout.g(name), layout.g(name))
            for pattern in _GLOBAL_PATTERNS:
                for key in await _scan(src, glob_escape(layout.g("")) + pattern):
                    report.global_keys += await _copy(src, dst, key, key.decode())
            progress(f"{report.global_keys} global keys")
        await dst.set(layout.g("layout"), LAYOUT_VERSION)
        if delete_legacy:
            for i in range(0, len(legacy), 500):
                report.legacy_deleted += int(await src.delete(*legacy[i : i + 500]))
        return report
    finally:
        await src.aclose()
        await target.close()


async def _migrate_tenant(
    src: Any, dst: Any, layout: Layout, tid: str
) -> tuple[int, int, list[bytes]]:
    """(keys copied, registry entries, the tenant's legacy keys)."""
    base = layout.legacy(tid, "")
    old_keys = await _scan(src, glob_escape(base) + "*")
    copied = entries = 0
    for key in old_keys:
        rest = key.decode()[len(base) :]
        kind, _, after = rest.partition(":")
        durable = kind == "probe" and durable_probe_key(after.split(":", 1)[0])
        if (kind in _SKIPPED and not durable) or kind in ("msgs", "msgidx"):
            continue
        copied += await _copy(src, dst, key, layout.t(tid, rest))
    # the registry: one hash -> buckets of BUCKET_IDS ids
    msgs = layout.legacy(tid, "msgs")
    cursor = 0
    while True:
        cursor, chunk = await src.hscan(msgs, cursor, count=_BATCH)
        by_bucket: dict[int, dict[str, bytes]] = {}
        for mid, raw in chunk.items():
            by_bucket.setdefault(bucket_of(int(mid)), {})[mid.decode()] = raw
        pipe = dst.pipeline()
        for b, mapping in by_bucket.items():
            pipe.hset(layout.msgs(tid, b), mapping=mapping)
        if by_bucket:
            await pipe.execute()
        entries += len(chunk)
        if cursor == 0:
            break
    for index in await _scan(src, glob_escape(layout.legacy(tid, "msgidx:")) + "*"):
        kv, bits = index.decode().rsplit(":", 2)[-2:]
        # the live counter the lookup's registry size reads (the legacy layout had none)
        await dst.set(layout.t(tid, "msglive", int(kv), int(bits)), int(await src.zcard(index)))
        start = 0
        while True:
            rows = await src.zrange(index, start, start + _BATCH - 1, withscores=True)
            if not rows:
                break
            by_bucket_z: dict[int, dict[str, float]] = {}
            for member, score in rows:
                by_bucket_z.setdefault(bucket_of(int(member)), {})[member.decode()] = score
            pipe = dst.pipeline()
            for b, members in by_bucket_z.items():
                pipe.zadd(layout.idx(tid, b, int(kv), int(bits)), members)
            await pipe.execute()
            start += _BATCH
    return copied, entries, old_keys
