"""The Redis store's message registry, bucketed by id range (see redis_layout).

Allocation is two writes, each one Lua script in one slot:

1. ``NEXT_ID`` in the tenant's slot: check the limit, ``INCR`` ``msgseq``, note the
   payload length. The id is unique because ``INCR`` is atomic on one primary.
2. ``PUT_ENTRY`` in the id's bucket slot: the entry and its index, written together
   and only if the id holds no other entry.

With ``wait_replicas`` > 0 each write is followed by ``WAIT`` on its connection, and
``allocate_message`` returns (so ``/generate`` acknowledges a text) only after both
were confirmed by that many replicas. A promoted replica therefore already holds the
counter and the entry of every acknowledged text. Should a counter still go back (an
increment lost with no ``WAIT``, or a replica promoted that had not acknowledged), the
next allocation meets an id that already holds an entry; ``PUT_ENTRY`` refuses it and
allocation moves on to a fresh id, so an acknowledged id never names a second entry.
A crash between the writes leaves an unused id (a gap): never handed out again.
"""

from __future__ import annotations

import json
from typing import Any, cast

from app.stores.base import RegistryEntry, RegistryFull, StoreUnavailable, compact_json
from app.stores.redis_base import RedisBase
from app.stores.redis_layout import bucket_of
from app.stores.redis_scripts import NEXT_ID, PUT_ENTRY, VOID_ENTRY

ALLOCATE_TRIES = 8  # ids tried when the counter went back (see the module docstring)


def _entry(tenant_id: str, message_id: int, raw: str) -> RegistryEntry:
    d = json.loads(raw)
    return RegistryEntry(
        tenant_id=tenant_id,
        message_id=int(message_id),
        key_version=int(d["key_version"]),
        num_bits=int(d["num_bits"]),
        metadata=d["metadata"],
        issued_at=float(d["issued_at"]),
    )


class RedisRegistry(RedisBase):
    def _init_registry(self) -> None:
        self._next_id = self._script(NEXT_ID)
        self._put_entry = self._script(PUT_ENTRY)
        self._void_entry = self._script(VOID_ENTRY)

    async def allocate_message(
        self,
        tenant_id: str,
        key_version: int,
        num_bits: int,
        metadata: dict[str, Any],
        issued_at: float,
        max_id: int | None = None,
    ) -> RegistryEntry:
        """Two scripts (counter, then entry), each acknowledged by replicas when set."""
        payload = compact_json(
            {
                "key_version": key_version,
                "num_bits": num_bits,
                "metadata": metadata,
                "issued_at": issued_at,
            }
        )
        k = self._keys
        seq = [k.t(tenant_id, "msgseq"), k.t(tenant_id, "msgbits", int(key_version))]
        limit = -1 if max_id is None else int(max_id)
        for _ in range(ALLOCATE_TRIES):
            async with self._guard():
                message_id = int(await self._eval_acked(self._next_id, seq, [num_bits, limit]))
            if message_id < 0:
                raise RegistryFull(f"no message id left below {max_id}")
            b = bucket_of(message_id)
            keys = [k.msgs(tenant_id, b), k.idx(tenant_id, b, key_version, num_bits)]
            async with self._guard():
                written = int(await self._eval_acked(self._put_entry, keys, [message_id, payload]))
            if written:
                return RegistryEntry(
                    tenant_id=tenant_id,
                    message_id=message_id,
                    key_version=key_version,
                    num_bits=num_bits,
                    metadata=json.loads(compact_json(metadata)),  # the shape a read returns
                    issued_at=issued_at,
                )
        raise StoreUnavailable("redis unavailable: the message counter is behind its entries")

    async def registry_entry(self, tenant_id: str, message_id: int) -> RegistryEntry | None:
        if int(message_id) < 1:
            return None
        key = self._keys.msgs(tenant_id, bucket_of(message_id))
        async with self._guard():
            raw = cast("str | None", await self._redis.hget(key, str(int(message_id))))
        return None if raw is None else _entry(tenant_id, message_id, raw)

    async def registry_entries(self, tenant_id: str, message_ids: list[int]) -> list[RegistryEntry]:
        """The entries of these ids that exist, in one round trip (one HMGET per bucket)."""
        by_bucket: dict[int, list[int]] = {}
        for mid in sorted({int(m) for m in message_ids if int(m) >= 1}):
            by_bucket.setdefault(bucket_of(mid), []).append(mid)
        if not by_bucket:
            return []
        async with self._guard():
            pipe = self._pipeline()
            for b, ids in by_bucket.items():
                pipe.hmget(self._keys.msgs(tenant_id, b), [str(i) for i in ids])
            rows: list[list[str | None]] = await pipe.execute()
        return [
            _entry(tenant_id, mid, raw)
            for ids, raws in zip(by_bucket.values(), rows, strict=True)
            for mid, raw in zip(ids, raws, strict=True)
            if raw is not None
        ]

    async def _buckets(self, tenant_id: str) -> int:
        async with self._guard():
            last = cast("str | None", await self._redis.get(self._keys.t(tenant_id, "msgseq")))
        return 0 if last is None else bucket_of(int(last)) + 1

    async def message_ids(self, tenant_id: str, key_version: int, num_bits: int) -> list[int]:
        buckets = await self._buckets(tenant_id)
        if not buckets:
            return []
        async with self._guard():
            pipe = self._pipeline()
            for b in range(buckets):
                pipe.zrange(self._keys.idx(tenant_id, b, key_version, num_bits), 0, -1)
            chunks: list[list[str]] = await pipe.execute()
        return [int(i) for chunk in chunks for i in chunk]  # buckets in id order

    async def registry_bit_lengths(self, tenant_id: str, key_version: int) -> list[int]:
        key = self._keys.t(tenant_id, "msgbits", int(key_version))
        async with self._guard():
            bits = cast("set[str]", await self._redis.smembers(key))
        return sorted(int(b) for b in bits)

    async def void_message(self, tenant_id: str, message_id: int, reason: str) -> bool:
        entry = await self.registry_entry(tenant_id, message_id)
        if entry is None:
            return False
        b = bucket_of(message_id)
        keys = [
            self._keys.msgs(tenant_id, b),
            self._keys.idx(tenant_id, b, entry.key_version, entry.num_bits),
        ]
        async with self._guard():  # msgseq is untouched: the id is never handed out again
            removed = await self._void_entry(keys=keys, args=[int(message_id)])
        return bool(int(removed))
