"""The scan driver: plan parts, skip finished ones, run an engine, merge, summarise, audit.

Resuming: every finished part is written atomically to ``<out>.parts/`` next to
a manifest naming the inputs (path, size, mtime), the mode, the fields and
the key set (public key ids only). A rerun with the same manifest skips the
finished parts; the final output is the parts concatenated in input order,
so it is identical however often the scan was interrupted and whichever
engine ran it. The parts folder is removed once the output is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.services.corpus import InputError, Part, check_fields, discover, plan
from app.stores.client_payloads import sealed_bits, without_seal
from worldcup_scan.keys import StoreSession
from worldcup_scan.scanner import COLUMNS, ScanSpec, arrow_schema, iso_utc

# 2: the registry_expired column; 3: statistic (model_free); 4: the client_payload column
MANIFEST_VERSION = 4


class ScanStateError(ValueError):
    """A previous, different scan left its parts where this one would write."""


@dataclass(frozen=True)
class ScanOptions:
    inputs: tuple[str, ...]
    out: Path
    engine: str = "local"
    workers: int = 1
    part_rows: int = 1000
    ray_address: str | None = None
    with_registry: bool = False
    restart: bool = False  # discard the parts of an earlier, different scan
    progress: bool = True
    actor: str = "cli"  # who ran the scan, for the audit log

    def __post_init__(self) -> None:
        output_format(self.out)  # refuse an unknown suffix before any work

    @property
    def out_format(self) -> str:
        return output_format(self.out)


# What ``--out`` writes, by its suffix; anything else is refused (never a silent Parquet).
OUTPUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl"}
OUTPUT_FORMATS |= {".ndjson": "jsonl", ".csv": "csv"}


def output_format(out: Path) -> str:
    """``parquet``, ``jsonl`` or ``csv``, from the output file's suffix."""
    fmt = OUTPUT_FORMATS.get(out.suffix.lower())
    if fmt is None:
        known = ", ".join(sorted(OUTPUT_FORMATS))
        raise InputError(
            f"--out {out}: unknown output format {out.suffix or '(no suffix)'!r}; "
            f"name the file with one of {known}"
        )
    return fmt


