"""The SQLite store's connection and plumbing, shared by the store's parts.

One connection guarded by a lock and driven from worker threads
(``asyncio.to_thread``) so the event loop never blocks on disk I/O. Any
``sqlite3.OperationalError`` (locked, disk I/O, cannot open, read-only) becomes
:class:`StoreUnavailable`, as does a lock not taken within ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from app.stores.base import StoreUnavailable
from app.stores.sqlite_schema import SCHEMA, migrate

T = TypeVar("T")


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE takes the write lock up front: read-then-write is atomic."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # also after a failed COMMIT: never leave it open
            conn.execute("ROLLBACK")
        raise


def sweep_expired(c: sqlite3.Connection, table: str, now: float) -> None:
    """Drop a table's rows whose ``expires_at`` has passed (bounded table growth).

    ``table`` is always one of the schema's literal names, never input.
    """
    c.execute(f"DELETE FROM {table} WHERE expires_at <= ?", (now,))


class SQLiteBase:
    """Connection, lock and process-local state shared by the SQLite store's parts."""

    def __init__(
        self,
        path: Path | str,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._path = str(path)
        self._timeout_s = timeout_s
        self._clock = clock  # injectable so tests can expire idempotency records
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        # Token buckets live in this process: the embedded store serves one node.
        self._buckets: dict[str, tuple[float, float]] = {}
        self._bucket_lock = threading.Lock()
        self._probe_calls = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def _open(self) -> sqlite3.Connection:
        _create_private(self._path)
        conn = sqlite3.connect(
            self._path,
            timeout=self._timeout_s,  # busy wait for another process's write lock
            isolation_level=None,  # autocommit; transactions are explicit
            check_same_thread=False,  # used from worker threads, one at a time (lock)
        )
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.executescript(SCHEMA)
            with transaction(conn):  # another process may be writing (or migrating) now
                migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _locked(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if not self._lock.acquire(timeout=self._timeout_s):
            raise StoreUnavailable("sqlite unavailable: store busy")
        try:
            if self._closed:
                raise StoreUnavailable("sqlite unavailable: store closed")
            if self._conn is None:
                self._conn = self._open()
            return fn(self._conn)
        except sqlite3.OperationalError as exc:  # locked, disk I/O, cannot open, read-only
            raise StoreUnavailable(f"sqlite unavailable: {exc}") from None
        finally:
            self._lock.release()

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self._locked, fn)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one ``BEGIN IMMEDIATE`` transaction, committed before returning."""

        def op(c: sqlite3.Connection) -> T:
            with transaction(c):
                return fn(c)

        return await self._run(op)

    async def _one(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Row | None:
        """One row of a read (outside any transaction), or None."""
        row: sqlite3.Row | None = await self._run(lambda c: c.execute(sql, args).fetchone())
        return row

    async def _all(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """Every row of a read (outside any transaction)."""
        rows: list[sqlite3.Row] = await self._run(lambda c: c.execute(sql, args).fetchall())
        return rows


def _create_private(path: str) -> None:
    """Create the database file 0600 whatever the umask, before SQLite would create it
    with the umask's mode: the registry holds tenants' metadata (possibly personal
    data). SQLite gives its -wal and -shm files the database file's mode."""
    if path == ":memory:" or path.startswith("file:"):
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    except OSError:
        return  # let sqlite3.connect report it (as StoreUnavailable)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by the umask
    finally:
        os.close(fd)
