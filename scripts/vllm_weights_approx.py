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
measures only how much of the power the approximation may keep. Usage::

    PYTHONPATH=. python scripts/vllm_weights_approx.py ANSWERS.jsonl --texts 60 --top 5 10 20 50
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
        text = row.get("text") or (row.get("answer") or {}).get("text")
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


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("answers", type=Path)
    ap.add_argument("--texts", type=int, default=60)
    ap.add_argument("--top", type=int, nargs="+", default=[5, 10, 20, 50])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(None)
    model = weights_model(lm.model)
    texts = _texts(args.answers, args.texts)
    started = time.perf_counter()
    exact_all: list[np.ndarray] = []
    approx_all: dict[int, list[np.ndarray]] = {n: [] for n in args.top}
    for text in texts:
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < 2:
            continue
        logits = model(torch.tensor([ids])).logits[0, :-1].float().numpy().astype(np.float64)
        exact_all.append(token_weights_from_logits(logits, ids, DETECTION_SAMPLING)[1:])
        for n in args.top:
            approx = token_weights_from_logits(_top_only(logits, n), ids, DETECTION_SAMPLING)
            approx_all[n].append(approx[1:])
    exact = np.concatenate(exact_all)
    levels = token_levels(exact)
    result: dict[str, Any] = {
        "texts": len(exact_all),
        "positions": int(exact.size),
        "seconds": round(time.perf_counter() - started, 1),
        "top": {},
    }
    for n in args.top:
        approx = np.concatenate(approx_all[n])
        diff = np.abs(approx - exact)
        result["top"][n] = {
            "exact_share": round(float(np.mean(diff < 1e-12)), 4),
            "mean_abs_diff": round(float(diff.mean()), 5),
            "p99_abs_diff": round(float(np.quantile(diff, 0.99)), 4),
            "level_changed_share": round(float(np.mean(token_levels(approx) != levels)), 4),
            "mean_a_exact": round(float(exact.mean()), 4),
            "mean_a_approx": round(float(approx.mean()), 4),
        }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
