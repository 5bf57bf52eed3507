"""``worldcup bench service``: the HTTP service measured end to end, over loopback.

The real app (``create_app``) with the embedded model, a SQLite store in a
temporary directory and freshly generated secrets runs under uvicorn in a
thread of this process, on a free loopback port; ``httpx.AsyncClient`` is
the load. Measured:

1. cold start: from creating the app to the first ``/ready`` 200, with the
   model weights already converted and cached (the Python imports are timed
   separately: they happen once per process, before the server exists);
2. generation: aggregate generated tokens/s with 1, 4 and 8 concurrent
   ``/generate`` requests (``max_new_tokens = min_new_tokens = 64``, an
   explicit 16-bit payload each, distinct prompts), and 8 requests sent one
   after another against the same 8 sent at once; every generated text is
   sent back to ``/decode`` and must give back its own payload;
3. detection: ``/detect`` requests/s and latency percentiles for 256-token
   texts from 16 and from 200 concurrent clients for about ten seconds each
   (plus the latency of one client alone, for scale);
4. probes under bulk load: ``/health`` and ``/ready`` latency (p50, p99, max)
   from their own process while other clients keep ``/decode/batch`` busy at
   full rate (three clients with 100 texts of ~256 tokens per batch, one with
   30 texts of 100 000 characters), and how many bulk requests were shed.

5. fair shares: another tenant's ``/detect`` latency (one closed-loop client,
   ~256-token texts) while one tenant saturates ``/decode/batch`` (six clients,
   batches of 100 000-character texts), and ``/detect`` throughput at 16
   clients, each under the first-come-first-served pool as it was before fair
   shares (``_FirstComeFirstServed``, swapped in on the same server) and under
   the fair pool, interleaved (latency: FCFS, fair, FCFS, fair; req/s in ABBA
   pairs) so a load that comes and goes on a shared machine hits both; compare
   them as ratios.
   ``--fairness-only`` runs just this part.

Rate limits and probe budgets are off here: the benchmark measures capacity,
and it sends the same texts again and again.

The generation load runs in the main thread: next to a forward pass its cost
is noise. The detection load runs in a child process: a request there costs
a few milliseconds of Python, and a client sharing the server's GIL would
roughly halve the figures (measured: 195 against 365 requests/s).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import platform
import secrets
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from worldcup_cli.benchlib import (
    FALLBACK_PROMPTS,
    NEW_TOKENS,
    PAYLOAD_BITS,
    Load,
    Progress,
    Server,
    free_socket,
    news_articles,
    news_prompts,
    percentile,
    ready_with_tenant,
    wave_stats,
)

CONCURRENCY_LEVELS = (1, 4, 8)
SEQUENTIAL_N = 8
DETECT_CLIENTS = 16
DETECT_CLIENTS_MANY = 200
BULK_SMALL_CLIENTS = 3
BULK_SMALL_TEXTS = 100
BULK_BIG_TEXTS = 30
BULK_BIG_CHARS = 100_000
PROBE_INTERVAL_S = 0.02
TARGET_PROBE_P99_MS = 100.0
DETECT_TOKENS = 256
DETECT_SECONDS = 10.0
TARGET_SPEEDUP = 3.0  # N concurrent against N sequential, N = 8
TARGET_DETECT_P50_MS = 10.0
TARGET_DETECT_RPS = 300.0
FAIR_BULK_CLIENTS = 6  # one tenant's /decode/batch clients
FAIR_BULK_TEXTS = 20
FAIR_BULK_CHARS = 100_000
FAIR_ROUNDS = 2  # FCFS then fair, this many times
RATE_ROUNDS = 3  # /detect req/s: FCFS, fair, fair, FCFS, ... (ABBA), this many pairs
TARGET_FAIR_P99_MS = 1000.0  # another tenant's /detect p99 under the bulk load
TARGET_FAIR_P99_RATIO = 0.2  # the same, fair against FCFS (holds on a shared machine)
TARGET_FAIR_RPS_RATIO = 0.9  # /detect req/s at 16 clients, fair against FCFS


def _detect_texts(tokenizer: Any, articles: Sequence[str], n: int) -> list[str]:
    """Texts of about DETECT_TOKENS tokens (human news text: the cost does not depend on it)."""
    texts = []
    for article in articles:
        ids = tokenizer(article, add_special_tokens=False).input_ids
        if len(ids) >= DETECT_TOKENS:
            texts.append(tokenizer.decode(ids[:DETECT_TOKENS]))
        if len(texts) >= n:
            break
    if not texts:
        base = " ".join(FALLBACK_PROMPTS)
        while len(tokenizer(base, add_special_tokens=False).input_ids) < DETECT_TOKENS:
            base += " " + base
        ids = tokenizer(base, add_special_tokens=False).input_ids
        texts = [tokenizer.decode(ids[i : i + DETECT_TOKENS]) for i in range(0, 8)]
    return texts


async def _bench_detect(
    client: Any, api_key: str, texts: list[str], clients: int, seconds: float
) -> dict[str, Any]:
    """Closed-loop clients. A shed request (503/429) waits its Retry-After, as a
    well-behaved client does; latency percentiles are over answered requests."""
    auth = {"Authorization": f"Bearer {api_key}"}
    latencies: list[float] = []
    errors = shed = 0
    stop_at = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal errors, shed
        i = offset
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            r = await client.post("/detect", json={"text": texts[i % len(texts)]}, headers=auth)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - start)
            elif r.status_code in (429, 503):
                shed += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
            else:
                errors += 1
            i += clients

    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(clients)))
    elapsed = time.perf_counter() - start
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": len(latencies),
        "errors": errors,
        "shed": shed,
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1e3 * percentile(latencies, 50), 2),
        "p90_ms": round(1e3 * percentile(latencies, 90), 2),
        "p99_ms": round(1e3 * percentile(latencies, 99), 2),
        "max_ms": round(1e3 * max(latencies, default=float("nan")), 2),
    }


def _detect_client(
    base_url: str, api_key: str, texts: list[str], seconds: float
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Runs in the child process: one client alone, then 16, then 200 at once."""
    import httpx

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        n = DETECT_CLIENTS_MANY + 8
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
            single = await _bench_detect(client, api_key, texts, 1, min(2.0, seconds))
            loaded = await _bench_detect(client, api_key, texts, DETECT_CLIENTS, seconds)
            many = await _bench_detect(client, api_key, texts, DETECT_CLIENTS_MANY, seconds)
        return single, loaded, many

    return asyncio.run(main())


