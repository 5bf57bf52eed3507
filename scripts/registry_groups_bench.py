"""Time ``registry_groups`` (POST /provenance/collection's ``group_by``) on Redis and
SQLite: the entries read one by one (``registry_entry`` an id, as before the bulk read)
beside the bulk read (``registry_entries``), in the same run, on the same registry.

One tenant, N entries (default 20 000) over 200 users (metadata ``user_id``), 32-bit
payloads; Redis at WORLDCUP_TEST_REDIS_URL (default redis://127.0.0.1:6379/15) under a
fresh prefix, removed afterwards; SQLite in a temporary file.

    PYTHONPATH=. .venv/bin/python scripts/registry_groups_bench.py [N]
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
from redis.asyncio import Redis

from app.services.collection import registry_groups
from app.stores.base import Store
from app.stores.redis import RedisStore
from app.stores.sqlite import SQLiteStore
from app.stores.sqlite_registry import _count
from tests.test_store_contract import tenant_records
from worldcup_core import WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.message import MessageIdCodec

BITS = 32
USERS = 200
REDIS_URL = os.environ.get("WORLDCUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def one_by_one(
    store: Store, scheme: WorldCup, tenant_id: str, version: int, field: str
) -> dict[str, list[str]]:
    """The group search's read as it was: one ``registry_entry`` an id."""
    groups: dict[str, list[str]] = defaultdict(list)
    for bits in await store.registry_bit_lengths(tenant_id, version):
        codec = MessageIdCodec(scheme.key, bits)
        for message_id in await store.message_ids(tenant_id, version, bits):
            entry = await store.registry_entry(tenant_id, message_id)
            if entry is None or entry.key_version != version:
                continue
            value = entry.metadata.get(field)
            if value is not None and not isinstance(value, dict | list):
                groups[str(value)].append(codec.payload(message_id).bits)
    return dict(groups)


async def timed(store: Store, scheme: WorldCup, tenant_id: str) -> tuple[float, float]:
    start = time.perf_counter()
    before = await one_by_one(store, scheme, tenant_id, 1, "user_id")
    old = time.perf_counter() - start
    start = time.perf_counter()
    after, entries, why = await registry_groups(store, scheme, tenant_id, 1, "user_id")
    new = time.perf_counter() - start
    assert after == before and why is None, why  # the same groups, in the same order
    return old, new


def fill_sqlite(store: SQLiteStore, tenant_id: str, n: int) -> None:
    conn = store._locked(lambda c: c)  # opened, schema made
    rows = [
        (tenant_id, i, 1, BITS, f'{{"user_id":"user-{i % USERS:04d}"}}', float(i))
        for i in range(1, n + 1)
    ]
    with conn:
        conn.executemany(
            "INSERT INTO messages (tenant_id, message_id, key_version, num_bits, metadata,"
            " issued_at) VALUES (?, ?, ?, ?, ?, ?)",
            rows,
        )
        _count(conn, tenant_id, 1, BITS, live=n)


async def main(n: int) -> None:
    rng = np.random.default_rng(0)
    scheme = WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig())
    start = time.perf_counter()  # the payloads' round table, built once per key and length
    MessageIdCodec(scheme.key, BITS).payload_ints(np.arange(1, 2))
    say(f"payload table ({BITS} bits, once per key): {time.perf_counter() - start:.2f} s")
    tenant, key = tenant_records("bench")
    tid = tenant.tenant_id
    prefix = f"wcbench-{uuid.uuid4().hex[:8]}"
    redis_store = RedisStore(REDIS_URL, prefix=prefix, timeout_s=30)
    try:
        await redis_store.create_tenant(tenant, key)
        for u in range(USERS):  # the writes /generate makes, in bulk: one user's at once
            count = n // USERS + (u < n % USERS)
            meta = {"user_id": f"user-{u:04d}"}
            await redis_store.allocate_messages(tid, 1, BITS, meta, float(u), count)
        old, new = await timed(redis_store, scheme, tid)
        say(f"redis  {n} entries: one by one {old:.2f} s, bulk {new:.2f} s ({old / new:.0f}x)")
    finally:
        await redis_store.close()
        client: Redis = Redis.from_url(REDIS_URL)
        doomed = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        for i in range(0, len(doomed), 500):
            await client.delete(*doomed[i : i + 500])
        await client.aclose()
    with tempfile.TemporaryDirectory() as tmp:
        sqlite_store = SQLiteStore(Path(tmp) / "bench.sqlite3")
        try:
            await sqlite_store.create_tenant(tenant, key)
            fill_sqlite(sqlite_store, tid, n)
            old, new = await timed(sqlite_store, scheme, tid)
            say(f"sqlite {n} entries: one by one {old:.2f} s, bulk {new:.2f} s ({old / new:.0f}x)")
        finally:
            await sqlite_store.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000))
