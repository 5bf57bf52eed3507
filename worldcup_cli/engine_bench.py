"""``worldcup bench-service --engine vllm``: the engines side by side over loopback HTTP.

In one run, one after another, the service (``create_app``, embedded model,
SQLite in a temporary directory) is started on:

1. ``hf``: our continuous-batching loop;
2. ``vllm-plain``: vLLM without the WorldCup processor (requests run with
   vLLM's own sampling and carry no watermark): the baseline;
3. ``vllm-worldcup``: vLLM with the processor, as served.

For each: cold start (app creation to the first ``/ready`` 200, weights already
converted and cached), then aggregate generated tokens/s and median time to
first token at 1, 8 and 32 concurrent ``/generate`` requests (``max_new_tokens
= min_new_tokens = 64``, distinct prompts, 16-bit payloads). Watermarked texts
are decoded back. Needs the ``[vllm]`` extra (``make setup-vllm``); vLLM spawns
its engine core, so the CLI entry point carries a ``__main__`` guard.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from worldcup_cli.service_bench import (
    PAYLOAD_BITS,
    Progress,
    _articles,
    _free_socket,
    _Load,
    _prompts,
    _ready_with_tenant,
    _Server,
    _wave_stats,
)

ENGINE_LEVELS = (1, 8, 32)
TARGET_RATIO = 0.95  # vLLM + WorldCup against vLLM plain, at 8 and 32 concurrent
VARIANTS = ("hf", "vllm-plain", "vllm-worldcup")


async def _drive(
    server: _Server,
    base_url: str,
    admin_token: str,
    t_start: float,
    watermarked: bool,
    progress: Progress,
) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as client:
        cold_start, api_key = await _ready_with_tenant(
            client, server, admin_token, t_start, 900, progress
        )
        load = _Load(client, api_key, _prompts(_articles(64), sum(ENGINE_LEVELS) + 1))
        await load.generate()  # warm
        levels = []
        for c in ENGINE_LEVELS:
            progress(f"generate: {c} concurrent")
            seconds, results = await load.wave(c, concurrent=True)
            levels.append(_wave_stats(c, seconds, results))
        exact, bit_acc = 0, []
        if watermarked:
            for bits, text in load.generated:
                d = await client.post(
                    "/decode", json={"text": text, "num_bits": PAYLOAD_BITS}, headers=load.auth
                )
                d.raise_for_status()
                got = d.json()["bits"]
                exact += got == bits
                bit_acc.append(sum(a == b for a, b in zip(got, bits, strict=True)) / PAYLOAD_BITS)
    out: dict[str, Any] = {"cold_start_seconds": round(cold_start, 3), "levels": levels}
    if watermarked:
        out["decoded"] = {
            "texts": len(load.generated),
            "exact_payload": exact,
            "bit_accuracy": round(statistics.mean(bit_acc), 4),
        }
    return out


def _run_variant(variant: str, device: str, max_batch: int, progress: Progress) -> dict[str, Any]:
    from pydantic import SecretStr

    import app.engines.vllm as vllm_engine
    from app.core.config import Environment, Role, Settings
    from app.main import create_app

    with tempfile.TemporaryDirectory(prefix="worldcup-bench-") as tmp:
        admin_token = secrets.token_urlsafe(32)
        sock = _free_socket()
        port = sock.getsockname()[1]
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            env=Environment.PROD,
            role=Role.GENERATOR,
            engine="hf" if variant == "hf" else "vllm",
            device=device,
            port=port,
            sqlite_path=Path(tmp) / "bench.sqlite3",
            redis_url=None,
            master_key=SecretStr(secrets.token_hex(32)),
            master_key_file=None,
            admin_token=SecretStr(admin_token),
            admin_token_file=None,
            log_level="WARNING",
            max_batch_size=max_batch,
            max_queue=256,
            request_timeout_s=900,  # 32 concurrent on a loaded 2-core box exceeds the default
            vllm_max_model_len=1024,
        )
        load = vllm_engine.VLLMEngine.load
        if variant == "vllm-plain":
            # the baseline only: the service never loads vLLM without the processor
            def plain(s: Settings, m: Any, watermark: bool = True) -> Any:
                return load(s, m, watermark=False)

            vllm_engine.VLLMEngine.load = plain  # type: ignore[method-assign,assignment]
        progress(f"{variant}: starting the service on 127.0.0.1:{port}")
        t_start = time.perf_counter()
        server = _Server(create_app(settings), sock)
        server.start()
        try:
            return asyncio.run(
                _drive(
                    server,
                    f"http://127.0.0.1:{port}",
                    admin_token,
                    t_start,
                    variant != "vllm-plain",
                    progress,
                )
            )
        finally:
            server.stop()
            sock.close()
            vllm_engine.VLLMEngine.load = load  # type: ignore[method-assign]


def run_engine_bench(
    *,
    device: str = "cpu",
    max_batch: int = 32,
    variants: tuple[str, ...] = VARIANTS,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """hf, vLLM plain and vLLM + WorldCup, one after another; a dict of figures."""
    from worldcup_core.models import resolve_model_dir

    say = progress or (lambda _msg: None)
    resolve_model_dir(None, None, need_model=True)
    # vLLM logs to stdout: keep it off the JSON this command prints there
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        results = {v: _run_variant(v, device, max_batch, say) for v in variants}
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)
    if not {"vllm-plain", "vllm-worldcup"} <= set(results):
        return {"engines": results, "environment": _environment(device, max_batch)}
    plain = {lv["concurrency"]: lv["tokens_per_s"] for lv in results["vllm-plain"]["levels"]}
    marked = {lv["concurrency"]: lv["tokens_per_s"] for lv in results["vllm-worldcup"]["levels"]}
    ratios = {c: round(marked[c] / plain[c], 3) for c in ENGINE_LEVELS}
    return {
        "engines": results,
        "worldcup_over_plain": {str(c): r for c, r in ratios.items()},
        "targets": {
            f"vllm_worldcup_over_plain_{c}": {
                "measured": ratios[c],
                "target": f">= {TARGET_RATIO}",
                "passed": ratios[c] >= TARGET_RATIO,
            }
            for c in (8, 32)
        },
        "environment": _environment(device, max_batch),
    }


def _environment(device: str, max_batch: int) -> dict[str, Any]:
    import torch

    return {
        "device": device,
        "max_batch_size": max_batch,
        "new_tokens": 64,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }


def format_engine_bench(result: dict[str, Any]) -> str:
    """A plain-text table of :func:`run_engine_bench`'s dict."""
    if "worldcup_over_plain" not in result:
        return json.dumps(result, indent=2)
    lines = [
        "engine          cold start   "
        + "   ".join(f"{c:>3} conc tok/s (TTFT)" for c in ENGINE_LEVELS)
    ]
    for name, r in result["engines"].items():
        cells = [
            f"{lv['tokens_per_s']:>8.1f} ({lv['ttft_median_s'] or float('nan'):.2f} s)"
            for lv in r["levels"]
        ]
        lines.append(f"{name:<15} {r['cold_start_seconds']:>8.1f} s   " + "   ".join(cells))
    ratios = ", ".join(f"{c}: {r}" for c, r in result["worldcup_over_plain"].items())
    lines.append(f"vLLM + WorldCup / vLLM plain: {ratios} (target >= {TARGET_RATIO} at 8 and 32)")
    env = result["environment"]
    lines.append(f"device {env['device']}, load average {env['load_average']}")
    return "\n".join(lines)
