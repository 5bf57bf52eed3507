"""The model-side work: generation, perplexity, paraphrasing, batched and cached.

**One generation per cell, at the longest length.** Each (scheme, payload
length) cell is generated once with ``max_new_tokens = max(lengths)``; the
128-token table reads the first 128 tokens. Sampling is causal -- token t
depends only on the prompt and tokens < t, and stopping at EOS is decided
token by token -- so the first 128 tokens of a 256-token generation have
exactly the distribution of a 128-token generation (a text that ended at EOS
before 128 tokens is the same text either way). Unwatermarked text does not
depend on the payload and is generated once.

**Rows.** Prompt i gets the sampling seed ``int_seed(seed, "sample", i)`` in
every cell (paired comparisons across schemes) and the payload
``Payload.random(b, rng_for(seed, "payload", b, i))`` in every b-bit cell.
Every scheme uses the run's key (:func:`worldcup_eval.seeding.eval_key`).

**Self-perplexity.** After a batch is generated, one forward pass (in
micro-batches, left-padded like the generation loop) gives the generating
model's log-probability of every generated token given the prompt and the
tokens before it: the raw model distribution, without temperature, top-k,
top-p or the watermark. They are cached with the batch, so the perplexity of
any prefix is ``exp(-mean(logprobs[:L]))``.

**Paraphrase attack.** The same model, unwatermarked, rewrites each
watermarked ``attack_length``-token text through its chat template, with
temperature ``paraphrase_temperature`` (0.7, as the paper's GPT-4o rephrase),
top-k 50, top-p 0.95, no-repeat-4-gram over prompt and output (so the
source cannot be copied verbatim), at most ``attack_length`` new tokens.

**Second scorer.** With ``scorer_model``, the prompt text and each evaluated
prefix's text are re-tokenised with the scorer's tokenizer and scored the
same way (one cache entry per prefix length).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from worldcup_core import Payload, SamplingConfig, WorldCup
from worldcup_core.baselines import BASELINES, build_baseline
from worldcup_core.generation import GenerationRequest, generate
from worldcup_core.models import LoadedModel
from worldcup_core.scheme import WatermarkScheme
from worldcup_eval.attacks import paraphrase_prompt_ids
from worldcup_eval.cache import CACHE_VERSION, BatchCache, stable_hash
from worldcup_eval.config import EvalConfig, SchemeSpec
from worldcup_eval.data import EvalPrompt, batches
from worldcup_eval.seeding import eval_key, int_seed, rng_for

PPL_MICRO_BATCH = 2  # (rows x tokens x vocab) float32 logits stay ~100 MB on SmolLM2


@dataclass(frozen=True)
class GenCell:
    """One generation cell: a scheme and a payload length (None when unwatermarked)."""

    spec: SchemeSpec
    bits: int | None

    @property
    def label(self) -> str:
        return self.spec.name if self.bits is None else f"{self.spec.name}/{self.bits}b"


@dataclass(frozen=True)
class Job:
    """A batch of work whose result lands in ``path``."""

    kind: str
    label: str
    path: Path
    run: Callable[[], dict[str, Any]]


def build_scheme(cfg: EvalConfig, spec: SchemeSpec) -> WatermarkScheme | None:
    key = eval_key(cfg.seed)
    if spec.kind == "none":
        return None
    if spec.kind in BASELINES:
        return build_baseline(spec.kind, key, spec.strength)
    if spec.kind.startswith("worldcup-"):  # a design experiment (issues #29, #40)
        from worldcup_eval.ideas import idea_scheme

        return idea_scheme(spec.kind.removeprefix("worldcup-"), key, cfg.watermark_config(spec))
    return WorldCup(key, cfg.watermark_config(spec))


def model_fingerprint(model_path: str | None, dtype: str, device: str) -> dict[str, Any]:
    """What identifies the weights in cache keys, without loading them.

    The model's id (the embedded model's name or the directory), a hash of its
    ``config.json`` and the dtype it runs in. The device is left out: a cache
    made on one device is reused on another (numerics may differ in the last
    bits, so a rerun from scratch on another device is a fresh sample).
    """
    from worldcup_core.models import EMBEDDED_MODEL_ID, resolve_model_dir

    resolved = dtype
    if dtype == "auto":
        resolved = "bfloat16" if device.startswith("cuda") else "float32"
    config: dict[str, Any] = {}
    directory = resolve_model_dir(model_path, None, need_model=False)
    if (directory / "config.json").is_file():
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    return {
        "model": model_path or EMBEDDED_MODEL_ID,
        "config": stable_hash(config),
        "dtype": resolved,
    }


def row_payload(cfg: EvalConfig, bits: int, index: int) -> Payload:
    return Payload.random(bits, rng_for(cfg.seed, "payload", bits, index))


def _prompt_key(prompts: Sequence[EvalPrompt]) -> str:
    return stable_hash([[p.index, list(p.prompt_ids)] for p in prompts])


# --------------------------------------------------------------------------- log-probabilities


@torch.inference_mode()
def continuation_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    pad_token_id: int,
    micro_batch: int = PPL_MICRO_BATCH,
) -> list[list[float]]:
    """log p(c_t | prompt, c_<t) under ``model`` for every continuation token."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for start in range(0, len(prompts), micro_batch):
        ps = prompts[start : start + micro_batch]
        cs = continuations[start : start + micro_batch]
        seqs = [list(p) + list(c) for p, c in zip(ps, cs, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(c) for c in cs) + 1
        try:
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep
            ).logits
        except TypeError:  # a model class without logits_to_keep: full logits
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for i, c in enumerate(cs):
            if not c:
                out.append([])
                continue
            rows = logits[i, -(len(c) + 1) : -1].float().log_softmax(-1)
            target = torch.tensor(list(c), device=device)[:, None]
            out.append([round(float(v), 5) for v in rows.gather(1, target)[:, 0].cpu()])
    return out


