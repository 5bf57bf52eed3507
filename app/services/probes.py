"""Probe accounting: a removal attack asks about many near-copies of one text.

Leave-one-word-out through ``/detect`` walks a watermark below detection by
scoring hundreds of variants of one text. Every detect or decode query under
an API key is fingerprinted here from the (context, token) pairs a detector
scores (token 3-grams for the default context width c = 2, each once, so the
first c tokens and repeated contexts do not count, as in scoring), with a
MinHash sketch of 64 values. A query whose estimated Jaccard similarity with
a cluster of recent queries under the same tenant (any of its keys: the
clusters are the tenant's, shared by its keys) is at least
:data:`SIMILARITY` counts against that cluster's budget (sliding window in
the store, shared by replicas); unrelated texts start clusters of their own.
Candidates are found by LSH (16 bands of 4 values: a 0.7-similar query is
found with probability 0.988, a 0.95-similar one always in practice) and
checked against the stored sketch. A matched query whose similarity is below
0.9 moves the cluster's sketch to itself, so a text that drifts word by word
stays in one cluster.

Accounted per tenant, audited per key: a tenant with N keys has one budget per
text, not N. The limit applied to a query is its own key's detail-level budget
(``verdict`` or ``full``) against the tenant's shared count, so a ``verdict``
key is refused once the tenant's keys together asked its (smaller) budget's
worth about a text, while a ``full`` key may go on to the ``full`` budget. The
audit line of a refusal names the key id (never its secret).

Why a small keyed MinHash and not ``datasketch``: the hash functions are
keyed with a secret derived from the master key, so nobody can compute
sketches offline and pick deletions that slip out of a cluster; the sketch of
a whole text is one vectorised numpy pass (``datasketch`` hashes element by
element in Python unless given pre-hashed values, and brings no keying); and
no new dependency for a 40-line function.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from app.core.errors import APIError
from app.core.metrics import Metrics
from app.stores.base import AuditRecord, ProbeDecision, Store

__all__ = ["SIMILARITY", "ProbeAccountant", "Sketch", "probe_secret", "sketch_tokens"]

NUM_HASHES = 64
BANDS = 16
ROWS = NUM_HASHES // BANDS
SIMILARITY = 0.7  # a query this similar to a cluster (estimated Jaccard) is a probe of it
MOVE_BELOW = 0.9  # a matched query less similar than this becomes the cluster's sketch
CONTEXT_WIDTH = 2  # the default c: a scored pair is (2 previous tokens, token)
_ID_BITS = 21  # token ids below 2**21 pack three to a uint64
_ID_MASK = np.uint64((1 << _ID_BITS) - 1)
TENANT_ACCOUNT = "tenant"  # the store's account id: one set of clusters per tenant


def probe_secret(master_key: bytes) -> bytes:
    """The MinHash key: derived from (never equal to) the master key."""
    return hmac.new(master_key, b"worldcup-probe-minhash-v1", hashlib.sha256).digest()


@dataclass(frozen=True)
class Sketch:
    values: NDArray[np.uint64]  # NUM_HASHES minimums
    bands: list[str]  # "band:hash" LSH keys

    def similarity(self, raw: bytes) -> float:
        other = np.frombuffer(raw, dtype=np.uint64)
        if other.shape != self.values.shape:
            return 0.0
        return float(np.mean(other == self.values))


def _mix(z: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """SplitMix64's finaliser: a bijection of uint64 with full avalanche."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hash_keys(secret: bytes) -> NDArray[np.uint64]:
    raw = b"".join(
        hashlib.blake2b(f"minhash:{i}".encode(), key=secret[:64], digest_size=64).digest()
        for i in range(NUM_HASHES * 8 // 64)
    )
    return np.frombuffer(raw, dtype=np.uint64).copy()


def _band_hash(rows: NDArray[np.uint64]) -> str:
    return hashlib.blake2b(rows.tobytes(), digest_size=8).hexdigest()


def sketch_tokens(token_ids: Sequence[int], keys: NDArray[np.uint64]) -> Sketch | None:
    """The keyed MinHash of a text's scored (context, token) pairs; None if it has none."""
    ids = np.asarray(token_ids, dtype=np.uint64) & _ID_MASK
    if ids.size <= CONTEXT_WIDTH:
        return None
    shingles = (ids[:-2] << np.uint64(2 * _ID_BITS)) | (ids[1:-1] << np.uint64(_ID_BITS)) | ids[2:]
    shingles = np.unique(shingles)
    values = np.empty(NUM_HASHES, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, NUM_HASHES, 16):  # bounded temporaries for long texts
            block = _mix(shingles[:, None] ^ keys[None, start : start + 16])
            values[start : start + 16] = block.min(axis=0)
    bands = [f"{b}:{_band_hash(values[b * ROWS : (b + 1) * ROWS])}" for b in range(BANDS)]
    return Sketch(values, bands)


class ProbeAccountant:
    """Counts detect/decode queries against per-text budgets of a tenant in the store."""

    def __init__(
        self,
        store: Store,
        secret: bytes,
        metrics: Metrics,
        window_s: float,
        budget_full: int,
        budget_verdict: int,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.window_s = window_s
        self.budgets = {"full": budget_full, "verdict": budget_verdict}
        self._keys = _hash_keys(secret)

    def __repr__(self) -> str:
        return f"ProbeAccountant(window_s={self.window_s}, budgets={self.budgets})"

    def budget(self, detail: str) -> int:
        return self.budgets.get(detail, self.budgets["verdict"])

    def sketches(self, texts: Sequence[Sequence[int]]) -> list[Sketch | None]:
        """CPU work: call it in a worker thread."""
        return [sketch_tokens(t, self._keys) for t in texts]

    async def admit(
        self, tenant_id: str, key_id: str, detail: str, sketches: Sequence[Sketch | None]
    ) -> list[ProbeDecision]:
        """One decision per query, in order (a batch's near-copies of each other count
        against one budget). The clusters are the tenant's, shared by all its keys;
        ``key_id`` only names the caller. A budget of 0 turns accounting off for that
        detail level."""
        budget = self.budget(detail)
        decisions = []
        for sketch in sketches:
            if budget <= 0 or sketch is None:
                decisions.append(ProbeDecision(True, 0, 0.0))
                continue
            candidates = await self.store.probe_candidates(tenant_id, TENANT_ACCOUNT, sketch.bands)
            best_id, best = None, 0.0
            for cluster_id, raw in candidates:
                sim = sketch.similarity(raw)
                if sim > best:
                    best_id, best = cluster_id, sim
            if best_id is None or best < SIMILARITY:
                cluster_id, move = secrets.token_hex(8), True
            else:
                cluster_id, move = best_id, best < MOVE_BELOW
            decisions.append(
                await self.store.probe_hit(
                    tenant_id,
                    TENANT_ACCOUNT,
                    cluster_id,
                    sketch.values.tobytes() if move else None,
                    sketch.bands if move else [],
                    self.window_s,
                    budget,
                )
            )
        return decisions

    async def account(
        self,
        tenant_id: str,
        key_id: str,
        detail: str,
        route: str,
        sketches: Sequence[Sketch | None],
        request_id: str,
    ) -> list[ProbeDecision]:
        """Count each fingerprinted query of one request against its text's budget;
        the refusals are audited and counted once per request."""
        decisions = await self.admit(tenant_id, key_id, detail, sketches)
        refused = sum(not d.allowed for d in decisions)
        if refused:
            await self.refused(tenant_id, key_id, detail, route, request_id, refused)
        return decisions

    async def admit_one(
        self,
        tenant_id: str,
        key_id: str,
        detail: str,
        route: str,
        sketch: Sketch | None,
        request_id: str,
    ) -> None:
        """Count one query, or raise its 429 (``probe_budget_exceeded``) if refused."""
        decisions = await self.account(tenant_id, key_id, detail, route, [sketch], request_id)
        if not decisions[0].allowed:
            raise self.refusal(detail, decisions)

    def budget_message(self, detail: str) -> str:
        return (
            f"this text's probe budget is spent ({self.budget(detail)} near-duplicate queries "
            f"per {self.window_s:g} s for this tenant, all its API keys together)"
        )

    def refusal(self, detail: str, decisions: Sequence[ProbeDecision]) -> APIError:
        """The 429 for a refused query, with the wait until its text has budget again."""
        return APIError(
            429,
            self.budget_message(detail),
            "probe_budget_exceeded",
            {"Retry-After": str(retry_after(decisions))},
        )

    async def refused(
        self, tenant_id: str, key_id: str, detail: str, route: str, request_id: str, count: int
    ) -> None:
        """Audit and count the queries refused in one request."""
        self.metrics.probe_budget_exceeded.labels(detail).inc(count)
        await self.store.append_audit(
            AuditRecord(
                at=time.time(),
                actor=f"tenant:{tenant_id}",
                action="probe_budget_exceeded",
                request_id=request_id,
                outcome={
                    "key_id": key_id,
                    "detail": detail,
                    "route": route,
                    "refused": count,
                    "budget": self.budget(detail),
                    "window_s": self.window_s,
                },
            )
        )


def retry_after(decisions: Sequence[ProbeDecision]) -> int:
    """Whole seconds until the first refused query's text has budget again."""
    waits = [d.retry_after_s for d in decisions if not d.allowed]
    return max(1, math.ceil(min(waits))) if waits else 0
