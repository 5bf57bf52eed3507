"""The store methods behind the registry lookup and retention (issue #36), on both stores:
counters kept at write time, one-round-trip membership, the retention watermark."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from test_store_contract import clock, store, tenant_records  # noqa: F401 - fixtures

from app.stores.base import RegistrySize, Store
from app.stores.client_payloads import (
    client_key,
    client_payload_count,
    client_payload_uses,
    payload_digest,
    record_client_payload,
    recorded_client_payloads,
)
from app.stores.sqlite import SQLiteStore

pytestmark = pytest.mark.anyio


async def test_registry_size_is_counted_at_write_time(store: Store) -> None:  # noqa: F811
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    assert await store.registry_size(tid, 1, 32) == RegistrySize(0, 0, 0, 0)
    plan = [(1, 32), (1, 16), (2, 32), (1, 32), (2, 32), (1, 32)]
    for kv, bits in plan:
        await store.allocate_message(tid, kv, bits, {}, 0.0)
    assert (await store.registry_size(tid, 1, 32)).live == 3
    assert (await store.registry_size(tid, 1, 16)).live == 1
    assert (await store.registry_size(tid, 2, 32)).live == 2
    assert (await store.registry_size(tid, 2, 32)).last_id == 6
    assert (await store.registry_size(tid, 3, 8)) == RegistrySize(0, 0, 0, 6)
    assert await store.void_message(tid, 4, "growth")
    assert not await store.void_message(tid, 4, "growth")  # counted once
    assert (await store.registry_size(tid, 1, 32)).live == 2
    assert (await store.registry_size(tid, 1, 32)).live == len(await store.message_ids(tid, 1, 32))
    assert await store.message_ids(tid, 1, 32, after=1) == [6]
    assert await store.message_ids(tid, 1, 32, after=6) == []
    assert await store.message_ids(tid, 2, 32, after=2) == [3, 5]


async def test_issued_among_answers_each_id(store: Store) -> None:  # noqa: F811
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    other, okey = tenant_records("other")
    await store.create_tenant(other, okey)
    tid = tenant.tenant_id
    for kv, bits in [(1, 32), (1, 16), (1, 32), (2, 32), (1, 32)]:
        await store.allocate_message(tid, kv, bits, {}, 0.0)
    await store.allocate_message(other.tenant_id, 1, 32, {}, 0.0)
    await store.void_message(tid, 5, "growth")
    asked = [5, 1, 2, 3, 4, 0, -1, 10**12, 1, 3]
    assert await store.issued_among(tid, 1, 32, asked) == [
        False, True, False, True, False, False, False, False, True, True,
    ]  # fmt: skip
    assert await store.issued_among(tid, 1, 16, [1, 2]) == [False, True]
    assert await store.issued_among(tid, 3, 32, [1, 2]) == [False, False]
    assert await store.issued_among(other.tenant_id, 1, 32, [1, 2, 3]) == [True, False, False]
    assert await store.issued_among(tid, 1, 32, []) == []
    many = list(range(1, 40_001))  # above SQLite's bound-variable limit
    found = await store.issued_among(tid, 1, 32, many)
    assert [i for i, f in zip(many, found, strict=True) if f] == [1, 3]


async def test_retention_sweep_moves_old_entries_behind_the_watermark(store: Store) -> None:  # noqa: F811
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    assert await store.registry_retention(tid) is None
    await store.set_registry_retention(tid, 30.0)
    assert await store.registry_retention(tid) == 30.0
    for i in range(1, 9):  # issued at t = 100 * i
        await store.allocate_message(tid, 1, 32 if i % 2 else 16, {"i": i}, 100.0 * i)
    await store.void_message(tid, 3, "growth")
    assert await store.expire_registry(tid, 50.0) == 0  # nothing that old
    assert (await store.registry_size(tid, 1, 32)).expired_below == 0
    # ids 1..4 were issued before t = 450; 3 was voided already
    assert await store.expire_registry(tid, 450.0) == 3
    assert await store.registry_size(tid, 1, 32) == RegistrySize(2, 1, 5, 8)  # live 5, 7
    assert await store.registry_size(tid, 1, 16) == RegistrySize(2, 2, 5, 8)  # live 6, 8
    assert await store.registry_entry(tid, 1) is None
    assert await store.registry_entry(tid, 5) is not None
    assert await store.message_ids(tid, 1, 32) == [5, 7]
    assert await store.issued_among(tid, 1, 32, [1, 5]) == [False, True]
    assert await store.expire_registry(tid, 450.0) == 0  # idempotent
    assert await store.expire_registry(tid, 10.0) == 0  # the watermark never goes back
    assert (await store.registry_size(tid, 1, 32)).expired_below == 5
    # everything expires; ids are never handed out again
    assert await store.expire_registry(tid, 10_000.0) == 4
    assert (await store.registry_size(tid, 1, 32)).expired_below == 9
    assert (await store.registry_size(tid, 1, 32)).last_id == 8
    assert (await store.allocate_message(tid, 1, 32, {}, 20_000.0)).message_id == 9
    assert await store.registry_size(tid, 1, 32) == RegistrySize(1, 3, 9, 9)
    await store.set_registry_retention(tid, None)
    assert await store.registry_retention(tid) is None


@pytest.mark.anyio
async def test_sqlite_counts_a_registry_written_before_the_counters(tmp_path: Path) -> None:
    """A file from an older release (no registry_counts rows) is counted once at open."""
    path = tmp_path / "old.sqlite3"
    s = SQLiteStore(path)
    tenant, key = tenant_records("acme")
    await s.create_tenant(tenant, key)
    for bits in (32, 32, 16, 32):
        await s.allocate_message(tenant.tenant_id, 1, bits, {}, 0.0)
    await s.void_message(tenant.tenant_id, 2, "growth")
    await s.close()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE registry_counts")
    s = SQLiteStore(path)
    try:
        assert (await s.registry_size(tenant.tenant_id, 1, 32)).live == 2
        assert (await s.registry_size(tenant.tenant_id, 1, 16)).live == 1
    finally:
        await s.close()


async def test_recorded_client_payloads_are_listed_per_key_version(store: Store) -> None:  # noqa: F811
    """What ``worldcup scan`` reads: every client-chosen payload recorded under one key
    version, per length; at the registry's lengths only where their counter says so."""
    tenant, key = tenant_records("acme")
    await store.create_tenant(tenant, key)
    tid = tenant.tenant_id
    assert await recorded_client_payloads(store, tid, 1) == {}
    for bits in ["1011", "0110", "1011", "01011", "1000000000000001"]:
        await record_client_payload(store, tid, 1, bits)
    await record_client_payload(store, tid, 2, "1111")
    await record_client_payload(store, tid + "x", 1, "0001")  # another tenant
    # an API key's probe accounting beside them is no payload
    await store.probe_hit(tid, "k1", payload_digest(4, 3), b"0011", [], 60.0, 5)
    assert await recorded_client_payloads(store, tid, 1) == {
        4: [0b0110, 0b1011], 5: [0b01011], 16: [0x8001],
    }  # fmt: skip
    assert await client_payload_count(store, tid, 1, 4) == 2  # the service's counter agrees
    # the texts under each, the registry test's prior weight ("1011" twice; none: 0)
    assert await client_payload_uses(store, tid, 1, 4, [0b1011, 0b0110, 0b0001]) == {
        0b0001: 0, 0b0110: 1, 0b1011: 2,
    }  # fmt: skip
    assert await client_payload_uses(store, tid, 2, 4, [0b1011]) == {0b1011: 0}
    assert await recorded_client_payloads(store, tid, 1, [4, 16, 8]) == {
        4: [0b0110, 0b1011], 16: [0x8001],
    }  # fmt: skip
    assert await recorded_client_payloads(store, tid, 1, [8]) == {}
    assert await recorded_client_payloads(store, tid, 2) == {4: [0b1111]}
    assert await recorded_client_payloads(store, tid, 3) == {}
    assert await recorded_client_payloads(store, tid + "x", 1) == {4: [0b0001]}
    # the store's own read: payloads and the per-length counters, by cluster id
    clusters = await store.probe_clusters(tid, client_key(1))
    assert len(clusters) == 4 + 3 + 4 and clusters == sorted(clusters)  # payloads, counters, uses
    assert ("count4", b"-") in clusters and (payload_digest(4, 0b0110), b"0110") in clusters
