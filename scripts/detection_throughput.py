"""Detection throughput with and without the served model, per process (issue #44).

Prints one JSON object. For each precision of detection's forward passes
(``--dtypes``, default ``float32,bfloat16``: ``WORLDCUP_WEIGHTS_DTYPE``), side by side:

* ``weights``: the hf engine's batched forward passes alone
  (:meth:`app.engines.hf.HFEngine.token_weights`, its own batching policy);
* ``model``: weights, then the tests weighted, as a /decode of the model-assisted
  statistic costs (the verdict's tests, :func:`app.services.watermark.verdict_stats`,
  and the decoder's reading, :func:`worldcup_core.detector_weighted.verdict_decode_many`);
* ``beside_generation``: generation and detection at once on the engine's thread
  (its time share), each one's rate then;

and once: ``model_free`` (the same tests without weights) and ``generation alone``.

``--engine vllm`` (run it from ``.venv-vllm``: ``make setup-vllm``) measures the vLLM
engine as the service builds it (:meth:`app.engines.vllm.VLLMEngine.load`, the WorldCup
processor loaded, ``WORLDCUP_MAX_BATCH_SIZE`` = ``--max-batch``): ``weights`` (vLLM's
prompt log-probs, at most half of its sequence slots), ``model`` (those, then the tests),
generation alone and ``beside_generation``; vLLM computes in its own dtype, so there is
one arm, not one per ``--dtypes``. ``--watermark`` gives every generation row a key and
a random payload (the service's path; default: plain rows, as the hf figures of
docs/operations.md were taken).
Every rate is wall-clock texts (or tokens) per second of this process, with the
process's CPU seconds per text beside it (``cpu_s_per_text``: all its threads; on a
shared machine the wall rate mostly measures the neighbours, the CPU time less so).
``bf16_vs_fp32`` says how far the bfloat16 weights are from the float32 ones.

``--answers FILE`` (``answers.jsonl`` of ``python -m worldcup_eval.model_weights_study
generate``: watermarked chat answers with their keys) adds ``power``: the message-free
test's median log10 p over those answers with each precision's weights, and how far
the weights and p-values move.

Texts are the tokenizer's word tokens drawn at random (the cost does not depend on
what the text says). Usage::

    PYTHONPATH=. python scripts/detection_throughput.py --texts 32 --threads 2 \\
        [--answers /tmp/gen/answers.jsonl]

The script reports ``OMP_WAIT_POLICY`` (set it before torch loads to compare: on an
oversubscribed machine spinning OpenMP threads can lose time waiting for each other;
PASSIVE and the default measured alike here). Quote the figures with the load
averages the script prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.core.metrics import Metrics
from app.engines.hf import HFEngine
from app.services.watermark import verdict_stats
from worldcup_core import SamplingConfig, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.detector_weighted import verdict_decode_many
from worldcup_core.generation import GenerationRequest, GenerationResult
from worldcup_core.message import Payload
from worldcup_core.model_weights import weights_model
from worldcup_core.models import load_model
from worldcup_scan.bench import word_tokens

NUM_BITS = 32


class Clock:
    """Wall and process CPU time of a block."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

    def rate(self, n: int) -> dict[str, float]:
        return {
            "texts_per_s": round(n / self.wall, 2),
            "cpu_s_per_text": round(self.cpu / n, 4),
        }


def _score(scheme: WorldCup, texts: list[list[int]], weights: Any) -> None:
    verdict_stats([(1, scheme)], texts, [NUM_BITS], weights)
    for i, ids in enumerate(texts):
        verdict_decode_many(scheme, [ids], NUM_BITS, None if weights is None else [weights[i]])


async def _generate(
    engine: Any, rows: int, tokens: int, scheme: WorldCup | None = None
) -> tuple[int, float]:
    sampling = SamplingConfig(max_new_tokens=tokens, min_new_tokens=tokens, seed=3)
    started = time.perf_counter()
    jobs = [
        engine.submit(
            GenerationRequest(
                [1, 2, 3, 4],
                sampling,
                scheme,
                None if scheme is None else Payload.from_int(secrets.randbits(NUM_BITS), NUM_BITS),
            )
        )
        for _ in range(rows)
    ]
    made = 0
    for job in jobs:
        item: Any = None
        while not isinstance(item, GenerationResult):
            item = await job.events.get()
            if isinstance(item, BaseException):
                raise item
            made += not isinstance(item, GenerationResult)
    return made, time.perf_counter() - started


