"""``worldcup bench attack``: removal attacks replayed through the API, with and
without probe budgets (issues 15 and 24; the table in SECURITY.md comes from
here).

The real app runs in-process (uvicorn on loopback, SQLite in a temporary
directory), with per-tenant rate limits off so that only the probe budgets
stand in the attacker's way. One watermarked text is generated with the
embedded SmolLM2 (or ``--model DIR``) under one tenant; every strategy attacks
that text with that tenant's keys, first with budgets off, then (a second
server on the same store) with the default budgets. The probe accounts are
cleared before each strategy, so each one starts with a full day's budget.

Strategies (the attacker's keys are ``full`` unless said otherwise; with budgets on,
only a ``full`` key's first ``probe_full_answers`` answers about the text carry a
p-value, the later ones the verdict word, read as a verdict key's are):

* ``greedy``: each round, every one-word deletion of the current text in one
  ``/detect/batch``; keep the one with the highest p; stop once an answer says
  ``is_watermarked: false`` (p >= 0.01);
* ``salted``: the same, with the same three random words appended to every
  query of a round (fresh words each round), so that rounds look like new texts;
* ``halves`` / ``windows``: greedy on each half / each of four disjoint windows
  on its own, the pieces joined at the end;
* ``rank-then-delete``: one leave-one-out round ranks the words by the p their
  deletion gives; then the top 10, 15, 20, 25, 30 or 40 % are deleted at once,
  one query each, until the answer says not watermarked;
* ``greedy, 4 keys``: greedy with each round spread over four keys of the tenant;
* ``greedy via /provenance``: greedy through ``/provenance`` (one text per
  request) with a ``full`` key holding the provenance scope;
* ``greedy, verdict key``: answers are three words, so all read ``watermarked``
  until the last step; it keeps a random deletion.

Every run stops when every query of a step was refused (probe budget) or
after ``max_queries`` queries. The final text (without salt) is scored by the
admin's ``/provenance`` (unmetered): "survived" means p < 0.01 there, and
"watermarked" that the one verdict still says so (p below its line, 1e-6).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worldcup_cli.benchlib import Progress, Server, free_socket, wait_ready
from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW

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

    off = {"probe_budget_full": 0, "probe_budget_verdict": 0, "probe_full_answers": 0}
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


Oracle = Any  # async (texts) -> p-value per text, None where refused


def _oracle(client: Any, auths: list[dict[str, str]], route: str) -> Oracle:
    """Ask about many texts; each round is spread over the keys in turn (one
    ``/detect/batch`` per key, or one ``/provenance`` request per text)."""

    async def ask(texts: list[str]) -> list[float | None]:
        out: list[float | None] = []
        if route == "provenance":
            for i, text in enumerate(texts):
                r = await client.post(
                    "/provenance", json={"text": text}, headers=auths[i % len(auths)]
                )
                if r.status_code == 429:
                    out.append(None)
                    continue
                r.raise_for_status()
                out.append(_p_or_word(r.json()))
            return out
        size = -(-len(texts) // len(auths))
        for k, start in enumerate(range(0, len(texts), size)):
            chunk = texts[start : start + size]
            r = await client.post("/detect/batch", json={"texts": chunk}, headers=auths[k])
            r.raise_for_status()
            for item in r.json()["results"]:
                res = item["result"]
                out.append(None if res is None else _p_or_word(res))
        return out

    return ask


def _p_or_word(answer: dict[str, Any]) -> float:
    """What an answer tells the attacker: its p-value, or, answered as the verdict only
    (a verdict key, or a full key past its text's full answers), whether it still
    reads "watermarked" (0) or not (1)."""
    if "p_value" in answer:
        return float(answer["p_value"])
    return 0.0 if answer["verdict"] == "watermarked" else 1.0


class _Run:
    def __init__(self, max_queries: int) -> None:
        self.max_queries = max_queries
        self.queries = self.answered = 0

    @property
    def left(self) -> int:
        return self.max_queries - self.queries

    async def ask(self, oracle: Oracle, texts: list[str]) -> list[float | None]:
        texts = texts[: self.left]
        answers: list[float | None] = await oracle(texts)
        self.queries += len(texts)
        self.answered += sum(a is not None for a in answers)
        return answers


async def _greedy(
    run: _Run, oracle: Oracle, words: list[str], rng: random.Random, salt: int, verdict: bool
) -> tuple[list[str], str]:
    """Greedy leave-one-out on ``words``: (final words, why it stopped)."""
    words = list(words)
    while run.left > 0 and len(words) > 1:
        extra = [rng.choice(SALT_WORDS) for _ in range(salt)]
        variants = [" ".join(words[:i] + words[i + 1 :] + extra) for i in range(len(words))]
        answers = await run.ask(oracle, variants)
        answered = [(i, p) for i, p in enumerate(answers) if p is not None]
        if not answered:
            return words, "blocked by probe budget"
        if verdict:
            flipped = [i for i, p in answered if p >= SIGNIFICANCE]
            if flipped:
                words.pop(flipped[0])
                return words, "oracle says removed"
            words.pop(rng.choice(answered)[0])
            continue
        best, p = max(answered, key=lambda a: a[1])
        words.pop(best)
        if p >= SIGNIFICANCE:
            return words, "oracle says removed"
    return words, "query cap"


async def _pieces(
    run: _Run, oracle: Oracle, words: list[str], rng: random.Random, count: int
) -> tuple[list[str], str]:
    """Greedy on each of ``count`` disjoint pieces on its own, joined at the end."""
    size = -(-len(words) // count)
    out, why = [], []
    for start in range(0, len(words), size):
        piece, reason = await _greedy(run, oracle, words[start : start + size], rng, 0, False)
        out += piece
        why.append(reason)
    removed = all(w == "oracle says removed" for w in why)
    blocked = any(w == "blocked by probe budget" for w in why)
    reason = (
        "oracle says removed"
        if removed
        else ("blocked by probe budget" if blocked else "query cap")
    )
    return out, reason


async def _rank_then_delete(
    run: _Run, oracle: Oracle, words: list[str], rng: random.Random, budget: int | None
) -> tuple[list[str], str]:
    """One leave-one-out round ranks the words; then delete the top share at once.
    Under a (published) budget the attacker ranks a random sample of words and keeps
    six answers for the deletions."""
    order = list(range(len(words)))
    if budget is not None and budget - 6 < len(words):
        order = sorted(rng.sample(order, max(1, budget - 6)))
    variants = [" ".join(words[:i] + words[i + 1 :]) for i in order]
    answers = dict(zip(order, await run.ask(oracle, variants), strict=False))
    ranked = sorted(
        (i for i, p in answers.items() if p is not None), key=lambda i: -(answers[i] or 0.0)
    )
    if not ranked:
        return words, "blocked by probe budget"
    final = words
    for share in (0.10, 0.15, 0.20, 0.25, 0.30, 0.40):
        if run.left <= 0:
            return final, "query cap"
        drop = set(ranked[: max(1, round(share * len(words)))])
        final = [w for i, w in enumerate(words) if i not in drop]
        (p,) = await run.ask(oracle, [" ".join(final)])
        if p is None:
            return final, "blocked by probe budget"
        if p >= SIGNIFICANCE:
            return final, "oracle says removed"
    return final, "every share tried"


STRATEGIES = (
    "greedy",
    "salted",
    "halves",
    "windows",
    "rank-then-delete",
    "greedy, 4 keys",
    "greedy via /provenance",
    "greedy, verdict key",
)

# salt: ordinary words, so the appended words look like text
SALT_WORDS = (
    "river market window garden silver morning letter station winter yellow paper "
    "bridge little orange quiet forest number simple travel summer engine kitchen"
).split()


async def _new_key(
    client: Any, admin: dict[str, str], tenant_id: str, detail: str, scopes: list[str]
) -> dict[str, str]:
    r = await client.post(
        f"/admin/tenants/{tenant_id}/api-keys",
        json={"name": f"attack {detail}", "scopes": scopes, "detail": detail},
        headers=admin,
    )
    r.raise_for_status()
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


async def _strategy(
    name: str,
    client: Any,
    admin: dict[str, str],
    tenant_id: str,
    text: str,
    max_queries: int,
    budget: int | None,
) -> tuple[_Run, list[str], str]:
    rng = random.Random(1)
    run, words = _Run(max_queries), text.split()
    if name == "greedy, verdict key":
        auth = await _new_key(client, admin, tenant_id, "verdict", ["detect"])
        final, why = await _greedy(run, _oracle(client, [auth], "detect"), words, rng, 0, True)
    elif name == "greedy via /provenance":
        auth = await _new_key(client, admin, tenant_id, "full", ["provenance"])
        oracle = _oracle(client, [auth], "provenance")
        final, why = await _greedy(run, oracle, words, rng, 0, False)
    elif name == "greedy, 4 keys":
        auths = [await _new_key(client, admin, tenant_id, "full", ["detect"]) for _ in range(4)]
        final, why = await _greedy(run, _oracle(client, auths, "detect"), words, rng, 0, False)
    else:
        oracle = _oracle(
            client, [await _new_key(client, admin, tenant_id, "full", ["detect"])], "detect"
        )
        if name in ("greedy", "salted"):
            salt = 3 if name == "salted" else 0
            final, why = await _greedy(run, oracle, words, rng, salt, False)
        elif name in ("halves", "windows"):
            final, why = await _pieces(run, oracle, words, rng, 2 if name == "halves" else 4)
        else:
            final, why = await _rank_then_delete(run, oracle, words, rng, budget)
    return run, final, why


async def _judge(client: Any, admin: dict[str, str], text: str) -> dict[str, Any]:
    """The judge: the admin's /provenance, unmetered (the tenant's probe budget, shared
    by all its keys, may be spent by the attack). One tenant with one key version is
    searched, so its p-value is the tenant key's own."""
    r = await client.post("/provenance", json={"text": text}, headers=admin)
    r.raise_for_status()
    answer: dict[str, Any] = r.json()
    return answer