def _detect_in_child(
    base_url: str, api_key: str, texts: list[str], seconds: float
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running torch threads
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_detect_client, base_url, api_key, texts, seconds).result()


def _bulk_client(base_url: str, api_key: str, texts: list[str], seconds: float) -> dict[str, Any]:
    """Child process: keep /decode/batch busy for ``seconds`` (small and huge batches)."""
    import httpx

    auth = {"Authorization": f"Bearer {api_key}"}
    small = [texts[i % len(texts)] for i in range(BULK_SMALL_TEXTS)]
    big_text = (" ".join(texts) * (BULK_BIG_CHARS // max(1, len(" ".join(texts))) + 1))[
        :BULK_BIG_CHARS
    ]
    big = [big_text] * BULK_BIG_TEXTS
    counts: dict[str, int] = {"ok": 0, "shed": 0, "other": 0, "texts": 0}

    async def main() -> None:
        stop_at = time.perf_counter() + seconds

        async def worker(batch: list[str]) -> None:
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
                while time.perf_counter() < stop_at:
                    r = await client.post("/decode/batch", json={"texts": batch}, headers=auth)
                    if r.status_code == 200:
                        counts["ok"] += 1
                        counts["texts"] += len(batch)
                    elif r.status_code in (429, 503):
                        counts["shed"] += 1
                        await asyncio.sleep(float(r.headers.get("Retry-After", "1")) / 10)
                    else:
                        counts["other"] += 1

        await asyncio.gather(*(worker(small) for _ in range(BULK_SMALL_CLIENTS)), worker(big))

    start = time.perf_counter()
    asyncio.run(main())
    elapsed = time.perf_counter() - start
    return {
        "seconds": round(elapsed, 2),
        "batches_ok": counts["ok"],
        "batches_shed": counts["shed"],
        "batches_failed": counts["other"],
        "texts_per_s": round(counts["texts"] / elapsed, 1),
        "big_batch_mb": round(BULK_BIG_TEXTS * BULK_BIG_CHARS / 1e6, 1),
    }


def _probe_client(base_url: str, seconds: float, delay_s: float) -> dict[str, Any]:
    """Child process: /health and /ready every PROBE_INTERVAL_S while the bulk load runs."""
    import httpx

    async def main() -> dict[str, Any]:
        out: dict[str, list[float]] = {"/health": [], "/ready": []}
        failures = 0
        await asyncio.sleep(delay_s)  # let the bulk load get going
        stop_at = time.perf_counter() + seconds
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            while time.perf_counter() < stop_at:
                for path, samples in out.items():
                    start = time.perf_counter()
                    r = await client.get(path)
                    samples.append(time.perf_counter() - start)
                    failures += r.status_code != 200
                await asyncio.sleep(PROBE_INTERVAL_S)
        result: dict[str, Any] = {"failures": failures}
        for path, samples in out.items():
            result[path] = {
                "samples": len(samples),
                "p50_ms": round(1e3 * percentile(samples, 50), 2),
                "p99_ms": round(1e3 * percentile(samples, 99), 2),
                "max_ms": round(1e3 * max(samples), 2),
            }
        return result

    return asyncio.run(main())


def _probes_under_bulk_load(
    base_url: str, api_key: str, texts: list[str], seconds: float
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        bulk = pool.submit(_bulk_client, base_url, api_key, texts, seconds + 2.0)
        probes = pool.submit(_probe_client, base_url, seconds, 1.0)
        return {"probes": probes.result(), "bulk": bulk.result()}


async def _drive(
    server: Server,
    app: Any,
    base_url: str,
    admin_token: str,
    t_start: float,
    tokenizer: Any,
    detect_seconds: float,
    progress: Progress,
    rate_pairs: int = RATE_ROUNDS,
    bulk_chars: int = FAIR_BULK_CHARS,
    fairness_only: bool = False,
) -> dict[str, Any]:
    """Every part in turn; with ``fairness_only`` (``--fairness-only``) part 5 alone."""
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        cold_start, api_key = await ready_with_tenant(
            client, server, admin_token, t_start, 600, progress
        )
        version = (await client.get("/version")).json()
        if fairness_only:
            texts = _detect_texts(tokenizer, news_articles(64), 64)
            fs = await _fair_shares(
                client, app.state.runtime, base_url, admin_token, api_key, texts,
                detect_seconds, FAIR_ROUNDS, progress, rate_pairs, bulk_chars,
            )  # fmt: skip
            return {
                "model": version.get("model_id"),
                "cold_start_seconds": round(cold_start, 3),
                "fair_shares": fs,
                "targets": _fair_targets(fs),
            }

        articles = news_articles(64)
        total_requests = sum(CONCURRENCY_LEVELS) + 2 * SEQUENTIAL_N + 1
        load = Load(client, api_key, news_prompts(articles, total_requests))
        await load.generate()  # first real request: allocator and caches warm

        levels = []
        for c in CONCURRENCY_LEVELS:
            progress(f"generate: {c} concurrent x {NEW_TOKENS} tokens")
            seconds, results = await load.wave(c, concurrent=True)
            levels.append(wave_stats(c, seconds, results))
        progress(f"generate: {SEQUENTIAL_N} sequential, then {SEQUENTIAL_N} concurrent")
        seq_s, seq_results = await load.wave(SEQUENTIAL_N, concurrent=False)
        conc_s, conc_results = await load.wave(SEQUENTIAL_N, concurrent=True)

        progress(f"decode: {len(load.generated)} generated texts")
        exact, bits_right, flagged, decode_p = 0, 0, 0, []
        for bits, text in load.generated:
            d = await client.post(
                "/decode", json={"text": text, "num_bits": PAYLOAD_BITS}, headers=load.auth
            )
            d.raise_for_status()
            got = d.json()
            exact += got["bits"] == bits
            flagged += got["is_watermarked"]
            bits_right += sum(a == b for a, b in zip(got["bits"], bits, strict=True))
            decode_p.append(got["p_value"])

        texts = _detect_texts(tokenizer, articles, 64)
        token_counts = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
        progress(f"detect: {DETECT_CLIENTS} clients for {detect_seconds:.0f} s")
        single, loaded, many = await asyncio.to_thread(
            _detect_in_child, base_url, api_key, texts, detect_seconds
        )
        loaded["text_tokens_median"] = int(statistics.median(token_counts))
        loaded["single_client_p50_ms"] = single["p50_ms"]
        loaded["single_client_requests_per_s"] = single["requests_per_s"]
        loaded["many_clients"] = many
        progress(f"/health and /ready under bulk /decode/batch load for {detect_seconds:.0f} s")
        bulk = await asyncio.to_thread(
            _probes_under_bulk_load, base_url, api_key, texts, detect_seconds
        )
        fs = await _fair_shares(
            client, app.state.runtime, base_url, admin_token, api_key, texts,
            detect_seconds, FAIR_ROUNDS, progress, rate_pairs, bulk_chars,
        )  # fmt: skip
        metrics = (await client.get("/metrics")).text

    n = len(load.generated)
    speedup = seq_s / conc_s
    return {
        "model": version.get("model_id"),
        "cold_start_seconds": round(cold_start, 3),
        "generation": {
            "new_tokens": NEW_TOKENS,
            "payload_bits": PAYLOAD_BITS,
            "levels": levels,
            "sequential_vs_concurrent": {
                "n": SEQUENTIAL_N,
                "sequential_seconds": round(seq_s, 3),
                "concurrent_seconds": round(conc_s, 3),
                "speedup": round(speedup, 2),
                "sequential_tokens_per_s": wave_stats(1, seq_s, seq_results)["tokens_per_s"],
                "concurrent_tokens_per_s": wave_stats(SEQUENTIAL_N, conc_s, conc_results)[
                    "tokens_per_s"
                ],
            },
            "decoded": {
                "texts": n,
                "exact_payload": exact,
                "flagged_watermarked": flagged,
                "bit_accuracy": round(bits_right / (n * PAYLOAD_BITS), 4),
                "max_p_value": max(decode_p),
                "median_p_value": statistics.median(decode_p),
            },
        },
        "detection": loaded,
        "probes_under_bulk_load": bulk,
        "fair_shares": fs,
        "server_generated_tokens_total": _metric(metrics, "worldcup_generated_tokens_total"),
        "targets": {
            "speedup_8_concurrent": {
                "measured": round(speedup, 2),
                "target": f">= {TARGET_SPEEDUP}",
                "passed": speedup >= TARGET_SPEEDUP,
            },
            "detect_p50_ms": {
                "measured": loaded["p50_ms"],
                "target": f"<= {TARGET_DETECT_P50_MS}",
                "passed": loaded["p50_ms"] <= TARGET_DETECT_P50_MS,
            },
            "detect_rps": {
                "measured": loaded["requests_per_s"],
                "target": f">= {TARGET_DETECT_RPS}",
                "passed": loaded["requests_per_s"] >= TARGET_DETECT_RPS,
            },
            "health_p99_ms_under_bulk_load": {
                "measured": bulk["probes"]["/health"]["p99_ms"],
                "target": f"<= {TARGET_PROBE_P99_MS:g}",
                "passed": bulk["probes"]["/health"]["p99_ms"] <= TARGET_PROBE_P99_MS,
            },
            "every_payload_decoded": {
                "measured": f"{exact}/{n}",
                "target": f"{n}/{n}",
                "passed": exact == n,
            },
            **_fair_targets(fs),
        },
    }


class _FirstComeFirstServed:
    """The CPU pool as it was before fair shares, for the side-by-side "before": one
    ``ThreadPoolExecutor`` queue in arrival order, a batch as one job, the global
    bound only. Swapped into the running app between phases."""

    def __init__(self, workers: int, max_pending: int, retry_after_s: int = 1) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.workers = workers
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="bench-fcfs")
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Any, *args: object, share: str | None = None) -> Any:
        from app.services.cpu import Overloaded

        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(self.retry_after_s)
            self._pending += 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())
        return await asyncio.wrap_future(future)

    async def map(
        self, fn: Any, items: Sequence[Any], weight: Any = None, share: Any = None
    ) -> Any:
        return await self.run(fn, list(items))

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


