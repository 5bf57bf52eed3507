"""Generate the cells a queue file lists, one cell per call, into the eval cache.

Generation only: no evaluation, so a long sweep spends its CPU on the model.
The queue is a text file, one cell a line, ``SCHEME BITS [BATCHES]`` (``BATCHES``: only
the first so many batches, for a paired screen on fewer prompts) where ``SCHEME`` is
any name :func:`worldcup_eval.frontier.frontier_spec` parses (``worldcup-k1@0.6``,
``bimark``, a design-idea variant ...); ``#`` starts a comment. Each call generates
the first cell whose batches are not all cached and exits (so a shell loop around it
picks up new code and a re-ordered queue between cells); exit status 3 means
every listed cell is cached.

    while python -m worldcup_eval.gen_queue QUEUE --config CFG; do :; done
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from worldcup_eval.cache import BatchCache
from worldcup_eval.config import build_config
from worldcup_eval.data import default_data_dir, load_data
from worldcup_eval.runner import GenCell, gen_jobs, model_fingerprint

ALL_DONE = 3
LOCKS = Path(os.environ.get("WORLDCUP_QUEUE_LOCKS", "/tmp/worldcup-gen-locks"))


def _lock_name(label: str) -> Path:
    return LOCKS / (label.replace("/", "_").replace("@", "_") + ".pid")


def _held(label: str) -> bool:
    """Whether another live worker generates this cell (several workers share a queue)."""
    try:
        pid = int(_lock_name(label).read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return pid != os.getpid()


def _claim(label: str) -> None:
    LOCKS.mkdir(parents=True, exist_ok=True)
    _lock_name(label).write_text(str(os.getpid()))


def read_queue(path: Path) -> list[tuple[str, int, int | None]]:
    """(scheme, bits, batches or None for all) per line; ``#`` starts a comment."""
    out: list[tuple[str, int, int | None]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, bits, *limit = line.split()
        out.append((name, int(bits), int(limit[0]) if limit else None))
    return out


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    from worldcup_core.models import load_model, load_tokenizer
    from worldcup_eval.frontier import frontier_spec

    ap = argparse.ArgumentParser()
    ap.add_argument("queue", type=Path)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="list what is missing and exit")
    args = ap.parse_args(argv)
    cfg = build_config(config_file=args.config)
    cache = BatchCache(cfg.cache_path)
    lm = None if args.dry_run else load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    tokenizer = lm.tokenizer if lm is not None else load_tokenizer(cfg.model)
    # after loading: a first load writes the embedded model's config.json, which is hashed
    model_fp = model_fingerprint(cfg.model, cfg.dtype, cfg.device)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()
    data = load_data(
        tokenizer, data_dir, cfg.prompts, cfg.datasets, cfg.prompt_tokens, cfg.max_length, cfg.seed
    )
    todo: list[tuple[GenCell, int, int | None, str]] = []
    for name, bits, limit in [("unwatermarked", 0, None), *read_queue(args.queue)]:
        cell = GenCell(frontier_spec(name, cfg), bits or None)
        jobs = gen_jobs(cfg, None, cell, data.prompts, cache, model_fp)[:limit]
        missing = sum(cache.load(j.path) is None for j in jobs)
        if args.dry_run:
            _out(f"{name:40s} {bits:3d}  missing {missing}/{len(jobs)} batches")
        elif missing and not _held(f"{name} {bits}"):
            todo.append((cell, missing, limit, f"{name} {bits}"))
    if args.dry_run:
        return 0
    if not todo:
        _out("queue: every cell is cached")
        return ALL_DONE
    cell, missing, limit, name = todo[0]
    _claim(name)
    _out(f"[{time.strftime('%H:%M:%S')}] {cell.label}: {missing} batches")
    assert lm is not None
    for job in gen_jobs(cfg, lm, cell, data.prompts, cache, model_fp)[:limit]:
        if cache.load(job.path) is not None:
            continue
        t0 = time.perf_counter()
        data_out = job.run()
        cache.store(job.path, data_out)
        _out(
            f"[{time.strftime('%H:%M:%S')}] {cell.label} batch {job.path.name}: "
            f"{data_out['tokens']} tokens in {time.perf_counter() - t0:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
