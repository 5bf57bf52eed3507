"""``worldcup bench-attack``: the greedy leave-one-word-out removal attack, replayed
through ``/detect/batch`` against a ``full`` key and a ``verdict`` key, with and
without probe budgets (issue 15; the table in SECURITY.md comes from here).

The real app runs in-process (uvicorn on loopback, SQLite in a temporary
directory), with per-tenant rate limits off so that only the probe budgets
stand in the attacker's way. One watermarked text is generated with the
embedded SmolLM2 (or ``--model DIR``); the same tenant and text serve all four
runs (the second server reopens the first one's store with budgets on).

Each round the attacker sends every one-word deletion of its current text in
one batch and keeps one of them:

* ``full`` key: the deletion with the highest p-value; it stops once the
  answer says ``is_watermarked: false`` (p >= 0.01);
* ``verdict`` key: the answers are three words, so all of them read
  ``watermarked`` until the last step; it keeps a random deletion, and stops
  once any answer is not ``watermarked``.

Both stop when every query of a round was refused (probe budget), or after
``max_queries`` queries. The final text is then scored by the admin's
``/provenance`` (unmetered): "survived" means p < 0.01 there. The tenant's
keys share one probe budget per text, so with budgets on the ``verdict`` run
starts where the ``full`` run left that budget.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worldcup_cli.benchlib import Progress, Server, free_socket, wait_ready

if TYPE_CHECKING:
    from app.core.config import Settings


PROMPT = (
    "Write a short news report about a storm that hit a small fishing town, "
    "with quotes from residents."
)
SIGNIFICANCE = 0.01


def _settings(
    tmp: Path, master: str, admin: str, port: int, model: str | None, budgets: bool
) -> Settings:
    from pydantic import SecretStr

    from app.core.config import Environment, Settings

    off = {"probe_budget_full": 0, "probe_budget_verdict": 0}
    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        env=Environment.PROD,
        model_path=model,
        sqlite_path=tmp / "attack.sqlite3",
        redis_url=None,
        master_key=SecretStr(master),
        master_key_file=None,
        admin_token=SecretStr(admin),
        admin_token_file=None,
        port=port,
        log_level="WARNING",
        rate_limit_per_s=0,  # only the probe budgets limit the attacker
        request_timeout_s=3600.0,  # one 256-token generation on a busy CPU can take minutes
        **({} if budgets else off),
    )


async def _attack(
    client: Any, auth: dict[str, str], text: str, detail: str, max_queries: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    words = text.split()
    queries = refused = deleted = rounds = 0
    outcome = "query cap"
    while queries < max_queries and len(words) > 1:
        rounds += 1
        variants = [" ".join(words[:i] + words[i + 1 :]) for i in range(len(words))]
        variants = variants[: max_queries - queries]
        r = await client.post("/detect/batch", json={"texts": variants}, headers=auth)
        r.raise_for_status()
        items = r.json()["results"]
        queries += len(variants)
        answered = [(i, it["result"]) for i, it in enumerate(items) if it["result"] is not None]
        refused += len(items) - len(answered)
        if not answered:
            outcome = "blocked by probe budget"
            break
        if detail == "full":
            best, result = max(answered, key=lambda a: a[1]["p_value"])
            words.pop(best)
            deleted += 1
            if not result["is_watermarked"]:
                outcome = "oracle says removed"
                break
        else:
            flipped = [i for i, res in answered if res["verdict"] != "watermarked"]
            if flipped:
                words.pop(flipped[0])
                deleted += 1
                outcome = "oracle says removed"
                break
            words.pop(rng.choice(answered)[0])
            deleted += 1
    return {
        "queries": queries,
        "refused": refused,
        "rounds": rounds,
        "words_deleted": deleted,
        "outcome": outcome,
        "final_text": " ".join(words),
    }


async def _new_key(
    client: Any, admin: dict[str, str], tenant_id: str, detail: str
) -> dict[str, str]:
    r = await client.post(
        f"/admin/tenants/{tenant_id}/api-keys",
        json={"name": f"attack {detail}", "scopes": ["detect"], "detail": detail},
        headers=admin,
    )
    r.raise_for_status()
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


async def _score(client: Any, admin: dict[str, str], text: str) -> float:
    """The judge: the admin's /provenance, unmetered (the tenant's probe budget, shared
    by all its keys, may be spent by the attack). One tenant with one key version is
    searched, so its p-value is the tenant key's own."""
    r = await client.post("/provenance", json={"text": text}, headers=admin)
    r.raise_for_status()
    return float(r.json()["p_value"])


