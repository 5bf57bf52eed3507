"""From cached generations to numbers: detection, extraction, perplexity, attacks.

Model-free: it needs the tokenizer (to re-tokenise attacked text) and the
cached token ids and log-probabilities, so it reruns in seconds.

* **Positives** of a cell at length L: its generations cut to L tokens.
  Each is decoded with ``scheme.decode(ids, b, list_size)``, which also runs
  the calibrated detector, and timed (``decode_ms``: decode + detect from
  token ids, one text at a time).
* **Negatives** (for AUC, TPR/FPR and best-F1): the unwatermarked
  generations and the human continuations of the same prompts, both cut to L
  tokens and scored with the same key, scheme and b. Attacked texts are
  compared with the negatives at the attack length.
* **Empirical FPR on human text**: a separate, larger pool of L-token human
  chunks (see :meth:`EvalData.human_pool`), with exact 95% intervals.
* **Extraction**: exact (all b bits), list decoding (the payload is among the
  top ``list_size`` messages) and registry decoding (``scheme.match`` over
  ``registry_size - 1`` random distractors plus the payload, at a seeded
  position; the distractors are fixed per b and never equal the payload).
  ``registry_significant`` also asks the match's Bonferroni-corrected p < 0.01.
* **Perplexity**: median over texts of ``exp(-mean log p)`` of the first L
  generated tokens under the generating model (and the scorer, if any).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worldcup_core.scheme import WatermarkScheme
from worldcup_eval.attacks import (
    SynonymSubstitution,
    copy_paste,
    load_wordnet,
    split_words,
    word_deletion,
)
from worldcup_eval.config import EvalConfig
from worldcup_eval.data import EvalData, EvalPrompt
from worldcup_eval.metrics import (
    TARGET_FPRS,
    auc,
    best_f1,
    bit_accuracy,
    clopper_pearson,
    mean,
    median,
    rate_above,
    roc_curve,
    standard_error,
)
from worldcup_eval.runner import GenCell, build_scheme
from worldcup_eval.seeding import rng_for

Row = dict[str, Any]
ROC_POINTS = 200  # ROC curves in results.json are thinned to about this many points


def _r(x: float, digits: int = 6) -> float | None:
    return round(float(x), digits) if math.isfinite(x) else None


def _fpr_key(fpr: float) -> str:
    return f"fpr_{fpr:g}"


def _thin(fpr: list[float], tpr: list[float]) -> dict[str, list[float | None]]:
    step = max(1, len(fpr) // ROC_POINTS)
    idx = sorted(set(range(0, len(fpr), step)) | {len(fpr) - 1})
    return {"fpr": [_r(fpr[i], 5) for i in idx], "tpr": [_r(tpr[i], 5) for i in idx]}


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-float(np.mean(logprobs))) if len(logprobs) else math.nan


@dataclass
class Scored:
    """One positive text, decoded."""

    index: int
    dataset: str
    score: float  # -log10 p
    bit_accuracy: float
    exact: bool
    list_hit: bool
    registry_hit: bool
    registry_significant: bool
    tokens: int
    decode_ms: float
    registry_ms: float


@dataclass
class Negatives:
    unwatermarked: list[tuple[str, float]]  # (dataset, score)
    human: list[tuple[str, float]]
    pool: list[float] = field(default_factory=list)

    def scores(self, dataset: str | None = None) -> list[float]:
        return [s for d, s in self.unwatermarked + self.human if dataset in (None, d)]


class Evaluator:
    """Computes every number of the report from cached rows."""

    def __init__(
        self,
        cfg: EvalConfig,
        tokenizer: Any,
        data: EvalData,
        gen_rows: dict[GenCell, list[Row]],
        unwatermarked: GenCell,
        scorer_logprobs: dict[tuple[GenCell, int], dict[int, list[float]]],
        paraphrases: dict[GenCell, dict[int, Row]],
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.data = data
        self.prompts: dict[int, EvalPrompt] = {p.index: p for p in data.prompts}
        self.gen_rows = gen_rows
        self.unwatermarked = unwatermarked
        self.scorer_logprobs = scorer_logprobs
        self.paraphrases = paraphrases
        self._schemes: dict[str, WatermarkScheme] = {}
        self._negatives: dict[tuple[str, int, int], Negatives] = {}
        self._registries: dict[int, list[int]] = {}
        self._synonyms: SynonymSubstitution | None = None
        self.per_text: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ pieces

    def scheme(self, cell: GenCell) -> WatermarkScheme:
        if cell.spec.name not in self._schemes:
            scheme = build_scheme(self.cfg, cell.spec)
            assert scheme is not None, "unwatermarked cells have no scheme"
            self._schemes[cell.spec.name] = scheme
        return self._schemes[cell.spec.name]

    def _distractors(self, bits: int) -> list[int]:
        if bits not in self._registries:
            rng = rng_for(self.cfg.seed, "registry", bits)
            size = min(self.cfg.registry_size, 2**bits)
            if 2**bits <= 4 * size:
                values = [int(v) for v in rng.permutation(2**bits)[:size]]
            else:
                seen: dict[int, None] = {}
                while len(seen) < size:
                    seen[int.from_bytes(rng.bytes(8), "little") >> (64 - bits)] = None
                values = list(seen)
            self._registries[bits] = values
        return self._registries[bits]

    def registry(self, bits: int, index: int, payload: str) -> list[str]:
        """``registry_size`` distinct messages, the payload at a seeded position."""
        truth = int(payload, 2)
        others = [v for v in self._distractors(bits) if v != truth]
        size = min(self.cfg.registry_size, 2**bits)
        others = others[: size - 1]
        at = int(rng_for(self.cfg.seed, "registry-position", bits, index).integers(size))
        values = others[:at] + [truth] + others[at:]
        return [format(v, f"0{bits}b") for v in values]

    def negatives(self, cell: GenCell, length: int) -> Negatives:
        assert cell.bits is not None
        key = (cell.spec.name, cell.bits, length)
        if key not in self._negatives:
            scheme, bits = self.scheme(cell), cell.bits

            def score(ids: Sequence[int]) -> float:
                return -scheme.detect(list(ids), num_bits=bits).log10_p_value

            unwm = [
                (r["dataset"], score(r["token_ids"][:length]))
                for r in self.gen_rows[self.unwatermarked]
            ]
            human = [(p.dataset, score(p.human_ids[:length])) for p in self.data.prompts]
            pool = [score(ids) for _, ids in self.data.human_pool(length, self.cfg.human_texts)]
            self._negatives[key] = Negatives(unwm, human, pool)
            for (dataset, s), kind, idx in [
                *(
                    (u, "unwatermarked", r["index"])
                    for u, r in zip(unwm, self.gen_rows[self.unwatermarked], strict=True)
                ),
                *((h, "human", p.index) for h, p in zip(human, self.data.prompts, strict=True)),
            ]:
                self.per_text.append(
                    {
                        "scheme": cell.spec.name,
                        "bits": bits,
                        "length": length,
                        "attack": None,
                        "text": kind,
                        "index": idx,
                        "dataset": dataset,
                        "log10_p": _r(-s),
                    }
                )
        return self._negatives[key]

    def decode_one(self, cell: GenCell, row: Row, ids: Sequence[int]) -> Scored:
        scheme, bits = self.scheme(cell), cell.bits
        assert bits is not None
        payload: str = row["payload"]
        ids = list(ids)
        start = time.perf_counter()
        result = scheme.decode(ids, bits, list_size=self.cfg.list_size)
        decoded = time.perf_counter()
        match = scheme.match(ids, self.registry(bits, row["index"], payload))
        matched = time.perf_counter()
        hit = match is not None and match.bits == payload
        return Scored(
            index=row["index"],
            dataset=row["dataset"],
            score=-result.detection.log10_p_value,
            bit_accuracy=bit_accuracy(result.bits, payload),
            exact=result.bits == payload,
            list_hit=any(a.bits == payload for a in result.alternatives),
            registry_hit=hit,
            registry_significant=hit and match is not None and match.p_value < 0.01,
            tokens=len(ids),
            decode_ms=1e3 * (decoded - start),
            registry_ms=1e3 * (matched - decoded),
        )

    # ------------------------------------------------------------------ summaries

    def _detection(self, scored: list[Scored], neg: Negatives) -> dict[str, Any]:
        pos = [s.score for s in scored]
        negs = neg.scores()
        f1, at = best_f1(pos, negs)
        fpr, tpr = roc_curve(pos, negs)
        by_dataset = {}
        for d in sorted({s.dataset for s in scored}):
            mine = [s for s in scored if s.dataset == d]
            by_dataset[d] = {
                "n": len(mine),
                "auc": _r(auc([s.score for s in mine], neg.scores(d))),
                "bit_accuracy": _r(mean([s.bit_accuracy for s in mine])),
                "exact": _r(mean([float(s.exact) for s in mine])),
            }
        return {
            "n": len(scored),
            "auc": _r(auc(pos, negs)),
            "tpr": {_fpr_key(f): _r(rate_above(pos, f)) for f in TARGET_FPRS},
            "negatives": {
                "n_unwatermarked": len(neg.unwatermarked),
                "n_human": len(neg.human),
                **{_fpr_key(f): _r(rate_above(negs, f)) for f in TARGET_FPRS},
            },
            "best_f1": _r(f1),
            "best_f1_threshold_log10_p": _r(-at) if math.isfinite(at) else None,
            "bit_accuracy": _r(mean([s.bit_accuracy for s in scored])),
            "bit_accuracy_se": _r(standard_error([s.bit_accuracy for s in scored])),
            "extraction": {
                "exact": _r(mean([float(s.exact) for s in scored])),
                "list": _r(mean([float(s.list_hit) for s in scored])),
                "registry": _r(mean([float(s.registry_hit) for s in scored])),
                "registry_significant": _r(mean([float(s.registry_significant) for s in scored])),
            },
            "tokens_mean": _r(mean([float(s.tokens) for s in scored]), 2),
            "by_dataset": by_dataset,
            "roc": _thin(fpr, tpr),
            "timing": {
                "decode_ms_mean": _r(mean([s.decode_ms for s in scored]), 4),
                "decode_ms_median": _r(median([s.decode_ms for s in scored]), 4),
                "registry_ms_mean": _r(mean([s.registry_ms for s in scored]), 4),
            },
        }

    def _human_fpr(self, neg: Negatives) -> dict[str, Any]:
        out: dict[str, Any] = {"n": len(neg.pool)}
        for f in TARGET_FPRS:
            k = int(sum(s > -math.log10(f) for s in neg.pool))
            lo, hi = clopper_pearson(k, len(neg.pool))
            out[_fpr_key(f)] = {
                "false_positives": k,
                "rate": _r(k / len(neg.pool)) if neg.pool else None,
                "ci95": [_r(lo), _r(hi)],
            }
        return out

    def _ppl(self, cell: GenCell, length: int) -> dict[str, Any]:
        rows = self.gen_rows[cell]
        own = [perplexity(r["logprobs"][:length]) for r in rows]
        scorer = self.scorer_logprobs.get((cell, length))
        other = [perplexity(scorer[r["index"]]) for r in rows] if scorer else []
        return {
            "self_median": _r(median(own), 4),
            "scorer_median": _r(median(other), 4) if other else None,
            "self_all": [_r(v, 3) for v in own],
        }

    def cell(self, cell: GenCell, length: int, role: str) -> dict[str, Any]:
        """Every number of one (scheme, bits, length) cell."""
        rows = self.gen_rows[cell]
        ppl = self._ppl(cell, length)
        base: dict[str, Any] = {
            "scheme": cell.spec.name,
            "bits": cell.bits,
            "length": length,
            "role": role,
            "ppl": ppl,
        }
        if cell.bits is None:
            base["n"] = len(rows)
            base["tokens_mean"] = _r(mean([min(len(r["token_ids"]), length) for r in rows]), 2)
            return base
        scored = [self.decode_one(cell, r, r["token_ids"][:length]) for r in rows]
        neg = self.negatives(cell, length)
        for s, own in zip(scored, ppl["self_all"], strict=True):
            self._record(cell, length, None, s, own)
        return {
            **base,
            **self._detection(scored, neg),
            "human_fpr": self._human_fpr(neg),
        }

    def _record(
        self, cell: GenCell, length: int, attack: str | None, s: Scored, ppl: float | None
    ) -> None:
        self.per_text.append(
            {
                "scheme": cell.spec.name,
                "bits": cell.bits,
                "length": length,
                "attack": attack,
                "text": "watermarked",
                "index": s.index,
                "dataset": s.dataset,
                "log10_p": _r(-s.score),
                "bit_accuracy": _r(s.bit_accuracy),
                "exact": s.exact,
                "list_hit": s.list_hit,
                "registry_hit": s.registry_hit,
                "tokens": s.tokens,
                "ppl": ppl,
            }
        )

    def curve(self, cell: GenCell) -> dict[str, Any]:
        """Bit accuracy of the first n tokens, n = step, 2*step, ..., max length."""
        assert cell.bits is not None
        longest = self.cfg.max_length
        prefixes = sorted(
            set(range(self.cfg.curve_step, longest + 1, self.cfg.curve_step)) | {longest}
        )
        scheme, bits = self.scheme(cell), cell.bits
        acc = []
        for n in prefixes:
            values = [
                bit_accuracy(
                    scheme.decode(r["token_ids"][:n], bits, list_size=1).bits, r["payload"]
                )
                for r in self.gen_rows[cell]
            ]
            acc.append(_r(mean(values)))
        return {
            "scheme": cell.spec.name,
            "bits": bits,
            "prefix_tokens": prefixes,
            "bit_accuracy": acc,
        }

    # ------------------------------------------------------------------ attacks

    def attacked_texts(
        self, cell: GenCell, attack: str
    ) -> list[tuple[Row, str, dict[str, float]]] | None:
        """(row, attacked text, attack stats) per row; None if paraphrases are missing."""
        length = self.cfg.attack_len
        out = []
        for r in self.gen_rows[cell]:
            text = self.tokenizer.decode(r["token_ids"][:length], skip_special_tokens=True)
            rng = rng_for(self.cfg.seed, "attack", attack, cell.spec.name, cell.bits, r["index"])
            stats: dict[str, float] = {}
            if attack == "none":
                attacked = text
            elif attack == "deletion":
                res = word_deletion(text, self.cfg.deletion_ratio, rng)
                attacked, stats = res.text, res.stats
            elif attack == "synonym":
                if self._synonyms is None:
                    self._synonyms = SynonymSubstitution(load_wordnet())
                res = self._synonyms(text, self.cfg.synonym_ratio, rng)
                attacked, stats = res.text, res.stats
            elif attack == "copy-paste":
                res = copy_paste(
                    text,
                    self.prompts[r["index"]].human_text,
                    self.cfg.copy_paste_segments,
                    self.cfg.copy_paste_human_fraction,
                    rng,
                )
                attacked, stats = res.text, res.stats
            elif attack == "paraphrase":
                para = self.paraphrases.get(cell, {}).get(r["index"])
                if para is None:
                    return None
                attacked = para["text"]
                words_in, words_out = len(split_words(text)[1]), len(split_words(attacked)[1])
                stats = {"words_in": words_in, "words_out": words_out}
            else:
                raise ValueError(f"unknown attack {attack!r}")
            out.append((r, attacked, stats))
        return out

    def attack(self, cell: GenCell, attack: str) -> dict[str, Any] | None:
        texts = self.attacked_texts(cell, attack)
        if texts is None:
            return None
        scored = []
        for row, text, _ in texts:
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            s = self.decode_one(cell, row, ids)
            scored.append(s)
            self._record(cell, self.cfg.attack_len, attack, s, None)
        neg = self.negatives(cell, self.cfg.attack_len)
        keys = sorted({k for _, _, st in texts for k in st})
        summary = self._detection(scored, neg)
        summary.pop("by_dataset")
        return {
            "scheme": cell.spec.name,
            "bits": cell.bits,
            "attack": attack,
            "length": self.cfg.attack_len,
            **summary,
            "attack_stats": {
                k: _r(mean([st[k] for _, _, st in texts if k in st]), 4) for k in keys
            },
        }
