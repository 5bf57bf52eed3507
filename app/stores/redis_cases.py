"""Console cases on Redis: one key per case, beside global indexes (never one transaction).

A case and its indexes live in different slots, so they are written one after the
other: the case first, then its index entries (``put_case``); on delete the case goes
first, then its index entries (``delete_case``). An index entry without its case (a
delete that stopped half way, or an expired case) is dropped by the next listing that
meets it, so both orders repair themselves. A case whose index write was lost is still
reachable by id and is listed again once ``put_case`` is retried (it is idempotent).
"""

from __future__ import annotations

from typing import cast

from app.stores.base import CaseRecord, case_from_json, case_to_json, check_tenant_id
from app.stores.redis_base import RedisBase


class RedisCases(RedisBase):
    def _case_key(self, case_id: str) -> str:
        return self._keys.g("case", check_tenant_id(case_id))

    def _case_indexes(self, case: CaseRecord) -> list[str]:
        owner = check_tenant_id(case.tenant_id) if case.tenant_id is not None else "-"
        keys = [self._keys.g("cases", "all"), self._keys.g("cases", "t", owner)]
        if case.batch_id is not None:
            keys.append(self._keys.g("cases", "b", check_tenant_id(case.batch_id)))
        return keys

    async def put_case(self, case: CaseRecord) -> None:
        key = self._case_key(case.case_id)
        async with self._guard():
            if case.expires_at is not None:
                await self._redis.set(key, case_to_json(case), pxat=int(case.expires_at * 1000))
            else:
                await self._redis.set(key, case_to_json(case))
            pipe = self._pipeline()
            for index in self._case_indexes(case):
                pipe.zadd(index, {case.case_id: case.created_at})
            await pipe.execute()

    async def get_case(self, case_id: str, now: float) -> CaseRecord | None:
        try:
            key = self._case_key(case_id)
        except ValueError:
            return None
        raw = cast("str | None", await self._retry(lambda: self._redis.get(key)))
        if raw is None:
            return None
        case = case_from_json(raw)
        if case.expires_at is not None and case.expires_at <= now:
            return None
        return case

    async def list_cases(
        self, tenant_id: str | None, batch_id: str | None, limit: int, now: float
    ) -> list[CaseRecord]:
        g = self._keys.g
        if batch_id is not None:
            index = g("cases", "b", check_tenant_id(batch_id))
        elif tenant_id is not None:
            index = g("cases", "t", check_tenant_id(tenant_id))
        else:
            index = g("cases", "all")
        out: list[CaseRecord] = []
        gone: list[str] = []
        start, page = 0, 200
        while len(out) < limit:  # newest first, a page of ids at a time
            async with self._guard():
                chunk = cast(
                    "list[str]", await self._redis.zrevrange(index, start, start + page - 1)
                )
                if not chunk:
                    break
                pipe = self._pipeline()  # one GET per case: the cases live in many slots
                for c in chunk:
                    pipe.get(self._case_key(c))
                raws = cast("list[str | None]", await pipe.execute())
            start += page
            for case_id, raw in zip(chunk, raws, strict=True):
                case = case_from_json(raw) if raw is not None else None
                if case is None or (case.expires_at is not None and case.expires_at <= now):
                    gone.append(case_id)
                    continue
                if tenant_id is not None and case.tenant_id != tenant_id:
                    continue
                out.append(case)
                if len(out) >= limit:
                    break
        if gone:  # expired: their index entries go too
            async with self._guard():
                pipe = self._pipeline()
                pipe.zrem(index, *gone)
                pipe.zrem(g("cases", "all"), *gone)
                await pipe.execute()
        return out

    async def delete_case(self, case_id: str) -> bool:
        try:
            key = self._case_key(case_id)
        except ValueError:
            return False
        async with self._guard():
            raw = cast("str | None", await self._redis.get(key))
            if raw is None:
                return False
            case = case_from_json(raw)
            await self._redis.delete(key)
            pipe = self._pipeline()
            for index in self._case_indexes(case):
                pipe.zrem(index, case_id)
            await pipe.execute()
        return True