async def _pool_round_trips(workers: int, rounds: int = 10, n: int = 2000) -> dict[str, float]:
    """The pools' own cost, apart from HTTP and the machine's load: the median round
    trip of an empty job through a fresh FCFS pool and a fresh fair pool, alternated
    ``rounds`` times, ``n`` jobs each (medians of the per-round medians, in µs)."""
    from app.services.cpu import CpuPool

    def nothing() -> None:
        return None

    async def median_us(pool: Any) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            await pool.run(nothing)
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times)

    fair, fcfs = CpuPool(workers, 64), _FirstComeFirstServed(workers, 64)
    out: dict[str, list[float]] = {"fcfs": [], "fair": []}
    try:
        for _ in range(rounds):
            out["fcfs"].append(await median_us(fcfs))
            out["fair"].append(await median_us(fair))
    finally:
        fair.close()
        fcfs.close()
    return {k: round(statistics.median(v), 1) for k, v in out.items()}


def _use_pool(runtime: Any, pool: Any) -> None:
    """Make ``pool`` the app's CPU pool (between phases, with nothing in flight)."""
    runtime.cpu = pool
    runtime.watermark.cpu = pool


async def _idle(runtime: Any) -> None:
    """Wait until the app's pool has nothing admitted (a phase's last bulk requests)."""
    while runtime.cpu.pending:
        await asyncio.sleep(0.05)


