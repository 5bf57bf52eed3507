"""``worldcup bench scan``: what a corpus scan costs, per core and per engine.

Per-core figures are CPU time per text in one process (the machine may be
shared, so wall time would mix in other jobs): tokenisation, then scoring in
detect mode (one key) and in provenance mode at each bank size. Engine figures
are wall-clock texts/s of a whole ``run_scan`` (local process pool and local
Ray) with 1 and 2 workers, start-up included (and when the first part was done).
The corpus mixes texts watermarked under the bank's keys (simulated sampling
over whole-word tokens, which survive detokenising and retokenising) with human
text from the evaluation data when it is there.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from app.services.corpus import Fields, Part, discover, plan, read_part
from worldcup_core import Payload, WorldCup
from worldcup_scan.keys import KeySpec, ScanKeys
from worldcup_scan.run import ScanOptions, _write_part, run_scan
from worldcup_scan.scanner import Scanner, ScanSpec


def word_tokens(tokenizer: Any) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Token ids of lowercase whole words with a leading space: they round-trip through text."""
    ids = [i for s, i in tokenizer.get_vocab().items() if re.fullmatch(r"Ġ[a-z]{3,10}", s)]
    return np.array(sorted(ids), dtype=np.int64)


def watermarked_ids(
    scheme: WorldCup,
    payload: Payload,
    length: int,
    vocab: np.ndarray[Any, np.dtype[np.int64]],
    rng: np.random.Generator,
) -> list[int]:
    """Watermarked sampling over random Dirichlet(0.5) distributions on 50 word tokens."""
    seq: Any = scheme.sequence(payload)
    for _ in range(length):
        p = rng.dirichlet(np.full(50, 0.5))
        cand = rng.choice(vocab, 50, replace=False)
        q = seq.reweight(cand, p)
        seq.observe(int(cand[rng.choice(50, p=q)]))
    out: list[int] = seq.generated
    return out


def human_texts(data_dir: Path | None = None, limit: int = 1000) -> list[str]:
    """Article openings from the evaluation data (empty if the data is not there)."""
    root = data_dir or Path(os.environ.get("WORLDCUP_DATA_DIR", "../shared/data"))
    path = root / "cnn_dailymail_test.jsonl"
    if not path.is_file():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line).get("article", "")
            if text:
                out.append(text[:1200])
            if len(out) >= limit:
                break
    return out


def random_keys(n: int, seed: int = 0) -> ScanKeys:
    rng = np.random.default_rng(seed)
    return ScanKeys(
        tuple(KeySpec(f"tenant-{i:05d}", f"tenant-{i:05d}", 1, rng.bytes(32)) for i in range(n)),
        {},
        None,
        "bench",
    )


