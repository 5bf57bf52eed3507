"""The store contract. Redis (deployment) and SQLite (embedded default) both meet it.

Every method may raise :class:`StoreUnavailable` when the backend cannot be
reached in time; the API turns that into a fast 503 instead of hanging.
Tenant isolation is structural: every key-version, registry and idempotency
method takes the ``tenant_id`` that authentication produced, and backends
namespace by it (Redis keys ``{prefix}:{tenant}:...``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


def check_tenant_id(tenant_id: str) -> str:
    """Tenant ids are path segments of Redis keys; a ':' could alias another namespace.

    Both backends apply the same rule, so they accept the same ids.
    """
    if not tenant_id or ":" in tenant_id or any(c.isspace() for c in tenant_id):
        raise ValueError("invalid tenant id")
    return tenant_id


def compact_json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class StoreError(Exception):
    """Base class for store failures."""


class StoreUnavailable(StoreError):
    """The backend is unreachable or timed out."""


class RegistryFull(StoreError):
    """No message id below the payload length's capacity is left; nothing was written."""


class Conflict(StoreError):
    """A uniqueness rule was violated (e.g. tenant name taken)."""


@dataclass(frozen=True)
class TenantRecord:
    tenant_id: str
    name: str
    api_key_hash: str  # hex SHA-256 of the API key; the key itself is never stored
    created_at: float
    scopes: tuple[str, ...] = ()


PRIMARY_KEY_ID = "primary"  # the key a tenant was created with (before API keys existed)


@dataclass(frozen=True)
class ApiKeyRecord:
    """One API key of a tenant: what it may do and how much detection detail it sees.

    Only the SHA-256 of the secret is stored. ``scopes`` are among generate,
    detect, decode and provenance (the last also needs the tenant's scope);
    ``detail`` is ``full`` or ``verdict``.
    """

    key_id: str
    tenant_id: str
    key_hash: str
    name: str
    scopes: tuple[str, ...]
    detail: str
    created_at: float
    revoked_at: float | None = None

    def __repr__(self) -> str:
        return f"ApiKeyRecord(tenant_id={self.tenant_id!r}, key_id={self.key_id!r})"


def api_key_to_json(key: ApiKeyRecord) -> str:
    """The stored form of an API key record (both backends; revocation is kept apart)."""
    return compact_json(
        {
            "key_id": key.key_id,
            "tenant_id": key.tenant_id,
            "key_hash": key.key_hash,
            "name": key.name,
            "scopes": list(key.scopes),
            "detail": key.detail,
            "created_at": key.created_at,
        }
    )


def api_key_from_json(raw: str, revoked_at: float | None) -> ApiKeyRecord:
    d = json.loads(raw)
    return ApiKeyRecord(
        key_id=d["key_id"],
        tenant_id=d["tenant_id"],
        key_hash=d["key_hash"],
        name=d["name"],
        scopes=tuple(d["scopes"]),
        detail=d["detail"],
        created_at=float(d["created_at"]),
        revoked_at=revoked_at,
    )


@dataclass(frozen=True)
class ProbeDecision:
    """The outcome of counting one query against its text's probe budget."""

    allowed: bool
    count: int  # queries of this text in the window, this one included when allowed
    retry_after_s: float  # 0 when allowed: when the oldest counted query leaves the window


# The context sketch's width of every key version recorded before the width was recorded
# with it (2**20 counters a row): what a record without the field is read as, forever.
SKETCH_WIDTH_LOG2_BEFORE = 20


@dataclass(frozen=True)
class KeyRecord:
    """One version of a tenant's watermark key, encrypted at rest (AES-256-GCM)."""

    tenant_id: str
    version: int  # 1, 2, ...; the highest is active for /generate
    wrapped_key: bytes  # nonce || ciphertext || tag; AAD binds tenant_id and version
    created_at: float
    groups: int
    layers: int
    alpha: float
    context_width: int = 2
    scheme: str = "worldcup-v1"  # the PRF/scoring version this key's texts were issued under
    # the geometry of its context sketch (worldcup_core.context_sketch): 2**this counters
    # a row, fixed when the version is created, so a release that changes the default
    # reads every older version's counters where they were written
    sketch_width_log2: int = SKETCH_WIDTH_LOG2_BEFORE

    def __repr__(self) -> str:
        return f"KeyRecord(tenant_id={self.tenant_id!r}, version={self.version})"


