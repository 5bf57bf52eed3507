"""``worldcup bench registry``: registry lookups over HTTP at 10^2 .. 10^6 issued texts.

The real app (``create_app``, embedded model) runs under uvicorn in a thread of this
process with a **Redis** store under a key prefix of its own (every key under it is
deleted at the end, also after a failure). One tenant per registry size generates a
few texts through ``/generate`` (with metadata, 32-bit payloads); its registry is then
filled to its size with the writes ``allocate_message`` makes
(:meth:`RedisStore.allocate_messages`, pipelined). Then ``/decode`` (one text),
``/decode/batch`` (the tenant's texts) and ``/provenance`` (admin token) are timed one
request at a time, the sizes interleaved round by round (a shuffled order each round),
so that the load of a shared machine falls on every size alike: the ratios are side
by side in one run. Each answer must name the text's own entry.

Printed: per size, p50 and p90 latency per route and the ratio of the p50 to the
smallest registry's; the Redis memory per entry (``MEMORY USAGE`` of the registry's
keys, every element sampled); how fast the registry filled (entries/s). Target: the
p50 at 10^6 entries within 1.5x of the p50 at 10^2.

Also printed (``--accuracy``, no HTTP): the list path's miss rate against the
exhaustive match on simulated texts at several registry sizes and bit-error levels.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import statistics
import time
from typing import Any

import numpy as np

from worldcup_cli.benchlib import Progress, Server, free_socket, percentile, ready_with_tenant

SIZES = (100, 10_000, 100_000, 1_000_000)
NUM_BITS = 32
TEXTS = 3  # generated texts per tenant: /decode takes the first, /decode/batch all
NEW_TOKENS = 128
REQUESTS = 30  # timed rounds (after 3 warm-up rounds): one request per route and size
FILL_CHUNK = 20_000
TARGET_RATIO = 1.5
SMALL_METADATA = {"user": "u-000123", "purpose": "bench"}
ROUTES = ("decode", "decode_batch", "provenance")


async def _timed(client: Any, path: str, body: dict[str, Any], auth: dict[str, str]) -> Any:
    start = time.perf_counter()
    r = await client.post(path, json=body, headers=auth)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
    return elapsed, r.json()


def _found(route: str, answer: dict[str, Any]) -> list[int | None]:
    """The message ids an answer names (None where it names none)."""
    if route == "decode":
        return [(answer.get("registry_match") or {}).get("message_id")]
    if route == "decode_batch":
        return [
            ((item["result"] or {}).get("registry_match") or {}).get("message_id")
            for item in answer["results"]
        ]
    entry = ((answer.get("match") or {}).get("registry_entry")) or {}
    return [entry.get("message_id")]


async def _measure(
    client: Any, tenants: list[dict[str, Any]], admin: dict[str, str], rounds: int
) -> dict[tuple[int, str], dict[str, Any]]:
    """Latencies per (tenant, route), the tenants' requests interleaved round by round
    (in a shuffled order each round) so a load that comes and goes on a shared machine
    hits every registry size alike; every answer must name the text's own entry."""
    rng = random.Random(36)
    times: dict[tuple[int, str], list[float]] = {}
    matched: dict[tuple[int, str], int] = {}
    for rnd in range(rounds + 3):  # 3 warm-up rounds
        order = list(range(len(tenants)))
        rng.shuffle(order)
        for route in ROUTES:
            for t in order:
                tenant = tenants[t]
                texts = tenant["texts"]
                path, body, who = {
                    "decode": ("/decode", {"text": texts[0], "num_bits": NUM_BITS}, tenant["auth"]),
                    "decode_batch": (
                        "/decode/batch",
                        {"texts": texts, "num_bits": NUM_BITS},
                        tenant["auth"],
                    ),
                    "provenance": ("/provenance", {"text": texts[0]}, admin),
                }[route]
                elapsed, answer = await _timed(client, path, body, who)
                if rnd < 3:
                    continue
                times.setdefault((t, route), []).append(elapsed)
                found = _found(route, answer)
                good = sum(f == w for f, w in zip(found, tenant["ids"], strict=False))
                matched[(t, route)] = matched.get((t, route), 0) + good
    out = {}
    for (t, route), values in times.items():
        per = len(tenants[t]["texts"]) if route == "decode_batch" else 1
        out[(t, route)] = {
            "p50_ms": round(1000 * statistics.median(values), 2),
            "p90_ms": round(1000 * percentile(values, 90), 2),
            "matched": matched.get((t, route), 0),
            "of": per * len(values),
        }
    return out


