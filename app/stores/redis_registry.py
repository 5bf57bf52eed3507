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

Retries (a failover, see :mod:`~app.stores.redis_base`). ``INCR`` is not idempotent,
but the allocation needs it not to be: an id is handed out only with the entry that
``PUT_ENTRY`` wrote for it, and ``PUT_ENTRY`` never writes over another entry. So
``NEXT_ID`` is re-run after a failed or unacknowledged attempt: if the first attempt
was applied, its id is a gap (never handed out), and if a promoted replica lacks it,
the second attempt takes the same id, which no one holds. ``PUT_ENTRY`` is re-run too:
it is idempotent by id and content (a retried write finds its own entry and answers
"written"; another entry under the id answers 0 and the allocation moves on). Two
allocations could only share an entry if the counter went back *and* both carried
identical metadata and issue time, i.e. the same entry. Ids lost to retries are counted
as issued (``msglive``), which errs towards the conservative registry-size correction.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from app.stores.base import (
    RegistryEntry,
    RegistryFull,
    RegistrySize,
    StoreUnavailable,
    check_tenant_id,
    compact_json,
)
from app.stores.redis_base import RedisBase
from app.stores.redis_layout import bucket_ids, bucket_of
from app.stores.redis_scripts import (
    ADVANCE_WATERMARK,
    COUNT_CONTEXTS,
    ISSUED_AMONG,
    MOVE_EXPIRED,
    NEXT_ID,
    NEXT_IDS,
    PUT_ENTRY,
    READ_CONTEXTS,
    SET_FINGERPRINT,
    VOID_ENTRY,
)
from worldcup_core.context_sketch import estimate, flat_cells

ALLOCATE_TRIES = 8  # ids tried when the counter went back (see the module docstring)
# bulk reads: short commands (the server never blocks long on one), a bounded reply a trip
ENTRIES_PER_HMGET = 1_000
HMGETS_PER_TRIP = 32


def _entry(tenant_id: str, message_id: int, raw: str) -> RegistryEntry:
    d = json.loads(raw)
    return RegistryEntry(
        tenant_id=tenant_id,
        message_id=int(message_id),
        key_version=int(d["key_version"]),
        num_bits=int(d["num_bits"]),
        metadata=d["metadata"],
        issued_at=float(d["issued_at"]),
        fingerprint=bytes.fromhex(d["fingerprint"]) if "fingerprint" in d else None,
    )


