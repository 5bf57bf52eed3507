"""``worldcup bench collection``: many short answers of one user read together (issue #44).

One tenant. ``users`` users (metadata ``user_id``) each get ``per_user`` chat answers from
the embedded model through ``POST /generate`` (the service default, temperature 0.7,
128 new tokens, ``metadata: {"user_id": ...}``: every answer is a registry entry), on
prompts held out from the model-assisted statistic's tuning, alternating the everyday
set (``data/everyday_prompts.txt``) and the ELI5 set (``data/first_use_prompts.txt``
and the data file's other questions). The tenant's registry is then filled to
``registry`` entries spread evenly over ``registry_users`` users (``registry //
registry_users`` entries each, written as ``/generate`` writes them: sequential ids in
one transaction, with the user's ``user_id``); the generated users are among them, their
generated answers being some of their entries.

Each generated user's answers are read together through ``POST /provenance/collection``
with ``group_by: "user_id"``: at their full length, and at their first 64 tokens (the
tokens decoded back to text). Generation is causal and the seed fixes the sampling, so
an answer cut to its first 64 tokens is what the same request would have given with
``max_new_tokens: 64``. The same answers also go one by one through ``/detect/batch``,
the single-answer verdict, for comparison. A control: ``human`` collections of
``per_user`` human ELI5 answers (128 tokens each, from ``/work/shared/data`` through
:func:`worldcup_eval.model_weights_study.human_texts`), read the same way: they should
never be watermarked and never name anybody.

Reported with binomial SE and exact (Clopper-Pearson) 95 % intervals: the joint
"watermarked" rate, the right user named, a wrong user named, the per-text rate, and
the seconds per collection request.

With ``out_dir`` the store, the tenant and the answers (``answers.jsonl``, appended as
they finish) are kept there, and a rerun with the same arguments resumes.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worldcup_cli.benchlib import RunState, json_plain
from worldcup_cli.first_use_bench import (
    ADMIN_TOKEN,
    _log,
    bench_settings,
    generate_answers,
    prompt_set,
)
from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW

FIELD = "user_id"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def user_name(u: int) -> str:
    return f"user-{u:04d}"


def bench_prompts(count: int) -> list[str]:
    """``count`` held-out prompts, alternating the everyday and the ELI5 set; a set that
    runs out starts over (see ``bench_seeds``: a prompt's later rounds get other seeds)."""
    return [prompt for prompt, _ in _bench_plan(count)]


def bench_seeds(count: int) -> list[int]:
    """The seed of each of ``bench_prompts(count)``: 0 in a prompt's first round, then
    ``SEED_ROUND * round``, so that a prompt asked again (another user, the same place among
    the user's answers) is not sampled with the same randomness. A user's seed is its
    answer's place among the user's plus this."""
    return [SEED_ROUND * round_ for _, round_ in _bench_plan(count)]


SEED_ROUND = 1000


def _bench_plan(count: int) -> list[tuple[str, int]]:
    half = (count + 1) // 2
    everyday, _ = prompt_set("everyday", half)
    eli5, _ = prompt_set("eli5", half)
    if not everyday or not eli5:
        raise ValueError("no held-out prompts")
    out: list[tuple[str, int]] = []
    for i in range(half):
        for pool in (everyday, eli5):
            out.append((pool[i % len(pool)], i // len(pool)))
    return out[:count]


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact two-sided binomial interval for k successes in n."""
    from scipy.stats import beta

    if n == 0:
        return 0.0, 1.0
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def share(k: int, n: int) -> dict[str, Any]:
    rate = k / n if n else 0.0
    lo, hi = clopper_pearson(k, n)
    se = math.sqrt(rate * (1 - rate) / n) if n else 0.0
    return {"k": k, "n": n, "rate": rate, "se": se, "ci95": [lo, hi]}


def fmt(s: dict[str, Any]) -> str:
    lo, hi = s["ci95"]
    return (
        f"{s['k']}/{s['n']} ({100 * s['rate']:.0f} % ± {100 * s['se']:.0f}; "
        f"95 % CI {100 * lo:.0f}–{100 * hi:.0f} %)"
    )


def fill_users(
    db: Path, tenant_id: str, version: int, num_bits: int, names: list[str], each: int
) -> int:
    """Each named user's entries topped up to ``each`` (the entries /generate already
    wrote for the user count), as /generate writes them: ids max+1, ..., the user's
    ``user_id`` as metadata, and the registry's counters moved in the same transaction."""
    from app.stores.base import compact_json
    from app.stores.sqlite_registry import _count

    with sqlite3.connect(db) as c:
        (top,) = c.execute(
            "SELECT COALESCE(MAX(message_id), 0) FROM messages WHERE tenant_id = ?", (tenant_id,)
        ).fetchone()
        held: dict[str, int] = {}
        for (meta_text,) in c.execute(
            "SELECT metadata FROM messages WHERE tenant_id = ?", (tenant_id,)
        ):
            name = json.loads(meta_text).get(FIELD)
            held[name] = held.get(name, 0) + 1
        now = time.time()
        rows = []
        next_id = top + 1
        for name in names:
            meta = compact_json({FIELD: name, "filled": True})
            for _ in range(each - held.get(name, 0)):
                rows.append((tenant_id, next_id, version, num_bits, meta, now))
                next_id += 1
        c.executemany(
            "INSERT INTO messages (tenant_id, message_id, key_version, num_bits, metadata,"
            " issued_at) VALUES (?, ?, ?, ?, ?, ?)",
            rows,
        )
        _count(c, tenant_id, version, num_bits, len(rows))
        return len(rows)


def cut(tokenizer: Any, text: str, tokens: int) -> str:
    """The text's first ``tokens`` tokens, decoded back to text."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return str(tokenizer.decode(ids[:tokens], skip_special_tokens=True))


def read_set(client: Any, texts: list[str], right: str | None) -> dict[str, Any]:
    """One collection through the service: its verdict, the user named, the time."""
    started = time.perf_counter()
    r = client.post(
        "/provenance/collection", json={"texts": texts, "group_by": FIELD}, headers=ADMIN
    )
    seconds = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"/provenance/collection failed: {r.status_code} {r.text[:300]}")
    body = r.json()
    group = body["group"] or {}
    named = group.get("value")
    tests = {
        t["test"] if t["num_bits"] is None else f"{t['test']}@{t['num_bits']}": t["p_value"]
        for t in body["tests"]
    }
    detect = tests.get("detect")
    return {
        "user": right,
        "verdict": body["verdict"],
        "p_value": body["p_value"],
        "tests": tests,  # each joint test alone, before the corrections
        # the verdict the message-free joint test alone gives (before it had company)
        "message_free_p": None if detect is None else min(1.0, body["num_keys"] * detect),
        "statistic": body["statistic"],
        "named": named,
        "right": right is not None and named == right,
        "wrong": named is not None and named != right,
        "group_p": group.get("p_value"),
        "values_searched": group.get("values_searched"),
        "entries_searched": group.get("entries_searched"),
        "group_message": group.get("message"),
        "num_units": body["num_units"],
        "num_tokens": body["num_tokens"],
        "per_text": [t["verdict"] for t in body["texts"]],
        "seconds": seconds,
    }


def singles(client: Any, auth: dict[str, str], texts: list[str]) -> list[str]:
    """Each text's own verdict through /detect/batch (the single-answer route)."""
    r = client.post("/detect/batch", json={"texts": texts}, headers=auth)
    if r.status_code != 200:
        raise RuntimeError(f"/detect/batch failed: {r.status_code} {r.text[:300]}")
    return [
        "error" if item["result"] is None else item["result"]["verdict"]
        for item in r.json()["results"]
    ]


def summarize(rows: list[dict[str, Any]], single: list[str]) -> dict[str, Any]:
    n = len(rows)
    secs = [r["seconds"] for r in rows]
    return {
        "collections": n,
        "watermarked": share(sum(r["verdict"] == "watermarked" for r in rows), n),
        "watermarked_message_free_only": share(
            sum((r.get("message_free_p") or 1.0) < VERDICT_WATERMARKED_BELOW for r in rows), n
        ),
        "right_user": share(sum(r["right"] for r in rows), n),
        "wrong_user": share(sum(r["wrong"] for r in rows), n),
        "single_watermarked": share(sum(v == "watermarked" for v in single), len(single)),
        "collection_text_watermarked": share(
            sum(v == "watermarked" for r in rows for v in r["per_text"]),
            sum(len(r["per_text"]) for r in rows),
        ),
        "median_joint_p": statistics.median(r["p_value"] for r in rows) if rows else None,
        "median_tokens": statistics.median(r["num_tokens"] for r in rows) if rows else None,
        "seconds_per_collection": {
            "median": statistics.median(secs) if secs else None,
            "max": max(secs) if secs else None,
        },
        "rows": rows,
    }


def run(
    users: int = 30,
    per_user: int = 5,
    max_new_tokens: int = 128,
    temperature: float = 0.7,
    registry: int = 100_000,
    registry_users: int = 1000,
    human: int = 12,
    short_tokens: int = 64,
    concurrency: int = 8,
    progress: Callable[[str], None] = _log,
    out_dir: Path | None = None,
    generate_only: bool = False,
    **settings_overrides: Any,
) -> dict[str, Any]:
    """Generate (or resume), fill the registry, read the collections."""
    if registry_users < users or registry % registry_users:
        raise ValueError("registry must be a multiple of registry_users, and users among them")
    if registry // registry_users < per_user:
        raise ValueError("each user's entries must hold the user's generated answers")
    if not 0 < short_tokens < max_new_tokens:
        raise ValueError("short_tokens must be below max_new_tokens")
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) if out_dir is None else out_dir
        return _run(
            users,
            per_user,
            max_new_tokens,
            temperature,
            registry,
            registry_users,
            human,
            (max_new_tokens, short_tokens),
            concurrency,
            progress,
            where,
            generate_only,
            settings_overrides,
        )


def _run(
    users: int,
    per_user: int,
    max_new_tokens: int,
    temperature: float,
    registry: int,
    registry_users: int,
    human: int,
    cuts: tuple[int, int],
    concurrency: int,
    progress: Callable[[str], None],
    out_dir: Path,
    generate_only: bool,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from app.main import create_app

    chosen = bench_prompts(users * per_user)
    seeds = bench_seeds(users * per_user)
    # users is not part of the signature: a rerun with more users, before the registry
    # is filled, generates only the new users' answers (user u's prompts do not depend
    # on how many users there are)
    signature = {
        "per_user": per_user,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "registry": registry,
        "registry_users": registry_users,
        "cuts": list(cuts),
    }
    state = RunState(out_dir, signature, owner="user")
    kept = state.state.get("prompts", [])
    if kept[: len(chosen)] != chosen[: len(kept)]:
        raise ValueError(f"{out_dir} holds answers to other prompts; use another --out-dir")
    if state.state.get("filled") is not None and state.state.get("users") != users:
        raise ValueError(
            f"{out_dir}: the registry was filled for {state.state.get('users')} users; "
            f"rerun with --users {state.state.get('users')} or use another --out-dir"
        )
    state.state["users"] = users
    state.state["prompts"] = chosen
    db = out_dir / "db.sqlite3"
    settings = bench_settings(db, **overrides)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        if "tenant" not in state.state:
            # the issued payloads are read back as analysts do (the provenance grant)
            body = {"name": "collection", "scopes": ["provenance"]}
            r = client.post("/admin/tenants", json=body, headers=ADMIN)
            body = r.json()
            if "api_key" not in body:
                raise RuntimeError(f"/admin/tenants failed: {r.status_code} {r.text[:200]}")
            state.state["tenant"] = {
                "id": body["tenant_id"],
                "auth": {"Authorization": f"Bearer {body['api_key']}"},
            }
            state.save()
        tenant = state.state["tenant"]
        cached = state.answers()
        if state.state.get("filled") is None:
            if cached:
                progress(f"resuming: {len(cached)} answers already generated")
            started = time.perf_counter()

            def done(i: int, n: int) -> None:
                progress(f"generated {i}/{n} answers ({time.perf_counter() - started:.0f} s)")

            # one pseudo-tenant per user for generate_answers: the same tenant's key,
            # the user's prompts, the seed = the prompt's place among the user's
            jobs = [
                {
                    "id": user_name(u),
                    "auth": tenant["auth"],
                    "prompts": chosen[u * per_user : (u + 1) * per_user],
                    "seed_base": seeds[u * per_user : (u + 1) * per_user],
                    "metadata": {FIELD: user_name(u)},
                }
                for u in range(users)
            ]
            generate_answers(
                client,
                jobs,
                max_new_tokens,
                temperature,
                concurrency,
                done,
                cached,
                state.record,
            )
            state.state.setdefault("generate_seconds", round(time.perf_counter() - started, 1))
            state.save()
            cached = state.answers()
            if generate_only:
                return {"answers": len(cached)}
            # the registry: registry_users users, registry // registry_users entries each
            # (a user's generated answers are among them; so are those of users beyond
            # ``users`` that a stopped, larger run generated)
            each = registry // registry_users
            names = [user_name(u) for u in range(registry_users)]
            added = fill_users(db, tenant["id"], 1, settings.default_num_bits, names, each)
            state.state["filled"] = registry
            state.save()
            progress(f"filled the registry: {added} entries added, {registry} in all")
        answers = {u: [cached[(user_name(u), j)] for j in range(per_user)] for u in range(users)}
        service: Any = client.app
        tokenizer = service.state.runtime.tokenizer
        measured: dict[str, Any] = state.state.setdefault("measured", {})
        for tokens in cuts:
            key = f"{tokens}"
            if key in measured:
                continue
            rows = measured.setdefault(f"{key}:rows", [])  # kept per collection, resumed
            texts_all: list[str] = []
            for u in range(users):
                texts = [
                    a["text"] if tokens >= max_new_tokens else cut(tokenizer, a["text"], tokens)
                    for a in answers[u]
                ]
                texts_all += texts
                if u < len(rows):
                    continue
                rows.append(read_set(client, texts, user_name(u)))
                state.save()
                progress(
                    f"{tokens} tokens, {user_name(u)}: {rows[-1]['verdict']}, named "
                    f"{rows[-1]['named']}, {rows[-1]['seconds']:.1f} s"
                )
            measured[key] = summarize(rows, singles(client, tenant["auth"], texts_all))
            del measured[f"{key}:rows"]
            state.save()
        if "human" not in measured and human > 0:
            from worldcup_eval.model_weights_study import human_texts

            ids = human_texts(tokenizer, human * per_user, max_new_tokens)
            texts = [tokenizer.decode(t, skip_special_tokens=True) for t in ids]
            rows = []
            for g in range(len(texts) // per_user):
                rows.append(read_set(client, texts[g * per_user : (g + 1) * per_user], None))
                progress(f"human set {g}: {rows[-1]['verdict']}, named {rows[-1]['named']}")
            measured["human"] = summarize(rows, singles(client, tenant["auth"], texts))
            state.save()
    made = [a for u in range(users) for a in answers[u]]
    result = {
        "users": users,
        "per_user": per_user,
        "registry": registry,
        "registry_users": registry_users,
        "settings": {"temperature": temperature, "max_new_tokens": max_new_tokens},
        "median_tokens": statistics.median(a["tokens"] for a in made),
        "generate_seconds": state.state.get("generate_seconds"),
        "cuts": list(cuts),
        **{f"{t}": measured[f"{t}"] for t in cuts},
        **({"human": measured["human"]} if "human" in measured else {}),
        "prompts": chosen,
        "answers": made,
    }
    return dict(json.loads(json.dumps(result, default=json_plain)))


def table(result: dict[str, Any]) -> str:
    n = result["per_user"]
    cols = [(f"{n} × {t} tokens", result[f"{t}"]) for t in result["cuts"]]
    if "human" in result:
        cols.append((f"{n} human texts (control)", result["human"]))
    head = (
        f"{result['users']} users × {result['per_user']} chat answers (median "
        f"{result['median_tokens']} tokens, T {result['settings']['temperature']}), one "
        f"tenant, {result['registry']} entries over {result['registry_users']} users; "
        "± one binomial SE, exact 95 % interval\n"
    )
    lines = [
        "| measured | " + " | ".join(c for c, _ in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for label, key in (
        ('joint verdict "watermarked"', "watermarked"),
        ("... from the message-free joint test alone", "watermarked_message_free_only"),
        ("right user named", "right_user"),
        ("wrong user named", "wrong_user"),
        ('each text alone "watermarked" (/detect/batch)', "single_watermarked"),
    ):
        lines.append(f"| {label} | " + " | ".join(fmt(c[key]) for _, c in cols) + " |")
    lines.append(
        "| median joint p | " + " | ".join(f"{c['median_joint_p']:.2g}" for _, c in cols) + " |"
    )
    lines.append(
        "| seconds per collection (median / max) | "
        + " | ".join(
            "{median:.1f} / {max:.1f}".format(**c["seconds_per_collection"]) for _, c in cols
        )
        + " |"
    )
    return head + "\n".join(lines)
