"""A fluency (surprisal) gate against spoofs, measured on genuine answers and spoofs (#45).

:mod:`worldcup_eval.fluency` asks whether a text surprises the served model more than
the model's own draws would (``z``). Used as a gate, a "watermarked" verdict would stand
only where ``z <= line``. This study measures what a line would cost and buy, with the
service's own verdict for the forgery tenant (:class:`worldcup_eval.forgery.Judge`,
model-assisted, both agreement gates as shipped):

* **genuine answers**: the attacker's own collected answers of a forgery run (the
  service's output at the attacker's settings: temperature 1, top-k 50, top-p 0.95, 200
  tokens) and, with ``--genuine DIR ...``, answers collected under the run's key at other
  settings (``--collect N --temperature T --top-k K --top-p P --max-new-tokens L``, one
  folder per setting, resuming). Among those the verdict calls watermarked, how many a
  line would take (the cost);
* **spoofs** of the run (every draft on the held-out prompts, each counted on its own):
  how many keep the verdict, and name an entry, before and after each line.

Each text is read as the service reads a text (the decoded text re-tokenized, the
response alone, no prompt) by the model in detection's precision
(:func:`worldcup_core.model_weights.weights_model`).

``python -m worldcup_eval.fluency_study --run RUN --budget-tokens N [--genuine DIR ...
[--collect N ...]] [--lines 2 3 4] [--genuine-limit K] [--out FILE] [--plot FILE]``
prints one table (Clopper-Pearson 95 % intervals), writes every text's ``z`` and verdict
(JSON) and the distributions of ``z`` (PNG).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from worldcup_eval.fluency import fluency_z, surprisal_from_logits
from worldcup_eval.forgery import (
    BASE,
    MODEL_DTYPES,
    Judge,
    Tenant,
    collect_answers,
    fmt_rate,
    judge_weights,
    load_prompts,
    read_jsonl,
    saved_config,
    spoof_set,
    within_budget,
)

DEFAULT_LINES = (2.0, 3.0, 4.0, 5.0)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "max_new_tokens")


def text_z(model: Any, texts: Sequence[Sequence[int]], pad: int, batch: int = 8) -> list[float]:
    """Each text's fluency ``z`` (:func:`worldcup_eval.fluency.fluency_z`) under
    ``model``, read alone (no prompt): one right-padded forward pass per batch."""
    import torch

    out: list[float] = []
    for s in range(0, len(texts), batch):
        part = [list(t) for t in texts[s : s + batch]]
        width = max((len(t) for t in part), default=0)
        if width < 2:
            out.extend(0.0 for _ in part)
            continue
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for i, t in enumerate(part):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            mask[i, : len(t)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        for i, t in enumerate(part):
            rows = logits[i, : max(len(t) - 1, 0)].numpy()
            out.append(fluency_z(surprisal_from_logits(rows, t, first=1)) if len(t) > 1 else 0.0)
    return out


def auc(spoofs: Sequence[float], genuine: Sequence[float]) -> float:
    """P(a spoof's ``z`` > a genuine text's), ties counted half (Mann-Whitney): 0.5 is
    no separation at all, 1.0 a line that takes every spoof and no genuine text."""
    a = np.asarray(spoofs, dtype=np.float64)
    b = np.asarray(genuine, dtype=np.float64)
    if not a.size or not b.size:
        return float("nan")
    greater = (a[:, None] > b[None, :]).sum()
    ties = (a[:, None] == b[None, :]).sum()
    return float((greater + 0.5 * ties) / (a.size * b.size))


def _quantiles(z: Sequence[float]) -> dict[str, float]:
    arr = np.asarray([x for x in z if np.isfinite(x)])
    if not arr.size:
        return {}
    qs = (0.5, 0.9, 0.99, 0.999, 1.0)
    return {f"q{100 * q:g}": float(np.quantile(arr, q)) for q in qs} | {"mean": float(arr.mean())}


def plot(sets: dict[str, list[dict[str, Any]]], lines: Sequence[float], path: Path) -> None:
    """The distributions of ``z`` (common bins, outlines): genuine answers and spoofs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    every = [r["z"] for rows in sets.values() for r in rows if np.isfinite(r["z"])]
    bins = np.linspace(min(every, default=-1.0), max(every, default=1.0), 45).tolist()
    for name, rows in sets.items():
        z = [r["z"] for r in rows if np.isfinite(r["z"])]
        if z:
            dashed = "genuine" not in name
            ax.hist(
                z,
                bins=bins,
                density=True,
                histtype="step",
                linewidth=1.6,
                linestyle="--" if dashed else "-",
                label=f"{name} ({len(z)})",
            )
    for line in lines:
        ax.axvline(line, color="k", linestyle=":", linewidth=1)
    ax.set_xlabel("fluency z (surprisal above the model's entropy, standardised)")
    ax.set_ylabel("density")
    ax.set_title("Genuine answers against stolen-watermark spoofs (issue #45)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worldcup_eval.fluency_study", description=__doc__)
    ap.add_argument("--run", type=Path, required=True, help="a forgery run's folder")
    ap.add_argument("--budget-tokens", type=int, required=True)
    ap.add_argument(
        "--genuine",
        type=Path,
        nargs="+",
        default=[],
        help="folders of genuine answers (answers.jsonl), e.g. agreement_study's",
    )
    ap.add_argument("--collect", type=int, default=0, help="first collect N answers into each")
    ap.add_argument("--temperature", type=float, default=1.0, help="--collect's sampling")
    ap.add_argument("--top-k", type=int, default=0, help="--collect's top-k (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="--collect's top-p (1: off)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="--collect's length")
    ap.add_argument("--collect-only", action="store_true", help="stop after --collect")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--genuine-limit", type=int, default=0, help="read at most K run answers")
    ap.add_argument("--lines", type=float, nargs="+", default=list(DEFAULT_LINES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        default="auto",
        help="the model's weights (bfloat16: about twice the CPU rate where the CPU has "
        "AVX512-BF16); the forward passes take detection's precision from it",
    )
    ap.add_argument(
        "--unweighted-clients",
        action="store_true",
        help="weigh each recorded client payload 1, not by its texts (as before 2026-11-30)",
    )
    ap.add_argument("--out", type=Path, default=Path("fluency-study.json"))
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.collect < 0 or args.genuine_limit < 0 or args.top_k < 0:
        ap.error("--collect, --genuine-limit and --top-k must be >= 0")
    if args.max_new_tokens < 1 or not args.temperature > 0 or not 0 < args.top_p <= 1:
        ap.error("--max-new-tokens must be >= 1, --temperature > 0 and --top-p in (0, 1]")
    if args.collect and not args.genuine:
        ap.error("--collect needs --genuine DIR: where to write the answers")
    spoof_path = args.run / f"spoofs-{args.budget_tokens}.jsonl"
    if not spoof_path.is_file():
        ap.error(f"--run {args.run}: no {spoof_path.name} (a forgery run's folder)")
    for folder in args.genuine:
        if not args.collect and not (folder / "answers.jsonl").is_file():
            ap.error(f"--genuine {folder}: no answers.jsonl (add --collect N to write them)")
    import torch

    from worldcup_core.model_weights import weights_model
    from worldcup_core.models import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(None, dtype=args.dtype)
    config = replace(saved_config(args.run, args.budget_tokens), judge="model")
    tenant = Tenant(config)
    if args.collect:
        from worldcup_eval.data import default_data_dir

        sampling = replace(
            config,
            scenario="per-request",
            budget_tokens=args.collect * args.max_new_tokens,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
        )
        prompts = load_prompts(
            args.data_dir or default_data_dir(), config.spoof_prompts, config.spoof_from
        )
        prompts = replace(prompts, train=prompts.train[::-1])  # away from the attacker's
        for folder in args.genuine:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "sampling.json").write_text(
                json.dumps({k: getattr(sampling, k) for k in SAMPLING_FIELDS})
            )
            collect_answers(lm, sampling, Tenant(sampling), prompts, folder, show_progress=True)
        if args.collect_only:
            return 0
    answers = within_budget(
        read_jsonl(args.run / "answers.jsonl", drop=(BASE,)), args.budget_tokens
    )
    registry = tenant.registry_ids(answers)
    uses = None if args.unweighted_clients else tenant.client_uses(answers)
    judge = Judge(config, tenant, lm.tokenizer, registry, judge_weights(lm, config), uses)
    model = weights_model(lm.model)

    sets: dict[str, list[list[int]]] = {}
    run_answers = answers[-args.genuine_limit :] if args.genuine_limit else answers
    sets["genuine, run (T 1.0)"] = [a["tokens"] for a in run_answers]
    for folder in args.genuine:
        how = folder / "sampling.json"
        label = f"genuine, {folder.name}"
        if how.is_file():
            got = json.loads(how.read_text())
            label += " (" + ", ".join(f"{k} {got[k]:g}" for k in SAMPLING_FIELDS) + ")"
        sets[label] = [a["tokens"] for a in read_jsonl(folder / "answers.jsonl", drop=(BASE,))]
    for row in read_jsonl(spoof_path):  # key: aim/delta/prompt/draw
        sets.setdefault(spoof_set(row["key"]), []).append(row["tokens"])

    result: dict[str, Any] = {
        "lines": args.lines,
        "registry_entries": len(registry),
        # which run answers the genuine set holds (the context study checks them)
        "budget_tokens": args.budget_tokens,
        "genuine_limit": args.genuine_limit,
        "sets": {},
    }
    out = sys.stdout
    out.write(f"registry: {len(registry)} entries; judge: the model-assisted verdict\n")
    header = " ".join(f"{'z<=' + format(x, 'g'):>22s}" for x in args.lines)
    for name, token_lists in sets.items():
        texts = [lm.tokenizer.decode(t, skip_special_tokens=True) for t in token_lists]
        ids = [lm.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        zs = text_z(model, ids, lm.pad_token_id)
        said = judge.judge(texts)
        rows = [
            {"z": z, "watermarked": bool(s["watermarked"]), "named": s["named"]}
            for z, s in zip(zs, said, strict=True)
        ]
        result["sets"][name] = {"rows": rows, "z": _quantiles(zs)}
        wm = [r for r in rows if r["watermarked"]]
        named = [r for r in rows if r["named"] is not None]
        out.write(f"\n{name}: {len(rows)} texts; z {json.dumps(_quantiles(zs))}\n")
        out.write(f"  {'':24s}{'ungated':>22s} {header}\n")
        for what, chosen in (("watermarked", wm), ("named an entry", named)):
            kept = [fmt_rate(sum(r["z"] <= x for r in chosen), len(rows)) for x in args.lines]
            cells = " ".join(f"{c:>22s}" for c in kept)
            out.write(f"  {what:24s}{fmt_rate(len(chosen), len(rows)):>22s} {cells}\n")
    # how far apart the spoofs are from the service's own answers at the same settings
    base = [r["z"] for r in result["sets"]["genuine, run (T 1.0)"]["rows"]]
    result["auc_vs_run_answers"] = {
        name: auc([r["z"] for r in v["rows"]], base)
        for name, v in result["sets"].items()
        if not name.startswith("genuine")
    }
    out.write(f"\nAUC against the run's answers: {json.dumps(result['auc_vs_run_answers'])}\n")
    args.out.write_text(json.dumps(result))
    if args.plot is not None:
        plot({k: v["rows"] for k, v in result["sets"].items()}, args.lines, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