class RedisRegistry(RedisBase):
    def _init_registry(self) -> None:
        self._next_id = self._script(NEXT_ID)
        self._put_entry = self._script(PUT_ENTRY)
        self._void_entry = self._script(VOID_ENTRY)
        self._set_fingerprint = self._script(SET_FINGERPRINT)
        self._count_contexts = self._script(COUNT_CONTEXTS)
        self._read_contexts = self._script(READ_CONTEXTS)
        self._next_ids = self._script(NEXT_IDS)
        self._move_expired = self._script(MOVE_EXPIRED)
        self._advance_watermark = self._script(ADVANCE_WATERMARK)
        self._issued_among = self._script(ISSUED_AMONG)

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
        seq = [
            k.t(tenant_id, "msgseq"),
            k.t(tenant_id, "msgbits", int(key_version)),
            k.t(tenant_id, "msglive", int(key_version), int(num_bits)),
        ]
        limit = -1 if max_id is None else int(max_id)
        for _ in range(ALLOCATE_TRIES):
            message_id = int(
                await self._retry(lambda: self._eval_acked(self._next_id, seq, [num_bits, limit]))
            )
            if message_id < 0:
                raise RegistryFull(f"no message id left below {max_id}")
            b = bucket_of(message_id)
            keys = [k.msgs(tenant_id, b), k.idx(tenant_id, b, key_version, num_bits)]
            put = functools.partial(self._eval_acked, self._put_entry, keys, [message_id, payload])
            written = int(await self._retry(put))
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
        field = str(int(message_id))
        raw = cast("str | None", await self._retry(lambda: self._redis.hget(key, field)))
        return None if raw is None else _entry(tenant_id, message_id, raw)

    def _sketch(self, tenant_id: str, key_version: int) -> str:
        return self._keys.t(tenant_id, "ctxsketch", int(key_version))

    async def count_contexts(
        self, tenant_id: str, key_version: int, cells: Sequence[Sequence[int]], width_log2: int
    ) -> None:
        """One script on the tenant's slot, run once (see :meth:`Store.count_contexts`)."""
        flat = flat_cells(cells, distinct=True, width_log2=width_log2)
        if flat.size == 0:
            return
        keys = [self._sketch(tenant_id, key_version)]
        args = [flat.shape[1], *flat.ravel().tolist()]
        async with self._guard():
            await self._count_contexts(keys=keys, args=args)

    async def context_counts(
        self, tenant_id: str, key_version: int, cells: Sequence[Sequence[int]], width_log2: int
    ) -> list[int]:
        flat = flat_cells(cells, width_log2=width_log2)
        if flat.size == 0:
            return []
        keys = [self._sketch(tenant_id, key_version)]
        read = functools.partial(self._read_contexts, keys=keys, args=flat.ravel().tolist())
        got = cast("list[int]", await self._retry(read))
        return [int(v) for v in estimate(np.asarray(got, dtype=np.int64).reshape(flat.shape))]

    async def set_fingerprint(self, tenant_id: str, message_id: int, fingerprint: bytes) -> bool:
        """One script in the id's bucket slot (acknowledged by replicas when set); safe
        to retry: it writes the same value."""
        if int(message_id) < 1:
            return False
        keys = [self._keys.msgs(tenant_id, bucket_of(message_id))]
        args = [int(message_id), bytes(fingerprint).hex()]
        put = functools.partial(self._eval_acked, self._set_fingerprint, keys, args)
        return bool(int(await self._retry(put)))

    async def registry_entries(
        self, tenant_id: str, message_ids: Sequence[int]
    ) -> list[RegistryEntry | None]:
        """HMGETs of at most ``ENTRIES_PER_HMGET`` ids of one bucket each, pipelined
        ``HMGETS_PER_TRIP`` at a time (each trip a round trip per node)."""
        check_tenant_id(tenant_id)
        wanted = [int(i) for i in message_ids]
        raws = await self._hmget_ids(tenant_id, wanted)
        found = {mid: _entry(tenant_id, mid, raw) for mid, raw in raws.items()}
        return [found.get(i) for i in wanted]

    async def _hmget_ids(self, tenant_id: str, message_ids: Iterable[int]) -> dict[int, str]:
        """The JSON of those of ``message_ids`` that hold an entry. Every key is one
        bucket's hash (tag ``{tenant:bucket}``), one key per command: cluster-safe."""
        calls: list[tuple[str, list[int]]] = []
        unique = sorted({int(m) for m in message_ids if int(m) >= 1})
        for b, in_bucket in itertools.groupby(unique, key=bucket_of):
            ids = list(in_bucket)
            key = self._keys.msgs(tenant_id, b)
            for start in range(0, len(ids), ENTRIES_PER_HMGET):
                calls.append((key, ids[start : start + ENTRIES_PER_HMGET]))
        found: dict[int, str] = {}
        for start in range(0, len(calls), HMGETS_PER_TRIP):
            trip = calls[start : start + HMGETS_PER_TRIP]

            async def call(trip: list[tuple[str, list[int]]] = trip) -> list[list[str | None]]:
                pipe = self._pipeline()
                for key, ids in trip:
                    pipe.hmget(key, [str(i) for i in ids])
                return cast("list[list[str | None]]", await pipe.execute())

            rows = await self._retry(call)
            for (_, ids), raws in zip(trip, rows, strict=True):
                for mid, raw in zip(ids, raws, strict=True):
                    if raw is not None:
                        found[mid] = raw
        return found

    async def _buckets(self, tenant_id: str) -> int:
        key = self._keys.t(tenant_id, "msgseq")
        last = cast("str | None", await self._retry(lambda: self._redis.get(key)))
        return 0 if last is None else bucket_of(int(last)) + 1

    async def message_ids(
        self, tenant_id: str, key_version: int, num_bits: int, after: int = 0
    ) -> list[int]:
        buckets = await self._buckets(tenant_id)
        first = bucket_of(after + 1) if after > 0 else 0
        if first >= buckets:
            return []

        async def call() -> list[list[str]]:
            pipe = self._pipeline()
            for b in range(first, buckets):
                key = self._keys.idx(tenant_id, b, key_version, num_bits)
                if after > 0 and b == first:
                    pipe.zrangebyscore(key, f"({int(after)}", "+inf")
                else:
                    pipe.zrange(key, 0, -1)
            return cast("list[list[str]]", await pipe.execute())

        chunks = await self._retry(call)
        return [int(i) for chunk in chunks for i in chunk]  # buckets in id order

    async def registry_bit_lengths(self, tenant_id: str, key_version: int) -> list[int]:
        key = self._keys.t(tenant_id, "msgbits", int(key_version))
        bits = cast("set[str]", await self._retry(lambda: self._redis.smembers(key)))
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
        live = self._keys.t(tenant_id, "msglive", entry.key_version, entry.num_bits)
        async with self._guard():  # msgseq is untouched: the id is never handed out again
            removed = int(await self._void_entry(keys=keys, args=[int(message_id)]))
            if removed:  # counted once: only the call that removed the entry
                await self._redis.decr(live)
        return bool(removed)

    # -- lookup and retention (issue #36) -------------------------------------

    async def _raw_entries(self, tenant_id: str, message_ids: list[int]) -> list[str | None]:
        """The entries' JSON, aligned with ``message_ids``."""
        found = await self._hmget_ids(tenant_id, message_ids)
        return [found.get(int(mid)) for mid in message_ids]

    async def registry_size(self, tenant_id: str, key_version: int, num_bits: int) -> RegistrySize:
        t, kv, bits = self._keys.t, int(key_version), int(num_bits)
        keys = [
            t(tenant_id, "msglive", kv, bits),
            t(tenant_id, "msgexp", kv, bits),
            t(tenant_id, "msgexpired"),
            t(tenant_id, "msgseq"),
        ]
        # one tenant's keys: one slot, one MGET
        live, expired, below, last = await self._retry(lambda: self._redis.mget(keys))
        return RegistrySize(
            max(0, int(live or 0)), int(expired or 0), int(below or 0), int(last or 0)
        )

    async def issued_among(
        self, tenant_id: str, key_version: int, num_bits: int, message_ids: list[int]
    ) -> list[bool]:
        found = [False] * len(message_ids)
        by_bucket: dict[int, list[int]] = {}  # bucket -> positions in message_ids
        for pos, mid in enumerate(message_ids):
            if int(mid) >= 1:
                by_bucket.setdefault(bucket_of(mid), []).append(pos)
        if not by_bucket:
            return found
        calls = [
            (
                self._keys.idx(tenant_id, b, key_version, num_bits),
                " ".join(str(int(message_ids[p])) for p in positions),
            )
            for b, positions in by_bucket.items()
        ]
        # one script per bucket, hits only back: ~1 us an id
        replies = await self._retry(lambda: self._run_scripts(self._issued_among, calls))
        for positions, hits in zip(by_bucket.values(), replies, strict=True):
            for i in hits:
                found[positions[int(i) - 1]] = True
        return found

    async def _run_scripts(self, script: AsyncScript, calls: list[tuple[str, str]]) -> list[Any]:
        """One pipeline of a one-key script over many keys, loading the script where a
        node lacks it (a fresh node, or a promoted replica)."""
        for attempt in range(2):
            pipe = self._pipeline()
            for key, arg in calls:
                pipe.execute_command("EVALSHA", script.sha, 1, key, arg)
            try:
                return cast("list[Any]", await pipe.execute())
            except NoScriptError:
                if attempt:
                    raise
                await self._redis.script_load(script.script)  # every primary in a cluster
        raise AssertionError("unreachable")

    async def allocate_messages(
        self,
        tenant_id: str,
        key_version: int,
        num_bits: int,
        metadata: dict[str, Any],
        issued_at: float,
        count: int,
    ) -> range:
        """``count`` entries at once, with the writes ``allocate_message`` makes (one
        INCRBY takes the ids; no ``max_id`` check, no WAIT): for ``worldcup
        bench-registry`` and bulk imports. Redis only; not part of the Store protocol."""
        entry = compact_json(
            {
                "key_version": int(key_version),
                "num_bits": int(num_bits),
                "metadata": metadata,
                "issued_at": issued_at,
            }
        )
        t, kv, bits = self._keys.t, int(key_version), int(num_bits)
        seq = [
            t(tenant_id, "msgseq"),
            t(tenant_id, "msgbits", kv),
            t(tenant_id, "msglive", kv, bits),
        ]
        async with self._guard():
            last = int(await self._next_ids(keys=seq, args=[bits, int(count)]))
        ids = range(last - int(count) + 1, last + 1)
        by_bucket: dict[int, list[int]] = {}
        for i in ids:
            by_bucket.setdefault(bucket_of(i), []).append(i)
        async with self._guard():
            pipe = self._pipeline()
            for b, chunk in by_bucket.items():
                pipe.hset(self._keys.msgs(tenant_id, b), mapping={str(i): entry for i in chunk})
                pipe.zadd(self._keys.idx(tenant_id, b, kv, bits), {str(i): i for i in chunk})
            await pipe.execute()
        return ids

    async def set_registry_retention(self, tenant_id: str, days: float | None) -> None:
        key = self._keys.t(tenant_id, "retention")
        if days is None:
            await self._retry(lambda: self._redis.delete(key))
        else:
            await self._retry(lambda: self._redis.set(key, repr(float(days))))

    async def registry_retention(self, tenant_id: str) -> float | None:
        key = self._keys.t(tenant_id, "retention")
        raw = cast("str | None", await self._retry(lambda: self._redis.get(key)))
        return None if raw is None else float(raw)

    async def _first_issued_at_or_after(self, tenant_id: str, lo: int, hi: int, t: float) -> int:
        """The first id in [lo, hi) issued at or after ``t`` (hi if none), by binary
        search over the time-ordered ids; voided (absent) ids are stepped over."""
        while lo < hi:
            mid = (lo + hi) // 2
            found: tuple[int, float] | None = None
            start = mid
            while found is None and start < hi:
                window = list(range(start, min(start + 64, hi)))
                raws = await self._raw_entries(tenant_id, window)
                for i, raw in zip(window, raws, strict=True):
                    if raw is not None:
                        found = (i, float(json.loads(raw)["issued_at"]))
                        break
                start = window[-1] + 1
            if found is None or found[1] >= t:
                hi = mid  # nothing live in [mid, first new id): the boundary is at most mid
            else:
                lo = found[0] + 1
        return lo

    async def expire_registry(self, tenant_id: str, issued_before: float) -> int:
        """As the Store protocol says; bucket by bucket. Each bucket's index removal is
        atomic and counted by what it removed, then moved from ``live`` to ``expired`` in
        the tenant's slot (a crash in between leaves the total right, the split off)."""
        t = self._keys.t
        async with self._guard():
            below_raw, seq_raw = await self._redis.mget(
                [t(tenant_id, "msgexpired"), t(tenant_id, "msgseq")]
            )
            versions = cast("list[str]", await self._redis.hkeys(t(tenant_id, "keys")))
        old = max(int(below_raw or 0), 1)
        new = await self._first_issued_at_or_after(
            tenant_id, old, int(seq_raw or 0) + 1, issued_before
        )
        if new <= old:
            return 0
        indexes = []
        for kv in sorted(int(v) for v in versions):
            indexes += [(kv, b) for b in await self.registry_bit_lengths(tenant_id, kv)]
        async with self._guard():  # the watermark first: these ids now answer "expired"
            await self._advance_watermark(keys=[t(tenant_id, "msgexpired")], args=[new])
        deleted = 0
        buckets = range(bucket_of(old), bucket_of(new - 1) + 1)
        for kv, bits in indexes:
            for b in buckets:
                key = self._keys.idx(tenant_id, b, kv, bits)
                async with self._guard():
                    n = int(await self._redis.zremrangebyscore(key, old, new - 1))
                    if n:
                        counters = [
                            t(tenant_id, "msglive", kv, bits),
                            t(tenant_id, "msgexp", kv, bits),
                        ]
                        await self._move_expired(keys=counters, args=[n])
                deleted += n
        for b in buckets:
            first, last = bucket_ids(b)[0], bucket_ids(b)[-1]
            async with self._guard():
                if old <= first and last < new:  # the whole bucket
                    await self._redis.delete(self._keys.msgs(tenant_id, b))
                    continue
                for start in range(max(old, first), min(new, last + 1), 10_000):
                    ids = [str(i) for i in range(start, min(start + 10_000, new, last + 1))]
                    await self._redis.hdel(self._keys.msgs(tenant_id, b), *ids)
        return deleted
