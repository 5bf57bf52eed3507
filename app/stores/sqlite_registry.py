"""The SQLite store's message registry: allocation, lookup counters and retention.

Ids are allocated as ``max + 1`` inside ``BEGIN IMMEDIATE``, which also serialises
several processes sharing one file, so ids stay unique across workers. A voided
message keeps its row (its id is never reused). ``registry_counts`` holds the live
and expired entries per (tenant, key version, payload length), moved in the same
transaction as the rows they count; ``registry_state`` holds a tenant's retention
and its ``expired_below`` watermark: ids below it have expired, and are never
handed out again (issue #36).
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Sequence
from typing import Any

import numpy as np

from app.stores.base import (
    RegistryEntry,
    RegistryFull,
    RegistrySize,
    check_tenant_id,
    compact_json,
)
from app.stores.sqlite_base import SQLiteBase
from worldcup_core.context_sketch import I64, conservative_update, estimate, flat_cells

_IN_CHUNK = 30_000  # ids per ``IN (...)`` query: below SQLite's variable limit


def _counters(c: sqlite3.Connection, tenant_id: str, key_version: int, flat: I64) -> I64:
    """The stored counters of ``flat`` (contexts x depth flat cell indices), 0 where none."""
    wanted = sorted(set(flat.ravel().tolist()))
    stored: dict[int, int] = {}
    for at in range(0, len(wanted), _IN_CHUNK):
        chunk = wanted[at : at + _IN_CHUNK]
        rows = c.execute(
            "SELECT cell, count FROM context_counters WHERE tenant_id = ? AND key_version = ?"
            f" AND cell IN ({','.join('?' * len(chunk))})",
            (tenant_id, key_version, *chunk),
        )
        stored.update((int(r[0]), int(r[1])) for r in rows)
    lookup = np.vectorize(lambda cell: stored.get(int(cell), 0), otypes=[np.int64])
    out: I64 = lookup(flat)
    return out


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


def _expired_below(c: sqlite3.Connection, tenant_id: str) -> int:
    """The tenant's retention watermark: every id below it has expired (0: none)."""
    row = c.execute(
        "SELECT expired_below FROM registry_state WHERE tenant_id = ?", (tenant_id,)
    ).fetchone()
    return int(row[0]) if row is not None else 0


def _blob(value: bytes | None) -> bytes | None:
    return None if value is None else bytes(value)


