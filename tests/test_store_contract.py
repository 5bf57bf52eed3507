"""One contract suite for every store backend (SQLite, Redis and Redis Cluster).

The Redis Cluster runs (pytest mark ``cluster``, ``make test-cluster``) use a real
six-node cluster that the session starts (tests/redis_cluster.py).

Redis tests use a real server (``WORLDCUP_TEST_REDIS_URL``, default
``redis://127.0.0.1:6379/15``) with a unique key prefix per test, removed
afterwards. An unreachable Redis fails the run when ``CI`` is set and is only
skipped on a developer machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from pydantic import SecretStr
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from app.core.config import Settings
from app.stores import redis_layout, redis_registry, sqlite_registry
from app.stores.base import (
    COUNT_ONLY,
    ApiKeyRecord,
    AuditRecord,
    Conflict,
    IdempotencyRecord,
    KeyRecord,
    RegistryEntry,
    RegistryFull,
    Store,
    StoreUnavailable,
    TenantRecord,
)
from app.stores.factory import make_store
from app.stores.redis import RedisStore, key_from_json, key_to_json
from app.stores.sqlite import SQLiteStore

pytestmark = pytest.mark.anyio

REDIS_URL = os.environ.get("WORLDCUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
_REDIS_WHERE = urlsplit(REDIS_URL)._replace(netloc=urlsplit(REDIS_URL).netloc.rpartition("@")[2])


class FakeClock:
    """Lets SQLite idempotency records expire without sleeping."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def redis_unreachable(exc: BaseException) -> None:
    msg = f"Redis test server at {_REDIS_WHERE.geturl()} is unreachable ({exc})"
    if os.environ.get("CI"):
        pytest.fail(f"{msg}; CI must run the Redis store tests", pytrace=False)
    pytest.skip(f"{msg}; start redis-server or set WORLDCUP_TEST_REDIS_URL")


@contextlib.asynccontextmanager
async def redis_namespace() -> AsyncIterator[str]:
    """A fresh key prefix on the test server; every key under it is deleted afterwards."""
    prefix = f"wctest-{uuid.uuid4().hex}"
    probe = RedisStore(REDIS_URL, prefix=prefix, timeout_s=2.0)
    try:
        await probe.ping()
    except StoreUnavailable as exc:
        await probe.close()
        redis_unreachable(exc)
    await probe.close()
    try:
        yield prefix
    finally:
        client: Redis = Redis.from_url(REDIS_URL)
        try:
            doomed = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
            for i in range(0, len(doomed), 500):
                await client.delete(*doomed[i : i + 500])
        finally:
            await client.aclose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", "redis", pytest.param("cluster", marks=pytest.mark.cluster)])
