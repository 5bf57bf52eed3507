"""How a tenant's context sketch fills: the share of rare contexts it reads as common.

The spoof-artifact check (docs/operations.md, "The spoof-artifact check") puts a
token in the rare group when its context was counted fewer than 5 times. The sketch
(:class:`worldcup_core.context_sketch.ContextSketch`) never undercounts; collisions
overcount, so a rare context can read as common. This feeds it texts of synthetic
contexts (60 draws a text of Zipf-distributed ids, exponent 1.01: about 43 new
contexts a text, where the forgery run's real answers had 59 at 10^3 answers; each
context's cells from its id by a keyed hash, as the service's are) and prints, per
number of texts and sketch width, the distinct contexts, the rare ones, and the share
of rare ones read as common, checked against exact counts. Measured (2026-11-30; the
service's 4 x 2^20): 4.4e-6 at 10^4 texts, 1.2e-4 at 5·10^4, 5.9e-4 at 10^5, 8.8e-2 at
2·10^5: sized for about 10^5 texts a key version.

    PYTHONPATH=. .venv/bin/python scripts/context_sketch_load.py [--texts 10000 100000]
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
    args = ap.parse_args()
    if min(args.texts) < 1:
        ap.error("--texts must be >= 1")
    key = WatermarkKey(bytes(range(32)))
    out = sys.stdout
    out.write("| texts | sketch | distinct contexts | rare (< 5) | rare read as common | s |\n")
    out.write("|---:|---|---:|---:|---:|---:|\n")
    for n in args.texts:
        rng = np.random.default_rng(0)
        texts = [np.unique(rng.zipf(args.zipf, 60)) for _ in range(n)]
        exact = Counter(int(i) for t in texts for i in t)
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
                f"{int(rare.sum())} | {misread:.2e} | {time.perf_counter() - started:.0f} |\n"
            )
            out.flush()


if __name__ == "__main__":
    main()