async def _phase(
    server: Server,
    base_url: str,
    admin_token: str,
    state: dict[str, Any],
    budgets: bool,
    max_queries: int,
    progress: Progress,
) -> list[dict[str, Any]]:
    import httpx

    admin = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await wait_ready(client, server, timeout_s=600)
        if "tenant_id" not in state:
            r = await client.post("/admin/tenants", json={"name": "attacked"}, headers=admin)
            r.raise_for_status()
            state["tenant_id"] = r.json()["tenant_id"]
            gen_key = {"Authorization": f"Bearer {r.json()['api_key']}"}
            progress("generating the watermarked text")
            r = await client.post(
                "/generate",
                json={
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_new_tokens": 256,
                    "min_new_tokens": 200,
                    "no_repeat_ngram_size": 4,
                    "seed": 1,
                    "metadata": {"purpose": "attack benchmark"},
                },
                headers=gen_key,
            )
            r.raise_for_status()
            state["text"] = r.json()["text"]
            state["model"] = (await client.get("/version")).json()["model_id"]
        tenant_id, text = state["tenant_id"], state["text"]
        rows = []
        for detail in ("full", "verdict"):
            label = f"{detail} key, {'with' if budgets else 'without'} budgets"
            progress(f"attack: {label}")
            auth = await _new_key(client, admin, tenant_id, detail)
            started = time.perf_counter()
            run = await _attack(client, auth, text, detail, max_queries, seed=1)
            run["seconds"] = round(time.perf_counter() - started, 1)
            p_final = await _score(client, admin, run.pop("final_text"))
            rows.append(
                {
                    "key": detail,
                    "budgets": budgets,
                    **run,
                    "final_p_value": p_final,
                    "survived": p_final < SIGNIFICANCE,
                }
            )
        if not budgets:
            state["initial_p_value"] = await _score(client, admin, text)
    return rows


def run_attack_bench(
    *, model: str | None = None, max_queries: int = 6000, progress: Progress | None = None
) -> dict[str, Any]:
    """Both phases (budgets off, then on) on one store; a dict of figures."""
    from app.main import create_app

    say = progress or (lambda _msg: None)
    state: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="worldcup-attack-") as tmp:
        master, admin = secrets.token_hex(32), secrets.token_urlsafe(32)
        for budgets in (False, True):
            sock = free_socket()
            port = sock.getsockname()[1]
            settings = _settings(Path(tmp), master, admin, port, model, budgets)
            server = Server(create_app(settings), sock)
            server.start()
            try:
                rows += asyncio.run(
                    _phase(
                        server,
                        f"http://127.0.0.1:{port}",
                        admin,
                        state,
                        budgets,
                        max_queries,
                        say,
                    )
                )
            finally:
                server.stop()
                sock.close()
            budgets_used = {
                "full": settings.probe_budget_full,
                "verdict": settings.probe_budget_verdict,
                "window_s": settings.probe_window_s,
            }
    return {
        "model": state.get("model"),
        "text_words": len(state["text"].split()),
        "initial_p_value": state["initial_p_value"],
        "max_queries": max_queries,
        "budgets": budgets_used,
        "runs": rows,
    }


def format_attack_bench(result: dict[str, Any]) -> str:
    b = result["budgets"]
    lines = [
        f"model {result['model']}; text of {result['text_words']} words, "
        f"p = {result['initial_p_value']:.2g} before the attack; "
        f"budgets {b['full']} (full) / {b['verdict']} (verdict) per {b['window_s']:g} s",
        "",
        "| key | probe budgets | queries sent | refused | words deleted | stopped because "
        "| p-value after (full detector) | watermark survived |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        pct = 100 * r["words_deleted"] / result["text_words"]
        lines.append(
            f"| {r['key']} | {'on' if r['budgets'] else 'off'} | {r['queries']} | {r['refused']} "
            f"| {r['words_deleted']} ({pct:.1f} %) | {r['outcome']} | {r['final_p_value']:.2g} "
            f"| {'yes' if r['survived'] else 'no'} |"
        )
    return "\n".join(lines)
