"""The legacy (pre-cluster) Redis layout, written for the migration tests.

``downgrade`` turns a namespace written by today's store on one Redis into exactly
what the legacy store left: a tenant's keys as ``p:t:<name>``, its registry in one
hash ``p:t:msgs`` with indexes ``p:t:msgidx:<kv>:<bits>``, and no ``p:layout``.
"""

from __future__ import annotations

from redis import Redis


def downgrade(client: Redis, prefix: str) -> int:
    """Rewrite ``prefix``'s keys into the legacy layout; returns the keys rewritten."""
    done = 0
    for raw in client.smembers(f"{prefix}:tenants"):  # type: ignore[union-attr]
        tid = raw.decode() if isinstance(raw, bytes) else str(raw)
        for key in client.scan_iter(match=f"{prefix}:{{{tid}}}:*", count=1000):
            rest = key.decode().split("}:", 1)[1]
            if rest == "creating" or rest.startswith("msglive:"):  # no such keys then
                client.delete(key)
                continue
            client.rename(key, f"{prefix}:{tid}:{rest}")
            done += 1
        for key in client.scan_iter(match=f"{prefix}:{{{tid}:*}}:*", count=1000):
            rest = key.decode().split("}:", 1)[1]
            if rest == "msgs":
                entries = client.hgetall(key)
                if entries:
                    client.hset(f"{prefix}:{tid}:msgs", mapping=entries)  # type: ignore[arg-type]
            else:  # idx:<kv>:<bits>
                _, kv, bits = rest.split(":")
                members = client.zrange(key, 0, -1, withscores=True)
                if members:
                    client.zadd(f"{prefix}:{tid}:msgidx:{kv}:{bits}", dict(members))  # type: ignore[arg-type]
            client.delete(key)
            done += 1
    client.delete(f"{prefix}:layout")
    return done