async def _score(client: Any, admin: dict[str, str], text: str) -> float:
    """The judge's p-value (:func:`_judge`)."""
    return float((await _judge(client, admin, text))["p_value"])


def _clear_probes(db: Path) -> None:
    """Every strategy starts with a full budget: the probe accounts are emptied."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        for table in ("probe_hits", "probe_bands", "probe_clusters"):
            conn.execute(f"DELETE FROM {table}")  # noqa: S608 (fixed table names)


async def _phase(
    server: Server,
    base_url: str,
    admin_token: str,
    state: dict[str, Any],
    budgets: bool,
    max_queries: int,
    strategies: tuple[str, ...],
    db: Path,
    server_budget: int,
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
            r = await client.put(
                f"/admin/tenants/{state['tenant_id']}/scopes",
                json={"scopes": ["provenance"]},
                headers=admin,
            )
            r.raise_for_status()
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
        for name in strategies:
            progress(f"attack: {name}, {'with' if budgets else 'without'} budgets")
            _clear_probes(db)
            started = time.perf_counter()
            budget = server_budget if budgets else None
            run, final, why = await _strategy(
                name, client, admin, tenant_id, text, max_queries, budget
            )
            seconds = round(time.perf_counter() - started, 1)
            p_final = await _score(client, admin, " ".join(final))
            rows.append(
                {
                    "strategy": name,
                    "budgets": budgets,
                    "queries": run.queries,
                    "answered": run.answered,
                    "refused": run.queries - run.answered,
                    "words_deleted": len(text.split()) - len(final),
                    "outcome": why,
                    "seconds": seconds,
                    "final_p_value": p_final,
                    "survived": p_final < SIGNIFICANCE,
                    "watermarked": p_final < VERDICT_WATERMARKED_BELOW,
                }
            )
        if not budgets:
            initial = await _judge(client, admin, text)
            state["initial_p_value"] = float(initial["p_value"])
            state["statistic"] = initial.get("statistic")
    return rows


def run_attack_bench(
    *,
    model: str | None = None,
    max_queries: int = 4000,
    strategies: tuple[str, ...] = STRATEGIES,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Both phases (budgets off, then on) on one store; a dict of figures."""
    from app.main import create_app

    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; known: {list(STRATEGIES)}")
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
                        strategies,
                        Path(settings.sqlite_path),
                        settings.probe_budget_full,
                        say,
                    )
                )
            finally:
                server.stop()
                sock.close()
            budgets_used = {
                "full": settings.probe_budget_full,
                "verdict": settings.probe_budget_verdict,
                "full_answers": settings.probe_full_answers,
                "window_s": settings.probe_window_s,
            }
    return {
        "model": state.get("model"),
        "text_words": len(state["text"].split()),
        "initial_p_value": state["initial_p_value"],
        "max_queries": max_queries,
        "context_width": settings.context_width,  # of the tenant's key (WORLDCUP_CONTEXT_WIDTH)
        "statistic": state.get("statistic"),  # the judge's: model or model_free
        "budgets": budgets_used,
        "runs": rows,
    }


