"""``worldcup bench service --engine vllm``: the engines side by side over loopback HTTP.

Every arm runs as its own service (``create_app``, embedded model, SQLite in a
temporary directory), all up at once in this process:

1. ``hf``: our continuous-batching loop;
2. ``vllm-plain``: vLLM without the WorldCup processor (requests run with
   vLLM's own sampling and carry no watermark): the baseline;
3. ``vllm-worldcup``: vLLM with the processor, as served;
4. ``vllm-plain-unfiltered`` (opt-in): the plain baseline with top-k and top-p
   off, i.e. vLLM sampling the whole distribution at the request's temperature.
   The processor applies top-k/top-p itself and hands vLLM a distribution with
   nothing left to filter, so on a CPU, where vLLM's own top-k/top-p sampler is
   costly, this arm isolates what the processor itself costs.

The arms start one after another (cold start: app creation to the first
``/ready`` 200, weights already converted and cached). Then the waves are
**interleaved**: for each repeat and each concurrency level (1, 8, 32
``/generate`` requests at once, ``max_new_tokens = min_new_tokens = 64``,
distinct prompts, 16-bit payloads) every arm runs one wave, in an order that
rotates between repeats, while the others sit idle. A change of machine load
then hits every arm alike, and the ratio vLLM + WorldCup / vLLM plain is taken
per repeat (paired) and reported as its median. Watermarked texts are decoded
back. Needs the ``[vllm]`` extra (``make setup-vllm``); vLLM spawns its engine
core, so the CLI entry point carries a ``__main__`` guard.
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
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from worldcup_cli.bench import paired_median
from worldcup_cli.benchlib import (
    PAYLOAD_BITS,
    Load,
    Progress,
    Server,
    free_socket,
    news_articles,
    news_prompts,
    ready_with_tenant,
    wave_stats,
)

ENGINE_LEVELS = (1, 8, 32)
TARGET_RATIO = 0.95  # vLLM + WorldCup against vLLM plain, at 8 and 32 concurrent
VARIANTS = ("hf", "vllm-plain", "vllm-worldcup")
KNOWN_VARIANTS = (*VARIANTS, "vllm-plain-unfiltered")


def _settings(variant: str, device: str, max_batch: int, port: int, tmp: str, token: str) -> Any:
    from pydantic import SecretStr

    from app.core.config import Environment, Role, Settings

    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        env=Environment.PROD,
        role=Role.GENERATOR,
        engine="hf" if variant == "hf" else "vllm",
        device=device,
        port=port,
        sqlite_path=Path(tmp) / f"{variant}.sqlite3",
        redis_url=None,
        master_key=SecretStr(secrets.token_hex(32)),
        master_key_file=None,
        admin_token=SecretStr(token),
        admin_token_file=None,
        log_level="WARNING",
        max_batch_size=max_batch,
        max_queue=256,
        request_timeout_s=900,  # 32 concurrent on a loaded 2-core box exceeds the default
        vllm_max_model_len=1024,
        # the load's chosen payloads carried as chosen: decoded bits are compared with them
        seal_client_payloads=False,
    )


class _Arm:
    """One variant's running service and its HTTP load."""

    def __init__(self, variant: str, server: Server, base_url: str, token: str) -> None:
        self.variant = variant
        self.server = server
        self.base_url = base_url
        self.token = token
        self.cold_start = 0.0
        self.load: Load | None = None
        self.waves: dict[int, list[dict[str, Any]]] = {c: [] for c in ENGINE_LEVELS}

    @property
    def watermarked(self) -> bool:
        return not self.variant.startswith("vllm-plain")


