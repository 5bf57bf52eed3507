"""``run_eval``: plan the cells, do the missing work, evaluate, write the outputs.

Phases, each with its own progress bar (ETA included) on stderr:

1. **generate** every cell's missing batches (unwatermarked first: every
   scheme's negatives need it), with self-perplexity;
2. **paraphrase** the attacked cells' texts (when the attack is configured);
3. **score** with the second model (when ``scorer_model`` is set);
4. **evaluate** (model-free; seconds to minutes) and write ``results.json``,
   ``per_text.jsonl``, ``report.md`` and the PNG plots under ``out``.

A rerun redoes only what is missing from the cache. With ``report_only``
nothing is generated: cells whose batches are not all cached are left out,
and the outputs say PARTIAL and list them. Every number in the outputs is a
function of the config and the seed, except what sits under ``timing`` and
``environment`` keys (wall-clock measurements, versions, the command).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from worldcup_core.models import LoadedModel
from worldcup_eval.cache import BatchCache, write_text_atomic
from worldcup_eval.config import ABLATION_BASE, EvalConfig
from worldcup_eval.data import EvalData, default_data_dir, load_data
from worldcup_eval.evaluate import Evaluator
from worldcup_eval.runner import (
    GenCell,
    Job,
    gen_cell_key,
    gen_jobs,
    model_fingerprint,
    paraphrase_jobs,
    scorer_jobs,
)
from worldcup_eval.seeding import eval_key

RESULTS_SCHEMA = "worldcup-eval-results-v1"


@dataclass
class Plan:
    """Which cells exist and at which lengths each is evaluated."""

    unwatermarked: GenCell
    main: list[GenCell]
    ablation: list[GenCell]  # the base configuration first, then the ablations
    attacked: list[GenCell]
    lengths: dict[GenCell, list[int]] = field(default_factory=dict)

    @property
    def generated(self) -> list[GenCell]:
        out: list[GenCell] = []
        for c in [self.unwatermarked, *self.main, *self.ablation, *self.attacked]:
            if c not in out:
                out.append(c)
        return out


def make_plan(cfg: EvalConfig) -> Plan:
    unwm = GenCell(cfg.spec("unwatermarked"), None)
    marked = [s for s in cfg.schemes if s != "unwatermarked"]
    main = [GenCell(cfg.spec(s), b) for s in marked for b in cfg.bits]
    ablation: list[GenCell] = []
    if cfg.ablations and cfg.ablation_lengths:
        for b in cfg.ablation_bits:
            ablation.append(GenCell(cfg.spec(ABLATION_BASE), b))
            ablation += [GenCell(cfg.spec(s), b) for s in cfg.ablation_schemes]
    attacked = (
        [GenCell(cfg.spec(s), b) for s in marked for b in cfg.attacked_bits] if cfg.attacks else []
    )
    plan = Plan(unwm, main, ablation, attacked)
    plan.lengths[unwm] = sorted(cfg.lengths)
    for c in main:
        plan.lengths[c] = sorted(cfg.lengths)
    for c in ablation:
        plan.lengths[c] = sorted(set(plan.lengths.get(c, [])) | set(cfg.ablation_lengths))
    return plan


# --------------------------------------------------------------------------- progress


class Reporter:
    """Progress bars with ETA on stderr (rich), or silence."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._console: Any = None
        if enabled:
            from rich.console import Console

            self._console = Console(stderr=True)

    def say(self, message: str) -> None:
        if self._console is not None:
            self._console.print(message, highlight=False)

    @contextmanager
    def bar(self, description: str, total: int) -> Iterator[Callable[[str], None]]:
        """Yields ``advance(label)``; the bar shows done/total, elapsed and remaining time."""
        if self._console is None or total == 0:
            yield lambda label: None
            return
        if not self._console.is_terminal:  # a log file: one line per step, with the ETA
            start, done = time.perf_counter(), 0

            def log(label: str) -> None:
                nonlocal done
                done += 1
                elapsed = time.perf_counter() - start
                eta = elapsed / done * (total - done)
                self.say(
                    f"{description} {done}/{total}  elapsed {_clock(elapsed)}  "
                    f"ETA {_clock(eta)}  {label}"
                )

            yield log
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[label]}"),
            console=self._console,
        ) as progress:
            task = progress.add_task(description, total=total, label="")

            def advance(label: str) -> None:
                progress.update(task, advance=1, label=label)

            yield advance


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def _execute(
    jobs: list[Job], cache: BatchCache, reporter: Reporter, description: str, run_missing: bool
) -> tuple[dict[Path, dict[str, Any]], list[Job]]:
    """Load cached batches, run the missing ones (unless not ``run_missing``)."""
    done: dict[Path, dict[str, Any]] = {}
    todo = []
    for job in jobs:
        data = cache.load(job.path)
        if data is None:
            todo.append(job)
        else:
            done[job.path] = data
    if not run_missing:
        return done, todo
    if todo:
        reporter.say(f"{description}: {len(todo)} batches to run, {len(done)} cached")
    with reporter.bar(description, len(todo)) as advance:
        for job in todo:
            data = job.run()
            cache.store(job.path, data)
            done[job.path] = cache.load(job.path) or data
            advance(job.label)
    return done, []


