"""The threshold of ``attribution: "whole"`` from data (issue #45, piggybacking).

``python -m worldcup_eval.coverage --out DIR [--answers 40] [--budget-tokens 30000]``

An answer that names a registry entry says how much of the text carries the watermark
(:func:`worldcup_core.islands.island_coverage`) and claims the *whole* text only when
its islands hold at least :data:`~worldcup_core.islands.WHOLE_COVERAGE` of its scored
tokens. This measures, with the attack harness of :mod:`worldcup_eval.forgery` (the
service's generation path, the tenant's key, per-request registry payloads):

* genuine answers (``--answers`` at each temperature, 0.7 and 1.0, up to 200 tokens):
  the distribution of the coverage and of the one-island share, and how many would be
  ``whole`` at the threshold (the rate genuine answers keep their whole claim);
* the piggyback edits of :func:`worldcup_eval.forgery.piggyback_edits` (an inserted
  human paragraph, negations, 10/30/50 % rewritten), judged at the production verdict:
  per edit, the texts that name an entry (before: every such answer implied the whole
  text was the issued one), those still ``whole`` by the coverage alone (after), and
  those ``whole`` as the service now answers (``whole_with_fingerprint``: the coverage
  and the issued-text fingerprint, :mod:`worldcup_core.fingerprint`), each with a
  Clopper-Pearson interval.

Results are kept under ``--out`` (answers and edits resume); the summary is printed
and written to ``coverage.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from worldcup_core.fingerprint import SIMILARITY_THRESHOLD, VERBATIM_SIMILARITY
from worldcup_eval.forgery import (
    ForgeryConfig,
    Judge,
    Tenant,
    collect_answers,
    load_prompts,
    piggyback_edits,
    rate,
)

TEMPERATURES = (0.7, 1.0)


def text_coverage(tenant: Tenant, tokenizer: Any, text: str, num_bits: int) -> Any:
    """The coverage of ``text`` under the tenant's key, as the service computes it."""
    from worldcup_core.evidence import text_evidence
    from worldcup_core.islands import island_coverage

    ids = tokenizer(text, add_special_tokens=False).input_ids
    marks = {m.index: m.z for m in text_evidence(tenant.worldcup(), ids, num_bits)}
    return island_coverage([marks.get(i) for i in range(len(ids))])


def issued_similarities(key: Any, edits: list[dict[str, Any]]) -> list[float]:
    """Each edit's similarity to its answer's unedited text (the text the service issued
    and fingerprinted), as the service computes it (:mod:`worldcup_core.fingerprint`)."""
    from worldcup_core.fingerprint import fingerprint_similarity, text_fingerprint

    issued = {
        int(e["answer"]): text_fingerprint(key, str(e["text"]))
        for e in edits
        if e["edit"] == "unedited"
    }
    return [
        fingerprint_similarity(issued[int(e["answer"])], text_fingerprint(key, str(e["text"])))
        for e in edits
    ]


def _quantiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    qs = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5)
    return {f"q{round(100 * q)}": round(float(np.quantile(arr, q)), 4) for q in qs} | {
        "mean": round(float(arr.mean()), 4),
        "max": round(float(arr.max()), 4),
    }


def measure_client_naming(
    config: ForgeryConfig, tokenizer: Any, answers: list[dict[str, Any]]
) -> dict[str, Any]:
    """Genuine answers as if each had been generated under a client-chosen payload (its
    bits) beside the tenant's ``config.bystanders`` registry entries: the entries their
    answers name, with the payloads not recorded (before) and recorded as candidates,
    as the service now records them (after). Any named entry is another user's."""
    from app.services.corpus import RawRow
    from worldcup_scan.keys import ScanKeys
    from worldcup_scan.scanner import Scanner, ScanSpec

    spec = Tenant(config).key_spec()
    at = (spec.tenant_id, spec.version)
    registry = {at: {config.num_bits: list(range(1, config.bystanders + 1))}}
    chosen = {at: {config.num_bits: [int(str(a["bits"]), 2) for a in answers]}}
    texts = [tokenizer.decode(a["tokens"], skip_special_tokens=True) for a in answers]
    rows = [RawRow(str(i), "client", i, t, None) for i, t in enumerate(texts)]
    out: dict[str, Any] = {"answers": len(answers), "entries": config.bystanders}
    for label, client in (("before", {}), ("after", chosen)):
        keys = ScanKeys((spec,), registry, config.num_bits, "coverage", client_payloads=client)
        said = Scanner(ScanSpec(keys, mode="detect"), tokenizer=tokenizer).scan_rows(rows)
        out[label] = {
            "watermarked": rate(sum(r["verdict"] == "watermarked" for r in said), len(said)),
            "named_other_entry": rate(sum(r["message_id"] is not None for r in said), len(said)),
        }
    return out


