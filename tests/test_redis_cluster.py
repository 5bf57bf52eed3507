"""The service on a real Redis Cluster (pytest mark ``cluster``; ``make test-cluster``).

Six local ``redis-server`` processes (tests/redis_cluster.py), three primaries with a
replica each, ``cluster-node-timeout`` 2 s. Over HTTP with the embedded SmolLM2:

- texts issued on one Redis under the legacy layout, migrated into the cluster
  (``worldcup migrate-store``), still decode to their entries;
- a /generate then /decode round trip with ``WORLDCUP_REDIS_CLUSTER=true``;
- a failover soak: /generate runs continuously, the primary holding the tenant's
  message counter is SIGKILLed, its replica takes over, the killed node comes back as
  a replica; every acknowledged /generate decodes to its own entry, every acknowledged
  registry write of a second client (another API replica, writing as fast as the
  store takes it) still holds its entry, and no message id was handed out twice.

Plus, without the model, one tenant's registry spread over the cluster's shards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from legacy_redis import downgrade
from redis_cluster import RedisClusterProcs
from servers import LiveServer, free_port
from test_store_contract import REDIS_URL, tenant_records

from app.core.config import Settings
from app.stores import redis_layout
from app.stores.backup import backup_redis, restore_redis
from app.stores.base import ApiKeyRecord, CaseRecord, StoreUnavailable
from app.stores.redis import RedisStore
from app.stores.redis_migrate import migrate_store

pytestmark = pytest.mark.cluster

ADMIN = "cluster-admin-token-5b2e"
MASTER = "c3" * 32
# Per text. At 64, /decode withheld the entry of 6 in 320 texts (a 160-entry registry:
# an entry a bit or two away fit almost as well); at 128, of none in 96.
TOKENS = 128
SOAK_REQUEST_S = 240  # a worker's /generate, at most
SOAK_WAIT_S = 2 * SOAK_REQUEST_S + 60  # two batches, and the retries between them


@pytest.mark.anyio
async def test_one_tenants_registry_spreads_over_shards(
    redis_cluster: RedisClusterProcs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_layout, "BUCKET_IDS", 4)  # 60 ids: 15 buckets
    store = RedisStore(redis_cluster.url, prefix=f"wct{uuid.uuid4().hex[:8]}", cluster=True)
    try:
        tenant, key = tenant_records("big")
        await store.create_tenant(tenant, key)
        tid = tenant.tenant_id
        entries = [await store.allocate_message(tid, 1, 32, {"i": i}, 0.0) for i in range(60)]
        assert [e.message_id for e in entries] == list(range(1, 61))
        assert await store.message_ids(tid, 1, 32) == list(range(1, 61))
        assert await store.registry_entries(tid, [3, 30, 59, 99]) == [
            entries[2],
            entries[29],
            entries[58],
            None,
        ]
        keys = {store._keys.msgs(tid, b) for b in range(15)}
        shards = {redis_cluster.primary_of(k) for k in keys}
        assert len(shards) == 3, shards  # 15 buckets over 3 primaries
    finally:
        await store.close()


def _settings(**kw: Any) -> Settings:
    return Settings(
        port=free_port(),
        master_key=MASTER,
        admin_token=ADMIN,
        max_batch_size=8,
        default_num_bits=16,
        **kw,
    )


def _tenant(http: httpx.Client, name: str) -> dict[str, str]:
    r = http.post(
        "/admin/tenants",
        json={"name": f"{name}-{uuid.uuid4().hex[:6]}"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 201, r.text
    body = r.json()
    return {"id": body["tenant_id"], "auth": f"Bearer {body['api_key']}"}


def _generate(http: httpx.Client, auth: str, prompt: str, meta: dict[str, Any]) -> httpx.Response:
    body = {
        "prompt": prompt,
        "max_new_tokens": TOKENS,
        "min_new_tokens": TOKENS,
        "metadata": meta,
    }
    return http.post("/generate", json=body, headers={"Authorization": auth})


def _match(http: httpx.Client, auth: str, text: str) -> dict[str, Any] | None:
    r = http.post("/decode", json={"text": text}, headers={"Authorization": auth})
    assert r.status_code == 200, r.text
    match: dict[str, Any] | None = r.json()["registry_match"]
    return match


@pytest.fixture(scope="module")
def prompts(data_dir: Path) -> list[str]:
    with (data_dir / "cnn_dailymail_test.jsonl").open() as fh:
        return [" ".join(json.loads(line)["article"].split()[:30]) for line in fh][:40]


@pytest.fixture(scope="module")
def legacy(redis_cluster: RedisClusterProcs, prompts: list[str]) -> dict[str, Any]:
    """Texts issued on one Redis, that namespace turned into the legacy layout, then
    migrated into the cluster (same prefix)."""
    prefix = f"wctl{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        with (
            LiveServer(_settings(redis_url=REDIS_URL, redis_prefix=prefix)) as server,
            httpx.Client(base_url=server.url, timeout=180) as http,
        ):
            tenant = _tenant(http, "legacy")
            with ThreadPoolExecutor(3) as pool:  # one batch
                done = list(
                    pool.map(
                        lambda i: _generate(http, tenant["auth"], prompts[i], {"legacy": i}),
                        range(3),
                    )
                )
            assert all(r.status_code == 200 for r in done), [r.text for r in done]
            issued = [r.json() for r in done]
        downgrade(client, prefix)
        import anyio

        report = anyio.run(
            lambda: migrate_store(
                REDIS_URL, prefix, target_url=redis_cluster.url, target_cluster=True
            )
        )
        assert (report.tenants, report.entries) == (1, 3)
    finally:
        keys = list(client.scan_iter(f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    return {"prefix": prefix, "tenant": tenant, "issued": issued}


@pytest.fixture(scope="module")
def live(redis_cluster: RedisClusterProcs, legacy: dict[str, Any]) -> Iterator[LiveServer]:
    settings = _settings(
        redis_url=redis_cluster.url, redis_cluster=True, redis_prefix=legacy["prefix"]
    )
    with LiveServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=180) as client:
        yield client


@pytest.mark.model
def test_migrated_texts_decode_to_their_entries(http: httpx.Client, legacy: dict[str, Any]) -> None:
    for i, g in enumerate(legacy["issued"]):
        match = _match(http, legacy["tenant"]["auth"], g["text"])
        assert match is not None
        assert match["message_id"] == g["message_id"] and match["metadata"] == {"legacy": i}


@pytest.mark.model
def test_generate_decode_round_trip(http: httpx.Client, prompts: list[str]) -> None:
    tenant = _tenant(http, "acme")
    r = _generate(http, tenant["auth"], prompts[5], {"user": "u-1"})
    assert r.status_code == 200, r.text
    match = _match(http, tenant["auth"], r.json()["text"])
    assert match is not None and match["message_id"] == r.json()["message_id"] == 1
    assert match["metadata"] == {"user": "u-1"} and match["p_value"] < 1e-6


def _wait(ok: Any, what: str, timeout: float) -> float:
    start = time.monotonic()
    while not ok():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


class RegistryPressure:
    """Another API replica's registry writes, as fast as the store takes them: many
    allocations are in flight when the primary dies."""

    def __init__(self, cluster: RedisClusterProcs, prefix: str, shard: int) -> None:
        self.cluster, self.prefix = cluster, prefix
        # its own tenant (a registry this full would blur the texts' 16-bit matches),
        # whose counter lives on the shard that will fail
        self.tenant_id = next(
            tid
            for tid in (f"t_{uuid.uuid4().hex[:16]}" for _ in range(1000))
            if cluster.primary_of(f"{prefix}:{{{tid}}}:msgseq") == shard
        )
        self.acked: list[tuple[int, dict[str, Any]]] = []
        self.refused = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self) -> None:
        store = RedisStore(self.cluster.url, prefix=self.prefix, cluster=True)
        tenant, key = tenant_records("pressure")
        tenant = dataclasses.replace(tenant, tenant_id=self.tenant_id)
        await store.create_tenant(tenant, dataclasses.replace(key, tenant_id=self.tenant_id))

        async def one(w: int) -> None:
            n = 0
            while not self.stop.is_set():
                meta = {"s": w, "n": n}
                n += 1
                try:
                    e = await store.allocate_message(self.tenant_id, 1, 16, meta, time.time())
                except StoreUnavailable:
                    self.refused += 1
                    await asyncio.sleep(0.05)
                    continue
                self.acked.append((e.message_id, meta))

        try:
            await asyncio.gather(*(one(w) for w in range(4)))
        finally:
            await store.close()


@pytest.mark.model
def test_failover_soak_loses_no_acknowledged_text(
    redis_cluster: RedisClusterProcs,
    live: LiveServer,
    http: httpx.Client,
    legacy: dict[str, Any],
    prompts: list[str],
) -> None:
    tenant = _tenant(http, "soak")
    victim = redis_cluster.primary_of(f"{legacy['prefix']}:{{{tenant['id']}}}:msgseq")
    acked: list[tuple[float, dict[str, Any], dict[str, Any]]] = []
    failures: Counter[str] = Counter()
    stop = threading.Event()

    def worker(w: int) -> None:
        # one batch of four 128-token answers took 59 s on a loaded CI machine: a client
        # that gives up first is never acknowledged, so the wait below would see nothing
        with httpx.Client(base_url=live.url, timeout=SOAK_REQUEST_S) as client:
            n = 0
            while not stop.is_set():
                meta = {"w": w, "n": n}
                n += 1
                try:
                    r = _generate(client, tenant["auth"], prompts[(w * 7 + n) % 40], meta)
                except httpx.HTTPError as exc:
                    failures[type(exc).__name__] += 1
                    continue
                if r.status_code == 200:
                    acked.append((time.monotonic(), meta, r.json()))
                else:
                    failures[str(r.status_code)] += 1
                    time.sleep(0.2)

    pressure = RegistryPressure(redis_cluster, legacy["prefix"], victim)
    pressure.thread.start()
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(worker, w) for w in range(4)]
        try:
            _wait(lambda: len(acked) >= 4, "acknowledged texts before the kill", SOAK_WAIT_S)
            before, writes_before = len(acked), len(pressure.acked)
            redis_cluster.kill(victim)
            killed = time.monotonic()
            failover_s = _wait(
                lambda: len(redis_cluster.primaries()) == 3, "the replica's promotion", 30
            )
            during = len(acked) - before
            redis_cluster.restart(victim)  # back as a replica: writes are acknowledged again
            redis_cluster.wait_healthy()
            back = time.monotonic()
            _wait(
                lambda: sum(t > back for t, _, _ in acked) >= 4, "texts after recovery", SOAK_WAIT_S
            )
        finally:
            stop.set()
            pressure.stop.set()
            for f in running:
                f.result()
            pressure.thread.join(timeout=30)
    ids = [g["message_id"] for _, _, g in acked]
    written = [i for i, _ in pressure.acked]  # ids are per tenant: checked one by one
    print(
        f"\nsoak: {len(acked)} acknowledged ({before} before the kill, {during} while the "
        f"shard failed over, {sum(t > back for t, _, _ in acked)} after recovery); "
        f"failover {failover_s:.1f} s, back after {back - killed:.1f} s; "
        f"refused: {dict(failures)}; registry writes beside: {len(pressure.acked)} "
        f"acknowledged ({writes_before} before the kill), {pressure.refused} refused"
    )
    assert pressure.refused > 0  # the kill did hit the writes in flight
    # a refusal is a 503 (Retry-After), never a 500: redis-py's torn connections included
    assert all(k == "503" for k in failures if k.isdigit()), failures
    # every acknowledged allocation beside still holds its own entry
    entries = _entries(redis_cluster, legacy["prefix"], pressure.tenant_id, written)
    assert asyncio.run(entries) == dict(pressure.acked)
    assert len(ids) == len(set(ids)), "a message id was issued twice"
    assert len(written) == len(set(written)), "a message id was issued twice"
    # every acknowledged text's entry survived the failover, read from the store itself
    # (a lost write fails here, not as a weak watermark below)
    held = asyncio.run(_entries(redis_cluster, legacy["prefix"], tenant["id"], ids))
    assert held == {g["message_id"]: meta for _, meta, g in acked}
    for _, meta, g in acked:  # ... and /decode names it from the text alone
        match = _match(http, tenant["auth"], g["text"])
        assert match is not None, (meta, g["message_id"], _decoded(http, tenant["auth"], g))
        assert (match["message_id"], match["metadata"]) == (g["message_id"], meta)


async def _entries(
    cluster: RedisClusterProcs, prefix: str, tenant_id: str, ids: list[int]
) -> dict[int, dict[str, Any]]:
    store = RedisStore(cluster.url, prefix=prefix, cluster=True)
    try:
        found = await store.registry_entries(tenant_id, ids)
        return {e.message_id: e.metadata for e in found if e is not None}
    finally:
        await store.close()


def _decoded(http: httpx.Client, auth: str, generated: dict[str, Any]) -> dict[str, Any]:
    """What /decode made of a text that named no entry: the failure message's evidence."""
    r = http.post("/decode", json={"text": generated["text"]}, headers={"Authorization": auth})
    body: dict[str, Any] = r.json()
    keep = ("verdict", "p_value", "bits", "num_tokens", "num_scored_tokens", "registry_expired")
    return {k: body.get(k) for k in keep} | {"issued": generated.get("payload")}


