"""The SQLite store's abuse limits: probe accounting and per-tenant rate limits.

Probe rows are short-lived counters, written without the fsync (``synchronous=NORMAL``)
and swept now and then. Token buckets live in this process: the embedded store
serves one node.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping, Sequence

from app.stores.base import (
    COUNT_ONLY,
    ProbeCounting,
    ProbeDecision,
    RateDecision,
    check_tenant_id,
)
from app.stores.sqlite_base import SQLiteBase, sweep_expired, transaction

_SWEEP_EVERY = 256  # probe_hit calls between two sweeps of expired probe rows


class SQLiteLimits(ProbeCounting, SQLiteBase):
    # -- probe accounting -----------------------------------------------------

    async def probe_candidates(
        self, tenant_id: str, key_id: str, bands: list[str], limit: int = 8, min_hits: int = 1
    ) -> list[tuple[str, bytes]]:
        check_tenant_id(tenant_id)
        if not bands or limit <= 0:
            return []
        now = self._clock()
        marks = ",".join("?" * len(bands))

        rows = await self._all(
            "SELECT k.cluster_id, k.sketch, COUNT(*) AS n FROM probe_bands b"
            " JOIN probe_clusters k"
            " ON k.tenant_id = b.tenant_id AND k.key_id = b.key_id"
            " AND k.cluster_id = b.cluster_id"
            f" WHERE b.tenant_id = ? AND b.key_id = ? AND b.band IN ({marks})"
            " AND b.expires_at > ? AND k.expires_at > ?"
            " GROUP BY k.cluster_id HAVING n >= ? ORDER BY n DESC, k.cluster_id LIMIT ?",
            (tenant_id, key_id, *bands, now, now, min_hits, limit),
        )
        return [(r["cluster_id"], bytes(r["sketch"])) for r in rows]

    async def probe_clusters(self, tenant_id: str, key_id: str) -> list[tuple[str, bytes]]:
        check_tenant_id(tenant_id)
        rows = await self._all(
            "SELECT cluster_id, sketch FROM probe_clusters WHERE tenant_id = ? AND key_id = ?"
            " AND expires_at > ? ORDER BY cluster_id",
            (tenant_id, key_id, self._clock()),
        )
        return [(r["cluster_id"], bytes(r["sketch"])) for r in rows]

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
        """One write transaction."""
        check_tenant_id(tenant_id)
        now = self._clock()
        expires = now + window_s
        ident = (tenant_id, key_id, cluster_id)
        known = {cluster_id, *seen}

        def op(c: sqlite3.Connection) -> ProbeDecision | None:
            # Losing the last few probe records to a power cut is harmless, so these
            # commits skip the fsync (WAL, synchronous=NORMAL).
            c.execute("PRAGMA synchronous=NORMAL")
            try:
                with transaction(c):
                    if min_hits > 0 and bands:
                        marks = ",".join("?" * len(bands))
                        pointed = c.execute(
                            "SELECT b.cluster_id FROM probe_bands b JOIN probe_clusters k"
                            " ON k.tenant_id = b.tenant_id AND k.key_id = b.key_id"
                            " AND k.cluster_id = b.cluster_id"
                            f" WHERE b.tenant_id = ? AND b.key_id = ? AND b.band IN ({marks})"
                            " AND b.expires_at > ? AND k.expires_at > ?"
                            " GROUP BY b.cluster_id HAVING COUNT(*) >= ?",
                            (tenant_id, key_id, *bands, now, now, min_hits),
                        )
                        if any(r[0] not in known for r in pointed):
                            return None
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

    async def probe_hit_all(
        self, tenant_id: str, key_id: str, hits: Mapping[str, int], window_s: float, budget: int
    ) -> bool:
        check_tenant_id(tenant_id)
        wanted = [(c, n) for c, n in hits.items() if n > 0]
        if not wanted:
            return True
        now = self._clock()

        def op(c: sqlite3.Connection) -> bool:
            c.execute("PRAGMA synchronous=NORMAL")  # short-lived counters, as _probe_count
            try:
                with transaction(c):
                    self._sweep_probes(c, now)
                    for cluster_id, n in wanted:
                        ident = (tenant_id, key_id, cluster_id)
                        c.execute(
                            "DELETE FROM probe_hits WHERE tenant_id = ? AND key_id = ?"
                            " AND cluster_id = ? AND at <= ?",
                            (*ident, now - window_s),
                        )
                        (count,) = c.execute(
                            "SELECT COUNT(*) FROM probe_hits WHERE tenant_id = ? AND key_id = ?"
                            " AND cluster_id = ?",
                            ident,
                        ).fetchone()
                        if int(count) + n > budget:
                            return False
                    for cluster_id, n in wanted:
                        ident = (tenant_id, key_id, cluster_id)
                        c.executemany(
                            "INSERT INTO probe_hits VALUES (?, ?, ?, ?)", [(*ident, now)] * n
                        )
                        c.execute(
                            "INSERT OR REPLACE INTO probe_clusters VALUES (?, ?, ?, ?, ?)",
                            (*ident, COUNT_ONLY, now + window_s),
                        )
                    return True
            finally:
                c.execute("PRAGMA synchronous=FULL")

        return await self._run(op)

    def _sweep_probes(self, c: sqlite3.Connection, now: float) -> None:
        """Drop expired probe rows now and then (bounded table growth)."""
        self._probe_calls += 1
        if self._probe_calls % _SWEEP_EVERY:
            return
        sweep_expired(c, "probe_bands", now)
        sweep_expired(c, "probe_clusters", now)
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