def format_attack_bench(result: dict[str, Any]) -> str:
    b = result["budgets"]
    lines = [
        f"model {result['model']}; text of {result['text_words']} words, "
        f"p = {result['initial_p_value']:.2g} before the attack; "
        f"key context width {result.get('context_width', 2)}, "
        f"statistic {result.get('statistic') or 'model_free'}; "
        f"budgets {b['full']} (full) / {b['verdict']} (verdict) per {b['window_s']:g} s, "
        f"of which {b.get('full_answers', 0) or 'all'} answered with a p-value; "
        f"at most {result['max_queries']} queries per run",
        "",
        "| strategy | probe budgets | queries sent | answered | words deleted | stopped because "
        "| p after (full detector) | watermark survived (p < 0.01) | verdict still watermarked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        pct = 100 * r["words_deleted"] / result["text_words"]
        lines.append(
            f"| {r['strategy']} | {'on' if r['budgets'] else 'off'} | {r['queries']} "
            f"| {r['answered']} | {r['words_deleted']} ({pct:.1f} %) | {r['outcome']} "
            f"| {r['final_p_value']:.2g} | {'yes' if r['survived'] else 'no'} "
            f"| {'yes' if r['final_p_value'] < VERDICT_WATERMARKED_BELOW else 'no'} |"
        )
    return "\n".join(lines)
