"""How a tenant's context sketch fills: the share of rare contexts it reads as common.

The spoof-artifact check (docs/operations.md, "The spoof-artifact check") puts a
token in the rare group when its context was counted fewer than 5 times. The sketch
(:class:`worldcup_core.context_sketch.ContextSketch`) never undercounts; collisions
overcount, so a rare context can read as common. This feeds it texts of synthetic
contexts (``--draws`` draws a text of Zipf-distributed ids, exponent 1.01; each
context's cells from its id by a keyed hash, as the service's are) and prints, per
number of texts and sketch width, the distinct contexts, the new ones a text, the
rare ones, and the share of rare ones read as common, checked against exact counts.

The default, 170 draws, is fitted to the service's width, c = 4: the forgery run of
2·10^6 tokens (docs/results/forgery/per-request-c4-2000000-model.md) saw 1 434 404
distinct width-4 contexts in 11 263 answers (127 a text), and 170 draws give 126 a
text at 10^4 texts (and 139 at 300 texts, where the real answers gave 160). At c = 2
(60 draws, about 45 a text) the sketch holds three times as many texts. Measured
(2026-12-01, the service's 4 x 2^20): see docs/operations.md, "The spoof-artifact
check".

    PYTHONPATH=. .venv/bin/python scripts/context_sketch_load.py [--texts 10000 30000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import numpy as np

from worldcup_core.context_sketch import RARE_BELOW, ContextSketch, context_cells
from worldcup_core.prf import WatermarkKey


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    ap.add_argument("--width-log2", type=int, nargs="+", default=[20])
    ap.add_argument("--zipf", type=float, default=1.01, help="the ids' Zipf exponent")
    ap.add_argument(
        "--draws", type=int, default=170, help="ids drawn a text (170: c = 4; 60: c = 2)"
    )
    args = ap.parse_args()
    if min(args.texts) < 1 or args.draws < 1:
        ap.error("--texts and --draws must be >= 1")
    key = WatermarkKey(bytes(range(32)))
    out = sys.stdout
    out.write(
        "| texts | sketch | distinct contexts | new a text (last tenth) | rare (< 5) "
        "| rare read as common | s |\n"
    )
    out.write("|---:|---|---:|---:|---:|---:|---:|\n")
    for n in args.texts:
        rng = np.random.default_rng(0)
        texts = [np.unique(rng.zipf(args.zipf, args.draws)) for _ in range(n)]
        exact = Counter(int(i) for t in texts[: n - n // 10] for i in t)
        before = len(exact)
        exact.update(int(i) for t in texts[n - n // 10 :] for i in t)
        fresh = (len(exact) - before) / max(1, n // 10)
        ids = np.fromiter(exact, dtype=np.int64)
        true = np.fromiter(exact.values(), dtype=np.int64)
        for width_log2 in args.width_log2:
            started = time.perf_counter()
            # context i: the one token i before a scored token
            cells_of = {
                int(i): row
                for i, row in zip(
                    ids,
                    context_cells(key, np.r_[ids, 0], range(1, len(ids) + 1), 1, 4, width_log2),
                    strict=True,
                )
            }
            sketch = ContextSketch(4, width_log2)
            for t in texts:
                sketch.add_text(np.stack([cells_of[int(i)] for i in t]))
            est = sketch.counts(np.stack([cells_of[int(i)] for i in ids]))
            assert (est >= np.minimum(true, 255)).all(), "the sketch undercounted"
            rare = true < RARE_BELOW
            misread = float(np.mean(est[rare] >= RARE_BELOW))
            out.write(
                f"| {n} | 4 x 2^{width_log2} ({4 << width_log2 >> 20} MiB) | {len(ids)} | "
                f"{fresh:.0f} | {int(rare.sum())} | {misread:.2e} | "
                f"{time.perf_counter() - started:.0f} |\n"
            )
            out.flush()


if __name__ == "__main__":
    main()
