"""/detect throughput at 16 clients with probe accounting on (issue 24: accounting
must cost little). Budgets are on, as deployed, and every text is distinct (a
random draw of words from the news articles, about 1 500 characters), so every
request is fingerprinted, looked up and opens an account of its own: the
accounting's worst case. The store is Redis (``--redis``) or SQLite.

Run it once per checkout to compare, e.g. before/after, alternating:

    PYTHONPATH=. python scripts/detect_accounting_bench.py --label main
    PYTHONPATH=.          python scripts/detect_accounting_bench.py --label branch

``--budgets off`` measures the same without accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def _texts(n: int, seed: int) -> list[str]:
    from worldcup_cli.benchlib import word_salad

    return word_salad(n, seed)


def _client(
    base_url: str, api_key: str, texts: list[str], clients: int, seconds: float
) -> dict[str, Any]:
    import httpx

    async def main() -> dict[str, Any]:
        auth = {"Authorization": f"Bearer {api_key}"}
        ok = other = 0
        latencies: list[float] = []
        stop_at = time.perf_counter() + seconds
        counter = iter(range(10**9))

        async def worker() -> None:
            nonlocal ok, other
            while time.perf_counter() < stop_at:
                text = texts[next(counter) % len(texts)]
                t0 = time.perf_counter()
                r = await client.post("/detect", json={"text": text}, headers=auth)
                if r.status_code == 200:
                    ok += 1
                    latencies.append(time.perf_counter() - t0)
                else:
                    other += 1

        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(clients)))
            elapsed = time.perf_counter() - start
        latencies.sort()
        return {
            "requests_per_s": round(ok / elapsed, 1),
            "answered": ok,
            "not_200": other,
            "p50_ms": round(1e3 * latencies[len(latencies) // 2], 2) if latencies else None,
            "p99_ms": round(1e3 * latencies[int(len(latencies) * 0.99)], 2) if latencies else None,
        }

    return asyncio.run(main())


def _cpu() -> float:
    """CPU seconds of this process (the server: event loop and worker threads)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _redis_cpu(url: str | None) -> float:
    if not url:
        return 0.0
    import redis

    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _setup(base_url: str, server: Any, admin: str) -> str:
    import httpx

    from worldcup_cli.benchlib import wait_ready

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await wait_ready(client, server, timeout_s=600)
        r = await client.post(
            "/admin/tenants",
            json={"name": f"bench-{uuid.uuid4().hex[:8]}"},
            headers={"Authorization": f"Bearer {admin}"},
        )
        r.raise_for_status()
        return str(r.json()["api_key"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="run")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--budgets", choices=["on", "off"], default="on")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()

    from pydantic import SecretStr

    from app.core.config import Environment, Settings
    from app.main import create_app
    from worldcup_cli.benchlib import Server, free_socket

    texts = _texts(6000, 1)
    master, admin = secrets.token_hex(32), secrets.token_urlsafe(32)
    prefix = f"wc-bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        sock = free_socket()
        port = sock.getsockname()[1]
        off = {"probe_budget_full": 0, "probe_budget_verdict": 0}
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            env=Environment.PROD,
            model_path=args.model,
            sqlite_path=Path(tmp) / "b.sqlite3",
            redis_url=args.redis or None,
            redis_prefix=prefix,
            master_key=SecretStr(master),
            master_key_file=None,
            admin_token=SecretStr(admin),
            admin_token_file=None,
            port=port,
            log_level="WARNING",
            rate_limit_per_s=0,
            **({} if args.budgets == "on" else off),
        )
        server = Server(create_app(settings), sock)
        server.start()
        try:
            base = f"http://127.0.0.1:{port}"
            key = asyncio.run(_setup(base, server, admin))
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                pool.submit(_client, base, key, texts[:50], 2, 2.0).result()  # warm-up
                cpu0, redis0 = _cpu(), _redis_cpu(args.redis)
                result = pool.submit(_client, base, key, texts, args.clients, args.seconds).result()
                cpu1, redis1 = _cpu(), _redis_cpu(args.redis)
            # CPU seconds per answered request: steadier than requests/s on a shared machine
            answered = max(1, result["answered"])
            result["server_cpu_ms_per_request"] = round(1e3 * (cpu1 - cpu0) / answered, 3)
            result["redis_cpu_ms_per_request"] = round(1e3 * (redis1 - redis0) / answered, 3)
        finally:
            server.stop()
            sock.close()
    if args.redis:
        import redis

        r = redis.Redis.from_url(args.redis)
        keys = list(r.scan_iter(f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            r.delete(*keys[i : i + 500])
    print(  # noqa: T201 (a script's output)
        json.dumps(
            {
                "label": args.label,
                "budgets": args.budgets,
                "clients": args.clients,
                "probe_budgets": [settings.probe_budget_full, settings.probe_budget_verdict],
                **result,
            }
        )
    )


if __name__ == "__main__":
    main()