class SQLiteRegistry(SQLiteBase):
    # -- allocation and reads -------------------------------------------------

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

        message_id = await self._write(op)
        return RegistryEntry(
            tenant_id=tenant_id,
            message_id=message_id,
            key_version=key_version,
            num_bits=num_bits,
            metadata=json.loads(meta),  # same shape a later read returns
            issued_at=issued_at,
        )

    async def registry_entry(self, tenant_id: str, message_id: int) -> RegistryEntry | None:
        row = await self._one(
            "SELECT * FROM messages WHERE tenant_id = ? AND message_id = ? AND voided IS NULL",
            (check_tenant_id(tenant_id), int(message_id)),
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
            fingerprint=_blob(row["fingerprint"]),
        )

    async def count_contexts(
        self, tenant_id: str, key_version: int, cells: Sequence[Sequence[int]], width_log2: int
    ) -> None:
        check_tenant_id(tenant_id)
        flat = flat_cells(cells, distinct=True, width_log2=width_log2)
        if flat.size == 0:
            return
        version = int(key_version)

        def op(c: sqlite3.Connection) -> None:
            current = _counters(c, tenant_id, version, flat)
            updated = conservative_update(current).astype(np.int64)
            best: dict[int, int] = {}  # a counter two contexts share takes the larger
            for cell, value in zip(flat.ravel().tolist(), updated.ravel().tolist(), strict=True):
                best[cell] = max(value, best.get(cell, 0))
            c.executemany(
                "INSERT INTO context_counters (tenant_id, key_version, cell, count)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (tenant_id, key_version, cell)"
                " DO UPDATE SET count = MAX(count, excluded.count)",
                [(tenant_id, version, cell, value) for cell, value in best.items()],
            )

        await self._write(op)

    async def context_counts(
        self, tenant_id: str, key_version: int, cells: Sequence[Sequence[int]], width_log2: int
    ) -> list[int]:
        check_tenant_id(tenant_id)
        flat = flat_cells(cells, width_log2=width_log2)
        if flat.size == 0:
            return []
        version = int(key_version)
        current = await self._run(lambda c: _counters(c, tenant_id, version, flat))
        return [int(v) for v in estimate(current)]

    async def set_fingerprint(self, tenant_id: str, message_id: int, fingerprint: bytes) -> bool:
        check_tenant_id(tenant_id)
        fp = bytes(fingerprint)

        def op(c: sqlite3.Connection) -> bool:
            done = c.execute(
                "UPDATE messages SET fingerprint = ?"
                " WHERE tenant_id = ? AND message_id = ? AND voided IS NULL",
                (fp, tenant_id, int(message_id)),
            )
            return done.rowcount > 0

        return await self._write(op)

    async def registry_entries(
        self, tenant_id: str, message_ids: Sequence[int]
    ) -> list[RegistryEntry | None]:
        """One ``IN`` query per ``_IN_CHUNK`` ids, each its own locked call (a long read
        leaves room for other requests' queries between its chunks)."""
        check_tenant_id(tenant_id)
        wanted = [int(i) for i in message_ids]
        unique = sorted(set(wanted))
        found: dict[int, RegistryEntry] = {}

        def read(chunk: list[int], c: sqlite3.Connection) -> list[RegistryEntry]:
            rows = c.execute(
                "SELECT message_id, key_version, num_bits, metadata, issued_at, fingerprint"
                " FROM messages"
                " WHERE tenant_id = ? AND voided IS NULL"
                f" AND message_id IN ({','.join('?' * len(chunk))})",
                (tenant_id, *chunk),
            ).fetchall()
            return [
                RegistryEntry(
                    tenant_id, int(r[0]), int(r[1]), int(r[2]), json.loads(r[3]), r[4], _blob(r[5])
                )
                for r in rows
            ]

        for start in range(0, len(unique), _IN_CHUNK):
            chunk = unique[start : start + _IN_CHUNK]
            for entry in await self._run(functools.partial(read, chunk)):
                found[entry.message_id] = entry
        return [found.get(i) for i in wanted]

    async def message_ids(
        self, tenant_id: str, key_version: int, num_bits: int, after: int = 0
    ) -> list[int]:
        rows = await self._all(
            "SELECT message_id FROM messages WHERE tenant_id = ? AND key_version = ?"
            " AND num_bits = ? AND voided IS NULL AND message_id > ? ORDER BY message_id",
            (check_tenant_id(tenant_id), int(key_version), int(num_bits), int(after)),
        )
        return [int(r[0]) for r in rows]

    async def registry_bit_lengths(self, tenant_id: str, key_version: int) -> list[int]:
        rows = await self._all(
            "SELECT DISTINCT num_bits FROM messages"
            " WHERE tenant_id = ? AND key_version = ? ORDER BY num_bits",
            (check_tenant_id(tenant_id), int(key_version)),
        )
        return [int(r[0]) for r in rows]

    async def void_message(self, tenant_id: str, message_id: int, reason: str) -> bool:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> bool:
            row = c.execute(
                "UPDATE messages SET voided = ?"
                " WHERE tenant_id = ? AND message_id = ? AND voided IS NULL"
                " RETURNING key_version, num_bits",
                (reason, tenant_id, int(message_id)),
            ).fetchone()
            if row is None:
                return False
            _count(c, tenant_id, row[0], row[1], live=-1)
            return True

        return await self._write(op)

    # -- lookup and retention (issue #36) -------------------------------------

    async def registry_size(self, tenant_id: str, key_version: int, num_bits: int) -> RegistrySize:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> RegistrySize:
            row = c.execute(
                "SELECT live, expired FROM registry_counts"
                " WHERE tenant_id = ? AND key_version = ? AND num_bits = ?",
                (tenant_id, int(key_version), int(num_bits)),
            ).fetchone()
            below = _expired_below(c, tenant_id)
            (last,) = c.execute(
                "SELECT MAX(message_id) FROM messages WHERE tenant_id = ?", (tenant_id,)
            ).fetchone()
            live, expired = (int(row[0]), int(row[1])) if row is not None else (0, 0)
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
            for start in range(0, len(wanted), _IN_CHUNK):
                chunk = wanted[start : start + _IN_CHUNK]
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
        await self._write(
            lambda c: c.execute(
                "INSERT INTO registry_state (tenant_id, retention_days) VALUES (?, ?)"
                " ON CONFLICT (tenant_id) DO UPDATE SET retention_days = excluded.retention_days",
                (tenant_id, None if days is None else float(days)),
            )
        )

    async def registry_retention(self, tenant_id: str) -> float | None:
        row = await self._one(
            "SELECT retention_days FROM registry_state WHERE tenant_id = ?",
            (check_tenant_id(tenant_id),),
        )
        return None if row is None or row[0] is None else float(row[0])

    async def expire_registry(self, tenant_id: str, issued_before: float) -> int:
        check_tenant_id(tenant_id)

        def op(c: sqlite3.Connection) -> int:
            # the new watermark: the oldest live id issued since, else past the last id
            new = int(
                c.execute(
                    "SELECT COALESCE(MIN(message_id), (SELECT COALESCE(MAX(message_id), 0) + 1"
                    " FROM messages WHERE tenant_id = ?)) FROM messages"
                    " WHERE tenant_id = ? AND issued_at >= ? AND voided IS NULL",
                    (tenant_id, tenant_id, float(issued_before)),
                ).fetchone()[0]
            )
            if new <= max(_expired_below(c, tenant_id), 1):  # ids start at 1
                return 0
            c.execute(
                "INSERT INTO registry_state (tenant_id, expired_below) VALUES (?, ?)"
                " ON CONFLICT (tenant_id) DO UPDATE SET expired_below = excluded.expired_below",
                (tenant_id, new),
            )
            gone = c.execute(
                "SELECT key_version, num_bits, COUNT(*) FROM messages WHERE tenant_id = ?"
                " AND message_id < ? AND voided IS NULL GROUP BY key_version, num_bits",
                (tenant_id, new),
            ).fetchall()
            for kv, bits, n in gone:
                _count(c, tenant_id, kv, bits, live=-n, expired=n)
            c.execute(
                "DELETE FROM messages WHERE tenant_id = ? AND message_id < ?", (tenant_id, new)
            )
            return sum(int(n) for _, _, n in gone)

        return await self._write(op)
