"""SQLite store: the embedded default for single-node deployments and tests.

One connection guarded by a lock and driven from worker threads
(``asyncio.to_thread``) so the event loop never blocks on disk I/O. WAL mode
with ``synchronous=FULL`` makes every committed write durable before the call
returns; writes run in ``BEGIN IMMEDIATE`` transactions, which also serialise
several processes sharing one file (message ids stay unique across workers).

Parts: :mod:`~app.stores.sqlite_base` (connection, lock, transactions),
:mod:`~app.stores.sqlite_schema` (tables and migrations),
:mod:`~app.stores.sqlite_tenants` (tenants, key versions, API keys),
:mod:`~app.stores.sqlite_registry` (the message registry, its counters and retention),
:mod:`~app.stores.sqlite_records` (audit log, idempotency, stored responses, cases),
:mod:`~app.stores.sqlite_limits` (probe accounting, rate limits).
"""

from __future__ import annotations

import asyncio
import sqlite3

from app.stores.sqlite_limits import SQLiteLimits
from app.stores.sqlite_records import SQLiteRecords
from app.stores.sqlite_registry import SQLiteRegistry
from app.stores.sqlite_tenants import SQLiteTenants

__all__ = ["SQLiteStore"]


class SQLiteStore(SQLiteTenants, SQLiteRegistry, SQLiteRecords, SQLiteLimits):
    """:class:`~app.stores.base.Store` on a local SQLite file (or ``":memory:"``)."""

    async def ping(self) -> None:
        await self._one("SELECT 1")

    async def ensure_marker(self, value: str) -> str:
        def run(c: sqlite3.Connection) -> str:
            c.execute("INSERT OR IGNORE INTO marker (id, value) VALUES (1, ?)", (value,))
            return str(c.execute("SELECT value FROM marker WHERE id = 1").fetchone()[0])

        return await self._run(run)

    async def marker(self) -> str | None:
        def run(c: sqlite3.Connection) -> str | None:
            try:
                row = c.execute("SELECT value FROM marker WHERE id = 1").fetchone()
            except sqlite3.OperationalError as exc:  # the table itself is gone
                if "no such table" in str(exc):
                    return None
                raise
            return None if row is None else str(row[0])

        return await self._run(run)

    async def close(self) -> None:
        def _close() -> None:
            with self._lock:
                self._closed = True
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None

        await asyncio.to_thread(_close)
