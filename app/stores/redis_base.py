"""The Redis store's client and plumbing: single Redis or Redis Cluster, fail fast.

Failure policy: each store call has a hard deadline of ``timeout_s`` (pool wait +
connect + command), redis-py's own retries are disabled, and any connection-level or
cluster-topology error becomes :class:`StoreUnavailable` whose message never contains
the URL or its password. Broken pooled connections are re-opened on their next use,
and the cluster client re-reads the slot map after an error, so the store recovers by
itself when Redis (or a promoted replica) answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from app.stores.base import StoreUnavailable
from app.stores.redis_layout import Layout

# Errors that mean "the backend is not usable right now" (as opposed to a bug).
UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # includes AuthenticationError, BusyLoadingError, pool exhaustion
    RedisTimeoutError,
    ReadOnlyError,  # failover in progress: we are talking to a replica
    ClusterError,  # CLUSTERDOWN, MASTERDOWN: a failover in progress
    AskError,  # MOVED/ASK past the client's redirections: the slot map is changing
    TryAgainError,
    RedisClusterException,  # slot not covered, no node reachable
    OSError,
    TimeoutError,  # our own per-call deadline (asyncio.timeout)
)


class NotAcknowledged(StoreUnavailable):
    """A write that Redis applied but too few replicas acknowledged in time."""


class RedisBase:
    """Client, key layout and the acknowledged-write helper shared by the store's parts."""

    def __init__(
        self,
        url: str,
        prefix: str = "wc",
        timeout_s: float = 2.0,
        max_connections: int = 64,
        cluster: bool = False,
        wait_replicas: int | None = None,
        wait_timeout_ms: int = 500,
    ) -> None:
        self._keys = Layout(prefix)
        parts = urlsplit(url)
        # Kept only to scrub it from error messages; never logged or shown.
        self._password = parts.password or ""
        self._where = f"{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path or ''}"
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._cluster = cluster
        # WAIT after each registry write: 1 replica by default in cluster mode
        self._wait_replicas = (1 if cluster else 0) if wait_replicas is None else wait_replicas
        self._wait_ms = max(1, min(int(wait_timeout_ms), int(timeout_s * 1000) // 2))
        common: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),  # fail fast; the caller answers 503
            # Off: with maintenance notifications on, redis-py skips its check for dead
            # pooled sockets (so the first calls after an outage fail again) and may
            # relax timeouts to many seconds during server maintenance.
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
            "decode_responses": True,
        }
        # The cluster client's per-node pools do not wait for a free connection (they
        # raise at once), so calls queue here instead: one call holds at most one
        # connection per node, so this bounds every node's pool.
        self._slots: contextlib.AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(max_connections) if cluster else contextlib.nullcontext()
        )
        self._topology = asyncio.Lock()
        self._ready = False
        self._refreshed_at = -1.0
        self._redis: Any
        if cluster:
            self._redis = RedisCluster.from_url(
                url,
                max_connections=max_connections,
                cluster_error_retry_attempts=1,
                reinitialize_steps=1,  # re-read the slot map at the first MOVED
                **common,
            )
        else:
            pool = BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=timeout_s,  # waiting for a free pooled connection
                **common,
            )
            self._redis = Redis.from_pool(pool)

    def __repr__(self) -> str:
        mode = ", cluster" if self._cluster else ""
        return f"{type(self).__name__}({self._where!r}, prefix={self._prefix!r}{mode})"

    def _script(self, text: str) -> AsyncScript:
        script: AsyncScript = self._redis.register_script(text)
        return script

    def _reason(self, exc: BaseException) -> str:
        text = str(exc) or type(exc).__name__
        if self._password:
            text = text.replace(self._password, "***")
        return f"{type(exc).__name__}: {text}"[:200]

    @contextlib.asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        """Bound the whole call by ``timeout_s`` and map outages to StoreUnavailable."""
        try:
            async with asyncio.timeout(self._timeout_s), self._slots:
                if self._cluster and not self._ready:
                    await self._initialize()
                yield
        except UNAVAILABLE as exc:
            if self._cluster:  # the topology may have changed: re-read it now
                await self._refresh()
            raise StoreUnavailable(f"redis unavailable: {self._reason(exc)}") from None

    async def _initialize(self) -> None:
        """The cluster client's first slot-map read, once: concurrent first calls would
        each start one and close the connections of the others."""
        async with self._topology:
            if not self._ready:
                await self._redis.initialize()
                self._ready = True

    async def _refresh(self) -> None:
        """Re-read the slot map after an error; one refresh at a time, at most every
        0.2 s (a burst of failing calls must not close each other's connections)."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(*UNAVAILABLE):
            async with asyncio.timeout(self._timeout_s), self._topology:
                if loop.time() - self._refreshed_at < 0.2:
                    return
                await self._redis.nodes_manager.initialize()
                self._refreshed_at = loop.time()

    def _pipeline(self) -> Any:
        """A non-transactional pipeline (per node in cluster mode)."""
        return self._redis.pipeline() if self._cluster else self._redis.pipeline(transaction=False)

    async def _eval_acked(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        """Run a script, then ``WAIT`` for replicas on the same connection.

        Raises :class:`NotAcknowledged` when fewer than ``wait_replicas`` replicas
        confirmed the write within the wait timeout: the write may or may not survive a
        failover, so the caller must not report success.
        """
        if self._wait_replicas <= 0:
            return await script(keys=keys, args=args)
        command = ("EVAL", script.script, len(keys), *keys, *args)
        wait = ("WAIT", self._wait_replicas, self._wait_ms)
        if self._cluster:
            # Both commands to the key's primary in one pipeline: one connection, so WAIT
            # covers this write (WAIT counts the replication offset of its connection).
            node = self._redis.get_node_from_key(keys[0])
            pipe = self._redis.pipeline()
            pipe.execute_command(*command, target_nodes=node)
            pipe.execute_command(*wait, target_nodes=node)
            result, acked = await pipe.execute(raise_on_error=False, allow_redirections=False)
        else:
            pipe = self._redis.pipeline(transaction=False)
            pipe.execute_command(*command)
            pipe.execute_command(*wait)
            result, acked = await pipe.execute(raise_on_error=False)
        if isinstance(result, BaseException):
            raise result
        if isinstance(acked, BaseException):
            raise acked
        if int(acked) < self._wait_replicas:
            raise NotAcknowledged(
                f"redis unavailable: {int(acked)} of {self._wait_replicas} replicas "
                f"acknowledged a write within {self._wait_ms} ms"
            )
        return result

    # -- lifecycle ------------------------------------------------------------

    async def ping(self) -> None:
        async with self._guard():
            await self._redis.ping()

    async def close(self) -> None:
        # Closing the client closes its pool(s) too.
        with contextlib.suppress(*UNAVAILABLE):
            await self._redis.aclose()