def _engine(lm: Any, weigher: Any, args: argparse.Namespace) -> HFEngine:
    return HFEngine(
        lm.model,
        lm.eos_token_ids,
        lm.pad_token_id,
        Metrics(),
        max_batch=args.rows,
        max_queue=64,
        weights_batch_texts=args.batch,
        weights_batch_tokens=args.batch * args.tokens,
        weights_model=weigher,
    )


async def _one_dtype(
    lm: Any, weigher: Any, scheme: WorldCup, texts: list[list[int]], args: argparse.Namespace
) -> tuple[dict[str, Any], list[Any]]:
    engine = _engine(lm, weigher, args)
    engine.start()
    n = len(texts)
    try:
        await engine.token_weights(texts[: args.batch])  # warm
        with Clock() as weights_clock:
            weights = await engine.token_weights(texts)
        with Clock() as model_clock:
            weights = await engine.token_weights(texts)
            _score(scheme, texts, weights)
        detection = asyncio.ensure_future(engine.token_weights(texts))
        with Clock() as both:
            made, gen_s = await _generate(
                engine, args.rows, args.gen_tokens, scheme if args.watermark else None
            )
            await detection
    finally:
        engine.stop()
    return {
        "weights": weights_clock.rate(n),
        "model": model_clock.rate(n),
        "beside_generation": {
            "generation_tokens_per_s": round(made / gen_s, 2),
            "detection_texts_per_s": round(n / both.wall, 2),
        },
    }, weights


