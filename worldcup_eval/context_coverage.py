"""How much of a new text a stealing learner has seen, by context width and budget (#45).

Watermark stealing (:mod:`worldcup_eval.stealing`) learns a context's favoured tokens
only from the contexts it has seen often. This measures that directly on a forgery
run's answers, without generating anything: for each context width ``w`` and each
budget (answer tokens read, in the order they were collected), the share of the
positions of held-out answers whose ``w``-token context the learner had seen at least
``min_count`` times (each context counted once per answer, as the scheme scores it).
How that share grows with the budget is what carries a measured budget to a larger one.

``python -m worldcup_eval.context_coverage RUN/answers.jsonl [--held-out 112]
[--widths 1 2 3 4] [--budgets 25000 50000 100000] [--min-count 5 20]``

It reads the tokens only: the answers' own key and width do not matter, since which
contexts recur is a property of the model's text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

Context = tuple[int, ...]


def first_contexts(tokens: Sequence[int], width: int) -> Iterator[Context]:
    """Each ``width``-token context of ``tokens`` once, in order of first occurrence."""
    seen: set[Context] = set()
    for t in range(width, len(tokens)):
        context = tuple(tokens[t - width : t])
        if context not in seen:
            seen.add(context)
            yield context


def coverage(
    train: Sequence[Sequence[int]],
    held: Sequence[Sequence[int]],
    width: int,
    budgets: Sequence[int],
    min_counts: Sequence[int],
) -> list[dict[str, float]]:
    """Per budget (answer tokens of ``train`` read in order; the budgets ascending): the
    share of ``held``'s scored contexts seen at least each of ``min_counts`` times."""
    counts: Counter[Context] = Counter()
    held_contexts = [c for tokens in held for c in first_contexts(tokens, width)]
    rows: list[dict[str, float]] = []
    pending = sorted(budgets)
    spent = 0

    def row(budget: int) -> dict[str, float]:
        out: dict[str, float] = {"budget": float(budget), "tokens_read": float(spent)}
        for m in min_counts:
            hits = sum(counts.get(c, 0) >= m for c in held_contexts)
            out[f"seen_{m}"] = hits / max(len(held_contexts), 1)
        return out

    for tokens in train:
        if not pending:
            break
        counts.update(first_contexts(tokens, width))
        spent += len(tokens)
        while pending and spent >= pending[0]:
            rows.append(row(pending.pop(0)))
    rows.extend(row(b) for b in pending)  # budgets past the answers: all that was read
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m worldcup_eval.context_coverage", description=__doc__
    )
    ap.add_argument("answers", type=Path, help="a forgery run's answers.jsonl")
    ap.add_argument("--held-out", type=int, default=112, help="the last N answers")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--budgets", type=int, nargs="+", default=[25_000, 50_000, 100_000, 180_000])
    ap.add_argument("--min-count", type=int, nargs="+", default=[5, 20])
    args = ap.parse_args(argv)
    if not args.answers.is_file():
        ap.error(f"{args.answers}: no such file")
    if args.held_out < 1 or min(args.widths) < 1 or min(args.min_count) < 1:
        ap.error("--held-out, --widths and --min-count must be at least 1")
    from worldcup_eval.forgery import iter_jsonl

    tokens = [[int(t) for t in r["tokens"]] for r in iter_jsonl(args.answers)]
    if len(tokens) <= args.held_out:
        ap.error(f"{args.answers}: {len(tokens)} answers, not more than --held-out {args.held_out}")
    train, held = tokens[: -args.held_out], tokens[-args.held_out :]
    result = {str(w): coverage(train, held, w, args.budgets, args.min_count) for w in args.widths}
    out = sys.stdout
    out.write(
        f"held out: the last {len(held)} answers; share of their scored contexts seen "
        f"at least {'/'.join(map(str, args.min_count))} times\n"
    )
    for w, series in result.items():
        cells = "  ".join(
            f"{int(r['budget']):>7d}: "
            + "/".join(f"{100 * r[f'seen_{m}']:.1f}" for m in args.min_count)
            for r in series
        )
        out.write(f"width {w}  {cells}\n")
    out.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