# --------------------------------------------------------------------------- generation


def sampling_key(sampling: SamplingConfig) -> dict[str, Any]:
    """The sampling settings as the cache key hashes them.

    Fields added to :class:`SamplingConfig` after the cache's format was fixed are
    left out while at their defaults (where they change nothing), so that a new field
    does not orphan every committed cell; set to anything else, they enter the key.
    """
    out = asdict(sampling)
    defaults = SamplingConfig()
    for name in LATER_SAMPLING_FIELDS:
        if out[name] == getattr(defaults, name):
            del out[name]
    return out


# SamplingConfig's fields newer than the committed cache (docs/results/cache); see sampling_key
LATER_SAMPLING_FIELDS = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "logprobs_mode",
    "prompt_logprobs",
)


def gen_cell_key(cfg: EvalConfig, cell: GenCell, model_fp: dict[str, Any]) -> str:
    return stable_hash(
        {
            "v": CACHE_VERSION,
            "model": model_fp,
            "scheme": cell.spec.describe(),
            "bits": cell.bits,
            "sampling": sampling_key(cfg.sampling),
            "seed": cfg.seed,
            "batch_size": cfg.batch_size,
        }
    )


def _generate_rows(
    lm: LoadedModel | None,
    requests: list[GenerationRequest],
) -> tuple[list[Any], float]:
    if lm is None:
        raise RuntimeError("this batch is not cached and no model is loaded (--report-only)")
    start = time.perf_counter()
    results = generate(lm.model, requests, lm.eos_token_ids, lm.pad_token_id)
    return results, time.perf_counter() - start


def gen_jobs(
    cfg: EvalConfig,
    lm: LoadedModel | None,
    cell: GenCell,
    prompts: list[EvalPrompt],
    cache: BatchCache,
    model_fp: dict[str, Any],
) -> list[Job]:
    """One job per batch of prompts; ``Job.run`` generates and scores it."""
    cell_key = gen_cell_key(cfg, cell, model_fp)
    scheme = build_scheme(cfg, cell.spec)
    jobs = []
    for b, chunk in enumerate(batches(prompts, cfg.batch_size)):
        path = cache.path("gen", cell_key, b, _prompt_key(chunk))

        def run(chunk: list[EvalPrompt] = chunk) -> dict[str, Any]:
            requests, payloads, seeds = [], [], []
            for p in chunk:
                seed = int_seed(cfg.seed, "sample", p.index)
                payload = row_payload(cfg, cell.bits, p.index) if cell.bits else None
                sampling = SamplingConfig(**{**asdict(cfg.sampling), "seed": seed})
                requests.append(GenerationRequest(list(p.prompt_ids), sampling, scheme, payload))
                payloads.append(payload.bits if payload else None)
                seeds.append(seed)
            results, seconds = _generate_rows(lm, requests)
            assert lm is not None
            start = time.perf_counter()
            logprobs = continuation_logprobs(
                lm.model,
                [p.prompt_ids for p in chunk],
                [r.token_ids for r in results],
                lm.pad_token_id,
            )
            ppl_seconds = time.perf_counter() - start
            return {
                "cell": cell.label,
                "rows": [
                    {
                        "index": p.index,
                        "dataset": p.dataset,
                        "payload": payload,
                        "seed": seed,
                        "token_ids": r.token_ids,
                        "finish_reason": r.finish_reason,
                        "logprobs": lp,
                    }
                    for p, payload, seed, r, lp in zip(
                        chunk, payloads, seeds, results, logprobs, strict=True
                    )
                ],
                "seconds": seconds,
                "tokens": sum(len(r.token_ids) for r in results),
                "ppl_seconds": ppl_seconds,
            }

        jobs.append(Job("generate", cell.label, path, run))
    return jobs


