"""Prompts, natural continuations and null text, from ``../shared/data``.

Two tasks, as in the issue (and the paper's Section 4.1 / Appendix C):

* ``cnn``, C4/OpenGen-style completion: the first ``prompt_tokens`` (40)
  tokens of a CNN/DailyMail article are the prompt, fed raw (no chat
  template); the rest of the article is the human continuation.
* ``eli5``, long-form QA: the question goes through the model's chat template
  (a plain ``Question:/Answer:`` frame when it has none); the human answers,
  joined by blank lines, are the continuation.

Only rows whose continuation has at least ``max_length`` tokens are used, so
every human negative is exactly as long as the generations it is compared
with. Each dataset is shuffled with a seed of its own and the two are
interleaved (cnn, eli5, cnn, ...), so the first N prompts of a bigger run are
the N prompts of a smaller one and cached batches are reused.

The human pool for the empirical false-positive rate is every non-overlapping
``length``-token chunk of the continuations of *all* rows (not only the
prompts used), interleaved across datasets and capped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldcup_eval.seeding import rng_for


@dataclass(frozen=True)
class EvalPrompt:
    index: int  # position in the run's prompt list
    dataset: str  # "cnn" or "eli5"
    source_id: str
    prompt_text: str  # the article's opening or the bare question (for a second scorer)
    prompt_ids: tuple[int, ...]
    human_ids: tuple[int, ...]  # the natural continuation, >= max_length tokens
    human_text: str


def default_data_dir() -> Path:
    """``$WORLDCUP_DATA_DIR``, else ``shared/data`` beside the checkout."""
    env = os.environ.get("WORLDCUP_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"evaluation data not found: {path} (set --data-dir or WORLDCUP_DATA_DIR)"
        )
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _ids(tokenizer: Any, text: str) -> list[int]:
    out: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return out


def chat_prompt_ids(tokenizer: Any, message: str, fallback: str) -> list[int]:
    """``message`` as a user turn in the chat template, or ``fallback`` as plain text."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return _ids(tokenizer, fallback)


@dataclass(frozen=True)
class _Source:
    dataset: str
    source_id: str
    prompt_text: str
    prompt_ids: tuple[int, ...]
    human_ids: tuple[int, ...]
    human_text: str


def _cnn_sources(tokenizer: Any, data_dir: Path, prompt_tokens: int) -> list[_Source]:
    out: list[_Source] = []
    for row in _read_jsonl(data_dir / "cnn_dailymail_test.jsonl"):
        ids = _ids(tokenizer, row["article"])
        human = ids[prompt_tokens:]
        out.append(
            _Source(
                "cnn",
                str(row["id"]),
                tokenizer.decode(ids[:prompt_tokens], skip_special_tokens=True),
                tuple(ids[:prompt_tokens]),
                tuple(human),
                tokenizer.decode(human, skip_special_tokens=True),
            )
        )
    return out


def _eli5_sources(tokenizer: Any, data_dir: Path) -> list[_Source]:
    out: list[_Source] = []
    for row in _read_jsonl(data_dir / "eli5_longform_qa.jsonl"):
        question = str(row["input"]).strip()
        answer = "\n\n".join(a.strip() for a in row.get("outputs", []) if a and a.strip())
        prompt = chat_prompt_ids(tokenizer, question, f"Question: {question}\nAnswer:")
        out.append(
            _Source(
                "eli5",
                str(row.get("_id", len(out))),
                question,
                tuple(prompt),
                tuple(_ids(tokenizer, answer)),
                answer,
            )
        )
    return out


@dataclass(frozen=True)
class EvalData:
    prompts: list[EvalPrompt]
    sources: dict[str, list[_Source]]

    def human_pool(self, length: int, cap: int) -> list[tuple[str, tuple[int, ...]]]:
        """(dataset, ids) chunks of exactly ``length`` tokens, interleaved, at most ``cap``."""
        per_dataset = []
        for name in sorted(self.sources):
            chunks = []
            for src in self.sources[name]:
                ids = src.human_ids
                chunks += [
                    (name, ids[i : i + length]) for i in range(0, len(ids) - length + 1, length)
                ]
            per_dataset.append(chunks)
        out: list[tuple[str, tuple[int, ...]]] = []
        for i in range(max((len(c) for c in per_dataset), default=0)):
            out += [c[i] for c in per_dataset if i < len(c)]
        return out[:cap]


def load_data(
    tokenizer: Any,
    data_dir: Path,
    num_prompts: int,
    datasets: tuple[str, ...],
    prompt_tokens: int,
    min_human_tokens: int,
    seed: int,
) -> EvalData:
    """The run's prompts (see the module docstring); fails if there are too few."""
    sources: dict[str, list[_Source]] = {}
    if "cnn" in datasets:
        sources["cnn"] = _cnn_sources(tokenizer, data_dir, prompt_tokens)
    if "eli5" in datasets:
        sources["eli5"] = _eli5_sources(tokenizer, data_dir)
    queues: list[list[_Source]] = []
    for name in datasets:
        eligible = [s for s in sources[name] if len(s.human_ids) >= min_human_tokens]
        order = rng_for(seed, "prompts", name).permutation(len(eligible))
        queues.append([eligible[i] for i in order])
    picked: list[_Source] = []
    for i in range(max(len(q) for q in queues)):
        picked += [q[i] for q in queues if i < len(q)]
    if len(picked) < num_prompts:
        raise ValueError(
            f"only {len(picked)} prompts have a human continuation of >= {min_human_tokens} "
            f"tokens; asked for {num_prompts}"
        )
    prompts = [
        EvalPrompt(
            i, s.dataset, s.source_id, s.prompt_text, s.prompt_ids, s.human_ids, s.human_text
        )
        for i, s in enumerate(picked[:num_prompts])
    ]
    return EvalData(prompts, sources)


def batches(items: list[EvalPrompt], size: int) -> list[list[EvalPrompt]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


__all__ = ["EvalData", "EvalPrompt", "batches", "chat_prompt_ids", "default_data_dir", "load_data"]
