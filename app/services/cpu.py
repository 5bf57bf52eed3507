"""A bounded pool of worker threads for the CPU-heavy work of requests, shared
fairly between tenants.

Tokenisation, scoring, decoding and registry matching run here, never on the
event loop, so ``/health``, ``/ready`` and ``/metrics`` answer within
milliseconds while bulk routes run at full rate. The pool has its own threads
(the default executor serves the SQLite store; sharing it would let a burst of
scoring starve store calls) and a bound on the calls admitted: beyond it a
request is refused at once with 503 and ``Retry-After`` (shed early) instead
of queueing for seconds behind work that is already late.

Fair shares. Every job belongs to a *share*: the tenant of the API key that
made the request (set by the authentication dependency, see :func:`set_share`),
``admin`` for the admin token, ``-`` for anything unauthenticated. Each share
has its own FIFO queue, and a free worker takes the next job from the next
share in round-robin order (a share that empties leaves the ring; one that gets
work joins at its back). Batch routes hand the pool their items in chunks of
about ``chunk_chars`` characters (:meth:`CpuPool.map`), so a bulk request is
many short jobs, not one long one. Together: when tenant A has hundreds of
chunks queued and tenant B sends one ``/detect``, B's job starts at the next
free worker after at most one more of A's jobs (one per other busy share),
i.e. within about one chunk's time, not after A's whole backlog. The pool stays
work-conserving: a share alone gets every worker.

Admission is per call (one request's ``run`` or ``map``), globally
(``max_pending``) and per share (``max_pending_per_share``): one tenant cannot
fill the global bound and get every other tenant shed. A call whose caller is
cancelled (a timeout, a dropped client) drops its jobs that have not started;
its running job finishes and only then frees its admission.

``fair=False`` is the old first-come-first-served pool (one queue, no
per-share bound, a batch as one job), kept so ``worldcup bench service`` can
measure both side by side.

Threads, not processes: the hot paths (the Rust tokenizer, numpy scoring)
release the GIL for most of their time, and a process pool would pay a
pickling round trip per job and hold a copy of every unwrapped key per worker.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any, Generic, TypeVar

__all__ = [
    "ADMIN_SHARE",
    "TOKEN_CHARS",
    "DEFAULT_SHARE",
    "CpuPool",
    "Overloaded",
    "current_share",
    "offload",
    "offload_map",
    "set_share",
]

T = TypeVar("T")
X = TypeVar("X")
Y = TypeVar("Y")

# The interpreter hands the GIL to a waiting thread every switch interval; the
# default 5 ms lets a few busy workers delay the event loop by tens of ms. 1 ms
# keeps probe latency low at a negligible cost in throughput.
_SWITCH_INTERVAL_S = 0.001

DEFAULT_SHARE = "-"  # no credential resolved (yet)
ADMIN_SHARE = "admin"
_FIFO_SHARE = "*"  # the one queue of fair=False
# a token counts as this many characters when a batch of token ids is chunked
TOKEN_CHARS = 4

_share: ContextVar[str] = ContextVar("worldcup_cpu_share", default=DEFAULT_SHARE)


def set_share(share: str) -> None:
    """Name the share of the current request's CPU work. Called by the authentication
    dependencies with the resolved principal's tenant (or :data:`ADMIN_SHARE`), so the
    share comes from the API key, never from the request body."""
    _share.set(share)


def current_share() -> str:
    return _share.get()


class Overloaded(Exception):
    """The pool (or this share of it) has its bound of calls admitted; the caller answers 503."""

    def __init__(self, retry_after_s: int, scope: str = "pool") -> None:
        super().__init__("overloaded")
        self.retry_after_s = retry_after_s
        self.scope = scope  # "pool" (global bound) or "share" (this tenant's bound)


@dataclass(eq=False, slots=True)
class _Job(Generic[T]):
    share: str
    fn: Callable[..., T]
    args: tuple[object, ...]
    future: Future[T] = field(default_factory=Future)


@dataclass(eq=False, slots=True)
class _Call:
    """One admitted call; its admission is released when its last job is done."""

    share: str
    jobs_left: int


class CpuPool:
    """``await pool.run(fn, *args)`` runs ``fn`` in a worker thread, or raises Overloaded;
    ``await pool.map(fn, items)`` runs ``fn`` over chunks of ``items``."""

    def __init__(
        self,
        workers: int,
        max_pending: int,
        retry_after_s: int = 1,
        *,
        max_pending_per_share: int | None = None,
        chunk_chars: int = 16_000,
        fair: bool = True,
    ) -> None:
        if workers < 1 or max_pending < 1:
            raise ValueError("workers and max_pending must be >= 1")
        if max_pending_per_share is not None and max_pending_per_share < 1:
            raise ValueError("max_pending_per_share must be >= 1")
        if chunk_chars < 1:
            raise ValueError("chunk_chars must be >= 1")
        self.workers = workers
        self.max_pending = max_pending
        self.max_pending_per_share = max_pending_per_share or max_pending
        self.retry_after_s = retry_after_s
        self.chunk_chars = chunk_chars
        self.fair = fair
        self._lock = threading.Lock()
        # One token per job queued (and one per worker at close): a worker blocks
        # in C on this queue, then takes the next job by the ring under the lock.
        # A job dropped from its queue leaves a token behind: one empty wake-up.
        self._wake: SimpleQueue[None] = SimpleQueue()
        self._queues: dict[str, deque[_Job[Any]]] = {}
        self._ring: deque[str] = deque()  # shares with queued jobs, in serving order
        self._pending = 0
        self._pending_by_share: dict[str, int] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"worldcup-cpu-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()
        if sys.getswitchinterval() > _SWITCH_INTERVAL_S:
            sys.setswitchinterval(_SWITCH_INTERVAL_S)

    # introspection ------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Calls admitted and not finished (running or waiting for a worker)."""
        return self._pending

    def pending_of(self, share: str) -> int:
        """Calls of ``share`` admitted and not finished."""
        with self._lock:
            return self._pending_by_share.get(share, 0)

    def queued(self, share: str | None = None) -> int:
        """Jobs waiting for a worker (of ``share``, or of every share)."""
        with self._lock:
            if share is not None:
                return len(self._queues.get(share, ()))
            return sum(len(q) for q in self._queues.values())

    # the event loop's side -------------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: object, share: str | None = None) -> T:
        """Run ``fn(*args)`` in a worker, as one job of the caller's share."""
        call = self._admit(share or current_share(), 1)
        job = self._submit(call, fn, args)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.future.cancel()  # dropped if not started yet; a running job finishes
            raise

    async def map(
        self,
        fn: Callable[[list[X]], list[Y]],
        items: Sequence[X],
        weight: Callable[[X], int] = len,  # type: ignore[assignment]
        share: str | None = None,
    ) -> list[Y]:
        """``fn`` over ``items``, in chunks of about ``chunk_chars`` of ``weight`` (at
        least one item each), each chunk its own job; the results concatenated in
        order. ``fn`` must return one result per item of its chunk. One admission
        for the whole call. With ``fair=False``, one job for every item (as before)."""
        if not items:
            return []
        chunks = self._chunks(items, weight) if self.fair else [list(items)]
        call = self._admit(share or current_share(), len(chunks))
        jobs = [self._submit(call, fn, (chunk,)) for chunk in chunks]
        try:
            parts = await asyncio.gather(*(asyncio.wrap_future(j.future) for j in jobs))
        except BaseException:  # a chunk failed, or the caller was cancelled
            for job in jobs:
                job.future.cancel()
            raise
        out: list[Y] = []
        for chunk, part in zip(chunks, parts, strict=True):
            if len(part) != len(chunk):
                raise ValueError("a map function must return one result per item")
            out.extend(part)
        return out

    def _chunks(self, items: Sequence[X], weight: Callable[[X], int]) -> list[list[X]]:
        chunks: list[list[X]] = [[]]
        size = 0
        for item in items:
            w = max(1, weight(item))
            if chunks[-1] and size + w > self.chunk_chars:
                chunks.append([])
                size = 0
            chunks[-1].append(item)
            size += w
        return chunks

    def _admit(self, share: str, jobs: int) -> _Call:
        if not self.fair:
            share = _FIFO_SHARE
        with self._lock:
            if self._closed:
                raise RuntimeError("the CPU pool is closed")
            if self._pending >= self.max_pending:
                raise Overloaded(self.retry_after_s, "pool")
            mine = self._pending_by_share.get(share, 0)
            if self.fair and mine >= self.max_pending_per_share:
                raise Overloaded(self.retry_after_s, "share")
            self._pending += 1
            self._pending_by_share[share] = mine + 1
        return _Call(share, jobs)

    def _submit(self, call: _Call, fn: Callable[..., T], args: tuple[object, ...]) -> _Job[T]:
        job: _Job[T] = _Job(call.share, fn, args)
        # Released when the job ends (or is dropped before it started), not when the
        # caller stops waiting: a client that disconnects does not free a running
        # worker any sooner.
        job.future.add_done_callback(lambda f: self._done(call, job, f))
        with self._lock:
            queue = self._queues.get(call.share)
            if queue is None:
                queue = self._queues[call.share] = deque()
                self._ring.append(call.share)
            queue.append(job)
        self._wake.put(None)
        return job

    def _done(self, call: _Call, job: _Job[Any], future: Future[Any]) -> None:
        with self._lock:
            if future.cancelled():
                queue = self._queues.get(job.share)
                if queue is not None and job in queue:
                    queue.remove(job)
                    if not queue:
                        del self._queues[job.share]
                        self._ring.remove(job.share)
            call.jobs_left -= 1
            if call.jobs_left:
                return
            self._pending -= 1
            left = self._pending_by_share[call.share] - 1
            if left:
                self._pending_by_share[call.share] = left
            else:
                del self._pending_by_share[call.share]

    # the workers' side ---------------------------------------------------------
    def _next(self) -> _Job[Any]:
        """The head job of the share at the front of the ring (the lock is held); the
        share goes to the back of the ring, or leaves it when its queue is empty."""
        share = self._ring.popleft()
        queue = self._queues[share]
        job = queue.popleft()
        if queue:
            self._ring.append(share)
        else:
            del self._queues[share]
        return job

    def _work(self) -> None:
        while True:
            self._wake.get()
            with self._lock:
                if not self._ring:
                    if self._closed:
                        return
                    continue  # the token of a dropped job
                job = self._next()
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled between leaving the queue and starting
            try:
                result = job.fn(*job.args)
            except BaseException as exc:
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            del job

    def close(self) -> None:
        """Stop taking calls, drop the queued jobs; running jobs finish in their threads."""
        with self._lock:
            self._closed = True
            dropped = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._ring.clear()
        for _ in self._threads:
            self._wake.put(None)
        for job in dropped:
            job.future.cancel()


async def offload(pool: CpuPool | None, fn: Callable[[], T]) -> T:
    """Run a request's CPU work off the event loop: in the bounded pool (which may
    refuse it with Overloaded), or in a plain thread when there is none."""
    if pool is not None:
        return await pool.run(fn)
    return await asyncio.to_thread(fn)


async def offload_map(
    pool: CpuPool | None,
    fn: Callable[[list[X]], list[Y]],
    items: Sequence[X],
    weight: Callable[[X], int] = len,  # type: ignore[assignment]
) -> list[Y]:
    """A batch's CPU work in bounded chunks (see :meth:`CpuPool.map`), or in one plain
    thread when there is no pool."""
    if pool is not None:
        return await pool.map(fn, items, weight)
    return await asyncio.to_thread(fn, list(items))
