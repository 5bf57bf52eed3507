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

**Statistics.** ``model_free`` is the statistic a service without a model takes;
``model`` weights every scored token by the embedded model's informativeness of it
(:func:`worldcup_core.model_weights.model_token_weights`, from the chunk alone, never
the key: computed once per chunk and reused under every key), as the HF service does.

**Null texts.** Human chunks, and with ``model_texts`` unwatermarked answers of the
embedded model itself (T 0.7, ELI5 questions, no key), the null most like the
watermarked text the service reads.

**Joint test** (:func:`null_joint_p_values`): ``size`` null texts read together
(:func:`worldcup_core.collection.read_collection`) under a fresh key, message-free
and at the registry's payload length, combined as the service combines them
(:meth:`~worldcup_core.collection.CollectionResult.tests`, one key tried), and the group
search over ``users`` users x ``entries`` issued entries each: every
collection is one null sample of the joint p and of the named group's corrected p.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worldcup_core import WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.assess import TestP, assess
from worldcup_core.collection import read_collection
from worldcup_core.config import service_config
from worldcup_core.detector_model import model_applies, model_text_cells
from worldcup_core.detector_weighted import verdict_log_p, verdict_match
from worldcup_core.message import MessageIdCodec
from worldcup_core.registry_lookup import exhaustive_match, text_cells

CHUNK = 128
NUM_BITS = 32
LEVELS = (0.1, 0.01, 1e-3, 1e-4)
F64 = npt.NDArray[np.float64]


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


def _batches(count: int, texts: int, per_key: int, rng: np.random.Generator) -> Iterator[list[int]]:
    """``texts`` samples (indices into ``count`` chunks) in groups of ``per_key``, each
    group for a fresh key; the chunks are shuffled and reused across rounds when
    ``texts`` exceeds them."""
    done = 0
    while done < texts:
        order = rng.permutation(count)
        for start in range(0, len(order), per_key):
            take = min(per_key, texts - done)
            if take <= 0:
                return
            batch = [int(i) for i in order[start : start + take]]
            yield batch
            done += len(batch)


def null_p_values(
    chunks: list[list[int]],
    texts: int,
    seed: int | None = None,
    per_key: int = 8,
    registry_size: int = 20,
    config: WatermarkConfig | None = None,
    weights: list[F64] | None = None,
    progress: Callable[[int], None] | None = None,
) -> NullSample:
    """The verdict's p (and its components) on ``texts`` null samples, a fresh key
    per ``per_key`` chunks; ``seed`` None draws the keys from the OS. With ``weights``
    (one array per chunk, from the chunk and the model only) the model-assisted
    statistic, as the HF service takes it; ``progress`` is told each batch's size."""
    rng = np.random.default_rng(seed)
    cfg = config or service_config()
    if weights is not None and len(weights) != len(chunks):
        raise ValueError("weights: one array per chunk")
    combined, detect, decode, registry = [], [], [], []
    keys = 0
    for picked in _batches(len(chunks), texts, per_key, rng):
        batch = [chunks[i] for i in picked]
        w = None if weights is None else [weights[i] for i in picked]
        secret = rng.bytes(32) if seed is not None else secrets.token_bytes(32)
        key = WatermarkKey(secret)
        scheme = WorldCup(key, cfg)
        keys += 1
        codec = MessageIdCodec(key, NUM_BITS)
        issued = rng.choice(2**20, size=registry_size, replace=False)
        candidates = [codec.payload(int(i)).bits for i in issued]
        payloads = np.array([int(b, 2) for b in candidates], dtype=np.uint64)
        free = np.exp(verdict_log_p(scheme, batch, None, w))
        known = np.exp(verdict_log_p(scheme, batch, NUM_BITS, w))
        for j, (ids, d, k) in enumerate(zip(batch, free, known, strict=True)):
            tw = None if w is None else w[j]
            if tw is not None and model_applies(cfg):  # as the service ranks entries
                ones, trials, cells = model_text_cells(key, cfg, ids, NUM_BITS, tw)
                match = exhaustive_match(
                    text_cells(ones, trials, NUM_BITS, cells), payloads, registry_size
                )
            else:
                match = scheme.match(ids, candidates)
            if match is not None:  # the registry test the verdict takes (weighted)
                match = verdict_match(scheme, ids, match, registry_size, tw)
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
        if progress is not None:
            progress(len(batch))
    return NullSample(
        np.array(combined), np.array(detect), np.array(decode), np.array(registry), keys
    )


@dataclass(frozen=True)
class JointSample:
    joint: F64  # the joint verdict's p per null collection (its tests combined)
    group: F64  # the best group's corrected p, per searched collection (1: none found)
    collections: int
    size: int  # texts per collection
    groups: int  # distinct values searched per collection
    detect: F64 = dataclasses.field(
        default_factory=lambda: np.zeros(0)
    )  # the joint test, message-free
    decode: F64 = dataclasses.field(
        default_factory=lambda: np.zeros(0)
    )  # ... at the payload length