@dataclass
class ScanSummary:
    files: int = 0
    texts: int = 0
    errors: int = 0
    hits: int = 0
    short_texts: int = 0
    unnamed_entries: int = 0  # watermarked rows whose entry a close runner-up kept unnamed
    expired_entries: int = 0  # rows whose entry is past the tenant's registry retention
    hits_per_tenant: dict[str, int] = field(default_factory=dict)
    parts: int = 0
    parts_resumed: int = 0  # finished by an earlier run, not scanned again
    texts_scanned: int = 0  # by this run
    seconds: float = 0.0
    texts_per_second: float = 0.0
    output: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"scanned {self.texts} texts: {self.hits} watermarked, {self.errors} with errors, "
            f"{self.short_texts} short, {self.unnamed_entries} with an entry too close to "
            f"another to name, {self.expired_entries} with an entry past the registry's "
            "retention",
            f"{self.texts_scanned} texts this run in {self.seconds:.1f} s "
            f"({self.texts_per_second:.1f} texts/s); "
            f"{self.parts_resumed}/{self.parts} parts were already done",
        ]
        for tenant, n in sorted(self.hits_per_tenant.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {tenant}: {n}")
        lines.append(f"output: {self.output}")
        return "\n".join(lines)


def _manifest(
    options: ScanOptions, spec: ScanSpec, files: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    inputs = []
    for path, fmt in files:
        st = os.stat(path)
        inputs.append([path, fmt, st.st_size, st.st_mtime_ns])
    return {
        "version": MANIFEST_VERSION,
        "inputs": inputs,
        "mode": spec.mode,
        "fields": asdict(spec.fields),
        "significance": spec.significance,
        "registry_min_confidence": spec.registry_min_confidence,
        "short_tokens": spec.short_tokens,
        "model": spec.model,
        "keys": spec.keys.fingerprint(),
        "part_rows": options.part_rows,
        "with_registry": options.with_registry,
    }


def _prepare_state(state: Path, manifest: dict[str, Any], restart: bool) -> None:
    path = state / "manifest.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        if old == manifest:
            return
        if not restart:
            raise ScanStateError(
                f"{state} holds parts of a different scan (inputs, keys or options changed); "
                "pass --restart to discard them"
            )
    if state.exists():
        shutil.rmtree(state)
    state.mkdir(parents=True)
    tmp = state / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _write_part(state: Path, part: Part, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=arrow_schema())
    tmp = state / f"{part.name}.parquet.tmp"
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, state / f"{part.name}.parquet")


def fill_registry(session: StoreSession, rows: list[dict[str, Any]]) -> None:
    """Registry metadata of the hits (the driver's job: workers never touch the store)."""
    by_tenant: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["message_id"] is not None and row["tenant_id"] is not None:
            by_tenant.setdefault(row["tenant_id"], []).append(row)
    for tenant_id, hits in by_tenant.items():  # one bulk read a tenant
        entries = session.registry_entries(tenant_id, [int(r["message_id"]) for r in hits])
        for row, entry in zip(hits, entries, strict=True):
            if entry is not None:  # an entry that seals a client-chosen payload says so
                row["client_payload"] = sealed_bits(entry.metadata) is not None
                metadata = without_seal(entry.metadata)
                row["registry_metadata"] = json.dumps(metadata, sort_keys=True)
                row["registry_issued_at"] = iso_utc(entry.issued_at)


def _merge(state: Path, parts: Sequence[Part], out: Path, fmt: str) -> ScanSummary:
    """Concatenate the parts in input order into ``out`` (atomically) and count."""
    import csv

    import pyarrow.parquet as pq

    summary = ScanSummary(parts=len(parts))
    per_tenant: Counter[str] = Counter()
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = pq.ParquetWriter(tmp, arrow_schema()) if fmt == "parquet" else None
    names = [n for n, _ in COLUMNS]
    try:
        with (
            open(tmp, "w", encoding="utf-8", newline="") if writer is None else _nullcontext()
        ) as text:
            table_writer = (
                csv.DictWriter(text, names) if text is not None and fmt == "csv" else None
            )
            if table_writer is not None:
                table_writer.writeheader()
            for part in parts:
                table = pq.read_table(state / f"{part.name}.parquet", schema=arrow_schema())
                rows = table.to_pylist()
                for row in rows:
                    summary.texts += 1
                    summary.errors += row["error"] is not None
                    summary.short_texts += bool(row["short_text"])
                    summary.unnamed_entries += bool(row["registry_ambiguous"])
                    summary.expired_entries += bool(row["registry_expired"])
                    if row["verdict"] == "watermarked":  # the row's own verdict
                        summary.hits += 1
                        per_tenant[row["tenant_name"] or row["tenant_id"]] += 1
                if writer is not None:
                    writer.write_table(table)
                elif table_writer is not None:
                    table_writer.writerows({n: row[n] for n in names} for row in rows)
                else:
                    assert text is not None
                    for row in rows:
                        text.write(json.dumps({n: row[n] for n in names}) + "\n")
    finally:
        if writer is not None:
            writer.close()
    os.replace(tmp, out)
    summary.hits_per_tenant = dict(per_tenant)
    summary.output = str(out)
    return summary


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _engine(
    options: ScanOptions, spec: ScanSpec, parts: Sequence[Part]
) -> Iterator[tuple[Part, list[dict[str, Any]]]]:
    if options.engine == "local":
        from worldcup_scan.engines import run_local

        return run_local(spec, parts, options.workers)
    if options.engine == "ray":
        from worldcup_scan.engines import run_ray

        return run_ray(spec, parts, options.workers, options.ray_address)
    raise ValueError(f"engine must be local or ray, got {options.engine!r}")


def run_scan(
    options: ScanOptions,
    spec: ScanSpec,
    session: StoreSession | None = None,
    on_part: Callable[[Part, int], None] | None = None,
) -> ScanSummary:
    """Scan, resumably; ``on_part(part, finished_parts)`` runs after each part is on disk."""
    if options.workers < 1:
        raise ValueError("workers must be at least 1")
    if options.engine == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError("the ray engine needs: pip install 'worldcup[scan]'") from None
    started = time.perf_counter()
    files = discover(options.inputs)
    check_fields(files, spec.fields)  # a wrong --text-field fails here, not as N error rows
    parts = plan(files, options.part_rows)
    if not any(len(p) for p in parts):
        raise InputError(f"nothing to scan: the inputs hold no rows ({len(files)} empty files)")
    state = options.out.with_name(options.out.name + ".parts")
    _prepare_state(state, _manifest(options, spec, files), options.restart)
    pending = [p for p in parts if not (state / f"{p.name}.parquet").is_file()]
    total = sum(len(p) for p in parts)
    already = total - sum(len(p) for p in pending)
    finished = len(parts) - len(pending)
    scanned = 0
    with _Progress(options.progress, total, already) as bar:
        for part, rows in _engine(options, spec, pending):
            if options.with_registry and session is not None:
                fill_registry(session, rows)
            _write_part(state, part, rows)
            finished += 1
            scanned += len(rows)
            bar.advance(len(rows))
            if on_part is not None:
                on_part(part, finished)
    summary = _merge(state, parts, options.out, options.out_format)
    summary.files = len(files)
    shutil.rmtree(state)
    summary.parts_resumed = len(parts) - len(pending)
    summary.texts_scanned = scanned
    summary.seconds = time.perf_counter() - started
    summary.texts_per_second = scanned / summary.seconds if summary.seconds > 0 else 0.0
    if session is not None:
        _audit(session, options, spec, summary)
    return summary


def _audit(session: StoreSession, options: ScanOptions, spec: ScanSpec, s: ScanSummary) -> None:
    """Who scanned, when, how much and what was found; never a text or a document id."""
    from app.stores.base import AuditRecord

    session.append_audit(
        AuditRecord(
            at=time.time(),
            actor=options.actor,
            action="scan",
            request_id=uuid.uuid4().hex,
            outcome={
                "mode": spec.mode,
                "engine": options.engine,
                "num_files": s.files,
                "num_texts": s.texts,
                "num_errors": s.errors,
                "num_hits": s.hits,
                "hits_per_tenant": s.hits_per_tenant,
                "num_keys": len(spec.keys.keys),
                "seconds": round(s.seconds, 3),
            },
        )
    )


class _Progress:
    """A rich progress bar on stderr: texts done, rate and ETA (silent when disabled)."""

    def __init__(self, enabled: bool, total: int, done: int) -> None:
        self.enabled = enabled
        self.total, self.done = total, done
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("scan"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("texts"),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "scan", total=self.total, completed=self.done, rate="-- texts/s"
            )
            self._started = time.perf_counter()
            self._counted = 0
        return self

    def advance(self, n: int) -> None:
        if self._progress is None:
            return
        self._counted += n
        rate = self._counted / max(time.perf_counter() - self._started, 1e-9)
        self._progress.update(self._task, advance=n, rate=f"{rate:.1f} texts/s")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
