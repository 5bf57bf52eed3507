"""The SQLite store's records: the audit log, idempotency, stored responses, console cases.

Records that expire (idempotency, responses, cases) are filtered by ``expires_at``
on read, and the expired rows of a table are swept by each write to it, which
bounds the table's growth without a background job.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from app.stores.base import (
    AuditRecord,
    CaseRecord,
    IdempotencyRecord,
    audit_from_json,
    audit_to_json,
    case_from_json,
    case_to_json,
    check_tenant_id,
    compact_json,
)
from app.stores.sqlite_base import SQLiteBase, sweep_expired


class SQLiteRecords(SQLiteBase):
    # -- audit log ------------------------------------------------------------

    async def append_audit(self, record: AuditRecord) -> None:
        data = audit_to_json(record)
        await self._write(lambda c: c.execute("INSERT INTO audit (record) VALUES (?)", (data,)))

    async def audit_log(self, limit: int) -> list[AuditRecord]:
        rows = await self._all(
            "SELECT id, record FROM audit ORDER BY id DESC LIMIT ?", (max(1, int(limit)),)
        )
        return [audit_from_json(row["record"], str(row["id"])) for row in rows]

    # -- idempotency ----------------------------------------------------------

    async def idempotency_get(self, tenant_id: str, key: str) -> IdempotencyRecord | None:
        row = await self._one(
            "SELECT * FROM idempotency WHERE tenant_id = ? AND key = ? AND expires_at > ?",
            (check_tenant_id(tenant_id), key, self._clock()),
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
        verb = "INSERT OR REPLACE" if overwrite else "INSERT OR IGNORE"

        def op(c: sqlite3.Connection) -> bool:
            sweep_expired(c, "idempotency", now)  # expired rows count as absent
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

        return await self._write(op)

    async def idempotency_delete(self, tenant_id: str, key: str) -> None:
        check_tenant_id(tenant_id)
        await self._write(
            lambda c: c.execute(
                "DELETE FROM idempotency WHERE tenant_id = ? AND key = ?", (tenant_id, key)
            )
        )

    # -- stored responses -----------------------------------------------------

    async def response_put(
        self, tenant_id: str, response_id: str, record: dict[str, Any], ttl_s: int
    ) -> None:
        check_tenant_id(tenant_id)
        now = self._clock()
        raw = compact_json(record)

        def op(c: sqlite3.Connection) -> None:
            sweep_expired(c, "responses", now)
            c.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (tenant_id, response_id, raw, now + max(1, int(ttl_s))),
            )

        await self._write(op)

    async def response_get(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        row = await self._one(
            "SELECT record FROM responses"
            " WHERE tenant_id = ? AND response_id = ? AND expires_at > ?",
            (check_tenant_id(tenant_id), response_id, self._clock()),
        )
        if row is None:
            return None
        record: dict[str, Any] = json.loads(row["record"])
        return record

    # -- console cases --------------------------------------------------------

    async def put_case(self, case: CaseRecord) -> None:
        data = case_to_json(case)

        def op(c: sqlite3.Connection) -> None:
            sweep_expired(c, "cases", case.created_at)  # a NULL expires_at never matches
            c.execute(
                "INSERT OR REPLACE INTO cases (case_id, tenant_id, batch_id, created_at,"
                " expires_at, record) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    case.case_id,
                    case.tenant_id,
                    case.batch_id,
                    case.created_at,
                    case.expires_at,
                    data,
                ),
            )

        await self._write(op)

    async def get_case(self, case_id: str, now: float) -> CaseRecord | None:
        row = await self._one(
            "SELECT record FROM cases WHERE case_id = ? AND (expires_at IS NULL OR expires_at > ?)",
            (case_id, now),
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
        rows = await self._all(
            f"SELECT record FROM cases WHERE {' AND '.join(where)}"
            " ORDER BY created_at DESC, case_id DESC LIMIT ?",
            (*args, max(1, int(limit))),
        )
        return [case_from_json(r["record"]) for r in rows]

    async def delete_case(self, case_id: str) -> bool:
        return await self._write(
            lambda c: c.execute("DELETE FROM cases WHERE case_id = ?", (case_id,)).rowcount > 0
        )
