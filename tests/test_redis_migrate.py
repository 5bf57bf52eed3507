"""``worldcup migrate-store`` in place on one Redis: the legacy layout (tests/legacy_redis)
into the current one; every entry, index, key and TTL'd record survives. The same
migration into a Redis Cluster, with texts decoded afterwards, is in test_redis_cluster."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from legacy_redis import downgrade
from redis import Redis
from test_store_contract import (
    REDIS_URL,
    api_key_record,
    key_record,
    redis_namespace,
    tenant_records,
)
from typer.testing import CliRunner

from app.stores import redis_layout
from app.stores.base import CaseRecord, IdempotencyRecord, StoreUnavailable
from app.stores.client_payloads import record_client_payload, recorded_client_payloads
from app.stores.redis import RedisStore
from app.stores.redis_migrate import migrate_store
from worldcup_cli.main import app as cli

pytestmark = pytest.mark.anyio


async def _fill(store: RedisStore) -> list[str]:
    """Two tenants, entries over several buckets and key versions, one voided; API keys,
    an idempotency record (TTL) and a case."""
    await store.ensure_marker("m-1")
    tids = []
    for name in ("acme", "globex"):
        tenant, key = tenant_records(name)
        await store.create_tenant(tenant, key)
        await store.add_key_version(key_record(tenant.tenant_id, 2))
        tids.append(tenant.tenant_id)
    for i in range(23):
        await store.allocate_message(tids[0], 1 + i % 2, 32 if i % 3 else 16, {"i": i}, float(i))
    await store.allocate_message(tids[1], 1, 32, {"other": True}, 5.0)
    await record_client_payload(store, tids[0], 1, "1011001110001111")  # a durable probe record
    await store.void_message(tids[0], 7, "test")
    await store.add_api_key(api_key_record(tids[0], "k1", key_hash="ab" * 32))
    await store.idempotency_put(tids[0], "req-1", IdempotencyRecord("h", 200, {"a": 1}), 600)
    case = CaseRecord("c1", 10.0, tids[0], {"verdict": "x"}, "text", None, time.time() + 600)
    await store.put_case(case)
    return tids


async def _snapshot(store: RedisStore, tids: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"tenants": await store.list_tenants()}
    for tid in tids:
        out[tid] = {
            "keys": await store.key_versions(tid),
            "entries": [await store.registry_entry(tid, i) for i in range(1, 26)],
            "ids": {
                (kv, bits): await store.message_ids(tid, kv, bits)
                for kv in (1, 2)
                for bits in (16, 32)
            },
            "bits": await store.registry_bit_lengths(tid, 1),
            "sizes": [
                await store.registry_size(tid, kv, bits) for kv in (1, 2) for bits in (16, 32)
            ],
            "api": await store.api_keys(tid),
            "idem": await store.idempotency_get(tid, "req-1"),
            "client": await recorded_client_payloads(store, tid, 1),
        }
    out["case"] = await store.get_case("c1", time.time())
    out["api_by_hash"] = await store.api_key_by_hash("ab" * 32)
    out["marker"] = await store.marker()
    return out


async def test_migrate_in_place_keeps_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_layout, "BUCKET_IDS", 4)  # 23 entries: six buckets
    async with redis_namespace() as prefix:
        store = RedisStore(REDIS_URL, prefix=prefix)
        try:
            tids = await _fill(store)
            before = await _snapshot(store, tids)
            assert len(before[tids[0]]["ids"][(1, 32)]) > 4  # spans buckets
            assert before[tids[0]]["entries"][6] is None  # the voided id
            assert before[tids[0]]["client"] == {16: [0b1011001110001111]}
            with Redis.from_url(REDIS_URL) as client:
                assert downgrade(client, prefix) > 10
                assert client.hlen(f"{prefix}:{tids[0]}:msgs") == 22
            # the legacy layout is refused, and nothing is readable under the new names
            with pytest.raises(StoreUnavailable, match="migrate-store"):
                await store.ensure_marker("m-2")
            assert await store.registry_entry(tids[0], 1) is None

            args = ["migrate-store", "--from", REDIS_URL, "--prefix", prefix]
            result = await asyncio.to_thread(CliRunner().invoke, cli, args)  # runs its own loop
            assert result.exit_code == 0, result.output
            assert "migrated 2 tenants, 23 registry entries" in result.output

            assert await store.ensure_marker("m-2") == "m-1"
            assert await _snapshot(store, tids) == before
            nxt = await store.allocate_message(tids[0], 1, 32, {}, 0.0)
            assert nxt.message_id == 24  # the counter came along: no id is handed out twice
            again = await migrate_store(REDIS_URL, prefix)
            assert again.already_migrated
        finally:
            await store.close()


async def test_migrate_refuses_nothing_when_empty() -> None:
    """A namespace with no tenants migrates to an empty current-layout namespace."""
    async with redis_namespace() as prefix:
        report = await migrate_store(REDIS_URL, prefix)
        assert (report.tenants, report.entries) == (0, 0)
        store = RedisStore(REDIS_URL, prefix=prefix)
        try:
            assert await store.ensure_marker("fresh") == "fresh"
        finally:
            await store.close()
