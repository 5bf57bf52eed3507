"""Helpers shared by the baseline tests (BiMark, StealthInk): text sources and checks.

Not a test module: the synthetic generation loop, the human-text chunks of the
calibration suite, and the exact-binomial FPR check.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import stats

from worldcup_core.message import Payload
from worldcup_core.scheme import WatermarkScheme

VOCAB = 49152  # SmolLM2's vocabulary: random texts draw from it
CHUNK_LENGTHS = (128, 256)
FPR_LEVELS = (1e-2, 1e-3)


def generate_synthetic(
    scheme: WatermarkScheme,
    payload: Payload,
    n: int,
    rng: np.random.Generator,
    vocab: int = 1000,
    scale: float = 1.0,
) -> list[int]:
    """The generation loop without a model: random logits, softmax, the scheme's hooks, a draw."""
    seq = scheme.sequence(payload)
    candidates = np.arange(vocab, dtype=np.int64)
    out: list[int] = []
    for _ in range(n):
        logits = seq.process_logits(rng.normal(size=vocab) * scale)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        q = seq.reweight(candidates, probs)
        token = int(rng.choice(vocab, p=q / q.sum()))
        seq.observe(token)
        out.append(token)
    return out


def registry_around(
    bits: str, rng: np.random.Generator, size: int = 500, at: int = 137
) -> list[str]:
    """A registry of ``size`` distinct payloads of ``bits``' length, ``bits`` at index ``at``."""
    others: set[str] = set()
    while len(others) < size - 1:
        candidate = Payload.random(len(bits), rng).bits
        if candidate != bits:
            others.add(candidate)
    registry = sorted(others)
    registry.insert(at, bits)
    return registry


def random_texts(seed: int, count: int, small_vocab: int = 400) -> list[list[int]]:
    """Uniform token ids of lengths 128/256, the last ``small_vocab`` over 8 ids (many
    repeated contexts, so the skip rule is exercised)."""
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(count):
        length = CHUNK_LENGTHS[i % 2]
        if i < count - small_vocab:
            texts.append(rng.integers(0, VOCAB, size=length).tolist())
        else:
            ids = rng.choice(VOCAB, size=8, replace=False)
            texts.append(ids[rng.integers(0, 8, size=length)].tolist())
    return texts


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def human_chunks(data_dir: Path, tokenizer: Any) -> list[list[int]]:
    """CNN/DailyMail articles and ELI5 answers, tokenised, cut into 128/256-token chunks."""
    documents = [row["article"] for row in _read_jsonl(data_dir / "cnn_dailymail_test.jsonl")]
    for row in _read_jsonl(data_dir / "eli5_longform_qa.jsonl"):
        documents.extend(row["outputs"])
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    chunks = []
    for ids in encoded:
        start, i = 0, 0
        while start + CHUNK_LENGTHS[i % 2] <= len(ids):
            chunks.append(list(ids[start : start + CHUNK_LENGTHS[i % 2]]))
            start += CHUNK_LENGTHS[i % 2]
            i += 1
    return chunks


def assert_fpr_nominal(pvalues: npt.NDArray[np.float64], what: str) -> None:
    """At 1e-2 and 1e-3, the false-positive count is within sampling error of nominal:
    an exact two-sided binomial test of ``#(p < alpha) ~ Bin(n, alpha)`` does not reject
    at 1e-4. Fails both an anti-conservative and a dead (never-rejecting) detector at 1e-2."""
    n = len(pvalues)
    for alpha in FPR_LEVELS:
        k = int(np.sum(pvalues < alpha))
        test = stats.binomtest(k, n, alpha)
        assert test.pvalue > 1e-4, f"{what}: FPR at {alpha} is {k}/{n} = {k / n:.5f}"


def assert_fpr_at_most_nominal(pvalues: npt.NDArray[np.float64], what: str) -> None:
    """Conservative version (a Šidák scan): FPR not above nominal beyond sampling error."""
    n = len(pvalues)
    for alpha in FPR_LEVELS:
        k = int(np.sum(pvalues < alpha))
        assert stats.binom.sf(k - 1, n, alpha) > 1e-4, f"{what}: FPR at {alpha} is {k}/{n}"


def chi_square_against(counts: npt.NDArray[np.int64], probs: npt.NDArray[np.float64]) -> float:
    """Pearson chi-square p-value of token counts against a distribution."""
    expected = probs / probs.sum() * counts.sum()
    return float(stats.chisquare(counts, expected).pvalue)


def model_round_trip(
    scheme: WatermarkScheme, model: Any, data_dir: Path, prompts: int = 8, bits: int = 16
) -> tuple[list[Payload], list[list[int]]]:
    """Generate with the embedded model from news prompts, then re-tokenise the *text*:
    (payloads, token ids of each detokenised response)."""
    from worldcup_core.config import SamplingConfig
    from worldcup_core.generation import GenerationRequest, generate

    tok = model.tokenizer
    articles = [row["article"] for row in _read_jsonl(data_dir / "cnn_dailymail_test.jsonl")]
    rng = np.random.default_rng(2026)
    payloads = [Payload.random(bits, rng) for _ in range(prompts)]
    requests = [
        GenerationRequest(
            tok(article, add_special_tokens=False).input_ids[:40],
            SamplingConfig(max_new_tokens=128, min_new_tokens=96, seed=i),
            scheme,
            payload,
        )
        for i, (article, payload) in enumerate(zip(articles, payloads, strict=False))
    ]
    results = generate(model.model, requests, model.eos_token_ids, model.pad_token_id)
    texts = [tok.decode(r.token_ids, skip_special_tokens=True) for r in results]
    return payloads, [list(tok(t, add_special_tokens=False).input_ids) for t in texts]
