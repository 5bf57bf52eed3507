"""How close token weights from vLLM's prompt log-probs come to the exact ones (issue #44).

The model-assisted statistic weighs each token by ``a_t = 1 - sum p^2`` of the model's
filtered next-token distribution (:mod:`worldcup_core.token_weights`: temperature 0.7,
top-k 50, top-p 0.95, after the text's own n-gram bans). The hf engine has the whole
row of logits. vLLM returns, per prompt position, only the ``N`` largest log-probs
(``prompt_logprobs=N``; ``max_logprobs`` caps N, 20 by default). Log-probs differ from
logits by a constant per row, so the same filter runs on the top N alone: exact where
the top N hold the whole filtered set (top-p reached inside them), else the tail
beyond N is missing and ``a_t`` comes out lower.

This script runs the embedded model over real answers (a JSONL with a ``text`` field
per line, or ``answer.text`` as ``worldcup bench first-use --out-dir`` saves them),
computes ``a_t`` from the full row and from its top N for each N given, and prints per
N: the share of positions where the two agree exactly, mean and 99th percentile of
|difference|, and the share of positions whose token level (the integer the
statistics use, :func:`worldcup_core.detector_model.token_levels`) changes. The null
stays exact under either (the weights depend on the text and the model only); this
measures only how much of the power the approximation may keep.

``--engine vllm`` measures the vLLM engine itself instead (run it in ``.venv-vllm``):
:meth:`app.engines.vllm.VLLMEngine.token_weights` (prompt log-probs over the top
``WEIGHT_LOGPROBS`` = 64, :func:`worldcup_core.token_weights.token_weights_from_top`)
against the full float32 rows of the same model under transformers; ``--top`` is then
ignored and the result is reported under ``"vllm"``. Usage::

    PYTHONPATH=. python scripts/vllm_weights_approx.py ANSWERS.jsonl --texts 60 --top 5 10 20 50
    PYTHONPATH=. .venv-vllm/bin/python scripts/vllm_weights_approx.py ANSWERS.jsonl \
        --texts 20 --engine vllm

A line may also hold ``outputs`` (a list of answers, as ``eli5_longform_qa.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worldcup_core.detector_model import token_levels
from worldcup_core.model_weights import weights_model
from worldcup_core.models import load_model
from worldcup_core.token_weights import DETECTION_SAMPLING, token_weights_from_logits


def _texts(path: Path, count: int) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        text = (
            row.get("text")
            or (row.get("answer") or {}).get("text")
            or next(iter(row.get("outputs") or []), None)
        )
        if text:
            out.append(str(text))
        if len(out) >= count:
            break
    return out


def _top_only(logits: np.ndarray, n: int) -> np.ndarray:
    """Each row's top ``n`` as log-probs (what prompt_logprobs returns), -inf elsewhere."""
    x = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    keep = np.argpartition(-x, n - 1, axis=1)[:, :n]
    out = np.full_like(x, -np.inf)
    np.put_along_axis(out, keep, np.take_along_axis(x, keep, axis=1), axis=1)
    return out


def _vllm_weights(ids: list[list[int]]) -> list[np.ndarray]:
    """The vLLM engine's own token weights (the embedded model, as served)."""
    import asyncio

    from app.core.config import Environment, Settings
    from app.core.metrics import Metrics
    from app.engines.vllm import VLLMEngine

    settings = Settings(_env_file=None, env=Environment.DEV, engine="vllm", vllm_max_model_len=2048)  # type: ignore[call-arg]

    async def run() -> list[np.ndarray]:
        engine, _, _ = VLLMEngine.load(settings, Metrics())
        engine.start()
        try:
            return list(await engine.token_weights(ids))
        finally:
            engine.stop()

    return asyncio.run(run())


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("answers", type=Path)
    ap.add_argument("--texts", type=int, default=60)
    ap.add_argument("--top", type=int, nargs="+", default=[5, 10, 20, 50])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", choices=("none", "vllm"), default="none")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(None, dtype="float32")
    model = weights_model(lm.model, "float32")
    texts = _texts(args.answers, args.texts)
    started = time.perf_counter()
    exact_all: list[np.ndarray] = []
    tops = ["vllm"] if args.engine == "vllm" else args.top
    approx_all: dict[int | str, list[np.ndarray]] = {n: [] for n in tops}
    id_lists = [lm.tokenizer(t, add_special_tokens=False)["input_ids"][:1024] for t in texts]
    id_lists = [ids for ids in id_lists if len(ids) >= 2]
    served = _vllm_weights(id_lists) if args.engine == "vllm" else []
    for j, ids in enumerate(id_lists):
        logits = model(torch.tensor([ids])).logits[0, :-1].float().numpy().astype(np.float64)
        exact_all.append(token_weights_from_logits(logits, ids, DETECTION_SAMPLING)[1:])
        if served:
            approx_all["vllm"].append(served[j][1:])
        for n in tops if not served else ():
            approx = token_weights_from_logits(_top_only(logits, int(n)), ids, DETECTION_SAMPLING)
            approx_all[n].append(approx[1:])
    exact = np.concatenate(exact_all)
    levels = token_levels(exact)
    result: dict[str, Any] = {
        "texts": len(exact_all),
        "positions": int(exact.size),
        "seconds": round(time.perf_counter() - started, 1),
        "top": {},
    }
    for n in tops:
        approx = np.concatenate(approx_all[n])
        diff = np.abs(approx - exact)
        result["top"][n] = {
            "exact_share": round(float(np.mean(diff < 1e-12)), 4),
            "within_1e-3_share": round(float(np.mean(diff <= 1e-3)), 4),
            "max_abs_diff": float(f"{diff.max():.3g}"),
            "mean_abs_diff": float(f"{diff.mean():.3g}"),
            "p99_abs_diff": round(float(np.quantile(diff, 0.99)), 4),
            "level_changed_share": round(float(np.mean(token_levels(approx) != levels)), 4),
            "mean_a_exact": round(float(exact.mean()), 4),
            "mean_a_approx": round(float(approx.mean()), 4),
        }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    sys.exit(main())