@dataclass(frozen=True)
class RegistryEntry:
    tenant_id: str
    message_id: int  # allocated atomically per tenant, from 1
    key_version: int
    num_bits: int
    metadata: dict[str, Any] = field(default_factory=dict)
    issued_at: float = 0.0
    # the issued text's keyed SimHash (worldcup_core.fingerprint), set once the text is
    # generated; None for entries issued before it existed or whose write failed
    fingerprint: bytes | None = None


@dataclass(frozen=True)
class RegistrySize:
    """How many candidates one (key version, payload length) registry holds, from
    counters kept at write time (never a scan): ``live`` entries, ``expired`` ones the
    retention sweep removed, ``expired_below``: every id below it is expired (0: none),
    and ``last_id``: the tenant's highest id handed out so far (over every key version
    and length; no id above it is an entry, so a lookup asks the store only about the
    listed ids up to it). A p-value is Bonferroni-corrected for ``live + expired``."""

    live: int
    expired: int = 0
    expired_below: int = 0
    last_id: int = 0

    @property
    def candidates(self) -> int:
        return self.live + self.expired


@dataclass(frozen=True)
class AuditRecord:
    """One provenance query: who asked, when, and what was found (never the text)."""

    at: float
    actor: str  # "admin" or "tenant:<tenant id>" (a holder of the provenance scope)
    action: str
    request_id: str
    outcome: dict[str, Any]
    id: str = ""  # assigned by the store, increasing in time


def audit_to_json(record: AuditRecord) -> str:
    """The stored form of an audit record (both backends); the id is the store's."""
    return compact_json(
        {
            "at": record.at,
            "actor": record.actor,
            "action": record.action,
            "request_id": record.request_id,
            "outcome": record.outcome,
        }
    )


def audit_from_json(raw: str, record_id: str) -> AuditRecord:
    d = json.loads(raw)
    return AuditRecord(
        at=float(d["at"]),
        actor=d["actor"],
        action=d["action"],
        request_id=d["request_id"],
        outcome=d["outcome"],
        id=record_id,
    )


@dataclass(frozen=True)
class CaseRecord:
    """One saved console check (a case): who ran it, when, and what was found.

    ``record`` holds the case's JSON fields (who, mode, verdict, evidence summary, the
    text's SHA-256); ``text`` is the text itself, only when the analyst chose to keep
    it. ``tenant_id`` is the owner's tenant (None for the admin): access checks and
    history are by it. The store forgets a case at ``expires_at`` (None: never).
    """

    case_id: str
    created_at: float
    tenant_id: str | None
    record: dict[str, Any]
    text: str | None = None
    batch_id: str | None = None
    expires_at: float | None = None

    def __repr__(self) -> str:  # never the text
        return f"CaseRecord({self.case_id!r}, tenant={self.tenant_id!r})"


def case_to_json(case: CaseRecord) -> str:
    return compact_json(
        {
            "case_id": case.case_id,
            "created_at": case.created_at,
            "tenant_id": case.tenant_id,
            "record": case.record,
            "text": case.text,
            "batch_id": case.batch_id,
            "expires_at": case.expires_at,
        }
    )


def case_from_json(raw: str) -> CaseRecord:
    d = json.loads(raw)
    return CaseRecord(
        case_id=d["case_id"],
        created_at=float(d["created_at"]),
        tenant_id=d["tenant_id"],
        record=d["record"],
        text=d.get("text"),
        batch_id=d.get("batch_id"),
        expires_at=d.get("expires_at"),
    )


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    retry_after_s: float  # 0 when allowed
    remaining: float  # tokens left in the bucket


@dataclass(frozen=True)
class IdempotencyRecord:
    body_hash: str
    status_code: int  # IDEMPOTENCY_PENDING while the first request is still running
    response: dict[str, Any]


IDEMPOTENCY_PENDING = 0

# The sketch of a probe count that nothing finds by its bands (a full key's full answers,
# a payload's repeats): the SQLite store's periodic sweep drops the hits of clusters
# without a sketch, so a count meant to last its window passes this one.
COUNT_ONLY = b"-"


