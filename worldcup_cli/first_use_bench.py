"""``worldcup bench first-use``: what a new user's chat answers get, through the service.

Chat prompts (``--prompt-set``) are answered by the embedded model under the service
default, at the settings people use (temperature 0.7, 128 new tokens), through
``POST /generate`` with metadata, so every answer is a registry entry. The tenants' texts
then go through
``/detect/batch`` and ``/decode/batch`` (the same verdict as the single routes,
``tests/test_one_verdict.py``) twice: with each tenant's registry at its natural
size (``per_tenant`` entries), and after filling it to ``big_registry`` entries as
``/generate`` fills it (sequential ids in the same table, written in one
transaction). Printed per registry size, with binomial standard errors: the
share of answers whose verdict is "watermarked" (p < 1e-6, every correction), the
share whose registry entry is named, the median p of each test, and the number
of answers that contradict each other.

Prompt sets: ``eli5``, ELI5 questions held out from the tuning of the model-assisted
statistic (``worldcup_eval.model_weights_study``: the committed prompts of
``data/first_use_prompts.txt`` that did not tune it, then the data file's other ELI5
questions that did not; the overlap with the tuning prompts is counted in the result
and is 0 by construction), and ``everyday`` (``data/everyday_prompts.txt``: notes,
emails, how-tos, short explanations, lists, rewrites, short messages).

The same answers are scored under both statistics side by side: the model-assisted
one (the service with the model's token weights, ``detect_with_model``) and the
model-free one (a second app over the same store with ``detect_with_model=False``).
Each answer states the statistic it took; the table counts answers whose statistic is
not the one its app should take.

With ``out_dir`` the store, the tenants and each answer (``answers.jsonl``, appended
as it finishes) are kept there, and a rerun with the same arguments resumes: it
generates only the missing answers, and reuses the measurements already made.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from worldcup_cli.benchlib import RunState, json_plain

PROMPTS = Path(__file__).parent / "data" / "first_use_prompts.txt"
EVERYDAY = Path(__file__).parent / "data" / "everyday_prompts.txt"
STRUCTURED = Path(__file__).parent / "data" / "structured_prompts.json"
PROMPT_SETS = ("eli5", "everyday", "structured")
STATISTICS = ("model", "model_free")
ADMIN_TOKEN = "bench-first-use-admin-token-0123"
MASTER_KEY = "cd" * 32


def component_p(answer: dict[str, Any], test: str) -> float:
    """One test's own p-value from an answer's nested ``tests`` (the smallest, where one
    kind ran at several payload lengths); the benchmarks' tenants hold one key version."""
    ps = [t["p_value"] for t in answer["tests"] if t["test"] == test]
    return min((1.0 if p is None else p) for p in ps) if ps else 1.0


def prompts() -> list[str]:
    return [p for p in PROMPTS.read_text(encoding="utf-8").splitlines() if p.strip()]


def everyday_prompts() -> list[str]:
    return [p for p in EVERYDAY.read_text(encoding="utf-8").splitlines() if p.strip()]


def structured_formats() -> dict[str, dict[str, Any]]:
    """The structured set's requests: prompt -> the ``response_format`` it is answered
    under (JSON under a schema, compiled by the service's grammar engine)."""
    data = json.loads(STRUCTURED.read_text(encoding="utf-8"))
    return {
        r["prompt"]: {
            "type": "json_schema",
            "json_schema": {"name": r["schema"], "schema": data["schemas"][r["schema"]]},
        }
        for r in data["requests"]
    }


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def prompt_set(name: str, count: int) -> tuple[list[str], dict[str, Any]]:
    """The first ``count`` prompts of a set, and how they stand against the prompts that
    tuned the model-assisted statistic (``overlap``: among those chosen, always 0;
    ``excluded``: tuning prompts of the committed file left out)."""
    from worldcup_eval.model_weights_study import prompts as study_prompts
    from worldcup_eval.model_weights_study import tuning_prompts

    tuning = {_norm(p) for p in tuning_prompts()}
    if name == "eli5":
        # the committed prompts first, then the other ELI5 questions (the study's order)
        pool = study_prompts()
    elif name == "everyday":
        pool = everyday_prompts()
    elif name == "structured":
        pool = list(structured_formats())
    else:
        raise ValueError(f"prompt set: one of {', '.join(PROMPT_SETS)}, got {name!r}")
    chosen = [p for p in pool if _norm(p) not in tuning][:count]
    info = {
        "prompt_set": name,
        "tuning_prompts": len(tuning),
        "excluded": sum(_norm(p) in tuning for p in prompts()) if name == "eli5" else 0,
        "overlap": sum(_norm(p) in tuning for p in chosen),
        "from_committed_file": sum(
            _norm(p) in {_norm(q) for q in (prompts() if name == "eli5" else pool)} for p in chosen
        ),
    }
    return chosen, info


