"""Engines: where the per-part function runs. Both yield ``(part, rows)`` as parts finish.

* ``local``: a process pool (``spawn``), one :class:`Scanner` per process, made
  by the pool's initializer, so the tokenizer and key bank load once per core
  (one worker scans in the driver process itself).
* ``ray``: a Ray Data pipeline over the pending parts; ``map_batches`` runs
  :class:`RayScanner`, a stateful callable class, in an actor pool
  (``concurrency`` actors, one CPU each), so each actor loads the tokenizer and
  the key bank once. ``--ray-address`` joins an existing cluster; otherwise Ray
  starts locally with ``num_cpus`` = workers. Workers read their parts
  themselves, so on a cluster the inputs must be on storage every node sees.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from app.services.corpus import Part
from worldcup_scan.scanner import COLUMNS, Scanner, ScanSpec, arrow_schema

ENGINES = ("local", "ray")

_worker: Scanner | None = None


def _init_worker(spec: ScanSpec) -> None:
    global _worker
    _worker = Scanner(spec)


def _scan_in_worker(part: Part) -> list[dict[str, Any]]:
    assert _worker is not None, "the pool initializer did not run"
    return _worker.scan_part(part)


def run_local(
    spec: ScanSpec, parts: Sequence[Part], workers: int
) -> Iterator[tuple[Part, list[dict[str, Any]]]]:
    """Scan ``parts`` in ``workers`` processes; at most 2 parts in flight per worker.

    One worker runs in this process: no start-up of a second interpreter.
    """
    if not parts:
        return
    if workers == 1:
        scanner = Scanner(spec)
        for part in parts:
            yield part, scanner.scan_part(part)
        return
    ctx = multiprocessing.get_context("spawn")  # torch and tokenizers threads do not fork well
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(spec,)
    ) as pool:
        todo = iter(parts)
        running: dict[Future[list[dict[str, Any]]], Part] = {}
        for part in todo:
            running[pool.submit(_scan_in_worker, part)] = part
            if len(running) >= 2 * workers:
                break
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                part = running.pop(future)
                yield part, future.result()
                nxt = next(todo, None)
                if nxt is not None:
                    running[pool.submit(_scan_in_worker, nxt)] = nxt


class RayScanner:
    """The Ray Data stage: constructed once per actor, then called on each batch of parts."""

    def __init__(self, spec: ScanSpec, parts: Sequence[Part]) -> None:
        self.scanner = Scanner(spec)
        self.parts = list(parts)

    def __call__(self, batch: dict[str, Any]) -> Any:
        import pyarrow as pa

        rows: list[dict[str, Any]] = []
        tags: list[int] = []
        for index in batch["part"]:
            result = self.scanner.scan_part(self.parts[int(index)])
            rows += result
            tags += [int(index)] * len(result)
        schema = arrow_schema().append(pa.field("_part", pa.int64()))
        columns = {name: [r[name] for r in rows] for name, _ in COLUMNS}
        columns["_part"] = tags
        return pa.table(columns, schema=schema)


def run_ray(
    spec: ScanSpec, parts: Sequence[Part], workers: int, address: str | None = None
) -> Iterator[tuple[Part, list[dict[str, Any]]]]:
    """The same per-part function as a Ray Data ``map_batches`` over the pending parts."""
    import ray

    if not parts:
        return
    started_here = not ray.is_initialized()
    if started_here:
        if address:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        else:
            ray.init(
                address="local",  # a new local instance, never someone else's cluster
                num_cpus=workers,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # our summary says what matters
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours counts texts; Ray's would interleave
        ctx.print_on_execution_start = False
        ctx.enable_auto_log_stats = False
        items = ray.data.from_items([{"part": i} for i in range(len(parts))])
        ds = items.map_batches(
            RayScanner,
            fn_constructor_kwargs={"spec": spec, "parts": list(parts)},
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=1,
        )
        pending: dict[int, list[dict[str, Any]]] = {}
        batches: Iterable[Any] = ds.iter_batches(batch_size=None, batch_format="pyarrow")
        for batch in batches:
            tags = batch.column("_part").to_pylist()
            rows = batch.drop_columns(["_part"]).to_pylist()
            for tag, row in zip(tags, rows, strict=True):
                pending.setdefault(tag, []).append(row)
                if len(pending[tag]) == len(parts[tag]):
                    yield parts[tag], pending.pop(tag)
        if pending:
            raise RuntimeError(f"ray returned {len(pending)} incomplete parts")
    finally:
        if started_here:
            ray.shutdown()