# -- two replicas per primary: a failover no request notices ---------------------------


@pytest.fixture(scope="module")
def cluster9() -> Iterator[RedisClusterProcs]:
    """Three primaries with two replicas each (nine nodes, their own ports): a primary's
    loss leaves its promoted replica a replica to acknowledge writes (``WAIT 1``)."""
    base = int(os.environ.get("WORLDCUP_TEST_CLUSTER_PORT", "21201")) + 10
    cluster = RedisClusterProcs(base, replicas=2).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _absorb_kill(cluster: RedisClusterProcs, victim: int) -> float:
    """SIGKILL ``victim``; return once the cluster has absorbed it (a replica promoted,
    every replica linked and acknowledging): the seconds that took."""
    cluster.kill(victim)
    killed = time.monotonic()
    _wait(lambda: len(cluster.primaries()) == 3, "a replica's promotion", 30)
    cluster.wait_healthy()
    return time.monotonic() - killed


@pytest.mark.anyio
async def test_first_store_calls_after_an_absorbed_failover_succeed(
    cluster9: RedisClusterProcs,
) -> None:
    """The store's slot map and pooled connections still point at the killed primary:
    the first call of each kind meets them, and its retry (after re-reading the slot
    map) must answer. Before the retry, the first call answered 503."""
    prefix = f"wct{uuid.uuid4().hex[:8]}"
    store = RedisStore(cluster9.url, prefix=prefix, cluster=True)
    try:
        tenant, key = tenant_records("absorbed")
        await store.create_tenant(tenant, key)
        tid = tenant.tenant_id
        first = await store.allocate_message(tid, 1, 16, {"n": 0}, 1.0)
        assert (await store.take_tokens(tid, 50, 100, 1)).allowed
        victim = cluster9.primary_of(f"{prefix}:{{{tid}}}:msgseq")
        await asyncio.to_thread(_absorb_kill, cluster9, victim)
        assert await store.get_tenant(tid) == tenant  # a read
        assert (await store.take_tokens(tid, 50, 100, 1)).allowed  # an idempotent write
        second = await store.allocate_message(tid, 1, 16, {"n": 1}, 2.0)  # the counter
        assert second.message_id == first.message_id + 1  # nothing lost, nothing skipped
        assert await store.registry_entries(tid, [1, 2]) == [first, second]
    finally:
        await store.close()
        cluster9.restart(victim)
        await asyncio.to_thread(cluster9.wait_healthy)


