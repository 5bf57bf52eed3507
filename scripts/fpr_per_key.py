"""False-positive rate of /detect's test per key, on human text (issue 24, point 5).

The nominal 1 % holds for a random key averaged over texts; a deployed tenant
key is one fixed key, so this measures the rate key by key: ``--keys`` random
keys (default 25) each score every human chunk of the evaluation data
(CNN/DailyMail articles and ELI5 answers, ``worldcup_eval.data``, chunked to
``--length`` tokens), as ``/detect`` does (payload length unknown, the default
scheme). It prints the pooled rate, the per-key spread, an exact binomial test
of the pooled rate against the nominal level and a chi-square test of
homogeneity across keys (is the spread more than binomial noise?).

    PYTHONPATH=. python scripts/fpr_per_key.py --keys 25 --length 200 --out docs/fpr-per-key.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from scipy import stats

from worldcup_core import WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.models import load_tokenizer
from worldcup_eval.data import default_data_dir, load_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=25)
    ap.add_argument("--length", type=int, default=200, help="tokens per human chunk")
    ap.add_argument("--cap", type=int, default=4000, help="at most this many chunks")
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    tokenizer = load_tokenizer()
    data = load_data(
        tokenizer, args.data_dir or default_data_dir(), 1, ("cnn", "eli5"), 40, 1, args.seed
    )
    pool = data.human_pool(args.length, args.cap)
    chunks = [list(ids) for _, ids in pool]
    by_set = {name: sum(1 for n, _ in pool if n == name) for name in ("cnn", "eli5")}
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    per_key = []
    for _ in range(args.keys):
        scheme = WorldCup(WatermarkKey(rng.bytes(32)), WatermarkConfig())
        p = np.array([r.p_value for r in scheme.detect_many(chunks)])
        per_key.append(int(np.sum(p < args.alpha)))
    hits = np.array(per_key)
    n = len(chunks)
    rates = hits / n
    pooled = hits.sum() / (n * args.keys)
    binom = stats.binomtest(int(hits.sum()), n * args.keys, args.alpha)
    table = np.stack([hits, n - hits])
    chi2 = stats.chi2_contingency(table, correction=False)
    result = {
        "keys": args.keys,
        "chunks_per_key": n,
        "chunk_tokens": args.length,
        "chunks_by_dataset": by_set,
        "alpha": args.alpha,
        "pooled_fpr": pooled,
        "pooled_fpr_ci95": list(binom.proportion_ci(0.95)),
        "binomial_test_p": binom.pvalue,
        "per_key_fpr_min": float(rates.min()),
        "per_key_fpr_median": float(np.median(rates)),
        "per_key_fpr_max": float(rates.max()),
        "homogeneity_chi2_p": float(chi2.pvalue),
        "per_key_false_positives": per_key,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result, indent=2))  # noqa: T201 (a script's output)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