def _power(
    answers: Path, lm: Any, weighers: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Median log10 p of the message-free test over watermarked answers, per precision."""
    from worldcup_core.detector_model import model_log_p_many
    from worldcup_core.model_weights import model_token_weights
    from worldcup_eval.model_weights_study import read_jsonl, service_config

    def key_of(row: dict[str, Any]) -> WatermarkKey:
        return WatermarkKey(bytes.fromhex(row["key"]))

    rows = [r for r in read_jsonl(answers) if r.get("key")][: args.answers_count]
    config = service_config()
    texts = [[int(t) for t in r["ids"]] for r in rows]
    lengths = [len(t) for t in texts]
    out: dict[str, Any] = {"answers": len(rows), "tokens_mean": round(float(np.mean(lengths)), 1)}
    logs: dict[str, np.ndarray] = {}
    got: dict[str, list[Any]] = {}
    for name, weigher in weighers.items():
        got[name] = model_token_weights(weigher, texts, pad_token_id=lm.pad_token_id)
        lp = [
            float(model_log_p_many(key_of(r), config, [t], None, [w])[0])
            for r, t, w in zip(rows, texts, got[name], strict=True)
        ]
        logs[name] = np.asarray(lp) / np.log(10)
        out[f"median_log10_p_{name}"] = round(float(np.median(logs[name])), 3)
    if {"float32", "bfloat16"} <= set(got):
        diff = np.concatenate(
            [np.abs(a - b)[1:] for a, b in zip(got["float32"], got["bfloat16"], strict=True)]
        )
        delta = logs["bfloat16"] - logs["float32"]
        out["weights_abs_diff"] = {
            "mean": round(float(diff.mean()), 4),
            "p99": round(float(np.quantile(diff, 0.99)), 4),
            "max": round(float(diff.max()), 4),
        }
        out["log10_p_bf16_minus_fp32"] = {
            "median": round(float(np.median(delta)), 3),
            "mean": round(float(delta.mean()), 3),
            "sd": round(float(delta.std(ddof=1)), 3) if len(delta) > 1 else None,
            "max_abs": round(float(np.abs(delta).max()), 3),
        }
    return out


async def _vllm(
    scheme: WorldCup, texts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """The vLLM engine's arm (module docstring): weights alone, all in, generation
    alone, then both at once."""
    from app.core.config import Settings
    from app.engines.vllm import VLLMEngine

    config: dict[str, Any] = {"env": "dev", "max_batch_size": args.max_batch}
    if args.model is not None:
        config["model_path"] = args.model
    settings = Settings(_env_file=None, **config)  # type: ignore[call-arg]
    started = time.perf_counter()
    engine, _, _ = VLLMEngine.load(settings, Metrics())
    out: dict[str, Any] = {
        "cold_start_s": round(time.perf_counter() - started, 1),
        "max_batch": args.max_batch,
        "detection_slots": engine.weights_texts,
    }
    gen_scheme = scheme if args.watermark else None
    engine.start()
    n = len(texts)
    try:
        await _generate(engine, args.rows, 8, gen_scheme)  # warm
        await engine.token_weights(texts[: args.batch])
        made, alone_s = await _generate(engine, args.rows, args.gen_tokens, gen_scheme)
        out["generation_alone_tokens_per_s"] = round(made / alone_s, 2)
        with Clock() as weights_clock:
            await engine.token_weights(texts)
        with Clock() as model_clock:
            weights = await engine.token_weights(texts)
            _score(scheme, texts, weights)
        detection = asyncio.ensure_future(engine.token_weights(texts))
        with Clock() as both:
            made, gen_s = await _generate(engine, args.rows, args.gen_tokens, gen_scheme)
            await detection
        detection_s = both.wall
    finally:
        engine.stop()
    # the engine core is a spawned process: the CPU seconds here are this process's only
    out["weights"] = weights_clock.rate(n)
    out["model"] = model_clock.rate(n)
    out["beside_generation"] = {
        "generation_tokens_per_s": round(made / gen_s, 2),
        "detection_texts_per_s": round(n / detection_s, 2),
    }
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    load_before = [round(x, 2) for x in os.getloadavg()]
    lm = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = np.asarray(word_tokens(lm.tokenizer))
    texts = [rng.choice(vocab, size=args.tokens).tolist() for _ in range(args.texts)]
    scheme = WorldCup(WatermarkKey(secrets.token_bytes(32)), WatermarkConfig())
    _score(scheme, texts[:2], None)  # warm
    with Clock() as free:
        _score(scheme, texts, None)
    result: dict[str, Any] = {
        "model": lm.model_id,
        "tokens_per_text": args.tokens,
        "texts": args.texts,
        "torch_threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "weights_batch_texts": args.batch,
        "cpus": os.cpu_count(),
        "model_free": free.rate(args.texts),
        "engine": args.engine,
        "generation_watermarked": args.watermark,
        "generation_rows": args.rows,
        "generation_tokens": args.gen_tokens,
    }
    if args.engine == "vllm":
        result["vllm"] = await _vllm(scheme, texts, args)
        result["load_average"] = {
            "before": load_before,
            "after": [round(x, 2) for x in os.getloadavg()],
        }
        return result
    engine = _engine(lm, lm.model, args)
    engine.start()
    try:
        made, alone_s = await _generate(
            engine, args.rows, args.gen_tokens, scheme if args.watermark else None
        )
    finally:
        engine.stop()
    result["generation_alone_tokens_per_s"] = round(made / alone_s, 2)
    weighers = {name: weights_model(lm.model, name) for name in args.dtypes.split(",")}
    found: dict[str, list[Any]] = {}
    for name, weigher in weighers.items():
        result[name], found[name] = await _one_dtype(lm, weigher, scheme, texts, args)
    if {"float32", "bfloat16"} <= set(found):
        diff = np.concatenate(
            [np.abs(a - b)[1:] for a, b in zip(found["float32"], found["bfloat16"], strict=True)]
        )
        result["bf16_vs_fp32"] = {
            "speedup_weights": round(
                result["bfloat16"]["weights"]["texts_per_s"]
                / result["float32"]["weights"]["texts_per_s"],
                2,
            ),
            "weights_abs_diff_mean": round(float(diff.mean()), 4),
            "weights_abs_diff_max": round(float(diff.max()), 4),
        }
    if args.answers is not None:
        result["power"] = _power(args.answers, lm, weighers, args)
    load_after = [round(x, 2) for x in os.getloadavg()]
    result["load_average"] = {"before": load_before, "after": load_after}
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="texts per detection batch")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rows", type=int, default=4, help="generation rows")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="weights dtypes compared")
    parser.add_argument("--answers", type=Path, default=None, help="watermarked answers.jsonl")
    parser.add_argument("--answers-count", type=int, default=30)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument(
        "--max-batch", type=int, default=8, help="vllm: WORLDCUP_MAX_BATCH_SIZE (max_num_seqs)"
    )
    parser.add_argument(
        "--watermark", action="store_true", help="generation rows carry a key and payload"
    )
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))  # noqa: T201