@pytest.mark.model
def test_generate_through_a_primary_loss_with_two_replicas(
    cluster9: RedisClusterProcs, tiny_model_dir: Path
) -> None:
    """/generate under load while the primary holding the tenant's counter is killed:
    the only refusals are 503s with Retry-After from requests begun before the cluster
    had absorbed the loss (docs/operations.md's failover window); from then on every
    request answers 200, the first included; 0 ids handed out twice, 0 entries lost."""
    prefix = f"wct{uuid.uuid4().hex[:8]}"
    settings = _settings(
        model_path=str(tiny_model_dir),
        redis_url=cluster9.url,
        redis_cluster=True,
        redis_prefix=prefix,
    )
    calls: list[tuple[float, float, int, str | None, dict[str, Any], dict[str, Any]]] = []
    stop = threading.Event()
    with LiveServer(settings) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        tenant = _tenant(http, "nine")
        victim = cluster9.primary_of(f"{prefix}:{{{tenant['id']}}}:msgseq")

        def worker(w: int) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                n = 0
                while not stop.is_set():
                    meta, body = {"w": w, "n": n}, {"prompt": "Tides", "max_new_tokens": 4}
                    n += 1
                    started = time.monotonic()
                    r = client.post(
                        "/generate",
                        json={**body, "metadata": meta},
                        headers={"Authorization": tenant["auth"]},
                    )
                    out = r.json()
                    calls.append(
                        (started, time.monotonic(), r.status_code,
                         r.headers.get("Retry-After"), meta, out)
                    )  # fmt: skip
                    if r.status_code != 200:
                        time.sleep(0.1)

        with ThreadPoolExecutor(3) as pool:
            running = [pool.submit(worker, w) for w in range(3)]
            try:
                _wait(lambda: len(calls) >= 6, "texts before the kill", 60)
                killed = time.monotonic()
                window = _absorb_kill(cluster9, victim)
                absorbed = time.monotonic()
                _wait(lambda: sum(c[0] > absorbed for c in calls) >= 6, "texts after", 60)
            finally:
                stop.set()
                for f in running:
                    f.result()
                cluster9.restart(victim)
        refused = [c for c in calls if c[2] != 200]
        after = sorted((c for c in calls if c[0] > absorbed), key=lambda c: c[0])
        print(
            f"\nfailover absorbed {window:.1f} s after the kill; {len(calls)} requests, "
            f"{len(refused)} refused (503), {len(after)} begun after absorption"
        )
        for started, ended, status, retry_after, _, out in refused:
            assert status == 503 and out["error"]["code"] == "store_unavailable", out
            assert retry_after is not None and int(retry_after) >= 1
            assert ended > killed and started < absorbed  # inside the failover window
        assert after[0][2] == 200  # the first request once the cluster absorbed the loss
        acked = {c[5]["message_id"]: c[4] for c in calls if c[2] == 200}
        assert len(acked) == sum(c[2] == 200 for c in calls), "a message id issued twice"
        held = asyncio.run(_entries(cluster9, prefix, tenant["id"], list(acked)))
        assert held == acked  # every acknowledged text's entry survived the failover
    cluster9.wait_healthy(timeout=120)  # a restarted node resyncs slowly on a loaded machine


