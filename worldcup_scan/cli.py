"""``worldcup scan`` and ``worldcup bench scan`` (registered by :mod:`worldcup_cli.main`).

Bad input is one ``error: …`` line and exit code 2, as everywhere in the CLI.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from app.services.corpus import Fields, InputError
from worldcup_core.verdict import MIN_SCORED_TOKENS
from worldcup_scan.keys import (
    KeySourceError,
    ScanKeys,
    StoreSession,
    keys_from_files,
    master_key_from_env,
    open_store,
)
from worldcup_scan.run import ScanOptions, ScanStateError, output_format, run_scan
from worldcup_scan.scanner import ScanSpec


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _default_actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no login name in a container
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


def scan(
    inputs: Annotated[
        list[str], typer.Argument(help="Files, globs or directories (.jsonl, .csv, .parquet).")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Output file: .parquet, .jsonl or .csv (by suffix).")
    ],
    text_field: Annotated[str, typer.Option("--text-field")] = "text",
    id_field: Annotated[str | None, typer.Option("--id-field")] = None,
    mode: Annotated[
        str, typer.Option("--mode", help="provenance (every tenant) or detect (one tenant).")
    ] = "provenance",
    engine: Annotated[str, typer.Option("--engine", help="local or ray.")] = "local",
    workers: Annotated[
        int | None, typer.Option("--workers", help="Processes or Ray actors (default: cores).")
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option("--ray-address", help="Join this Ray cluster ('auto' too).")
    ] = None,
    key_file: Annotated[
        list[Path] | None,
        typer.Option("--key-file", help="A key file (repeatable); its name labels the output."),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            help="redis://… or a SQLite file (default: WORLDCUP_REDIS_URL, WORLDCUP_SQLITE_PATH).",
        ),
    ] = None,
    master_key_file: Annotated[
        Path | None,
        typer.Option("--master-key-file", help="Default: WORLDCUP_MASTER_KEY(_FILE)."),
    ] = None,
    redis_prefix: Annotated[str, typer.Option("--redis-prefix")] = "wc",
    redis_cluster: Annotated[
        bool,
        typer.Option(
            "--redis-cluster", envvar="WORLDCUP_REDIS_CLUSTER", help="The store is a Redis Cluster."
        ),
    ] = False,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Detect mode: the tenant's id or name.")
    ] = None,
    with_registry: Annotated[
        bool, typer.Option("--with-registry", help="Add the registry metadata of each hit.")
    ] = False,
    num_bits: Annotated[
        int | None, typer.Option("--num-bits", help="Key files: decode this payload length.")
    ] = None,
    scheme_version: Annotated[str, typer.Option("--scheme-version")] = "worldcup-v2",
    k: Annotated[int, typer.Option("--k")] = 2,
    layers: Annotated[int, typer.Option("--layers")] = 30,
    context_width: Annotated[
        int,
        typer.Option(
            "--context-width",
            help="Key files: the context width c they were issued with (a store's keys "
            "carry their own).",
        ),
    ] = 2,
    significance: Annotated[
        float,
        typer.Option(
            "--significance",
            help="Deprecated: carries no threshold. Rows' verdict and is_watermarked use the "
            "fixed 1e-6 of worldcup_core.assess, as the API's.",
        ),
    ] = 0.01,
    part_rows: Annotated[int, typer.Option("--part-rows", help="Rows per resumable part.")] = 1000,
    short_tokens: Annotated[
        int,
        typer.Option(
            "--short-tokens",
            help="Fewer scored tokens: flagged short_text (default: the verdict's own line, "
            "below which a row is inconclusive/too_short rather than not_watermarked).",
        ),
    ] = MIN_SCORED_TOKENS,
    max_chars: Annotated[int, typer.Option("--max-chars")] = 1_000_000,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A local model directory: its tokenizer, and with --with-model its weights "
            "(default: the embedded SmolLM2, which the service serves).",
        ),
    ] = None,
    with_model: Annotated[
        bool,
        typer.Option(
            "--with-model",
            help="Weigh every test by the model's token weights, as the service's generator "
            "replicas answer (statistic 'model'; the p-values stay exact). Each worker "
            "loads the model and runs one forward pass per text: slower than the default "
            "model-free scan. Use the model the texts were generated with.",
        ),
    ] = False,
    restart: Annotated[
        bool, typer.Option("--restart", help="Discard parts left by a different scan.")
    ] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress")] = False,
    actor: Annotated[
        str | None, typer.Option("--actor", help="Who runs the scan (audit log).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    group_by: Annotated[
        str | None,
        typer.Option(
            "--group-by",
            help="A column whose value groups rows (an account): each group is read "
            "together (one exact joint test, a repeated (context, token) counted once, "
            "model-free) and written as one row per group.",
        ),
    ] = None,
) -> None:
    """Scan a corpus for watermarked texts: one result row per document (per group with
    --group-by)."""
    try:
        output_format(out)
    except InputError as exc:
        _fail(str(exc))
    if out.is_dir():
        _fail(f"--out {out} is a folder; name the output file")
    if mode not in ("detect", "provenance"):
        _fail(f"--mode must be detect or provenance, got {mode!r}")
    if engine not in ("local", "ray"):
        _fail(f"--engine must be local or ray, got {engine!r}")
    if num_bits is not None and not 1 <= num_bits <= 64:
        _fail(f"--num-bits must be in 1..64, got {num_bits}")
    if workers is not None and workers < 1:
        _fail("--workers must be at least 1")
    if with_model and group_by is not None:
        _fail("--with-model scans rows one by one; a --group-by read is model-free")
    if with_model:  # here, not in a worker: a missing model is a usage error
        from worldcup_core.models import ModelLoadError, resolve_model_dir

        try:
            found = resolve_model_dir(model, None, need_model=True)
        except ModelLoadError as exc:
            _fail(f"--with-model: {exc}")
        if not (found / "config.json").is_file():
            _fail(f"--with-model: {found} holds a tokenizer but no model (config.json)")
    if part_rows < 1 or max_chars < 1 or short_tokens < 0:
        _fail("--part-rows and --max-chars must be positive, --short-tokens not negative")
    session: StoreSession | None = None
    try:
        keys: ScanKeys
        if key_file:
            if store is not None or tenant is not None:
                _fail("--key-file cannot be combined with --store or --tenant")
            keys = keys_from_files(key_file, scheme_version, k, layers, num_bits, context_width)
        else:
            url = (
                store
                or os.environ.get("WORLDCUP_REDIS_URL")
                or os.environ.get("WORLDCUP_SQLITE_PATH")
            )
            if not url:
                _fail("no keys: pass --key-file, or --store with the master key")
            if mode == "detect" and tenant is None:
                _fail("--mode detect with the store needs --tenant")
            if mode == "provenance" and tenant is not None:
                _fail("--tenant is for --mode detect; provenance searches every tenant")
            master_key = master_key_from_env(master_key_file)
            opened = open_store(url, redis_prefix, cluster=redis_cluster)
            session = StoreSession(opened, master_key)
            keys = session.load_keys(tenant)
        spec = ScanSpec(
            keys,
            mode,
            Fields(text_field, id_field, max_chars, group_by),
            significance,
            short_tokens=short_tokens,
            model=model,
            with_model=with_model,
        )
        options = ScanOptions(
            tuple(inputs),
            out,
            engine=engine,
            workers=workers or os.cpu_count() or 1,
            part_rows=part_rows,
            ray_address=ray_address,
            with_registry=with_registry and session is not None,
            restart=restart,
            progress=not no_progress,
            actor=actor or _default_actor(),
        )
        if with_registry and session is None:
            typer.echo("warning: --with-registry needs the store; no metadata columns", err=True)
        if group_by is not None:
            from worldcup_scan.groups import scan_groups

            grouped = scan_groups(tuple(inputs), out, spec)
            typer.echo(json.dumps(grouped.as_dict()) if as_json else grouped.format())
            return
        summary = run_scan(options, spec, session)
    except (KeySourceError, InputError, ScanStateError, ValueError) as exc:
        _fail(str(exc))
    finally:
        if session is not None:
            session.close()
    typer.echo(json.dumps(summary.as_dict()) if as_json else summary.format())


def bench_scan(
    texts: Annotated[int, typer.Option(min=20, max=100_000, help="Texts in the corpus.")] = 400,
    keys: Annotated[
        str, typer.Option(help="Bank sizes for the per-core provenance figures.")
    ] = "100,1000",
    engines: Annotated[str, typer.Option(help="local,ray")] = "local,ray",
    engine_keys: Annotated[
        int, typer.Option(min=1, max=100_000, help="Bank size of the engine runs.")
    ] = 1000,
    worker_counts: Annotated[str, typer.Option("--workers", help="e.g. 1,2")] = "1,2",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Texts/s of a corpus scan for 1 and 2 workers on both engines, and per-core costs."""
    from worldcup_scan.bench import format_scan_bench, run_scan_bench

    try:
        sizes = [int(x) for x in keys.split(",") if x.strip()]
        counts = [int(x) for x in worker_counts.split(",") if x.strip()]
    except ValueError:
        _fail("--keys and --workers take comma-separated integers")
    names = [e.strip() for e in engines.split(",") if e.strip()]
    if any(e not in ("local", "ray") for e in names) or any(c < 1 for c in counts):
        _fail("--engines takes local and/or ray; --workers positive integers")

    def progress(msg: str) -> None:
        typer.echo(msg, err=True)

    result = run_scan_bench(texts, sizes, names, counts, progress, engine_keys)
    typer.echo(json.dumps(result) if as_json else format_scan_bench(result))