def _detect_rate_client(
    base_url: str, api_key: str, texts: list[str], seconds: float
) -> dict[str, Any]:
    """Child process: /detect with DETECT_CLIENTS closed-loop clients."""
    import httpx

    async def main() -> dict[str, Any]:
        n = DETECT_CLIENTS + 4
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
            await _bench_detect(client, api_key, texts, 2, 0.5)  # connections warm
            return await _bench_detect(client, api_key, texts, DETECT_CLIENTS, seconds)

    return asyncio.run(main())


def _fair_bulk_client(
    base_url: str, api_key: str, texts: list[str], seconds: float, chars: int = FAIR_BULK_CHARS
) -> dict[str, Any]:
    """Child process: FAIR_BULK_CLIENTS clients keep /decode/batch of big texts busy."""
    import httpx

    auth = {"Authorization": f"Bearer {api_key}"}
    joined = " ".join(texts)
    big = (joined * (chars // max(1, len(joined)) + 1))[:chars]
    counts = {"ok": 0, "shed": 0, "other": 0}

    async def main() -> None:
        stop_at = time.perf_counter() + seconds

        async def worker(k: int) -> None:
            # distinct texts per client: nothing is cached, every batch is fresh work
            batch = [f"{k}-{i} {big}"[:chars] for i in range(FAIR_BULK_TEXTS)]
            async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
                while time.perf_counter() < stop_at:
                    r = await client.post("/decode/batch", json={"texts": batch}, headers=auth)
                    key = (
                        "ok"
                        if r.status_code == 200
                        else "shed"
                        if r.status_code == 503
                        else "other"
                    )
                    counts[key] += 1
                    if key == "shed":
                        await asyncio.sleep(float(r.headers.get("Retry-After", "1")) / 10)

        await asyncio.gather(*(worker(k) for k in range(FAIR_BULK_CLIENTS)))

    asyncio.run(main())
    return {"batches_ok": counts["ok"], "batches_shed": counts["shed"], "failed": counts["other"]}


def _other_tenant_client(
    base_url: str, api_key: str, texts: list[str], seconds: float, delay_s: float
) -> dict[str, Any]:
    """Child process: one closed-loop /detect client of another tenant."""
    import httpx

    async def main() -> dict[str, Any]:
        await asyncio.sleep(delay_s)  # the bulk load is under way
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            return await _bench_detect(client, api_key, texts, 1, seconds)

    return asyncio.run(main())


def _fairness_phase(
    base_url: str,
    bulk_key: str,
    other_key: str,
    texts: list[str],
    seconds: float,
    chars: int = FAIR_BULK_CHARS,
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        bulk = pool.submit(_fair_bulk_client, base_url, bulk_key, texts, seconds + 2.0, chars)
        other = pool.submit(_other_tenant_client, base_url, other_key, texts, seconds, 2.0)
        return {"other_tenant_detect": other.result(), "bulk": bulk.result()}


def _detect_rate_in_child(
    base_url: str, api_key: str, texts: list[str], seconds: float
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_detect_rate_client, base_url, api_key, texts, seconds).result()


async def _fair_shares(
    client: Any,
    runtime: Any,
    base_url: str,
    admin_token: str,
    bulk_key: str,
    texts: list[str],
    seconds: float,
    rounds: int,
    progress: Progress,
    rate_pairs: int = RATE_ROUNDS,
    bulk_chars: int = FAIR_BULK_CHARS,
) -> dict[str, Any]:
    """FCFS and fair pools interleaved on one server: the other tenant's /detect
    latency under one tenant's bulk load, and /detect req/s at 16 clients."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    r = await client.post("/admin/tenants", json={"name": "bench-other"}, headers=admin)
    r.raise_for_status()
    other_key = str(r.json()["api_key"])
    fair = runtime.cpu
    fcfs = _FirstComeFirstServed(fair.workers, fair.max_pending, fair.retry_after_s)
    phases: dict[str, list[dict[str, Any]]] = {"fcfs": [], "fair": []}
    rates: dict[str, list[dict[str, Any]]] = {"fcfs": [], "fair": []}
    pools = {"fcfs": fcfs, "fair": fair}
    # warm up first (the decoder's compiled loops, caches): else the first FCFS
    # phase pays it and the comparison flatters the fair pool
    auth = {"Authorization": f"Bearer {bulk_key}"}
    warm = await client.post("/decode/batch", json={"texts": texts[:4]}, headers=auth)
    warm.raise_for_status()
    progress("fair shares: the pools' own round trip, in this process")
    round_trip = await _pool_round_trips(fair.workers)
    try:
        for k in range(rate_pairs):
            for mode in ("fcfs", "fair") if k % 2 == 0 else ("fair", "fcfs"):
                await _idle(runtime)
                _use_pool(runtime, pools[mode])
                progress(f"fair shares, /detect at 16 clients, pair {k + 1}/{rate_pairs}: {mode}")
                rates[mode].append(
                    await asyncio.to_thread(
                        _detect_rate_in_child, base_url, other_key, texts, seconds / 2
                    )
                )
        for k in range(rounds):
            for mode, pool in (("fcfs", fcfs), ("fair", fair)):
                await _idle(runtime)
                _use_pool(runtime, pool)
                progress(
                    f"fair shares, round {k + 1}/{rounds}, {mode}: another tenant's /detect "
                    f"under {FAIR_BULK_CLIENTS} /decode/batch clients"
                )
                load = await asyncio.to_thread(
                    _fairness_phase, base_url, bulk_key, other_key, texts, seconds, bulk_chars
                )
                phases[mode].append(load)
    finally:
        await _idle(runtime)
        _use_pool(runtime, fair)
        fcfs.close()

    def summary(runs: list[dict[str, Any]], rate: list[dict[str, Any]]) -> dict[str, Any]:
        lat = [r["other_tenant_detect"] for r in runs]
        return {
            "other_detect_p50_ms": round(statistics.median(x["p50_ms"] for x in lat), 1),
            "other_detect_p99_ms": round(max(x["p99_ms"] for x in lat), 1),
            "other_detect_max_ms": round(max(x["max_ms"] for x in lat), 1),
            "other_detect_answered": sum(x["requests"] for x in lat),
            "bulk_batches_ok": sum(r["bulk"]["batches_ok"] for r in runs),
            "bulk_batches_shed": sum(r["bulk"]["batches_shed"] for r in runs),
            "detect_rps_16": [r["requests_per_s"] for r in rate],
            "detect_rps_16_mean": round(statistics.mean(r["requests_per_s"] for r in rate), 1),
            "detect_p99_ms_16": max(r["p99_ms"] for r in rate),
        }

    before, after = summary(phases["fcfs"], rates["fcfs"]), summary(phases["fair"], rates["fair"])
    ratio = after["detect_rps_16_mean"] / max(before["detect_rps_16_mean"], 1e-9)
    pair_ratios = [
        a["requests_per_s"] / max(b["requests_per_s"], 1e-9)
        for a, b in zip(rates["fair"], rates["fcfs"], strict=True)
    ]
    return {
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "bulk": f"{FAIR_BULK_CLIENTS} clients x /decode/batch of {FAIR_BULK_TEXTS} texts x "
        f"{bulk_chars} chars (one tenant)",
        # the fallback (no news data: WORLDCUP_DATA_DIR) repeats a few prompts, and a
        # repetitive text decodes far faster than human text of the same length
        "texts": "news" if news_articles(1) else "fallback prompts (repetitive)",
        "chunk_chars": getattr(fair, "chunk_chars", None),
        "workers": fair.workers,
        "fcfs": before,
        "fair": after,
        "detect_rps_ratio_fair_over_fcfs": round(ratio, 3),
        "detect_rps_pair_ratios": [round(r, 3) for r in pair_ratios],
        "detect_rps_pair_ratio_median": round(statistics.median(pair_ratios), 3),
        "rate_pairs": rate_pairs,
        "empty_job_round_trip_us": round_trip,
        "phases": phases,
        "detect_16_clients": rates,
    }


def format_fair_shares(fs: dict[str, Any]) -> list[str]:
    b, a = fs["fcfs"], fs["fair"]
    lines = [
        f"fair shares ({fs['workers']} workers, chunks of {fs['chunk_chars']} chars; "
        f"{fs['rounds']} rounds of FCFS then fair, {fs['seconds_per_phase']:.0f} s each; "
        f"/detect req/s in {fs.get('rate_pairs', RATE_ROUNDS)} ABBA pairs of "
        f"{fs['seconds_per_phase'] / 2:.0f} s)",
        f"  load: {fs['bulk']}; another tenant: 1 closed-loop /detect client; "
        f"texts: {fs.get('texts', '?')}",
        f"  {'pool':<6} {'other p50':>10} {'other p99':>10} {'other max':>10} {'answered':>9} "
        f"{'bulk ok':>8} {'shed':>5} {'/detect req/s @16 (per round)':>30}",
    ]
    for name, m in (("FCFS", b), ("fair", a)):
        rates = ", ".join(f"{x:.0f}" for x in m["detect_rps_16"])
        lines.append(
            f"  {name:<6} {m['other_detect_p50_ms']:>8.0f}ms {m['other_detect_p99_ms']:>8.0f}ms "
            f"{m['other_detect_max_ms']:>8.0f}ms {m['other_detect_answered']:>9} "
            f"{m['bulk_batches_ok']:>8} {m['bulk_batches_shed']:>5} "
            f"{m['detect_rps_16_mean']:>10.1f} ({rates})"
        )
    lines.append(
        f"  /detect req/s at 16 clients, fair / FCFS: {fs['detect_rps_ratio_fair_over_fcfs']:.3f} "
        "(same server, phases interleaved: compare ratios on a shared machine)"
    )
    if "empty_job_round_trip_us" in fs:
        rt = fs["empty_job_round_trip_us"]
        lines.append(
            f"  the pools' own cost: an empty job's round trip {rt['fcfs']:.1f} us FCFS, "
            f"{rt['fair']:.1f} us fair (median, in-process, no HTTP)"
        )
    if "detect_rps_pair_ratio_median" in fs:
        pairs = ", ".join(f"{r:.2f}" for r in fs["detect_rps_pair_ratios"])
        lines.append(f"  per ABBA pair: {pairs}; median {fs['detect_rps_pair_ratio_median']:.3f}")
    return lines


def _fair_targets(fs: dict[str, Any]) -> dict[str, Any]:
    p99 = fs["fair"]["other_detect_p99_ms"]
    p99_ratio = round(p99 / max(fs["fcfs"]["other_detect_p99_ms"], 1e-9), 3)
    ratio = fs["detect_rps_ratio_fair_over_fcfs"]
    return {
        "other_tenant_p99_fair_over_fcfs": {
            "measured": p99_ratio,
            "target": f"<= {TARGET_FAIR_P99_RATIO}",
            "passed": p99_ratio <= TARGET_FAIR_P99_RATIO,
        },
        "other_tenant_detect_p99_ms_under_bulk": {
            "measured": p99,
            "target": f"<= {TARGET_FAIR_P99_MS:g}",
            "passed": p99 <= TARGET_FAIR_P99_MS,
        },
        "detect_rps_fair_over_fcfs": {
            "measured": ratio,
            "target": f">= {TARGET_FAIR_RPS_RATIO}",
            "passed": ratio >= TARGET_FAIR_RPS_RATIO,
        },
    }


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def run_service_bench(
    *,
    device: str = "cpu",
    detect_seconds: float = DETECT_SECONDS,
    fairness_only: bool = False,
    rate_pairs: int = RATE_ROUNDS,
    bulk_chars: int = FAIR_BULK_CHARS,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Start the service in-process, load it over loopback HTTP, stop it; a dict of figures."""
    say = progress or (lambda _msg: None)
    t_imports = time.perf_counter()
    import torch
    from pydantic import SecretStr

    from app.core.config import Environment, Role, Settings
    from app.main import create_app
    from worldcup_core.models import load_tokenizer, resolve_model_dir

    imports_s = time.perf_counter() - t_imports

    say("caching the embedded model weights (converted once)")
    resolve_model_dir(None, None, need_model=True)
    tokenizer = load_tokenizer()

    with tempfile.TemporaryDirectory(prefix="worldcup-bench-") as tmp:
        admin_token = secrets.token_urlsafe(32)
        sock = free_socket()
        port = sock.getsockname()[1]
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            env=Environment.PROD,
            role=Role.DETECTOR if fairness_only else Role.GENERATOR,  # no model needed
            model_path=None,
            device=device,
            host="127.0.0.1",
            port=port,
            sqlite_path=Path(tmp) / "bench.sqlite3",
            redis_url=None,
            master_key=SecretStr(secrets.token_hex(32)),
            master_key_file=None,
            admin_token=SecretStr(admin_token),
            admin_token_file=None,
            log_level="WARNING",
            rate_limit_per_s=0,  # capacity, not the per-tenant budget
            probe_budget_full=0,  # the detect load repeats its 64 texts
            probe_budget_verdict=0,
            # the load's chosen payloads carried as chosen: decoded bits are compared with them
            seal_client_payloads=False,
        )
        say(f"starting the service on 127.0.0.1:{port} ({device})")
        t_start = time.perf_counter()
        app = create_app(settings)
        server = Server(app, sock)
        server.start()
        try:
            result = asyncio.run(
                _drive(
                    server,
                    app,
                    f"http://127.0.0.1:{port}",
                    admin_token,
                    t_start,
                    tokenizer,
                    detect_seconds,
                    say,
                    rate_pairs,
                    bulk_chars,
                    fairness_only,
                )
            )
        finally:
            server.stop()
            sock.close()
    result["environment"] = {
        "device": device,
        "python_imports_seconds": round(imports_s, 3),
        "max_batch_size": settings.max_batch_size,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "detect_client": "child process",
    }
    return result


def format_service_bench(result: dict[str, Any]) -> str:
    """A plain-text report of :func:`run_service_bench`'s dict."""
    if "generation" not in result:  # --fairness-only
        env = result["environment"]
        lines = [
            f"model   {result['model']} on {env['device']}; {env['cpu_count']} CPUs, "
            f"python {env['python']}",
            "",
            *format_fair_shares(result["fair_shares"]),
            "",
            *_format_targets(result["targets"]),
        ]
        return "\n".join(lines)
    env, gen, det = result["environment"], result["generation"], result["detection"]
    many, bulk = det["many_clients"], result["probes_under_bulk_load"]
    svc = gen["sequential_vs_concurrent"]
    dec = gen["decoded"]
    lines = [
        f"model   {result['model']} on {env['device']} (max batch {env['max_batch_size']})",
        f"system  torch {env['torch']}, {env['torch_threads']} torch threads, "
        f"{env['cpu_count']} CPUs, python {env['python']}",
        "",
        f"cold start (app created -> /ready 200, weights cached)  "
        f"{result['cold_start_seconds']:.2f} s   "
        f"(python imports before it: {env['python_imports_seconds']:.2f} s)",
        "",
        f"generation (/generate, {gen['new_tokens']} new tokens, "
        f"{gen['payload_bits']}-bit payloads)",
        f"  {'concurrent':>10} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} "
        f"{'ttft p50':>9} {'tok/s/seq':>10}",
    ]
    for lv in gen["levels"]:
        ttft = f"{1e3 * lv['ttft_median_s']:.0f} ms" if lv["ttft_median_s"] is not None else "-"
        lines.append(
            f"  {lv['concurrency']:>10} {lv['requests']:>8} {lv['tokens']:>7} "
            f"{lv['seconds']:>8.2f} {lv['tokens_per_s']:>8.1f} {ttft:>9} "
            f"{lv['per_sequence_tokens_per_s'] or 0:>10.1f}"
        )
    lines += [
        f"  {svc['n']} sequential {svc['sequential_seconds']:.2f} s "
        f"({svc['sequential_tokens_per_s']:.1f} tok/s) vs {svc['n']} concurrent "
        f"{svc['concurrent_seconds']:.2f} s ({svc['concurrent_tokens_per_s']:.1f} tok/s): "
        f"speed-up {svc['speedup']:.2f}x",
        f"  /decode of every response: {dec['exact_payload']}/{dec['texts']} exact payloads, "
        f"{dec['flagged_watermarked']}/{dec['texts']} verdict watermarked (p < 1e-6),",
        f"  bit accuracy {100 * dec['bit_accuracy']:.1f}%, "
        f"p-value median {dec['median_p_value']:.2g} max {dec['max_p_value']:.2g}",
        "",
        f"detection (/detect, ~{det['text_tokens_median']}-token texts, {det['clients']} clients, "
        f"{det['seconds']:.1f} s)",
        f"  {det['requests']} requests ({det['errors']} errors)  "
        f"{det['requests_per_s']:.1f} req/s  p50 {det['p50_ms']:.2f} ms  "
        f"p90 {det['p90_ms']:.2f} ms  p99 {det['p99_ms']:.2f} ms",
        f"  one client alone: p50 {det['single_client_p50_ms']:.2f} ms, "
        f"{det['single_client_requests_per_s']:.1f} req/s",
        f"  {many['clients']} clients: {many['requests']} answered, {many['shed']} shed "
        f"(503/429, Retry-After honoured), {many['errors']} errors  "
        f"{many['requests_per_s']:.1f} req/s  p50 {many['p50_ms']:.2f} ms  "
        f"p99 {many['p99_ms']:.2f} ms  max {many['max_ms']:.2f} ms",
        "",
        f"probes under bulk load (/decode/batch: {BULK_SMALL_CLIENTS} clients x "
        f"{BULK_SMALL_TEXTS} texts, 1 client x {bulk['bulk']['big_batch_mb']} MB; "
        f"{bulk['bulk']['texts_per_s']:.0f} texts/s, {bulk['bulk']['batches_ok']} batches ok, "
        f"{bulk['bulk']['batches_shed']} shed)",
        *(
            f"  {path:<8} p50 {bulk['probes'][path]['p50_ms']:.2f} ms  "
            f"p99 {bulk['probes'][path]['p99_ms']:.2f} ms  "
            f"max {bulk['probes'][path]['max_ms']:.2f} ms  "
            f"({bulk['probes'][path]['samples']} samples)"
            for path in ("/health", "/ready")
        ),
        "",
        *format_fair_shares(result["fair_shares"]),
        "",
        *_format_targets(result["targets"]),
    ]
    return "\n".join(lines)


def _format_targets(targets: dict[str, Any]) -> list[str]:
    lines = ["targets"]
    for name, t in targets.items():
        verdict = "PASS" if t["passed"] else "FAIL"
        lines.append(f"  {name:<24} {t['measured']!s:>9} (target {t['target']})  {verdict}")
    return lines
