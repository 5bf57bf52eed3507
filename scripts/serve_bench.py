"""Capacity figures for docs/scaling.md ("Serving replicas"): what one replica answers,
what each request costs Redis, what the registry costs Redis's memory, and how /decode
grows with the registry.

    PYTHONPATH=. python scripts/serve_bench.py store            # private redis-server
    PYTHONPATH=. python scripts/serve_bench.py serve --seconds 20   # Ray Serve vs uvicorn

``store`` starts its own ``redis-server`` (``--redis-port``, default 21390) so its counts
are this run's alone: Redis commands (those inside Lua scripts included) and client
round trips (each command or pipeline sent) per request, from ``INFO commandstats``
and a counter on redis-py's connection; the memory of ``--entries`` registry entries;
the latency of one /decode as the registry grows.

``serve`` measures /detect (distinct 1 500-character texts, probe budgets on) and
/generate (32 tokens) requests/s: the app under uvicorn, then on a local Ray Serve
cluster (ports from WORLDCUP_TEST_RAY_PORT_BASE) with 1 replica and with 2, side by
side in one run, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# one torch thread in every server, uvicorn's as the replicas' (their nodes set the same)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _texts(n: int, seed: int) -> list[str]:
    from worldcup_cli.benchlib import word_salad

    return word_salad(n, seed)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)  # noqa: T201 (a script's output)


# ------------------------------------------------------------------- store ---


class RedisServer:
    """A private redis-server (no persistence) on a port of our own."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="wcbench-redis")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
        )
        import redis

        self.client = redis.Redis(port=port)
        for _ in range(100):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise SystemExit(f"redis-server did not start on port {port}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cpu_s(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def command_calls(self) -> Counter[str]:
        stats = self.client.info("commandstats")
        # the counting's own INFO calls are not the service's
        return Counter(
            {
                k.removeprefix("cmdstat_"): v["calls"]
                for k, v in stats.items()
                if k != "cmdstat_info"
            }
        )

    def commands(self) -> int:
        return sum(self.command_calls().values())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class RoundTrips:
    """Counts what redis-py sends: one command, or one pipeline, is one round trip."""

    def __init__(self) -> None:
        from redis.asyncio.connection import AbstractConnection

        self.count = 0
        original = AbstractConnection.send_packed_command

        async def counted(conn: Any, command: Any, check_health: bool = True) -> None:
            self.count += 1
            await original(conn, command, check_health)

        AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


def store_bench(args: argparse.Namespace) -> None:
    import httpx
    from pydantic import SecretStr

    from app.core.config import Environment, Settings
    from app.main import create_app
    from worldcup_cli.benchlib import Server, free_socket, wait_ready

    trips = RoundTrips()
    redis_server = RedisServer(args.redis_port)
    admin = secrets.token_urlsafe(24)
    sock = free_socket()
    port = sock.getsockname()[1]
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        env=Environment.PROD,
        redis_url=redis_server.url,
        redis_prefix="wcb",
        master_key=SecretStr(secrets.token_hex(32)),
        admin_token=SecretStr(admin),
        port=port,
        log_level="WARNING",
        max_batch_size=4,
    )
    server = Server(create_app(settings), sock)
    server.start()
    texts = _texts(200, 3)
    try:
        base = f"http://127.0.0.1:{port}"

        async def run() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=600) as client:
                await wait_ready(client, server, timeout_s=600)
                r = await client.post(
                    "/admin/tenants",
                    json={"name": "bench", "scopes": ["provenance"]},
                    headers={"Authorization": f"Bearer {admin}"},
                )
                r.raise_for_status()
                auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
                await _count_requests(client, auth, texts, redis_server, trips, args.repeat)
                await _registry(client, auth, redis_server, r.json()["tenant_id"], args.entries)

        asyncio.run(run())
    finally:
        server.stop()
        sock.close()
        redis_server.stop()