def _share(hits: int, n: int) -> str:
    rate = hits / n if n else 0.0
    se = math.sqrt(rate * (1 - rate) / n) if n else 0.0
    return f"{hits}/{n} ({100 * rate:.0f} % ± {100 * se:.0f})"


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2g}" if values else "-"


def measure(client: Any, tenants: list[dict[str, Any]]) -> dict[str, Any]:
    """Every answer through the bulk routes; the table's row values."""
    rows = []
    for t in tenants:
        texts = [g["text"] for g in t["generated"]]
        det = client.post("/detect/batch", json={"texts": texts}, headers=t["auth"]).json()
        dec = client.post("/decode/batch", json={"texts": texts}, headers=t["auth"]).json()
        for g, d, c in zip(t["generated"], det["results"], dec["results"], strict=True):
            if d["result"] is None or c["result"] is None:  # this text failed its own item
                error = d["error"] or c["error"]
                rows.append(
                    {
                        "verdict": "error",
                        "error": error["code"],
                        "statistic": None,
                        "took": None,
                        "verdict_p": 1.0,
                        "detect_p": 1.0,
                        "decode_p": 1.0,
                        "named": False,
                        "bits": None,
                        "contradiction": False,
                    }
                )
                continue
            d, c = d["result"], c["result"]
            match = c["registry_match"]
            rows.append(
                {
                    "verdict": d["verdict"],
                    "statistic": d["verdict_statistic"],
                    "took": d.get("statistic"),
                    "verdict_p": d["p_value"],
                    "detect_p": component_p(d, "detect"),
                    "decode_p": component_p(c, "decode"),
                    "named": match is not None and match["message_id"] == g["message_id"],
                    "bits": c["bits"],
                    "contradiction": d["verdict"] != c["verdict"]
                    or d["is_watermarked"] != (d["verdict"] == "watermarked")
                    or (match is not None and c["verdict"] != "watermarked"),
                }
            )
    n = len(rows)
    return {
        "texts": n,
        "watermarked": sum(r["verdict"] == "watermarked" for r in rows),
        "inconclusive": sum(r["verdict"] == "inconclusive" for r in rows),
        "named": sum(r["named"] for r in rows),
        "errors": sum(r["verdict"] == "error" for r in rows),
        "contradictions": sum(r["contradiction"] for r in rows),
        "median_verdict_p": statistics.median(r["verdict_p"] for r in rows),
        "median_detect_p": statistics.median(r["detect_p"] for r in rows),
        "median_decode_p": statistics.median(r["decode_p"] for r in rows),
        "deciding": {
            s: sum(r["statistic"] == s for r in rows) for s in ("detect", "decode", "registry")
        },
        "took": {s: sum(r["took"] == s for r in rows) for s in STATISTICS},
        "rows": rows,
    }