async def store(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        s: Store = SQLiteStore(tmp_path / "store.sqlite3", clock=clock)
        try:
            yield s
        finally:
            await s.close()
        return
    if request.param == "cluster":  # a real Redis Cluster (make test-cluster)
        cluster = request.getfixturevalue("redis_cluster")
        s = RedisStore(cluster.url, prefix=f"wctest-{uuid.uuid4().hex}", cluster=True)
        try:
            yield s
        finally:
            await s.close()  # the cluster and its data go at the end of the session
        return
    async with redis_namespace() as prefix:
        s = RedisStore(REDIS_URL, prefix=prefix)
        try:
            yield s
        finally:
            await s.close()


async def advance(store: Store, clock: FakeClock, seconds: float) -> None:
    """Let time pass: a fake clock for SQLite, real time for Redis's server-side TTL."""
    if isinstance(store, SQLiteStore):
        clock.now += seconds
    else:
        await asyncio.sleep(seconds)


def tenant_records(name: str, *, scopes: tuple[str, ...] = ()) -> tuple[TenantRecord, KeyRecord]:
    tid = f"t_{uuid.uuid4().hex[:16]}"
    tenant = TenantRecord(
        tenant_id=tid,
        name=name,
        api_key_hash=uuid.uuid4().hex * 2,
        created_at=time.time(),
        scopes=scopes,
    )
    return tenant, key_record(tid, 1)


def key_record(tid: str, version: int, blob: bytes | None = None) -> KeyRecord:
    return KeyRecord(
        tenant_id=tid,
        version=version,
        wrapped_key=blob if blob is not None else os.urandom(60),
        created_at=1_700_000_000.123456 + version,
        groups=2,
        layers=30,
        alpha=1.2,
        context_width=2,
    )


# -- tenants ------------------------------------------------------------------


async def test_ping(store: Store) -> None:
    await store.ping()


async def test_create_get_and_lookup_tenant(store: Store) -> None:
    tenant, key = tenant_records("acme", scopes=("generate", "detect"))
    await store.create_tenant(tenant, key)

    assert await store.get_tenant(tenant.tenant_id) == tenant
    assert await store.tenant_by_api_key_hash(tenant.api_key_hash) == tenant
    assert await store.tenant_by_api_key_hash("0" * 64) is None
    assert await store.get_tenant("t_missing") is None
    assert await store.list_tenants() == [tenant]
    assert await store.key_versions(tenant.tenant_id) == [key]


async def test_list_tenants_in_creation_order(store: Store) -> None:
    made = []
    for i in range(3):
        tenant, key = tenant_records(f"tenant-{i}")
        await store.create_tenant(tenant, key)
        made.append(tenant)
    assert await store.list_tenants() == made


async def test_duplicate_name_is_conflict_and_writes_nothing(store: Store) -> None:
    first, key = tenant_records("acme")
    await store.create_tenant(first, key)
    second, key2 = tenant_records("acme")
    with pytest.raises(Conflict):
        await store.create_tenant(second, key2)
    assert await store.get_tenant(second.tenant_id) is None
    assert await store.tenant_by_api_key_hash(second.api_key_hash) is None
    assert await store.key_versions(second.tenant_id) == []
    assert await store.list_tenants() == [first]


async def test_duplicate_api_key_hash_or_id_is_conflict(store: Store) -> None:
    first, key = tenant_records("acme")
    await store.create_tenant(first, key)
    other, other_key = tenant_records("other")
    same_hash = TenantRecord(
        tenant_id=other.tenant_id,
        name="other",
        api_key_hash=first.api_key_hash,
        created_at=other.created_at,
    )
    with pytest.raises(Conflict):
        await store.create_tenant(same_hash, other_key)
    same_id = TenantRecord(
        tenant_id=first.tenant_id, name="third", api_key_hash="f" * 64, created_at=1.0
    )
    with pytest.raises(Conflict):
        await store.create_tenant(same_id, key_record(first.tenant_id, 1))
    assert await store.list_tenants() == [first]


async def test_tenant_ids_with_separator_are_rejected(store: Store) -> None:
    with pytest.raises(ValueError):
        await store.get_tenant("a:b")
    with pytest.raises(ValueError):
        await store.allocate_message("a:idem:x", 1, 32, {}, 0.0)


# -- keys ---------------------------------------------------------------------


async def test_key_versions_are_ordered_and_contiguous(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    v2 = key_record(tid, 2, blob=bytes(range(256)))  # every byte value survives the round trip
    await store.add_key_version(v2)
    with pytest.raises(Conflict):
        await store.add_key_version(key_record(tid, 2))  # already exists
    with pytest.raises(Conflict):
        await store.add_key_version(key_record(tid, 4))  # gap
    v3 = KeyRecord(**{**key_record(tid, 3).__dict__, "scheme": "worldcup-v2"})
    v3 = replace(v3, sketch_width_log2=16)
    await store.add_key_version(v3)

    versions = await store.key_versions(tid)
    assert [k.version for k in versions] == [1, 2, 3]
    assert versions == [key, v2, v3]
    assert versions[1].wrapped_key == bytes(range(256))
    # each version keeps the scheme its texts were issued under, and its sketch's width
    assert [k.scheme for k in versions] == ["worldcup-v1", "worldcup-v1", "worldcup-v2"]
    assert [k.sketch_width_log2 for k in versions] == [20, 20, 16]


async def test_add_key_for_unknown_tenant_is_conflict(store: Store) -> None:
    with pytest.raises(Conflict):
        await store.add_key_version(key_record("t_nobody", 1))
    assert await store.key_versions("t_nobody") == []


async def test_replace_wrapped_keys(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    await store.add_key_version(key_record(tid, 2))
    before = await store.key_versions(tid)

    new = [KeyRecord(**{**k.__dict__, "wrapped_key": b"new-" + bytes([k.version])}) for k in before]
    await store.replace_wrapped_keys(new)
    after = await store.key_versions(tid)
    assert [k.wrapped_key for k in after] == [b"new-\x01", b"new-\x02"]
    # only the blob changes
    for old, cur in zip(before, after, strict=True):
        assert (old.version, old.created_at, old.groups, old.layers, old.alpha) == (
            cur.version,
            cur.created_at,
            cur.groups,
            cur.layers,
            cur.alpha,
        )

    # all-or-nothing: an unknown version aborts the whole batch
    with pytest.raises(Conflict):
        await store.replace_wrapped_keys(
            [key_record(tid, 1, blob=b"partial"), key_record(tid, 9, blob=b"nope")]
        )
    assert [k.wrapped_key for k in await store.key_versions(tid)] == [b"new-\x01", b"new-\x02"]
    await store.replace_wrapped_keys([])


# -- registry -----------------------------------------------------------------


async def test_allocate_message_ids_and_persistence(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    meta = {"user": "u-1", "nested": {"a": [1, 2.5, None, True]}, "text": "héllo ✓"}

    entries = [
        await store.allocate_message(tid, 1, 32, meta, 1_712_345_678.123456 + i) for i in range(3)
    ]
    assert [e.message_id for e in entries] == [1, 2, 3]
    for e in entries:
        stored = await store.registry_entry(tid, e.message_id)
        assert stored == e
        assert stored is not None and stored.metadata == meta
    assert entries[2].issued_at == 1_712_345_678.123456 + 2
    assert entries[0] == RegistryEntry(tid, 1, 1, 32, meta, 1_712_345_678.123456)
    assert await store.registry_entry(tid, 4) is None
    assert await store.registry_entry(tid, 0) is None


async def test_context_counts_are_the_sketchs(store: Store) -> None:
    """The tenant's context sketch (issue #45) in the store counts as the in-memory
    :class:`~worldcup_core.context_sketch.ContextSketch` over the same texts, exactly:
    many texts into a crowded sketch (shared counters, saturation at 255), a repeated
    context once per text, a long text past one script command's 1000 counters; per
    tenant and key version apart; nothing counted reads 0."""
    import numpy as np

    from worldcup_core.context_sketch import WIDTH_LOG2, ContextSketch

    rng = np.random.default_rng(45)
    tenant, key = tenant_records("ctx")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    pool = rng.integers(0, 1 << WIDTH_LOG2, size=(40, 4))  # 40 contexts' cells
    pool[1, 2] = pool[0, 2]  # two contexts share a counter
    texts = [pool[np.r_[0, rng.integers(0, 40, rng.integers(1, 30))]] for _ in range(300)]
    texts.append(rng.integers(0, 1 << WIDTH_LOG2, size=(700, 4)))  # 2800 counters
    sketch = ContextSketch()
    for cells in texts:
        sketch.add_text(cells)
        await store.count_contexts(tid, 1, cells.tolist(), WIDTH_LOG2)
    wanted = np.r_[pool, texts[-1][:50]]
    got = await store.context_counts(tid, 1, wanted.tolist(), WIDTH_LOG2)
    assert got == sketch.counts(wanted).tolist()
    assert max(got) == 255 and min(got) >= 1
    assert await store.context_counts(tid, 2, pool.tolist(), WIDTH_LOG2) == [0] * 40
    other, other_key = tenant_records("ctx-other")
    await store.create_tenant(other, other_key)
    assert await store.context_counts(other.tenant_id, 1, pool.tolist(), WIDTH_LOG2) == [0] * 40
    assert await store.context_counts(tid, 1, [], WIDTH_LOG2) == []
    await store.count_contexts(tid, 1, [], WIDTH_LOG2)  # nothing to count
    with pytest.raises(ValueError, match="outside"):
        await store.count_contexts(tid, 1, [[0, 0, 0, 1 << WIDTH_LOG2]], WIDTH_LOG2)
    # a key version's own width (KeyRecord.sketch_width_log2): row r's counters start at
    # r * 2**width, so a narrower sketch keeps its rows apart, and a cell past its
    # width is refused rather than read in the next row
    narrow = rng.integers(0, 1 << 12, size=(30, 4))
    for _ in range(3):
        await store.count_contexts(tid, 3, narrow.tolist(), 12)
    assert await store.context_counts(tid, 3, narrow.tolist(), 12) == [3] * 30
    with pytest.raises(ValueError, match="outside"):
        await store.context_counts(tid, 3, [[0, 0, 0, 1 << 12]], 12)


async def test_set_fingerprint_is_stored_with_the_entry(store: Store) -> None:
    """The issued text's fingerprint (issue #45): set after allocation, read back by
    both reads, replaced by a later call; refused (False) without a live entry. The
    metadata may hold a field of the same name: it stays the metadata's."""
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    meta = {"fingerprint": "ab", "nested": {"fingerprint": "cd"}}
    e1 = await store.allocate_message(tid, 1, 32, meta, 1_712_345_678.123456)
    e2 = await store.allocate_message(tid, 1, 32, {}, 1.5)
    assert e1.fingerprint is None
    assert (await store.registry_entry(tid, 1)) == e1  # none recorded yet
    fp, other = bytes(range(16)), b"\xff" * 16
    assert await store.set_fingerprint(tid, 1, fp)
    assert await store.set_fingerprint(tid, 1, fp)  # a retry: the same value
    got = await store.registry_entry(tid, 1)
    assert got is not None and got.fingerprint == fp
    assert got.metadata == meta and got.issued_at == e1.issued_at and got.num_bits == 32
    assert await store.set_fingerprint(tid, 2, other)
    assert await store.set_fingerprint(tid, 1, other)  # replaced
    read = await store.registry_entries(tid, [2, 1, 3])
    assert [r.fingerprint if r else None for r in read] == [other, other, None]
    assert read[1] is not None and read[1].metadata == meta
    assert read[0] is not None and read[0].metadata == {} and read[0].issued_at == e2.issued_at
    assert not await store.set_fingerprint(tid, 3, fp)  # never issued
    assert not await store.set_fingerprint(tid, 0, fp)
    assert await store.registry_entry(tid, 3) is None
    assert await store.void_message(tid, 2, "test")
    assert not await store.set_fingerprint(tid, 2, fp)  # voided
    assert await store.registry_entry(tid, 2) is None
    assert await store.message_ids(tid, 1, 32) == [1]


async def test_message_ids_filter_by_key_version_and_bits(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    plan = [(1, 32), (1, 16), (2, 32), (1, 32), (2, 32), (1, 16), (1, 32)]
    for kv, bits in plan:
        await store.allocate_message(tid, kv, bits, {}, 0.0)
    assert await store.message_ids(tid, 1, 32) == [1, 4, 7]
    assert await store.message_ids(tid, 1, 16) == [2, 6]
    assert await store.message_ids(tid, 2, 32) == [3, 5]
    assert await store.message_ids(tid, 2, 16) == []
    assert await store.message_ids(tid, 3, 32) == []


async def test_void_message_withdraws_the_entry_and_never_reuses_its_id(store: Store) -> None:
    """A generation that could not be watermarked voids its entry: no longer read nor
    matched, and the next allocation does not hand its id out again (the last id too)."""
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    for _ in range(3):
        await store.allocate_message(tid, 1, 32, {"m": 1}, 0.0)
    assert await store.void_message(tid, 3, "growth")
    assert await store.void_message(tid, 2, "growth")
    assert not await store.void_message(tid, 2, "growth")  # already void
    assert not await store.void_message(tid, 9, "growth")  # never issued
    assert await store.registry_entry(tid, 2) is None
    assert await store.message_ids(tid, 1, 32) == [1]
    assert (await store.allocate_message(tid, 1, 32, {}, 0.0)).message_id == 4
    assert await store.message_ids(tid, 1, 32) == [1, 4]


async def test_registry_entries_reads_in_bulk_what_registry_entry_reads(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bulk read answers, for each id asked (any order, duplicates, out of range),
    what ``registry_entry`` answers: the entry, or None (never issued, voided, expired,
    another tenant's), over several chunks and, on Redis, several buckets."""
    monkeypatch.setattr(sqlite_registry, "_IN_CHUNK", 3)  # ids per IN query
    monkeypatch.setattr(redis_registry, "ENTRIES_PER_HMGET", 3)
    monkeypatch.setattr(redis_registry, "HMGETS_PER_TRIP", 2)
    monkeypatch.setattr(redis_layout, "BUCKET_IDS", 4)  # 24 ids: 6 buckets
    a, ka = tenant_records("alpha")
    b, kb = tenant_records("beta")
    await store.create_tenant(a, ka)
    await store.create_tenant(b, kb)
    tid = a.tenant_id
    await store.add_key_version(key_record(tid, 2))
    issued = {
        i: await store.allocate_message(tid, 1 + i % 2, 16 if i % 3 else 32, {"i": i}, float(i))
        for i in range(1, 25)
    }
    assert list(issued) == [e.message_id for e in issued.values()]
    theirs = [await store.allocate_message(b.tenant_id, 1, 32, {"b": i}, 0.0) for i in range(2)]
    assert await store.void_message(tid, 7, "test")
    assert await store.expire_registry(tid, 2.5) == 2  # ids 1 and 2
    asked = [24, 1, 7, 3, 3, 0, -4, 25, 99, 12, 5, 19, 2, 8, *range(24, 0, -1)]
    got = await store.registry_entries(tid, asked)
    assert got == [await store.registry_entry(tid, i) for i in asked]
    gone = {1, 2, 7}
    assert got == [issued[i] if i in issued and i not in gone else None for i in asked]
    assert sum(e is not None for e in got) == 7 + 21  # a test that could not pass empty
    assert await store.registry_entries(b.tenant_id, [3, 2, 1]) == [None, theirs[1], theirs[0]]
    assert await store.registry_entries(tid, []) == []


async def test_tenant_isolation(store: Store) -> None:
    a, ka = tenant_records("alpha")
    b, kb = tenant_records("beta")
    await store.create_tenant(a, ka)
    await store.create_tenant(b, kb)
    await store.add_key_version(key_record(a.tenant_id, 2))

    for _ in range(3):
        await store.allocate_message(a.tenant_id, 1, 32, {"owner": "a"}, 1.0)
    # B cannot see A's registry with A's ids ...
    for mid in (1, 2, 3):
        assert await store.registry_entry(b.tenant_id, mid) is None
    assert await store.message_ids(b.tenant_id, 1, 32) == []
    # ... and B's ids are its own sequence
    eb = await store.allocate_message(b.tenant_id, 1, 32, {"owner": "b"}, 2.0)
    assert eb.message_id == 1
    ea = await store.registry_entry(a.tenant_id, 1)
    assert ea is not None and ea.metadata == {"owner": "a"}
    assert await store.message_ids(a.tenant_id, 1, 32) == [1, 2, 3]

    # keys
    assert [k.version for k in await store.key_versions(b.tenant_id)] == [1]
    assert (await store.key_versions(b.tenant_id))[0].wrapped_key == kb.wrapped_key
    assert await store.tenant_by_api_key_hash(b.api_key_hash) == b

    # idempotency: same client key, separate namespaces
    rec_a = IdempotencyRecord("hash-a", 200, {"who": "a"})
    rec_b = IdempotencyRecord("hash-b", 201, {"who": "b"})
    assert await store.idempotency_put(a.tenant_id, "req-1", rec_a, 60) is True
    assert await store.idempotency_get(b.tenant_id, "req-1") is None
    assert await store.idempotency_put(b.tenant_id, "req-1", rec_b, 60) is True
    assert await store.idempotency_get(a.tenant_id, "req-1") == rec_a
    assert await store.idempotency_get(b.tenant_id, "req-1") == rec_b


# -- idempotency --------------------------------------------------------------


async def test_idempotency_put_if_absent_and_ttl(store: Store, clock: FakeClock) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    first = IdempotencyRecord("body-1", 200, {"message_id": 7, "text": "…"})
    second = IdempotencyRecord("body-2", 500, {})

    assert await store.idempotency_get(tid, "k") is None
    assert await store.idempotency_put(tid, "k", first, 1) is True
    assert await store.idempotency_put(tid, "k", second, 1) is False
    assert await store.idempotency_get(tid, "k") == first
    assert await store.idempotency_put(tid, "long", first, 3600) is True

    await advance(store, clock, 1.2)
    assert await store.idempotency_get(tid, "k") is None  # expired == absent
    assert await store.idempotency_put(tid, "k", second, 1) is True
    assert await store.idempotency_get(tid, "k") == second
    assert await store.idempotency_get(tid, "long") == first


async def test_stored_responses_per_tenant_with_ttl(store: Store, clock: FakeClock) -> None:
    """/v1/responses' previous_response_id: a tenant reads only its own, until the TTL."""
    a, ka = tenant_records("acme")
    b, kb = tenant_records("globex")
    await store.create_tenant(a, ka)
    await store.create_tenant(b, kb)
    record = {"messages": [{"role": "user", "content": "Hi"}], "response": {"id": "resp_1"}}
    assert await store.response_get(a.tenant_id, "resp_1") is None
    await store.response_put(a.tenant_id, "resp_1", record, 1)
    await store.response_put(a.tenant_id, "resp_long", record, 3600)
    assert await store.response_get(a.tenant_id, "resp_1") == record
    assert await store.response_get(b.tenant_id, "resp_1") is None  # another tenant's
    replaced = {**record, "response": {"id": "resp_1", "v": 2}}
    await store.response_put(a.tenant_id, "resp_1", replaced, 1)
    assert await store.response_get(a.tenant_id, "resp_1") == replaced

    await advance(store, clock, 1.2)
    assert await store.response_get(a.tenant_id, "resp_1") is None  # expired == absent
    assert await store.response_get(a.tenant_id, "resp_long") == record


# -- concurrency --------------------------------------------------------------


async def test_concurrent_allocation_gives_distinct_ids(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    entries = await asyncio.gather(
        *(store.allocate_message(tid, 1, 32, {"i": i}, float(i)) for i in range(200))
    )
    assert sorted(e.message_id for e in entries) == list(range(1, 201))
    assert await store.message_ids(tid, 1, 32) == list(range(1, 201))
    for e in entries[::37]:
        assert await store.registry_entry(tid, e.message_id) == e


async def test_concurrent_create_same_name_only_one_wins(store: Store) -> None:
    attempts = [tenant_records("race") for _ in range(20)]
    results = await asyncio.gather(
        *(store.create_tenant(t, k) for t, k in attempts), return_exceptions=True
    )
    assert sum(r is None for r in results) == 1
    assert all(isinstance(r, Conflict) for r in results if r is not None)
    assert len(await store.list_tenants()) == 1


async def test_concurrent_key_versions_only_one_wins(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    results = await asyncio.gather(
        *(store.add_key_version(key_record(tenant.tenant_id, 2)) for _ in range(10)),
        return_exceptions=True,
    )
    assert sum(r is None for r in results) == 1
    assert [k.version for k in await store.key_versions(tenant.tenant_id)] == [1, 2]


# -- Redis specifics ----------------------------------------------------------


@contextlib.asynccontextmanager
async def two_replicas() -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two clients on one namespace, as two API replicas would be."""
    async with redis_namespace() as prefix:
        s1 = RedisStore(REDIS_URL, prefix=prefix)
        s2 = RedisStore(REDIS_URL, prefix=prefix)
        try:
            yield s1, s2
        finally:
            await s1.close()
            await s2.close()


async def test_redis_two_clients_allocate_distinct_ids() -> None:
    async with two_replicas() as (s1, s2):
        tenant, key = tenant_records("acme")
        await s1.create_tenant(tenant, key)
        tid = tenant.tenant_id
        entries = await asyncio.gather(
            *((s1 if i % 2 else s2).allocate_message(tid, 1, 32, {"i": i}, 0.0) for i in range(200))
        )
        assert sorted(e.message_id for e in entries) == list(range(1, 201))
        assert await s2.message_ids(tid, 1, 32) == list(range(1, 201))
        assert await s1.get_tenant(tid) == await s2.get_tenant(tid) == tenant


async def test_redis_write_without_replica_acknowledgement_is_refused() -> None:
    """``wait_replicas``: a registry write that too few replicas acknowledged (here: a
    Redis without replicas) is refused, never reported as issued. The counter's write
    was retried once (a second INCR within the deadline): both ids are spent, unused."""
    async with two_replicas() as (plain, _):
        waiting = RedisStore(REDIS_URL, prefix=plain._prefix, wait_replicas=1, wait_timeout_ms=50)
        try:
            tenant, key = tenant_records("acme")
            await plain.create_tenant(tenant, key)
            tid = tenant.tenant_id
            with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
                await waiting.allocate_message(tid, 1, 32, {"m": 1}, 0.0)
            with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
                await waiting.add_key_version(key_record(tid, 2))
            assert (await plain.allocate_message(tid, 1, 32, {}, 0.0)).message_id == 3
        finally:
            await waiting.close()


def _reply_lost_once(fn: Any) -> tuple[Any, list[Any]]:
    """``fn``, whose first call (per script, for ``_eval_acked``) is applied but answers
    "Connection closed by server" (a primary killed between the write and its reply):
    the store must retry it, and only a write idempotent by construction (or, for the
    id counter, harmless to repeat) comes out right."""
    results: list[Any] = []
    lost: set[int] = set()

    async def lossy(*args: Any, **kwargs: Any) -> Any:
        results.append(await fn(*args, **kwargs))
        script = id(args[0]) if args else 0
        if script not in lost:
            lost.add(script)
            raise RedisConnectionError("Connection closed by server.")
        return results[-1]

    return lossy, results


async def test_redis_writes_retried_after_a_lost_reply_count_once() -> None:
    async with redis_namespace() as prefix:
        store = RedisStore(REDIS_URL, prefix=prefix)
        try:
            tenant, key = tenant_records("acme")
            await store.create_tenant(tenant, key)
            tid = tenant.tenant_id
            # the rate-limit debit: its decision is replayed, the bucket debited once
            store._take_tokens, took = _reply_lost_once(store._take_tokens)
            decision = await store.take_tokens(tid, 0.001, 10, 1)
            assert len(took) == 2 and decision.allowed
            assert decision.remaining == pytest.approx(9, abs=0.01)  # not 8
            # a probe hit: counted once, so a budget of 1 still admits it
            store._probe_hit, hits = _reply_lost_once(store._probe_hit)
            probe = await store.probe_hit(tid, "k1", "c1", None, [], 60.0, 1)
            assert len(hits) == 2 and (probe.allowed, probe.count) == (True, 1)
            # the allocation: the lost INCR leaves id 1 unused, the lost entry write finds
            # its own entry: one entry, under the id handed out
            store._eval_acked, acked = _reply_lost_once(store._eval_acked)  # type: ignore[method-assign]
            entry = await store.allocate_message(tid, 1, 32, {"m": 1}, 5.0)
            assert len(acked) == 4  # NEXT_ID twice, PUT_ENTRY twice
            assert entry.message_id == 2 and await store.message_ids(tid, 1, 32) == [2]
            assert await store.registry_entry(tid, 2) == entry
            assert await store.registry_entry(tid, 1) is None
        finally:
            await store.close()


async def test_redis_name_claim_of_a_creation_that_died_is_taken_over() -> None:
    """A creation that died between claiming the name and writing the tenant leaves a
    claim: refused while its ``creating`` marker lives, taken over once it expired."""
    async with two_replicas() as (store, _):
        raw, keys = store._redis, store._keys
        await raw.hset(keys.g("tenant-names"), "acme", "t_dead")
        await raw.set(keys.t("t_dead", "creating"), "1", px=60_000)
        tenant, key = tenant_records("acme")
        with pytest.raises(Conflict):
            await store.create_tenant(tenant, key)
        assert await store.get_tenant(tenant.tenant_id) is None
        await raw.delete(keys.t("t_dead", "creating"))  # the marker expired
        await store.create_tenant(tenant, key)
        assert await store.list_tenants() == [tenant]
        assert await raw.hget(keys.g("tenant-names"), "acme") == tenant.tenant_id


async def test_redis_rate_limit_is_shared_by_replicas() -> None:
    """Two API replicas (two clients) draw from one bucket per tenant."""
    async with two_replicas() as (s1, s2):
        tenant, key = tenant_records("acme")
        await s1.create_tenant(tenant, key)
        decisions = await asyncio.gather(
            *((s1 if i % 2 else s2).take_tokens(tenant.tenant_id, 0.01, 25, 1) for i in range(60))
        )
        assert sum(d.allowed for d in decisions) == 25
        assert all(d.retry_after_s > 0 for d in decisions if not d.allowed)


async def test_redis_unreachable_fails_fast_without_leaking_password(
    free_tcp_port: int,
) -> None:
    secret = "s3cr3t-Pa55word"
    store = RedisStore(f"redis://user:{secret}@127.0.0.1:{free_tcp_port}/0", timeout_s=2.0)
    try:
        for call in (store.ping, lambda: store.allocate_message("t_x", 1, 32, {}, 0.0)):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as info:
                await call()
            assert time.monotonic() - started < 3.0
            assert str(info.value).startswith("redis unavailable:")
            assert secret not in str(info.value)
            assert info.value.__cause__ is None and info.value.__suppress_context__
        assert secret not in repr(store)
    finally:
        await store.close()


async def test_redis_unresponsive_server_times_out() -> None:
    """A server that accepts but never answers must not hang the caller."""
    accepted: list[asyncio.StreamWriter] = []

    async def blackhole(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(w)

    server = await asyncio.start_server(blackhole, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.ping()
        assert time.monotonic() - started < 1.5
    finally:
        await store.close()
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


class TcpProxy:
    """Forwards a local port to Redis; stopping it simulates an outage without
    touching the shared server."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()
        await asyncio.sleep(0.05)  # let the pump tasks observe the close

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            self._writers.discard(writer)
            return
        self._writers.add(up_w)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w), pump(up_r, writer))
        self._writers.discard(writer)
        self._writers.discard(up_w)


async def test_redis_recovers_after_outage_without_restart() -> None:
    parts = urlsplit(REDIS_URL)
    async with redis_namespace() as prefix:
        proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379)
        await proxy.start()
        store = RedisStore(
            f"redis://127.0.0.1:{proxy.port}{parts.path}", prefix=prefix, timeout_s=1.0
        )
        try:
            tenant, key = tenant_records("acme")
            await store.create_tenant(tenant, key)
            tid = tenant.tenant_id
            # several pooled connections, all of which will go stale
            await asyncio.gather(*(store.allocate_message(tid, 1, 32, {}, 0.0) for _ in range(8)))

            await proxy.stop()
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await store.allocate_message(tid, 1, 32, {}, 0.0)
                assert time.monotonic() - started < 1.5
            with pytest.raises(StoreUnavailable):
                await store.ping()

            await proxy.start()  # same port: Redis is "back"
            await store.ping()
            entries = await asyncio.gather(
                *(store.allocate_message(tid, 1, 32, {}, 0.0) for _ in range(8))
            )
            assert sorted(e.message_id for e in entries) == list(range(9, 17))
        finally:
            await store.close()
            await proxy.stop()


# -- SQLite specifics ---------------------------------------------------------


async def test_sqlite_in_memory() -> None:
    store = SQLiteStore(":memory:")
    try:
        tenant, key = tenant_records("acme")
        await store.create_tenant(tenant, key)
        entries = await asyncio.gather(
            *(store.allocate_message(tenant.tenant_id, 1, 8, {}, 0.0) for _ in range(50))
        )
        assert sorted(e.message_id for e in entries) == list(range(1, 51))
    finally:
        await store.close()


async def test_sqlite_survives_reopen_and_shares_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite3"
    s1, s2 = SQLiteStore(path), SQLiteStore(path)  # like two worker processes
    try:
        tenant, key = tenant_records("acme")
        await s1.create_tenant(tenant, key)
        tid = tenant.tenant_id
        entries = await asyncio.gather(
            *((s1 if i % 2 else s2).allocate_message(tid, 1, 32, {}, 0.0) for i in range(60))
        )
        assert sorted(e.message_id for e in entries) == list(range(1, 61))
    finally:
        await s1.close()
        await s2.close()
    reopened = SQLiteStore(path)
    try:
        assert await reopened.get_tenant(tid) == tenant
        assert await reopened.message_ids(tid, 1, 32) == list(range(1, 61))
    finally:
        await reopened.close()


def test_redis_key_record_from_before_scheme_versions_reads_as_then() -> None:
    """A key version's JSON written by an older release, without ``scheme`` and
    ``sketch_width_log2``, reads as the only scheme and width there were; a record's
    own fields round-trip."""
    old = (
        '{"version": 1, "wrapped_key": "AA==", "created_at": 1.0, "groups": 2,'
        ' "layers": 30, "alpha": 1.2, "context_width": 2}'
    )
    record = key_from_json("t1", old)
    assert (record.scheme, record.sketch_width_log2, record.wrapped_key) == (
        "worldcup-v1",
        20,
        b"\x00",
    )
    newer = replace(key_record("t1", 2), scheme="worldcup-v2", sketch_width_log2=17)
    assert key_from_json("t1", key_to_json(newer)) == newer


async def test_sqlite_file_from_before_scheme_versions_is_migrated(tmp_path: Path) -> None:
    """A store file written before key versions recorded their scheme still opens; its
    keys read as ``worldcup-v1`` (the only scheme there was), and new ones keep theirs."""
    import sqlite3

    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        """
        CREATE TABLE tenants (tenant_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE,
            api_key_hash TEXT NOT NULL UNIQUE, created_at REAL NOT NULL,
            scopes TEXT NOT NULL DEFAULT '[]');
        CREATE TABLE keys (tenant_id TEXT NOT NULL REFERENCES tenants(tenant_id),
            version INTEGER NOT NULL, wrapped_key BLOB NOT NULL, created_at REAL NOT NULL,
            groups INTEGER NOT NULL, layers INTEGER NOT NULL, alpha REAL NOT NULL,
            context_width INTEGER NOT NULL, PRIMARY KEY (tenant_id, version));
        INSERT INTO tenants VALUES ('t1', 'old', 'h', 1.0, '[]');
        INSERT INTO keys VALUES ('t1', 1, x'00', 1.0, 2, 30, 1.2, 2);
        """
    )
    old.commit()
    old.close()
    store = SQLiteStore(path)
    try:
        (v1,) = await store.key_versions("t1")
        # ... and the context sketch's width of every version before it was recorded
        assert v1.scheme == "worldcup-v1" and v1.groups == 2 and v1.sketch_width_log2 == 20
        v2 = KeyRecord(**{**key_record("t1", 2).__dict__, "scheme": "worldcup-v2"})
        await store.add_key_version(replace(v2, sketch_width_log2=18))
        got = await store.key_versions("t1")
        assert [k.scheme for k in got] == ["worldcup-v1", "worldcup-v2"]
        assert [k.sketch_width_log2 for k in got] == [20, 18]
    finally:
        await store.close()


async def test_sqlite_registry_from_before_fingerprints_is_migrated(tmp_path: Path) -> None:
    """A messages table without the fingerprint column gets it on open: its entries read
    with none, and one can be recorded."""
    import sqlite3

    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        """
        CREATE TABLE messages (tenant_id TEXT NOT NULL, message_id INTEGER NOT NULL,
            key_version INTEGER NOT NULL, num_bits INTEGER NOT NULL, metadata TEXT NOT NULL,
            issued_at REAL NOT NULL, voided TEXT, PRIMARY KEY (tenant_id, message_id));
        INSERT INTO messages VALUES ('t1', 1, 1, 32, '{"u":1}', 2.0, NULL);
        """
    )
    old.commit()
    old.close()
    store = SQLiteStore(path)
    try:
        assert await store.registry_entry("t1", 1) == RegistryEntry("t1", 1, 1, 32, {"u": 1}, 2.0)
        assert await store.set_fingerprint("t1", 1, b"\x01" * 16)
        (got,) = await store.registry_entries("t1", [1])
        assert got is not None and got.fingerprint == b"\x01" * 16
    finally:
        await store.close()


async def test_sqlite_closed_store_is_unavailable(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "x.sqlite3")
    await store.ping()
    await store.close()
    with pytest.raises(StoreUnavailable):
        await store.ping()


async def test_sqlite_unopenable_path_is_unavailable(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "missing-dir" / "x.sqlite3")
    with pytest.raises(StoreUnavailable):
        await store.ping()
    await store.close()


# -- factory ------------------------------------------------------------------


def test_make_store_picks_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no stray .env file
    monkeypatch.delenv("WORLDCUP_REDIS_URL", raising=False)
    master, admin = SecretStr("ab" * 32), SecretStr("a-real-admin-token")
    settings = Settings(master_key=master, admin_token=admin, sqlite_path=tmp_path / "f.sqlite3")
    assert isinstance(make_store(settings), SQLiteStore)
    settings = Settings(
        master_key=master,
        admin_token=admin,
        redis_url="redis://127.0.0.1:6379/15",
        redis_prefix="wcf",
    )
    store = make_store(settings)
    assert isinstance(store, RedisStore)
    asyncio.run(store.close())
    # cluster mode: the same store on redis-py's cluster client, WAIT on by default
    clustered = Settings(
        master_key=master, admin_token=admin, redis_url="redis://127.0.0.1:7000", redis_cluster=True
    )
    store = make_store(clustered)
    assert isinstance(store, RedisStore) and "cluster" in repr(store)
    assert store._wait_replicas == 1
    asyncio.run(store.close())
    with pytest.raises(ValueError, match="WORLDCUP_REDIS_URL"):
        Settings(master_key=master, admin_token=admin, redis_cluster=True)


# -- issue 4: scopes, key listing, bit lengths, audit log, rate limits ----------


async def test_set_scopes(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    updated = await store.set_scopes(tenant.tenant_id, ("provenance",))
    assert updated is not None and updated.scopes == ("provenance",)
    assert (await store.get_tenant(tenant.tenant_id)).scopes == ("provenance",)  # type: ignore[union-attr]
    looked_up = await store.tenant_by_api_key_hash(tenant.api_key_hash)
    assert looked_up is not None and looked_up.scopes == ("provenance",)
    assert (await store.set_scopes(tenant.tenant_id, ())).scopes == ()  # type: ignore[union-attr]
    assert await store.set_scopes("t_nobody", ("provenance",)) is None
    assert await store.get_tenant("t_nobody") is None  # nothing was created


async def test_all_key_versions(store: Store) -> None:
    made = []
    for name in ("a", "b"):
        tenant, key = tenant_records(name)
        await store.create_tenant(tenant, key)
        await store.add_key_version(key_record(tenant.tenant_id, 2))
        made.append(tenant.tenant_id)
    keys = await store.all_key_versions()
    assert sorted((k.tenant_id, k.version) for k in keys) == sorted(
        (t, v) for t in made for v in (1, 2)
    )
    for tid in made:  # each tenant's versions in order, records equal to key_versions()
        assert [k for k in keys if k.tenant_id == tid] == await store.key_versions(tid)


async def test_registry_bit_lengths(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    assert await store.registry_bit_lengths(tid, 1) == []
    for kv, bits in [(1, 32), (1, 16), (2, 48), (1, 32)]:
        await store.allocate_message(tid, kv, bits, {}, 0.0)
    assert await store.registry_bit_lengths(tid, 1) == [16, 32]
    assert await store.registry_bit_lengths(tid, 2) == [48]
    assert await store.registry_bit_lengths(tid, 3) == []


async def test_audit_log_is_newest_first(store: Store) -> None:
    records = [
        AuditRecord(
            at=1_700_000_000.0 + i,
            actor="admin" if i % 2 else "tenant:t_x",
            action="provenance",
            request_id=f"r{i}",
            outcome={"found": bool(i % 2), "p_value": 10.0**-i, "tenant_id": None},
        )
        for i in range(5)
    ]
    for r in records:
        await store.append_audit(r)
    log = await store.audit_log(3)
    assert [r.request_id for r in log] == ["r4", "r3", "r2"]
    assert log[0].outcome == records[4].outcome and log[0].actor == "tenant:t_x"
    assert log[0].at == records[4].at and all(r.id for r in log)
    assert len({r.id for r in log}) == 3
    assert [r.request_id for r in await store.audit_log(100)][-1] == "r0"


async def test_token_bucket(store: Store) -> None:
    tenant, key = tenant_records("acme")
    other, other_key = tenant_records("other")
    await store.create_tenant(tenant, key)
    await store.create_tenant(other, other_key)
    tid = tenant.tenant_id
    # burst 5 at a slow refill: five requests pass, the sixth waits ~1/rate seconds
    decisions = [await store.take_tokens(tid, 0.5, 5, 1) for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    assert 1.0 < decisions[-1].retry_after_s <= 2.0 + 1e-6
    assert decisions[4].remaining == pytest.approx(0.0, abs=0.01)
    # another tenant has its own bucket
    assert (await store.take_tokens(other.tenant_id, 0.5, 5, 1)).allowed
    # a cost above what is left is refused without taking anything
    assert not (await store.take_tokens(tid, 0.5, 5, 3)).allowed
    # refill: at 20 tokens/s a 0.3 s pause buys back a few tokens
    fast, _ = tenant_records("fast")
    await store.create_tenant(fast, _)
    for _i in range(3):
        assert (await store.take_tokens(fast.tenant_id, 20, 3, 1)).allowed
    assert not (await store.take_tokens(fast.tenant_id, 20, 3, 1)).allowed
    await asyncio.sleep(0.3)
    assert (await store.take_tokens(fast.tenant_id, 20, 3, 2)).allowed


async def test_concurrent_token_takers_never_overdraw(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    results = await asyncio.gather(
        *(store.take_tokens(tenant.tenant_id, 0.01, 10, 1) for _ in range(40))
    )
    assert sum(r.allowed for r in results) == 10


async def test_allocation_stops_at_max_id_without_writing(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    ids = [
        (await store.allocate_message(tid, 1, 2, {}, 0.0, max_id=3)).message_id for _ in range(3)
    ]
    assert ids == [1, 2, 3]
    with pytest.raises(RegistryFull):
        await store.allocate_message(tid, 1, 2, {"lost": True}, 0.0, max_id=3)
    assert await store.message_ids(tid, 1, 2) == [1, 2, 3]
    assert await store.registry_entry(tid, 4) is None
    # another payload length with room left still allocates after the refusal
    assert (await store.allocate_message(tid, 1, 8, {}, 0.0, max_id=255)).message_id == 4


# -- API keys and probe accounting (issue 15) ---------------------------------


def api_key_record(tid: str, key_id: str, **kw: object) -> ApiKeyRecord:
    values: dict[str, object] = {
        "key_id": key_id,
        "tenant_id": tid,
        "key_hash": uuid.uuid4().hex * 2,
        "name": f"key {key_id}",
        "scopes": ("detect",),
        "detail": "verdict",
        "created_at": 1_700_000_000.5 + len(key_id),
    }
    values.update(kw)
    return ApiKeyRecord(**values)  # type: ignore[arg-type]


async def test_api_keys_add_lookup_list_revoke(store: Store) -> None:
    tenant, key = tenant_records("acme")
    other, other_key = tenant_records("other")
    await store.create_tenant(tenant, key)
    await store.create_tenant(other, other_key)
    tid = tenant.tenant_id
    a = api_key_record(tid, "a", scopes=("detect", "decode"), detail="full")
    b = api_key_record(tid, "bb", scopes=())
    assert await store.add_api_key(a) and await store.add_api_key(b)
    assert await store.api_key_by_hash(a.key_hash) == a  # scopes, detail, times round-trip
    assert (await store.api_key_by_hash(b.key_hash)) == b
    assert await store.api_key_by_hash("0" * 64) is None
    # the same key id again writes nothing; another key's hash is a conflict
    assert not await store.add_api_key(api_key_record(tid, "a"))
    with pytest.raises(Conflict):
        await store.add_api_key(api_key_record(tid, "c", key_hash=a.key_hash))
    assert await store.api_keys(tid) == [a, b]
    assert await store.api_keys(other.tenant_id) == []
    # revocation: only that key, the first time stays, other tenants cannot reach it
    assert await store.revoke_api_key(other.tenant_id, "a", 5.0) is None
    revoked = await store.revoke_api_key(tid, "a", 1_700_000_100.25)
    assert revoked is not None and revoked.revoked_at == 1_700_000_100.25
    again = await store.revoke_api_key(tid, "a", 1_700_000_200.0)
    assert again is not None and again.revoked_at == 1_700_000_100.25
    assert (await store.api_key_by_hash(a.key_hash)) == revoked
    assert (await store.api_key_by_hash(b.key_hash)) == b
    assert await store.revoke_api_key(tid, "missing", 1.0) is None


async def test_probe_budget_counts_per_cluster_and_key(store: Store, clock: FakeClock) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    sketch = os.urandom(512)
    assert await store.probe_candidates(tid, "k1", ["0:aa", "1:bb"]) == []
    first = await store.probe_hit(tid, "k1", "c1", sketch, ["0:aa", "1:bb"], 60.0, 3)
    assert first.allowed and first.count == 1
    # a band of the cluster finds it (with its sketch); unknown bands and other keys do not
    assert await store.probe_candidates(tid, "k1", ["1:bb", "9:zz"]) == [("c1", sketch)]
    assert await store.probe_candidates(tid, "k2", ["0:aa"]) == []
    assert await store.probe_candidates(tid, "k1", []) == []
    decisions = [await store.probe_hit(tid, "k1", "c1", None, [], 60.0, 3) for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    assert [d.count for d in decisions] == [2, 3, 3]
    assert 0 < decisions[-1].retry_after_s <= 60.0
    # another cluster, and the same cluster id under another key, have their own budgets
    assert (await store.probe_hit(tid, "k1", "c2", sketch, ["0:cc"], 60.0, 3)).allowed
    assert (await store.probe_hit(tid, "k2", "c1", sketch, ["0:aa"], 60.0, 3)).allowed
    # a new sketch moves the cluster: its bands point to it
    moved = os.urandom(512)
    assert (await store.probe_hit(tid, "k2", "c1", moved, ["5:ee"], 60.0, 3)).allowed
    assert await store.probe_candidates(tid, "k2", ["5:ee"]) == [("c1", moved)]
    # a count with a placeholder sketch and no bands (a full key's full answers,
    # app.services.probes): counted under that cluster id, found by no band, and kept
    # through more probe calls than the SQLite store's sweep interval (256)
    spent = [await store.probe_hit(tid, "k1-full", "c1", b"-", [], 60.0, 2) for _ in range(3)]
    assert [(d.allowed, d.count) for d in spent] == [(True, 1), (True, 2), (False, 2)]
    for i in range(300):
        assert (await store.probe_hit(tid, "k3", f"x{i}", b"-", [], 60.0, 1)).allowed
    assert not (await store.probe_hit(tid, "k1-full", "c1", b"-", [], 60.0, 2)).allowed
    assert await store.probe_candidates(tid, "k1-full", ["0:aa"]) == []
    assert [c for c, _ in await store.probe_clusters(tid, "k1")] == ["c1", "c2"]


async def test_probe_open_is_one_step_with_the_last_look(store: Store, clock: FakeClock) -> None:
    """Opening a cluster re-checks its bands in the same atomic call: a cluster opened
    since the caller looked (at least min_hits of the bands point to it, and the caller
    did not see it) makes the open write nothing; clusters the caller saw, fewer hits,
    or its own id do not. A budget of 0 peeks at a count and records nothing."""
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    first, second = os.urandom(64), os.urandom(64)
    opened = await store.probe_open(tid, "t", "ca", first, ["a1", "a2", "a3"], 60.0, 5, [], 2)
    assert opened is not None and (opened.allowed, opened.count) == (True, 1)
    assert await store.probe_candidates(tid, "t", ["a1"]) == [("ca", first)]
    # a second open whose bands point twice to ca, unseen: nothing written
    bands = ["a1", "a2", "b1"]
    assert await store.probe_open(tid, "t", "cb", second, bands, 60.0, 5, [], 2) is None
    assert await store.probe_candidates(tid, "t", ["b1"]) == []
    peek = await store.probe_hit(tid, "t", "cb", None, [], 60.0, 0)
    assert (peek.allowed, peek.count) == (False, 0)
    # once seen (weighed and not linked), or pointed to fewer than min_hits times, it opens
    assert await store.probe_open(tid, "t", "cb", second, bands, 60.0, 5, ["ca"], 2) is not None
    assert await store.probe_candidates(tid, "t", ["b1"]) == [("cb", second)]
    third = await store.probe_open(tid, "t", "cc", first, ["a3", "c1"], 60.0, 5, [], 2)
    assert third is not None and third.allowed
    # its own bands (a retried open, or a re-open of its id) never block it
    again = await store.probe_open(tid, "t", "cc", first, ["a3", "c1"], 60.0, 5, [], 2)
    assert again is not None and (again.allowed, again.count) == (True, 2)
    # a peek: the count now, nothing recorded
    for _ in range(2):
        peek = await store.probe_hit(tid, "t", "cc", None, [], 60.0, 0)
        assert (peek.allowed, peek.count) == (False, 2)
    # an expired cluster's bands block nothing
    await advance(store, clock, 1.2)
    short = await store.probe_open(tid, "u", "da", first, ["d1", "d2"], 1.0, 5, [], 2)
    assert short is not None
    await advance(store, clock, 1.2)
    assert await store.probe_open(tid, "u", "db", first, ["d1", "d2"], 60.0, 5, [], 2) is not None


async def test_probe_hit_all_counts_every_cluster_or_none(store: Store, clock: FakeClock) -> None:
    """Several clusters' counts in one atomic step: counted only if each cluster's
    count plus its number stays within the budget; else nothing anywhere. Counts
    expire like probe_hit's, and survive many other probe calls (the SQLite sweep)."""
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id

    async def count(cluster: str) -> int:
        return (await store.probe_hit(tid, "f", cluster, None, [], 60.0, 0)).count

    assert await store.probe_hit_all(tid, "f", {}, 60.0, 3)  # nothing to count
    assert await store.probe_hit_all(tid, "f", {"ca": 1, "cb": 2}, 60.0, 3)
    assert [await count(c) for c in ("ca", "cb")] == [1, 2]
    # cb has one left: two more for it refuses the whole set, ca included
    assert not await store.probe_hit_all(tid, "f", {"ca": 1, "cb": 2}, 60.0, 3)
    assert [await count(c) for c in ("ca", "cb")] == [1, 2]
    assert await store.probe_hit_all(tid, "f", {"ca": 2, "cb": 1, "cc": 0}, 60.0, 3)
    assert [await count(c) for c in ("ca", "cb", "cc")] == [3, 3, 0]
    # the same counts as probe_hit's: a plain hit is refused on a spent cluster
    assert not (await store.probe_hit(tid, "f", "ca", COUNT_ONLY, [], 60.0, 3)).allowed
    # they outlive other probe traffic (the SQLite store sweeps every 256 calls)
    for i in range(300):
        await store.probe_hit(tid, "g", f"x{i}", os.urandom(16), [f"b{i}"], 60.0, 5)
    assert [await count(c) for c in ("ca", "cb")] == [3, 3]
    # and leave the window as probe_hit's do
    assert await store.probe_hit_all(tid, "s", {"da": 2}, 1.0, 2)
    assert not await store.probe_hit_all(tid, "s", {"da": 1}, 1.0, 2)
    await advance(store, clock, 1.2)
    assert await store.probe_hit_all(tid, "s", {"da": 2}, 1.0, 2)


async def test_probe_candidates_most_pointed_to_first(store: Store, clock: FakeClock) -> None:
    """Containment accounting looks up a query's anchor hashes: the clusters most of
    them point to come first, and at most ``limit`` come back."""
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    sketches = {c: os.urandom(64) for c in ("ca", "cb", "cc")}
    await store.probe_hit(tid, "t", "ca", sketches["ca"], ["a1"], 60.0, 5)
    await store.probe_hit(tid, "t", "cb", sketches["cb"], ["b1", "b2", "b3"], 60.0, 5)
    await store.probe_hit(tid, "t", "cc", sketches["cc"], ["c1", "c2"], 60.0, 5)
    anchors = ["a1", "b1", "b2", "b3", "c1", "c2", "zz"]
    found = await store.probe_candidates(tid, "t", anchors, 2)
    assert found == [("cb", sketches["cb"]), ("cc", sketches["cc"])]
    assert len(await store.probe_candidates(tid, "t", anchors, 8)) == 3
    # clusters fewer than min_hits anchors point to are not fetched
    assert await store.probe_candidates(tid, "t", anchors, 8, 2) == found
    assert await store.probe_candidates(tid, "t", anchors, 8, 3) == [("cb", sketches["cb"])]
    assert await store.probe_candidates(tid, "t", anchors, 0) == []


async def test_probe_clusters_lists_one_key_of_one_tenant(store: Store, clock: FakeClock) -> None:
    """The offline listing of a probe key (``worldcup scan`` reads the recorded client
    payloads with it): every live cluster with a sketch, by id; no other key's or
    tenant's, even where their names extend this one's (Redis: a SCAN pattern)."""
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    assert await store.probe_clusters(tid, "k") == []
    sketches = {c: os.urandom(16) for c in ("c2", "c1", "c3")}
    for c, sk in sketches.items():
        assert (await store.probe_hit(tid, "k", c, sk, [f"b-{c}"], 60.0, 5)).allowed
    await store.probe_hit(tid, "k", "c1", None, [], 60.0, 5)  # a hit keeps its sketch
    moved = os.urandom(16)
    await store.probe_hit(tid, "k", "c3", moved, [], 60.0, 5)  # a new sketch replaces it
    await store.probe_hit(tid, "k", "gone", b"x", [], 0.5, 5)  # expires below
    await store.probe_hit(tid, "k", "nosketch", None, [], 60.0, 5)  # hits, no cluster
    await store.probe_hit(tid, "kk", "c9", b"other key", [], 60.0, 5)
    await store.probe_hit(tid, "k*", "c8", b"glob key", [], 60.0, 5)  # '*' is literal
    await store.probe_hit(tid + "x", "k", "c7", b"other tenant", [], 60.0, 5)
    await store.probe_hit(tid[:-1] + "?", "k", "c6", b"glob tenant", [], 60.0, 5)
    await advance(store, clock, 0.6)
    want = [("c1", sketches["c1"]), ("c2", sketches["c2"]), ("c3", moved)]
    assert await store.probe_clusters(tid, "k") == want
    assert await store.probe_clusters(tid, "k*") == [("c8", b"glob key")]
    assert await store.probe_clusters(tid[:-1] + "?", "k") == [("c6", b"glob tenant")]
    assert await store.probe_clusters(tid, "none") == []


async def test_probe_window_slides(store: Store, clock: FakeClock) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    sketch = os.urandom(16)
    assert (await store.probe_hit(tid, "k", "c", sketch, ["0:a"], 0.5, 1)).allowed
    refused = await store.probe_hit(tid, "k", "c", None, [], 0.5, 1)
    assert not refused.allowed and refused.retry_after_s <= 0.5
    await advance(store, clock, 0.6)
    assert (await store.probe_hit(tid, "k", "c", sketch, ["0:a"], 0.5, 1)).allowed


async def test_concurrent_probes_never_exceed_the_budget(store: Store) -> None:
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    sketch = os.urandom(16)
    results = await asyncio.gather(
        *(store.probe_hit(tenant.tenant_id, "k", "c", sketch, ["0:a"], 60.0, 7) for _ in range(30))
    )
    assert sum(r.allowed for r in results) == 7


async def test_redis_probe_budget_is_shared_by_replicas() -> None:
    async with two_replicas() as (a, b):
        tenant, key = tenant_records("acme")
        await a.create_tenant(tenant, key)
        tid = tenant.tenant_id
        sketch = os.urandom(16)
        assert (await a.probe_hit(tid, "k", "c", sketch, ["0:a"], 60.0, 2)).allowed
        assert await b.probe_candidates(tid, "k", ["0:a"]) == [("c", sketch)]
        assert (await b.probe_hit(tid, "k", "c", None, [], 60.0, 2)).allowed
        assert not (await a.probe_hit(tid, "k", "c", None, [], 60.0, 2)).allowed
