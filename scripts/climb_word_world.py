"""The p-value climber with and without the full-answer limit, in the word world.

The word world of ``tests/test_forgery.py``: a tiny random model restricted to 64
words, answers of 48 tokens, 8 spoof prompts (the test's ``_small`` runs). For KGW at
a weak boost, WorldCup at c = 2 and at c = 4, the climber (``--climb Q``) runs twice
on the same answers and drafts: every query answered with a p-value
(``full_answers=0``), then as the service answers (``full_answers=3``: a p-value for
the first 3 queries a day, the verdict word after). Prints and writes
``OUT/result-Q.json`` (texts accepted after 0, 1, 3, 10, 30, 60 queries).

    WORLDCUP_DATA_DIR=../shared/data python scripts/climb_word_world.py --climb 30 --out RUN
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--climb", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import torch
    from test_forgery import WORDS, _small, _Words  # type: ignore[import-not-found]

    from worldcup_core.models import LoadedModel, load_tokenizer, tiny_random_model
    from worldcup_eval.forgery import run_forgery

    torch.set_num_threads(1)
    tok = load_tokenizer()
    allowed = [tok(" " + w, add_special_tokens=False).input_ids[0] for w in WORDS]
    inner = tiny_random_model(tok, seed=3)
    with torch.no_grad():
        inner.model.lm_head.weight.mul_(15.0)  # as the test's word_lm
    words = _Words(inner.model, allowed, len(tok)).eval()
    lm = LoadedModel(words, tok, "tiny-words", torch.device("cpu"))
    runs = {
        "kgw d=0.5": _small("kgw", budget_tokens=3000, deltas=(0.5,), climb=args.climb),
        "worldcup c=2": _small("per-request", climb=args.climb),
        "worldcup c=4": _small("per-request", context_width=4, climb=args.climb),
    }
    out: dict[str, object] = {}
    for name, config in runs.items():
        for full in (0, 3):
            where = args.out / name.replace(" ", "_").replace("=", "")
            got = run_forgery(replace(config, full_answers=full), where, lm, args.data_dir, False)
            by_round = {r["round"]: r["accepted"] for r in got["climb"]["by_round"]}
            row = got["climb"]["row"]
            label = f"{name}, full_answers={full}"
            out[label] = {
                "accepted_after": {q: by_round[q] for q in (0, 1, 3, 10, 30, 60) if q in by_round},
                "named_any": row["named_any"]["k"],
                "texts": row["watermarked"]["n"],
            }
            sys.stdout.write(
                f"{name}, full_answers={full}: {out[f'{name}, full_answers={full}']}\n"
            )
            sys.stdout.flush()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"result-{args.climb}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