def compare_statistics(client: Any, db: Path, tenants: list[dict[str, Any]]) -> dict[str, Any]:
    """On the same answers: the unweighted detection statistic against the layer-weighted
    one (:mod:`worldcup_core.detector_weighted`), message-free and at 32 bits, under each
    answer's own key (read from the store as a scan does)."""
    import numpy as np

    from worldcup_core.detector_weighted import verdict_log_p, weighted_applies
    from worldcup_scan.keys import StoreSession, open_store

    session = StoreSession(open_store(str(db)), bytes.fromhex(MASTER_KEY))
    try:
        keys = {k.tenant_id: k.worldcup() for k in session.load_keys().keys}
    finally:
        session.close()
    tokenizer = client.app.state.runtime.tokenizer
    out: dict[str, list[float]] = {
        "detect": [],
        "detect_weighted": [],
        "decode": [],
        "decode_weighted": [],
    }
    for t in tenants:
        scheme = keys[t["id"]]
        ids = [tokenizer(g["text"], add_special_tokens=False).input_ids for g in t["generated"]]
        for bits, name in ((None, "detect"), (32, "decode")):
            out[name] += [r.log10_p_value for r in scheme.detect_many(ids, bits)]
            if weighted_applies(scheme.config):
                out[f"{name}_weighted"] += list(verdict_log_p(scheme, ids, bits) / np.log(10.0))
    return {
        name: {
            "median_p": 10.0 ** statistics.median(values),
            "below_1e-6": sum(v < -6 for v in values),
            "below_1e-3": sum(v < -3 for v in values),
        }
        for name, values in out.items()
        if values
    }


def fill_registry(db: Path, tenant_id: str, version: int, num_bits: int, upto: int) -> int:
    """Fill a tenant's registry to ``upto`` entries as /generate does (ids max+1, ...)."""
    from app.stores.sqlite_registry import _count

    with sqlite3.connect(db) as c:
        (top,) = c.execute(
            "SELECT COALESCE(MAX(message_id), 0) FROM messages WHERE tenant_id = ?", (tenant_id,)
        ).fetchone()
        now = time.time()
        c.executemany(
            "INSERT INTO messages (tenant_id, message_id, key_version, num_bits, metadata,"
            " issued_at) VALUES (?, ?, ?, ?, ?, ?)",
            (
                (tenant_id, i, version, num_bits, '{"filled":true}', now)
                for i in range(top + 1, upto + 1)
            ),
        )
        # and the registry's counters, in the same transaction, as the store moves them
        # (the Bonferroni count of the registry test: app.stores.sqlite_registry._count)
        _count(c, tenant_id, version, num_bits, max(upto - top, 0))
        return int(upto - top)


def bench_settings(db: Path, **overrides: Any) -> Any:
    """The service's settings for a benchmark: the default preset unless ``overrides``
    name another, an SQLite store at ``db``, no Redis, the CPU."""
    from pydantic import SecretStr

    from app.core.config import Settings

    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        master_key=SecretStr(MASTER_KEY),
        admin_token=SecretStr(ADMIN_TOKEN),
        redis_url=None,
        sqlite_path=db,
        device="cpu",
        log_level="WARNING",
        # a benchmark measures answers, not the deadline: a loaded machine must not
        # turn a slow generation into a failed run
        request_timeout_s=3600.0,
        # nor is it probing: answers of one template (JSON under one schema) count as one
        # text by containment, and their several measurements would spend its budget
        probe_budget_verdict=0,
        probe_budget_full=0,
        **overrides,
    )


