"""PNG plots from ``results.json``'s dict (matplotlib, Agg backend: no display needed).

* ``roc_<attack>.png``: ROC curves under each attack (``none`` is the
  unattacked text after a detokenise/retokenise round trip), one panel per
  payload length, one line per scheme;
* ``bit_accuracy_vs_length.png``: bit accuracy of the first n generated
  tokens, one panel per payload length;
* ``ppl_distribution.png``: self-perplexity per text, per scheme, one panel
  per evaluated length.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

_METADATA = {"Software": None}  # keep the PNGs byte-stable across matplotlib builds


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=_METADATA)
    plt.close(fig)
    return path


def _panels(count: int, width: float = 4.6, height: float = 4.0) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(
        1, max(count, 1), figsize=(width * max(count, 1), height), squeeze=False
    )
    return fig, list(axes[0])


def roc_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    by_attack: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results["robustness"]:
        by_attack[r["attack"]].append(r)
    paths = []
    for attack, rows in by_attack.items():
        bits = sorted({r["bits"] for r in rows})
        fig, axes = _panels(len(bits))
        for ax, b in zip(axes, bits, strict=True):
            for r in (r for r in rows if r["bits"] == b):
                label = (
                    f"{r['scheme']} (AUC {r['auc']:.3f})" if r["auc"] is not None else r["scheme"]
                )
                ax.plot(r["roc"]["fpr"], r["roc"]["tpr"], label=label, drawstyle="steps-post")
            ax.plot([0, 1], [0, 1], linestyle=":", color="grey", linewidth=0.8)
            ax.set(
                xlabel="false positive rate",
                ylabel="true positive rate",
                title=f"{attack}, {b} bits, {rows[0]['length']} tokens",
                xlim=(0, 1),
                ylim=(0, 1.01),
            )
            ax.legend(loc="lower right", fontsize=8)
        paths.append(_save(fig, out_dir / f"roc_{attack}.png"))
    return paths


def bit_accuracy_plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    curves = results["curves"]
    if not curves:
        return []
    bits = sorted({c["bits"] for c in curves})
    fig, axes = _panels(len(bits))
    for ax, b in zip(axes, bits, strict=True):
        for c in (c for c in curves if c["bits"] == b):
            ax.plot(
                c["prefix_tokens"], c["bit_accuracy"], marker="o", markersize=3, label=c["scheme"]
            )
        ax.set(
            xlabel="generated tokens (prefix)",
            ylabel="bit accuracy",
            title=f"{b}-bit payload",
            ylim=(0.45, 1.01),
        )
        ax.axhline(0.5, linestyle=":", color="grey", linewidth=0.8)
        ax.legend(loc="lower right", fontsize=8)
    return [_save(fig, out_dir / "bit_accuracy_vs_length.png")]


def ppl_plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    cells = [c for c in results["main"] + results["ablation"] if c["ppl"]["self_all"]]
    if not cells:
        return []
    lengths = sorted({c["length"] for c in cells})
    fig, axes = _panels(len(lengths), width=max(6.0, 0.55 * len(cells) / max(len(lengths), 1) + 3))
    for ax, n in zip(axes, lengths, strict=True):
        mine = [c for c in cells if c["length"] == n]
        seen: dict[str, list[float]] = {}
        for c in mine:
            label = c["scheme"] if c["bits"] is None else f"{c['scheme']}\n{c['bits']}b"
            seen.setdefault(label, [v for v in c["ppl"]["self_all"] if v is not None])
        ax.boxplot(list(seen.values()), showfliers=False)
        ax.set_xticks(range(1, len(seen) + 1), list(seen), rotation=60, fontsize=7)
        ax.set(ylabel="self-perplexity (generating model)", title=f"max {n} tokens")
    return [_save(fig, out_dir / "ppl_distribution.png")]


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    return (
        roc_plots(results, out_dir)
        + bit_accuracy_plot(results, out_dir)
        + ppl_plot(results, out_dir)
    )