async def _count_requests(
    client: Any,
    auth: dict[str, str],
    texts: list[str],
    redis_server: RedisServer,
    trips: RoundTrips,
    repeat: int,
) -> None:
    """Steady state: the tenant and key caches (WORLDCUP_CACHE_TTL_S) warm, as under load."""
    generated: list[str] = []

    async def generate(i: int) -> Any:
        body = {"prompt": f"Write about harbour {i}.", "max_new_tokens": 24, "metadata": {"i": i}}
        r = await client.post("/generate", json=body, headers=auth)
        r.raise_for_status()
        generated.append(r.json()["text"])
        return r

    chat = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    cases = {
        "/generate (metadata)": generate,
        "/decode": lambda i: client.post("/decode", json={"text": generated[i]}, headers=auth),
        "/detect": lambda i: client.post("/detect", json={"text": texts[i]}, headers=auth),
        "/provenance": lambda i: client.post(
            "/provenance", json={"text": texts[100 + i]}, headers=auth
        ),
        "/v1/chat/completions": lambda i: client.post(
            "/v1/chat/completions", json=chat, headers=auth
        ),
        "/ready": lambda i: client.get("/ready"),
    }
    for name, send in cases.items():
        await send(repeat)  # warm the caches (and, for /decode, a text to spare)
        if name == "/generate (metadata)":
            generated.clear()
        trips0, calls0, cpu0 = trips.count, redis_server.command_calls(), redis_server.cpu_s()
        for i in range(repeat):
            r = await send(i)
            assert r.status_code == 200, (name, r.status_code, r.text[:300])
        cpu = redis_server.cpu_s() - cpu0
        calls = redis_server.command_calls() - calls0
        _emit(
            {
                "request": name,
                "redis_round_trips": round((trips.count - trips0) / repeat, 2),
                "redis_commands": round(sum(calls.values()) / repeat, 2),
                "by_command": {k: round(v / repeat, 2) for k, v in calls.most_common()},
                # Redis's own CPU per request: includes its idle timer (serverCron) over
                # the request's wall time, which dominates for slow requests (/generate)
                "redis_cpu_ms": round(1e3 * cpu / repeat, 3),
                "requests": repeat,
            }
        )
        if name == "/generate (metadata)":
            generated.append((await send(repeat + 1)).json()["text"])


async def _registry(
    client: Any, auth: dict[str, str], redis_server: RedisServer, tenant_id: str, entries: int
) -> None:
    """Registry memory per entry, and one /decode's latency as the registry grows."""
    from app.stores.redis import RedisStore
    from worldcup_cli.benchlib import news_articles

    opening = " ".join(news_articles(1)[0].split()[:30])  # prose to continue: entropy
    r = await client.post(
        "/generate",
        json={
            "prompt": opening,
            "max_new_tokens": 128,
            "min_new_tokens": 128,
            "metadata": {"user": "u0"},
        },
        headers=auth,
    )
    r.raise_for_status()
    probe = r.json()
    store = RedisStore(redis_server.url, prefix="wcb", timeout_s=30)
    done = int(redis_server.client.get(f"wcb:{{{tenant_id}}}:msgseq") or 0)  # no voids
    added = 0  # bytes the allocations added (the decodes' own writes left out)
    for target in sorted({1_000, 10_000, 100_000, entries}):
        if target > entries:
            continue
        before = int(redis_server.client.info("memory")["used_memory"])
        while done < target:
            batch = min(500, target - done)
            await asyncio.gather(
                *(
                    store.allocate_message(
                        tenant_id,
                        probe["key_version"],
                        32,
                        {"user": f"u{done + k:07d}"},
                        time.time(),
                    )
                    for k in range(batch)
                )
            )
            done += batch
        added += int(redis_server.client.info("memory")["used_memory"]) - before
        latencies = []
        for _ in range(3):
            t0 = time.perf_counter()
            d = await client.post("/decode", json={"text": probe["text"]}, headers=auth)
            latencies.append(time.perf_counter() - t0)
            assert d.status_code == 200, d.text
        match = d.json()["registry_match"]
        _emit(
            {
                "registry_entries": done,
                "redis_bytes_per_entry": round(added / max(1, done - 1), 1),
                "redis_mb_per_million_entries": round(added / max(1, done - 1) * 1e6 / 2**20, 1),
                "decode_ms_median_of_3": round(1e3 * sorted(latencies)[1], 1),
                # the probe text (128 tokens) still named among this many entries?
                "decoded_to_its_entry": bool(match and match["message_id"] == probe["message_id"]),
            }
        )
    await store.close()


# ------------------------------------------------------------------- serve ---