def null_joint_p_values(
    chunks: Sequence[Sequence[int]],
    collections: int,
    size: int = 5,
    users: int = 20,
    entries: int = 5,
    seed: int | None = None,
    config: WatermarkConfig | None = None,
    weights: Sequence[F64] | None = None,
    progress: Callable[[int], None] | None = None,
    searched: int | None = None,
) -> JointSample:
    """``collections`` null collections of ``size`` distinct chunks, each read together
    under a fresh key (message-free joint test); the first ``searched`` (default: all)
    also with a registry of ``users`` users of ``entries`` issued entries each searched
    for the group that best explains it (the group search costs ~100 joint tests)."""
    if size > len(chunks):
        raise ValueError(f"a collection of {size} texts needs as many chunks")
    rng = np.random.default_rng(seed)
    cfg = config or service_config()
    joint, group, detect, decode = [], [], [], []
    searched = collections if searched is None else min(searched, collections)
    for n in range(collections):
        picked = rng.choice(len(chunks), size=size, replace=False)
        secret = rng.bytes(32) if seed is not None else secrets.token_bytes(32)
        key = WatermarkKey(secret)
        codec = MessageIdCodec(key, NUM_BITS)
        ids = rng.choice(2**20, size=users * entries, replace=False)
        groups = {
            f"user-{u}": [codec.payload(int(i)).bits for i in ids[u * entries : (u + 1) * entries]]
            for u in range(users)
        }
        found = read_collection(
            key,
            cfg,
            [chunks[int(i)] for i in picked],
            None,
            None if weights is None else [weights[int(i)] for i in picked],
            groups if n < searched else None,
            lengths=(NUM_BITS,),
        )
        tests = found.tests()
        joint.append(assess(tests, 1, "one random key").p_value)
        detect.append(float(tests[0].p_value or 1.0))
        decode.append(float(tests[1].p_value or 1.0))
        if n < searched:
            gp = found.group_p_value
            group.append(1.0 if gp is None else gp)
        if progress is not None:
            progress(1)
    return JointSample(
        np.array(joint),
        np.array(group),
        collections,
        size,
        users,
        np.array(detect),
        np.array(decode),
    )


def eli5_questions(data_dir: Path) -> list[str]:
    """The evaluation data's ELI5 questions, in file order."""
    out = []
    for line in (data_dir / "eli5_longform_qa.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            question = str(json.loads(line).get("input") or "").strip()
            if question:
                out.append(question)
    return out


def model_null_texts(
    lm: Any,
    questions: Sequence[str],
    count: int,
    tokens: int = CHUNK,
    batch: int = 16,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """``count`` unwatermarked answers of ``lm`` (no key: the service's sampling at
    T 0.7, top-k 50, top-p 0.95, no 4-gram repeats) to the last ``count`` questions,
    each exactly ``tokens`` long (EOS held off until then)."""
    from worldcup_core import SamplingConfig
    from worldcup_core.generation import GenerationRequest, generate
    from worldcup_eval.data import chat_prompt_ids

    if count > len(questions):
        raise ValueError(f"{count} model texts need as many questions ({len(questions)})")
    asked = list(questions[len(questions) - count :])  # the first ones serve the benches
    out: list[list[int]] = []
    for start in range(0, count, batch):
        requests = [
            GenerationRequest(
                chat_prompt_ids(lm.tokenizer, q, q),
                SamplingConfig(
                    temperature=0.7,
                    top_k=50,
                    top_p=0.95,
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    no_repeat_ngram_size=4,
                    seed=seed * 1_000_003 + start + i,
                ),
            )
            for i, q in enumerate(asked[start : start + batch])
        ]
        results = generate(lm.model, requests, lm.eos_token_ids, lm.pad_token_id)
        out.extend(list(r.token_ids) for r in results)
        if progress is not None:
            progress(len(requests))
    return out


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
    head = f"{n} null (text, key) pairs ({CHUNK}-token texts), {sample.keys} random keys\n"
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


def joint_table(sample: JointSample, levels: tuple[float, ...] = LEVELS) -> str:
    n = sample.collections
    head = (
        f"{n} null collections of {sample.size} texts read together, a fresh key each; "
        f"the group search over {sample.groups} users on {len(sample.group)} of them\n"
    )
    lines = [
        "| level t | joint verdict rate (count) | message-free (exact) | payload length known "
        "(exact) | SE | group named rate (count) | SE |",
        "|---|---|---|---|---|---|---|",
    ]
    joint = tail_rows(sample.joint, levels)
    parts = [tail_rows(x, levels) if len(x) else [] for x in (sample.detect, sample.decode)]
    group = tail_rows(sample.group, levels) if len(sample.group) else []
    for i, t in enumerate(levels):
        g = f"{group[i]['rate']:.2e} ({group[i]['count']}) | {group[i]['se']:.1e}" if group else ""
        cells = [f"{p[i]['rate']:.2e} ({p[i]['count']})" if p else "-" for p in parts]
        lines.append(
            f"| {t:g} | {joint[i]['rate']:.2e} ({joint[i]['count']}) | {cells[0]} | {cells[1]} | "
            f"{joint[i]['se']:.1e} | " + (g if len(sample.group) else "- | -") + " |"
        )
    return head + "\n".join(lines)
