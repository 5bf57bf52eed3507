"""What a grammar costs the watermark: JSON under a schema vs free text of the same length.

For each prompt and realistic schema, the embedded SmolLM2-135M-Instruct writes a
JSON answer under the schema's grammar (xgrammar's mask before the watermark, as
the service does; sampling as the /v1 routes default: temperature 1, top-k 50,
no n-gram bans under a grammar), each with its own key and random 32-bit payload;
then free text from the same prompt, forced to the same number of tokens (and with
the routes' default 4-gram bans). Both are decoded from their text (re-tokenised,
as /decode does). Prints a JSON summary (bit accuracy, payload recovery, detection
p-values, scored tokens) per arm.

    python scripts/bench_structured.py --per-schema 8 --out docs/results/structured.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema

from app.engines import grammar
from worldcup_core import Payload, SamplingConfig
from worldcup_core.config import WatermarkConfig
from worldcup_core.generation import GenerationRequest, generate
from worldcup_core.models import load_model
from worldcup_core.prf import WatermarkKey
from worldcup_core.scheme import WorldCup

# the schemas and requests `worldcup bench first-use --prompt-set structured` answers too
_DATA = json.loads(
    (Path(__file__).parent.parent / "worldcup_cli" / "data" / "structured_prompts.json").read_text(
        encoding="utf-8"
    )
)
SCHEMAS: dict[str, dict[str, Any]] = _DATA["schemas"]
ASKED: dict[str, list[str]] = {
    name: [r["prompt"] for r in _DATA["requests"] if r["schema"] == name] for name in SCHEMAS
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--per-schema", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--num-bits", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lm = load_model(None, "cpu", "float32", None)
    tok = lm.tokenizer
    rows: list[dict[str, Any]] = []
    for name, schema in SCHEMAS.items():
        spec = grammar.GrammarSpec("json_schema", schema, "bench")
        compiled = grammar.compile_spec(tok, spec)
        for i in range(args.per_schema):
            asked = ASKED[name]
            messages = [{"role": "user", "content": asked[i % len(asked)]}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
            key = WatermarkKey(rng.randbytes(32))
            payload = Payload.from_int(rng.getrandbits(args.num_bits), args.num_bits)
            rows.append(
                {"schema": name, "prompt": ids, "key": key, "payload": payload,
                 "spec": spec, "compiled": compiled, "seed": rng.getrandbits(31)}
            )  # fmt: skip

    def run(structured: bool) -> list[Any]:
        requests = []
        for r in rows:
            length = args.max_tokens if structured else r["json_tokens"]
            sampling = SamplingConfig(
                temperature=1.0, top_k=50, top_p=1.0, max_new_tokens=length,
                min_new_tokens=0 if structured else length,
                no_repeat_ngram_size=0 if structured else 4, seed=r["seed"],
            )  # fmt: skip
            constraint = grammar.GrammarConstraint(r["spec"], r["compiled"]) if structured else None
            scheme = WorldCup(r["key"], WatermarkConfig())
            requests.append(
                GenerationRequest(r["prompt"], sampling, scheme, r["payload"], constraint)  # type: ignore[arg-type]
            )
        return generate(lm.model, requests, lm.eos_token_ids, lm.pad_token_id)

    started = time.perf_counter()
    for r, res in zip(rows, run(True), strict=True):
        r["json_text"] = tok.decode(res.token_ids, skip_special_tokens=True)
        r["json_tokens"] = max(1, len(res.token_ids))
        r["json_finish"] = res.finish_reason
    for r, res in zip(rows, run(False), strict=True):
        r["free_text"] = tok.decode(res.token_ids, skip_special_tokens=True)

    def score(text: str, r: dict[str, Any]) -> dict[str, Any]:
        ids = tok(text, add_special_tokens=False).input_ids
        dec = WorldCup(r["key"], WatermarkConfig()).decode(ids, args.num_bits)
        truth = r["payload"].bits
        return {
            "tokens": len(ids),
            "scored": dec.detection.num_scored_tokens,
            "bit_accuracy": sum(a == b for a, b in zip(dec.bits, truth, strict=True)) / len(truth),
            "exact": dec.bits == truth,
            "p": dec.detection.p_value,
            "detected": dec.detection.is_watermarked,
        }

    out: dict[str, Any] = {"num_bits": args.num_bits, "samples": len(rows), "arms": {}}
    for arm in ("json", "free"):
        scores = []
        valid = 0
        for r in rows:
            s = score(r[f"{arm}_text"], r)
            if arm == "json":
                try:
                    jsonschema.validate(json.loads(r["json_text"]), SCHEMAS[r["schema"]])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            s["schema"] = r["schema"]
            scores.append(s)
        per_schema = {}
        for name in [*SCHEMAS, "all"]:
            sel = [s for s in scores if name in ("all", s["schema"])]
            per_schema[name] = {
                "n": len(sel),
                "mean_tokens": statistics.mean(s["tokens"] for s in sel),
                "mean_scored_tokens": statistics.mean(s["scored"] for s in sel),
                "bit_accuracy": statistics.mean(s["bit_accuracy"] for s in sel),
                "payload_exact": sum(s["exact"] for s in sel) / len(sel),
                "detected": sum(s["detected"] for s in sel) / len(sel),
                "median_p": statistics.median(s["p"] for s in sel),
            }
        out["arms"][arm] = per_schema
        if arm == "json":
            out["json_valid"] = valid / len(rows)
            out["json_finished"] = sum(r["json_finish"] == "eos" for r in rows) / len(rows)
    out["seconds"] = round(time.perf_counter() - started, 1)
    out["example_json"] = rows[0]["json_text"][:400]
    text = json.dumps(out, indent=2)
    sys.stdout.write(text + "\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
