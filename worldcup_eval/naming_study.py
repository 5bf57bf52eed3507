"""Who a genuine answer is named for, against a large registry (issue #45).

A false attribution is the worst answer the service can give. This study takes genuine
answers collected under a forgery run's key, each under its own registry payload
(``python -m worldcup_eval.fluency_study --run RUN --collect N --collect-only --genuine
DIR --temperature 0.7 --max-new-tokens 128``, the service default), puts their entries
among ``--registry`` issued ids (1 .. N, so the others are keyed-random payloads as a
tenant's other users'), and judges each as the service does
(:class:`worldcup_eval.forgery.Judge`: the verdict, then an entry named where the
registry test clears the verdict's level and the decoder's posterior clears
``registry_min_confidence``). Per confidence line: how many answers are named for
their own entry, how many for another's (a false attribution), and how many are
``registry_ambiguous``. 95 % Clopper-Pearson intervals.

``python -m worldcup_eval.naming_study --run RUN --genuine DIR [--registry 100000]
[--lines 0.95 0.99 0.999] [--judge model|model_free] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from worldcup_eval.forgery import (
    BASE,
    MODEL_DTYPES,
    Judge,
    Tenant,
    fmt_rate,
    judge_weights,
    read_jsonl,
    saved_config,
)

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "max_new_tokens")


def tally(issued: Sequence[int], said: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Counts of one line's answers: ``watermarked``, ``right`` (named for the entry it
    was issued under), ``wrong`` (named for another entry), ``ambiguous``."""
    out = {"answers": len(issued), "watermarked": 0, "right": 0, "wrong": 0, "ambiguous": 0}
    for mid, s in zip(issued, said, strict=True):
        out["watermarked"] += bool(s["watermarked"])
        out["ambiguous"] += bool(s.get("ambiguous"))
        if s["named"] is not None:
            out["right" if s["named"] == mid else "wrong"] += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a forgery run's folder (its key)")
    ap.add_argument("--budget-tokens", type=int, default=200_000, help="the run's config")
    ap.add_argument("--genuine", type=Path, required=True, help="collected answers' folder")
    ap.add_argument("--registry", type=int, default=100_000, help="issued ids 1 .. N")
    ap.add_argument("--lines", type=float, nargs="+", default=[0.95, 0.99, 0.999])
    ap.add_argument("--judge", choices=("model", "model_free"), default="model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=MODEL_DTYPES, default="auto")
    ap.add_argument("--out", type=Path, default=Path("naming-study.json"))
    args = ap.parse_args(argv)
    if not (args.run / f"config-{args.budget_tokens}.json").is_file():
        ap.error(f"--run {args.run}: no config-{args.budget_tokens}.json (a forgery run)")
    if not (args.genuine / "answers.jsonl").is_file():
        ap.error(f"--genuine {args.genuine}: no answers.jsonl (fluency_study --collect)")
    if any(not 0 < x <= 1 for x in args.lines) or args.registry < 1:
        ap.error("--lines must be in (0, 1] and --registry >= 1")
    answers = read_jsonl(args.genuine / "answers.jsonl", drop=(BASE,))
    if not answers or any(a.get("message_id") is None for a in answers):
        ap.error(f"--genuine {args.genuine}: no answers, or answers without a registry entry")
    issued = [int(a["message_id"]) for a in answers]
    if max(issued) > args.registry:
        ap.error(f"--registry {args.registry} must hold the answers' ids (up to {max(issued)})")
    import torch

    from worldcup_core.models import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(None, dtype=args.dtype)
    sampling = {}
    how = args.genuine / "sampling.json"
    if how.is_file():
        sampling = {k: v for k, v in json.loads(how.read_text()).items() if k in SAMPLING_FIELDS}
    config = replace(
        saved_config(args.run, args.budget_tokens),
        judge=args.judge,
        scenario="per-request",
        **sampling,
    )
    tenant = Tenant(config)
    judge = Judge(
        config, tenant, lm.tokenizer, range(1, args.registry + 1), judge_weights(lm, config)
    )
    texts = [lm.tokenizer.decode(a["tokens"], skip_special_tokens=True) for a in answers]
    base = judge.scanner.spec
    result: dict[str, Any] = {
        "registry": args.registry,
        "judge": args.judge,
        "sampling": sampling,
        "lines": {},
    }
    out = sys.stdout
    out.write(f"{len(texts)} genuine answers; registry of {args.registry}; {args.judge}\n")
    out.write("| posterior line | watermarked | named, own entry | named, another's | ambiguous |")
    out.write("\n")
    out.write("|---|---|---|---|---|\n")
    for line in args.lines:
        judge.scanner.spec = replace(base, registry_min_confidence=line)
        counts = tally(issued, judge.judge(texts))
        result["lines"][str(line)] = counts
        n = counts["answers"]
        cells = [fmt_rate(counts[k], n) for k in ("watermarked", "right", "wrong", "ambiguous")]
        out.write(f"| {line:g} | " + " | ".join(cells) + " |\n")
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