def genuine_summary(
    config: ForgeryConfig, tokenizer: Any, got: list[dict[str, Any]]
) -> dict[str, Any]:
    """The coverage of genuine answers, judged as the service judges them: coverage is
    answered for "watermarked" texts only, and "whole" matters where an entry is named."""
    tenant = Tenant(config)
    texts = [tokenizer.decode(a["tokens"], skip_special_tokens=True) for a in got]
    said = Judge(config, tenant, tokenizer, tenant.registry_ids(got)).judge(texts)
    covs = [text_coverage(tenant, tokenizer, x, config.num_bits) for x in texts]
    marked = [c for c, r in zip(covs, said, strict=True) if r["watermarked"]]
    named = [c for c, r in zip(covs, said, strict=True) if r["named"] is not None]
    return {
        "answers": len(covs),
        "watermarked": len(marked),
        "named": len(named),
        "coverage_watermarked": _quantiles([c.share for c in marked]) if marked else None,
        "whole_of_watermarked": rate(sum(c.attribution == "whole" for c in marked), len(marked)),
        "whole_of_named": rate(sum(c.attribution == "whole" for c in named), len(named)),
        "shares_watermarked": sorted(round(c.share, 4) for c in marked),
        "shares_named": sorted(round(c.share, 4) for c in named),
    }


def measure(out: Path, answers: int, budget_tokens: int, show_progress: bool) -> dict[str, Any]:
    from worldcup_core.models import load_model
    from worldcup_eval.data import default_data_dir

    lm = load_model()
    base = ForgeryConfig(
        "per-request",
        budget_tokens=min(budget_tokens // 3, 220 * answers),
        piggyback=answers,
        spoof_prompts=40,
    )
    prompts = load_prompts(default_data_dir(), base.spoof_prompts)
    summary: dict[str, Any] = {"genuine": {}, "piggyback": []}
    collected: dict[float, list[dict[str, Any]]] = {}
    for t in TEMPERATURES:
        config = replace(base, temperature=t)
        sub = out / f"t{t:g}"
        sub.mkdir(parents=True, exist_ok=True)
        got = collect_answers(lm, config, Tenant(config), prompts, sub, show_progress)
        got = [a for a in got if len(a["tokens"]) >= 128][:answers]
        collected[t] = got
        summary["genuine"][f"T{t:g}"] = genuine_summary(config, lm.tokenizer, got)
    summary["client_naming"] = measure_client_naming(
        replace(base, temperature=1.0), lm.tokenizer, collected[1.0]
    )
    # piggyback edits of the T 1.0 answers, judged with the tenant's registry
    config = replace(base, temperature=1.0)
    tenant = Tenant(config)
    got = collected[1.0]
    edits = piggyback_edits(lm, config, prompts, got, out / "t1", show_progress)
    judge = Judge(config, tenant, lm.tokenizer, tenant.registry_ids(got))
    kinds: dict[str, list[dict[str, Any]]] = {}
    for e in edits:
        kinds.setdefault(str(e["edit"]), []).append(e)
    sims = dict(
        zip(
            (str(e["key"]) for e in edits),
            issued_similarities(tenant.worldcup().key, edits),
            strict=True,
        )
    )
    for kind, group in kinds.items():
        said = judge.judge([str(e["text"]) for e in group])
        named = [e for e, s in zip(group, said, strict=True) if s["named"] is not None]
        covs = [text_coverage(tenant, lm.tokenizer, str(e["text"]), config.num_bits) for e in named]
        similar = [sims[str(e["key"])] for e in named]
        # "whole" as the service now answers it (app.services.evidence.coverage_out): the
        # coverage and the issued-text fingerprint, or a fingerprint that finds it verbatim
        fingerprinted = sum(
            x >= VERBATIM_SIMILARITY or (c.attribution == "whole" and x >= SIMILARITY_THRESHOLD)
            for c, x in zip(covs, similar, strict=True)
        )
        summary["piggyback"].append(
            {
                "edit": kind,
                "texts": len(group),
                "named_before": rate(len(named), len(group)),
                "whole_after": rate(sum(c.attribution == "whole" for c in covs), len(group)),
                "whole_with_fingerprint": rate(fingerprinted, len(group)),
                "coverage_named": _quantiles([c.share for c in covs]) if covs else None,
                "similarity_named": _quantiles(similar) if similar else None,
                "shares": [round(c.share, 4) for c in covs],
            }
        )
    (out / "coverage.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worldcup_eval.coverage", description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--answers", type=int, default=40)
    ap.add_argument("--budget-tokens", type=int, default=30000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    summary = measure(args.out, args.answers, args.budget_tokens, show_progress=True)
    for k, v in summary["genuine"].items():
        shown = {x: y for x, y in v.items() if not x.startswith("shares")}
        sys.stdout.write(f"{k} {json.dumps(shown)}\n")
    sys.stdout.write(f"client payloads {json.dumps(summary['client_naming'])}\n")
    for row in summary["piggyback"]:
        sys.stdout.write(json.dumps({k: v for k, v in row.items() if k != "shares"}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
