"""The Redis store's client and plumbing: single Redis or Redis Cluster, fail fast.

Failure policy: each store call has a hard deadline of ``timeout_s`` (pool wait +
connect + command, a retry included), redis-py's own retries are disabled, and any
connection-level or cluster-topology error becomes :class:`StoreUnavailable` whose
message never contains the URL or its password. Broken pooled connections are re-opened
on their next use, and the cluster client re-reads the slot map after an error, so the
store recovers by itself when Redis (or a promoted replica) answers again.

Retry (:meth:`RedisBase._retry`): a call that is safe to run twice runs once more,
within the same deadline, after the failed attempt re-read the slot map (cluster), or
after a write that too few replicas acknowledged. That keeps a failover the cluster has
already absorbed away from clients: the first call after it meets a stale slot map or a
pooled connection to the dead primary, and its second attempt goes to the promoted
replica. Safe to run twice: every read; the writes that are idempotent by construction
(a registry entry, by id and content; a rate-limit debit and a probe hit, by an
operation id that the script records with its effect; plain SETs and DELs); and the
registry's id allocation, where a second ``INCR`` only leaves an id unused, never hands
one out twice (see :mod:`~app.stores.redis_registry`). Everything else (tenant
creation, API keys, cases, the audit stream, voids) gets one attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import redis
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


_REDIS_PACKAGE = os.path.dirname(redis.__file__) + os.sep


def torn_connection(exc: BaseException) -> bool:
    """redis-py's client races a topology change it is reacting to: a connection torn
    down by one coroutine while another still writes on it. Raised from inside redis-py
    as ``AttributeError``/``TypeError`` on the dropped writer (``'NoneType' object has
    no attribute 'writelines'``; redis/redis-py#3546, #3835) or as uvloop's
    ``RuntimeError`` on the closed transport (``... the handler is closed``), it means
    the same as a dropped connection: the node is not usable right now, and the call
    may be retried on a fresh map. Both were 500s in the cluster failover soak."""
    if isinstance(exc, AttributeError | TypeError):
        if "NoneType" not in str(exc):
            return False
    elif not isinstance(exc, RuntimeError) or "closed" not in str(exc):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_REDIS_PACKAGE):
            return True
        tb = tb.tb_next
    return False


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means "the backend is not usable right now", not a bug."""
    return isinstance(exc, UNAVAILABLE) or torn_connection(exc)


def stall_allowance(timeout_s: float) -> float:
    """How late a store deadline's timer may fire before the lateness counts as this
    process's own stall rather than the store's slowness: a fifth of the deadline, at
    least 50 ms (a running loop fires timers within milliseconds)."""
    return max(0.05, 0.2 * timeout_s)


T = TypeVar("T")
REFRESH_INTERVAL_S = 0.1  # slot-map re-reads at most this often (a failover's burst)


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
        self._refreshed_at = -1.0  # loop time the latest slot-map re-read completed
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
        """One attempt, bounded by ``timeout_s``, outages mapped to StoreUnavailable:
        for a call that must not run twice (:meth:`_retry` runs one that may)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + self._timeout_s), self._slots:
                if self._cluster and not self._ready:
                    await self._initialize()
                yield
        except Exception as exc:
            if not unavailable(exc):
                raise
            await self._refresh(loop.time(), exc, None)  # the topology may have changed
            raise StoreUnavailable(f"redis unavailable: {self._reason(exc)}") from None

    async def _retry(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, which must be safe to run twice (module docstring), and once more
        after an outage error or an unacknowledged write, all within one deadline of
        ``timeout_s``. Before the second attempt the slot map is re-read (cluster), so it
        goes to whichever node serves the slot now. A hung node uses the whole deadline
        in the first attempt: then there is no second.

        A deadline that passed while this process's event loop was stalled (the timer
        fired late by :func:`stall_allowance` or more: CPU or GIL starvation, a blocking
        callback) measures the process, not the store: the reply may have sat unread in
        the socket. The call then gets one fresh deadline, once, so an overloaded
        replica does not report a healthy store as unavailable (worst case: about two
        deadlines, then 503)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        attempt, extended = 1, False
        while True:
            try:
                async with asyncio.timeout_at(deadline), self._slots:
                    if self._cluster and not self._ready:
                        await self._initialize()
                    return await call()
            except NotAcknowledged:
                if attempt == 2 or loop.time() >= deadline:
                    raise
            except Exception as exc:
                if not unavailable(exc):
                    raise
                now = loop.time()
                if (
                    isinstance(exc, TimeoutError | RedisTimeoutError)
                    and not extended
                    and now - deadline >= stall_allowance(self._timeout_s)
                ):
                    extended, deadline = True, now + self._timeout_s
                    continue  # our stall, not the store's: the same attempt again
                last = attempt == 2 or now >= deadline
                await self._refresh(now, exc, None if last else deadline)
                if last:
                    raise StoreUnavailable(f"redis unavailable: {self._reason(exc)}") from None
            attempt += 1

    async def _initialize(self) -> None:
        """The cluster client's first slot-map read, once: concurrent first calls would
        each start one and close the connections of the others."""
        async with self._topology:
            if not self._ready:
                await self._redis.initialize()
                self._ready = True

    async def _refresh(self, failed_at: float, exc: BaseException, until: float | None) -> None:
        """Re-read the slot map after a call failed at ``failed_at`` (cluster only), by
        ``until`` (default: ``timeout_s`` from now). One re-read at a time; none if one
        completed after this failure (its map is newer than the one the call failed
        on), so a burst of failing calls re-reads once; and at most one every
        ``REFRESH_INTERVAL_S`` (a re-read reconnects every pooled connection), waited
        for, not skipped, so no call retries on a map older than its own failure."""
        if not self._cluster:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + self._timeout_s if until is None else until
        failed_node = getattr(exc, "last_failed_node_name", None)  # asked last, if at all
        with contextlib.suppress(*UNAVAILABLE):
            async with asyncio.timeout_at(until), self._topology:
                if self._refreshed_at > failed_at:
                    return
                await asyncio.sleep(self._refreshed_at + REFRESH_INTERVAL_S - loop.time())
                await self._redis.nodes_manager.initialize(last_failed_node_name=failed_node)
                self._refreshed_at = loop.time()

    def _pipeline(self) -> Any:
        """A non-transactional pipeline (per node in cluster mode)."""
        return self._redis.pipeline() if self._cluster else self._redis.pipeline(transaction=False)

    async def _hashes(self, keys: list[str]) -> list[dict[str, str]]:
        """HGETALL of each key, in one pipeline (one round trip per node); retried."""

        async def call() -> list[dict[str, str]]:
            pipe = self._pipeline()
            for key in keys:
                pipe.hgetall(key)
            return cast("list[dict[str, str]]", await pipe.execute())

        return await self._retry(call) if keys else []

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
        await self._retry(self._redis.ping)

    async def close(self) -> None:
        # Closing the client closes its pool(s) too.
        with contextlib.suppress(*UNAVAILABLE):
            await self._redis.aclose()
