"""Where a text's watermark evidence sits: in contexts common in the tenant's outputs? (#45)

A stealing spoofer learns the watermark only where its collected answers showed it: in
the contexts (the last c tokens) it saw often. Where it saw a context rarely or never,
its spoof's token is the plain model's and carries no watermark. A genuine answer
carries the watermark at every scored context, common or rare. Gloaguen et al. (ICML
2025) detect learning-based spoofers by this artifact. The service knows every text
it generated for a tenant, so it could count the contexts itself; this study measures
the test offline, with the attacker's own answers as those counts (the worst case for
the service: the attacker saw everything it counts).

Per text, each scored token's leave-one-out evidence ``z_t``
(:func:`worldcup_core.evidence.text_evidence`: mean 0 and variance 1 without the
watermark) is put in the **rare** group, where its context was seen fewer than
``--rare-below`` times in *other* answers, or the **common** group. Two statistics:

* ``R = sum_rare z_t / sqrt(n_rare)``: the evidence in rare contexts alone (about
  N(0, 1) where they carry no watermark, large for genuine text);
* ``D``: the common group's mean ``z`` minus the rare group's, standardised
  (``/ sqrt(1/n_common + 1/n_rare)``): about 0 for genuine text, positive for a spoof.

Among the texts the service's verdict calls watermarked (the rows of a
:mod:`worldcup_eval.fluency_study` JSON over the same texts, ``--verdicts``), the
table says how many each line takes: genuine answers (the cost) and spoofs (the power).

``python -m worldcup_eval.context_artifact_study --run RUN --budget-tokens N --verdicts
FLUENCY_JSON [--genuine DIR ...] [--rare-below 5] [--out FILE]``; ``--table FILE``
prints a saved JSON's table again, with the service's rule
(:func:`worldcup_core.context_sketch.spoof_artifact`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from worldcup_core.context_sketch import D_ABOVE, R_BELOW, Split, split_evidence, spoof_artifact
from worldcup_eval.forgery import (
    BASE,
    Tenant,
    fmt_rate,
    read_jsonl,
    saved_config,
    spoof_set,
    within_budget,
)

R_LINES = (1.0, 1.64, 2.33)  # a spoof when R is below the line
D_LINES = (2.0, 3.0, 4.0)  # a spoof when D is above the line


def context_counts(contexts: Iterable[Iterable[tuple[int, ...]]]) -> Counter[tuple[int, ...]]:
    """How many texts scored each context (once per text, as the scheme scores it)."""
    counts: Counter[tuple[int, ...]] = Counter()
    for text in contexts:
        counts.update(set(text))
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m worldcup_eval.context_artifact_study", description=__doc__
    )
    ap.add_argument("--run", type=Path, help="a forgery run's folder")
    ap.add_argument("--budget-tokens", type=int)
    ap.add_argument("--verdicts", type=Path, help="a fluency_study JSON over the same texts")
    ap.add_argument("--genuine", type=Path, nargs="+", default=[], help="as the fluency study's")
    ap.add_argument("--rare-below", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("context-artifact.json"))
    ap.add_argument(
        "--table", type=Path, help="print a saved study's JSON again (nothing else needed)"
    )
    args = ap.parse_args(argv)
    if args.table is not None:
        if not args.table.is_file():
            ap.error(f"--table {args.table}: no such file")
        try:
            table(args.table, sys.stdout)
        except (ValueError, KeyError, TypeError) as exc:
            ap.error(f"--table {args.table}: not a study's JSON ({type(exc).__name__}: {exc})")
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("run", "budget_tokens", "verdicts")
               if getattr(args, n) is None]  # fmt: skip
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)}")
    if args.rare_below < 1:
        ap.error("--rare-below must be >= 1")
    spoof_path = args.run / f"spoofs-{args.budget_tokens}.jsonl"
    answers_of = [folder / "answers.jsonl" for folder in args.genuine]
    for path in (
        spoof_path,
        args.verdicts,
        args.run / f"config-{args.budget_tokens}.json",
        *answers_of,
    ):
        if not path.is_file():
            ap.error(f"{path}: no such file")
    from worldcup_core.evidence import text_evidence
    from worldcup_core.models import load_tokenizer

    config = saved_config(args.run, args.budget_tokens)
    scheme = Tenant(config).worldcup()
    width = scheme.config.context_width
    tok = load_tokenizer(None)

    def retokenized(tokens: Sequence[int]) -> list[int]:  # as the service reads a text
        ids: list[int] = tok(
            tok.decode(tokens, skip_special_tokens=True), add_special_tokens=False
        ).input_ids
        return ids

    def contexts(ids: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(ids[i - width : i]) for i in scheme.scored_indices(ids)]

    answers = [
        retokenized(a["tokens"])
        for a in within_budget(
            read_jsonl(args.run / "answers.jsonl", drop=(BASE,)), args.budget_tokens
        )
    ]
    counts = context_counts(contexts(a) for a in answers)
    study = json.loads(args.verdicts.read_text())
    verdicts = study["sets"]
    limit = int(study.get("genuine_limit") or 0)  # the fluency study's --genuine-limit
    if study.get("budget_tokens", args.budget_tokens) != args.budget_tokens:
        ap.error(f"--verdicts were made at --budget-tokens {study['budget_tokens']}")
    sets: dict[str, tuple[list[list[int]], bool]] = {"genuine, run (T 1.0)": (answers, True)}
    labels = {name.split(" (")[0]: name for name in verdicts}
    for folder in args.genuine:
        label = labels.get(f"genuine, {folder.name}")
        if label is None:
            ap.error(f"--genuine {folder}: not a set of --verdicts (its folder name names it)")
        rows = read_jsonl(folder / "answers.jsonl", drop=(BASE,))
        sets[label] = ([retokenized(a["tokens"]) for a in rows], False)
    prompt_of: dict[str, list[str]] = {}  # each spoof's prompt (best-of-n per prompt)
    for row in read_jsonl(spoof_path):
        label = spoof_set(row["key"])
        sets.setdefault(label, ([], False))[0].append(retokenized(row["tokens"]))
        prompt_of.setdefault(label, []).append(row["key"].split("/")[2])
    result: dict[str, Any] = {
        "rare_below": args.rare_below,
        "contexts": len(counts),
        "sets": {},
    }
    out = sys.stdout
    out.write(
        f"{len(counts)} contexts in {len(answers)} answers; rare: seen in fewer than "
        f"{args.rare_below} other answers\n"
    )
    for name, (texts, counted) in sets.items():
        flags = [bool(r["watermarked"]) for r in verdicts[name]["rows"]]
        if counted and limit and len(flags) == min(limit, len(texts)):
            texts = texts[-len(flags) :]  # as the fluency study's --genuine-limit: the last K
        if len(flags) != len(texts):
            ap.error(f"--verdicts: {len(flags)} rows for {len(texts)} texts of {name!r}")
        rows = []
        for ids, wm in zip(texts, flags, strict=True):
            marks = [m for m in text_evidence(scheme, ids, config.num_bits) if m.z is not None]
            own = 1 if counted else 0  # the text's own answer counted its contexts once
            seen = [counts.get(tuple(ids[m.index - width : m.index]), 0) - own for m in marks]
            split = split_evidence([float(m.z or 0.0) for m in marks], seen, args.rare_below)
            rows.append({"watermarked": wm, **split.__dict__})
        for row, prompt in zip(rows, prompt_of.get(name, []), strict=False):
            row["prompt"] = prompt
        result["sets"][name] = rows
        write_set(out, name, rows)
    args.out.write_text(json.dumps(result))
    return 0


def write_set(out: TextIO, name: str, rows: list[dict[str, Any]]) -> None:
    """One set's lines: what each line, and the service's rule, takes of its watermarked
    texts."""
    held = [r for r in rows if r["watermarked"]]
    share = np.mean([r["rare"] / max(1, r["rare"] + r["common"]) for r in held]) if held else 0
    out.write(f"\n{name}: {len(held)} of {len(rows)} watermarked; rare share {share:.2f}\n")
    for line in R_LINES:
        taken = sum(not r["r"] >= line for r in held)  # NaN (no rare token): taken
        out.write(f"  R < {line:<5g} takes {fmt_rate(taken, len(held))}\n")
    for line in D_LINES:
        taken = sum(r["d"] > line for r in held)
        out.write(f"  D > {line:<5g} takes {fmt_rate(taken, len(held))}\n")
    flagged = sum(
        spoof_artifact(Split(**{k: r[k] for k in ("rare", "common", "r", "d")})) for r in held
    )
    out.write(
        f"  the service's rule (R < {R_BELOW:g} and D > {D_ABOVE:g}) takes "
        f"{fmt_rate(flagged, len(held))}\n"
    )
    alone = sum(r["rare"] == 0 or r["common"] == 0 for r in held)
    out.write(f"  one group only (nothing to compare, never taken): {fmt_rate(alone, len(held))}\n")
    prompts: dict[str, list[bool]] = {}  # spoofs: per prompt, whether each draft gets by
    for r in rows:
        if "prompt" in r:
            split = Split(*(r[k] for k in ("rare", "common", "r", "d")))
            prompts.setdefault(r["prompt"], []).append(
                r["watermarked"] and not spoof_artifact(split)
            )
    if prompts:
        passed = sum(any(v) for v in prompts.values())
        through = sum(any(r["watermarked"] for r in rows if r.get("prompt") == p) for p in prompts)
        out.write(
            f"  prompts with a watermarked draft: {through}/{len(prompts)}; with one the rule "
            f"does not take (an oracle's best of {max(map(len, prompts.values()))}): "
            f"{passed}/{len(prompts)}\n"
        )


def table(path: Path, out: TextIO) -> None:
    """Print a saved study's sets again (``--table``), with the service's rule."""
    result = json.loads(path.read_text())
    out.write(
        f"{result['contexts']} contexts; rare: seen fewer than {result['rare_below']} times\n"
    )
    for name, rows in result["sets"].items():
        write_set(out, name, rows)


if __name__ == "__main__":
    sys.exit(main())