class ProbeCounting:
    """:meth:`Store.probe_hit` and :meth:`Store.probe_open` for a store that does both
    with one atomic primitive, :meth:`_probe_count`."""

    async def _probe_count(
        self,
        tenant_id: str,
        key_id: str,
        cluster_id: str,
        sketch: bytes | None,
        bands: list[str],
        window_s: float,
        budget: int,
        seen: Sequence[str],
        min_hits: int,
    ) -> ProbeDecision | None:
        """Count one hit atomically; for an open (``min_hits`` > 0), None with nothing
        written when ``min_hits`` of ``bands`` point to one live cluster other than
        ``cluster_id`` and those in ``seen``."""
        raise NotImplementedError

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
        decision = await self._probe_count(
            tenant_id, key_id, cluster_id, sketch, bands, window_s, budget, (), 0
        )
        return decision or ProbeDecision(False, 0, window_s)  # None only for an open

    async def probe_open(
        self,
        tenant_id: str,
        key_id: str,
        cluster_id: str,
        sketch: bytes,
        bands: list[str],
        window_s: float,
        budget: int,
        seen: list[str],
        min_hits: int,
    ) -> ProbeDecision | None:
        return await self._probe_count(
            tenant_id, key_id, cluster_id, sketch, bands, window_s, budget, seen, max(1, min_hits)
        )


