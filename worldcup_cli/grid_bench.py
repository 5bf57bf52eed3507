"""``worldcup bench grid``: detection and decoding where users are (issue #35, item 2).

The committed chat prompts of ``bench first-use`` (``data/first_use_prompts.txt``,
the first ``texts`` of them, the same in every cell) are answered by the embedded
instruct model at each temperature, under each WorldCup preset through the
service (one app per preset, ``POST /generate`` with chat messages, seed = the
prompt's place in its tenant, metadata: every answer is a registry entry), and
under BiMark (and unwatermarked, for quality) through
:func:`worldcup_core.generation.generate` with the same chat template, top-k,
top-p, no-repeat n-gram size and 32-bit payloads.

**One generation serves every length.** Each answer is generated once, at
``max(lengths)`` new tokens; the length-L text is its first L tokens (the answer
re-tokenised with the model's tokenizer, cut, detokenised: :func:`prefix`).
Sampling is causal, so a prefix has the distribution of a shorter generation; an
answer that ended (EOS) before L counts at its own length, and each cell reports
the share that reached L and the median length measured.

**Measured per (scheme, temperature, length).** WorldCup, through
``/detect/batch`` and ``/decode/batch`` (:func:`worldcup_cli.first_use_bench.measure`)
with each tenant's registry at its natural size (``per_tenant`` entries) and after
filling it to ``big_registry`` entries: the share whose verdict is "watermarked"
(p < 1e-6, every correction), the share whose issued entry /decode names, the share
where the message-free /detect p alone is below 1e-6, /decode's bit accuracy
against the issued payload, the median verdict p and the answers that contradict
each other. BiMark has no registry: its own calibrated p (length known, 32 bits)
below 1e-6 and its bit accuracy, the same at both registry sizes. Quality: the
median self-perplexity of the full answers (the generating model's raw
distribution, :func:`worldcup_eval.runner.continuation_logprobs`).

Every finished unit (one scheme at one temperature) is written to
``out/cells/`` at once; a rerun reads the finished ones back (the service's store
lives in ``out/work/``, so the tenants' keys survive a crash), and
``--report-only`` renders ``report.md`` and ``grid.png`` from ``results.json``.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worldcup_cli.first_use_bench import (
    bench_settings,
    fill_registry,
    generate_answers,
    make_tenants,
    measure,
    prompts,
)
from worldcup_eval.metrics import bit_accuracy

PRESETS = ("frontier", "paper")
TEMPERATURES = (0.3, 0.7, 1.0)
LENGTHS = (32, 64, 128, 256)
THRESHOLD = 1e-6
NUM_BITS = 32  # the service's default payload length
TOP_K, TOP_P, NO_REPEAT = 50, 0.95, 4  # /generate's defaults
BIMARK_SEED = 0  # BiMark's key: worldcup_eval.seeding.eval_key(0)
SIZES = ("small", "big")


def prefix(tokenizer: Any, text: str, length: int) -> tuple[str, list[int]]:
    """The first ``length`` tokens of ``text`` (fewer if it is shorter), as text and ids."""
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)[:length]
    return tokenizer.decode(ids), ids


def share_se(hits: int, n: int) -> float:
    """One binomial standard error of ``hits / n``."""
    if not n:
        return 0.0
    rate = hits / n
    return math.sqrt(rate * (1 - rate) / n)


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def _lengths_seen(tokens: list[int], length: int) -> dict[str, Any]:
    return {
        "n": len(tokens),
        "reached": sum(t >= length for t in tokens),
        "median_tokens": statistics.median(min(t, length) for t in tokens),
    }


# --------------------------------------------------------------------------- WorldCup


def _summary(result: dict[str, Any], payloads: list[str]) -> dict[str, Any]:
    rows = result["rows"]
    # a text the service could not score (its item's error) recovered no bit
    acc = [bit_accuracy(r["bits"] or "?" * len(p), p) for r, p in zip(rows, payloads, strict=True)]
    mean, se = _mean_se(acc)
    return {
        "watermarked": result["watermarked"],
        "named": result["named"],
        "detect_alone": sum(r["detect_p"] < THRESHOLD for r in rows),
        "bit_accuracy": round(mean, 4),
        "bit_accuracy_se": round(se, 4),
        "median_verdict_p": result["median_verdict_p"],
        "contradictions": result["contradictions"],
        "errors": sorted({r["error"] for r in rows if r["verdict"] == "error"}),
        "error_count": result["errors"],
    }


def _measure_lengths(
    client: Any, tenants: list[dict[str, Any]], lengths: Sequence[int]
) -> dict[int, dict[str, Any]]:
    tokenizer = client.app.state.runtime.tokenizer
    out = {}
    for length in lengths:
        cut = [
            {
                "auth": t["auth"],
                "generated": [
                    {"text": prefix(tokenizer, g["text"], length)[0], "message_id": g["message_id"]}
                    for g in t["generated"]
                ],
            }
            for t in tenants
        ]
        payloads = [g["payload"] for t in tenants for g in t["generated"]]
        out[length] = _summary(measure(client, cut), payloads)
    return out


def _registry_top(db: Path, tenant_ids: list[str]) -> int:
    with sqlite3.connect(db) as c:
        tops = [
            c.execute(
                "SELECT COALESCE(MAX(message_id), 0) FROM messages WHERE tenant_id = ?", (t,)
            ).fetchone()[0]
            for t in tenant_ids
        ]
    return max(tops, default=0)


def unfill_registry(db: Path, tenant_ids: list[str]) -> None:
    """Back to the natural size: remove the entries :func:`fill_registry` added."""
    with sqlite3.connect(db) as c:
        for t in tenant_ids:
            gone = c.execute(
                "DELETE FROM messages WHERE tenant_id = ? AND metadata = '{\"filled\":true}'",
                (t,),
            ).rowcount
            # the counters with them (fill_registry moved them): the natural count again
            c.execute("UPDATE registry_counts SET live = live - ? WHERE tenant_id = ?", (gone, t))


def worldcup_unit(
    client: Any,
    db: Path,
    preset: str,
    temperature: float,
    chosen: list[str],
    lengths: Sequence[int],
    per_tenant: int,
    big_registry: int,
    saved: dict[str, Any] | None,
    save: Callable[[dict[str, Any]], None],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """One preset at one temperature: generate (or reuse ``saved`` answers whose
    registries are still at their natural size; new answers go to ``save`` at once),
    measure at both registry sizes."""
    tenants: list[dict[str, Any]]
    started = time.perf_counter()
    if saved is not None:
        unfill_registry(db, [t["id"] for t in saved["tenants"]])
    if saved is not None and _registry_top(db, [t["id"] for t in saved["tenants"]]) <= per_tenant:
        tenants = saved["tenants"]
        seconds = saved["generate_seconds"]
        progress("  reusing the saved answers")
    else:
        tenants = make_tenants(
            client, chosen, per_tenant, f"grid-{preset}-{temperature}-{time.time_ns()}"
        )

        def done(i: int, n: int) -> None:
            if i % 8 == 0 or i == n:
                elapsed = time.perf_counter() - started
                progress(f"  {i}/{n} answers, {elapsed:.0f} s")

        generate_answers(client, tenants, max(lengths), temperature, done=done)
        seconds = round(time.perf_counter() - started, 1)
        save({"texts": len(chosen), "tenants": tenants, "generate_seconds": seconds})
    small = _measure_lengths(client, tenants, lengths)
    key_version = 1
    for t in tenants:
        fill_registry(db, t["id"], key_version, NUM_BITS, big_registry)
    big = _measure_lengths(client, tenants, lengths)
    for length in lengths:
        if small[length]["error_count"] or big[length]["error_count"]:
            progress(
                f"  at {length} tokens the service could not score "
                f"{small[length]['error_count']} / {big[length]['error_count']} texts "
                f"({', '.join(small[length]['errors'] + big[length]['errors'])})"
            )
    tokens = [g["tokens"] for t in tenants for g in t["generated"]]
    return {
        "scheme": preset,
        "temperature": temperature,
        "generate_seconds": seconds,
        "tenants": tenants,
        "answers": [g for t in tenants for g in t["generated"]],
        "cells": {
            str(length): {
                **_lengths_seen(tokens, length),
                "small": small[length],
                "big": big[length],
            }
            for length in lengths
        },
    }


# --------------------------------------------------------------------------- model side


def model_unit(
    lm: Any,
    scheme_name: str,
    temperature: float,
    chosen: list[str],
    lengths: Sequence[int],
    progress: Callable[[str], None],
    batch: int = 8,
    saved: Sequence[dict[str, Any]] = (),
    save: Callable[[list[dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """BiMark (or no watermark: ``scheme_name="none"``) at one temperature, generated
    with :func:`worldcup_core.generation.generate` as the evaluation does, at the
    service's sampling defaults; BiMark decoded at every length."""
    import numpy as np

    from worldcup_core import Payload, SamplingConfig
    from worldcup_core.baselines import build_baseline
    from worldcup_core.generation import GenerationRequest, generate
    from worldcup_eval.data import chat_prompt_ids
    from worldcup_eval.seeding import eval_key

    scheme = None if scheme_name == "none" else build_baseline(scheme_name, eval_key(BIMARK_SEED))
    tok = lm.tokenizer
    started = time.perf_counter()
    answers: list[dict[str, Any]] = list(saved)[: len(chosen)]  # a crashed run's batches
    if answers:
        progress(f"  {len(answers)} saved answers read back")
    for start in range(len(answers), len(chosen), batch):
        requests, payloads = [], []
        for j in range(start, min(start + batch, len(chosen))):
            payload = (
                Payload.random(NUM_BITS, np.random.default_rng([BIMARK_SEED, j]))
                if scheme is not None
                else None
            )
            sampling = SamplingConfig(
                temperature=temperature,
                top_k=TOP_K,
                top_p=TOP_P,
                max_new_tokens=max(lengths),
                no_repeat_ngram_size=NO_REPEAT,
                seed=j,
            )
            ids = chat_prompt_ids(tok, chosen[j], chosen[j])
            requests.append(GenerationRequest(ids, sampling, scheme, payload))
            payloads.append(payload.bits if payload is not None else None)
        results = generate(lm.model, requests, lm.eos_token_ids, lm.pad_token_id)
        for r, p in zip(results, payloads, strict=True):
            answers.append(
                {
                    "text": tok.decode(r.token_ids, skip_special_tokens=True),
                    "tokens": len(r.token_ids),
                    "finish_reason": r.finish_reason,
                    "payload": p,
                }
            )
        elapsed = time.perf_counter() - started
        progress(f"  {len(answers)}/{len(chosen)} answers, {elapsed:.0f} s")
        if save is not None:
            save(answers)
    seconds = round(time.perf_counter() - started, 1)
    cells: dict[str, Any] = {}
    tokens = [a["tokens"] for a in answers]
    for length in lengths:
        cell: dict[str, Any] = _lengths_seen(tokens, length)
        if scheme is not None:
            ids = [prefix(tok, a["text"], length)[1] for a in answers]
            decoded = scheme.decode_many(ids, NUM_BITS) if hasattr(scheme, "decode_many") else None
            if decoded is None:
                decoded = [scheme.decode(i, NUM_BITS) for i in ids]
            acc = [
                bit_accuracy(d.bits, a["payload"]) for d, a in zip(decoded, answers, strict=True)
            ]
            mean, se = _mean_se(acc)
            ps = [d.detection.p_value for d in decoded]
            own = {
                "watermarked": sum(p < THRESHOLD for p in ps),
                "named": None,
                "detect_alone": sum(p < THRESHOLD for p in ps),
                "bit_accuracy": round(mean, 4),
                "bit_accuracy_se": round(se, 4),
                "median_verdict_p": statistics.median(ps),
                "contradictions": None,
            }
            cell["small"] = cell["big"] = own
        cells[str(length)] = cell
    return {
        "scheme": scheme_name,
        "temperature": temperature,
        "generate_seconds": seconds,
        "answers": answers,
        "cells": cells,
    }