async def _registry_bytes(redis: Any, prefix: str, tenant_id: str) -> int:
    total = 0
    # the tenant's registry counters and its id-range buckets (app/stores/redis_layout.py)
    for pattern in (f"{prefix}:{{{tenant_id}}}:msg*", f"{prefix}:{{{tenant_id}:*}}:*"):
        async for key in redis.scan_iter(match=pattern, count=1000):
            total += int(await redis.memory_usage(key, samples=0) or 0)
    return total


async def _drive(
    server: Server,
    base: str,
    admin_token: str,
    redis_url: str,
    prefix: str,
    sizes: tuple[int, ...],
    rounds: int,
    say: Progress,
) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        _, api_key = await ready_with_tenant(
            client, server, admin_token, time.perf_counter(), 600, say
        )
        auth = {"Authorization": f"Bearer {api_key}"}
        admin = {"Authorization": f"Bearer {admin_token}"}
        from app.stores.redis import RedisStore

        # the service's store lives on the server thread's loop: this one has its own
        store = RedisStore(redis_url, prefix=prefix, timeout_s=60.0)
        tenants: list[dict[str, Any]] = []
        fill_s, filled_total = 0.0, 0
        for n, size in enumerate(sizes):
            if n == 0:
                key = api_key
            else:
                r = await client.post("/admin/tenants", json={"name": f"bench-{n}"}, headers=admin)
                r.raise_for_status()
                key = str(r.json()["api_key"])
            auth = {"Authorization": f"Bearer {key}"}
            texts, ids = [], []
            for i in range(TEXTS):
                body = {
                    "prompt": f"The city council met on Tuesday to discuss item {i} of the budget,",
                    "metadata": {**SMALL_METADATA, "text": i},
                    "num_bits": NUM_BITS,
                    "max_new_tokens": NEW_TOKENS,
                    "min_new_tokens": NEW_TOKENS,
                    "seed": 1000 * n + i,
                }
                r = await client.post("/generate", json=body, headers=auth)
                r.raise_for_status()
                texts.append(r.json()["text"])
                ids.append(int(r.json()["message_id"]))
            tenant = await store.tenant_by_api_key_hash(_sha256(key))
            if tenant is None:
                raise RuntimeError("the bench tenant is not in the store")
            filled = TEXTS
            while filled < size:
                chunk = min(FILL_CHUNK, size - filled)
                start = time.perf_counter()
                await store.allocate_messages(
                    tenant.tenant_id, 1, NUM_BITS, SMALL_METADATA, time.time(), chunk
                )
                fill_s += time.perf_counter() - start
                filled += chunk
                filled_total += chunk
            memory = await _registry_bytes(store._redis, prefix, tenant.tenant_id)
            say(f"tenant {n}: {TEXTS} texts generated, registry filled to {filled} entries")
            tenants.append(
                {"texts": texts, "ids": ids, "auth": auth, "entries": filled, "bytes": memory}
            )
        say(f"measuring {rounds} interleaved rounds")
        timings = await _measure(client, tenants, admin, rounds)
        await store.close()
        rows = []
        for t, tenant in enumerate(tenants):
            row: dict[str, Any] = {"entries": tenant["entries"]}
            for route in ROUTES:
                row[route] = timings[(t, route)]
            row["bytes_per_entry"] = round(tenant["bytes"] / tenant["entries"], 1)
            rows.append(row)
        return {
            "rows": rows,
            "fill_entries_per_s": round(filled_total / fill_s, 1) if fill_s else None,
            "rounds": rounds,
        }


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