def _load(
    base_url: str, api_key: str, texts: list[str], clients: int, seconds: float, kind: str
) -> dict[str, Any]:
    import httpx

    async def main() -> dict[str, Any]:
        auth = {"Authorization": f"Bearer {api_key}"}
        statuses: Counter[int] = Counter()
        latencies: list[float] = []
        stop_at = time.perf_counter() + seconds
        counter = iter(range(10**9))

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                i = next(counter)
                t0 = time.perf_counter()
                if kind == "detect":
                    r = await client.post(
                        "/detect", json={"text": texts[i % len(texts)]}, headers=auth
                    )
                else:
                    body = {
                        "prompt": f"Harbour {i}",
                        "max_new_tokens": 32,
                        "min_new_tokens": 32,
                        "metadata": {},
                    }
                    r = await client.post("/generate", json=body, headers=auth)
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)

        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(clients)))
            elapsed = time.perf_counter() - start
        latencies.sort()
        return {
            "requests_per_s": round(statuses[200] / elapsed, 2),
            "statuses": dict(statuses),
            "p50_ms": round(1e3 * latencies[len(latencies) // 2], 1) if latencies else None,
        }

    return asyncio.run(main())


def _tenant(base_url: str, admin: str) -> str:
    import httpx

    r = httpx.post(
        f"{base_url}/admin/tenants",
        json={"name": f"b-{uuid.uuid4().hex[:6]}"},
        headers={"Authorization": f"Bearer {admin}"},
        timeout=60,
    )
    r.raise_for_status()
    return str(r.json()["api_key"])


def serve_bench(args: argparse.Namespace) -> None:
    import ray
    from pydantic import SecretStr
    from serve_cluster import LocalRayCluster

    from app.core.config import Environment, Settings
    from app.main import create_app
    from app.serve import PROXY_CALLBACK, deploy, deployment_options, load_config, override
    from worldcup_cli.benchlib import Server, free_socket

    redis_server = RedisServer(args.redis_port)
    master, admin = secrets.token_hex(32), secrets.token_urlsafe(24)
    texts = _texts(4000, 1)
    common = {
        "WORLDCUP_CPU_WORKERS": "1",
        "WORLDCUP_MAX_BATCH_SIZE": "8",
        "WORLDCUP_RATE_LIMIT_PER_S": "0",
        "WORLDCUP_LOG_LEVEL": "WARNING",
    }
    results: list[dict[str, Any]] = []

    # the clients run in a process of their own: never in the server's interpreter
    clients_process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def measure(label: str, base: str, replicas: int) -> None:
        key = _tenant(base, admin)
        clients_process.submit(_load, base, key, texts[:20], 2, 3.0, "detect").result()  # warm
        for kind, clients in (("detect", args.clients), ("generate", 4)):
            out = clients_process.submit(
                _load, base, key, texts, clients, args.seconds, kind
            ).result()
            record = {
                "server": label,
                "replicas": replicas,
                "request": kind,
                "clients": clients,
                **out,
                "per_replica_per_s": round(out["requests_per_s"] / replicas, 2),
            }
            results.append(record)
            _emit(record)

    try:
        # the app under uvicorn, in this process (one worker process, as `worldcup serve`)
        sock = free_socket()
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            env=Environment.PROD,
            redis_url=redis_server.url,
            redis_prefix="wcu",
            master_key=SecretStr(master),
            admin_token=SecretStr(admin),
            port=sock.getsockname()[1],
            log_level="WARNING",
            cpu_workers=1,
            rate_limit_per_s=0,
        )
        server = Server(create_app(settings), sock)
        server.start()
        try:
            import httpx

            from worldcup_cli.benchlib import wait_ready

            async def ready() -> None:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.port}") as c:
                    await wait_ready(c, server, timeout_s=600)

            asyncio.run(ready())
            measure("uvicorn", f"http://127.0.0.1:{settings.port}", 1)
        finally:
            server.stop()
            sock.close()

        cluster = LocalRayCluster(
            env={
                "PYTHONPATH": str(ROOT),
                "WORLDCUP_MASTER_KEY": master,
                "WORLDCUP_ADMIN_TOKEN": admin,
                "WORLDCUP_REDIS_URL": redis_server.url,
                "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK,
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        stack = contextlib.ExitStack()
        try:
            cluster.start([2])
            stack.enter_context(cluster.driver_env())
            ray.init(address=cluster.gcs, namespace="serve", log_to_driver=False)
            for replicas in (1, 2):
                config = override(
                    load_config(),
                    cpus_per_replica=0.5,
                    engine="hf",
                    replicas=(replicas, replicas),
                    http_host="127.0.0.1",
                    http_port=cluster.http_port,
                    env={**common, "WORLDCUP_REDIS_PREFIX": "wcs"},
                )
                deployment_options(config)["max_ongoing_requests"] = 64
                deploy(config, timeout_s=900)
                measure("ray-serve", f"http://127.0.0.1:{cluster.http_port}", replicas)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            stack.close()
            cluster.stop()
    finally:
        clients_process.shutdown()
        redis_server.stop()
    load = os.getloadavg()
    _emit({"summary": results, "loadavg": [round(x, 1) for x in load]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    store = sub.add_parser("store", help="Redis commands per request; registry memory; decode")
    store.add_argument("--repeat", type=int, default=10)
    store.add_argument("--entries", type=int, default=100_000)
    store.add_argument("--redis-port", type=int, default=21390)
    serve = sub.add_parser("serve", help="requests/s: uvicorn, Serve with 1 and 2 replicas")
    serve.add_argument("--seconds", type=float, default=20.0)
    serve.add_argument("--clients", type=int, default=8)
    serve.add_argument("--redis-port", type=int, default=21390)
    args = ap.parse_args()
    store_bench(args) if args.what == "store" else serve_bench(args)


if __name__ == "__main__":
    main()
