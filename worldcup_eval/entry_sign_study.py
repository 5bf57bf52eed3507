"""What the sign-conditional registry test costs genuine answers (issue #45).

The registry test names an entry when the text's weighted agreement with the entry's
bits is too high for text written without the key (exact under H0,
:func:`worldcup_core.detector_weighted.entry_log_p`). A spoof written from payload-free
stolen counts is not such text: its tokens are extreme in either direction, so its
agreement with any entry is over-dispersed, and the exact test over-rejects random
entries (``tests/test_consistency.py``). The sign-conditional test
(:func:`worldcup_core.detector_model.sign_upper_log_sf` over
:func:`~worldcup_core.detector_model.entry_units`) asks the same question given every
unit's magnitude: valid under H0 and under any text whose units point at random bits,
however extreme. Taking the larger of the two p-values keeps both guarantees; this
study measures what that costs the issued entry of genuine answers.

``python -m worldcup_eval.entry_sign_study --genuine DIR [--sizes 2112 100000] [--out FILE]``
reads ``DIR/answers.jsonl`` (``python -m worldcup_eval.agreement_study --genuine DIR
--collect N`` writes it: chat answers under the forgery tenant's key, temperature 0.7,
128 new tokens, each with its registry payload ``bits``), weighs every answer by the
embedded model (as a generator replica does) and prints, per registry size, how many
issued entries each form of the test keeps below 1e-6 after the Bonferroni correction.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from worldcup_core.detector_model import entry_units, sign_upper_log_sf
from worldcup_eval.forgery import BASE, ForgeryConfig, Tenant, clopper_pearson, read_jsonl

LEVEL = math.log(1e-6)


def score(key: Any, config: Any, tokens: list[int], bits: str, weights: Any) -> dict[str, float]:
    """log p of the entry ``bits``: exact and sign-conditional, model-weighted and not."""
    from worldcup_core.detector_weighted import entry_log_p

    out: dict[str, float] = {}
    for name, w in (("model", weights), ("model_free", None)):
        out[f"{name}/exact"] = entry_log_p(key, config, tokens, bits, w)
        out[f"{name}/sign"] = sign_upper_log_sf(entry_units(key, config, tokens, bits, w))
    return out


def kept(rows: list[dict[str, float]], size: int) -> dict[str, int]:
    """Per statistic, the entries below 1e-6 after the correction for ``size`` entries."""
    shift = math.log(size)
    out: dict[str, int] = {}
    for name in ("model", "model_free"):
        exact = [r[f"{name}/exact"] + shift < LEVEL for r in rows]
        both = [max(r[f"{name}/exact"], r[f"{name}/sign"]) + shift < LEVEL for r in rows]
        out[f"{name}/exact"] = sum(exact)
        out[f"{name}/exact and sign"] = sum(both)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m worldcup_eval.entry_sign_study", description=__doc__
    )
    ap.add_argument("--genuine", type=Path, required=True, help="a directory of genuine answers")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2112, 100_000])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=None, help="read each answer's first N")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.genuine / "answers.jsonl").is_file():
        ap.error(f"--genuine {args.genuine}: no answers.jsonl")
    if any(s < 1 for s in args.sizes):
        ap.error("--sizes must be positive")
    if args.tokens is not None and args.tokens < 1:
        ap.error("--tokens must be at least 1")
    import torch

    from worldcup_core.model_weights import model_token_weights, weights_model
    from worldcup_core.models import load_model

    torch.set_num_threads(args.threads)
    answers = read_jsonl(args.genuine / "answers.jsonl", drop=(BASE,))
    config = ForgeryConfig("per-request", 1)
    scheme = Tenant(config).worldcup()
    lm = load_model(None)
    tokens = [list(a["tokens"])[: args.tokens] for a in answers]
    weights = model_token_weights(weights_model(lm.model), tokens, pad_token_id=lm.pad_token_id)
    rows = [
        score(scheme.key, scheme.config, t, str(a["bits"]), w)
        for a, t, w in zip(answers, tokens, weights, strict=True)
    ]
    n = len(rows)
    out = sys.stdout
    out.write(f"{n} genuine answers; an issued entry kept below 1e-6 after x registry size\n")
    out.write(
        "| registry | statistic | exact test | exact and sign-conditional |\n|---|---|---|---|\n"
    )
    table: dict[str, Any] = {}
    for size in args.sizes:
        k = kept(rows, size)
        table[str(size)] = k
        for name in ("model", "model_free"):
            cells = []
            for form in ("exact", "exact and sign"):
                hits = k[f"{name}/{form}"]
                lo, hi = clopper_pearson(hits, n)
                cells.append(f"{hits}/{n} [{100 * lo:.1f}, {100 * hi:.1f}] %")
            out.write(f"| {size} | {name} | {cells[0]} | {cells[1]} |\n")
    med = {k: sorted(r[k] for r in rows)[n // 2] / math.log(10) for k in rows[0]} if rows else {}
    out.write("median log10 p: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()) + "\n")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "kept": table, "answers": n}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
