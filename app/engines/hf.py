"""The ``hf`` engine: concurrent /generate requests share one forward pass per step.

A single generation thread owns a :class:`worldcup_core.generation.ContinuousBatch`.
Between steps it admits waiting jobs (up to ``max_batch``) and drops cancelled
ones (client gone, timeout); after each step it hands every job its token on
the job's event loop. The waiting queue is bounded: a full queue is refused
at once (the API answers 429 with Retry-After) instead of growing without limit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any

from app.core.config import Settings
from app.core.metrics import Metrics
from app.engines.base import EngineStopped, GenerationJob, QueueFull
from worldcup_core import SamplingConfig
from worldcup_core.batched import warm_up
from worldcup_core.generation import (
    ContinuousBatch,
    GenerationRequest,
)
from worldcup_core.generation import generate as run_generation
from worldcup_core.models import load_model

logger = logging.getLogger("worldcup.engine.hf")


def _ids(jobs: Any) -> dict[str, Any]:
    """Log fields naming the requests a batch-wide failure hit (the thread has no context)."""
    return {"fields": {"request_id": ",".join(job.request_id for job in jobs)}}


class HFEngine:
    """Our continuous-batching loop over a Hugging Face model, in one thread."""

    name = "hf"
    logprobs_mode: str | None = None  # each request picks "sampled" or "model"

    @classmethod
    def load(cls, settings: Settings, metrics: Metrics) -> tuple[HFEngine, Any, str]:
        """Load the model and warm it with a one-token generation (blocking)."""
        lm = load_model(settings.model_path, settings.device, settings.dtype, settings.cache_dir)
        warmup = GenerationRequest(
            lm.tokenizer("Hello", add_special_tokens=False).input_ids or [lm.pad_token_id],
            SamplingConfig(max_new_tokens=1, seed=0),
        )
        run_generation(lm.model, [warmup], lm.eos_token_ids, lm.pad_token_id)
        warm_up(lm.device)  # the watermark step's compiled CPU loops, before /health says ready
        engine = cls(
            lm.model,
            lm.eos_token_ids,
            lm.pad_token_id,
            metrics,
            max_batch=settings.max_batch_size,
            max_queue=settings.max_queue,
        )
        return engine, lm.tokenizer, lm.model_id

    def __init__(
        self,
        model: Any,
        eos_token_ids: list[int],
        pad_token_id: int,
        metrics: Metrics,
        max_batch: int,
        max_queue: int,
    ) -> None:
        self._batch = ContinuousBatch(model, eos_token_ids, pad_token_id)
        self._metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._pending: collections.deque[GenerationJob] = collections.deque()
        self._active: dict[int, GenerationJob] = {}
        self._cond = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._active)

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name="worldcup-generation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Refuse new work, cancel what is left (after ``drain``) and join the thread."""
        with self._cond:
            self._running = False
            for job in [*self._pending, *self._active.values()]:
                job.cancelled = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, request: GenerationRequest) -> GenerationJob:
        job = GenerationJob(request=request, loop=asyncio.get_running_loop())
        with self._cond:
            if not self._running:
                raise EngineStopped()
            if len(self._pending) >= self.max_queue:
                raise QueueFull()
            self._pending.append(job)
            self._metrics.queue_depth.set(len(self._pending))
            self._cond.notify()
        return job

    def cancel(self, job: GenerationJob) -> None:
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no job is waiting or running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight

    def _admit(self) -> None:
        with self._cond:
            while self._running and not self._pending and not self._active:
                self._cond.wait(timeout=0.5)
            admit: list[GenerationJob] = []
            dropped = [job for job in self._pending if job.cancelled]
            self._pending = collections.deque(job for job in self._pending if not job.cancelled)
            while self._pending and len(self._active) + len(admit) < self.max_batch:
                admit.append(self._pending.popleft())
            cancelled = [row for row, job in self._active.items() if job.cancelled]
            self._metrics.queue_depth.set(len(self._pending))
        for job in dropped:
            job.done = True
            job._push(EngineStopped())
        if cancelled:
            self._batch.cancel(cancelled)
            for row in cancelled:
                job = self._active.pop(row)
                job.done = True
                job._push(EngineStopped())
            # right away, not at the next step (which may never come)
            self._metrics.active_sequences.set(len(self._active))
        if admit:
            now = time.perf_counter()
            try:
                rows = self._batch.add([job.request for job in admit])
            except Exception as exc:  # a bad prompt must not take the batch down
                logger.exception("prefill failed", extra=_ids(admit))
                for job in admit:
                    job._push(exc)
                return
            for row, job in zip(rows, admit, strict=True):
                job.admitted_at = now
                self._metrics.queue_time.observe(now - job.enqueued_at)
                self._active[row] = job

    def _step(self) -> None:
        if not self._active:
            return
        self._metrics.active_sequences.set(len(self._active))
        self._metrics.batch_size.observe(len(self._active))
        try:
            events, finished = self._batch.step()
        except Exception as exc:
            logger.exception("generation step failed", extra=_ids(self._active.values()))
            self._batch.cancel(list(self._active))
            for job in self._active.values():
                job._push(exc)
            self._active.clear()
            self._metrics.active_sequences.set(0)
            return
        now = time.perf_counter()
        results = iter(finished)
        for ev in events:
            job = self._active[ev.row_id]
            if job.first_token_at is None:
                job.first_token_at = now
                self._metrics.ttft.observe(now - job.enqueued_at)
            else:
                assert job.last_token_at is not None
                self._metrics.inter_token.observe(now - job.last_token_at)
            job.last_token_at = now
            job._push(ev)
            if ev.finish is not None:
                job._push(next(results))
                job.done = True
                del self._active[ev.row_id]
        self._metrics.generated_tokens.inc(len(events))
        self._metrics.active_sequences.set(len(self._active))

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._running and not self._active and not self._pending:
                    return
            try:
                self._admit()
                self._step()
            except Exception as exc:  # the thread must outlive any one failure
                self._fail_active(exc)

    def _fail_active(self, exc: Exception) -> None:
        """A failure outside a step (admission, a cancel's cleanup): fail the running jobs
        with it (their requests answer 500, logged) and start a fresh batch, so the engine
        keeps serving instead of leaving every later request to time out."""
        logger.exception("generation thread failed", extra=_ids(self._active.values()))
        with self._cond:
            jobs = list(self._active.values())
            self._active.clear()
            self._batch = ContinuousBatch(self._batch.model, self._batch.eos, self._batch.pad)
        for job in jobs:
            job.done = True
            job._push(exc)
        self._metrics.active_sequences.set(0)
