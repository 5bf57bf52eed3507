"""The Redis registry across id-range buckets (app/stores/redis_layout.py), on one Redis
and on a Redis Cluster: with 4 ids a bucket, lookups, counters and the retention sweep
behave exactly as on one bucket (tests/test_registry_store.py), and a swept bucket is
deleted whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from test_store_contract import REDIS_URL, redis_namespace, tenant_records

from app.stores import redis_layout
from app.stores.base import RegistrySize
from app.stores.redis import RedisStore

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.cluster)])
async def store(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[RedisStore]:
    monkeypatch.setattr(redis_layout, "BUCKET_IDS", 4)
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        s = RedisStore(cluster.url, prefix="wcbuckets", cluster=True)
        try:
            yield s
        finally:
            await s.close()
        return
    async with redis_namespace() as prefix:
        s = RedisStore(REDIS_URL, prefix=prefix)
        try:
            yield s
        finally:
            await s.close()


async def test_lookup_counters_and_sweep_across_buckets(store: RedisStore) -> None:
    tenant, key = tenant_records("big")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    for i in range(1, 31):  # ids 1..30, issued at time i; every third one 16 bits
        await store.allocate_message(tid, 1, 16 if i % 3 == 0 else 32, {"i": i}, float(i))
    assert await store.void_message(tid, 10, "test")
    ids32 = [i for i in range(1, 31) if i % 3 and i != 10]
    assert await store.message_ids(tid, 1, 32) == ids32
    assert await store.message_ids(tid, 1, 32, after=9) == [i for i in ids32 if i > 9]
    assert await store.registry_size(tid, 1, 32) == RegistrySize(len(ids32), 0, 0, 30)
    asked = [30, 1, 10, 3, 0, 29, 31, 5, 5]
    assert await store.issued_among(tid, 1, 32, asked) == [False, True, False, False] + [
        False,
        True,
        False,
        True,
        True,
    ]
    entries = await store.registry_entries(tid, [2, 10, 17, 99])
    assert [e and (e.message_id, e.metadata) for e in entries] == [
        (2, {"i": 2}),
        None,
        (17, {"i": 17}),
        None,
    ]

    # everything issued before t=13.5 goes: ids 1..13, three whole buckets and one id more
    deleted = await store.expire_registry(tid, 13.5)
    gone32 = [i for i in ids32 if i <= 13]
    gone16 = [3, 6, 9, 12]
    assert deleted == len(gone32) + len(gone16)
    assert await store.registry_size(tid, 1, 32) == RegistrySize(
        len(ids32) - len(gone32), len(gone32), 14, 30
    )
    assert await store.registry_size(tid, 1, 16) == RegistrySize(10 - 4, 4, 14, 30)
    assert await store.message_ids(tid, 1, 32) == [i for i in ids32 if i > 13]
    assert await store.registry_entry(tid, 13) is None
    assert (await store.registry_entry(tid, 14)) is not None
    raw = store._redis
    assert not await raw.exists(store._keys.msgs(tid, 0))  # a swept bucket goes whole
    assert await raw.hlen(store._keys.msgs(tid, 3)) == 3  # ids 14..16 stay (13 went)
    assert await store.expire_registry(tid, 13.5) == 0  # idempotent
    assert (await store.allocate_message(tid, 1, 32, {}, 99.0)).message_id == 31