def _corpus(tokenizer: Any, keys: ScanKeys, n: int, rng: np.random.Generator) -> list[str]:
    vocab = word_tokens(tokenizer)
    human = human_texts()
    texts: list[str] = []
    marked: list[str] = []  # simulated sampling is slow: at most 40 distinct, then repeated
    for i in range(n):
        if i % 4 == 0 or not human:
            if len(marked) < 40:
                spec = keys.keys[int(rng.integers(len(keys.keys)))]
                ids = watermarked_ids(spec.worldcup(), Payload.random(16, rng), 200, vocab, rng)
                marked.append(tokenizer.decode(ids))
            texts.append(marked[(i // 4) % len(marked)])
        else:
            texts.append(human[i % len(human)])
    return texts


def _cpu_per_text(fn: Callable[[], object], count: int) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) / count


def run_scan_bench(
    texts: int,
    bank_sizes: Sequence[int],
    engines: Sequence[str],
    worker_counts: Sequence[int],
    progress: Callable[[str], None] = lambda _: None,
    engine_keys: int = 1000,
) -> dict[str, Any]:
    from worldcup_core.models import load_tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rng = np.random.default_rng(7)
    tokenizer = load_tokenizer()
    small = random_keys(100)
    bank = random_keys(engine_keys, seed=engine_keys)
    corpus = _corpus(tokenizer, bank, texts, rng)
    result: dict[str, Any] = {"texts": texts, "cpu_count": os.cpu_count()}
    result["load_average"] = list(os.getloadavg())

    progress("per core: tokenisation and scoring (CPU time per text)")
    tok_cpu = _cpu_per_text(lambda: tokenizer(corpus, add_special_tokens=False), texts)
    ids = tokenizer(corpus, add_special_tokens=False).input_ids
    result["mean_tokens"] = float(np.mean([len(t) for t in ids]))
    per_core: dict[str, Any] = {"tokenize_ms": 1000 * tok_cpu}
    one = Scanner(ScanSpec(ScanKeys(small.keys[:1], {}, None), "detect"), tokenizer)
    score = _cpu_per_text(lambda: [one._assess(t) for t in ids], texts)
    per_core["detect_1_key_ms"] = 1000 * score
    per_core["detect_texts_per_s"] = 1.0 / (tok_cpu + score)
    provenance = []
    for size in bank_sizes:
        keys = (
            small if size == 100 else bank if size == engine_keys else random_keys(size, seed=size)
        )
        scanner = Scanner(ScanSpec(keys, "provenance"), tokenizer)
        subset = ids[: max(4, min(texts, 400_000 // max(size, 1)))]
        progress(f"  provenance, {size} keys, {len(subset)} texts")
        cost = _cpu_per_text(partial(_assess_all, scanner, subset), len(subset))
        provenance.append(
            {
                "keys": size,
                "texts": len(subset),
                "score_ms": 1000 * cost,
                "texts_per_s": 1.0 / (tok_cpu + cost),
                "ms_per_1000_keys": 1000 * cost * 1000 / size,
            }
        )
    per_core["provenance"] = provenance
    result["per_core"] = per_core

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus_path = Path(tmp) / "corpus.jsonl"
        with open(corpus_path, "w", encoding="utf-8") as f:
            for i, t in enumerate(corpus):
                f.write(json.dumps({"id": str(i), "text": t}) + "\n")
        part_rows = max(10, texts // 20)
        # I/O per text: reading and validating JSONL rows, writing result parts
        parts = plan(discover([str(corpus_path)]), part_rows)
        read = _cpu_per_text(lambda: [read_part(p, Fields("text", "id")) for p in parts], texts)
        rows = Scanner(ScanSpec(ScanKeys(small.keys[:1], {}, None), "detect"), tokenizer).scan_rows(
            read_part(parts[0], Fields("text", "id"))
        )
        state = Path(tmp) / "write-bench"
        state.mkdir()
        _write_part(state, parts[0], rows)  # the first write imports and sets up Parquet
        write = _cpu_per_text(lambda: _write_part(state, parts[0], rows), len(rows))
        per_core["read_jsonl_ms"] = 1000 * read
        per_core["write_parquet_ms"] = 1000 * write
        reference: bytes | None = None
        if "ray" in engines:  # one local Ray for both Ray runs: its start-up is paid once
            import ray

            ray.init(
                address="local",
                num_cpus=max(worker_counts),
                include_dashboard=False,
                log_to_driver=False,
            )
        for engine in engines:
            for workers in worker_counts:
                progress(f"engine {engine}, {workers} worker(s)")
                out = Path(tmp) / f"out-{engine}-{workers}.jsonl"
                stamps: list[tuple[float, int]] = []

                def stamp(part: Part, _n: int, stamps: list[tuple[float, int]] = stamps) -> None:
                    stamps.append((time.perf_counter(), len(part)))

                spec = ScanSpec(bank, "provenance")
                options = ScanOptions(
                    (str(corpus_path),), out, engine, workers, part_rows, progress=False
                )
                started = time.perf_counter()
                run_scan(
                    options,
                    spec,
                    on_part=stamp,
                )
                wall = time.perf_counter() - started
                first = stamps[0][0] - started if stamps else None
                body = out.read_bytes()
                same = reference is None or body == reference
                reference = reference or body
                runs.append(
                    {
                        "engine": engine,
                        "workers": workers,
                        "wall_s": wall,
                        "texts_per_s": texts / wall,
                        "first_part_s": first,
                        "identical_output": same,
                    }
                )
        if "ray" in engines:
            ray.shutdown()
    result["engines"] = runs
    result["engine_keys"] = engine_keys
    result["load_average_after"] = list(os.getloadavg())
    return result


def format_scan_bench(r: dict[str, Any]) -> str:
    pc = r["per_core"]
    lines = [
        f"corpus: {r['texts']} texts, {r['mean_tokens']:.0f} tokens on average; "
        f"load average {r['load_average'][0]:.2f} -> {r['load_average_after'][0]:.2f}",
        "per core (CPU time per text):",
        f"  read JSONL          {pc['read_jsonl_ms']:.3f} ms",
        f"  tokenise            {pc['tokenize_ms']:.3f} ms",
        f"  write Parquet part  {pc['write_parquet_ms']:.3f} ms",
        f"  detect, 1 key       {pc['detect_1_key_ms']:.3f} ms  -> "
        f"{pc['detect_texts_per_s']:.0f} texts/s per core",
    ]
    for p in pc["provenance"]:
        lines.append(
            f"  provenance {p['keys']:>6} keys {p['score_ms']:.1f} ms  -> "
            f"{p['texts_per_s']:.1f} texts/s per core ({p['ms_per_1000_keys']:.1f} ms / 1000 keys)"
        )
    lines.append(f"engines (provenance, {r['engine_keys']} keys; wall clock):")
    for e in r["engines"]:
        lines.append(
            f"  {e['engine']:<5} {e['workers']} worker(s): {e['texts_per_s']:.1f} texts/s "
            f"({e['wall_s']:.1f} s with start-up; first part done after {e['first_part_s']:.1f} s"
            + f"){'' if e['identical_output'] else '  OUTPUT DIFFERS'}"
        )
    return "\n".join(lines)


def _assess_all(scanner: Scanner, ids: list[list[int]]) -> None:
    for text_ids in ids:
        scanner._assess(text_ids)