def self_ppl(lm: Any, chosen: list[str], answers: list[dict[str, Any]], length: int) -> list[float]:
    """Each answer's self-perplexity over its first ``length`` tokens (re-tokenised)."""
    from worldcup_eval.data import chat_prompt_ids
    from worldcup_eval.runner import continuation_logprobs

    tok = lm.tokenizer
    prompt_ids = [chat_prompt_ids(tok, p, p) for p in chosen[: len(answers)]]
    conts = [prefix(tok, a["text"], length)[1] for a in answers]
    lps = continuation_logprobs(lm.model, prompt_ids, conts, lm.pad_token_id)
    return [math.exp(-statistics.fmean(lp)) for lp in lps if lp]


# --------------------------------------------------------------------------- the run


def _unit_path(out: Path, scheme: str, temperature: float) -> Path:
    return out / "cells" / f"{scheme}-t{temperature:g}.json"


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def run(
    texts: int = 40,
    temperatures: Sequence[float] = TEMPERATURES,
    lengths: Sequence[int] = LENGTHS,
    presets: Sequence[str] = PRESETS,
    baselines: Sequence[str] = ("bimark",),
    unwatermarked: bool = True,
    big_registry: int = 100_000,
    per_tenant: int = 20,
    out: Path = Path("docs/results/grid"),
    ppl_texts: int = 20,
    model_texts: int | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every unit (scheme x temperature), resuming finished ones from ``out/cells``;
    returns (and writes) ``results.json``."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from worldcup_core.models import load_model

    chosen = prompts()[:texts]
    lengths = sorted(lengths)
    plan = [(p, t) for p in presets for t in temperatures]
    plan += [(b, t) for b in baselines for t in temperatures]
    plan += [("none", t) for t in temperatures] if unwatermarked else []
    started = time.perf_counter()
    spent: list[float] = []
    units: dict[tuple[str, float], dict[str, Any]] = {}

    def stamp(i: int, scheme: str, temperature: float) -> None:
        elapsed = time.perf_counter() - started
        eta = statistics.fmean(spent) * (len(plan) - i + 1) if spent else math.nan
        eta_s = f"{eta / 60:.0f} min" if math.isfinite(eta) else "?"
        progress(
            f"cell {i}/{len(plan)}: {scheme} at temperature {temperature:g}; "
            f"elapsed {elapsed / 60:.1f} min, ETA {eta_s}"
        )

    def finished(path: Path, count: int = len(chosen)) -> dict[str, Any] | None:
        if not path.is_file():
            return None
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        same = data.get("texts") == count and data.get("lengths") == list(lengths)
        done = same and data.get("big_registry", big_registry) == big_registry
        return data if done and "cells" in data else None

    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text("work/\n", encoding="utf-8")
    i = 0
    for preset in presets:
        todo = [t for t in temperatures if finished(_unit_path(out, preset, t)) is None]
        for t in temperatures:
            if t not in todo:
                i += 1
                units[preset, t] = finished(_unit_path(out, preset, t)) or {}
                progress(f"cell {i}/{len(plan)}: {preset} at {t:g} read back")
        if not todo:
            continue
        db = work / f"{preset}.sqlite3"
        # each answer is scored at every length and registry size, 16 queries about one
        # text (by containment): the per-tenant probe budgets would refuse the later ones
        settings = bench_settings(
            db, watermark_preset=preset, probe_budget_verdict=0, probe_budget_full=0
        )
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            for t in todo:
                i += 1
                stamp(i, preset, t)
                t0 = time.perf_counter()
                partial = work / f"{preset}-t{t:g}.answers.json"
                saved = json.loads(partial.read_text()) if partial.is_file() else None
                if saved is not None and saved.get("texts") != len(chosen):
                    saved = None
                unit = worldcup_unit(
                    client, db, preset, t, chosen, lengths, per_tenant, big_registry, saved,
                    lambda data, partial=partial: _write_json(partial, data), progress,
                )  # fmt: skip
                unit.pop("tenants")
                unit.update(texts=len(chosen), lengths=list(lengths), big_registry=big_registry)
                _write_json(_unit_path(out, preset, t), unit)
                units[preset, t] = unit
                spent.append(time.perf_counter() - t0)
    model_plan = [(s, t) for s, t in plan if s not in presets]
    model_chosen = chosen[: model_texts or len(chosen)]
    lm = load_model()  # BiMark, unwatermarked and every answer's self-perplexity
    for scheme, t in model_plan:
        i += 1
        path = _unit_path(out, scheme, t)
        old = finished(path, len(model_chosen))
        if old is not None:
            units[scheme, t] = old
            progress(f"cell {i}/{len(plan)}: {scheme} at {t:g} read back")
            continue
        stamp(i, scheme, t)
        t0 = time.perf_counter()
        partial = work / f"{scheme}-t{t:g}.answers.json"
        unit = model_unit(
            lm, scheme, t, model_chosen, lengths, progress,
            saved=json.loads(partial.read_text()) if partial.is_file() else [],
            save=lambda answers, partial=partial: _write_json(partial, answers),
        )  # fmt: skip
        unit.update(texts=len(model_chosen), lengths=list(lengths), big_registry=big_registry)
        _write_json(path, unit)
        units[scheme, t] = unit
        spent.append(time.perf_counter() - t0)
    settings = {
        "texts": len(chosen),
        "temperatures": list(temperatures),
        "lengths": list(lengths),
        "presets": list(presets),
        "baselines": list(baselines),
        "per_tenant": per_tenant,
        "big_registry": big_registry,
        "max_new_tokens": max(lengths),
        "top_k": TOP_K,
        "top_p": TOP_P,
        "no_repeat_ngram_size": NO_REPEAT,
        "num_bits": NUM_BITS,
        "threshold": THRESHOLD,
        "ppl_texts": ppl_texts,
        "model_texts": len(model_chosen),
    }
    result = assemble(settings, units, time.perf_counter() - started)
    _write_json(out / "results.json", result)  # detection first: quality is the slow extra
    for (scheme, t), unit in units.items():
        if unit.get("ppl_n") != min(ppl_texts, len(unit["answers"])) and ppl_texts:
            progress(f"self-perplexity of {scheme} at {t:g}")
            ppl = self_ppl(lm, chosen, unit["answers"][:ppl_texts], max(lengths))
            unit["median_ppl"] = round(statistics.median(ppl), 3)
            unit["ppl_n"] = len(ppl)
            _write_json(_unit_path(out, scheme, t), unit)
    result = assemble(settings, units, time.perf_counter() - started)
    _write_json(out / "results.json", result)
    progress(f"done in {(time.perf_counter() - started) / 60:.1f} min")
    return result


def assemble(
    settings: dict[str, Any], units: dict[tuple[str, float], dict[str, Any]], seconds: float
) -> dict[str, Any]:
    """``results.json``: the settings, one entry per (scheme, temperature, length) cell
    with both registry sizes, the quality figures and the timings."""
    return {
        "settings": settings,
        "cells": [
            {"scheme": scheme, "temperature": t, "length": int(length), **cell}
            for (scheme, t), unit in units.items()
            if scheme != "none"
            for length, cell in unit["cells"].items()
        ],
        "quality": [
            {"scheme": scheme, "temperature": t, "median_ppl": u["median_ppl"], "n": u["ppl_n"]}
            for (scheme, t), u in units.items()
            if "median_ppl" in u
        ],
        "generate_seconds": {
            f"{scheme}-t{t:g}": unit["generate_seconds"] for (scheme, t), unit in units.items()
        },
        "runtime_s": round(seconds, 1),
    }


# --------------------------------------------------------------------------- the report


def _pct(hits: int, n: int) -> str:
    return f"{100 * hits / n:.0f} ± {100 * share_se(hits, n):.0f}" if n else "-"


def _cell(cells: list[dict[str, Any]], scheme: str, t: float, length: int) -> dict[str, Any]:
    for c in cells:
        if c["scheme"] == scheme and c["temperature"] == t and c["length"] == length:
            return c
    raise KeyError((scheme, t, length))


METRICS: tuple[tuple[str, str, Callable[[dict[str, Any], str], str]], ...] = (
    (
        "watermarked",
        'Verdict "watermarked" (p < 1e-6, every correction), % ± SE',
        lambda c, s: _pct(c[s]["watermarked"], c["n"]),
    ),
    (
        "named",
        "/decode names the issued registry entry, % ± SE",
        lambda c, s: "no registry" if c[s]["named"] is None else _pct(c[s]["named"], c["n"]),
    ),
    (
        "detect_alone",
        "message-free /detect p alone < 1e-6, % ± SE",
        lambda c, s: _pct(c[s]["detect_alone"], c["n"]),
    ),
    (
        "bit_accuracy",
        "/decode bit accuracy against the issued payload (32 bits), % ± SE",
        lambda c, s: f"{100 * c[s]['bit_accuracy']:.1f} ± {100 * c[s]['bit_accuracy_se']:.1f}",
    ),
    (
        "median_verdict_p",
        "median verdict p",
        lambda c, s: f"{c[s]['median_verdict_p']:.2g}",
    ),
    (
        "reached",
        "answers that reached the length (median tokens measured)",
        lambda c, s: f"{c['reached']}/{c['n']} ({c['median_tokens']:g})",
    ),
)


def _label(scheme: str) -> str:
    return {
        "frontier": "WorldCup frontier (k=1, m=30, α=0.6)",
        "paper": "WorldCup paper (k=2, α=1.2)",
        "bimark": "BiMark (own p; no registry)",
    }.get(scheme, scheme)


def metric_table(result: dict[str, Any], size: str, metric: str) -> str:
    s = result["settings"]
    name, title, fmt = next(m for m in METRICS if m[0] == metric)
    schemes = s["presets"] + s["baselines"]
    lengths = s["lengths"]
    lines = [
        f"{title}:",
        "",
        "| scheme | temperature | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|---|" + "---|" * len(lengths),
    ]
    for scheme in schemes:
        for t in s["temperatures"]:
            row = [fmt(_cell(result["cells"], scheme, t, n), size) for n in lengths]
            lines.append(f"| {_label(scheme)} | {t:g} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def contradictions(result: dict[str, Any], size: str) -> int:
    return sum(c[size]["contradictions"] or 0 for c in result["cells"] if c[size]["contradictions"])


def reaches(result: dict[str, Any], size: str, target: float = 0.9) -> str:
    """Per scheme and temperature, the shortest measured length whose "watermarked"
    share is at least ``target`` (a point estimate), as a table."""
    s = result["settings"]
    lines = [
        "| scheme | " + " | ".join(f"T={t:g}" for t in s["temperatures"]) + " |",
        "|---|" + "---|" * len(s["temperatures"]),
    ]
    for scheme in s["presets"] + s["baselines"]:
        row = []
        for t in s["temperatures"]:
            hit = [
                n
                for n in s["lengths"]
                if (c := _cell(result["cells"], scheme, t, n))[size]["watermarked"]
                >= target * c["n"]
            ]
            row.append(f"{hit[0]} tokens" if hit else f"not by {max(s['lengths'])}")
        lines.append(f"| {_label(scheme)} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    sizes = {
        "small": f"natural registry ({s['per_tenant']} entries per tenant)",
        "big": f"registry filled to {s['big_registry']:,} entries".replace(",", " "),
    }
    parts = [
        "# Power where users are: temperature x length grid (issue #35)",
        "",
        f"{s['texts']} chat answers per cell (the first {s['texts']} prompts of "
        "worldcup_cli/data/first_use_prompts.txt, the same in every cell), embedded "
        f"SmolLM2-135M-Instruct, top-k {s['top_k']}, top-p {s['top_p']}, no-repeat "
        f"{s['no_repeat_ngram_size']}-grams, {s['num_bits']}-bit payloads, one generation "
        f"at {s['max_new_tokens']} new tokens read at every length (its first L tokens). "
        "WorldCup through the service (/generate, /detect/batch, /decode/batch); BiMark "
        "through the evaluation's generate() with the same prompts and sampling, scored by "
        "its own calibrated p (length known) -- it has no registry, so its rows are the "
        "same at both registry sizes. Every answer is scored at every length and registry "
        "size, so the service's per-tenant probe budgets are off for this run. ± one "
        "standard error (binomial for shares; at 0 or all of n it is 0, and the rule of "
        "three bounds the rate within 3/n at 95 %).",
        "",
        "Reproduce: `worldcup bench grid --texts "
        f"{s['texts']} --big-registry {s['big_registry']}` "
        "(`--report-only` re-renders this file and grid.png from results.json).",
    ]
    for size, title in sizes.items():
        parts += ["", f"## {title[0].upper()}{title[1:]}", ""]
        for metric, *_ in METRICS:
            parts += [metric_table(result, size, metric), ""]
        parts += [
            f'Shortest length with at least 90 % "watermarked" ({title}):',
            "",
            reaches(result, size),
            "",
        ]
        n = contradictions(result, size)
        parts.append(f"Answers whose /detect and /decode contradict each other: {n}.")
        errors = [c for c in result["cells"] if c[size].get("error_count")]
        if errors:
            codes = sorted({e for c in errors for e in c[size]["errors"]})
            count = sum(c[size]["error_count"] for c in errors)
            parts.append(
                f"Texts the service answered with an item error (counted as not "
                f"watermarked, no bit recovered): {count} ({', '.join(codes)})."
            )
    parts += ["", "## Quality: median self-perplexity of the full answers", ""]
    parts += ["| scheme | " + " | ".join(f"T={t:g}" for t in s["temperatures"]) + " |"]
    parts += ["|---|" + "---|" * len(s["temperatures"])]
    q = {(r["scheme"], r["temperature"]): r for r in result["quality"]}
    for scheme in s["presets"] + s["baselines"] + ["none"]:
        if not any(k[0] == scheme for k in q):
            continue
        row = [
            f"{q[scheme, t]['median_ppl']:.2f}" if (scheme, t) in q else "-"
            for t in s["temperatures"]
        ]
        label = "unwatermarked" if scheme == "none" else _label(scheme)
        parts.append(f"| {label} | " + " | ".join(row) + " |")
    parts += [
        "",
        "Self-perplexity: the generating model's raw distribution (no temperature, top-k, "
        "top-p or watermark) over each answer's tokens after the chat prompt.",
        "",
        "Generation time (s) per unit: "
        + ", ".join(f"{k} {v:.0f}" for k, v in result["generate_seconds"].items())
        + f"; the last invocation {result['runtime_s'] / 60:.0f} min on the CPU (cells "
        "finished by an earlier one are read back, not rerun).",
        "",
        "![watermarked share vs length](grid.png)",
        "",
    ]
    return "\n".join(parts)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    colours = {"frontier": "tab:blue", "paper": "tab:orange", "bimark": "tab:green"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, size, title in zip(
        axes,
        SIZES,
        (f"registry {s['per_tenant']} entries", f"registry {s['big_registry']:,} entries"),
        strict=True,
    ):
        for scheme in s["presets"] + s["baselines"]:
            for k, t in enumerate(s["temperatures"]):
                cells = [_cell(result["cells"], scheme, t, n) for n in s["lengths"]]
                y = [100 * c[size]["watermarked"] / c["n"] for c in cells]
                e = [100 * share_se(c[size]["watermarked"], c["n"]) for c in cells]
                ax.errorbar(
                    s["lengths"], y, yerr=e, capsize=3, color=colours.get(scheme),
                    linestyle=styles[k % len(styles)], marker="o", markersize=3,
                    label=f"{scheme} T={t:g}",
                )  # fmt: skip
        ax.axhline(90, color="grey", linewidth=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["lengths"], [str(n) for n in s["lengths"]])
        ax.set_xlabel("tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('verdict "watermarked" (p < 1e-6), %  (BiMark: own p)')
    axes[1].legend(fontsize=7, ncol=3, loc="upper left")
    fig.suptitle(f"{s['texts']} chat answers per point, ± 1 SE")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report(result), encoding="utf-8")
    plot(result, out / "grid.png")


README_CELLS = ((0.7, 64), (0.7, 128), (0.7, 256), (1.0, 64), (1.0, 128))


def readme_table(result: dict[str, Any]) -> str:
    """The README's table of what a chat answer gets (tests check the README holds it):
    per scheme, the "watermarked" share with the registry at its large size at a few
    (temperature, length) points, and the median self-PPL at temperature 0.7."""
    s = result["settings"]
    big = f"{s['big_registry']:,}"
    head = " | ".join(f"T {t:g}, {n} t" for t, n in README_CELLS)
    lines = [
        f'| setting ("watermarked" at {big} entries, % ± SE, {s["texts"]} answers) | {head} '
        "| self-PPL at T 0.7 |",
        "|---|" + "---|" * (len(README_CELLS) + 1),
    ]
    ppl = {(q["scheme"], q["temperature"]): q["median_ppl"] for q in result["quality"]}
    for scheme in [*s["presets"], *s["baselines"], "none"]:
        if scheme == "none":
            cells = ["—"] * len(README_CELLS)
            label = "unwatermarked"
        else:
            cells = [
                _pct(c["big"]["watermarked"], c["n"])
                for c in (_cell(result["cells"], scheme, t, n) for t, n in README_CELLS)
            ]
            label = _label(scheme)
        shown = ppl.get((scheme, 0.7))
        quality = f"{shown:.2f}" if shown is not None else "—"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {quality} |")
    return "\n".join(lines) + "\n"


def absence_line(
    result: dict[str, Any],
    scheme: str = "frontier",
    temperature: float = 1.0,
    share: float = 0.5,
    context: int = 2,
) -> int:
    """The scored tokens from which "not_watermarked" means absence
    (:data:`worldcup_core.verdict.MIN_SCORED_TOKENS`): the generated length at which the
    message-free test alone reaches the verdict's level on ``share`` of ``scheme``'s
    answers at ``temperature``, linear between the lengths measured, less the ``context``
    tokens that are never scored (so a text with that many scored tokens is at least as
    long as the measured ones)."""
    cells = sorted(
        (c for c in result["cells"] if c["scheme"] == scheme and c["temperature"] == temperature),
        key=lambda c: c["length"],
    )
    points = [(c["length"], c["small"]["detect_alone"] / c["n"]) for c in cells]
    for (l0, s0), (l1, s1) in zip(points, points[1:], strict=False):
        if s0 < share <= s1:
            return math.ceil(l0 + (share - s0) / (s1 - s0) * (l1 - l0)) - context
    if points and points[0][1] >= share:
        return points[0][0] - context
    raise ValueError(f"{scheme} at T {temperature} never reaches {share:.0%} in the grid")
