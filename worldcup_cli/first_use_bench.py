"""``worldcup bench first-use``: what a new user's chat answers get, through the service.

100 committed chat prompts (``data/first_use_prompts.txt``, ELI5 questions) are
answered by the embedded model under the service default, at the settings people
use (temperature 0.7, 128 new tokens), through ``POST /generate`` with metadata,
so every answer is a registry entry. The tenants' texts then go through
``/detect/batch`` and ``/decode/batch`` (the same verdict as the single routes,
``tests/test_one_verdict.py``) twice: with each tenant's registry at its natural
size (``per_tenant`` entries), and after filling it to ``big_registry`` entries as
``/generate`` fills it (sequential ids in the same table, written in one
transaction). Printed per registry size, with binomial standard errors: the
share of answers whose verdict is "watermarked" (p < 1e-6, every correction), the
share whose registry entry is named, the median p of each test, and the number
of answers that contradict each other.
"""

from __future__ import annotations

import math
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROMPTS = Path(__file__).parent / "data" / "first_use_prompts.txt"
ADMIN_TOKEN = "bench-first-use-admin-token-0123"
MASTER_KEY = "cd" * 32


def component_p(answer: dict[str, Any], test: str) -> float:
    """One test's own p-value from an answer's nested ``tests`` (the smallest, where one
    kind ran at several payload lengths); the benchmarks' tenants hold one key version."""
    ps = [t["p_value"] for t in answer["tests"] if t["test"] == test]
    return min((1.0 if p is None else p) for p in ps) if ps else 1.0


def prompts() -> list[str]:
    return [p for p in PROMPTS.read_text(encoding="utf-8").splitlines() if p.strip()]


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
    from app.core.config import Settings

    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        master_key=MASTER_KEY,
        admin_token=ADMIN_TOKEN,
        redis_url=None,
        sqlite_path=db,
        device="cpu",
        log_level="WARNING",
        # a benchmark measures answers, not the deadline: a loaded machine must not
        # turn a slow generation into a failed run
        request_timeout_s=3600.0,
        **overrides,
    )


def make_tenants(
    client: Any, chosen: list[str], per_tenant: int, name: str = "first-use"
) -> list[dict[str, Any]]:
    """One tenant per ``per_tenant`` prompts (its registry holds their answers)."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    tenants = []
    for i in range(0, len(chosen), per_tenant):
        r = client.post("/admin/tenants", json={"name": f"{name}-{i}"}, headers=admin)
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
) -> list[dict[str, Any]]:
    """Each tenant's prompts answered through ``POST /generate`` (chat messages, seed =
    the prompt's place in its tenant, metadata: every answer is a registry entry); the
    answers land in ``tenant["generated"]`` and are returned in order. ``done(i, n)``
    is called as answers finish."""
    finished = 0

    def generate(job: tuple[dict[str, Any], int, str]) -> dict[str, Any]:
        nonlocal finished
        tenant, j, prompt = job
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": j,
            "metadata": {"prompt": j},
        }
        r = client.post("/generate", json=body, headers=tenant["auth"])
        out = r.json()
        if r.status_code != 200:
            raise RuntimeError(f"/generate failed: {r.status_code} {r.text[:200]}")
        finished += 1
        if done is not None:
            done(finished, len(jobs))
        return {
            "text": out["text"],
            "message_id": out["message_id"],
            "tokens": out["num_tokens"],
            "finish_reason": out["finish_reason"],
            "payload": out["payload"]["bits"],
        }

    jobs = [(t, j, p) for t in tenants for j, p in enumerate(t["prompts"])]
    with ThreadPoolExecutor(concurrency) as pool:
        made = list(pool.map(generate, jobs))
    for (t, _, _), g in zip(jobs, made, strict=True):
        t.setdefault("generated", []).append(g)
    return made


def run(
    count: int = 100,
    per_tenant: int = 20,
    max_new_tokens: int = 128,
    temperature: float = 0.7,
    big_registry: int = 100_000,
    concurrency: int = 8,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from app.main import create_app

    chosen = prompts()[:count]
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "db.sqlite3"
        settings = bench_settings(db)
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            tenants = make_tenants(client, chosen, per_tenant)
            started = time.perf_counter()
            made = generate_answers(client, tenants, max_new_tokens, temperature, concurrency)
            seconds = time.perf_counter() - started
            progress(f"generated {len(made)} answers in {seconds:.0f} s")
            statistics_compared = compare_statistics(client, db, tenants)
            small = measure(client, tenants)
            progress(f"measured at {per_tenant} entries per tenant")
            key_version = 1
            num_bits = settings.default_num_bits
            for t in tenants:
                fill_registry(db, t["id"], key_version, num_bits, big_registry)
            progress(f"filled every registry to {big_registry} entries")
            big = measure(client, tenants)
    return {
        "texts": len(made),
        "median_tokens": statistics.median(g["tokens"] for g in made),
        "generate_seconds": round(seconds, 1),
        "settings": {
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "per_tenant": per_tenant,
        },
        "small": small,
        "big": big,
        "statistics": statistics_compared,
        "big_registry": big_registry,
    }


def table(result: dict[str, Any]) -> str:
    small, big = result["small"], result["big"]
    n = result["texts"]
    head = (
        f"{n} chat answers (median {result['median_tokens']} tokens), temperature "
        f"{result['settings']['temperature']}, {result['settings']['max_new_tokens']} new tokens, "
        "service default; ± one binomial SE\n"
    )
    sizes = (
        f"registry {result['settings']['per_tenant']} entries",
        f"registry {result['big_registry']} entries",
    )
    lines = ["| measured | " + " | ".join(sizes) + " |", "|---|---|---|"]
    for label, key in (
        ('verdict "watermarked" (p < 1e-6, every correction)', "watermarked"),
        ('verdict "inconclusive"', "inconclusive"),
        ("/decode names the issued registry entry", "named"),
    ):
        lines.append(f"| {label} | {_share(small[key], n)} | {_share(big[key], n)} |")
    for label, key in (
        ("median verdict p", "median_verdict_p"),
        ("median /detect p (message-free)", "median_detect_p"),
        ("median /decode p (length known)", "median_decode_p"),
    ):
        lines.append(f"| {label} | {small[key]:.2g} | {big[key]:.2g} |")
    deciding = f"{_fmt(small['deciding'])} | {_fmt(big['deciding'])}"
    stats_lines = [
        f"| {name} | median p {v['median_p']:.2g}; p < 1e-3: {v['below_1e-3']}/{n}; "
        f"p < 1e-6: {v['below_1e-6']}/{n} |"
        for name, v in result["statistics"].items()
    ]
    lines.append(f"| deciding test (detect/decode/registry) | {deciding} |")
    lines.append(
        "| answers that contradict each other | "
        f"{small['contradictions']} | {big['contradictions']} |"
    )
    same = (
        "\n\nOn the same answers, each test alone (uncorrected), unweighted and layer-weighted:\n"
    )
    return (
        head + "\n".join(lines) + same + "| test | figures |\n|---|---|\n" + "\n".join(stats_lines)
    )


def _fmt(counts: dict[str, int]) -> str:
    return "/".join(str(counts[s]) for s in ("detect", "decode", "registry"))