# --------------------------------------------------------------------------- environment


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def environment(cfg: EvalConfig, command: str, device: str) -> dict[str, Any]:
    from importlib import metadata

    import torch

    versions: dict[str, str | None] = {}
    for pkg in (
        "worldcup",
        "torch",
        "transformers",
        "numpy",
        "scipy",
        "nltk",
        "matplotlib",
        "rich",
    ):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": command,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "versions": versions,
    }


# --------------------------------------------------------------------------- the run


def _rows(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for b in batches for r in b["rows"]), key=lambda r: int(r["index"]))


def run_eval(
    cfg: EvalConfig,
    *,
    model: LoadedModel | None = None,
    scorer: LoadedModel | None = None,
    report_only: bool = False,
    progress: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """Run (or resume) the evaluation ``cfg`` describes; returns what ``results.json`` holds.

    ``model``/``scorer`` override loading ``cfg.model``/``cfg.scorer_model`` (tests
    pass a tiny model this way). The steps: generate, paraphrase, score with the second
    model, evaluate, then timing and outputs; each of the first three runs its jobs
    through the batch cache and lists the cells it could not complete in ``missing``.
    """
    from worldcup_core.models import load_model, load_tokenizer

    started = time.perf_counter()
    reporter = Reporter(progress)
    command = command or shlex.join(["worldcup", *sys.argv[1:]])
    cache = BatchCache(cfg.cache_path)
    if model is None and not report_only:
        reporter.say(f"loading model {cfg.model or 'embedded SmolLM2'} on {cfg.device} ...")
        model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    tokenizer = model.tokenizer if model is not None else load_tokenizer(cfg.model)
    # after loading: a first load converts the embedded model, which writes its config.json
    model_fp = model_fingerprint(cfg.model, cfg.dtype, cfg.device)
    if model is not None:
        model_fp = {**model_fp, "model": model.model_id}

    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()
    data: EvalData = load_data(
        tokenizer, data_dir, cfg.prompts, cfg.datasets, cfg.prompt_tokens, cfg.max_length, cfg.seed
    )
    run = _Run(cfg, make_plan(cfg), cache, reporter, report_only, model_fp, [])
    gen_rows, gen_batches = _generate(run, model, data)
    paraphrases = _paraphrase(run, model, gen_rows)
    if scorer is None and cfg.scorer_model is not None and not report_only:
        reporter.say(f"loading scorer {cfg.scorer_model} ...")
        scorer = load_model(
            cfg.scorer_model, device=cfg.scorer_device or cfg.device, dtype=cfg.dtype
        )
    scorer_lp = _score(run, tokenizer, scorer, data, gen_rows)
    ev = Evaluator(cfg, tokenizer, data, gen_rows, run.plan.unwatermarked, scorer_lp, paraphrases)
    evaluated = _evaluate(run, ev, gen_rows)

    results: dict[str, Any] = {
        "schema": RESULTS_SCHEMA,
        "complete": not run.missing,
        "missing": run.missing,
        "config": cfg.to_dict(),
        "protocol": _protocol(cfg, model_fp, data, scorer),
        **evaluated,
        "timing": _timing(gen_batches),
        "environment": environment(cfg, command, str(model.device) if model else cfg.device),
    }
    out_dir = cfg.out_dir
    results["timing"]["wall_clock_seconds"] = round(time.perf_counter() - started, 1)
    write_outputs(results, ev.per_text, out_dir)
    results["timing"]["wall_clock_seconds"] = round(time.perf_counter() - started, 1)
    write_text_atomic(
        out_dir / "results.json", json.dumps(results, indent=1, sort_keys=True) + "\n"
    )
    missing = run.missing
    reporter.say(
        f"wrote {out_dir}/results.json, report.md and plots "
        f"({'complete' if not missing else 'PARTIAL: ' + str(len(missing)) + ' missing'}, "
        f"{results['timing']['wall_clock_seconds']} s)"
    )
    return results


@dataclass
class _Run:
    """What every step of :func:`run_eval` shares; ``missing`` collects incomplete cells."""

    cfg: EvalConfig
    plan: Plan
    cache: BatchCache
    reporter: Reporter
    report_only: bool
    model_fp: dict[str, Any]
    missing: list[str]


GenRows = dict[GenCell, list[dict[str, Any]]]


def _generate(
    run: _Run, model: LoadedModel | None, data: EvalData
) -> tuple[GenRows, dict[GenCell, list[dict[str, Any]]]]:
    """Step 1: the generations of every cell; (rows by cell, cached batches by cell)."""
    cfg, plan = run.cfg, run.plan
    jobs_by_cell = {
        c: gen_jobs(cfg, model, c, data.prompts, run.cache, run.model_fp) for c in plan.generated
    }
    all_jobs = [j for js in jobs_by_cell.values() for j in js]
    done, _ = _execute(all_jobs, run.cache, run.reporter, "generate", not run.report_only)
    gen_rows: GenRows = {}
    gen_batches: dict[GenCell, list[dict[str, Any]]] = {}
    for c, js in jobs_by_cell.items():
        if all(j.path in done for j in js):
            gen_batches[c] = [done[j.path] for j in js]
            gen_rows[c] = _rows(gen_batches[c])
        else:
            run.missing.append(f"generate {c.label}")
    if plan.unwatermarked not in gen_rows:
        raise RuntimeError("no unwatermarked generations cached: nothing can be evaluated")
    return gen_rows, gen_batches


def _paraphrase(
    run: _Run, model: LoadedModel | None, gen_rows: GenRows
) -> dict[GenCell, dict[int, dict[str, Any]]]:
    """Step 2: the paraphrase attack's rewrites of the attacked cells (when asked for)."""
    cfg = run.cfg
    paraphrases: dict[GenCell, dict[int, dict[str, Any]]] = {}
    if "paraphrase" not in cfg.attacks:
        return paraphrases
    pjobs = {
        c: paraphrase_jobs(
            cfg, model, c, gen_cell_key(cfg, c, run.model_fp), gen_rows[c], run.cache, run.model_fp
        )
        for c in run.plan.attacked
        if c in gen_rows
    }
    for c, rows in _run_keyed(run, pjobs, "paraphrase", lambda c: f"paraphrase {c.label}"):
        paraphrases[c] = {r["index"]: r for r in rows}
    return paraphrases


K = TypeVar("K")


def _run_keyed(
    run: _Run, jobs: dict[K, list[Any]], phase: str, label: Callable[[K], str]
) -> Iterator[tuple[K, list[dict[str, Any]]]]:
    """Run every key's jobs as one phase; yield the rows of each key whose jobs are all
    done, and record the others as missing (``label`` names them in the report)."""
    done, _ = _execute(
        [j for js in jobs.values() for j in js],
        run.cache,
        run.reporter,
        phase,
        not run.report_only,
    )
    for key, js in jobs.items():
        if all(j.path in done for j in js):
            yield key, [r for j in js for r in done[j.path]["rows"]]
        else:
            run.missing.append(label(key))


def _score(
    run: _Run, tokenizer: Any, scorer: LoadedModel | None, data: EvalData, gen_rows: GenRows
) -> dict[tuple[GenCell, int], dict[int, list[float]]]:
    """Step 3: the second scorer's log-probabilities of each cell at each length."""
    cfg = run.cfg
    scorer_lp: dict[tuple[GenCell, int], dict[int, list[float]]] = {}
    if cfg.scorer_model is None and scorer is None:
        return scorer_lp
    scorer_fp = model_fingerprint(cfg.scorer_model, cfg.dtype, cfg.scorer_device or cfg.device)
    if scorer is not None:
        scorer_fp = {**scorer_fp, "model": scorer.model_id}
    sjobs = {
        (c, n): scorer_jobs(
            cfg,
            tokenizer,
            scorer,
            c,
            gen_cell_key(cfg, c, run.model_fp),
            gen_rows[c],
            {p.index: p for p in data.prompts},
            n,
            run.cache,
            scorer_fp,
        )
        for c, lengths in run.plan.lengths.items()
        if c in gen_rows
        for n in lengths
    }
    for cn, rows in _run_keyed(
        run, sjobs, "scorer", lambda cn: f"scorer {cn[0].label} at {cn[1]} tokens"
    ):
        scorer_lp[cn] = {r["index"]: r["logprobs"] for r in rows}
    return scorer_lp


def _evaluate(run: _Run, ev: Evaluator, gen_rows: GenRows) -> dict[str, list[dict[str, Any]]]:
    """Step 4: the main, ablation, curve and robustness results of the cells generated."""
    cfg, plan = run.cfg, run.plan
    computed: dict[tuple[GenCell, int], dict[str, Any]] = {}

    def cell_result(c: GenCell, n: int, role: str) -> dict[str, Any]:
        if (c, n) not in computed:
            computed[(c, n)] = ev.cell(c, n, role)
        return {**computed[(c, n)], "role": role}

    evaluated = [(c, list(cfg.lengths)) for c in [plan.unwatermarked, *plan.main] if c in gen_rows]
    ablated = [c for c in plan.ablation if c in gen_rows]
    attacked = [c for c in plan.attacked if c in gen_rows]
    curve_cells = [c for c in dict.fromkeys([*plan.main, *plan.ablation]) if c in gen_rows]
    attacks = ["none", *cfg.attacks]
    total = sum(len(ls) for _, ls in evaluated) + len(ablated) + len(curve_cells)
    total += len(attacked) * len(attacks)
    out: dict[str, list[dict[str, Any]]] = {
        "main": [],
        "ablation": [],
        "curves": [],
        "robustness": [],
    }
    with run.reporter.bar("evaluate", total) as advance:
        for c, lengths in evaluated:
            for n in lengths:
                out["main"].append(cell_result(c, n, "main"))
                advance(f"{c.label} @ {n}")
        for c in ablated:
            for n in cfg.ablation_lengths:
                out["ablation"].append(cell_result(c, n, "ablation"))
            advance(f"{c.label} ablation")
        for c in curve_cells:
            out["curves"].append(ev.curve(c))
            advance(f"{c.label} curve")
        for c in attacked:
            for a in attacks:
                res = ev.attack(c, a)
                if res is not None:
                    out["robustness"].append(res)
                advance(f"{c.label} {a}")
    return out


def _timing(gen_batches: dict[GenCell, list[dict[str, Any]]]) -> dict[str, Any]:
    """Step 5a: encoding cost per cell (from the cached batches) and compute totals."""
    encoding: list[dict[str, Any]] = []
    for c, bs in gen_batches.items():
        seconds = sum(float(b["seconds"]) for b in bs)
        tokens = sum(int(b["tokens"]) for b in bs)
        encoding.append(
            {
                "scheme": c.spec.name,
                "bits": c.bits,
                "batches": len(bs),
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "ms_per_token": round(1e3 * seconds / max(tokens, 1), 4),
            }
        )
    base = next((e for e in encoding if e["bits"] is None), None)
    for e in encoding:
        if base is not None and base["ms_per_token"] > 0:
            e["relative_to_unwatermarked"] = round(e["ms_per_token"] / base["ms_per_token"], 4)
    compute = {
        "generate_seconds": round(
            sum(float(b["seconds"]) for bs in gen_batches.values() for b in bs), 1
        ),
        "self_ppl_seconds": round(
            sum(float(b.get("ppl_seconds", 0.0)) for bs in gen_batches.values() for b in bs), 1
        ),
    }
    return {"encoding": encoding, "compute": compute}


def _protocol(
    cfg: EvalConfig, model_fp: dict[str, Any], data: EvalData, scorer: LoadedModel | None
) -> dict[str, Any]:
    """Step 5b: what was measured on what (model, key, prompts, pools, registry sizes)."""
    return {
        "model": model_fp,
        "key_id": eval_key(cfg.seed).key_id,
        "generated_length": cfg.max_length,
        "prompts": len(data.prompts),
        "prompts_by_dataset": {
            d: sum(p.dataset == d for p in data.prompts)
            for d in sorted({p.dataset for p in data.prompts})
        },
        "human_pool": {
            str(n): len(data.human_pool(n, cfg.human_texts)) for n in sorted(set(cfg.lengths))
        },
        "registry_size": {
            str(b): min(cfg.registry_size, 2**b)
            for b in sorted(set(cfg.bits) | set(cfg.ablation_bits))
        },
        "scorer": scorer.model_id if scorer is not None else cfg.scorer_model,
    }


def write_outputs(results: dict[str, Any], per_text: list[dict[str, Any]], out_dir: Path) -> None:
    """results.json, per_text.jsonl, report.md and the PNG plots."""
    from worldcup_eval.plots import write_plots
    from worldcup_eval.report import render_report

    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        out_dir / "per_text.jsonl",
        "".join(json.dumps(r, sort_keys=True) + "\n" for r in per_text),
    )
    plots = write_plots(results, out_dir)
    results["plots"] = sorted(p.name for p in plots)
    write_text_atomic(out_dir / "report.md", render_report(results))
