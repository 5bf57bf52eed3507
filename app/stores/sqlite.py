"""SQLite store: the embedded default for single-node deployments and tests.

One connection guarded by a lock and driven from worker threads
(``asyncio.to_thread``) so the event loop never blocks on disk I/O. WAL mode
with ``synchronous=FULL`` makes every committed write durable before the call
returns; writes run in ``BEGIN IMMEDIATE`` transactions, which also serialise
several processes sharing one file (message ids stay unique across workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from app.stores.base import (
    ApiKeyRecord,
    AuditRecord,
    CaseRecord,
    Conflict,
    IdempotencyRecord,
    KeyRecord,
    ProbeDecision,
    RateDecision,
    RegistryEntry,
    RegistryFull,
    RegistrySize,
    StoreUnavailable,
    TenantRecord,
    api_key_from_json,
    api_key_to_json,
    audit_from_json,
    audit_to_json,
    case_from_json,
    case_to_json,
    check_tenant_id,
    compact_json,
)

__all__ = ["SQLiteStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    tenant_id    TEXT PRIMARY KEY,
    name         TEXT NOT NULL UNIQUE,
    api_key_hash TEXT NOT NULL UNIQUE,
    created_at   REAL NOT NULL,
    scopes       TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS keys (
    tenant_id     TEXT NOT NULL REFERENCES tenants(tenant_id),
    version       INTEGER NOT NULL,
    wrapped_key   BLOB NOT NULL,
    created_at    REAL NOT NULL,
    groups        INTEGER NOT NULL,
    layers        INTEGER NOT NULL,
    alpha         REAL NOT NULL,
    context_width INTEGER NOT NULL,
    scheme        TEXT NOT NULL DEFAULT 'worldcup-v1',
    PRIMARY KEY (tenant_id, version)
);
CREATE TABLE IF NOT EXISTS messages (
    tenant_id   TEXT NOT NULL,
    message_id  INTEGER NOT NULL,
    key_version INTEGER NOT NULL,
    num_bits    INTEGER NOT NULL,
    metadata    TEXT NOT NULL,
    issued_at   REAL NOT NULL,
    PRIMARY KEY (tenant_id, message_id)
);
CREATE INDEX IF NOT EXISTS messages_by_key
    ON messages (tenant_id, key_version, num_bits, message_id);
CREATE TABLE IF NOT EXISTS registry_counts (
    tenant_id   TEXT NOT NULL,
    key_version INTEGER NOT NULL,
    num_bits    INTEGER NOT NULL,
    live        INTEGER NOT NULL DEFAULT 0,
    expired     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, key_version, num_bits)
);
CREATE TABLE IF NOT EXISTS registry_state (
    tenant_id      TEXT PRIMARY KEY,
    retention_days REAL,
    expired_below  INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS idempotency (
    tenant_id   TEXT NOT NULL,
    key         TEXT NOT NULL,
    body_hash   TEXT NOT NULL,
    status_code INTEGER NOT NULL,
    response    TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency (expires_at);
CREATE TABLE IF NOT EXISTS responses (
    tenant_id   TEXT NOT NULL,
    response_id TEXT NOT NULL,
    record      TEXT NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (tenant_id, response_id)
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
CREATE TABLE IF NOT EXISTS api_keys (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    key_hash   TEXT NOT NULL UNIQUE,
    record     TEXT NOT NULL,
    revoked_at REAL,
    PRIMARY KEY (tenant_id, key_id)
);
CREATE TABLE IF NOT EXISTS probe_bands (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    band       TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant_id, key_id, band)
);
CREATE TABLE IF NOT EXISTS probe_clusters (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    sketch     BLOB NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant_id, key_id, cluster_id)
);
CREATE TABLE IF NOT EXISTS probe_hits (
    tenant_id  TEXT NOT NULL,
    key_id     TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    at         REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS probe_hits_by_cluster ON probe_hits (tenant_id, key_id, cluster_id, at);
CREATE INDEX IF NOT EXISTS probe_bands_expiry ON probe_bands (expires_at);
CREATE INDEX IF NOT EXISTS probe_clusters_expiry ON probe_clusters (expires_at);
CREATE TABLE IF NOT EXISTS audit (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cases (
    case_id    TEXT PRIMARY KEY,
    tenant_id  TEXT,
    batch_id   TEXT,
    created_at REAL NOT NULL,
    expires_at REAL,
    record     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS cases_by_tenant ON cases (tenant_id, created_at);
CREATE INDEX IF NOT EXISTS cases_by_batch ON cases (batch_id, created_at);
CREATE INDEX IF NOT EXISTS cases_expiry ON cases (expires_at);
CREATE TABLE IF NOT EXISTS marker (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    value TEXT NOT NULL
);
"""


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE takes the write lock up front: read-then-write is atomic."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # also after a failed COMMIT: never leave it open
            conn.execute("ROLLBACK")
        raise


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a file written by an older release up to the current schema."""
    columns = {row["name"] for row in conn.execute("PRAGMA table_info(keys)")}
    if "scheme" not in columns:  # key versions created before scheme worldcup-v2 existed
        conn.execute("ALTER TABLE keys ADD COLUMN scheme TEXT NOT NULL DEFAULT 'worldcup-v1'")
    columns = {row["name"] for row in conn.execute("PRAGMA table_info(messages)")}
    if "voided" not in columns:  # void_message: the row stays, so its id is never reused
        conn.execute("ALTER TABLE messages ADD COLUMN voided TEXT")
    counted = conn.execute("SELECT 1 FROM registry_counts LIMIT 1").fetchone()
    if counted is None:  # a registry written before the counters existed: count it once
        conn.execute(
            "INSERT INTO registry_counts (tenant_id, key_version, num_bits, live)"
            " SELECT tenant_id, key_version, num_bits, COUNT(*) FROM messages"
            " WHERE voided IS NULL GROUP BY tenant_id, key_version, num_bits"
        )


def _count(
    c: sqlite3.Connection,
    tenant_id: str,
    key_version: int,
    num_bits: int,
    live: int,
    expired: int = 0,
) -> None:
    """Move a registry's counters (inside the caller's transaction)."""
    c.execute(
        "INSERT INTO registry_counts (tenant_id, key_version, num_bits, live, expired)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant_id, key_version, num_bits)"
        " DO UPDATE SET live = live + excluded.live, expired = expired + excluded.expired",
        (tenant_id, int(key_version), int(num_bits), live, expired),
    )


def _tenant(row: sqlite3.Row | None) -> TenantRecord | None:
    if row is None:
        return None
    return TenantRecord(
        tenant_id=row["tenant_id"],
        name=row["name"],
        api_key_hash=row["api_key_hash"],
        created_at=row["created_at"],
        scopes=tuple(json.loads(row["scopes"])),
    )


def _key(row: sqlite3.Row) -> KeyRecord:
    return KeyRecord(
        tenant_id=row["tenant_id"],
        version=row["version"],
        wrapped_key=bytes(row["wrapped_key"]),
        created_at=row["created_at"],
        groups=row["groups"],
        layers=row["layers"],
        alpha=row["alpha"],
        context_width=row["context_width"],
        scheme=row["scheme"],
    )


class SQLiteStore:
    """:class:`~app.stores.base.Store` on a local SQLite file (or ``":memory:"``)."""

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
        return f"SQLiteStore({self._path!r})"

    # -- plumbing -------------------------------------------------------------

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
            conn.executescript(_SCHEMA)
            _migrate(conn)
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

    # -- lifecycle ------------------------------------------------------------

    async def ping(self) -> None:
        await self._run(lambda c: c.execute("SELECT 1").fetchone())

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

    # -- tenants --------------------------------------------------------------

    async def create_tenant(self, tenant: TenantRecord, key: KeyRecord) -> None:
        if key.tenant_id != tenant.tenant_id or key.version != 1:
            raise ValueError("the first key must be version 1 of the same tenant")
        check_tenant_id(tenant.tenant_id)

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                if c.execute("SELECT 1 FROM tenants WHERE name = ?", (tenant.name,)).fetchone():
                    raise Conflict(f"tenant name {tenant.name!r} already exists")
                try:
                    c.execute(
                        "INSERT INTO tenants VALUES (?, ?, ?, ?, ?)",
                        (
                            tenant.tenant_id,
                            tenant.name,
                            tenant.api_key_hash,
                            tenant.created_at,
                            compact_json(list(tenant.scopes)),
                        ),
                    )
                except sqlite3.IntegrityError:
                    raise Conflict("tenant id or api key hash already exists") from None
                self._insert_key(c, key)

        await self._run(op)

    @staticmethod
    def _insert_key(c: sqlite3.Connection, key: KeyRecord) -> None:
        c.execute(
            "INSERT INTO keys (tenant_id, version, wrapped_key, created_at, groups, layers,"
            " alpha, context_width, scheme) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key.tenant_id,
                key.version,
                key.wrapped_key,
                key.created_at,
                key.groups,
                key.layers,
                key.alpha,
                key.context_width,
                key.scheme,
            ),
        )

    async def get_tenant(self, tenant_id: str) -> TenantRecord | None:
        check_tenant_id(tenant_id)
        return await self._run(
            lambda c: _tenant(
                c.execute("SELECT * FROM tenants WHERE tenant_id = ?", (tenant_id,)).fetchone()
            )
        )

    async def tenant_by_api_key_hash(self, api_key_hash: str) -> TenantRecord | None:
        return await self._run(
            lambda c: _tenant(
                c.execute(
                    "SELECT * FROM tenants WHERE api_key_hash = ?", (api_key_hash,)
                ).fetchone()
            )
        )

    async def list_tenants(self) -> list[TenantRecord]:
        rows = await self._run(
            lambda c: c.execute("SELECT * FROM tenants ORDER BY created_at, tenant_id").fetchall()
        )
        return [t for r in rows if (t := _tenant(r)) is not None]

    async def set_scopes(self, tenant_id: str, scopes: tuple[str, ...]) -> TenantRecord | None:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> TenantRecord | None:
            with _transaction(c):
                c.execute(
                    "UPDATE tenants SET scopes = ? WHERE tenant_id = ?",
                    (compact_json(list(scopes)), tenant_id),
                )
                row = c.execute("SELECT * FROM tenants WHERE tenant_id = ?", (tenant_id,))
                return _tenant(row.fetchone())

        return await self._run(op)

    # -- watermark keys -------------------------------------------------------

    async def add_key_version(self, key: KeyRecord) -> None:
        check_tenant_id(key.tenant_id)

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                if not c.execute(
                    "SELECT 1 FROM tenants WHERE tenant_id = ?", (key.tenant_id,)
                ).fetchone():
                    raise Conflict(f"unknown tenant {key.tenant_id!r}")
                (latest,) = c.execute(
                    "SELECT COALESCE(MAX(version), 0) FROM keys WHERE tenant_id = ?",
                    (key.tenant_id,),
                ).fetchone()
                if key.version != latest + 1:
                    raise Conflict(f"key version must be {latest + 1}, got {key.version}")
                self._insert_key(c, key)

        await self._run(op)

    async def key_versions(self, tenant_id: str) -> list[KeyRecord]:
        check_tenant_id(tenant_id)
        rows = await self._run(
            lambda c: c.execute(
                "SELECT * FROM keys WHERE tenant_id = ? ORDER BY version", (tenant_id,)
            ).fetchall()
        )
        return [_key(r) for r in rows]

    async def replace_wrapped_keys(self, keys: list[KeyRecord]) -> None:
        """All-or-nothing; Conflict if a version does not exist."""

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                for k in keys:
                    cur = c.execute(
                        "UPDATE keys SET wrapped_key = ? WHERE tenant_id = ? AND version = ?",
                        (k.wrapped_key, k.tenant_id, k.version),
                    )
                    if cur.rowcount != 1:
                        raise Conflict(f"no key version {k.version} for {k.tenant_id!r}")

        await self._run(op)

    async def all_key_versions(self) -> list[KeyRecord]:
        rows = await self._run(
            lambda c: c.execute("SELECT * FROM keys ORDER BY tenant_id, version").fetchall()
        )
        return [_key(r) for r in rows]

    # -- registry -------------------------------------------------------------

    async def allocate_message(
        self,
        tenant_id: str,
        key_version: int,
        num_bits: int,
        metadata: dict[str, Any],
        issued_at: float,
        max_id: int | None = None,
    ) -> RegistryEntry:
        """Next id = max + 1 inside BEGIN IMMEDIATE; committed (fsynced) before returning."""
        check_tenant_id(tenant_id)
        meta = compact_json(metadata)

        def op(c: sqlite3.Connection) -> int:
            with _transaction(c):
                (next_id,) = c.execute(
                    "SELECT MAX(COALESCE((SELECT MAX(message_id) FROM messages"
                    " WHERE tenant_id = ?), 0) + 1, COALESCE((SELECT expired_below"
                    " FROM registry_state WHERE tenant_id = ?), 0))",
                    (tenant_id, tenant_id),
                ).fetchone()
                if max_id is not None and next_id > max_id:
                    raise RegistryFull(f"no message id left below {max_id}")
                c.execute(
                    "INSERT INTO messages (tenant_id, message_id, key_version, num_bits,"
                    " metadata, issued_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (tenant_id, next_id, key_version, num_bits, meta, issued_at),
                )
                _count(c, tenant_id, key_version, num_bits, live=1)
            return int(next_id)

        message_id = await self._run(op)
        return RegistryEntry(
            tenant_id=tenant_id,
            message_id=message_id,
            key_version=key_version,
            num_bits=num_bits,
            metadata=json.loads(meta),  # same shape a later read returns
            issued_at=issued_at,
        )

    async def registry_entry(self, tenant_id: str, message_id: int) -> RegistryEntry | None:
        check_tenant_id(tenant_id)
        row = await self._run(
            lambda c: c.execute(
                "SELECT * FROM messages WHERE tenant_id = ? AND message_id = ? AND voided IS NULL",
                (tenant_id, int(message_id)),
            ).fetchone()
        )
        if row is None:
            return None
        return RegistryEntry(
            tenant_id=row["tenant_id"],
            message_id=row["message_id"],
            key_version=row["key_version"],
            num_bits=row["num_bits"],
            metadata=json.loads(row["metadata"]),
            issued_at=row["issued_at"],
        )

    async def message_ids(
        self, tenant_id: str, key_version: int, num_bits: int, after: int = 0
    ) -> list[int]:
        check_tenant_id(tenant_id)
        rows = await self._run(
            lambda c: c.execute(
                "SELECT message_id FROM messages WHERE tenant_id = ? AND key_version = ?"
                " AND num_bits = ? AND voided IS NULL AND message_id > ? ORDER BY message_id",
                (tenant_id, int(key_version), int(num_bits), int(after)),
            ).fetchall()
        )
        return [int(r[0]) for r in rows]

    async def registry_bit_lengths(self, tenant_id: str, key_version: int) -> list[int]:
        check_tenant_id(tenant_id)
        rows = await self._run(
            lambda c: c.execute(
                "SELECT DISTINCT num_bits FROM messages"
                " WHERE tenant_id = ? AND key_version = ? ORDER BY num_bits",
                (tenant_id, int(key_version)),
            ).fetchall()
        )
        return [int(r[0]) for r in rows]

    async def void_message(self, tenant_id: str, message_id: int, reason: str) -> bool:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> bool:
            with _transaction(c):
                cur = c.execute(
                    "UPDATE messages SET voided = ?"
                    " WHERE tenant_id = ? AND message_id = ? AND voided IS NULL"
                    " RETURNING key_version, num_bits",
                    (reason, tenant_id, int(message_id)),
                )
                row = cur.fetchone()
                if row is not None:
                    _count(c, tenant_id, row[0], row[1], live=-1)
            return row is not None

        return bool(await self._run(op))

    # -- registry lookup and retention (issue #36) -----------------------------

    async def registry_size(self, tenant_id: str, key_version: int, num_bits: int) -> RegistrySize:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> RegistrySize:
            row = c.execute(
                "SELECT live, expired FROM registry_counts"
                " WHERE tenant_id = ? AND key_version = ? AND num_bits = ?",
                (tenant_id, int(key_version), int(num_bits)),
            ).fetchone()
            state = c.execute(
                "SELECT expired_below FROM registry_state WHERE tenant_id = ?", (tenant_id,)
            ).fetchone()
            (last,) = c.execute(
                "SELECT MAX(message_id) FROM messages WHERE tenant_id = ?", (tenant_id,)
            ).fetchone()
            live, expired = (int(row[0]), int(row[1])) if row is not None else (0, 0)
            below = int(state[0]) if state is not None else 0
            return RegistrySize(live, expired, below, max(int(last or 0), below - 1, 0))

        return await self._run(op)

    async def issued_among(
        self, tenant_id: str, key_version: int, num_bits: int, message_ids: list[int]
    ) -> list[bool]:
        check_tenant_id(tenant_id)
        wanted = [int(i) for i in message_ids]
        if not wanted:
            return []

        def op(c: sqlite3.Connection) -> set[int]:
            found: set[int] = set()
            for start in range(0, len(wanted), 30_000):  # below SQLite's variable limit
                chunk = wanted[start : start + 30_000]
                rows = c.execute(
                    "SELECT message_id FROM messages WHERE tenant_id = ? AND key_version = ?"
                    " AND num_bits = ? AND voided IS NULL"
                    f" AND message_id IN ({','.join('?' * len(chunk))})",
                    (tenant_id, int(key_version), int(num_bits), *chunk),
                ).fetchall()
                found.update(int(r[0]) for r in rows)
            return found

        found = await self._run(op)
        return [i in found for i in wanted]

    async def set_registry_retention(self, tenant_id: str, days: float | None) -> None:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                c.execute(
                    "INSERT INTO registry_state (tenant_id, retention_days) VALUES (?, ?)"
                    " ON CONFLICT (tenant_id)"
                    " DO UPDATE SET retention_days = excluded.retention_days",
                    (tenant_id, None if days is None else float(days)),
                )

        await self._run(op)

    async def registry_retention(self, tenant_id: str) -> float | None:
        check_tenant_id(tenant_id)
        row = await self._run(
            lambda c: c.execute(
                "SELECT retention_days FROM registry_state WHERE tenant_id = ?", (tenant_id,)
            ).fetchone()
        )
        return None if row is None or row[0] is None else float(row[0])

    async def expire_registry(self, tenant_id: str, issued_before: float) -> int:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> int:
            with _transaction(c):
                (new,) = c.execute(
                    "SELECT COALESCE(MIN(message_id), (SELECT COALESCE(MAX(message_id), 0) + 1"
                    " FROM messages WHERE tenant_id = ?)) FROM messages"
                    " WHERE tenant_id = ? AND issued_at >= ? AND voided IS NULL",
                    (tenant_id, tenant_id, float(issued_before)),
                ).fetchone()
                state = c.execute(
                    "SELECT expired_below FROM registry_state WHERE tenant_id = ?", (tenant_id,)
                ).fetchone()
                old = int(state[0]) if state is not None else 0
                if int(new) <= max(old, 1):  # ids start at 1
                    return 0
                c.execute(
                    "INSERT INTO registry_state (tenant_id, expired_below) VALUES (?, ?)"
                    " ON CONFLICT (tenant_id) DO UPDATE SET expired_below = excluded.expired_below",
                    (tenant_id, int(new)),
                )
                gone = c.execute(
                    "SELECT key_version, num_bits, COUNT(*) FROM messages WHERE tenant_id = ?"
                    " AND message_id < ? AND voided IS NULL GROUP BY key_version, num_bits",
                    (tenant_id, int(new)),
                ).fetchall()
                for kv, bits, n in gone:
                    _count(c, tenant_id, kv, bits, live=-n, expired=n)
                c.execute(
                    "DELETE FROM messages WHERE tenant_id = ? AND message_id < ?",
                    (tenant_id, int(new)),
                )
            return sum(int(n) for _, _, n in gone)

        return await self._run(op)

    # -- audit log ------------------------------------------------------------

    async def append_audit(self, record: AuditRecord) -> None:
        data = audit_to_json(record)

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                c.execute("INSERT INTO audit (record) VALUES (?)", (data,))

        await self._run(op)

    async def audit_log(self, limit: int) -> list[AuditRecord]:
        rows = await self._run(
            lambda c: c.execute(
                "SELECT id, record FROM audit ORDER BY id DESC LIMIT ?", (max(1, int(limit)),)
            ).fetchall()
        )
        return [audit_from_json(row["record"], str(row["id"])) for row in rows]

    # -- API keys -------------------------------------------------------------

    async def add_api_key(self, key: ApiKeyRecord) -> bool:
        check_tenant_id(key.tenant_id)
        data = api_key_to_json(key)

        def op(c: sqlite3.Connection) -> bool:
            with _transaction(c):
                exists = c.execute(
                    "SELECT 1 FROM api_keys WHERE tenant_id = ? AND key_id = ?",
                    (key.tenant_id, key.key_id),
                ).fetchone()
                if exists:
                    return False
                try:
                    c.execute(
                        "INSERT INTO api_keys VALUES (?, ?, ?, ?, ?)",
                        (key.tenant_id, key.key_id, key.key_hash, data, key.revoked_at),
                    )
                except sqlite3.IntegrityError:
                    raise Conflict("api key hash already in use") from None
                return True

        return await self._run(op)

    async def api_key_by_hash(self, key_hash: str) -> ApiKeyRecord | None:
        row = await self._run(
            lambda c: c.execute(
                "SELECT record, revoked_at FROM api_keys WHERE key_hash = ?", (key_hash,)
            ).fetchone()
        )
        return None if row is None else api_key_from_json(row["record"], row["revoked_at"])

    async def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        check_tenant_id(tenant_id)
        rows = await self._run(
            lambda c: c.execute(
                "SELECT record, revoked_at FROM api_keys WHERE tenant_id = ?", (tenant_id,)
            ).fetchall()
        )
        keys = [api_key_from_json(r["record"], r["revoked_at"]) for r in rows]
        return sorted(keys, key=lambda k: (k.created_at, k.key_id))

    async def revoke_api_key(self, tenant_id: str, key_id: str, at: float) -> ApiKeyRecord | None:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> ApiKeyRecord | None:
            with _transaction(c):
                c.execute(
                    "UPDATE api_keys SET revoked_at = ? WHERE tenant_id = ? AND key_id = ?"
                    " AND revoked_at IS NULL",
                    (at, tenant_id, key_id),
                )
                row = c.execute(
                    "SELECT record, revoked_at FROM api_keys WHERE tenant_id = ? AND key_id = ?",
                    (tenant_id, key_id),
                ).fetchone()
            return None if row is None else api_key_from_json(row["record"], row["revoked_at"])

        return await self._run(op)

    # -- probe accounting -----------------------------------------------------

    async def probe_candidates(
        self, tenant_id: str, key_id: str, bands: list[str], limit: int = 8, min_hits: int = 1
    ) -> list[tuple[str, bytes]]:
        check_tenant_id(tenant_id)
        if not bands or limit <= 0:
            return []
        now = self._clock()
        marks = ",".join("?" * len(bands))

        def op(c: sqlite3.Connection) -> list[tuple[str, bytes]]:
            rows = c.execute(
                "SELECT k.cluster_id, k.sketch, COUNT(*) AS n FROM probe_bands b"
                " JOIN probe_clusters k"
                " ON k.tenant_id = b.tenant_id AND k.key_id = b.key_id"
                " AND k.cluster_id = b.cluster_id"
                f" WHERE b.tenant_id = ? AND b.key_id = ? AND b.band IN ({marks})"
                " AND b.expires_at > ? AND k.expires_at > ?"
                " GROUP BY k.cluster_id HAVING n >= ? ORDER BY n DESC, k.cluster_id LIMIT ?",
                (tenant_id, key_id, *bands, now, now, min_hits, limit),
            ).fetchall()
            return [(r["cluster_id"], bytes(r["sketch"])) for r in rows]

        return await self._run(op)

    async def probe_hit(
        self,
        tenant_id: str,
        key_id: str,
        cluster_id: str,
        sketch: bytes | None,
        bands: list[str],
        window_s: float,
        budget: int,
    ) -> ProbeDecision:
        check_tenant_id(tenant_id)
        now = self._clock()
        expires = now + window_s
        ident = (tenant_id, key_id, cluster_id)

        def op(c: sqlite3.Connection) -> ProbeDecision:
            # Probe records are short-lived counters: losing the last few to a power
            # cut is harmless, so these commits skip the fsync (WAL, synchronous=NORMAL).
            c.execute("PRAGMA synchronous=NORMAL")
            try:
                with _transaction(c):
                    self._sweep_probes(c, now)
                    c.execute(
                        "DELETE FROM probe_hits WHERE tenant_id = ? AND key_id = ?"
                        " AND cluster_id = ? AND at <= ?",
                        (*ident, now - window_s),
                    )
                    hits = [
                        float(r[0])
                        for r in c.execute(
                            "SELECT at FROM probe_hits WHERE tenant_id = ? AND key_id = ?"
                            " AND cluster_id = ? ORDER BY at",
                            ident,
                        )
                    ]
                    if len(hits) >= budget:
                        retry = max(0.0, hits[0] + window_s - now) if hits else window_s
                        return ProbeDecision(False, len(hits), retry)
                    c.execute("INSERT INTO probe_hits VALUES (?, ?, ?, ?)", (*ident, now))
                    if sketch is not None:
                        c.execute(
                            "INSERT OR REPLACE INTO probe_clusters VALUES (?, ?, ?, ?, ?)",
                            (*ident, sketch, expires),
                        )
                        c.executemany(
                            "INSERT OR REPLACE INTO probe_bands VALUES (?, ?, ?, ?, ?)",
                            [(tenant_id, key_id, b, cluster_id, expires) for b in bands],
                        )
                    else:
                        c.execute(
                            "UPDATE probe_clusters SET expires_at = ? WHERE tenant_id = ?"
                            " AND key_id = ? AND cluster_id = ?",
                            (expires, *ident),
                        )
                    return ProbeDecision(True, len(hits) + 1, 0.0)
            finally:
                c.execute("PRAGMA synchronous=FULL")

        return await self._run(op)

    def _sweep_probes(self, c: sqlite3.Connection, now: float) -> None:
        """Drop expired probe rows now and then (bounded table growth)."""
        self._probe_calls += 1
        if self._probe_calls % 256:
            return
        c.execute("DELETE FROM probe_bands WHERE expires_at <= ?", (now,))
        c.execute("DELETE FROM probe_clusters WHERE expires_at <= ?", (now,))
        c.execute(
            "DELETE FROM probe_hits WHERE NOT EXISTS (SELECT 1 FROM probe_clusters k"
            " WHERE k.tenant_id = probe_hits.tenant_id AND k.key_id = probe_hits.key_id"
            " AND k.cluster_id = probe_hits.cluster_id)"
        )

    # -- rate limits ----------------------------------------------------------

    async def take_tokens(
        self, tenant_id: str, rate_per_s: float, burst: float, cost: float
    ) -> RateDecision:
        check_tenant_id(tenant_id)
        now = time.monotonic()
        with self._bucket_lock:
            tokens, ts = self._buckets.get(tenant_id, (burst, now))
            tokens = min(burst, tokens + max(0.0, now - ts) * rate_per_s)
            if tokens >= cost:
                decision = RateDecision(True, 0.0, tokens - cost)
                tokens -= cost
            else:
                decision = RateDecision(False, (cost - tokens) / rate_per_s, tokens)
            self._buckets[tenant_id] = (tokens, now)
        return decision

    # -- idempotency ----------------------------------------------------------

    async def idempotency_get(self, tenant_id: str, key: str) -> IdempotencyRecord | None:
        check_tenant_id(tenant_id)
        now = self._clock()
        row = await self._run(
            lambda c: c.execute(
                "SELECT * FROM idempotency WHERE tenant_id = ? AND key = ? AND expires_at > ?",
                (tenant_id, key, now),
            ).fetchone()
        )
        if row is None:
            return None
        return IdempotencyRecord(
            body_hash=row["body_hash"],
            status_code=row["status_code"],
            response=json.loads(row["response"]),
        )

    async def idempotency_put(
        self,
        tenant_id: str,
        key: str,
        record: IdempotencyRecord,
        ttl_s: int,
        overwrite: bool = False,
    ) -> bool:
        check_tenant_id(tenant_id)
        now = self._clock()
        response = compact_json(record.response)

        def op(c: sqlite3.Connection) -> bool:
            with _transaction(c):
                # Expired rows count as absent; sweeping them here also bounds table growth.
                c.execute("DELETE FROM idempotency WHERE expires_at <= ?", (now,))
                verb = "INSERT OR REPLACE" if overwrite else "INSERT OR IGNORE"
                cur = c.execute(
                    f"{verb} INTO idempotency VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        tenant_id,
                        key,
                        record.body_hash,
                        record.status_code,
                        response,
                        now + max(1, int(ttl_s)),
                    ),
                )
                return cur.rowcount == 1

        return await self._run(op)

    async def idempotency_delete(self, tenant_id: str, key: str) -> None:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                c.execute(
                    "DELETE FROM idempotency WHERE tenant_id = ? AND key = ?", (tenant_id, key)
                )

        await self._run(op)

    # -- console cases --------------------------------------------------------

    async def put_case(self, case: CaseRecord) -> None:
        data = case_to_json(case)

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                c.execute(
                    "DELETE FROM cases WHERE expires_at IS NOT NULL AND expires_at <= ?",
                    (case.created_at,),
                )
                c.execute(
                    "INSERT OR REPLACE INTO cases (case_id, tenant_id, batch_id, created_at, "
                    "expires_at, record) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        case.case_id,
                        case.tenant_id,
                        case.batch_id,
                        case.created_at,
                        case.expires_at,
                        data,
                    ),
                )

        await self._run(op)

    # -- stored responses -----------------------------------------------------

    async def response_put(
        self, tenant_id: str, response_id: str, record: dict[str, Any], ttl_s: int
    ) -> None:
        check_tenant_id(tenant_id)
        now = self._clock()
        raw = compact_json(record)

        def op(c: sqlite3.Connection) -> None:
            with _transaction(c):
                # expired rows are swept here, which bounds the table's growth
                c.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
                c.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                    (tenant_id, response_id, raw, now + max(1, int(ttl_s))),
                )

        await self._run(op)

    async def get_case(self, case_id: str, now: float) -> CaseRecord | None:
        row = await self._run(
            lambda c: c.execute(
                "SELECT record FROM cases WHERE case_id = ? "
                "AND (expires_at IS NULL OR expires_at > ?)",
                (case_id, now),
            ).fetchone()
        )
        return None if row is None else case_from_json(row["record"])

    async def list_cases(
        self, tenant_id: str | None, batch_id: str | None, limit: int, now: float
    ) -> list[CaseRecord]:
        where = ["(expires_at IS NULL OR expires_at > ?)"]
        args: list[Any] = [now]
        if tenant_id is not None:
            where.append("tenant_id = ?")
            args.append(tenant_id)
        if batch_id is not None:
            where.append("batch_id = ?")
            args.append(batch_id)
        sql = (
            f"SELECT record FROM cases WHERE {' AND '.join(where)} "
            "ORDER BY created_at DESC, case_id DESC LIMIT ?"
        )
        rows = await self._run(lambda c: c.execute(sql, (*args, max(1, int(limit)))).fetchall())
        return [case_from_json(r["record"]) for r in rows]

    async def delete_case(self, case_id: str) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            with _transaction(c):
                return c.execute("DELETE FROM cases WHERE case_id = ?", (case_id,)).rowcount > 0

        return await self._run(op)

    async def response_get(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        check_tenant_id(tenant_id)
        now = self._clock()
        row = await self._run(
            lambda c: c.execute(
                "SELECT record FROM responses "
                "WHERE tenant_id = ? AND response_id = ? AND expires_at > ?",
                (tenant_id, response_id, now),
            ).fetchone()
        )
        if row is None:
            return None
        record: dict[str, Any] = json.loads(row["record"])
        return record


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
