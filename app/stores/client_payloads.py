"""Client-chosen payloads recorded as candidates of a tenant's registry test.

A payload a client chose (``payload`` on /generate, ``watermark.payload`` on /v1) is
no registry entry, but the texts under it must not be named as another user's entry:
each such payload is recorded once per tenant key version (in the store's probe
accounting tables, which SQLite, Redis and Redis Cluster all keep; kept for a
century) with a counter per payload length, and the registry test matches a text
against the recorded payloads among its likeliest as well (``client_payload`` in the
answer; :mod:`app.services.registry`), Bonferroni-corrected for them too. Each payload
also counts the texts issued under it: the test weighs a payload by them, so that a
damaged copy of a much-used payload is not named as the entry nearest to it.

The layout, under the probe key :func:`client_key` of the key version: one cluster per
payload, its id :func:`payload_digest`, its sketch the payload's bits (ASCII ``0``/``1``)
and its one band the id itself (so :meth:`~app.stores.base.Store.probe_candidates`
answers "which of these payloads are recorded"); one cluster ``count<num_bits>``
per length (sketch ``-``) whose hits count the payloads of that length; and one cluster
``uses<digest>`` per payload (sketch ``-``) whose hits count its texts.

The service records and asks (:func:`record_client_payload`, :func:`client_payload_count`,
:func:`client_payload_uses`, ``probe_candidates``); offline readers list them
(:func:`recorded_client_payloads`, with :func:`client_payload_uses`: ``worldcup scan``,
which may read ``app.stores`` but not the services).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from app.stores.base import COUNT_ONLY, Store

FOREVER_S = 100 * 365 * 86_400.0  # how long a recorded payload stays a candidate

# Sealed client payloads (SECURITY.md, "Forgery and framing"; issue #45): a chosen
# payload is no longer embedded. The service issues a registry entry for it, records the
# chosen bits on the entry under this metadata key (which clients may not send), and the
# text carries the entry's keyed payload, as for a metadata request. A client's labels
# then say nothing about the bits its texts carry. The payloads recorded above (by the
# releases before) stay candidates, so that texts issued under them keep decoding.
SEALED_METADATA_KEY = "worldcup:client_payload"
SEALED_MIN_BITS = 16  # a shorter chosen payload is sealed in an entry of the default length


def sealed_metadata(bits: str) -> dict[str, Any]:
    """The registry entry metadata that seals the chosen payload ``bits``."""
    return {SEALED_METADATA_KEY: _check_bits(bits)}


def sealed_bits(metadata: Mapping[str, Any]) -> str | None:
    """The chosen payload a registry entry seals, or None for an ordinary entry."""
    bits = metadata.get(SEALED_METADATA_KEY)
    return bits if isinstance(bits, str) else None


def without_seal(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """An entry's metadata as answers show it: the sealed payload is reported as
    ``client_payload`` and ``bits``, to the keys that may see them, not as metadata."""
    return {k: v for k, v in metadata.items() if k != SEALED_METADATA_KEY}


def sealed_length(chosen_bits: int, default_bits: int) -> int:
    """The length of the entry that seals a chosen payload of ``chosen_bits``: the same
    length from ``SEALED_MIN_BITS`` up (so ``/decode`` at the chosen length finds it),
    else the deployment's default (a 4-bit registry would hold 15 texts)."""
    return chosen_bits if chosen_bits >= SEALED_MIN_BITS else max(default_bits, SEALED_MIN_BITS)


_NO_LIMIT = 1 << 62
# A client payload's texts are counted up to this many: its weight in the registry
# posterior is then far past what a damaged copy of it needs (issue #45: the entries two
# stolen drafts named were 42 and 22 times likelier than the chosen payload), and a
# payload keeps at most this many rows.
USES_CAP = 1024


def client_key(version: int) -> str:
    """The probe key that holds the client-chosen payloads of one key version."""
    return f"cpayload-v{int(version)}"


def repeats_key(version: int) -> str:
    """The probe key that counts each client-chosen payload's texts under one key
    version (the cap ``WORLDCUP_FIXED_PAYLOAD_REPEATS``, app.services.generation)."""
    return f"payload-v{int(version)}"


# Probe keys that hold records, not short-lived accounting: a backup and a migration
# carry them over (losing them would let texts under a client payload be named as
# another user's entry again, and reset every payload's repeat cap).
DURABLE_PROBE_KEYS = ("cpayload-v", "payload-v")


