"""``report.md`` from ``results.json``'s dict: the paper's Table 1 layout and the rest.

Table 1 keeps the paper's shape -- rows are payload length x scheme, column
groups are the maximum generation length, each with AUC, bit accuracy,
median PPL and decoding time -- with the time in milliseconds per text
(the paper reports seconds). Every other table says in its heading what it
measures. A run with missing cells says PARTIAL at the top and lists them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from worldcup_core.baselines import BASELINES, describe_settings

NA = "—"


def _f(x: Any, digits: int = 3) -> str:
    return NA if x is None else f"{x:.{digits}f}"


def _pct(x: Any, digits: int = 1) -> str:
    return NA if x is None else f"{100 * x:.{digits}f}%"


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _index(cells: list[dict[str, Any]]) -> dict[tuple[str, int | None, int], dict[str, Any]]:
    return {(c["scheme"], c["bits"], c["length"]): c for c in cells}


def _schemes(results: dict[str, Any]) -> list[str]:
    return [s for s in results["config"]["schemes"] if s != "unwatermarked"]


def _status(results: dict[str, Any]) -> str:
    if results["complete"]:
        return "**Status: complete** -- every configured cell was generated and evaluated."
    items = "\n".join(f"  - {m}" for m in results["missing"])
    return (
        "**Status: PARTIAL** -- the numbers below cover only the cells that were run; "
        f"these are missing:\n\n{items}"
    )


def _baseline_settings(schemes: Iterable[str]) -> list[str]:
    """One protocol line per baseline in the run, in the words of its own module."""
    present = [s for s in schemes if s in BASELINES]
    if not present:
        return []
    lines = [
        "- Baselines (each as in the WorldCup paper's Appendix B; departures from the "
        "reference code are listed in each module's docstring):"
    ]
    return lines + [f"  - `{s}`: {describe_settings(s)}." for s in present]


def _protocol(results: dict[str, Any]) -> str:
    cfg, p = results["config"], results["protocol"]
    by_ds = ", ".join(f"{n} {d}" for d, n in p["prompts_by_dataset"].items())
    scorer = p["scorer"] or "not configured"
    lines = [
        f"- Model: {p['model']['model']} ({p['model']['dtype']}); second PPL scorer: {scorer}.",
        f"- Prompts per cell: {p['prompts']} ({by_ds}). `cnn`: the first {cfg['prompt_tokens']} "
        "tokens of a CNN/DailyMail article, as a raw completion prompt (C4/OpenGen style), the "
        "rest of the article is the human continuation; `eli5`: the ELI5 question through the "
        "chat template, the human answers are the continuation.",
        f"- Generation (paper, Sec. 4.1): min {cfg['min_new_tokens']} new tokens, max "
        f"{', '.join(map(str, cfg['lengths']))}; temperature {cfg['temperature']}, top-k "
        f"{cfg['top_k']}, top-p {cfg['top_p']}, "
        f"no_repeat_ngram_size {cfg['no_repeat_ngram_size']}, "
        f"context width c=2; WorldCup m={cfg['layers']}, alpha={cfg['alpha']}. Batched "
        f"generation, batch size {cfg['batch_size']}, seed {cfg['seed']}, watermark key id "
        f"`{p['key_id']}`.",
        *_baseline_settings(cfg["schemes"]),
        f"- **One generation per cell, at {p['generated_length']} tokens.** A shorter table "
        "reads the first tokens of the same texts: sampling is causal (token t depends only "
        "on the prompt and the tokens before it, and stopping at EOS is decided token by "
        f"token), so the first {min(cfg['lengths'])} tokens of a {p['generated_length']}-token "
        f"generation are distributed exactly like a {min(cfg['lengths'])}-token generation. "
        "Unwatermarked text is generated once (it carries no payload).",
        "- Payloads: random per prompt, derived from the seed; the same prompt carries the "
        "same payload in every scheme.",
        "- Detection score: `-log10 p` of the scheme's calibrated p-value for the known "
        "payload length. Negatives: the unwatermarked generations and the human "
        "continuations of the same prompts, cut to the same length and scored with the "
        "same key. TPR at FPR 1% / 0.1% uses the fixed thresholds p < 0.01 / p < 0.001 "
        "given by the p-value, not thresholds tuned on the negatives; best-F1 (a threshold "
        "sweep, optimistic) is shown only for comparison with the paper.",
        f"- Empirical FPR on human text: every non-overlapping chunk of the lengths under "
        f"test from all human continuations (up to {cfg['human_texts']}: "
        + ", ".join(f"{n} at {k} tokens" for k, n in p["human_pool"].items())
        + "), with exact 95% intervals.",
        f"- Extraction: exact; list decoding (payload among the top {cfg['list_size']}); "
        "registry decoding (maximum likelihood over a registry of "
        + ", ".join(f"{n} messages at {b} bits" for b, n in p["registry_size"].items())
        + ", random, containing the true one).",
        "- PPL: median over texts of the generating model's perplexity of the generated "
        "tokens given the prompt (self-PPL; raw model distribution).",
        "- Time: decoding (decode + detect from token ids) per text, in ms, one text at a "
        "time; encoding time is generation wall time per generated token in batches.",
    ]
    return "\n".join(lines)


def _table1(results: dict[str, Any]) -> str:
    cfg = results["config"]
    idx = _index(results["main"])
    lengths = cfg["lengths"]
    header = ["Bits", "Scheme"] + [
        f"{m} @{n}" for n in lengths for m in ("AUC", "Bit Acc", "PPL", "Time (ms)")
    ]
    rows = []
    for b in cfg["bits"]:
        for s in ["unwatermarked", *_schemes(results)]:
            row = [f"{b}", s]
            for n in lengths:
                c = idx.get((s, None if s == "unwatermarked" else b, n))
                if c is None:
                    row += ["not run"] + [NA] * 3
                elif s == "unwatermarked":
                    row += [NA, NA, _f(c["ppl"]["self_median"], 2), NA]
                else:
                    row += [
                        _f(c["auc"]),
                        _f(c["bit_accuracy"]),
                        _f(c["ppl"]["self_median"], 2),
                        _f(c["timing"]["decode_ms_mean"], 2),
                    ]
            rows.append(row)
    return _table(header, rows)


def _per_cell_table(
    results: dict[str, Any], columns: list[tuple[str, Any]], cells_key: str = "main"
) -> str:
    cfg = results["config"]
    idx = _index(results[cells_key])
    header = ["Bits", "Scheme"] + [f"{name} @{n}" for n in cfg["lengths"] for name, _ in columns]
    rows = []
    for b in cfg["bits"]:
        for s in _schemes(results):
            row = [f"{b}", s]
            for n in cfg["lengths"]:
                c = idx.get((s, b, n))
                row += [get(c) if c else "not run" for _, get in columns]
            rows.append(row)
    return _table(header, rows)


def _fpr_cell(c: dict[str, Any], key: str) -> str:
    h = c["human_fpr"]
    entry = h[key]
    lo, hi = entry["ci95"]
    rate, ci = _pct(entry["rate"], 2), f"{_pct(lo, 2)}–{_pct(hi, 2)}"
    return f"{entry['false_positives']}/{h['n']} ({rate}, CI {ci})"


def _detection_table(results: dict[str, Any]) -> str:
    rows = []
    for c in results["main"]:
        if c["bits"] is None:
            continue
        rows.append(
            [
                f"{c['bits']}",
                c["scheme"],
                f"{c['length']}",
                _pct(c["tpr"]["fpr_0.01"]),
                _pct(c["tpr"]["fpr_0.001"]),
                _pct(c["negatives"]["fpr_0.01"]),
                _pct(c["negatives"]["fpr_0.001"]),
                _fpr_cell(c, "fpr_0.01"),
                _fpr_cell(c, "fpr_0.001"),
                _f(c["best_f1"]),
            ]
        )
    header = [
        "Bits",
        "Scheme",
        "Tokens",
        "TPR p<0.01",
        "TPR p<0.001",
        "FPR negatives p<0.01",
        "FPR negatives p<0.001",
        "FPR human pool p<0.01",
        "FPR human pool p<0.001",
        "best F1",
    ]
    return _table(header, rows)


def _ppl_time_table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    idx = _index(results["main"])
    enc = {(e["scheme"], e["bits"]): e for e in results["timing"]["encoding"]}
    header = ["Scheme", "Bits"]
    header += [f"self-PPL @{n}" for n in cfg["lengths"]]
    header += [f"scorer PPL @{n}" for n in cfg["lengths"]]
    header += ["encode ms/token", "vs unwatermarked"]
    rows = []
    for s in ["unwatermarked", *_schemes(results)]:
        for b in [None] if s == "unwatermarked" else cfg["bits"]:
            cells = [idx.get((s, b, n)) for n in cfg["lengths"]]
            e = enc.get((s, b), {})
            rows.append(
                [s, NA if b is None else str(b)]
                + [_f(c["ppl"]["self_median"], 2) if c else "not run" for c in cells]
                + [
                    _f(c["ppl"]["scorer_median"], 2) if c and c["ppl"]["scorer_median"] else NA
                    for c in cells
                ]
                + [_f(e.get("ms_per_token"), 2), _f(e.get("relative_to_unwatermarked"), 3)]
            )
    return _table(header, rows)


def _ablation_table(results: dict[str, Any]) -> str:
    rows = []
    for c in results["ablation"]:
        rows.append(
            [
                f"{c['bits']}",
                f"{c['length']}",
                c["scheme"],
                _f(c["auc"]),
                _f(c["bit_accuracy"]),
                _f(c["ppl"]["self_median"], 2),
                _f(c["timing"]["decode_ms_mean"], 2),
                _pct(c["extraction"]["exact"]),
                _pct(c["tpr"]["fpr_0.01"]),
            ]
        )
    header = [
        "Bits",
        "Tokens",
        "Variant",
        "AUC",
        "Bit Acc",
        "PPL",
        "Time (ms)",
        "exact",
        "TPR p<0.01",
    ]
    return _table(header, rows)


def _robustness_table(results: dict[str, Any]) -> tuple[str, str]:
    rob = results["robustness"]
    attacks = list(dict.fromkeys(r["attack"] for r in rob))
    idx = {(r["scheme"], r["bits"], r["attack"]): r for r in rob}
    keys = list(dict.fromkeys((r["scheme"], r["bits"]) for r in rob))
    keys.sort(
        key=lambda k: (k[1], _schemes(results).index(k[0]) if k[0] in _schemes(results) else 99)
    )
    main = []
    tpr = []
    for s, b in keys:
        row, trow = [str(b), s], [str(b), s]
        for a in attacks:
            r = idx.get((s, b, a))
            row.append(f"{_f(r['auc'])} / {_f(r['bit_accuracy'])}" if r else "not run")
            trow.append(
                f"{_pct(r['tpr']['fpr_0.01'])} / {_pct(r['extraction']['registry'])}"
                if r
                else "not run"
            )
        main.append(row)
        tpr.append(trow)
    header = ["Bits", "Scheme", *attacks]
    return _table(header, main), _table(header, tpr)


def _attack_stats(results: dict[str, Any]) -> str:
    """What each attack did, averaged over every attacked cell's texts."""
    sums: dict[str, dict[str, list[float]]] = {}
    for r in results["robustness"]:
        for k, v in r["attack_stats"].items():
            if v is not None:
                sums.setdefault(r["attack"], {}).setdefault(k, []).append(v)
    parts = []
    for a, st in sums.items():
        values = ", ".join(f"{k} {sum(v) / len(v):.3g}" for k, v in st.items())
        parts.append(f"- `{a}`: {values}")
    return (
        ("What the attacks did (means over texts and cells):\n\n" + "\n".join(parts))
        if parts
        else ""
    )


