"""What the spoof-artifact check and the context count cost (issue #45), side by side.

One app in-process (the embedded model, the service's defaults) over Redis (a fresh
prefix at WORLDCUP_TEST_REDIS_URL, removed afterwards) or SQLite (a temporary file).
A tenant's registered answers are generated once; then, interleaved and warmed, on the
same texts, median of ``--runs`` rounds:

* ``detect``: a whole ``POST /detect`` of a watermarked answer, check included;
* ``check``: the check alone (:func:`app.services.artifact.check_one`): the text's
  leave-one-out evidence and keyed context cells in a worker, and one store read;
* ``check_store``: that store read alone (``context_counts``);
* ``count``: what each watermarked ``/generate`` adds after the text (``count_contexts``);
* ``generate``: a whole ``POST /generate`` (``--tokens`` new tokens), the count included.

The store's sketch is filled first to ``--fill`` texts' worth of counts (random cells;
a large tenant's), though neither store's cost depends on how full it is. Prints one
JSON object: the medians in ms and the ratios check/detect and count/generate.

    PYTHONPATH=. .venv/bin/python scripts/artifact_check_cost.py [--store redis|sqlite]
        [--texts 8] [--tokens 128] [--runs 5] [--fill 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.main import create_app
from app.services import artifact
from app.services.intake import encode_texts
from worldcup_core.context_sketch import text_cells

REDIS_URL = os.environ.get("WORLDCUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
ADMIN_TOKEN = secrets.token_urlsafe(24)
PROMPTS = [
    "Explain why the sky is blue.",
    "How do vaccines train the immune system?",
    "Why do cats purr?",
    "What makes bread rise?",
    "How does a refrigerator keep food cold?",
    "Why is the ocean salty?",
    "How do airplanes stay in the air?",
    "What causes the seasons?",
]


def _settings(store: str, db_dir: Path, prefix: str) -> Settings:
    values: dict[str, Any] = {
        "master_key": secrets.token_hex(32),
        "master_key_file": None,
        "admin_token": ADMIN_TOKEN,
        "admin_token_file": None,
        "log_level": "WARNING",
        "redis_url": REDIS_URL if store == "redis" else None,
        "redis_prefix": prefix,
        "sqlite_path": db_dir / "db.sqlite3",
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def _median_ms(times: list[float]) -> float:
    return round(1000.0 * statistics.median(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=("redis", "sqlite"), default="redis")
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--fill", type=int, default=100_000, help="texts' worth of counts first")
    args = ap.parse_args()
    for name in ("texts", "tokens", "runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.fill < 0:
        ap.error("--fill must be at least 0")
    prefix = f"artbench{secrets.token_hex(6)}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = _run(args, _settings(args.store, Path(tmp), prefix))
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        finally:
            if args.store == "redis":
                import redis

                r = redis.Redis.from_url(REDIS_URL)
                keys = list(r.scan_iter(f"{prefix}*"))
                if keys:
                    r.delete(*keys)
                r.close()


def _run(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    app = create_app(settings)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with TestClient(app) as c:
        portal = c.portal
        assert portal is not None  # inside the with: the app's event loop runs
        runtime: Any = app.state.runtime
        r = c.post("/admin/tenants", json={"name": "artbench"}, headers=admin)
        assert r.status_code == 201, r.text
        tenant_id, auth = r.json()["tenant_id"], {"Authorization": f"Bearer {r.json()['api_key']}"}
        scheme = portal.call(runtime.tenants.version, tenant_id, None).scheme
        store = runtime.store
        rng = np.random.default_rng(0)
        width = 1 << 20
        for start in range(0, args.fill, 1000):  # a large tenant's counts (about 130 a text)
            cells = rng.integers(0, width, size=(min(1000, args.fill - start) * 130, 4))
            portal.call(store.count_contexts, tenant_id, 1, cells.tolist())

        def generate(i: int) -> str:
            body = {
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_new_tokens": args.tokens,
                "min_new_tokens": args.tokens,
                "metadata": {"user_id": f"u{i}"},
            }
            r = c.post("/generate", json=body, headers=auth)
            assert r.status_code == 200, r.text
            return str(r.json()["text"])

        texts = [generate(i) for i in range(args.texts)]
        ids = encode_texts(runtime.tokenizer, texts)
        text_contexts = [text_cells(scheme, t).tolist() for t in ids]
        marked = []
        for text in texts:
            r = c.post("/detect", json={"text": text}, headers=auth)
            assert r.status_code == 200, r.text
            marked.append(r.json()["verdict"] == "watermarked")
        keep = [i for i, m in enumerate(marked) if m]
        assert keep, "no answer was watermarked: nothing to check"
        bits = settings.default_num_bits

        def detect(i: int) -> None:
            r = c.post("/detect", json={"text": texts[i]}, headers=auth)
            assert r.status_code == 200, r.text

        def check(i: int) -> None:
            portal.call(artifact.check_one, runtime, tenant_id, ids[i], 1, bits)

        def check_store(i: int) -> None:
            portal.call(store.context_counts, tenant_id, 1, text_contexts[i])

        def count(i: int) -> None:
            portal.call(store.count_contexts, tenant_id, 1, text_contexts[i])

        jobs: dict[str, Callable[[int], Any]] = {
            "detect": detect,
            "check": check,
            "check_store": check_store,
            "count": count,
            "generate": generate,
        }
        times: dict[str, list[float]] = {name: [] for name in jobs}
        for job in jobs.values():  # warm every path once
            job(keep[0])
        for _ in range(args.runs):
            for i in keep:
                for name, job in jobs.items():  # interleaved, text by text
                    t0 = time.perf_counter()
                    job(i)
                    times[name].append(time.perf_counter() - t0)
        med = {name: _median_ms(t) for name, t in times.items()}
        return {
            "store": args.store,
            "texts": len(texts),
            "watermarked": len(keep),
            "tokens": args.tokens,
            "runs": args.runs,
            "fill_texts": args.fill,
            "scored_contexts_median": int(statistics.median(len(x) for x in text_contexts)),
            "median_ms": med,
            "check_over_detect": round(med["check"] / med["detect"], 4),
            "count_over_generate": round(med["count"] / med["generate"], 5),
        }


if __name__ == "__main__":
    main()
