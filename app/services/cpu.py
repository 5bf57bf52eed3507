"""A bounded pool of worker threads for the CPU-heavy work of requests.

Tokenisation, scoring, decoding and registry matching run here, never on the
event loop, so ``/health``, ``/ready`` and ``/metrics`` answer within
milliseconds while bulk routes run at full rate. The pool has its own
executor (the default one serves the SQLite store; sharing it would let a
burst of scoring starve store calls) and a bound on the jobs admitted: beyond
it a request is refused at once with 503 and ``Retry-After`` (shed early)
instead of queueing for seconds behind work that is already late.

Threads, not processes: the hot paths (the Rust tokenizer, numpy scoring)
release the GIL for most of their time, and a process pool would pay a
pickling round trip per job and hold a copy of every unwrapped key per worker.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["CpuPool", "Overloaded", "offload"]

T = TypeVar("T")

# The interpreter hands the GIL to a waiting thread every switch interval; the
# default 5 ms lets a few busy workers delay the event loop by tens of ms. 1 ms
# keeps probe latency low at a negligible cost in throughput.
_SWITCH_INTERVAL_S = 0.001


class Overloaded(Exception):
    """The pool has ``max_pending`` jobs admitted already; the caller answers 503."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("overloaded")
        self.retry_after_s = retry_after_s


class CpuPool:
    """``await pool.run(fn, *args)`` runs ``fn`` in a worker thread, or raises Overloaded."""

    def __init__(self, workers: int, max_pending: int, retry_after_s: int = 1) -> None:
        if workers < 1 or max_pending < 1:
            raise ValueError("workers and max_pending must be >= 1")
        self.workers = workers
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="worldcup-cpu")
        self._lock = threading.Lock()
        self._pending = 0
        if sys.getswitchinterval() > _SWITCH_INTERVAL_S:
            sys.setswitchinterval(_SWITCH_INTERVAL_S)

    @property
    def pending(self) -> int:
        """Jobs admitted and not finished (running or waiting for a worker)."""
        return self._pending

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(self.retry_after_s)
            self._pending += 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        # Released when the job ends, not when the caller stops waiting: a client
        # that disconnects does not free its worker any sooner.
        future.add_done_callback(lambda _: self._release())
        return await asyncio.wrap_future(future)

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


async def offload(pool: CpuPool | None, fn: Callable[[], T]) -> T:
    """Run a request's CPU work off the event loop: in the bounded pool (which may
    refuse it with Overloaded), or in a plain thread when there is none."""
    if pool is not None:
        return await pool.run(fn)
    return await asyncio.to_thread(fn)