def _start_arm(
    variant: str, device: str, max_batch: int, tmp: str, stack: ExitStack, progress: Progress
) -> _Arm:
    """Start one arm's service and wait for it; the vLLM engine core spawns during this."""
    import app.engines.vllm as vllm_engine
    from app.main import create_app

    token = secrets.token_urlsafe(32)
    sock = free_socket()
    port = sock.getsockname()[1]
    stack.callback(sock.close)
    load = vllm_engine.VLLMEngine.load
    if variant.startswith("vllm-plain"):
        # the baselines only: the service never loads vLLM without the processor
        unfiltered = variant == "vllm-plain-unfiltered"

        def plain(s: Any, m: Any, watermark: bool = True) -> Any:
            engine, tokenizer, name = load(s, m, watermark=False)
            if unfiltered:
                engine._params = _unfiltered(engine._params)
            return engine, tokenizer, name

        vllm_engine.VLLMEngine.load = plain  # type: ignore[method-assign,assignment]
    progress(f"{variant}: starting the service on 127.0.0.1:{port}")
    try:
        t_start = time.perf_counter()
        server = Server(create_app(_settings(variant, device, max_batch, port, tmp, token)), sock)
        server.start()
        stack.callback(server.stop)
        arm = _Arm(variant, server, f"http://127.0.0.1:{port}", token)
        arm.cold_start = asyncio.run(_ready(arm, t_start, progress))
    finally:
        vllm_engine.VLLMEngine.load = load  # type: ignore[method-assign]
    return arm


def _unfiltered(params: Any) -> Any:
    """``VLLMEngine._params`` with the request's top-k and top-p switched off."""
    from dataclasses import replace

    def build(request: Any, handle: str) -> Any:
        sampling = replace(request.sampling, top_k=0, top_p=1.0)
        return params(replace(request, sampling=sampling), handle)

    return build


async def _ready(arm: _Arm, t_start: float, progress: Progress) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=arm.base_url, timeout=900) as client:
        cold, _ = await ready_with_tenant(client, arm.server, arm.token, t_start, 900, progress)
    return cold


async def _interleaved(arms: list[_Arm], repeats: int, progress: Progress) -> None:
    """Every (repeat, level): one wave per arm, the arms' order rotated each repeat."""
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    clients = [httpx.AsyncClient(base_url=a.base_url, timeout=900, limits=limits) for a in arms]
    try:
        prompts = news_prompts(news_articles(64), repeats * sum(ENGINE_LEVELS) + 1)
        for arm, client in zip(arms, clients, strict=True):
            admin = {"Authorization": f"Bearer {arm.token}"}
            # decoded bits are compared with the issued ones: an analyst's key
            body = {"name": "waves", "scopes": ["provenance"]}
            r = await client.post("/admin/tenants", json=body, headers=admin)
            r.raise_for_status()
            arm.load = Load(client, r.json()["api_key"], prompts)
            await arm.load.generate()  # warm: allocator, caches, the first batch
        for rep in range(repeats):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for c in ENGINE_LEVELS:
                for arm in order:
                    assert arm.load is not None
                    progress(f"repeat {rep + 1}/{repeats}: {arm.variant}, {c} concurrent")
                    seconds, results = await arm.load.wave(c, concurrent=True)
                    arm.waves[c].append(wave_stats(c, seconds, results))
    finally:
        for client in clients:
            await client.aclose()


async def _decoded(arm: _Arm) -> dict[str, Any]:
    """Decode every text the arm generated with its own service."""
    import httpx

    assert arm.load is not None
    exact, bit_acc = 0, []
    async with httpx.AsyncClient(base_url=arm.base_url, timeout=900) as client:
        for bits, text in arm.load.generated:
            d = await client.post(
                "/decode", json={"text": text, "num_bits": PAYLOAD_BITS}, headers=arm.load.auth
            )
            d.raise_for_status()
            got = d.json()["bits"]
            exact += got == bits
            bit_acc.append(sum(a == b for a, b in zip(got, bits, strict=True)) / PAYLOAD_BITS)
    return {
        "texts": len(arm.load.generated),
        "exact_payload": exact,
        "bit_accuracy": round(statistics.mean(bit_acc), 4),
    }


