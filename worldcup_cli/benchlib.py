"""The harness the service benchmarks share (``worldcup bench service``, ``bench-engines``,
``bench attack``): the service in a thread on a free loopback socket, readiness, a bench
tenant, the generation load and its statistics, and the news-article prompts."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

NEW_TOKENS = 64  # each generation request: exactly this many new tokens
PAYLOAD_BITS = 16
Progress = Callable[[str], None]


FALLBACK_PROMPTS = (
    "The city council met on Tuesday evening to discuss the new budget, which",
    "Scientists studying the coral reef off the coast reported that",
    "The football club announced on Monday that its long-serving manager",
    "After three days of heavy rain, residents of the river valley",
    "The museum's new exhibition, which opens next week, brings together",
    "Shares in the technology company fell sharply after it warned that",
    "A small bakery in the old town has become famous for",
    "The space agency said the probe had sent back its first images of",
)


def data_dir() -> Path:
    env = os.environ.get("WORLDCUP_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def news_articles(limit: int) -> list[str]:
    path = data_dir() / "cnn_dailymail_test.jsonl"
    if not path.is_file():
        return []
    out: list[str] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                article = json.loads(line).get("article", "")
                if len(article) > 2000:
                    out.append(article)
            if len(out) >= limit:
                break
    return out


def word_salad(n: int, seed: int, chars: int = 1500) -> list[str]:
    """``n`` distinct texts of ``chars`` characters, words drawn at random from the news
    articles: every one its own probe account (the accounting's worst case)."""
    words = [w for a in news_articles(200) for w in a.split()]
    if not words:
        raise SystemExit("no news articles found: set WORLDCUP_DATA_DIR to shared/data")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = ""
        while len(text) < chars:
            text += rng.choice(words) + " "
        out.append(text[:chars])
    return out


def news_prompts(articles: Sequence[str], n: int) -> list[str]:
    """Distinct prompts: the opening of a news article, or fixed ones without the data."""
    prompts = []
    for i in range(n):
        if articles:
            opening = articles[i % len(articles)][:400].rsplit(" ", 1)[0]
            prompts.append(f"{opening} (continued {i})" if i >= len(articles) else opening)
        else:
            prompts.append(f"{FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)]} ({i})")
    return prompts


def free_socket() -> socket.socket:
    """A loopback socket bound to a free port, handed to uvicorn (no port race).

    The protocol must be given explicitly: asyncio sets TCP_NODELAY only on
    sockets whose ``proto`` is IPPROTO_TCP, and with ``proto=0`` every response
    waited out a ~40 ms delayed ACK (Nagle).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Server:
    """uvicorn in a daemon thread; ``stop`` runs the app's shutdown (drain, store close)."""

    def __init__(self, app: Any, sock: socket.socket) -> None:
        import uvicorn

        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=10
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="bench-uvicorn", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


async def wait_ready(client: Any, server: Server, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive:
            raise RuntimeError("the server exited during startup (see the log above)")
        try:
            r = await client.get("/ready")
            if r.status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.01)
    raise RuntimeError(f"/ready did not answer 200 within {timeout_s:.0f} s")


class Load:
    def __init__(self, client: Any, api_key: str, prompts: list[str], seed: int = 0) -> None:
        self.client = client
        self.auth = {"Authorization": f"Bearer {api_key}"}
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.next_prompt = 0
        self.generated: list[tuple[str, str]] = []  # (payload bits, text)

    def _body(self) -> dict[str, Any]:
        prompt = self.prompts[self.next_prompt % len(self.prompts)]
        self.next_prompt += 1
        bits = "".join(self.rng.choice("01") for _ in range(PAYLOAD_BITS))
        return {
            "prompt": prompt,
            "payload": {"bits": bits},
            "max_new_tokens": NEW_TOKENS,
            "min_new_tokens": NEW_TOKENS,
            "seed": self.rng.randrange(2**31),
        }

    async def generate(self) -> dict[str, Any]:
        body = self._body()
        r = await self.client.post("/generate", json=body, headers=self.auth)
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:300]}")
        out: dict[str, Any] = r.json()
        if out["payload"]["bits"] != body["payload"]["bits"]:
            raise RuntimeError("the response does not echo the requested payload")
        self.generated.append((body["payload"]["bits"], out["text"]))
        return out

    async def wave(self, n: int, concurrent: bool) -> tuple[float, list[dict[str, Any]]]:
        start = time.perf_counter()
        if concurrent:
            results = list(await asyncio.gather(*(self.generate() for _ in range(n))))
        else:
            results = [await self.generate() for _ in range(n)]
        return time.perf_counter() - start, results


def wave_stats(concurrency: int, seconds: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["num_tokens"] for r in results)
    ttft = [
        r["timing"]["time_to_first_token_seconds"]
        for r in results
        if r["timing"]["time_to_first_token_seconds"] is not None
    ]
    per_seq = [t for r in results if (t := r["timing"]["tokens_per_second"])]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "ttft_median_s": round(statistics.median(ttft), 4) if ttft else None,
        "per_sequence_tokens_per_s": round(statistics.median(per_seq), 2) if per_seq else None,
    }


async def ready_with_tenant(
    client: Any,
    server: Server,
    admin_token: str,
    t_start: float,
    timeout_s: float,
    progress: Progress,
) -> tuple[float, str]:
    """Wait for ``/ready`` (the cold start, from ``t_start``), then create the bench tenant:
    (cold start seconds, its API key)."""
    await wait_ready(client, server, timeout_s=timeout_s)
    cold_start = time.perf_counter() - t_start
    progress(f"ready after {cold_start:.2f} s")
    admin = {"Authorization": f"Bearer {admin_token}"}
    # the benchmarks choose their payloads (the fixed_payload scope) and read decoded
    # bits as analysts do (the provenance scope: app.services.disclosure)
    body = {"name": "bench", "scopes": ["fixed_payload", "provenance"]}
    r = await client.post("/admin/tenants", json=body, headers=admin)
    r.raise_for_status()
    return cold_start, str(r.json()["api_key"])


def json_plain(value: Any) -> Any:
    """numpy scalars (counts and p's from the core) as JSON numbers (``json.dumps``'s
    ``default``)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


class RunState:
    """What a resumable benchmark keeps under ``out_dir``: ``state.json`` (its
    arguments' ``signature``, refused if another run's, and what was measured) and
    ``answers.jsonl``, the answers as they finish, each under its ``owner`` (the
    field naming whose answer it is: a tenant, a user) and its place ``j``."""

    def __init__(self, out_dir: Path, signature: dict[str, Any], owner: str) -> None:
        self.owner = owner
        out_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = out_dir / "state.json"
        self.answers_path = out_dir / "answers.jsonl"
        self.state: dict[str, Any] = {}
        if self.state_path.is_file():
            self.state = json.loads(self.state_path.read_text(encoding="utf-8"))
            if self.state.get("signature") != signature:
                raise ValueError(
                    f"{out_dir} holds a run with other arguments ({self.state.get('signature')});"
                    " use another --out-dir"
                )
        self.state["signature"] = signature

    def save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, default=json_plain), encoding="utf-8")
        tmp.replace(self.state_path)

    def answers(self) -> dict[tuple[str, int], dict[str, Any]]:
        if not self.answers_path.is_file():
            return {}
        with self.answers_path.open(encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        return {(r[self.owner], r["j"]): r["answer"] for r in rows}

    def record(self, owner: str, j: int, answer: dict[str, Any]) -> None:
        with self.answers_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({self.owner: owner, "j": j, "answer": answer}) + "\n")