def make_tenants(
    client: Any, chosen: list[str], per_tenant: int, name: str = "first-use"
) -> list[dict[str, Any]]:
    """One tenant per ``per_tenant`` prompts (its registry holds their answers)."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    tenants = []
    for i in range(0, len(chosen), per_tenant):
        # bit accuracy needs the issued and decoded bits: an analyst's key (provenance)
        body = {"name": f"{name}-{i}", "scopes": ["provenance"]}
        r = client.post("/admin/tenants", json=body, headers=admin)
        body = r.json()
        if "api_key" not in body:
            raise RuntimeError(f"/admin/tenants failed: {r.status_code} {r.text[:200]}")
        auth = {"Authorization": f"Bearer {body['api_key']}"}
        tenants.append(
            {"id": body["tenant_id"], "auth": auth, "prompts": chosen[i : i + per_tenant]}
        )
    return tenants


def generate_answers(
    client: Any,
    tenants: list[dict[str, Any]],
    max_new_tokens: int,
    temperature: float,
    concurrency: int = 8,
    done: Callable[[int, int], None] | None = None,
    cached: dict[tuple[str, int], dict[str, Any]] | None = None,
    record: Callable[[str, int, dict[str, Any]], None] | None = None,
    formats: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Each tenant's prompts answered through ``POST /generate`` (chat messages, seed =
    the prompt's place in its tenant, plus ``tenant["seed_base"][j]`` where given;
    metadata: every answer is a registry entry, with
    ``tenant["metadata"]`` where given); the
    answers land in ``tenant["generated"]`` and are returned in order. ``done(i, n)``
    is called as answers finish, ``record(tenant id, j, answer)`` with each new answer;
    answers in ``cached`` (by tenant id and j) are not generated again. A prompt in
    ``formats`` is answered through ``POST /v1/chat/completions`` under that
    ``response_format`` instead, as an OpenAI client asks for JSON."""
    finished = 0
    lock = threading.Lock()
    cached = cached or {}

    def generate(job: tuple[dict[str, Any], int, str]) -> dict[str, Any]:
        nonlocal finished
        tenant, j, prompt = job
        if (tenant["id"], j) in cached:
            return cached[(tenant["id"], j)]
        messages = [{"role": "user", "content": prompt}]
        metadata = {**tenant.get("metadata", {}), "prompt": j}
        if formats is not None and prompt in formats:
            answer = _structured_answer(
                client, tenant, messages, metadata, formats[prompt], max_new_tokens, temperature, j
            )
        else:
            body = {
                "messages": messages,
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "seed": j + tenant.get("seed_base", [0] * (j + 1))[j],
                "metadata": metadata,
            }
            r = client.post("/generate", json=body, headers=tenant["auth"])
            out = r.json()
            if r.status_code != 200:
                raise RuntimeError(f"/generate failed: {r.status_code} {r.text[:200]}")
            answer = {
                "text": out["text"],
                "message_id": out["message_id"],
                "tokens": out["num_tokens"],
                "finish_reason": out["finish_reason"],
                "payload": out["payload"]["bits"],
            }
        with lock:
            finished += 1
            if record is not None:
                record(tenant["id"], j, answer)
            if done is not None:
                done(finished, len(jobs) - len(cached))
        return answer

    jobs = [(t, j, p) for t in tenants for j, p in enumerate(t["prompts"])]
    with ThreadPoolExecutor(concurrency) as pool:
        made = list(pool.map(generate, jobs))
    for (t, _, _), g in zip(jobs, made, strict=True):
        t.setdefault("generated", []).append(g)
    return made