# --------------------------------------------------------------------------- paraphrase


def paraphrase_jobs(
    cfg: EvalConfig,
    lm: LoadedModel | None,
    cell: GenCell,
    source_key: str,
    rows: list[dict[str, Any]],
    cache: BatchCache,
    model_fp: dict[str, Any],
) -> list[Job]:
    """Paraphrase each row's first ``attack_len`` tokens with the model, unwatermarked."""
    length = cfg.attack_len
    settings = {
        "temperature": cfg.paraphrase_temperature,
        "top_k": 50,
        "top_p": 0.95,
        "max_new_tokens": length,
        "min_new_tokens": min(cfg.min_new_tokens, length),
        "no_repeat_ngram_size": 4,
    }
    cell_key = stable_hash(
        {
            "v": CACHE_VERSION,
            "model": model_fp,
            "source": source_key,
            "length": length,
            "settings": settings,
            "seed": cfg.seed,
            "batch_size": cfg.batch_size,
        }
    )
    jobs = []
    for b in range(0, len(rows), cfg.batch_size):
        chunk = rows[b : b + cfg.batch_size]
        batch_key = stable_hash([[r["index"], r["token_ids"][:length]] for r in chunk])
        path = cache.path("paraphrase", cell_key, b // cfg.batch_size, batch_key)

        def run(chunk: list[dict[str, Any]] = chunk) -> dict[str, Any]:
            if lm is None:
                raise RuntimeError("paraphrases are not cached and no model is loaded")
            requests = []
            for r in chunk:
                source = lm.tokenizer.decode(r["token_ids"][:length], skip_special_tokens=True)
                seed = int_seed(cfg.seed, "paraphrase", cell.label, r["index"])
                sampling = SamplingConfig(**settings, seed=seed)  # type: ignore[arg-type]
                requests.append(
                    GenerationRequest(paraphrase_prompt_ids(lm.tokenizer, source), sampling)
                )
            results, seconds = _generate_rows(lm, requests)
            return {
                "cell": cell.label,
                "rows": [
                    {
                        "index": r["index"],
                        "token_ids": res.token_ids,
                        "text": lm.tokenizer.decode(res.token_ids, skip_special_tokens=True),
                        "finish_reason": res.finish_reason,
                    }
                    for r, res in zip(chunk, results, strict=True)
                ],
                "seconds": seconds,
                "tokens": sum(len(res.token_ids) for res in results),
            }

        jobs.append(Job("paraphrase", cell.label, path, run))
    return jobs


# --------------------------------------------------------------------------- second scorer


def scorer_jobs(
    cfg: EvalConfig,
    tokenizer: Any,
    scorer: LoadedModel | None,
    cell: GenCell,
    source_key: str,
    rows: list[dict[str, Any]],
    prompts: dict[int, EvalPrompt],
    length: int,
    cache: BatchCache,
    scorer_fp: dict[str, Any],
) -> list[Job]:
    """Per-token log-probabilities of each row's first ``length`` tokens under ``scorer``."""
    cell_key = stable_hash(
        {"v": CACHE_VERSION, "scorer": scorer_fp, "source": source_key, "length": length}
    )
    jobs = []
    for b in range(0, len(rows), cfg.batch_size):
        chunk = rows[b : b + cfg.batch_size]
        batch_key = stable_hash([[r["index"], r["token_ids"][:length]] for r in chunk])
        path = cache.path("scorer", cell_key, b // cfg.batch_size, batch_key)

        def run(chunk: list[dict[str, Any]] = chunk) -> dict[str, Any]:
            if scorer is None:
                raise RuntimeError(
                    "scorer log-probabilities are not cached and no scorer is loaded"
                )
            tok = scorer.tokenizer
            ctx = [
                tok(prompts[r["index"]].prompt_text, add_special_tokens=False).input_ids
                for r in chunk
            ]
            texts = [
                tokenizer.decode(r["token_ids"][:length], skip_special_tokens=True) for r in chunk
            ]
            conts = [tok(t, add_special_tokens=False).input_ids for t in texts]
            lps = continuation_logprobs(scorer.model, ctx, conts, scorer.pad_token_id)
            return {
                "rows": [
                    {"index": r["index"], "logprobs": lp} for r, lp in zip(chunk, lps, strict=True)
                ]
            }

        jobs.append(Job("scorer", cell.label, path, run))
    return jobs
