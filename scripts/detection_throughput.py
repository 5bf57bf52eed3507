"""Detection throughput with and without the served model, per process (issue #44).

Prints one JSON object:

* ``model_free_texts_per_s``: the verdict's tests (message-free and at one payload
  length, :func:`app.services.watermark.verdict_stats`) and the decoder's reading
  (:func:`app.services.watermark.decode_one`) of texts of ``--tokens`` tokens;
* ``weights_texts_per_s``: the hf engine's batched forward passes alone
  (:meth:`app.engines.hf.HFEngine.token_weights`, its own batching policy);
* ``model_texts_per_s``: both together, as a /decode of the model-assisted statistic
  costs (weights, then the same tests weighted);
* ``generation_tokens_per_s`` alone and ``beside_detection`` (generation while the
  engine runs detection batches between its steps), with the detection rate then.

Texts are the tokenizer's word tokens drawn at random (the cost does not depend on
what the text says). Usage::

    PYTHONPATH=. python scripts/detection_throughput.py --texts 64 --threads 2

The figures depend on the machine and on what else runs on it: quote them with the
load average the script prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from typing import Any

import numpy as np
import torch

from app.core.metrics import Metrics
from app.engines.hf import HFEngine
from app.services.watermark import decode_one, verdict_stats
from worldcup_core import SamplingConfig, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.generation import GenerationRequest, GenerationResult
from worldcup_core.models import load_model
from worldcup_scan.bench import word_tokens

NUM_BITS = 32


def _score(scheme: WorldCup, texts: list[list[int]], weights: Any) -> None:
    verdict_stats([(1, scheme)], texts, [NUM_BITS], weights)
    for i, ids in enumerate(texts):
        decode_one(scheme, ids, NUM_BITS, None if weights is None else weights[i])


async def _generate(engine: HFEngine, rows: int, tokens: int) -> tuple[int, float]:
    sampling = SamplingConfig(max_new_tokens=tokens, min_new_tokens=tokens, seed=3)
    started = time.perf_counter()
    jobs = [engine.submit(GenerationRequest([1, 2, 3, 4], sampling)) for _ in range(rows)]
    made = 0
    for job in jobs:
        item: Any = None
        while not isinstance(item, GenerationResult):
            item = await job.events.get()
            if isinstance(item, BaseException):
                raise item
            made += not isinstance(item, GenerationResult)
    return made, time.perf_counter() - started


async def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = np.asarray(word_tokens(lm.tokenizer))
    texts = [rng.choice(vocab, size=args.tokens).tolist() for _ in range(args.texts)]
    scheme = WorldCup(WatermarkKey(secrets.token_bytes(32)), WatermarkConfig())
    engine = HFEngine(
        lm.model,
        lm.eos_token_ids,
        lm.pad_token_id,
        Metrics(),
        max_batch=args.rows,
        max_queue=64,
        weights_batch_texts=args.batch,
        weights_batch_tokens=args.batch * args.tokens,
    )
    engine.start()
    try:
        await engine.token_weights(texts[:2])  # warm
        started = time.perf_counter()
        _score(scheme, texts, None)
        free_s = time.perf_counter() - started
        started = time.perf_counter()
        weights = await engine.token_weights(texts)
        weights_s = time.perf_counter() - started
        _score(scheme, texts, weights)
        model_s = time.perf_counter() - started
        made, alone_s = await _generate(engine, args.rows, args.gen_tokens)
        detection = asyncio.ensure_future(engine.token_weights(texts))
        started = time.perf_counter()
        made_beside, beside_s = await _generate(engine, args.rows, args.gen_tokens)
        await detection
        both_s = time.perf_counter() - started
    finally:
        engine.stop()
    return {
        "model": lm.model_id,
        "tokens_per_text": args.tokens,
        "texts": args.texts,
        "torch_threads": args.threads,
        "weights_batch_texts": args.batch,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "model_free_texts_per_s": round(args.texts / free_s, 2),
        "weights_texts_per_s": round(args.texts / weights_s, 2),
        "model_texts_per_s": round(args.texts / model_s, 2),
        "generation_tokens_per_s": round(made / alone_s, 2),
        "beside_detection": {
            "generation_tokens_per_s": round(made_beside / beside_s, 2),
            "detection_texts_per_s": round(args.texts / both_s, 2),
        },
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="texts per detection batch")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rows", type=int, default=4, help="generation rows")
    parser.add_argument("--gen-tokens", type=int, default=64)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))  # noqa: T201
