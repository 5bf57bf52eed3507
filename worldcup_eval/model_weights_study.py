"""Model-assisted detection (issue #44, items 1-2): today's statistic against token weights.

``python -m worldcup_eval.model_weights_study generate --out DIR`` answers the committed
ELI5 chat prompts (``worldcup_cli/data/first_use_prompts.txt``) with the embedded model
under the service default (preset ``frontier``, temperature 0.7, top-k 50, top-p 0.95,
no-repeat 4-grams, 128 new tokens, the chat template), each under its own random key
and 32-bit payload, as ``/generate`` would, and unwatermarked answers to other prompts
for the null. ``score --out DIR`` computes the token weights of every answer and of
human ELI5 answers (one batched forward pass of the model per batch of texts,
:func:`worldcup_core.model_weights.model_token_weights`) and prints the tables.

Splits (fixed before any scoring): prompts 0..T-1 tune the variant, T..T+H-1 are held
out, the next N prompts give the unwatermarked answers; ``--extra-tuning`` more tuning
answers come from the data file's other ELI5 questions (never held out). The variant is
chosen on the tuning answers alone (median log10 p, message-free, at 128 tokens) and
reported on the held-out answers beside today's statistic. The registry and decoding
table uses the core's default (:mod:`worldcup_core.detector_model`: a^1.5, Lancaster).

Everything is written as it finishes (``answers.jsonl``, ``weights.jsonl`` under
``--out``): a rerun reads it back and only does what is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = Path(__file__).resolve().parents[1] / "worldcup_cli" / "data" / "first_use_prompts.txt"
SEED = 44
NUM_BITS = 32
LENGTHS = (64, 128)


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


_REPORT: list[str] = []


def _say(msg: str = "") -> None:
    """A line of the report: printed, and kept for ``report.md``."""
    _REPORT.append(msg)
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def append_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def prompts() -> list[str]:
    """The 100 committed first-use prompts, then the ELI5 questions of the data file that
    are not among them (file order): extra tuning prompts, never held out."""
    from worldcup_eval.data import default_data_dir

    first = [p for p in PROMPTS.read_text(encoding="utf-8").splitlines() if p.strip()]
    seen = {_norm(p)[:25] for p in first}
    rows = read_jsonl(default_data_dir() / "eli5_longform_qa.jsonl")
    extra = [r["input"] for r in rows if not any(k in _norm(r["input"]) for k in seen)]
    return first + extra


def _norm(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


FIRST_USE = 100  # prompts 0..99 are the committed ones; the extra tuning prompts follow
TUNING = 20  # the committed prompts 0..TUNING-1 tune the variant (--tuning)
EXTRA_TUNING = 40  # and this many of the other ELI5 questions (--extra-tuning)


def plan(tuning: int, heldout: int, null: int, extra: int = 0) -> list[tuple[str, int]]:
    """(split, prompt index) of every answer, in generation order: tuning, held-out and
    null answers from the committed prompts, then ``extra`` more tuning answers from the
    other ELI5 questions."""
    out = [("tuning", i) for i in range(tuning)]
    out += [("heldout", tuning + i) for i in range(heldout)]
    out += [("null", tuning + heldout + i) for i in range(null)]
    out += [("tuning", FIRST_USE + i) for i in range(extra)]
    return out


def tuning_prompts(tuning: int = TUNING, extra: int = EXTRA_TUNING) -> list[str]:
    """The prompts whose answers chose the variant (the defaults: the study's run)."""
    texts = prompts()
    return [texts[i] for split, i in plan(tuning, 0, 0, extra) if split == "tuning"]


def answer_key(index: int) -> tuple[Any, str]:
    """The key and payload an answer is issued under (fixed by its prompt index)."""
    from worldcup_core import WatermarkKey
    from worldcup_eval.seeding import rng_for

    rng = rng_for(SEED, "answer", index)
    key = WatermarkKey(rng.bytes(32))
    bits = "".join(rng.choice(["0", "1"], NUM_BITS).tolist())
    return key, bits


def service_config() -> Any:
    from worldcup_core.config import service_config as new_key_config

    return new_key_config()


def load_lm() -> Any:
    import torch

    from worldcup_core.models import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return load_model(device="cpu", dtype="float32")


def generate(
    out: Path, tuning: int, heldout: int, null: int, extra: int, tokens: int, batch: int
) -> None:
    """Answers not yet in ``answers.jsonl``, ``batch`` at a time, appended as they finish."""
    from worldcup_core import Payload, SamplingConfig, WorldCup
    from worldcup_core.generation import GenerationRequest
    from worldcup_core.generation import generate as run_batch
    from worldcup_eval.data import chat_prompt_ids
    from worldcup_eval.seeding import int_seed

    path = out / "answers.jsonl"
    done = {(r["split"], r["prompt"]) for r in read_jsonl(path)}
    todo = [job for job in plan(tuning, heldout, null, extra) if job not in done]
    _log(f"{len(done)} answers saved, {len(todo)} to generate")
    if not todo:
        return
    lm = load_lm()
    texts = prompts()
    config = service_config()
    started = time.perf_counter()
    for start in range(0, len(todo), batch):
        jobs = todo[start : start + batch]
        requests: list[GenerationRequest] = []
        meta: list[tuple[str | None, str | None]] = []
        for split, i in jobs:
            sampling = SamplingConfig(
                temperature=0.7,
                top_k=50,
                top_p=0.95,
                max_new_tokens=tokens,
                no_repeat_ngram_size=4,
                seed=int_seed(SEED, "sample", i),
            )
            ids = chat_prompt_ids(lm.tokenizer, texts[i], texts[i])
            if split == "null":
                requests.append(GenerationRequest(ids, sampling))
                meta.append((None, None))
            else:
                key, bits = answer_key(i)
                scheme = WorldCup(key, config)
                requests.append(GenerationRequest(ids, sampling, scheme, Payload.from_bits(bits)))
                meta.append((key.hex(), bits))
        results = run_batch(lm.model, requests, lm.eos_token_ids, lm.pad_token_id)
        rows = [
            {
                "split": split,
                "prompt": i,
                "key": key_hex,
                "payload": bits,
                "ids": r.token_ids,
                "finish_reason": r.finish_reason,
            }
            for (split, i), (key_hex, bits), r in zip(jobs, meta, results, strict=True)
        ]
        append_jsonl(path, rows)
        elapsed = time.perf_counter() - started
        _log(f"  {start + len(jobs)}/{len(todo)} answers, {elapsed:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worldcup_eval.model_weights_study")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate (resumable) the chat answers")
    score = sub.add_parser("score", help="token weights (resumable) and the tables")
    for p in (gen, score):
        p.add_argument("--out", type=Path, default=Path("/work/scratch-stat"))
        p.add_argument("--tuning", type=int, default=TUNING)
        p.add_argument("--heldout", type=int, default=40)
        p.add_argument("--null", type=int, default=40)
        p.add_argument("--extra-tuning", type=int, default=EXTRA_TUNING)
    gen.add_argument("--tokens", type=int, default=128)
    gen.add_argument("--batch", type=int, default=10)
    score.add_argument("--keys", type=int, default=50, help="random keys per null text")
    score.add_argument("--human", type=int, default=100, help="human ELI5 answers")
    score.add_argument("--batch", type=int, default=8)
    score.add_argument(
        "--header", action="store_true", help="weights with a generic chat header before the text"
    )
    args = parser.parse_args(argv)
    if args.command == "generate":
        generate(
            args.out,
            args.tuning,
            args.heldout,
            args.null,
            args.extra_tuning,
            args.tokens,
            args.batch,
        )
        return 0
    return score_main(args)


def human_texts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first human answer of each ELI5 row that has
    that many (the rows in file order)."""
    from worldcup_eval.data import default_data_dir

    out: list[list[int]] = []
    for row in read_jsonl(default_data_dir() / "eli5_longform_qa.jsonl"):
        for answer in row.get("outputs", [])[:1]:
            ids = list(tokenizer(answer, add_special_tokens=False).input_ids)
            if len(ids) >= length:
                out.append([int(t) for t in ids[:length]])
        if len(out) >= count:
            break
    return out


def chat_header(tokenizer: Any) -> list[int]:
    """A generic chat header: the chat template up to the assistant's turn, for an empty
    user message (the text's true prompt is unknown to a detector)."""
    from worldcup_eval.data import chat_prompt_ids

    return chat_prompt_ids(tokenizer, "", "")


def compute_weights(
    out: Path, texts: dict[str, list[int]], batch: int, header: bool = False
) -> dict[str, Any]:
    """Token weights of every named text, read back from ``weights.jsonl`` (with a chat
    header before each text: ``weights-header.jsonl``) where saved."""
    from worldcup_core.model_weights import model_token_weights

    path = out / ("weights-header.jsonl" if header else "weights.jsonl")
    saved = {r["name"]: np.array(r["w"], dtype=np.float64) for r in read_jsonl(path)}
    todo = [name for name in texts if name not in saved]
    _log(f"{len(saved)} weight arrays saved, {len(todo)} to compute")
    if todo:
        lm = load_lm()
        prefix = chat_header(lm.tokenizer) if header else []
        started = time.perf_counter()
        for start in range(0, len(todo), batch):
            names = todo[start : start + batch]
            got = model_token_weights(
                lm.model,
                [texts[n] for n in names],
                prefix_ids=prefix,
                batch_size=batch,
                pad_token_id=lm.pad_token_id,
            )
            rows = []
            for name, w in zip(names, got, strict=True):
                saved[name] = w
                rows.append({"name": name, "w": [None if math.isnan(x) else x for x in w]})
            append_jsonl(path, rows)
            elapsed = time.perf_counter() - started
            _log(f"  weights {start + len(names)}/{len(todo)}, {elapsed:.0f} s")
    return saved


Scorer = Callable[[Any, Any, list[list[int]], int | None, list[Any]], Any]


def variants() -> dict[str, Scorer]:
    """The statistics compared: today's, and the model-assisted ones (a power of a_t,
    Fisher or Lancaster across cells). The variant is chosen on the tuning answers."""
    from worldcup_core.detector_model import model_log_p_many
    from worldcup_core.detector_weighted import weighted_log_p_many

    def today(key: Any, cfg: Any, texts: list[list[int]], bits: int | None, w: list[Any]) -> Any:
        return weighted_log_p_many(key, cfg, texts, bits)

    def model(power: float, combiner: Any) -> Scorer:
        def run(key: Any, cfg: Any, texts: list[list[int]], bits: int | None, w: list[Any]) -> Any:
            return model_log_p_many(key, cfg, texts, bits, w, combiner, power)

        return run

    out: dict[str, Scorer] = {"today": today}
    for power in (0.5, 1.0, 1.5, 2.0):
        for combiner in ("fisher", "lancaster"):
            out[f"model a^{power:g} {combiner}"] = model(power, combiner)
    return out


def _row(values: Sequence[float]) -> str:
    v = np.asarray(values)
    n = len(v)

    def share(t: float) -> str:
        r = float(np.mean(v < t))
        return f"{100 * r:.0f} % ± {100 * math.sqrt(r * (1 - r) / n):.0f}"

    return f"{share(-6)} | {share(-3)} | {statistics.median(v.tolist()):.2f}"


def score_main(args: argparse.Namespace) -> int:
    from worldcup_core import WatermarkKey
    from worldcup_core.models import load_tokenizer

    out: Path = args.out
    answers = read_jsonl(out / "answers.jsonl")
    if not answers:
        _log("no answers: run generate first")
        return 1
    tok = load_tokenizer()
    texts = {f"{a['split']}:{a['prompt']}": a["ids"] for a in answers}
    humans = human_texts(tok, args.human, max(LENGTHS))
    texts.update({f"human:{i}": ids for i, ids in enumerate(humans)})
    weights = compute_weights(out, texts, args.batch, args.header)
    if args.header:
        _say("(token weights computed with a generic chat header before each text)\n")
    cfg = service_config()
    scorers = variants()
    # ------------------------------------------------------------ watermarked answers
    results: dict[tuple[str, str, int, str], list[float]] = {}
    for split in ("tuning", "heldout"):
        rows = [a for a in answers if a["split"] == split]
        for length in LENGTHS:
            for name, fn in scorers.items():
                for bits, label in ((None, "free"), (NUM_BITS, "known")):
                    vals = []
                    for a in rows:
                        key = WatermarkKey.from_hex(a["key"])
                        w = weights[f"{split}:{a['prompt']}"][:length]
                        lp = fn(key, cfg, [a["ids"][:length]], bits, [w])
                        vals.append(float(lp[0]) / math.log(10.0))
                    results[(split, name, length, label)] = vals
    tuned = {
        name: statistics.median(results[("tuning", name, 128, "free")])
        for name in scorers
        if name != "today"
    }
    chosen = min(tuned, key=lambda n: tuned[n])
    _say("## Tuning (message-free, 128 tokens): median log10 p per variant\n")
    _say(f"today: {statistics.median(results[('tuning', 'today', 128, 'free')]):.2f}")
    for name, med in sorted(tuned.items(), key=lambda kv: kv[1]):
        _say(f"{name}: {med:.2f}")
    _say(f"\nchosen on the tuning answers: **{chosen}**\n")
    held = len([a for a in answers if a["split"] == "heldout"])
    for label, title in (("free", "message-free"), ("known", f"payload length known ({NUM_BITS})")):
        _say(f"## Held-out answers ({held}), {title}\n")
        _say("| statistic | tokens | p < 1e-6 | p < 1e-3 | median log10 p |")
        _say("|---|---|---|---|---|")
        for name in dict.fromkeys(("today", "model a^1 lancaster", "model a^1 fisher", chosen)):
            for length in LENGTHS:
                _say(f"| {name} | {length} | {_row(results[('heldout', name, length, label)])} |")
        _say()
    for length in LENGTHS:
        old = np.array(results[("heldout", "today", length, "free")])
        new = np.array(results[("heldout", chosen, length, "free")])
        _say(
            f"paired, {length} tokens: lower p on {int((new < old).sum())}/{len(old)}, "
            f"median gain {statistics.median((old - new).tolist()):.2f} decades"
        )
    _say()
    registry_table(answers, weights, cfg)
    null_calibration(answers, weights, humans, cfg, args.keys, chosen, scorers)
    report = out / ("report-header.md" if args.header else "report.md")
    report.write_text("\n".join(_REPORT) + "\n", encoding="utf-8")
    _log(f"report written under {out}")
    return 0


def registry_table(answers: list[dict[str, Any]], weights: dict[str, Any], cfg: Any) -> None:
    """Held-out answers: the issued entry's registry test at 10^5 entries and whether the
    list decoder would name it (expected over the other entries' random payloads), with
    and without the token weights; 32-bit accuracy of the decoded payload."""
    from worldcup_core import WatermarkKey, WorldCup
    from worldcup_core.detector_model import model_decode_many, model_text_cells
    from worldcup_core.detector_weighted import entry_log_p
    from worldcup_core.registry_lookup import payload_list, text_cells

    size = 100_000
    taken = size / 2.0**NUM_BITS  # chance a listed payload is another entry's
    rows = [a for a in answers if a["split"] == "heldout"]
    _say(f"## Held-out answers ({len(rows)}): registry of {size} entries, 32-bit payload\n")
    _say("| statistic | tokens | registry p < 1e-6 | entry named (expected) | bit accuracy |")
    _say("|---|---|---|---|---|")
    for length in LENGTHS:
        table: dict[str, list[tuple[bool, float, float]]] = {"today": [], "model (default)": []}
        for a in rows:
            key = WatermarkKey.from_hex(a["key"])
            scheme = WorldCup(key, cfg)
            ids = a["ids"][:length]
            w = weights[f"heldout:{a['prompt']}"][:length]
            issued = int(a["payload"], 2)
            symbols = cfg.symbols_for(NUM_BITS)
            ones, trials, _ = scheme.evidence(ids).cells(symbols)
            plain = text_cells(ones, trials, NUM_BITS)
            o2, t2, weighted = model_text_cells(key, cfg, ids, NUM_BITS, w)
            for name, cells, lp in (
                ("today", plain, entry_log_p(key, cfg, ids, a["payload"])),
                ("model (default)", text_cells(o2, t2, NUM_BITS, weighted), None),
            ):
                if lp is None:
                    lp = entry_log_p(key, cfg, ids, a["payload"], w)
                strong = lp + math.log(size) < math.log(1e-6)
                plist = payload_list(cells)
                hit = np.flatnonzero(plist.payloads == np.uint64(issued))
                named = 0.0
                if hit.size and strong:
                    named = (1.0 - taken) ** int(hit[0])
                if name == "today":
                    bits = scheme.decode(ids, NUM_BITS).bits
                else:
                    bits = model_decode_many(key, cfg, [ids], NUM_BITS, [w])[0].bits
                acc = float(np.mean([x == y for x, y in zip(bits, a["payload"], strict=True)]))
                table[name].append((strong, named, acc))
        for name, vals in table.items():
            n = len(vals)
            rate = float(np.mean([v[0] for v in vals]))
            named = float(np.mean([v[1] for v in vals]))
            acc = float(np.mean([v[2] for v in vals]))
            se = math.sqrt(rate * (1 - rate) / n)
            _say(
                f"| {name} | {length} | {100 * rate:.0f} % ± {100 * se:.0f} | "
                f"{100 * named:.0f} % | {100 * acc:.1f} % |"
            )
    _say()


def null_calibration(
    answers: list[dict[str, Any]],
    weights: dict[str, Any],
    humans: list[list[int]],
    cfg: Any,
    keys: int,
    chosen: str,
    scorers: dict[str, Scorer],
) -> None:
    """p-values of unwatermarked model answers and human answers under ``keys`` random
    keys each: the rate below each level, with one binomial SE, and a KS test.

    Every (text, key) pair has a key of its own: texts that share a key share the
    g-values of the (context, token) pairs they have in common ("of the", "it is"), so
    their p-values, each exactly uniform, are dependent, and a KS test over them
    (which assumes independence) would reject more often than its level."""
    from scipy import stats

    from worldcup_core import WatermarkKey
    from worldcup_eval.seeding import rng_for

    null = [(a["ids"], weights[f"null:{a['prompt']}"]) for a in answers if a["split"] == "null"]
    human = [(ids, weights[f"human:{i}"]) for i, ids in enumerate(humans)]
    names = ["today", "model a^1 lancaster", chosen]
    names = list(dict.fromkeys(names))
    _say(f"## Null calibration: {len(null)} unwatermarked answers + {len(human)} human")
    _say(f"answers, {keys} random keys each, a fresh key per (text, key) pair\n")
    _say("| statistic | test | tokens | pairs | p < 1e-2 | p < 1e-3 | KS p |")
    _say("|---|---|---|---|---|---|---|")
    texts = null + human
    key_rows = [
        [WatermarkKey(rng_for(SEED, "null-key", i, j).bytes(32)) for j in range(keys)]
        for i in range(len(texts))
    ]
    for length in LENGTHS:
        ids = [t[:length] for t, _ in texts]
        ws = [w[:length] for _, w in texts]
        for name in names:
            for bits, test in ((None, "message-free"), (NUM_BITS, f"{NUM_BITS} bits")):
                p = [
                    float(np.exp(scorers[name](key, cfg, [t], bits, [w])[0]))
                    for t, w, row in zip(ids, ws, key_rows, strict=True)
                    for key in row
                ]
                arr = np.array(p)
                cells = []
                for level in (1e-2, 1e-3):
                    rate = float(np.mean(arr < level))
                    se = math.sqrt(level * (1 - level) / arr.size)
                    cells.append(f"{rate:.4f} (nominal {level:g} ± {se:.4f})")
                ks = stats.kstest(arr, "uniform").pvalue
                _say(
                    f"| {name} | {test} | {length} | {arr.size} | {cells[0]} | {cells[1]} "
                    f"| {ks:.2f} |"
                )
    _say()


if __name__ == "__main__":
    raise SystemExit(main())
