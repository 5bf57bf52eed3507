"""The spread of p-values of test_engines' 160-token round trip, on one engine, over many keys.

``tests/test_engines.py::test_generate_with_metadata_then_decode_matches_the_registry``
generates two 160-token texts (prompts 0 and 1, seeds 10 and 11, 16-bit payloads, the
/generate defaults: temperature 1, top-k 50, top-p 0.95) under a fresh tenant key each
run, and asserts p < 1e-6. Twice in CI a vLLM text decoded at p = 0.04 and 0.0075. This
repeats that request under ``--texts`` fresh keys and reports the distribution of p and,
per weak text, what decides between a weak text and a sync bug: the scored tokens and,
on vLLM, the processor's per-position record (how many positions the watermark moved,
their entropy, and any step watermarked on a context that is not the text's).

    PYTHONPATH=. WORLDCUP_VENV=.venv-vllm .venv-vllm/bin/python scripts/round_trip_spread.py \\
        --engine vllm --texts 48 --json spread-vllm.json
    PYTHONPATH=. .venv/bin/python scripts/round_trip_spread.py --engine hf --texts 48
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = (
    "Write a short, surprising story about a lighthouse keeper and a fox.",
    "Invent five names for a new breakfast cereal and describe each one.",
)
ADMIN = "spread-admin-token-0123456789"


class _Scores(logging.Handler):
    """The vLLM engine's per-request score summaries, by request id."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_request: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("WorldCup scores of request"):
            request_id, summary = record.args  # type: ignore[misc]
            self.by_request[str(request_id)] = summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("hf", "vllm"), default="vllm")
    parser.add_argument("--texts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--json", type=Path, help="write every text's figures here")
    args = parser.parse_args()

    import httpx
    from servers import LiveServer, free_port

    from app.core.config import Settings

    tmp = Path(tempfile.mkdtemp(prefix="spread-"))
    os.environ["WORLDCUP_VLLM_SCORES"] = str(tmp / "scores.jsonl")
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        engine=args.engine,
        port=free_port(),
        sqlite_path=tmp / "db.sqlite3",
        redis_url=None,
        master_key="3d" * 32,
        admin_token=ADMIN,
        log_level="WARNING",
        max_batch_size=8,
        max_queue=256,
        vllm_max_model_len=1024,
    )
    scores = _Scores()
    with LiveServer(settings, startup_timeout_s=900) as server:
        logging.getLogger("worldcup.engine.vllm").addHandler(scores)
        logging.getLogger("worldcup.engine.vllm").setLevel(logging.INFO)
        http = httpx.Client(base_url=server.url, timeout=900)

        def one(i: int) -> dict[str, Any]:
            admin = {"Authorization": f"Bearer {ADMIN}"}
            r = http.post("/admin/tenants", json={"name": f"s{i}"}, headers=admin)
            auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
            body = {
                "prompt": PROMPTS[i % 2],
                "metadata": {"i": i},
                "num_bits": 16,
                "max_new_tokens": args.tokens,
                "min_new_tokens": args.tokens,
                "seed": 10 + i % 2,
            }
            r = http.post("/generate", json=body, headers=auth)
            r.raise_for_status()
            gen, request_id = r.json(), r.headers["x-request-id"]
            dec = http.post(
                "/decode", json={"text": gen["text"], "num_bits": 16}, headers=auth
            ).json()
            match = dec.get("registry_match") or {}
            return {
                "prompt": i % 2,
                "p_value": dec["p_value"],
                "scored": dec.get("num_scored_tokens"),
                "matched": match.get("message_id") == gen["message_id"],
                "request_id": request_id,
                "text": gen["text"],
            }

        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            rows = list(pool.map(one, range(args.texts)))
        http.close()
    for row in rows:
        row["scores"] = scores.by_request.get(row["request_id"])
    ps = sorted(r["p_value"] for r in rows)
    weak = [r for r in rows if r["p_value"] >= 1e-6]
    summary = {
        "engine": args.engine,
        "texts": len(rows),
        "median_p": statistics.median(ps),
        "weak_p_ge_1e-6": len(weak),
        "weak_p_ge_1e-3": sum(p >= 1e-3 for p in ps),
        "largest_p": ps[-3:],
        "unmatched": sum(not r["matched"] for r in rows),
        "context_mismatches": sum((r["scores"] or {}).get("context_mismatches", 0) for r in rows),
    }
    print(json.dumps(summary, indent=1))  # noqa: T201
    for r in sorted(weak, key=lambda r: -r["p_value"]):
        print(json.dumps({k: r[k] for k in ("p_value", "scored", "prompt", "scores")}))  # noqa: T201
        print("   ", r["text"][:300].replace("\n", " "))  # noqa: T201
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "texts": rows}, indent=1))


if __name__ == "__main__":
    main()