def _structured_answer(
    client: Any,
    tenant: dict[str, Any],
    messages: list[dict[str, str]],
    metadata: dict[str, Any],
    response_format: dict[str, Any],
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> dict[str, Any]:
    """One JSON answer under its schema, as an OpenAI client asks for it; ``json_valid``:
    whether the text parses and satisfies the schema."""
    import jsonschema

    models = client.get("/v1/models", headers=tenant["auth"]).json()["data"]
    body = {
        "model": models[0]["id"],  # the one the service serves
        "messages": messages,
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "response_format": response_format,
        "watermark": {"metadata": metadata},
    }
    r = client.post("/v1/chat/completions", json=body, headers=tenant["auth"])
    out = r.json()
    if r.status_code != 200:
        raise RuntimeError(f"/v1/chat/completions failed: {r.status_code} {r.text[:200]}")
    choice = out["choices"][0]
    text = choice["message"]["content"]
    try:
        jsonschema.validate(json.loads(text), response_format["json_schema"]["schema"])
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {
        "text": text,
        "message_id": choice["watermark"]["message_id"],
        "tokens": out["usage"]["completion_tokens"],
        "finish_reason": choice["finish_reason"],
        "payload": choice["watermark"]["payload_bits"],
        "json_valid": valid,
    }


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def run(
    count: int = 100,
    per_tenant: int = 20,
    max_new_tokens: int = 128,
    temperature: float = 0.7,
    big_registry: int = 100_000,
    concurrency: int = 8,
    progress: Callable[[str], None] = _log,
    prompt_set_name: str = "eli5",
    out_dir: Path | None = None,
    generate: bool = True,
    **settings_overrides: Any,
) -> dict[str, Any]:
    """Generate (or resume), then measure under both statistics at both registry sizes
    (``settings_overrides``: for the service's settings, e.g. another model). With
    ``generate`` false, only the answers already kept under ``out_dir`` are measured."""
    chosen, info = prompt_set(prompt_set_name, count)
    with tempfile.TemporaryDirectory() as tmp:  # the store, where no out_dir keeps it
        where = Path(tmp) if out_dir is None else out_dir
        return _run(
            chosen,
            info,
            per_tenant,
            max_new_tokens,
            temperature,
            big_registry,
            concurrency,
            progress,
            where,
            generate,
            settings_overrides,
        )


def _run(
    chosen: list[str],
    info: dict[str, Any],
    per_tenant: int,
    max_new_tokens: int,
    temperature: float,
    big_registry: int,
    concurrency: int,
    progress: Callable[[str], None],
    out_dir: Path,
    generate: bool,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    from contextlib import ExitStack

    from fastapi.testclient import TestClient

    from app.main import create_app

    signature = {
        "prompts": chosen,
        "per_tenant": per_tenant,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "big_registry": big_registry,
    }
    state = RunState(out_dir, signature, owner="tenant")
    db = out_dir / "db.sqlite3"
    settings = {
        s: bench_settings(db, detect_with_model=s == "model", **overrides) for s in STATISTICS
    }
    with ExitStack() as stack:
        clients = {
            s: stack.enter_context(
                TestClient(create_app(settings[s]), raise_server_exceptions=False)
            )
            for s in STATISTICS
        }
        client = clients["model"]
        if "tenants" in state.state:
            tenants = [
                {k: v for k, v in t.items() if k != "generated"} for t in state.state["tenants"]
            ]
        else:
            tenants = make_tenants(client, chosen, per_tenant)
            state.state["tenants"] = [dict(t) for t in tenants]
            state.save()
        cached = state.answers()
        if cached and generate and state.state.get("filled") is None:
            progress(f"resuming: {len(cached)} answers already generated")
        started = time.perf_counter()

        def done(i: int, n: int) -> None:
            elapsed = time.perf_counter() - started
            progress(f"generated {i}/{n} answers ({elapsed:.0f} s)")

        if state.state.get("filled"):
            missing = [
                (t["id"], j)
                for t in tenants
                for j in range(len(t["prompts"]))
                if (t["id"], j) not in cached
            ]
            if missing and generate:
                raise RuntimeError(f"{out_dir}: registries filled with answers missing")
        if generate and not state.state.get("filled"):
            made = generate_answers(
                client,
                tenants,
                max_new_tokens,
                temperature,
                concurrency,
                done,
                cached,
                state.record,
                structured_formats() if info["prompt_set"] == "structured" else None,
            )
        else:  # the answers kept (a run stopped early is measured on those: n says how many)
            made = []
            for t in tenants:
                kept = [j for j in range(len(t["prompts"])) if (t["id"], j) in cached]
                t["prompts"] = [t["prompts"][j] for j in kept]
                t["generated"] = [cached[(t["id"], j)] for j in kept]
                made += t["generated"]
            tenants = [t for t in tenants if t["generated"]]
            if not made:
                raise RuntimeError(f"{out_dir}: no answers kept to measure")
            progress(f"measuring the {len(made)} answers kept in {out_dir}")
        seconds = time.perf_counter() - started
        progress(f"generated {len(made)} answers in {seconds:.0f} s")
        measured: dict[str, Any] = state.state.setdefault("measured", {})
        if "statistics" not in measured:
            measured["statistics"] = compare_statistics(client, db, tenants)
            state.save()
        if state.state.get("filled") is None:
            for s in STATISTICS:
                if f"small:{s}" not in measured:
                    measured[f"small:{s}"] = measure(clients[s], tenants)
                    state.save()
                    progress(f"measured at {per_tenant} entries per tenant ({s})")
            key_version = 1
            num_bits = settings["model"].default_num_bits
            for t in tenants:
                fill_registry(db, t["id"], key_version, num_bits, big_registry)
            state.state["filled"] = big_registry
            state.save()
            progress(f"filled every registry to {big_registry} entries")
        for s in STATISTICS:
            if f"big:{s}" not in measured:
                measured[f"big:{s}"] = measure(clients[s], tenants)
                state.save()
                progress(f"measured at {big_registry} entries per tenant ({s})")
    result = {
        **info,
        "texts": len(made),
        "median_tokens": statistics.median(g["tokens"] for g in made),
        **(
            {"json_valid": sum(bool(g.get("json_valid")) for g in made)}
            if info["prompt_set"] == "structured"
            else {}
        ),
        "generate_seconds": round(seconds, 1),
        "settings": {
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "per_tenant": per_tenant,
        },
        **{f"{size}:{s}": measured[f"{size}:{s}"] for size in ("small", "big") for s in STATISTICS},
        "statistics": measured["statistics"],
        "big_registry": big_registry,
        "prompts": [p for t in tenants for p in t["prompts"]],
        "answers": made,
    }
    return dict(json.loads(json.dumps(result, default=json_plain)))


COLUMNS = ("small:model", "small:model_free", "big:model", "big:model_free")


def table(result: dict[str, Any]) -> str:
    n = result["texts"]
    cols = [result[c] for c in COLUMNS]
    head = (
        f"{n} chat answers, prompt set {result['prompt_set']} (overlap with the "
        f"statistic's {result['tuning_prompts']} tuning prompts: {result['overlap']}; "
        f"{result['excluded']} tuning prompts of the committed file left out), median "
        f"{result['median_tokens']} tokens, temperature {result['settings']['temperature']}, "
        f"{result['settings']['max_new_tokens']} new tokens, service default; the same "
        "answers under both statistics; ± one binomial SE\n"
    )
    if "json_valid" in result:
        head += (
            f"JSON answers under a schema (response_format json_schema, /v1/chat/completions):"
            f" {result['json_valid']}/{n} parse and satisfy their schema\n"
        )
    small = f"{result['settings']['per_tenant']} entries"
    big = f"{result['big_registry']} entries"
    lines = [
        f"| measured | {small}: model | {small}: model-free | {big}: model | {big}: model-free |",
        "|---|---|---|---|---|",
    ]
    for label, key in (
        ('verdict "watermarked" (p < 1e-6, every correction)', "watermarked"),
        ('verdict "inconclusive"', "inconclusive"),
        ("/decode names the issued registry entry", "named"),
    ):
        lines.append(f"| {label} | " + " | ".join(_share(c[key], n) for c in cols) + " |")
    for label, key in (
        ("median verdict p", "median_verdict_p"),
        ("median /detect p (message-free)", "median_detect_p"),
        ("median /decode p (length known)", "median_decode_p"),
    ):
        lines.append(f"| {label} | " + " | ".join(f"{c[key]:.2g}" for c in cols) + " |")
    lines.append(
        "| deciding test (detect/decode/registry) | "
        + " | ".join(_fmt(c["deciding"]) for c in cols)
        + " |"
    )
    lines.append(
        "| statistic the answers state (model/model_free) | "
        + " | ".join(f"{c['took']['model']}/{c['took']['model_free']}" for c in cols)
        + " |"
    )
    lines.append(
        "| answers that contradict each other | "
        + " | ".join(str(c["contradictions"]) for c in cols)
        + " |"
    )
    lines.append("| errors | " + " | ".join(str(c["errors"]) for c in cols) + " |")
    stats_lines = [
        f"| {name} | median p {v['median_p']:.2g}; p < 1e-3: {v['below_1e-3']}/{n}; "
        f"p < 1e-6: {v['below_1e-6']}/{n} |"
        for name, v in result["statistics"].items()
    ]
    same = (
        "\n\nOn the same answers, each test alone (uncorrected, model-free), unweighted and"
        " layer-weighted:\n"
    )
    return (
        head + "\n".join(lines) + same + "| test | figures |\n|---|---|\n" + "\n".join(stats_lines)
    )


def _fmt(counts: dict[str, int]) -> str:
    return "/".join(str(counts[s]) for s in ("detect", "decode", "registry"))
