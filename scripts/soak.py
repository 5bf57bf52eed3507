"""Soak the real service: mixed load on loopback, optionally with a Redis outage mid-run.

Starts a private ``redis-server`` (free port, temp dir, AOF ``appendfsync always``;
the system Redis is never touched) and the app under uvicorn on the tiny random
model (or ``--model-path``), creates a tenant and fires ``--requests`` mixed
requests (~10% /generate, ~45% /decode, ~45% /detect) with ``--concurrency`` in
flight. ``--outage`` SIGKILLs Redis half-way, keeps it down ``--outage-s`` and
restarts it on the same port and directory. Then it checks that every generated
text decodes to its payload and every message id a client got is in the registry,
prints latency percentiles, status counts and a verdict, and exits 1 on any
violation (see ``tests/soaklib.py`` for the rules).

    .venv/bin/python scripts/soak.py --requests 3000 --concurrency 16 --outage
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402
from servers import LiveServer  # noqa: E402
from soaklib import (  # noqa: E402
    TABLE_COLUMNS,
    RedisServer,
    SoakConfig,
    SoakReport,
    data_dir,
    human_texts,
    run_soak,
    soak_settings,
)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--outage", action="store_true", help="take Redis down in the middle")
    p.add_argument(
        "--outage-mode",
        choices=("kill", "freeze"),
        default="kill",
        help="kill: SIGKILL and restart from the AOF; freeze: SIGSTOP/SIGCONT (a hung Redis)",
    )
    p.add_argument("--outage-s", type=float, default=3.0, help="seconds Redis stays down")
    p.add_argument("--store-timeout-s", type=float, default=0.5)
    p.add_argument("--model-path", help="model directory or hub id (default: tiny random)")
    p.add_argument("--data-dir", type=Path, help="default: $WORLDCUP_DATA_DIR or ../shared/data")
    p.add_argument("--num-bits", type=int, default=SoakConfig.num_bits)
    p.add_argument("--max-new-tokens", type=int, default=SoakConfig.max_new_tokens)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _tiny_model(directory: Path) -> Path:
    from worldcup_core.models import load_tokenizer, tiny_random_model

    lm = tiny_random_model(load_tokenizer())
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return directory


def _print(console: Console, report: SoakReport) -> None:
    table = Table(title="latency per endpoint (200 = successful answers only)")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col in ("endpoint", "statuses") else "right")
    for row in report.table():
        table.add_row(*row)
    console.print(table)
    for line in report.details():
        console.print(line, highlight=False)
    for v in report.violations[:20]:
        console.print(f"[red]violation:[/red] {v}", highlight=False)
    if len(report.violations) > 20:
        console.print(f"... and {len(report.violations) - 20} more", highlight=False)
    style = "bold green" if report.ok else "bold red"
    console.print(report.verdict(), style=style, highlight=False)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    console = Console(stderr=False)
    texts, prompts = human_texts(args.data_dir or data_dir())
    config = SoakConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        num_bits=args.num_bits,
        max_new_tokens=args.max_new_tokens,
        outage=args.outage_mode if args.outage else None,
        outage_s=args.outage_s,
        fast_503_s=max(2.0, 4 * args.store_timeout_s),
        seed=args.seed,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="worldcup-soak-") as tmp:
        tmpdir = Path(tmp)
        started = time.monotonic()
        model = args.model_path or str(_tiny_model(tmpdir / "tiny-model"))
        with RedisServer(tmpdir / "redis") as redis:
            settings = soak_settings(model, redis.url, store_timeout_s=args.store_timeout_s)
            with LiveServer(settings) as server:
                console.print(
                    f"service {server.url} (model {model}), private redis-server "
                    f"{redis.url} in {redis.directory}, ready in "
                    f"{time.monotonic() - started:.1f}s; {args.requests} requests, "
                    f"concurrency {args.concurrency}, outage: {config.outage or 'none'}",
                    highlight=False,
                )
                with Progress(
                    "[progress.description]{task.description}",
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=console,
                    disable=args.no_progress,
                ) as bar:
                    task = bar.add_task("soak", total=args.requests)
                    report = asyncio.run(
                        run_soak(
                            server.url,
                            config,
                            texts,
                            prompts,
                            redis=redis,
                            progress=lambda n: bar.advance(task, n),
                        )
                    )
    _print(console, report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
