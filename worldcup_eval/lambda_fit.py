"""Model-free screening of subtraction schedules on the generator's own distributions.

For design ideas that change only how WorldCup reweights one step (the lambda schedule,
the number of layers m), the expected effect of a step can be computed exactly from the
filtered distribution ``p`` the encoder sees and random g-values, without generating:

* **signal**: ``E_key[ E_{x~q}[gbar_int(x)] - E_{x~p}[gbar_int(x)] ]``, how far the
  watermarked draw moves the decoder's per-token statistic (the intended family's mean
  g-value over m layers, averaged over the k groups) -- what bit accuracy grows with;
* **cost**: ``E_key[ sum_x (q(x) - p(x)) (-log p(x)) ]``, the expected rise of the
  token's negative log-likelihood under the model -- what self-PPL grows with
  (``exp`` of its mean is the PPL factor to first order).

The distributions come from the unwatermarked cached generations (teacher-forced,
temperature 1, top-k 50, top-p 0.95, the eval's sampling). Each schedule family is
swept over its strength; one family is better than another where its (cost, signal)
curve lies above. This screens ideas before spending generation on them; the frontier
cells are the measurement.

    python -m worldcup_eval.lambda_fit --config docs/results/frontier/frontier.toml
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worldcup_core.sampling import filter_logits
from worldcup_core.tournament import tournament_distribution

Schedule = Callable[[float, float], float]  # (strength, entropy) -> lambda

SCHEDULES: dict[str, tuple[Schedule, tuple[float, ...]]] = {
    # the paper's: lambda = alpha * tanh(H)
    "tanh": (lambda a, h: a * math.tanh(h), (0.0, 0.15, 0.3, 0.6, 0.9, 1.2)),
    # constant lambda (first-order optimum of signal per unit KL when nothing clips)
    "flat": (lambda a, h: a, (0.1, 0.2, 0.3, 0.45, 0.6, 0.8)),
    # subtraction only where the step has entropy to spare
    "gate1": (lambda a, h: a if h >= 1.0 else 0.0, (0.3, 0.6, 0.9, 1.2)),
    "gate2": (lambda a, h: a if h >= 2.0 else 0.0, (0.3, 0.6, 0.9, 1.2)),
    # tanh squared: smaller at low entropy, the same at high
    "tanh2": (lambda a, h: a * math.tanh(h) ** 2, (0.3, 0.6, 0.9, 1.2, 1.5)),
}


def entropy(p: np.ndarray) -> float:
    q = p[p > 0]
    return float(-(q * np.log(q)).sum())


def distributions(config: Path, texts: int, max_steps: int) -> list[np.ndarray]:
    """Filtered next-token distributions along the first ``texts`` unwatermarked texts."""
    from worldcup_core.models import load_model
    from worldcup_eval.frontier import Frontier, load_frontier

    cfg, fcfg = load_frontier(config)
    fr = Frontier(cfg, fcfg)
    rows = fr.rows("unwatermarked", None)
    assert rows is not None
    lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    prompts = {p.index: p for p in fr.data.prompts}
    out: list[np.ndarray] = []
    with torch.inference_mode():
        for r in rows[:texts]:
            ctx = list(prompts[r["index"]].prompt_ids)
            cont = list(r["token_ids"])
            ids = torch.tensor([ctx + cont])
            logits = lm.model(input_ids=ids).logits[0, len(ctx) - 1 : -1].float()
            n = logits.shape[0]
            _, probs = filter_logits(
                logits, [cfg.temperature] * n, [cfg.top_k] * n, [cfg.top_p] * n
            )
            for row in probs:
                p = row[row > 0]
                out.append(p / p.sum())
    rng = np.random.default_rng(0)
    if len(out) > max_steps:
        keep = rng.choice(len(out), max_steps, replace=False)
        out = [out[i] for i in sorted(keep)]
    return out


def screen(
    dists: list[np.ndarray], groups: int, layers: int, keys: int, seed: int = 1
) -> dict[str, list[dict[str, float]]]:
    """(strength, signal, cost) of every schedule in :data:`SCHEDULES`, averaged over steps."""
    rng = np.random.default_rng(seed)
    acc: dict[tuple[str, float], list[float]] = {}
    for p in dists:
        n = len(p)
        h = entropy(p)
        nll = -np.log(p)
        g = rng.integers(0, 2, size=(keys, groups, layers, n), dtype=np.uint8)
        q_int = tournament_distribution(p, g).sum(axis=1)  # (keys, n)
        q_oth = tournament_distribution(p, 1 - g).sum(axis=1)
        gbar = g.mean(axis=2).mean(axis=1)  # (keys, n): intended mean g over layers, groups
        base_signal = gbar @ p
        for name, (fn, strengths) in SCHEDULES.items():
            for a in strengths:
                lam = fn(a, h)
                s = np.clip(q_int - lam * q_oth, 0.0, None)
                tot = s.sum(axis=1, keepdims=True)
                fallback = q_int / q_int.sum(axis=1, keepdims=True)
                q = np.where(tot > 0, s / np.where(tot > 0, tot, 1.0), fallback)
                signal = float(((q * gbar).sum(axis=1) - base_signal).mean())
                cost = float((q @ nll).mean() - p @ nll)
                acc.setdefault((name, a), []).extend([signal, cost])
    out: dict[str, list[dict[str, float]]] = {}
    for (name, a), values in acc.items():
        arr = np.asarray(values).reshape(-1, 2)
        out.setdefault(name, []).append(
            {
                "strength": a,
                "signal": round(float(arr[:, 0].mean()), 6),
                "cost": round(float(arr[:, 1].mean()), 6),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=Path("docs/results/frontier/frontier.toml"))
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("docs/results/frontier/lambda_fit.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dists = distributions(args.config, args.texts, args.steps)
    results: dict[str, Any] = {"steps": len(dists), "keys": args.keys, "screens": {}}
    for groups, layers in ((1, 30), (1, 10), (2, 30), (2, 10)):
        results["screens"][f"k{groups}-m{layers}"] = screen(dists, groups, layers, args.keys)
        sys.stdout.write(f"k{groups} m{layers} done\n")
        sys.stdout.flush()
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
