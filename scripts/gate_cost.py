"""What the agreement gate costs the model-free verdict (issue #45), side by side.

Times, on the same texts in one run (interleaved, warmed, median of ``--runs``):

* ``ungated``: the layer-weighted statistic alone (``weighted_log_p_many``);
* ``eager``: the statistic with ``z`` computed for every text;
* ``verdict``: :func:`worldcup_core.detector_weighted.verdict_log_p` as shipped, which
  computes ``z`` only for the texts below the verdict's level.

The texts are random token ids (unwatermarked: what most of a scan holds), so the
shipped verdict should cost what the ungated statistic does. Prints one JSON object.

    PYTHONPATH=. python scripts/gate_cost.py [--texts 200] [--tokens 128] [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from worldcup_core import WatermarkKey, WorldCup
from worldcup_core.config import service_config
from worldcup_core.consistency import gate_log_p
from worldcup_core.detector_model import agreement_z_many
from worldcup_core.detector_weighted import verdict_log_p, weighted_log_p_many


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    for name in ("texts", "tokens", "runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    config = service_config()
    scheme = WorldCup(WatermarkKey(b"gate-cost-bench-key-0123456789ab"), config)
    rng = np.random.default_rng(0)
    texts = [[int(x) for x in rng.integers(0, 49152, args.tokens)] for _ in range(args.texts)]
    key = scheme.key

    def ungated() -> object:
        return weighted_log_p_many(key, config, texts, None)

    def eager() -> object:
        return gate_log_p(ungated(), agreement_z_many(key, config, texts, None))  # type: ignore[arg-type]

    def verdict() -> object:
        return verdict_log_p(scheme, texts, None)

    runs: dict[str, Callable[[], object]] = {"ungated": ungated, "eager": eager, "verdict": verdict}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for f in runs.values():
        f()
    for _ in range(args.runs):
        for name, f in runs.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    ms = {n: 1000 * statistics.median(v) / args.texts for n, v in times.items()}
    out = {
        "texts": args.texts,
        "tokens": args.tokens,
        "ms_per_text": {n: round(v, 4) for n, v in ms.items()},
        "verdict_over_eager": round(ms["verdict"] / ms["eager"], 3),
        "verdict_over_ungated": round(ms["verdict"] / ms["ungated"], 3),
    }
    print(json.dumps(out))  # noqa: T201


if __name__ == "__main__":
    main()
