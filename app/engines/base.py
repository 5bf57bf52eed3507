"""The generation engine protocol: what routes, health and the lifespan rely on.

An engine takes :class:`~worldcup_core.generation.GenerationRequest` rows (prompt
ids, sampling, scheme and payload) and answers each with a :class:`GenerationJob`
whose queue receives one :class:`~worldcup_core.generation.StepEvent` per token,
then the :class:`~worldcup_core.generation.GenerationResult` (or an exception).
Routes see only this protocol, so streaming, cancellation, timeouts, 429 on a
full queue and drain behave the same on every engine (``WORLDCUP_ENGINE``):

- ``hf`` (:mod:`app.engines.hf`): our continuous-batching loop over a
  Hugging Face model, in a thread. The embedded default.
- ``vllm`` (:mod:`app.engines.vllm`): vLLM's async engine, with WorldCup as a
  batch-level logits processor.

An engine may also run detection's forward passes (:attr:`Engine.weigher`, issue
#44): the informativeness of every token of a text under the served model
(:mod:`worldcup_core.token_weights`), which the detection statistics weigh tokens
by. ``hf`` runs them in its own batches, interleaved with generation steps
(:mod:`app.engines.hf`); ``vllm`` from its own prompt log-probs over each position's
top tokens (:meth:`app.engines.vllm.VLLMEngine.token_weights`). With
``WORLDCUP_DETECT_WITH_MODEL=false`` an engine offers none, and detection is
model-free and says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from app.core.logging import request_id_var
from worldcup_core.generation import GenerationRequest, GenerationResult, StepEvent


class QueueFull(Exception):
    """The waiting queue is at capacity."""


class EngineStopped(Exception):
    """The engine is shutting down and takes no new work (or dropped this job)."""


class UnwatermarkedError(RuntimeError):
    """A watermarked request's row was sampled without its watermark (a guard of the
    vLLM processor failed: ``reason``); its text must never be returned as watermarked."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"the vLLM step could not watermark this request ({reason}); the text is withheld"
        )
        self.reason = reason


@dataclass(eq=False)
class GenerationJob:
    """One submitted request; the engine pushes its events, the route reads them."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[StepEvent | GenerationResult | BaseException] = field(
        default_factory=asyncio.Queue
    )
    enqueued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    done: bool = False
    request_id: str = field(default_factory=request_id_var.get)  # for the error log

    def _push(self, item: StepEvent | GenerationResult | BaseException) -> None:
        """Thread-safe: hand ``item`` to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the request's event loop is gone (shutdown)
            pass


F64 = npt.NDArray[np.float64]


class TokenWeigher(Protocol):
    """Runs the served model over texts for detection (no generation, no key)."""

    async def token_weights(self, texts: Sequence[Sequence[int]]) -> list[F64]:
        """Each text's per-token informativeness ``a_t`` in [0, 1] (NaN where the model
        gives no distribution, e.g. the first token), one array per text, as long as
        it (:func:`worldcup_core.model_weights.model_token_weights`). Raises
        :class:`EngineStopped` when the engine shuts down first."""
        ...


class Engine(Protocol):
    """What every generation engine offers the service."""

    name: str
    max_queue: int

    @property
    def queue_depth(self) -> int:
        """Requests accepted but not yet generating (the 429 bound applies here)."""
        ...

    @property
    def logprobs_mode(self) -> str | None:
        """The one distribution ("sampled" or "model") this engine reports logprobs
        under for every request, or None when each request picks its own."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests waiting or generating."""
        ...

    @property
    def weigher(self) -> TokenWeigher | None:
        """Detection's forward passes on this engine's model, or None: detection is
        then model-free (the statistic every answer names)."""
        ...

    def start(self) -> None:
        """Begin serving; called once in the lifespan, on the event loop."""
        ...

    def submit(self, request: GenerationRequest) -> GenerationJob:
        """Queue ``request``; raises :class:`QueueFull` or :class:`EngineStopped`."""
        ...

    def cancel(self, job: GenerationJob) -> None:
        """Stop generating for ``job`` (client gone, timeout); idempotent."""
        ...

    async def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is waiting or running; False on timeout."""
        ...

    def stop(self) -> None:
        """Refuse new work, cancel what is left (after ``drain``) and release resources."""
        ...
