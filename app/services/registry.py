"""Registry lookups whose cost does not grow with what a tenant issued (issue #36).

:func:`~app.services.watermark.WatermarkService.decode_texts` asks this module, per
(tenant, key version, payload length), how to match a decoded text:

* **small registries** (see :func:`worldcup_core.registry_lookup.use_list`) are
  matched exhaustively against their payloads, kept here between requests: each
  request reads the registry's counters and the ids issued since (one short range
  read), and reloads only when an entry was voided or expired;
* **big registries** are matched by list: the text's likeliest payloads are inverted
  to message ids, and the store says which of them were issued (one round trip).

Either way the p-value is Bonferroni-corrected by the registry's size from counters
the store keeps at write time, and ids past the tenant's retention stay candidates,
so a text issued for an expired entry is reported as such (``expired``) rather than
matched to a live neighbour. The payloads clients chose (:mod:`app.stores.client_payloads`)
are candidates too, so their texts are named as the client's payload, never as an entry;
each weighs as many entries as it has texts (:func:`worldcup_core.decoder.prior_logits`),
so that a damaged copy of a much-used payload is not named as the entry nearest to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from app.core.config import Settings
from app.stores.base import RegistrySize, Store, StoreError
from app.stores.client_payloads import (
    client_key,
    client_payload_count,
    client_payload_uses,
    payload_digest,
)
from worldcup_core.assess import Assessment
from worldcup_core.decoder import RegistryMatch
from worldcup_core.message import MessageIdCodec
from worldcup_core.registry_lookup import (
    F64,
    LIST_SIZE,
    U64,
    PayloadList,
    TextCells,
    count_weights,
    exhaustive_match,
    list_match,
    payload_list,
    use_list,
)

logger = logging.getLogger(__name__)

CACHED_REGISTRIES = 64  # small registries' payloads kept per process (<= 1 MiB each)


@dataclass
class _Cached:
    ids: list[int]
    payloads: U64


@dataclass(frozen=True)
class Plan:
    """How to match texts against one (key version, payload length) registry."""

    codec: MessageIdCodec
    size: RegistrySize
    ids: U64 | None = None  # exhaustive: every candidate id (expired ones first) ...
    payloads: U64 | None = None  # ... and its payload
    expired_count: int = 0  # how many of ``ids`` are past retention (they lead)
    client: int = 0  # client-chosen payloads recorded for this key version and length

    @property
    def candidates(self) -> int:
        """The Bonferroni count: live entries, every id the retention expired, and the
        client-chosen payloads recorded as candidates."""
        expired = max(self.size.expired, self.size.expired_below - 1, 0)
        return self.size.live + expired + self.client

    @property
    def bonferroni(self) -> int:
        """The registry test's correction: the count, or the payloads an exhaustive match
        scanned where the cache holds more than the counters say (as the match's own p)."""
        scanned = int(self.payloads.size) if self.payloads is not None else 0
        return max(self.candidates, scanned, 1)


@dataclass(frozen=True)
class ClientCandidates:
    """The recorded client-chosen payloads among one text's likeliest, and how many
    texts each was issued under (0: recorded before the count; it then weighs 1)."""

    payloads: U64
    uses: npt.NDArray[np.int64]

    def weights_for(self, payloads: U64) -> F64:
        """The prior weight of each of ``payloads``: its texts where it is one of these,
        else 1 (an entry)."""
        return count_weights(payloads, self.payloads, self.uses)


NO_CLIENT = ClientCandidates(np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class Found:
    match: RegistryMatch
    message_id: int
    expired: bool
    client: bool = False  # the best candidate is a client-chosen payload, not an entry


@dataclass(frozen=True)
class Pending:
    """A list lookup waiting for the store's answer."""

    cells: TextCells
    plist: PayloadList
    ids: U64  # the listed payloads' message ids


@dataclass
class RegistryLookup:
    store: Store
    list_size: int = LIST_SIZE
    _cache: OrderedDict[tuple[str, int, int], _Cached] = field(default_factory=OrderedDict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def plan(self, tenant_id: str, codec: MessageIdCodec, key_version: int) -> Plan:
        """Read the counters and, for a small registry, its payloads (cached)."""
        num_bits = codec.num_bits
        size = await self.store.registry_size(tenant_id, key_version, num_bits)
        expired_ids = max(size.expired_below - 1, 0)
        client = await client_payload_count(self.store, tenant_id, key_version, num_bits)
        if use_list(num_bits, size.live + expired_ids):
            return Plan(codec, size, client=client)
        cached = await self._payloads(tenant_id, codec, key_version, size)
        expired = np.arange(1, min(expired_ids + 1, codec.capacity), dtype=np.uint64)
        ids = np.concatenate([expired, np.asarray(cached.ids, dtype=np.uint64)])
        payloads = np.concatenate([codec.payload_ints(expired), cached.payloads])
        return Plan(codec, size, ids, payloads, int(expired.size), client)

    async def _payloads(
        self, tenant_id: str, codec: MessageIdCodec, key_version: int, size: RegistrySize
    ) -> _Cached:
        key = (tenant_id, key_version, codec.num_bits)
        async with self._lock:
            cached = self._cache.pop(key, None)
            after = cached.ids[-1] if cached is not None and cached.ids else 0
            new = await self.store.message_ids(tenant_id, key_version, codec.num_bits, after)
            new = [i for i in new if i < codec.capacity]  # older releases could leave these
            if cached is not None and len(cached.ids) + len(new) == size.live:
                cached = _Cached(
                    cached.ids + new,
                    np.concatenate([cached.payloads, codec.payload_ints(new)]),
                )
            else:  # first use, or an entry was voided or expired: read it all again
                ids = await self.store.message_ids(tenant_id, key_version, codec.num_bits)
                ids = [i for i in ids if i < codec.capacity]
                cached = _Cached(ids, codec.payload_ints(ids))
            self._cache[key] = cached
            while len(self._cache) > CACHED_REGISTRIES:
                self._cache.popitem(last=False)
            return cached

    def match_small(
        self, plan: Plan, cells: TextCells, client: ClientCandidates | None = None
    ) -> Found | None:
        """The exhaustive match (CPU only), over the registry's payloads and ``client``,
        the recorded client-chosen payloads among the text's likeliest, each weighed by
        its texts."""
        assert plan.ids is not None and plan.payloads is not None
        extra = client if client is not None else NO_CLIENT
        known = np.isin(extra.payloads, plan.payloads)  # an entry's own payload stays the entry
        payloads = np.concatenate([plan.payloads, extra.payloads[~known]])
        weights = np.ones(payloads.size)
        weights[plan.payloads.size :] = extra.weights_for(extra.payloads[~known])
        found = exhaustive_match(cells, payloads, plan.candidates, weights)
        if found is None:
            return None
        if found.index >= plan.ids.size:
            return Found(found, 0, False, client=True)
        return Found(found, int(plan.ids[found.index]), found.index < plan.expired_count)

    def prepare_list(self, plan: Plan, cells: TextCells) -> Pending:
        """The text's likeliest payloads and their ids (CPU only)."""
        plist = payload_list(cells, self.list_size)
        return Pending(cells, plist, plan.codec.message_id_ints(plist.payloads))

    async def finish_lists(
        self,
        tenant_id: str,
        plans: dict[int, Plan],
        pending: list[tuple[int, Pending]],
        client: list[ClientCandidates] | None = None,
    ) -> list[Found | None]:
        """Ask the store which listed ids were issued (one round trip per key version for
        the whole batch), and match each text among its own and ``client`` (per text,
        the recorded client-chosen payloads among its list, each weighed by its texts)."""
        live: list[npt.NDArray[np.bool_]] = []
        asks: dict[int, list[tuple[int, npt.NDArray[np.intp]]]] = {}
        for n, (version, p) in enumerate(pending):
            # ids are handed out from 1 up: only listed ids up to the last one can be
            # entries (a few of the 4096 unless the registry fills much of the space)
            maybe = np.flatnonzero((p.ids >= 1) & (p.ids <= plans[version].size.last_id))
            live.append(np.zeros(p.ids.size, dtype=bool))
            if maybe.size:
                asks.setdefault(version, []).append((n, maybe))
        for version, items in asks.items():
            asked = [int(i) for n, maybe in items for i in pending[n][1].ids[maybe]]
            bits = plans[version].codec.num_bits
            answers = iter(await self.store.issued_among(tenant_id, version, bits, asked))
            for n, maybe in items:
                live[n][maybe] = [next(answers) for _ in range(maybe.size)]
        out: list[Found | None] = []
        extras = client if client is not None else [NO_CLIENT] * len(pending)
        for (version, p), hits, extra in zip(pending, live, extras, strict=True):
            below = plans[version].size.expired_below
            expired = (p.ids >= 1) & (p.ids < below) & ~hits
            chosen = np.isin(p.plist.payloads, extra.payloads) & ~hits & ~expired
            weights = np.where(chosen, extra.weights_for(p.plist.payloads), 1.0)
            found = list_match(
                p.cells, p.plist, p.ids, hits | chosen, expired, plans[version].candidates, weights
            )
            if found is None:
                out.append(None)
            elif chosen[found.match.index]:
                out.append(Found(found.match, 0, False, client=True))
            else:
                out.append(Found(found.match, found.message_id, found.expired))
        return out

    async def client_among(
        self, tenant_id: str, version: int, num_bits: int, listed: list[U64]
    ) -> list[ClientCandidates]:
        """Per text, the recorded client-chosen payloads among its listed payloads and
        their texts (one store read for the whole batch, then one for each payload found,
        sent together; how they are recorded: :mod:`app.stores.client_payloads`)."""
        digests = [[payload_digest(num_bits, int(x)) for x in p] for p in listed]
        bands = sorted({d for ds in digests for d in ds})
        found = await self.store.probe_candidates(
            tenant_id, client_key(version), bands, limit=len(bands)
        )
        recorded = {c for c, _ in found}
        among = [
            [int(x) for x, d in zip(p, ds, strict=True) if d in recorded]
            for p, ds in zip(listed, digests, strict=True)
        ]
        uses = await client_payload_uses(
            self.store, tenant_id, version, num_bits, {x for xs in among for x in xs}
        )
        return [
            ClientCandidates(
                np.asarray(xs, dtype=np.uint64), np.asarray([uses[x] for x in xs], dtype=np.int64)
            )
            for xs in among
        ]


async def sweep_registries(store: Store, now: float) -> dict[str, int]:
    """The retention sweep: every tenant with a retention loses the entries issued more
    than that many days before ``now``; entries deleted, per such tenant. Its cost is per
    tenant and per deleted entry, never per request."""
    out = {}
    for tenant in await store.list_tenants():
        days = await store.registry_retention(tenant.tenant_id)
        if days is not None:
            out[tenant.tenant_id] = await store.expire_registry(
                tenant.tenant_id, now - days * 86_400.0
            )
    return out


async def sweep_forever(store: Store, interval_s: float) -> None:
    """Run :func:`sweep_registries` every ``interval_s`` (an app lifespan task)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            swept = await sweep_registries(store, time.time())
        except StoreError as exc:
            logger.warning("registry sweep failed: %s", exc)
            continue
        if any(swept.values()):
            logger.info("registry sweep", extra={"fields": {"expired": sum(swept.values())}})


def ambiguous_answer(
    found: RegistryMatch | None, assessment: Assessment, settings: Settings
) -> bool:
    """Whether an answer says ``registry_ambiguous``: the registry test alone would let
    the answer name an entry (``may_name_entry``), but another entry fits the text
    almost as well (the posterior below ``registry_min_confidence``), so none is named.
    Without it such an answer reads "watermarked, by the registry test" beside no entry."""
    return (
        found is not None
        and assessment.may_name_entry
        and found.posterior < settings.registry_min_confidence
    )


def expired_answer(
    found: RegistryMatch | None, expired: bool, assessment: Assessment, settings: Settings
) -> bool:
    """Whether an answer says ``registry_expired``: the best candidate is an expired
    entry, and the match is as sure as a named live entry would be (the registry test
    alone below the watermarked level with every correction, ``may_name_entry``, and
    clearly ahead of the others)."""
    return (
        expired
        and found is not None
        and assessment.may_name_entry
        and found.posterior >= settings.registry_min_confidence
    )
