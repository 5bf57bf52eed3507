"""The ``hf`` engine: concurrent /generate requests share one forward pass per step.

A single generation thread owns a :class:`worldcup_core.generation.ContinuousBatch`.
Between steps it admits waiting jobs (up to ``max_batch``) and drops cancelled
ones (client gone, timeout); after each step it hands every job its token on
the job's event loop. The waiting queue is bounded: a full queue is refused
at once (the API answers 429 with Retry-After) instead of growing without limit.

**Detection's forward passes** (:meth:`HFEngine.token_weights`, issue #44) run on
the same thread, so the model is only ever used by one thread, in their own
batches: texts from any number of detection requests are packed into batches of at
most ``weights_batch_texts`` texts and ``weights_batch_tokens`` tokens (a text
longer than ``weights_max_tokens`` is read in windows of that many tokens, each
from its own start). The policy is a **time share** of the thread: while both kinds
of work wait, a detection batch runs only once generation steps have had
``(1 - share) / share`` times the previous batch's time since it
(``weights_time_share``, default one half), so

* generation is never starved: under any detection load it keeps at least
  ``1 - share`` of the thread's time, and each inter-token gap grows by at most one
  detection batch (bounded by ``weights_batch_tokens``);
* detection is never starved: under any generation load it gets ``share`` of the
  thread's time (at least one batch per step while its batches are shorter than a
  step); with nothing generating, batches run back to back;
* the detection queue is bounded: at most ``weights_max_pending`` texts wait; a
  request beyond that waits for room (on the event loop, holding no worker)
  instead of growing the queue.

Detection's forward passes run on :func:`worldcup_core.model_weights.weights_model`
of the served model (``weights_dtype``, default ``auto``: a bfloat16 copy where the
device computes bfloat16 natively, several times the float32 rate on AMX CPUs), and a
request's texts are batched by length, longest first, so that little of a batch is
padding.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.core.config import Settings
from app.core.metrics import Metrics
from app.engines.base import F64, EngineStopped, GenerationJob, QueueFull
from worldcup_core import SamplingConfig
from worldcup_core.batched import warm_up
from worldcup_core.generation import (
    ContinuousBatch,
    GenerationRequest,
)
from worldcup_core.generation import generate as run_generation
from worldcup_core.model_weights import (
    emulated_bfloat16,
    join_windows,
    model_token_weights,
    weights_model,
    windows,
)
from worldcup_core.models import load_model

logger = logging.getLogger("worldcup.engine.hf")


def _ids(jobs: Any) -> dict[str, Any]:
    """Log fields naming the requests a batch-wide failure hit (the thread has no context)."""
    return {"fields": {"request_id": ",".join(job.request_id for job in jobs)}}


@dataclass(eq=False)
class WeightsJob:
    """One detection request's texts (or windows of them) awaiting forward passes."""

    texts: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[F64]]
    out: list[F64 | None] = field(default_factory=list)
    taken: int = 0  # texts handed to a batch so far
    done: int = 0  # texts whose weights came back
    failed: bool = False

    def _finish(self, result: list[F64] | BaseException) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the request's event loop is gone (shutdown)
            pass


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
        weigher = (
            weights_model(lm.model, settings.weights_dtype) if settings.detect_with_model else None
        )
        if weigher is not None and emulated_bfloat16(settings.weights_dtype, lm.device):
            logger.warning(
                "WORLDCUP_WEIGHTS_DTYPE=bfloat16 on a device without native bfloat16 "
                "(no AMX or AVX512-BF16): detection's forward passes run emulated, about 5x "
                "slower than float32 on an AVX2 CPU; 'auto' picks float32 here"
            )
        engine = cls(
            lm.model,
            lm.eos_token_ids,
            lm.pad_token_id,
            metrics,
            max_batch=settings.max_batch_size,
            max_queue=settings.max_queue,
            weights_batch_texts=settings.weights_batch_texts,
            weights_batch_tokens=settings.weights_batch_tokens,
            weights_max_pending=settings.weights_max_pending,
            weights_time_share=settings.weights_time_share,
            weights_max_tokens=min(
                settings.weights_max_tokens,
                int(getattr(lm.model.config, "max_position_embeddings", 0) or 1 << 30),
            ),
            weights_model=weigher,
        )
        if weigher is not None:
            # the first detection batch pays no one-time cost a request would see
            model_token_weights(weigher, [[lm.pad_token_id] * 2], pad_token_id=lm.pad_token_id)
        else:
            engine.weigh = False
        return engine, lm.tokenizer, lm.model_id

    def __init__(
        self,
        model: Any,
        eos_token_ids: list[int],
        pad_token_id: int,
        metrics: Metrics,
        max_batch: int,
        max_queue: int,
        weights_batch_texts: int = 8,
        weights_batch_tokens: int = 1024,
        weights_max_pending: int = 256,
        weights_max_tokens: int = 2048,
        weights_time_share: float = 0.5,
        weights_model: Any | None = None,
    ) -> None:
        self._batch = ContinuousBatch(model, eos_token_ids, pad_token_id)
        # detection's forward passes: the served model, or its weights_model copy
        self.weights_model = model if weights_model is None else weights_model
        self.weigh = True  # offer detection's forward passes (WORLDCUP_DETECT_WITH_MODEL)
        self.weights_batch_texts = weights_batch_texts
        self.weights_batch_tokens = weights_batch_tokens
        self.weights_max_pending = weights_max_pending
        # a window always fits one batch: a batch is never wider than the token budget
        self.weights_max_tokens = max(2, min(weights_max_tokens, weights_batch_tokens))
        if not 0.0 < weights_time_share < 1.0:
            raise ValueError(f"weights_time_share must be in (0, 1), got {weights_time_share}")
        self.weights_time_share = weights_time_share
        self._stepped_s = 0.0  # generation step time since the last detection batch
        self._batch_s = 0.0  # the last detection batch's time
        self._weighing: collections.deque[WeightsJob] = collections.deque()
        self._room: asyncio.Condition | None = None  # made on the event loop
        self._queued = 0  # texts (windows) handed to the thread, not yet answered
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

    @property
    def weigher(self) -> HFEngine | None:
        return self if self.weigh else None

    @property
    def weights_waiting(self) -> int:
        """Texts (windows) queued for detection's forward passes, not yet in a batch."""
        with self._cond:
            return sum(len(job.texts) - job.taken for job in self._weighing)

    async def token_weights(self, texts: Sequence[Sequence[int]]) -> list[F64]:
        """Each text's informativeness from this engine's model (see the module
        docstring for the batching policy). Texts longer than ``weights_max_tokens``
        are read in windows, each from its own start (the weights still depend on the
        text and the model only)."""
        if not texts:
            return []
        if self._room is None:
            self._room = asyncio.Condition()
        cut = [windows(t, self.weights_max_tokens) for t in texts]
        flat = [w for parts in cut for w in parts]
        # longest first, so that a batch's texts have like lengths (little padding)
        order = sorted(range(len(flat)), key=lambda i: -len(flat[i]))
        ranked = [flat[i] for i in order]
        step = max(1, min(self.weights_batch_texts, self.weights_max_pending))
        # chunks of one batch each, queued as the bound allows (each takes its room whole)
        found = await asyncio.gather(
            *(self._weigh_chunk(ranked[i : i + step]) for i in range(0, len(ranked), step))
        )
        out: list[F64] = [np.empty(0)] * len(flat)
        for i, w in zip(order, (w for part in found for w in part), strict=True):
            out[i] = w
        return join_windows(cut, out)

    async def _weigh_chunk(self, chunk: list[list[int]]) -> list[F64]:
        room = self._room
        assert room is not None
        size = len(chunk)
        async with room:  # the whole chunk or nothing: no two requests hold part of the room
            await room.wait_for(lambda: self._queued + size <= self.weights_max_pending)
            self._queued += size
        try:
            loop = asyncio.get_running_loop()
            job = WeightsJob(chunk, loop, loop.create_future(), [None] * len(chunk))
            with self._cond:
                if not self._running:
                    raise EngineStopped()
                self._weighing.append(job)
                self._cond.notify()
            return await job.future
        finally:
            async with room:
                self._queued -= size
                room.notify_all()

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
            weighing = list(self._weighing)
            self._weighing.clear()
            self._cond.notify_all()
        for waiting in weighing:
            waiting._finish(EngineStopped())
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
            while self._running and not self._pending and not self._active and not self._weighing:
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
        started = time.perf_counter()
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
        self._stepped_s += now - started
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

    def _next_weights_batch(self) -> list[tuple[WeightsJob, int]]:
        """(job, text index) of the next detection batch: first come, first served,
        across jobs, up to ``weights_batch_texts`` texts and ``weights_batch_tokens``
        padded tokens (at least one text)."""
        picked: list[tuple[WeightsJob, int]] = []
        width = 0
        full = False
        with self._cond:
            for job in self._weighing:
                while job.taken < len(job.texts) and not full:
                    wider = max(width, len(job.texts[job.taken]))
                    if picked and wider * (len(picked) + 1) > self.weights_batch_tokens:
                        full = True
                        break
                    picked.append((job, job.taken))
                    job.taken += 1
                    width = wider
                    full = len(picked) >= self.weights_batch_texts
                if full:
                    break
            while self._weighing and self._weighing[0].taken == len(self._weighing[0].texts):
                self._weighing.popleft()
        return picked

    def detection_due(self) -> bool:
        """Whether a detection batch may run now: always with nothing generating, else
        once generation has had its share since the last batch (the time share)."""
        if not self._active:
            return True
        share = self.weights_time_share
        return self._stepped_s * share >= self._batch_s * (1.0 - share)

    def _weigh(self) -> None:
        """At most one detection batch (between two generation steps), when due."""
        if not self.detection_due():
            return
        picked = self._next_weights_batch()
        if not picked:
            return
        started = time.perf_counter()
        try:
            found = model_token_weights(
                self.weights_model,
                [job.texts[i] for job, i in picked],
                batch_size=len(picked),
                pad_token_id=self._batch.pad,
            )
        except Exception as exc:  # a failed batch fails its requests, not the thread
            logger.exception("detection forward pass failed", extra=_ids([]))
            for job in {id(j): j for j, _ in picked}.values():
                if not job.failed:
                    job.failed = True
                    job._finish(exc)
            with self._cond:
                self._weighing = collections.deque(j for j in self._weighing if not j.failed)
            return
        self._batch_s = time.perf_counter() - started
        self._stepped_s = 0.0
        self._metrics.detection_batch.observe(self._batch_s)
        for (job, i), weights in zip(picked, found, strict=True):
            job.out[i] = weights
            job.done += 1
            if job.done == len(job.texts) and not job.failed:
                job._finish([w for w in job.out if w is not None])

    def _run(self) -> None:
        while True:
            with self._cond:
                if (
                    not self._running
                    and not self._active
                    and not self._pending
                    and not self._weighing
                ):
                    return
            try:
                self._admit()
                self._step()
                self._weigh()  # one detection batch per generation step, at most
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