class Store(Protocol):
    async def ping(self) -> None: ...

    async def ensure_marker(self, value: str) -> str:
        """Write the service's marker unless one is there; return the stored marker.

        Written at the first start; ``/ready`` fails when it disappears (a store that
        came back empty would otherwise answer 401 to every tenant, looking ready)."""

    async def marker(self) -> str | None:
        """The stored marker, or None if the store has lost it."""

    async def close(self) -> None: ...

    # tenants
    async def create_tenant(self, tenant: TenantRecord, key: KeyRecord) -> None:
        """Atomically create the tenant and its key version 1; Conflict if the name exists."""

    async def get_tenant(self, tenant_id: str) -> TenantRecord | None: ...

    async def tenant_by_api_key_hash(self, api_key_hash: str) -> TenantRecord | None: ...

    async def list_tenants(self) -> list[TenantRecord]: ...

    async def set_scopes(self, tenant_id: str, scopes: tuple[str, ...]) -> TenantRecord | None:
        """Replace the tenant's scopes; None if there is no such tenant."""

    # watermark keys
    async def add_key_version(self, key: KeyRecord) -> None:
        """Store a new version; Conflict unless it is exactly latest + 1."""

    async def key_versions(self, tenant_id: str) -> list[KeyRecord]:
        """All versions, oldest first (old ones stay usable for decode/detect)."""

    async def replace_wrapped_keys(self, keys: list[KeyRecord]) -> None:
        """Overwrite wrapped_key of existing versions (master-key rotation)."""

    async def all_key_versions(self) -> list[KeyRecord]:
        """Every version of every tenant (provenance search, master-key rotation)."""

    # registry
    async def allocate_message(
        self,
        tenant_id: str,
        key_version: int,
        num_bits: int,
        metadata: dict[str, Any],
        issued_at: float,
        max_id: int | None = None,
    ) -> RegistryEntry:
        """Atomically take the next message id and persist the entry before returning.

        RegistryFull (and nothing written) if the next id would exceed ``max_id``."""

    async def registry_entry(self, tenant_id: str, message_id: int) -> RegistryEntry | None: ...

    async def set_fingerprint(self, tenant_id: str, message_id: int, fingerprint: bytes) -> bool:
        """Record the issued text's fingerprint with its entry (after generation; a
        later call replaces it). False, and nothing written, if there is no such entry
        (voided, expired, never issued)."""

    async def count_contexts(
        self, tenant_id: str, key_version: int, cells: Sequence[Sequence[int]], width_log2: int
    ) -> None:
        """Count one issued text's distinct contexts in the tenant's sketch for the key
        version (:mod:`worldcup_core.context_sketch`: each row of ``cells`` one context's
        counter per sketch row of ``2**width_log2``, the key version's
        :attr:`KeyRecord.sketch_width_log2`; conservative update from the counters
        before the text).
        Not idempotent: a retried write overcounts, which only makes contexts look
        common (never a spoof let through), so callers do not retry."""

    async def context_counts(
        self, tenant_id: str, key_version: int, cells: Sequence[Sequence[int]], width_log2: int
    ) -> list[int]:
        """Each context's estimated count in that sketch (0 where nothing was counted)."""
        ...

    async def registry_entries(
        self, tenant_id: str, message_ids: Sequence[int]
    ) -> list[RegistryEntry | None]:
        """``registry_entry`` of each of ``message_ids`` (any order, duplicates allowed),
        aligned with them: None where there is no entry (never issued, voided, expired,
        out of range). A few round trips whatever the number of ids (SQLite: chunked
        ``IN`` queries; Redis: chunked HMGETs of the ids' buckets, pipelined). This
        default, one read an id, is for a backend without a faster way."""
        return [await self.registry_entry(tenant_id, int(i)) for i in message_ids]

    async def message_ids(
        self, tenant_id: str, key_version: int, num_bits: int, after: int = 0
    ) -> list[int]:
        """Ids issued under this key version and payload length (registry ML decoding),
        ascending; only those above ``after`` when given (a cache's increment)."""

    async def registry_bit_lengths(self, tenant_id: str, key_version: int) -> list[int]:
        """The payload lengths the registry has entries for under this key version."""

    async def void_message(self, tenant_id: str, message_id: int, reason: str) -> bool:
        """Withdraw an entry whose text could not be watermarked: it is no longer read
        nor matched (``registry_entry`` None, out of ``message_ids``), and its id is
        never handed out again. False if there was no such entry."""

    # registry lookup without reading the registry (issue #36); both O(1) or O(ids)
    async def registry_size(self, tenant_id: str, key_version: int, num_bits: int) -> RegistrySize:
        """Counters of this (key version, payload length) registry, kept at write time:
        ``allocate_message`` adds 1 to ``live``, ``void_message`` takes 1 off, the sweep
        (``expire_registry``) moves what it deletes from ``live`` to ``expired``. One
        round trip, independent of the registry's size (Redis: one MGET of the counters
        in the tenant's slot, ``msgseq`` for ``last_id``; the live counter is taken at
        the id's allocation, so an allocation that failed half way over-counts it by
        one, a conservative correction; SQLite: one row of ``registry_counts``
        and the tenant's MAX(message_id) from the primary key)."""

    async def issued_among(
        self, tenant_id: str, key_version: int, num_bits: int, message_ids: list[int]
    ) -> list[bool]:
        """For each of ``message_ids`` (any order, duplicates allowed, ids out of range
        simply False): whether it is a live entry issued under this key version and
        payload length (voided and expired ones are not). One round trip whatever the
        number of ids (Redis: one script per id-range bucket the ids fall in, pipelined;
        SQLite: one IN query)."""

    # registry retention (issue #36)
    async def set_registry_retention(self, tenant_id: str, days: float | None) -> None:
        """The tenant's registry retention in days; None keeps entries forever (default)."""

    async def registry_retention(self, tenant_id: str) -> float | None:
        """The tenant's registry retention in days, None if entries are kept forever."""

    async def expire_registry(self, tenant_id: str, issued_before: float) -> int:
        """The retention sweep: advance the tenant's watermark ``expired_below`` to the
        first id issued at or after ``issued_before`` (ids are allocated in time order),
        then delete every entry below it, moving them from the counters' ``live`` to
        ``expired``. The watermark never goes back, and ids below it are never handed
        out again (``allocate_message`` continues above it). Returns how many entries
        were deleted. Idempotent; safe to run from several replicas at once."""

    # audit log
    async def append_audit(self, record: AuditRecord) -> None:
        """Durably append; the caller answers only after this returned."""

    async def audit_log(self, limit: int) -> list[AuditRecord]:
        """The newest ``limit`` records, newest first."""

    # API keys
    async def add_api_key(self, key: ApiKeyRecord) -> bool:
        """Store a new API key; False (nothing written) if the tenant already has this
        key id. Conflict if another key has the same hash."""

    async def api_key_by_hash(self, key_hash: str) -> ApiKeyRecord | None: ...

    async def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        """Every key of the tenant, revoked ones too, oldest first."""

    async def revoke_api_key(self, tenant_id: str, key_id: str, at: float) -> ApiKeyRecord | None:
        """Mark revoked (the first revocation time stays); None if there is no such key."""

    # probe accounting (near-duplicate scoring queries per tenant account)
    async def probe_candidates(
        self, tenant_id: str, key_id: str, bands: list[str], limit: int = 8, min_hits: int = 1
    ) -> list[tuple[str, bytes]]:
        """(cluster id, sketch) of the live clusters at least ``min_hits`` of these
        anchors ("bands") point to: at most ``limit``, those most pointed to first
        (ties by cluster id)."""

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
        """Count one query of the cluster in a sliding window of ``window_s``, unless
        ``budget`` queries are counted already (then nothing is recorded). When
        ``sketch`` is given, the cluster's sketch becomes it and ``bands`` point to
        the cluster. Everything expires ``window_s`` after its last use. A count with
        nothing to find it by passes :data:`COUNT_ONLY` (the SQLite store's periodic
        sweep drops the hits of clusters without a sketch). A ``budget`` of 0 records
        nothing: the refusal's ``count`` is the cluster's count now (a peek)."""

    async def probe_open(
        self,
        tenant_id: str,
        key_id: str,
        cluster_id: str,
        sketch: bytes,
        bands: list[str],
        window_s: float,
        budget: int,
        seen: list[str],
        min_hits: int,
    ) -> ProbeDecision | None:
        """Open a cluster as :meth:`probe_hit` would, in the same atomic step as a last
        look: None, with nothing written, when at least ``min_hits`` of ``bands``
        point to one live cluster other than ``cluster_id`` and those in ``seen`` (the
        ones the caller's :meth:`probe_candidates` found and weighed). That is a
        cluster opened since the caller looked, by a concurrent first query about the
        same text; the caller looks again and joins it."""

    async def probe_hit_all(
        self, tenant_id: str, key_id: str, hits: Mapping[str, int], window_s: float, budget: int
    ) -> bool:
        """Count ``hits[c]`` queries of each cluster ``c`` as :meth:`probe_hit` with
        :data:`COUNT_ONLY` would, all or none, in one atomic step: True, counted, when
        every cluster's count plus its number is at most ``budget``; else False with
        nothing recorded. A retried call counts once. (A set of texts answered as one
        spends a full answer of each text's account, or none.)"""

    async def probe_clusters(self, tenant_id: str, key_id: str) -> list[tuple[str, bytes]]:
        """(cluster id, sketch) of every live cluster of this key that has a sketch, by
        cluster id. A listing for offline readers (``worldcup scan``), never a
        request's path: SQLite reads the key's range of its primary key, Redis SCANs
        the keys of the node that serves the tenant's slot (its whole keyspace)."""

    # rate limits
    async def take_tokens(
        self, tenant_id: str, rate_per_s: float, burst: float, cost: float
    ) -> RateDecision:
        """Token bucket per tenant: take ``cost`` tokens if the bucket holds them."""

    # idempotency
    async def idempotency_get(self, tenant_id: str, key: str) -> IdempotencyRecord | None: ...

    async def idempotency_put(
        self,
        tenant_id: str,
        key: str,
        record: IdempotencyRecord,
        ttl_s: int,
        overwrite: bool = False,
    ) -> bool:
        """Store if absent (False if a record exists), or unconditionally with overwrite."""

    async def idempotency_delete(self, tenant_id: str, key: str) -> None:
        """Drop a record (a request that held the key failed; its retry may run)."""

    # console cases
    async def put_case(self, case: CaseRecord) -> None:
        """Save a case (and drop cases past their ``expires_at``)."""

    async def get_case(self, case_id: str, now: float) -> CaseRecord | None:
        """A case, or None if there is none or it expired before ``now``."""

    async def list_cases(
        self, tenant_id: str | None, batch_id: str | None, limit: int, now: float
    ) -> list[CaseRecord]:
        """Newest first: one tenant's cases (``tenant_id``), or every case (None);
        only one batch's when ``batch_id`` is given. Expired cases are left out."""

    async def delete_case(self, case_id: str) -> bool:
        """Delete a case and its text; False if there was none."""

    # stored /v1/responses (previous_response_id), in the tenant's own namespace
    async def response_put(
        self, tenant_id: str, response_id: str, record: dict[str, Any], ttl_s: int
    ) -> None:
        """Store (or replace) a response and the conversation it ends, for ``ttl_s``."""

    async def response_get(self, tenant_id: str, response_id: str) -> dict[str, Any] | None:
        """The tenant's stored response; None if absent, expired or another tenant's."""
