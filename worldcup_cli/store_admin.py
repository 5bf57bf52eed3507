"""``worldcup store backup`` / ``worldcup store restore``: the registry, tenants, keys,
API keys and cases, saved and put back (app/stores/backup.py; docs/operations.md).

The store is the service's own: ``WORLDCUP_REDIS_URL`` (with ``WORLDCUP_REDIS_PREFIX``
and ``WORLDCUP_REDIS_CLUSTER``) when set, else ``WORLDCUP_SQLITE_PATH``; or the options.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, NoReturn

import typer

store_app = typer.Typer(
    help="Back up and restore the service's store (SQLite or Redis).",
    no_args_is_help=True,
)

RedisUrlOpt = Annotated[
    str | None,
    typer.Option("--redis-url", envvar="WORLDCUP_REDIS_URL", help="A Redis (or cluster node)."),
]
PrefixOpt = Annotated[str, typer.Option("--prefix", envvar="WORLDCUP_REDIS_PREFIX")]
ClusterOpt = Annotated[
    bool, typer.Option("--cluster", envvar="WORLDCUP_REDIS_CLUSTER", help="Redis Cluster.")
]
SqliteOpt = Annotated[
    Path,
    typer.Option("--sqlite-path", envvar="WORLDCUP_SQLITE_PATH", help="Used without a Redis URL."),
]


def fail(message: str) -> NoReturn:
    """One line, exit code 2: the CLI's contract for bad input (as worldcup_cli.main's)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _check_url(url: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        fail("--redis-url must be a redis://, rediss:// or unix:// URL")


@store_app.command("backup")
def backup(
    out: Annotated[Path, typer.Option("--out", help="The backup file to write.")],
    redis_url: RedisUrlOpt = None,
    prefix: PrefixOpt = "wc",
    cluster: ClusterOpt = False,
    sqlite_path: SqliteOpt = Path("worldcup.sqlite3"),
) -> None:
    """Save the store to one file while the service runs (SQLite: the online backup
    API; Redis: a logical dump of the namespace, also from a cluster)."""
    from redis.exceptions import RedisError

    from app.stores.backup import BackupError, backup_redis, backup_sqlite

    try:
        if redis_url:
            _check_url(redis_url)
            report = asyncio.run(backup_redis(redis_url, prefix, cluster, out))
        else:
            report = backup_sqlite(sqlite_path, out)
    except (BackupError, ValueError) as exc:
        fail(str(exc))
    except (RedisError, OSError) as exc:  # never the URL: it may hold a password
        fail(f"backup failed ({type(exc).__name__}); nothing was written to {out}")
    typer.echo(
        f"backed up the {report.store} store: {report.tenants} tenants, "
        f"{report.entries} registry entries"
        + (f", {report.keys} keys" if report.keys else "")
        + f" -> {out}"
    )


@store_app.command("restore")
def restore(
    source: Annotated[Path, typer.Option("--from", help="A file `store backup` wrote.")],
    redis_url: RedisUrlOpt = None,
    prefix: PrefixOpt = "wc",
    cluster: ClusterOpt = False,
    sqlite_path: SqliteOpt = Path("worldcup.sqlite3"),
    force: Annotated[
        bool, typer.Option("--force", help="Replace a store that is not empty.")
    ] = False,
) -> None:
    """Put a backup back, with the service stopped. Refuses a store that is not empty
    unless --force."""
    from redis.exceptions import RedisError

    from app.stores.backup import BackupError, restore_redis, restore_sqlite

    if not source.is_file():
        fail(f"cannot use {source}: no such file")
    try:
        if redis_url:
            _check_url(redis_url)
            report = asyncio.run(restore_redis(redis_url, prefix, cluster, source, force))
        else:
            report = restore_sqlite(source, sqlite_path, force)
    except (BackupError, ValueError) as exc:
        fail(str(exc))
    except (RedisError, OSError) as exc:
        fail(f"restore failed ({type(exc).__name__}); re-run it with --force")
    typer.echo(
        f"restored the {report.store} store: {report.tenants} tenants, "
        f"{report.entries} registry entries" + (f", {report.keys} keys" if report.keys else "")
    )
