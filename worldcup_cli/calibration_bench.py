"""``worldcup bench calibration``: the null calibration of the one verdict's p-value.

Human text (the evaluation data's CNN/DailyMail articles and ELI5 answers, in
128-token chunks) is scored under many random keys, each key over a few chunks,
as the service scores a tenant with one key version and a registry of
``registry_size`` issued 32-bit entries: the message-free test, the test at the
payload length, and the registry match, combined by :func:`worldcup_core.assess.assess`.
Every (chunk, key) pair is one null sample; the keys are independent, so the
samples are independent under the PRF assumption even where chunks repeat.

The combined p is conservative by construction (weighted Bonferroni), so its tail
rate should sit at or below each nominal level; the component p-values (detect,
decode) are exact and should sit on it. Printed: the empirical rate of p < t with
its binomial standard error, for t down to 1e-4.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worldcup_core import WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.assess import TestP, assess
from worldcup_core.config import SERVICE_PRESET, WATERMARK_PRESETS
from worldcup_core.detector_weighted import verdict_log_p, verdict_match
from worldcup_core.message import MessageIdCodec

CHUNK = 128
NUM_BITS = 32
LEVELS = (0.1, 0.01, 1e-3, 1e-4)


@dataclass(frozen=True)
class NullSample:
    combined: npt.NDArray[np.float64]
    detect: npt.NDArray[np.float64]
    decode: npt.NDArray[np.float64]
    registry: npt.NDArray[np.float64]
    keys: int


def human_chunks(data_dir: Path, tokenizer: Any, length: int = CHUNK) -> list[list[int]]:
    """Consecutive ``length``-token chunks of every human document in the data."""
    documents: list[str] = []
    for name, field in (
        ("cnn_dailymail_test.jsonl", "article"),
        ("eli5_longform_qa.jsonl", "outputs"),
    ):
        for line in (data_dir / name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                value = json.loads(line).get(field) or ""
                documents.extend(value if isinstance(value, list) else [value])
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return [
        list(ids[s : s + length])
        for ids in encoded
        for s in range(0, len(ids) - length + 1, length)
    ]


def service_config() -> WatermarkConfig:
    preset = WATERMARK_PRESETS[SERVICE_PRESET]
    return WatermarkConfig(groups=preset.groups, layers=preset.layers, alpha=preset.alpha)


def _batches(
    chunks: list[list[int]], texts: int, per_key: int, rng: np.random.Generator
) -> Iterator[list[list[int]]]:
    """``texts`` samples in groups of ``per_key`` chunks, each group for a fresh key;
    the chunks are shuffled and reused across rounds when ``texts`` exceeds them."""
    done = 0
    while done < texts:
        order = rng.permutation(len(chunks))
        for start in range(0, len(order), per_key):
            take = min(per_key, texts - done)
            if take <= 0:
                return
            batch = [chunks[i] for i in order[start : start + take]]
            yield batch
            done += len(batch)


def null_p_values(
    chunks: list[list[int]],
    texts: int,
    seed: int | None = None,
    per_key: int = 8,
    registry_size: int = 20,
    config: WatermarkConfig | None = None,
) -> NullSample:
    """The verdict's p (and its components) on ``texts`` null samples, a fresh key
    per ``per_key`` chunks; ``seed`` None draws the keys from the OS."""
    rng = np.random.default_rng(seed)
    cfg = config or service_config()
    combined, detect, decode, registry = [], [], [], []
    keys = 0
    for batch in _batches(chunks, texts, per_key, rng):
        secret = rng.bytes(32) if seed is not None else secrets.token_bytes(32)
        key = WatermarkKey(secret)
        scheme = WorldCup(key, cfg)
        keys += 1
        codec = MessageIdCodec(key, NUM_BITS)
        issued = rng.choice(2**20, size=registry_size, replace=False)
        candidates = [codec.payload(int(i)).bits for i in issued]
        free = np.exp(verdict_log_p(scheme, batch, None))
        known = np.exp(verdict_log_p(scheme, batch, NUM_BITS))
        for ids, d, k in zip(batch, free, known, strict=True):
            match = scheme.match(ids, candidates)
            if match is not None:  # the registry test the verdict takes (layer-weighted)
                match = verdict_match(scheme, ids, match, registry_size)
            reg = match.p_value if match is not None else None
            tests = [
                TestP("detect", float(d)),
                TestP("decode", float(k), NUM_BITS),
                TestP("registry", reg, NUM_BITS, registry_size),
            ]
            combined.append(assess(tests, 1, "one random key", None).p_value)
            detect.append(float(d))
            decode.append(float(k))
            registry.append(1.0 if reg is None else reg)
    return NullSample(
        np.array(combined), np.array(detect), np.array(decode), np.array(registry), keys
    )


def tail_rows(
    p_values: npt.NDArray[np.float64], levels: tuple[float, ...] = LEVELS
) -> list[dict[str, float]]:
    """Empirical rate of p < t with its binomial standard error, per level."""
    n = len(p_values)
    rows = []
    for t in levels:
        rate = float(np.mean(p_values < t))
        rows.append(
            {
                "level": t,
                "rate": rate,
                "se": math.sqrt(t * (1 - t) / n),
                "count": int(np.sum(p_values < t)),
            }
        )
    return rows


def table(sample: NullSample, levels: tuple[float, ...] = LEVELS) -> str:
    n = len(sample.combined)
    head = f"{n} null texts ({CHUNK} tokens of human text), {sample.keys} random keys\n"
    lines = [
        "| level t | "
        + " | ".join(
            f"{name} rate (count)" for name in ("verdict p", "detect", "decode", "registry")
        )
        + " | SE at t |",
        "|---|---|---|---|---|---|",
    ]
    columns = [
        tail_rows(p, levels)
        for p in (sample.combined, sample.detect, sample.decode, sample.registry)
    ]
    for i, t in enumerate(levels):
        cells = [f"{c[i]['rate']:.2e} ({c[i]['count']})" for c in columns]
        lines.append(f"| {t:g} | " + " | ".join(cells) + f" | {columns[0][i]['se']:.1e} |")
    return head + "\n".join(lines)