async def _cleanup(redis_url: str, prefix: str) -> int:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    deleted = 0
    try:
        batch: list[Any] = []
        async for key in client.scan_iter(match=f"{prefix}:*", count=5000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(await client.delete(*batch))
                batch = []
        if batch:
            deleted += int(await client.delete(*batch))
    finally:
        await client.aclose()
    return deleted


def run_registry_bench(
    *,
    redis_url: str,
    sizes: tuple[int, ...] = SIZES,
    rounds: int = REQUESTS,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Start the service on Redis in-process, fill and measure, clean up; a dict of figures."""
    say = progress or (lambda _msg: None)
    from pydantic import SecretStr

    from app.core.config import Environment, Role, Settings
    from app.main import create_app
    from worldcup_core.models import resolve_model_dir

    resolve_model_dir(None, None, need_model=True)
    prefix = f"wcbench-{secrets.token_hex(6)}"
    admin_token = secrets.token_urlsafe(32)
    sock = free_socket()
    port = sock.getsockname()[1]
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        env=Environment.PROD,
        role=Role.GENERATOR,
        model_path=None,
        host="127.0.0.1",
        port=port,
        redis_url=redis_url,
        redis_prefix=prefix,
        master_key=SecretStr(secrets.token_hex(32)),
        master_key_file=None,
        admin_token=SecretStr(admin_token),
        admin_token_file=None,
        log_level="WARNING",
        rate_limit_per_s=0,
        probe_budget_full=0,
        probe_budget_verdict=0,
    )
    say(f"service on 127.0.0.1:{port}, Redis key prefix {prefix}")
    app = create_app(settings)
    server = Server(app, sock)
    server.start()
    try:
        result = asyncio.run(
            _drive(
                server,
                f"http://127.0.0.1:{port}",
                admin_token,
                redis_url,
                prefix,
                sizes,
                rounds,
                say,
            )
        )
    finally:
        server.stop()
        sock.close()
        deleted = asyncio.run(_cleanup(redis_url, prefix))
        say(f"deleted {deleted} keys under {prefix}")
    base = result["rows"][0]
    for row in result["rows"]:
        for route in ROUTES:
            row[route]["ratio"] = round(row[route]["p50_ms"] / base[route]["p50_ms"], 2)
    last = result["rows"][-1]
    result["target"] = {
        "ratio": TARGET_RATIO,
        "met": all(last[r]["ratio"] <= TARGET_RATIO for r in ROUTES),
    }
    return result


def format_registry_bench(result: dict[str, Any]) -> str:
    lines = [
        "registry lookup over HTTP (Redis, one tenant, 32-bit payloads; p50 / p90 ms, "
        "ratio of p50 to the smallest registry)",
        f"{'entries':>10} | {'/decode':>24} | {'/decode/batch':>24} | {'/provenance':>24} | "
        f"{'B/entry':>8} | matched",
    ]
    for row in result["rows"]:
        cells = [
            f"{row[r]['p50_ms']:7.1f} / {row[r]['p90_ms']:6.1f} ({row[r]['ratio']:4.2f}x)"
            for r in ROUTES
        ]
        matched = sum(row[r]["matched"] for r in ROUTES)
        total = sum(row[r]["of"] for r in ROUTES)
        lines.append(
            f"{row['entries']:>10} | {cells[0]:>24} | {cells[1]:>24} | {cells[2]:>24} | "
            f"{row['bytes_per_entry']:>8} | {matched}/{total}"
        )
    lines.append(f"fill rate: {result['fill_entries_per_s']} entries/s (pipelined)")
    t = result["target"]
    lines.append(
        f"target p50 at the largest within {t['ratio']}x of the smallest: "
        f"{'met' if t['met'] else 'NOT met'}"
    )
    if "memory" in result:
        m = result["memory"]
        lines.append(
            f"bytes per entry, {m['small_metadata_bytes']} B / {m['max_metadata_bytes']} B "
            f"metadata: Redis {m['redis']['small']} / {m['redis']['max']}, "
            f"SQLite {m['sqlite']['small']} / {m['sqlite']['max']}"
        )
    if "accuracy" in result:
        lines += ["", format_accuracy(result["accuracy"])]
    return "\n".join(lines)


# --------------------------------------------------------------------------- accuracy
def list_accuracy(
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000),
    deltas: tuple[float, ...] = (0.08, 0.05, 0.035, 0.025),
    texts: int = 100,
    seed: int = 36,
) -> list[dict[str, Any]]:
    """The list path against the exhaustive match on simulated 32-bit texts (each
    payload cell ~ Binomial(n, 1/2 +- delta), n in 45..135 g-bits): how often the
    exhaustive match is confident (p < 0.01, posterior >= 0.95), and how often the list
    then misses its entry; the mean number of bit errors per text."""
    from worldcup_core.message import MessageIdCodec
    from worldcup_core.prf import WatermarkKey
    from worldcup_core.registry_lookup import (
        exhaustive_match,
        list_match,
        payload_list,
        text_cells,
        use_list,
    )

    rng = np.random.default_rng(seed)
    codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), NUM_BITS)
    rows = []
    for size in sizes:
        payloads = codec.payload_ints(np.arange(1, size + 1))
        for delta in deltas:
            confident = missed = list_wrong = errors = 0
            for _ in range(texts):
                true = int(payloads[rng.integers(size)])
                bits = (true >> np.arange(NUM_BITS - 1, -1, -1)) & 1
                trials = rng.integers(45, 136, size=NUM_BITS)
                ones = rng.binomial(trials, np.where(bits == 0, 0.5 + delta, 0.5 - delta))
                errors += int(((2 * ones < trials).astype(int) != bits).sum())
                cells = text_cells(ones.reshape(-1, 2), trials.reshape(-1, 2), NUM_BITS)
                ex = exhaustive_match(cells, payloads, size)
                plist = payload_list(cells)
                ids = codec.message_id_ints(plist.payloads)
                live = (ids >= 1) & (ids <= size)
                got = list_match(cells, plist, ids, live, np.zeros_like(live), size)
                sure = got is not None and got.match.p_value < 0.01
                sure = sure and got is not None and got.match.posterior >= 0.95
                assert ex is not None
                if sure and got is not None and got.message_id != ex.index + 1:
                    list_wrong += 1
                if ex.p_value < 0.01 and ex.posterior >= 0.95:
                    confident += 1
                    missed += got is None or got.message_id != ex.index + 1
            rows.append(
                {
                    "entries": size,
                    "delta": delta,
                    "mean_bit_errors": round(errors / texts, 2),
                    "exhaustive_confident": confident,
                    "list_missed": missed,
                    "miss_rate": round(missed / confident, 3) if confident else None,
                    "list_confident_and_wrong": list_wrong,
                    "service_uses_list": use_list(NUM_BITS, size),
                    "texts": texts,
                }
            )
    return rows


def format_accuracy(rows: list[dict[str, Any]]) -> str:
    lines = [
        "list path (4096 likeliest payloads) against the exhaustive match, simulated 32-bit texts",
        f"{'entries':>9} {'delta':>6} {'bit errs':>8} {'exh. conf':>9} {'missed':>6} "
        f"{'miss rate':>9} {'list wrong':>10} {'service':>8}",
    ]
    for r in rows:
        rate = "-" if r["miss_rate"] is None else f"{r['miss_rate']:.3f}"
        path = "list" if r["service_uses_list"] else "exh."
        lines.append(
            f"{r['entries']:>9} {r['delta']:>6} {r['mean_bit_errors']:>8} "
            f"{r['exhaustive_confident']:>5}/{r['texts']:<3} {r['list_missed']:>6} {rate:>9} "
            f"{r['list_confident_and_wrong']:>10} {path:>8}"
        )
    return "\n".join(lines)


def codec_rate(n: int = 1_000_000) -> dict[str, float]:
    """Ids/s of the vectorised codec at 32 bits, both directions (tables built first)."""
    from worldcup_core.message import MessageIdCodec
    from worldcup_core.prf import WatermarkKey

    codec = MessageIdCodec(WatermarkKey(secrets.token_bytes(32)), NUM_BITS)
    start = time.perf_counter()
    codec.payload_ints([1])
    build = time.perf_counter() - start
    ids = np.random.default_rng(0).integers(0, 2**NUM_BITS, size=n, dtype=np.uint64)
    start = time.perf_counter()
    payloads = codec.payload_ints(ids)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    back = codec.message_id_ints(payloads)
    inverse = time.perf_counter() - start
    if not np.array_equal(back, ids):
        raise RuntimeError("the codec does not invert")
    start = time.perf_counter()
    for i in ids[:2000].tolist():
        codec.payload(i)
    scalar = (time.perf_counter() - start) / 2000
    return {
        "table_build_s": round(build, 3),
        "payload_ids_per_s": round(n / forward),
        "message_id_ids_per_s": round(n / inverse),
        "scalar_us_per_id": round(1e6 * scalar, 2),
    }


# --------------------------------------------------------------------------- memory
MAX_METADATA = {"blob": "x" * 4085}  # 4 096 bytes of compact JSON, the API's limit


async def _redis_memory(redis_url: str, n: int) -> dict[str, float]:
    from app.stores.redis import RedisStore

    prefix = f"wcmem-{secrets.token_hex(6)}"
    store = RedisStore(redis_url, prefix=prefix, timeout_s=60.0)
    out = {}
    try:
        for label, meta in (("small", SMALL_METADATA), ("max", MAX_METADATA)):
            tenant = f"t{label}"
            for _ in range(n // 5000):
                await store.allocate_messages(tenant, 1, NUM_BITS, meta, time.time(), 5000)
            out[label] = round(await _registry_bytes(store._redis, prefix, tenant) / n, 1)
    finally:
        await store.close()
        await _cleanup(redis_url, prefix)
    return out


async def _sqlite_memory(n: int) -> dict[str, float]:
    import tempfile
    from pathlib import Path

    from app.stores.sqlite import SQLiteStore

    out = {}
    for label, meta in (("small", SMALL_METADATA), ("max", MAX_METADATA)):
        with tempfile.TemporaryDirectory(prefix="worldcup-mem-") as tmp:
            path = Path(tmp) / "store.sqlite3"
            store = SQLiteStore(path)
            await store.allocate_message("t0", 1, NUM_BITS, meta, time.time())
            await store.close()
            before = path.stat().st_size
            store = SQLiteStore(path)
            for _ in range(n):
                await store.allocate_message("t0", 1, NUM_BITS, meta, time.time())
            await store.close()
            out[label] = round((path.stat().st_size - before) / n, 1)
    return out


def memory_per_entry(
    redis_url: str, n_redis: int = 20_000, n_sqlite: int = 2_000
) -> dict[str, Any]:
    """Bytes per registry entry at small metadata and at the 4 096-byte maximum:
    Redis (``MEMORY USAGE`` of the registry keys, every element sampled) and SQLite (the
    file's growth, its indexes included, after a checkpoint)."""
    return {
        "redis": asyncio.run(_redis_memory(redis_url, n_redis)),
        "sqlite": asyncio.run(_sqlite_memory(n_sqlite)),
        "small_metadata_bytes": len(json.dumps(SMALL_METADATA, separators=(",", ":"))),
        "max_metadata_bytes": len(json.dumps(MAX_METADATA, separators=(",", ":"))),
        "entries": {"redis": n_redis, "sqlite": n_sqlite},
    }