def _level_summary(waves: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        vals = [w[key] for w in waves if w[key] is not None]
        return round(statistics.median(vals), 4) if vals else None

    return {
        "concurrency": waves[0]["concurrency"],
        "repeats": len(waves),
        "tokens_per_s": med("tokens_per_s"),
        "tokens_per_s_each": [w["tokens_per_s"] for w in waves],
        "ttft_median_s": med("ttft_median_s"),
        "per_sequence_tokens_per_s": med("per_sequence_tokens_per_s"),
    }


def paired_ratio(marked: list[dict[str, Any]], plain: list[dict[str, Any]]) -> float:
    """Median over repeats of tokens/s marked / plain, each repeat's two waves taken
    back to back: a load change between repeats cancels within each pair."""
    if not marked or len(marked) != len(plain):
        raise ValueError("one plain wave per watermarked wave is needed")
    rates = [m["tokens_per_s"] for m in marked], [p["tokens_per_s"] for p in plain]
    return round(paired_median(*rates), 3)


def run_engine_bench(
    *,
    device: str = "cpu",
    max_batch: int = 32,
    variants: tuple[str, ...] = VARIANTS,
    repeats: int = 3,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every arm up at once, waves interleaved (see the module docstring); a dict of figures."""
    from worldcup_core.models import resolve_model_dir

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = progress or (lambda _msg: None)
    resolve_model_dir(None, None, need_model=True)
    # vLLM logs to stdout: keep it off the JSON this command prints there
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        with tempfile.TemporaryDirectory(prefix="worldcup-bench-") as tmp, ExitStack() as stack:
            arms = [_start_arm(v, device, max_batch, tmp, stack, say) for v in variants]
            asyncio.run(_interleaved(arms, repeats, say))
            results: dict[str, Any] = {}
            for arm in arms:
                results[arm.variant] = {
                    "cold_start_seconds": round(arm.cold_start, 3),
                    "levels": [_level_summary(arm.waves[c]) for c in ENGINE_LEVELS],
                }
                if arm.watermarked:
                    results[arm.variant]["decoded"] = asyncio.run(_decoded(arm))
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)
    out: dict[str, Any] = {"engines": results, "environment": _environment(device, max_batch)}
    out["environment"]["repeats"] = repeats
    if {"vllm-plain", "vllm-worldcup"} <= set(results):
        by = {a.variant: a for a in arms}
        ratios = {
            c: paired_ratio(by["vllm-worldcup"].waves[c], by["vllm-plain"].waves[c])
            for c in ENGINE_LEVELS
        }
        out["worldcup_over_plain"] = {str(c): r for c, r in ratios.items()}
        out["targets"] = {
            f"vllm_worldcup_over_plain_{c}": {
                "measured": ratios[c],
                "target": f">= {TARGET_RATIO}",
                "passed": ratios[c] >= TARGET_RATIO,
            }
            for c in (8, 32)
        }
    if {"vllm-plain-unfiltered", "vllm-worldcup"} <= set(results):
        by = {a.variant: a for a in arms}
        out["worldcup_over_plain_unfiltered"] = {
            str(c): paired_ratio(by["vllm-worldcup"].waves[c], by["vllm-plain-unfiltered"].waves[c])
            for c in ENGINE_LEVELS
        }
    return out


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
        + "   (medians over repeats)"
    ]
    for name, r in result["engines"].items():
        cells = [
            f"{lv['tokens_per_s']:>8.1f} ({lv['ttft_median_s'] or float('nan'):.2f} s)"
            for lv in r["levels"]
        ]
        lines.append(f"{name:<15} {r['cold_start_seconds']:>8.1f} s   " + "   ".join(cells))
    ratios = ", ".join(f"{c}: {r}" for c, r in result["worldcup_over_plain"].items())
    if "worldcup_over_plain_unfiltered" in result:
        unf = ", ".join(f"{c}: {r}" for c, r in result["worldcup_over_plain_unfiltered"].items())
        lines.append(f"vLLM + WorldCup / vLLM plain without top-k/top-p: {unf}")
    lines.append(
        f"vLLM + WorldCup / vLLM plain, median of paired repeats: {ratios} "
        f"(target >= {TARGET_RATIO} at 8 and 32)"
    )
    env = result["environment"]
    lines.append(
        f"device {env['device']}, {env.get('repeats', 1)} interleaved repeats, "
        f"load average {env['load_average']}"
    )
    return "\n".join(lines)