@pytest.mark.anyio
async def test_backup_wipe_restore_drill_on_the_cluster(
    redis_cluster: RedisClusterProcs, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``worldcup store backup``'s dump read from every shard, the namespace wiped, the
    dump written back through the cluster: registry, counter, case and API key alike."""
    monkeypatch.setattr(redis_layout, "BUCKET_IDS", 4)  # 20 ids: 5 buckets over the shards
    prefix = f"wct{uuid.uuid4().hex[:8]}"
    store = RedisStore(redis_cluster.url, prefix=prefix, cluster=True)
    try:
        tenant, key = tenant_records("drill")
        await store.create_tenant(tenant, key)
        tid = tenant.tenant_id
        entries = [await store.allocate_message(tid, 1, 16, {"i": i}, 1.0) for i in range(20)]
        api_key = ApiKeyRecord("k1", tid, "ab" * 32, "analyst", ("decode",), "full", 1.0)
        assert await store.add_api_key(api_key)
        case = CaseRecord("c1", 2.0, tid, {"verdict": "watermarked"}, batch_id="b1")
        await store.put_case(case)
        out = tmp_path / "cluster.backup"
        dumped = await backup_redis(redis_cluster.url, prefix, True, out)
        assert (dumped.tenants, dumped.entries) == (1, 20)
        wiper = redis.RedisCluster.from_url(redis_cluster.url)
        try:
            for k in list(wiper.scan_iter(match=f"{prefix}:*", count=1000)):
                wiper.delete(k)
        finally:
            wiper.close()
        assert await store.registry_entries(tid, [1]) == [None]  # wiped
        restored = await restore_redis(redis_cluster.url, prefix, True, out)
        assert (restored.tenants, restored.entries, restored.keys) == (1, 20, dumped.keys)
        assert await store.registry_entries(tid, list(range(1, 21))) == entries
        assert await store.message_ids(tid, 1, 16) == list(range(1, 21))
        assert await store.api_key_by_hash("ab" * 32) == api_key
        assert await store.list_cases(tid, "b1", 10, 3.0) == [case]
        assert (await store.allocate_message(tid, 1, 16, {}, 3.0)).message_id == 21
    finally:
        await store.close()
