"""The agreement gate's line, chosen on genuine answers and measured on spoofs (issue #45).

:mod:`worldcup_core.consistency` calls a text watermarked only where its tokens agree
within the deciding test's cells (``z >= AGREEMENT_Z_MIN``). This study measures what a
line costs and buys, with the service's own verdict (:class:`worldcup_eval.forgery.Judge`,
model-assisted and model-free) for the forgery tenant:

* **genuine answers** (``--collect N`` writes them first): chat answers of the embedded
  model under the tenant's key, temperature 0.7, 128 new tokens, per-request registry
  payloads: how many lose the verdict at each line (the line is chosen here);
* **spoofs** of a forgery run (``--run DIR``: its ``spoofs-BUDGET.jsonl`` and, if present,
  ``extra-spoofs.jsonl``): how many keep it.

``python -m worldcup_eval.agreement_study [--genuine DIR [--collect 240]] [--run RUN]
[--lines 1.5 2 2.5] [--out FILE]`` prints one table (Clopper-Pearson 95 % intervals) and
writes every text's verdicts to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from worldcup_eval.forgery import (
    BASE,
    ForgeryConfig,
    Judge,
    Tenant,
    collect_answers,
    fmt_rate,
    judge_weights,
    load_prompts,
    read_jsonl,
    within_budget,
)

GENUINE_TOKENS = 128
GENUINE_TEMPERATURE = 0.7
DEFAULT_LINES = (1.5, 2.0, 2.5)


def collect_genuine(
    lm: Any, out: Path, count: int, data_dir: Path, seed: int = 0, context_width: int = 0
) -> None:
    """``count`` genuine answers under the forgery tenant's key (its context width
    ``context_width``, 0 the service's), on the training prompts taken from the far end
    (away from the attacker's first ones), resuming."""
    config = ForgeryConfig(
        "per-request",
        GENUINE_TOKENS * count,
        temperature=GENUINE_TEMPERATURE,
        max_new_tokens=GENUINE_TOKENS,
        seed=seed,
        context_width=context_width,
    )
    prompts = load_prompts(data_dir, config.spoof_prompts)
    prompts = replace(prompts, train=prompts.train[::-1])
    collect_answers(lm, config, Tenant(config), prompts, out, show_progress=True)


def judge_at_lines(
    judges: dict[str, Judge], texts: Sequence[str], lines: Sequence[float]
) -> list[dict[str, Any]]:
    """Per text and judge: watermarked ungated (``raw``) and at each line."""
    import worldcup_core.consistency as consistency

    rows: list[dict[str, Any]] = [{} for _ in texts]
    saved = consistency.AGREEMENT_Z_MIN, consistency.SIGN_GATE_LEVEL
    try:
        for line in [None, *lines]:
            consistency.AGREEMENT_Z_MIN = -1e9 if line is None else line  # type: ignore[misc]
            # raw: the verdict before both gates; at a line, with the sign gate as shipped
            consistency.SIGN_GATE_LEVEL = math.inf if line is None else saved[1]  # type: ignore[misc]
            tag = "raw" if line is None else f"{line:g}"
            for name, judge in judges.items():
                for row, said in zip(rows, judge.judge(texts), strict=True):
                    row[f"{name}/{tag}"] = said["watermarked"]
                    row[f"{name}/{tag}/named"] = said["named"] is not None
    finally:
        consistency.AGREEMENT_Z_MIN, consistency.SIGN_GATE_LEVEL = saved  # type: ignore[misc]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m worldcup_eval.agreement_study", description=__doc__
    )
    ap.add_argument("--genuine", type=Path, default=None, help="a directory of genuine answers")
    ap.add_argument("--collect", type=int, default=0, help="first collect this many answers")
    ap.add_argument("--run", type=Path, default=None, help="a per-request forgery run")
    ap.add_argument("--budget-tokens", type=int, default=200_000)
    ap.add_argument("--lines", type=float, nargs="+", default=list(DEFAULT_LINES))
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("agreement-study.json"))
    ap.add_argument("--tokens", type=int, default=None, help="read each genuine answer's first N")
    ap.add_argument(
        "--context-width",
        type=int,
        default=0,
        help="the tenant key's context width (default: the service's); a run's own is read "
        "from its config",
    )
    args = ap.parse_args(argv)
    if args.genuine is None and args.run is None:
        ap.error("give --genuine, --run or both")
    if args.run is not None and not (args.run / f"spoofs-{args.budget_tokens}.jsonl").is_file():
        ap.error(f"--run {args.run}: no spoofs-{args.budget_tokens}.jsonl (a forgery run's folder)")
    if (
        args.genuine is not None
        and not args.collect
        and not (args.genuine / "answers.jsonl").is_file()
    ):
        ap.error(f"--genuine {args.genuine}: no answers.jsonl (add --collect N to write them)")
    if args.tokens is not None and args.tokens < 1:
        ap.error("--tokens must be at least 1")
    import torch

    from worldcup_core.models import load_model
    from worldcup_eval.data import default_data_dir

    torch.set_num_threads(args.threads)
    lm = load_model(None)
    if args.genuine is not None and args.collect:
        args.genuine.mkdir(parents=True, exist_ok=True)
    width = args.context_width
    if args.run is not None and not width:
        saved = args.run / f"config-{args.budget_tokens}.json"
        if saved.is_file():
            width = int(json.loads(saved.read_text()).get("context_width", 0))
    if args.genuine is not None and args.collect:
        collect_genuine(
            lm, args.genuine, args.collect, args.data_dir or default_data_dir(), context_width=width
        )
    config = ForgeryConfig("per-request", args.budget_tokens, judge="model", context_width=width)
    tenant = Tenant(config)
    answers = [] if args.run is None else read_jsonl(args.run / "answers.jsonl", drop=(BASE,))
    registry = tenant.registry_ids(within_budget(answers, args.budget_tokens))
    judges = {
        "model": Judge(config, tenant, lm.tokenizer, registry, judge_weights(lm, config)),
        "model_free": Judge(replace(config, judge="model_free"), tenant, lm.tokenizer, registry),
    }
    sets: dict[str, list[list[int]]] = {}
    if args.genuine is not None:
        cut = args.tokens
        sets["genuine"] = [
            a["tokens"][:cut] for a in read_jsonl(args.genuine / "answers.jsonl", drop=(BASE,))
        ]
    if args.run is not None:
        spoofs = read_jsonl(args.run / f"spoofs-{args.budget_tokens}.jsonl")
        spoofs += read_jsonl(args.run / "extra-spoofs.jsonl")
        for row in spoofs:  # key: aim/delta/prompt/draw; every draft counted on its own
            aim, delta, _, _ = row["key"].split("/")
            label = "plain model (control)" if float(delta) == 0 else f"{aim} spoofs d={delta}"
            sets.setdefault(label.replace("plain spoofs", "stolen spoofs"), []).append(
                row["tokens"]
            )
    result: dict[str, Any] = {"lines": args.lines, "registry_entries": len(registry), "sets": {}}
    out = sys.stdout
    out.write(f"registry: {len(registry)} entries; judge: the service's verdict (p < 1e-6)\n")
    for name, token_lists in sets.items():
        texts = [lm.tokenizer.decode(t, skip_special_tokens=True) for t in token_lists]
        rows = judge_at_lines(judges, texts, args.lines)
        result["sets"][name] = rows
        out.write(f"\n{name} ({len(rows)} texts): watermarked / named\n")
        for judge in judges:
            for tag in ["raw", *(f"{x:g}" for x in args.lines)]:
                wm = sum(r[f"{judge}/{tag}"] for r in rows)
                named = sum(r[f"{judge}/{tag}/named"] for r in rows)
                label = "ungated" if tag == "raw" else f"line {tag}"
                out.write(
                    f"  {judge:10s} {label:9s} {fmt_rate(wm, len(rows)):>24s}   "
                    f"{fmt_rate(named, len(rows)):>24s}\n"
                )
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
