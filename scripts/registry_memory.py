"""Memory per registry entry on Redis, measured (docs/operations.md, sizing).

Starts a private ``redis-server`` (no persistence) on PORT, writes N entries through
the store's own ``allocate_message`` (what /generate writes), and prints Redis's
``used_memory`` growth per entry, for small and for maximal (4 096-byte) metadata.

    PYTHONPATH=. .venv/bin/python scripts/registry_memory.py [N] [PORT]
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time

from redis import Redis

from app.stores.redis import RedisStore
from tests.test_store_contract import tenant_records


async def fill(url: str, prefix: str, n: int, metadata: dict[str, str]) -> float:
    store = RedisStore(url, prefix=prefix, timeout_s=30)
    tenant, key = tenant_records("mem")
    await store.create_tenant(tenant, key)
    left = n
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await store.allocate_message(tenant.tenant_id, 1, 32, metadata, time.time())

    await asyncio.gather(*(worker() for _ in range(32)))
    rate = n / (time.perf_counter() - start)
    await store.close()
    return rate


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 21210
    with tempfile.TemporaryDirectory() as tmp:
        args = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
        server = subprocess.Popen([*args, "--dir", tmp], stdout=subprocess.DEVNULL)
        try:
            client = Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except Exception:
                    time.sleep(0.05)
            url = f"redis://127.0.0.1:{port}/0"
            out = sys.stdout.write
            out("| metadata | entries | bytes per entry | per 10^6 texts | entries/s |\n")
            out("|---|---:|---:|---:|---:|\n")
            for label, meta, count in [
                ('small (`{"user": "u-123456"}`)', {"user": "u-123456"}, n),
                ("4 096 bytes", {"blob": "x" * 4082}, max(1, n // 10)),
            ]:
                client.flushall()
                before = int(client.info("memory")["used_memory"])
                rate = asyncio.run(fill(url, "mem", count, meta))
                per = (int(client.info("memory")["used_memory"]) - before) / count
                gib = per * 1e6 / 2**30
                out(f"| {label} | {count} | {per:.0f} | {gib:.2f} GiB | {rate:.0f} |\n")
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