def durable_probe_key(key_id: str) -> bool:
    """Whether probe key ``key_id`` holds records a backup must keep."""
    return key_id.startswith(DURABLE_PROBE_KEYS)


def payload_digest(num_bits: int, payload: int) -> str:
    """One payload's name in the store (the same bits in any spelling: one name)."""
    bits = format(payload, f"0{num_bits}b")
    return hashlib.sha256(f"{num_bits}:{bits}".encode()).hexdigest()[:32]


def _check_bits(bits: str) -> str:
    if not bits or set(bits) - {"0", "1"}:
        raise ValueError("a payload is a non-empty string of 0 and 1")
    return bits


async def record_client_payload(store: Store, tenant_id: str, version: int, bits: str) -> None:
    """Record the payload ``bits`` as a candidate of the tenant's registry test under
    key ``version`` (once), and count one more text under it (:func:`client_payload_uses`)."""
    num_bits = len(_check_bits(bits))
    digest = payload_digest(num_bits, int(bits, 2))
    key = client_key(version)
    sketch = bits.encode("ascii")
    first = await store.probe_hit(tenant_id, key, digest, sketch, [digest], FOREVER_S, 1)
    if first.allowed:  # a payload not recorded before: one more candidate
        count_id = f"count{num_bits}"
        await store.probe_hit(tenant_id, key, count_id, COUNT_ONLY, [], FOREVER_S, _NO_LIMIT)
    # COUNT_ONLY, so that the SQLite store's probe sweep keeps the count; counted up to
    # USES_CAP, so that the rows a payload keeps (and each count's cost) stay bounded
    await store.probe_hit(tenant_id, key, _uses_id(digest), COUNT_ONLY, [], FOREVER_S, USES_CAP)


def _uses_id(digest: str) -> str:
    return f"uses{digest}"


async def client_payload_uses(
    store: Store, tenant_id: str, version: int, num_bits: int, payloads: Iterable[int]
) -> dict[int, int]:
    """How many texts were issued under each recorded client payload (``num_bits``
    long; reads only, one store call each, sent together), up to :data:`USES_CAP`: the
    registry test's prior weight of the payload
    (:func:`worldcup_core.decoder.prior_logits`). A payload recorded by a release before
    the count reads 0 (the test then weighs it 1, as before)."""
    wanted = sorted(set(payloads))
    decisions = await asyncio.gather(
        *(
            store.probe_hit(
                tenant_id,
                client_key(version),
                _uses_id(payload_digest(num_bits, payload)),
                None,
                [],
                FOREVER_S,
                0,
            )
            for payload in wanted
        )
    )
    return {payload: d.count for payload, d in zip(wanted, decisions, strict=True)}


async def client_payload_count(store: Store, tenant_id: str, version: int, num_bits: int) -> int:
    """How many client-chosen payloads of ``num_bits`` are recorded (a read: budget 0)."""
    decision = await store.probe_hit(
        tenant_id, client_key(version), f"count{num_bits}", None, [], FOREVER_S, 0
    )
    return decision.count


def _payload_of(cluster_id: str, sketch: bytes) -> str | None:
    """The bits of a payload's cluster; None for a counter (or anything not a payload)."""
    try:
        bits = sketch.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not bits or set(bits) - {"0", "1"}:
        return None
    return bits if payload_digest(len(bits), int(bits, 2)) == cluster_id else None


async def recorded_client_payloads(
    store: Store, tenant_id: str, version: int, lengths: Iterable[int] | None = None
) -> dict[int, list[int]]:
    """The client-chosen payloads recorded under the tenant's key ``version``: payload
    integers (bit 0 of the bits is the most significant) per length, ascending; every
    payload ever recorded (the listing reads the clusters themselves).

    With ``lengths``, only the lengths among them whose counter says payloads are
    recorded, as the service's registry test takes them (none where the counter reads
    0), and no listing at all when every such counter reads 0: the listing reads every
    cluster of the key version (on Redis a SCAN of the tenant's node), the counters one
    key each."""
    wanted: set[int] | None = None
    if lengths is not None:
        wanted = {
            n for n in set(lengths) if await client_payload_count(store, tenant_id, version, n)
        }
        if not wanted:
            return {}
    found: dict[int, set[int]] = {}
    for cluster_id, sketch in await store.probe_clusters(tenant_id, client_key(version)):
        bits = _payload_of(cluster_id, sketch)
        if bits is not None and (wanted is None or len(bits) in wanted):
            found.setdefault(len(bits), set()).add(int(bits, 2))
    return {n: sorted(found[n]) for n in sorted(found)}