def _by_dataset(results: dict[str, Any]) -> str:
    rows = []
    datasets = sorted(
        {d for c in results["main"] if c["bits"] is not None for d in c["by_dataset"]}
    )
    for c in results["main"]:
        if c["bits"] is None:
            continue
        row = [str(c["bits"]), c["scheme"], str(c["length"])]
        for d in datasets:
            x = c["by_dataset"].get(d)
            row.append(
                f"{_f(x['auc'])} / {_f(x['bit_accuracy'])} / {_pct(x['exact'])}" if x else NA
            )
        rows.append(row)
    return _table(
        ["Bits", "Scheme", "Tokens", *(f"{d}: AUC / bit acc / exact" for d in datasets)], rows
    )


def _environment(results: dict[str, Any]) -> str:
    env, t = results["environment"], results["timing"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    dirty = " (uncommitted changes)" if env.get("git_dirty") else ""
    return "\n".join(
        [
            f"- Command: `{env['command']}`",
            f"- Git commit: `{env['git_commit']}`{dirty}",
            f"- Python {env['python']} on {env['platform']}; {env['cpu_count']} CPUs, "
            f"{env['torch_threads']} torch threads, device {env['device']}",
            f"- Versions: {versions}",
            f"- Wall-clock of this invocation: {t['wall_clock_seconds']} s (a resumed run counts "
            "only its own time). Generation compute in the cache: "
            f"{t['compute']['generate_seconds']} s generating, "
            f"{t['compute']['self_ppl_seconds']} s scoring self-PPL.",
        ]
    )


def render_report(results: dict[str, Any]) -> str:
    cfg = results["config"]
    rob_main, rob_tpr = _robustness_table(results)
    sections = [
        "# WorldCup evaluation report",
        _status(results),
        "## Protocol",
        _protocol(results),
        "## Table 1: multi-bit watermarking (layout of the paper's Table 1)",
        "AUC, bit accuracy, median self-PPL and decoding time per text (ms) for each payload "
        "length and scheme, at each maximum generation length.",
        _table1(results),
        "## Message extraction rate",
        "exact: all bits right; list: the payload is among the top "
        f"{cfg['list_size']} decoded messages; registry: maximum-likelihood match in the "
        "registry is the payload (registry p<0.01: and its corrected p-value is below 0.01).",
        _per_cell_table(
            results,
            [
                ("exact", lambda c: _pct(c["extraction"]["exact"])),
                ("list", lambda c: _pct(c["extraction"]["list"])),
                ("registry", lambda c: _pct(c["extraction"]["registry"])),
                ("registry p<0.01", lambda c: _pct(c["extraction"]["registry_significant"])),
            ],
        ),
        "## Detection at fixed p-value thresholds",
        "TPR = share of watermarked texts with p below the threshold; FPR negatives = the same "
        "on the AUC negatives (unwatermarked generations + paired human continuations); FPR "
        "human pool = false positives on the larger human-text pool, with exact 95% intervals.",
        _detection_table(results),
        "## Perplexity and encoding time",
        "Encoding time is wall time per generated token of batched generation on this machine; "
        "a shared machine makes it noisy, compare it with the unwatermarked row.",
        _ppl_time_table(results),
        "## Ablations",
        "The paper's Section 5.1 variants of WorldCup k=2 (first row: the full method).",
        _ablation_table(results) if results["ablation"] else "not configured",
        f"## Robustness ({cfg['attack_length'] or max(cfg['lengths'])}-token watermarked texts)",
        "AUC / bit accuracy under each attack; `none` is the unattacked text after a "
        "detokenise/retokenise round trip. Attacks: word deletion "
        f"{cfg['deletion_ratio']}, WordNet synonym substitution {cfg['synonym_ratio']} of the "
        f"words, copy-paste CP-{cfg['copy_paste_segments']}-"
        f"{int(round(100 * cfg['copy_paste_human_fraction']))}% (human text of the same "
        "prompt around the watermarked segments), paraphrase by the generating model.",
        rob_main if results["robustness"] else "not configured",
        "TPR at p<0.01 / registry extraction rate under each attack:",
        rob_tpr if results["robustness"] else "not configured",
        _attack_stats(results),
        "## By dataset",
        "AUC / bit accuracy / exact extraction per prompt source.",
        _by_dataset(results),
        "## Plots",
        "\n\n".join(f"![{p}]({p})" for p in results.get("plots", [])),
        "## Environment",
        _environment(results),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"
