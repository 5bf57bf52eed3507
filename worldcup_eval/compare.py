"""WorldCup's default against the multi-bit schemes of 2025-2026 (issue #40).

One TOML file (``docs/results/compare/compare.toml``) says what is compared; this module
generates the missing cells into the eval cache (``--generate``, one cell per call) and
measures everything from the cache (no model needed), writing ``results.json``,
``report.md`` and the plots:

* **the grid**: every scheme at every payload length, at 128 and 256 tokens, on the
  committed grid's 100 prompts, seed, payloads and sampling (so cells already cached by
  ``worldcup eval`` and the frontier are reused). Bit accuracy and exact match, TPR at
  p < 0.01 and p < 1e-6 (each scheme's calibrated p-value, with the negatives' rate at the
  same thresholds beside it), median self-PPL, and three model-free views of the text
  (distinct word 2-grams, repeated word 3-grams) and one tail view (the share of tokens the
  unwatermarked model gives probability < 1 %). Paired differences against the reference
  (WorldCup's default) on the same prompts and payloads, with their SE.
* **attacks**: at one setting (32 bits, 256 tokens) for every scheme: copy-paste with 25,
  50 and 75 % of the text human-written, word deletion and synonym substitution (20 %), and
  a paraphrase by the generating model itself.
* **equal strength**: each baseline's strength swept on 128-token texts; the weakest
  strength whose TPR at p < 0.01 matches WorldCup's default (within ``tolerance``) is the
  matched point, and quality is compared there.
* **masking**: design ablations paired with their base (``worldcup_eval.ideas``), here
  repeated-context masking switched off.

**One 256-token run serves both lengths.** Each (scheme, bits) cell is generated once at
256 tokens and the 128-token table reads its first 128 tokens: sampling is causal, so the
prefix has exactly the distribution of a 128-token generation (``worldcup_eval.runner``).
The equal-strength sweep's other strengths are generated at 128 tokens directly.

Names: any frontier point (``worldcup-v2-k1@0.6``, ``worldcup-k1-nomask@0.6``), a baseline
at its paper setting (``mpac``), or a baseline at another strength (``mpac@3``: the
parameter ``worldcup_core.baselines.STRENGTH`` names, here MPAC's delta).
"""

from __future__ import annotations

import functools
import json
import math
import resource
import sys
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from worldcup_core.baselines import BASELINES, STRENGTH
from worldcup_eval.attacks import (
    SynonymSubstitution,
    copy_paste,
    load_wordnet,
    split_words,
    word_deletion,
)
from worldcup_eval.cache import (
    BatchCache,
    say,
    stable_hash,
    write_results_json,
    write_text_atomic,
)
from worldcup_eval.config import EvalConfig, SchemeSpec, _jsonable, build_config
from worldcup_eval.data import EvalData, default_data_dir, load_data
from worldcup_eval.frontier import (
    _r,
    _texts,
    binomial_se,
    frontier_spec,
    mean_se,
    paired,
)
from worldcup_eval.metrics import bit_accuracy, mean, standard_error
from worldcup_eval.runner import (
    GenCell,
    Job,
    build_scheme,
    gen_cell_key,
    gen_jobs,
    model_fingerprint,
    paraphrase_jobs,
)
from worldcup_eval.seeding import eval_key, rng_for

COMPARE_SCHEMA = "worldcup-compare-v1"
ALL_DONE = 3  # --generate's exit status once every cell is cached
UNLIKELY = math.log(0.01)  # a token the unwatermarked model gives probability < 1 %
LABELS = {"bimark": "BiMark", "xmark": "XMark", "segmark": "RSBH", "mpac": "MPAC"}
# the service's `frontier` preset (k = 1, alpha = 0.6) under the scheme new keys get
SERVICE_DEFAULT = "worldcup-v2-k1@0.6"


def compare_spec(name: str, cfg: EvalConfig) -> SchemeSpec:
    """A point's :class:`SchemeSpec`: ``BASELINE@STRENGTH`` or any frontier name."""
    base, sep, settings = name.partition("@")
    if base in BASELINES and sep:
        if base not in STRENGTH:
            raise ValueError(f"{name!r}: baseline {base!r} has no strength setting")
        try:
            strength = float(settings)
        except ValueError:
            raise ValueError(f"{name!r}: expected BASELINE@STRENGTH") from None
        return replace(cfg.spec(base), strength=strength)
    return frontier_spec(name, cfg)


def label(name: str) -> str:
    """The name a table shows: ``MPAC δ=3``, ``WorldCup (default)``."""
    if name == SERVICE_DEFAULT:
        return "WorldCup (default)"
    base, sep, settings = name.partition("@")
    if base in LABELS:
        knob = "δ̃" if STRENGTH.get(base) == "base_delta" else "δ"
        return f"{LABELS[base]} {knob}={settings}" if sep else LABELS[base]
    return name


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class AttackConfig:
    """``[compare.attacks]``: which attacks, at which setting."""

    bits: int = 32
    length: int = 256
    copy_paste: tuple[float, ...] = (0.25, 0.5, 0.75)  # human share of the attacked text
    segments: int = 3
    deletion: float = 0.2
    substitution: float = 0.2
    paraphrase: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        cp = tuple(f"copy-paste-{round(100 * f)}" for f in self.copy_paste)
        return ("none", *cp, "deletion", "substitution") + (
            ("paraphrase",) if self.paraphrase else ()
        )


@dataclass(frozen=True)
class EqualConfig:
    """``[compare.equal]``: the strength sweeps and the detection target they match."""

    bits: int = 32
    length: int = 128
    anchor: str = "worldcup-v2-k1@0.6"
    tolerance: float = 0.01  # matched: TPR >= the anchor's TPR - tolerance
    sweeps: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (scheme, points weakest first)


@dataclass(frozen=True)
class CompareConfig:
    """``[compare]``: the schemes, the grid, the thresholds and the other sections."""

    schemes: tuple[str, ...]
    bits: tuple[int, ...] = (16, 32, 48, 64)
    lengths: tuple[int, ...] = (128, 256)
    reference: str = "worldcup-v2-k1@0.6"
    fpr: float = 0.01
    strict: float = 1e-6
    tie_se: float = 2.0  # |paired difference| <= tie_se * SE is a tie
    bootstrap: int = 2000
    attacks: AttackConfig = field(default_factory=AttackConfig)
    equal: EqualConfig = field(default_factory=EqualConfig)
    masking: tuple[tuple[str, str], ...] = ()  # (ablation, base), paired
    out: str = "docs/results/compare"

    def __post_init__(self) -> None:
        if self.reference not in self.schemes:
            raise ValueError(f"reference {self.reference!r} must be one of the schemes")
        if not 0.0 < self.strict < self.fpr < 1.0:
            raise ValueError("0 < strict < fpr < 1 required")
        if self.attacks.bits not in self.bits or self.attacks.length not in self.lengths:
            raise ValueError("the attack setting must be a grid setting")
        for scheme, _ in self.equal.sweeps:
            if scheme not in self.schemes:
                raise ValueError(f"swept scheme {scheme!r} is not one of the schemes")


def load_compare(path: Path) -> tuple[EvalConfig, CompareConfig]:
    """The eval protocol (``[eval]``) and the comparison (``[compare]``) of one TOML file."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    cfg = build_config(overrides=data.get("eval", {}))
    raw = dict(data.get("compare", {}))
    attacks = dict(raw.pop("attacks", {}))
    if "copy_paste" in attacks:
        attacks["copy_paste"] = tuple(float(f) for f in attacks["copy_paste"])
    equal = dict(raw.pop("equal", {}))
    if "sweeps" in equal:
        equal["sweeps"] = tuple((str(k), tuple(map(str, v))) for k, v in equal["sweeps"].items())
    for key in ("schemes",):
        if key in raw:
            raw[key] = tuple(str(v) for v in raw[key])
    for key in ("bits", "lengths"):
        if key in raw:
            raw[key] = tuple(int(v) for v in raw[key])
    if "masking" in raw:
        raw["masking"] = tuple((str(a), str(b)) for a, b in raw["masking"])
    for table, cls in ((raw, CompareConfig), (attacks, AttackConfig), (equal, EqualConfig)):
        unknown = set(table) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys: {', '.join(sorted(unknown))}")
    ccfg = CompareConfig(**raw, attacks=AttackConfig(**attacks), equal=EqualConfig(**equal))
    if max(ccfg.lengths) > cfg.max_length or ccfg.equal.length > cfg.max_length:
        raise ValueError(f"a length exceeds the generated length {cfg.max_length}")
    for name in (*ccfg.schemes, ccfg.equal.anchor, *(p for s in ccfg.equal.sweeps for p in s[1])):
        compare_spec(name, cfg)  # validates every name up front
    return cfg, ccfg


# --------------------------------------------------------------------------- the attacks


def copy_paste_share(
    text: str, human: str, human_share: float, segments: int, rng: np.random.Generator
) -> tuple[str, dict[str, float]]:
    """Copy-paste at a fixed total length: the first ``1 - human_share`` of the
    watermarked words, cut into ``segments`` pieces and set inside human words making
    ``human_share`` of the result (``worldcup_eval.attacks.copy_paste``)."""
    _, wm = split_words(text)
    keep = max(1, int(round(len(wm) * (1.0 - human_share))))
    res = copy_paste("".join(wm[:keep]), human, segments, human_share, rng)
    return res.text, res.stats


# --------------------------------------------------------------------------- measurement


@dataclass
class _Scored:
    """Per-text values of one point (index order), for paired differences."""

    index: list[int]
    values: dict[str, list[float]]


class Comparison:
    """Loads the cached cells of the comparison and measures them (model-free)."""

    def __init__(self, cfg: EvalConfig, ccfg: CompareConfig) -> None:
        from worldcup_core.models import load_tokenizer

        self.cfg, self.ccfg = cfg, ccfg
        short = (ccfg.equal.length,)
        self.short_cfg = replace(cfg, lengths=short, ablation_lengths=short)
        self.cache = BatchCache(cfg.cache_path)
        self.tokenizer = load_tokenizer(cfg.model)
        self.model_fp = model_fingerprint(cfg.model, cfg.dtype, cfg.device)
        data_dir = Path(cfg.data_dir) if cfg.data_dir else default_data_dir()
        self.data: EvalData = load_data(
            self.tokenizer,
            data_dir,
            cfg.prompts,
            cfg.datasets,
            cfg.prompt_tokens,
            cfg.max_length,
            cfg.seed,
        )
        self.prompts = {p.index: p for p in self.data.prompts}
        self.missing: list[str] = []
        self._negatives: dict[tuple[Any, ...], list[float]] = {}
        self._synonyms: SynonymSubstitution | None = None

    # ------------------------------------------------------------------ cells

    def cell_cfg(self, name: str) -> EvalConfig:
        """Where a point's texts come from: a swept strength is generated at the sweep's
        length, everything else at the grid's (and read as a prefix)."""
        return self.short_cfg if compare_spec(name, self.cfg).strength is not None else self.cfg

    def jobs(self, name: str, bits: int | None, lm: Any = None) -> list[Job]:
        cell = GenCell(compare_spec(name, self.cfg), bits)
        return gen_jobs(self.cell_cfg(name), lm, cell, self.data.prompts, self.cache, self.model_fp)

    def para_jobs(self, name: str, bits: int, lm: Any = None) -> list[Job] | None:
        """The paraphrase batches of a cell (None while the cell itself is missing)."""
        rows = self.rows(name, bits)
        if rows is None:
            return None
        cell = GenCell(compare_spec(name, self.cfg), bits)
        source = gen_cell_key(self.cfg, cell, self.model_fp)
        return paraphrase_jobs(self.cfg, lm, cell, source, rows, self.cache, self.model_fp)

    def para_jobs_of(self, name: str, bits: int, lm: Any) -> list[Job]:
        return self.para_jobs(name, bits, lm) or []

    def plan(self) -> list[tuple[str, int | None]]:
        """Every generation cell the report rests on, most valuable first."""
        c = self.ccfg
        out: list[tuple[str, int | None]] = [("unwatermarked", None)]
        out += [(s, c.attacks.bits) for s in c.schemes]
        out += [(c.equal.anchor, c.equal.bits)]
        out += [(p, c.equal.bits) for _, points in c.equal.sweeps for p in points]
        out += [(s, b) for b in c.bits for s in c.schemes]
        out += [(n, c.attacks.bits) for pair in c.masking for n in pair]
        return list(dict.fromkeys(out))

    def early_cells(self) -> int:
        """How many of :meth:`plan`'s first entries the attack and sweep tables need."""
        c = self.ccfg
        early = [("unwatermarked", None), *((s, c.attacks.bits) for s in c.schemes)]
        early += [(c.equal.anchor, c.equal.bits)]
        early += [(p, c.equal.bits) for _, points in c.equal.sweeps for p in points]
        return len(dict.fromkeys(early))

    def rows(self, name: str, bits: int | None) -> list[dict[str, Any]] | None:
        """The cached rows of one cell by prompt index; None when a batch is missing."""
        out: list[dict[str, Any]] = []
        for job in self.jobs(name, bits):
            batch = self.cache.load(job.path)
            if batch is None:
                return None
            out += batch["rows"]
        return sorted(out, key=lambda r: int(r["index"]))

    def paraphrases(self, name: str, bits: int) -> dict[int, str] | None:
        jobs = self.para_jobs(name, bits)
        if jobs is None:
            return None
        out: dict[int, str] = {}
        for job in jobs:
            batch = self.cache.load(job.path)
            if batch is None:
                return None
            out.update({int(r["index"]): str(r["text"]) for r in batch["rows"]})
        return out

    # ------------------------------------------------------------------ scoring

    def negatives(self, name: str, bits: int, length: int) -> list[float]:
        """``-log10 p`` of the unwatermarked generations and human continuations."""
        spec = compare_spec(name, self.cfg)
        key = (spec.kind, spec.groups, spec.layers, spec.variant, spec.version, bits, length)
        if key not in self._negatives:
            scheme = build_scheme(self.cfg, spec)
            assert scheme is not None
            ids = [r["token_ids"][:length] for r in self.unwatermarked]
            ids += [list(p.human_ids[:length]) for p in self.data.prompts]
            self._negatives[key] = [
                -scheme.detect(list(x), num_bits=bits).log10_p_value for x in ids
            ]
        return self._negatives[key]

    def texts_summary(
        self, items: list[tuple[int, Sequence[int], Sequence[float] | None]], length: int, seed: int
    ) -> tuple[dict[str, Any], dict[str, list[float]]]:
        """Quality of a set of texts: frontier's summary plus the unlikely-token share."""
        t = _texts(self.tokenizer, items, length)
        out = t.summary(self.ccfg.bootstrap, seed)
        unlikely = [
            float(np.mean(np.asarray(lp[:length]) < UNLIKELY)) if lp else math.nan
            for _, _, lp in items
        ]
        if any(math.isfinite(u) for u in unlikely):
            m, se = mean_se(unlikely)
            out["unlikely"], out["unlikely_se"] = _r(m, 5), _r(se, 5)
        values = {"log_ppl": t.log_ppl, "unlikely": unlikely, "rep3": _floats(t.rep3)}
        values["distinct2"] = _floats(t.distinct2)
        return out, values

    def point(
        self, name: str, rows: list[dict[str, Any]], bits: int, length: int, seed: int
    ) -> tuple[dict[str, Any], _Scored]:
        """Every number of one point at (bits, length)."""
        c = self.ccfg
        spec = compare_spec(name, self.cfg)
        scheme = build_scheme(self.cfg, spec)
        assert scheme is not None
        acc, exact, hit, strict, scored = [], [], [], [], []
        for r in rows:
            res = scheme.decode(list(r["token_ids"][:length]), bits, list_size=1)
            scored.append(res.detection.num_scored_tokens / max(1, res.detection.num_tokens))
            acc.append(bit_accuracy(res.bits, r["payload"]))
            exact.append(float(res.bits == r["payload"]))
            hit.append(float(res.detection.p_value < c.fpr))
            strict.append(float(res.detection.p_value < c.strict))
        neg = self.negatives(name, bits, length)
        quality, values = self.texts_summary(
            [(r["index"], r["token_ids"], r["logprobs"]) for r in rows], length, seed
        )
        n = len(rows)
        point: dict[str, Any] = {
            "name": name,
            "label": label(name),
            "scheme": spec.kind,
            "strength": spec.strength,
            "bits": bits,
            "length": length,
            "n": n,
            "bit_accuracy": _r(mean(acc)),
            "bit_accuracy_se": _r(standard_error(acc)),
            "exact": _r(mean(exact)),
            "exact_se": _r(binomial_se(mean(exact), n)),
            "tpr": _r(mean(hit)),
            "tpr_se": _r(binomial_se(mean(hit), n)),
            "tpr_strict": _r(mean(strict)),
            "tpr_strict_se": _r(binomial_se(mean(strict), n)),
            "negatives_fpr": _r(float(np.mean([s > -math.log10(c.fpr) for s in neg]))),
            "negatives_fpr_strict": _r(float(np.mean([s > -math.log10(c.strict) for s in neg]))),
            "n_negatives": len(neg),
            # tokens scored: not after a repeated context (nor, in v2, the first c tokens)
            "scored_share": _r(mean(scored), 4),
            **{k: v for k, v in quality.items() if k != "n"},
        }
        values.update({"bit_accuracy": acc, "exact": exact, "tpr": hit, "tpr_strict": strict})
        return point, _Scored([int(r["index"]) for r in rows], values)

    # ------------------------------------------------------------------ sections

    def run(self) -> dict[str, Any]:
        cfg, c = self.cfg, self.ccfg
        unwm = self.rows("unwatermarked", None)
        if unwm is None:
            raise RuntimeError("no unwatermarked generations cached: nothing can be measured")
        self.unwatermarked = unwm
        results: dict[str, Any] = {
            "schema": COMPARE_SCHEMA,
            "eval_config": cfg.to_dict(),
            "compare_config": _jsonable(asdict(c)),
            "protocol": {
                "model": self.model_fp,
                "key_id": eval_key(cfg.seed).key_id,
                "prompts": len(self.data.prompts),
                "generated_length": cfg.max_length,
                "sweep_length": c.equal.length,
            },
            "grid": self.grid(),
            "attacks": self.attacks(),
            "equal": self.equal(),
            "masking": self.masking(),
        }
        results["missing"] = list(dict.fromkeys(self.missing))
        results["complete"] = not self.missing
        results["verdicts"] = verdicts(results)
        return results

    def grid(self) -> list[dict[str, Any]]:
        c = self.ccfg
        out: list[dict[str, Any]] = []
        for bits in c.bits:
            for length in c.lengths:
                seed = int(stable_hash([self.cfg.seed, bits, length], 8), 16)
                base, _ = self.texts_summary(
                    [(r["index"], r["token_ids"], r["logprobs"]) for r in self.unwatermarked],
                    length,
                    seed,
                )
                human, _ = self.texts_summary(
                    [(p.index, p.human_ids, None) for p in self.data.prompts], length, seed
                )
                points: list[dict[str, Any]] = []
                scored: dict[str, _Scored] = {}
                for name in c.schemes:
                    rows = self.rows(name, bits)
                    if rows is None:
                        self.missing.append(f"{name} {bits}")
                        continue
                    point, scored[name] = self.point(name, rows, bits, length, seed)
                    points.append(point)
                add_paired(points, scored, c.reference)
                out.append(
                    {
                        "bits": bits,
                        "length": length,
                        "unwatermarked": base,
                        "human": human,
                        "points": points,
                    }
                )
        return out

    def attacked(self, name: str, attack: str) -> list[tuple[dict[str, Any], str]] | None:
        """(row, attacked text) per row; None when the cell or its paraphrases are missing."""
        a = self.ccfg.attacks
        rows = self.rows(name, a.bits)
        if rows is None:
            return None
        paras = self.paraphrases(name, a.bits) if attack == "paraphrase" else {}
        if paras is None:
            return None
        out = []
        for r in rows:
            text = self.tokenizer.decode(r["token_ids"][: a.length], skip_special_tokens=True)
            rng = rng_for(self.cfg.seed, "compare-attack", attack, r["index"])
            human = self.prompts[int(r["index"])].human_text
            if attack == "none":
                attacked = text
            elif attack.startswith("copy-paste-"):
                share = int(attack.removeprefix("copy-paste-")) / 100
                attacked, _ = copy_paste_share(text, human, share, a.segments, rng)
            elif attack == "deletion":
                attacked = word_deletion(text, a.deletion, rng).text
            elif attack == "substitution":
                if self._synonyms is None:
                    self._synonyms = SynonymSubstitution(load_wordnet())
                attacked = self._synonyms(text, a.substitution, rng).text
            elif attack == "paraphrase":
                attacked = paras[int(r["index"])]
            else:
                raise ValueError(f"unknown attack {attack!r}")
            out.append((r, attacked))
        return out

    def attacks(self) -> dict[str, Any]:
        a, c = self.ccfg.attacks, self.ccfg
        table: list[dict[str, Any]] = []
        for attack in a.names:
            scored: dict[str, _Scored] = {}
            points = []
            for name in c.schemes:
                texts = self.attacked(name, attack)
                if texts is None:
                    self.missing.append(f"{name} {a.bits} attack {attack}")
                    continue
                scheme = build_scheme(self.cfg, compare_spec(name, self.cfg))
                assert scheme is not None
                acc, hit, strict, tokens = [], [], [], []
                for r, text in texts:
                    ids = self.tokenizer(text, add_special_tokens=False).input_ids
                    res = scheme.decode(ids, a.bits, list_size=1)
                    acc.append(bit_accuracy(res.bits, r["payload"]))
                    hit.append(float(res.detection.p_value < c.fpr))
                    strict.append(float(res.detection.p_value < c.strict))
                    tokens.append(float(len(ids)))
                n = len(texts)
                points.append(
                    {
                        "attack": attack,
                        "name": name,
                        "label": label(name),
                        "n": n,
                        "bit_accuracy": _r(mean(acc)),
                        "bit_accuracy_se": _r(standard_error(acc)),
                        "tpr": _r(mean(hit)),
                        "tpr_se": _r(binomial_se(mean(hit), n)),
                        "tpr_strict": _r(mean(strict)),
                        "tpr_strict_se": _r(binomial_se(mean(strict), n)),
                        "tokens_mean": _r(mean(tokens), 1),
                    }
                )
                scored[name] = _Scored(
                    [int(r["index"]) for r, _ in texts],
                    {"bit_accuracy": acc, "tpr": hit, "tpr_strict": strict},
                )
            add_paired(points, scored, c.reference, keys=("bit_accuracy", "tpr"))
            table += points
        return {"bits": a.bits, "length": a.length, "rows": table}

    def equal(self) -> dict[str, Any]:
        e = self.ccfg.equal
        seed = int(stable_hash([self.cfg.seed, "equal", e.bits, e.length], 8), 16)
        out: dict[str, Any] = {"bits": e.bits, "length": e.length, "sweeps": [], "matched": []}
        anchor_rows = self.rows(e.anchor, e.bits)
        if anchor_rows is None:
            self.missing.append(f"{e.anchor} {e.bits} (equal-strength anchor)")
            return out
        anchor, anchor_values = self.point(e.anchor, anchor_rows, e.bits, e.length, seed)
        out["anchor"] = anchor
        target = float(anchor["tpr"]) - e.tolerance
        out["target_tpr"] = _r(target)
        for scheme, names in e.sweeps:
            points = []
            for name in names:
                rows = self.rows(name, e.bits)
                if rows is None:
                    self.missing.append(f"{name} {e.bits} (sweep, {e.length} tokens)")
                    continue
                point, values = self.point(name, rows, e.bits, e.length, seed)
                add_paired([point], {name: values, e.anchor: anchor_values}, e.anchor)
                points.append(point)
            out["sweeps"].append({"scheme": scheme, "points": points})  # a list: kept in order
            if scheme != e.anchor:  # the anchor's own sweep shows its frontier, unmatched
                out["matched"].append({"scheme": scheme, **match_strength(points, target)})
        return out

    def masking(self) -> list[dict[str, Any]]:
        a = self.ccfg.attacks
        out = []
        for ablation, base in self.ccfg.masking:
            ra, rb = self.rows(ablation, a.bits), self.rows(base, a.bits)
            if ra is None or rb is None:
                for name, rows in ((ablation, ra), (base, rb)):
                    if rows is None:
                        self.missing.append(f"{name} {a.bits} (masking)")
                continue
            for length in self.ccfg.lengths:
                seed = int(stable_hash([self.cfg.seed, "masking", length], 8), 16)
                pa, va = self.point(ablation, ra, a.bits, length, seed)
                pb, vb = self.point(base, rb, a.bits, length, seed)
                diffs = {}
                for key in ("bit_accuracy", "log_ppl", "rep3", "distinct2", "unlikely"):
                    d, se = paired(va.values[key], vb.values[key])
                    diffs[key], diffs[f"{key}_se"] = _r(d), _r(se)
                out.append({"ablation": pa, "base": pb, "length": length, "minus_base": diffs})
        return out


def match_strength(points: Sequence[Mapping[str, Any]], target: float) -> dict[str, Any]:
    """The equal-strength rule: the first point (sweeps list the weakest first) whose TPR
    reaches ``target``; when none does, the strongest measured, flagged as not reached."""
    matched = next((p for p in points if p["tpr"] >= target - 1e-12), None)
    if matched is not None:
        return {"reached": True, "point": matched}
    return {"reached": False, "point": points[-1] if points else None}


def _floats(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def add_paired(
    points: list[dict[str, Any]],
    scored: Mapping[str, _Scored],
    reference: str,
    keys: Sequence[str] = ("bit_accuracy", "exact", "tpr", "tpr_strict", "log_ppl", "unlikely"),
) -> None:
    """``<key>_minus_ref`` and its SE on each point: paired on the prompts both have."""
    ref = scored.get(reference)
    if ref is None:
        return
    at = {i: k for k, i in enumerate(ref.index)}
    for p in points:
        mine = scored.get(p["name"])
        if mine is None or p["name"] == reference:
            continue
        both = [(k, at[i]) for k, i in enumerate(mine.index) if i in at]
        for key in keys:
            d, se = paired(
                [mine.values[key][k] for k, _ in both], [ref.values[key][j] for _, j in both]
            )
            p[f"{key}_minus_ref"], p[f"{key}_minus_ref_se"] = _r(d), _r(se)


# --------------------------------------------------------------------------- verdicts


def verdict(diff: float | None, se: float | None, tie_se: float) -> str:
    """``leads``/``ties``/``trails`` for WorldCup from a paired difference *baseline - WorldCup*
    where higher is better for the baseline."""
    if diff is None or se is None:
        return "—"
    if se == 0.0:
        return "ties" if diff == 0.0 else ("trails" if diff > 0 else "leads")
    if diff > tie_se * se:
        return "trails"
    if diff < -tie_se * se:
        return "leads"
    return "ties"


# what the standing table compares, and the sign that makes "higher is better"
VERDICT_KEYS = (("bit_accuracy", 1.0), ("exact", 1.0), ("tpr_strict", 1.0), ("log_ppl", -1.0))


def verdicts(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """WorldCup's standing against each baseline per grid setting: bit accuracy, exact
    match, TPR at p < 1e-6 and log self-PPL (lower is better), each by its paired
    difference."""
    c = results["compare_config"]
    out = []
    for setting in results["grid"]:
        for p in setting["points"]:
            if p["name"] == c["reference"]:
                continue
            row = {"name": p["name"], "bits": setting["bits"], "length": setting["length"]}
            for key, sign in VERDICT_KEYS:
                d, se = p.get(f"{key}_minus_ref"), p.get(f"{key}_minus_ref_se")
                row[key] = verdict(None if d is None else sign * d, se, c["tie_se"])
            out.append(row)
    return out


# --------------------------------------------------------------------------- outputs


def _pm(value: float | None, se: float | None, nd: int = 3) -> str:
    if value is None:
        return "—"
    return f"{value:.{nd}f} ± {se:.{nd}f}" if se is not None else f"{value:.{nd}f}"


def _signed(value: float | None, se: float | None, nd: int = 3) -> str:
    if value is None:
        return "—"
    return f"{value:+.{nd}f} ± {se:.{nd}f}" if se is not None else f"{value:+.{nd}f}"


def _grid_table(setting: Mapping[str, Any], c: Mapping[str, Any]) -> list[str]:
    u, h = setting["unwatermarked"], setting["human"]
    lines = [
        f"| scheme | bit acc | exact | TPR p<{c['fpr']:g} | TPR p<{c['strict']:g} | "
        "self-PPL | dist-2 | rep-3 | unlikely | Δacc vs WorldCup | Δlog-PPL vs WorldCup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| unwatermarked | — | — | — | — | "
        f"{_pm(u.get('self_ppl_median'), u.get('self_ppl_median_se'), 2)} | "
        f"{_pm(u['distinct2'], u['distinct2_se'])} | {_pm(u['rep3'], u['rep3_se'])} | "
        f"{_pm(u.get('unlikely'), u.get('unlikely_se'))} | — | — |",
        f"| human continuation | — | — | — | — | — | {_pm(h['distinct2'], h['distinct2_se'])} | "
        f"{_pm(h['rep3'], h['rep3_se'])} | — | — | — |",
    ]
    for p in setting["points"]:
        lines.append(
            f"| {p['label']} | {_pm(p['bit_accuracy'], p['bit_accuracy_se'])} | "
            f"{_pm(p['exact'], p['exact_se'], 2)} | {_pm(p['tpr'], p['tpr_se'], 2)} | "
            f"{_pm(p['tpr_strict'], p['tpr_strict_se'], 2)} | "
            f"{_pm(p.get('self_ppl_median'), p.get('self_ppl_median_se'), 2)} | "
            f"{_pm(p['distinct2'], p['distinct2_se'])} | {_pm(p['rep3'], p['rep3_se'])} | "
            f"{_pm(p.get('unlikely'), p.get('unlikely_se'))} | "
            f"{_signed(p.get('bit_accuracy_minus_ref'), p.get('bit_accuracy_minus_ref_se'))} | "
            f"{_signed(p.get('log_ppl_minus_ref'), p.get('log_ppl_minus_ref_se'))} |"
        )
    negatives = ", ".join(
        f"{p['label']} {p['negatives_fpr']:.3f} / {p['negatives_fpr_strict']:.3f}"
        for p in setting["points"]
    )
    lines += [
        "",
        f"Negatives flagged at p < {c['fpr']:g} / p < {c['strict']:g} (unwatermarked "
        f"generations and human continuations, {setting['points'][0]['n_negatives']} texts "
        f"per scheme): {negatives}."
        if setting["points"]
        else "",
        "",
    ]
    return lines


def attack_table(results: Mapping[str, Any]) -> list[str]:
    """Rows: attacks; columns: schemes; cells: bit accuracy / TPR at p < fpr."""
    rows = results["attacks"]["rows"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    by = {(r["attack"], r["name"]): r for r in rows}
    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    labels = {r["name"]: r["label"] for r in rows}
    lines = [
        "| attack | " + " | ".join(labels[n] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for attack in attacks:
        cells = []
        for n in names:
            r = by.get((attack, n))
            cells.append(
                "—"
                if r is None
                else f"{r['bit_accuracy']:.3f} ± {r['bit_accuracy_se']:.3f} / {r['tpr']:.2f}"
            )
        lines.append(f"| {attack} | " + " | ".join(cells) + " |")
    return lines


def equal_table(results: Mapping[str, Any]) -> list[str]:
    e = results["equal"]
    if "anchor" not in e:
        return ["(the anchor is not measured)"]
    c = results["compare_config"]
    lines = [
        f"| scheme | strength | TPR p<{c['fpr']:g} | TPR p<{c['strict']:g} | bit acc | "
        "self-PPL | Δlog-PPL vs WorldCup | dist-2 | rep-3 | unlikely |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def row(p: Mapping[str, Any], strength: str, note: str = "") -> str:
        return (
            f"| {p['label']}{note} | {strength} | {_pm(p['tpr'], p['tpr_se'], 2)} | "
            f"{_pm(p['tpr_strict'], p['tpr_strict_se'], 2)} | "
            f"{_pm(p['bit_accuracy'], p['bit_accuracy_se'])} | "
            f"{_pm(p.get('self_ppl_median'), p.get('self_ppl_median_se'), 2)} | "
            f"{_signed(p.get('log_ppl_minus_ref'), p.get('log_ppl_minus_ref_se'))} | "
            f"{_pm(p['distinct2'], p['distinct2_se'])} | {_pm(p['rep3'], p['rep3_se'])} | "
            f"{_pm(p.get('unlikely'), p.get('unlikely_se'))} |"
        )

    lines.append(row(e["anchor"], "default (anchor)"))
    for m in e["matched"]:
        p = m["point"]
        if p is None:
            lines.append(f"| {label(m['scheme'])} | not measured | " + "— |" * 8)
            continue
        strength = "paper" if p["strength"] is None else f"{p['strength']:g}"
        lines.append(row(p, strength, "" if m["reached"] else " (target not reached)"))
    return lines


def render(results: Mapping[str, Any]) -> str:
    """The comparison's Markdown report, entirely from ``results``."""
    c, proto = results["compare_config"], results["protocol"]
    lines = ["# WorldCup against the 2025-2026 multi-bit schemes (issue #40)", ""]
    if results["missing"]:
        lines += [
            "**Status: PARTIAL** -- not (yet) generated, left out: "
            + ", ".join(f"`{m}`" for m in results["missing"]),
            "",
        ]
    else:
        lines += ["**Status: complete** -- every listed cell was generated and measured.", ""]
    lines += [
        "## Protocol",
        "",
        f"- {proto['prompts']} prompts (the committed grid's seed, prompts, payloads and "
        f"sampling), model {proto['model']['model']}, key id `{proto['key_id']}`. Each "
        f"(scheme, bits) cell is generated once at {proto['generated_length']} tokens; the "
        "128-token rows read its first 128 tokens (sampling is causal, so the prefix has the "
        "distribution of a 128-token generation). Equal-strength sweep points other than a "
        f"scheme's paper setting are generated at {proto['sweep_length']} tokens.",
        f"- WorldCup is the service default (`{c['reference']}`: k = 1, α = 0.6, scheme "
        "worldcup-v2). RSBH is `segmark` (Qu et al., Reed-Solomon segments; "
        "docs/baselines.md). Every scheme's settings: docs/baselines.md.",
        "- Bit accuracy (mean ± SE over texts), exact payload match (binomial SE). TPR: the "
        f"share of texts whose calibrated p-value is below {c['fpr']:g} (FPR 1 % by "
        f"calibration; the negatives' rate is printed as a check) and below {c['strict']:g}.",
        "- Quality: median self-PPL (bootstrap SE); `dist-2`: distinct word 2-grams per text "
        "(higher is more diverse); `rep-3`: the share of word 3-grams repeating an earlier "
        "one (lower is better); `unlikely`: the share of tokens the unwatermarked model gives "
        "probability < 1 % (the tail a reader notices, which a median PPL averages away).",
        "- `Δ… vs WorldCup`: the paired mean difference, scheme minus WorldCup, on the same "
        f"prompts and payloads, with its SE. WorldCup *leads* / *trails* when the difference "
        f"exceeds {c['tie_se']:g} SE, else it *ties*.",
        "",
        "## Where WorldCup stands",
        "",
        *standing_table(results),
        "",
        "## The grid",
        "",
        "![grid](grid.png)",
        "",
    ]
    for setting in results["grid"]:
        lines += [f"### {setting['bits']} bits, {setting['length']} tokens", ""]
        if not setting["points"]:
            lines += ["Not generated yet (see the status line).", ""]
            continue
        lines += _grid_table(setting, c)
    a = results["attacks"]
    lines += [
        f"## Attacks ({a['bits']} bits, {a['length']} tokens)",
        "",
        "Each cell: bit accuracy ± SE / TPR at p < 0.01, on the attacked text re-tokenised. "
        "`copy-paste-X`: the first (100 − X) % of the watermarked words, cut into "
        f"{c['attacks']['segments']} pieces, set inside the prompt's human continuation so "
        "that X % of the words are human (the attacked text is as long as the original). "
        f"`deletion` / `substitution`: {c['attacks']['deletion']:.0%} of the words deleted / "
        f"replaced by a WordNet synonym. `paraphrase`: the generating 135M model rewrites the "
        "text (a weak paraphraser: it often copies or drifts; it is the only one offline). No "
        "translation round trip: no package on the registries ships a translation model "
        "(argostranslate, bergamot and the like download their models at run time).",
        "",
        *attack_table(results),
        "",
        "![attacks](attacks.png)",
        "",
    ]
    e = results["equal"]
    lines += [
        f"## Equal strength ({e['bits']} bits, {e['length']} tokens)",
        "",
        "Each baseline's strength is swept (`δ`: the logit bias of MPAC, RSBH and XMark; "
        "`δ̃`: BiMark's base scaling factor); the matched point is the weakest measured "
        f"strength whose TPR at p < {c['fpr']:g} is at least WorldCup's minus "
        f"{c['equal']['tolerance']:g} (target {e.get('target_tpr', float('nan')):.2f}). "
        "Quality is then compared on the same texts.",
        "",
        *equal_table(results),
        "",
        "Every swept point:",
        "",
    ]
    for scheme, points in ((w["scheme"], w["points"]) for w in e["sweeps"]):
        cells = ", ".join(
            f"{p['label']}: TPR {p['tpr']:.2f}, acc {p['bit_accuracy']:.3f}, "
            f"PPL {p.get('self_ppl_median', float('nan')):.2f}"
            for p in points
        )
        lines.append(f"- {label(scheme).removesuffix(' (default)')}: {cells or 'none measured'}")
    lines += ["", "![equal strength](equal.png)", ""]
    if not results["masking"] and c["masking"]:
        lines += [
            "## Repeated-context masking",
            "",
            "WorldCup already samples a step whose c-token context occurred earlier in the "
            "response from the unmodified distribution (since scheme v1, as SynthID and "
            "vLLM-style samplers do); the grid's `scored_share` in results.json is the share "
            "of tokens that carry the watermark. The ablation that switches the mask off ("
            + ", ".join(f"`{a}` against `{b}`" for a, b in c["masking"])
            + ") is not generated yet.",
            "",
        ]
    if results["masking"]:
        lines += [
            "## Repeated-context masking",
            "",
            "WorldCup already samples a step whose c-token context occurred earlier in the "
            "response from the unmodified distribution (since scheme v1, as SynthID and "
            "vLLM-style samplers do). The ablation switches that off at generation (every "
            "step watermarked, `worldcup_eval.ideas`); the detector still skips repeated "
            "contexts. Paired with its base on the same prompts and payloads (scheme v1, the "
            "only one an ablation can run under: v2 steps in one batched kernel).",
            "",
            "| length | point | bit acc | self-PPL | rep-3 | dist-2 | unlikely | Δacc | "
            "Δlog-PPL | Δrep-3 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in results["masking"]:
            d = m["minus_base"]
            for p, deltas in ((m["ablation"], True), (m["base"], False)):
                lines.append(
                    f"| {m['length']} | `{p['name']}` | "
                    f"{_pm(p['bit_accuracy'], p['bit_accuracy_se'])} | "
                    f"{_pm(p.get('self_ppl_median'), p.get('self_ppl_median_se'), 2)} | "
                    f"{_pm(p['rep3'], p['rep3_se'])} | {_pm(p['distinct2'], p['distinct2_se'])} | "
                    f"{_pm(p.get('unlikely'), p.get('unlikely_se'))} | "
                    + (
                        f"{_signed(d['bit_accuracy'], d['bit_accuracy_se'])} | "
                        f"{_signed(d['log_ppl'], d['log_ppl_se'])} | "
                        f"{_signed(d['rep3'], d['rep3_se'])} |"
                        if deltas
                        else "— | — | — |"
                    )
                )
        lines.append("")
    return "\n".join(lines)


def standing_table(results: Mapping[str, Any]) -> list[str]:
    """Per baseline and setting: WorldCup leads / ties / trails on accuracy, strict TPR, PPL."""
    rows = results["verdicts"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    settings = list(dict.fromkeys((r["bits"], r["length"]) for r in rows))
    lines = [
        "WorldCup's default against each scheme: bit accuracy / exact match / TPR at "
        "p < 1e-6 / self-PPL (paired; `lead` = WorldCup better by more than the tie margin).",
        "",
        "| setting | " + " | ".join(label(n) for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    short = {"leads": "lead", "ties": "tie", "trails": "trail", "—": "—"}
    by = {(r["name"], r["bits"], r["length"]): r for r in rows}
    for bits, length in settings:
        cells = []
        for n in names:
            r = by.get((n, bits, length))
            cells.append("—" if r is None else " / ".join(short[r[k]] for k, _ in VERDICT_KEYS))
        lines.append(f"| {bits} b / {length} t | " + " | ".join(cells) + " |")
    return lines


def readme_table(results: Mapping[str, Any]) -> str:
    """The README's headline table (32 bits at 128 and 256 tokens), from ``results``."""
    c = results["compare_config"]
    bits = c["attacks"]["bits"]
    lines = [
        f"| scheme ({bits} bits) | bit acc @128 | bit acc @256 | TPR p<1e-6 @128 | "
        "self-PPL @256 | Δacc vs WorldCup @256 |",
        "|---|---|---|---|---|---|",
    ]
    grid = {(s["bits"], s["length"]): s for s in results["grid"]}
    short, long = grid.get((bits, 128)), grid.get((bits, 256))
    if short is None or long is None:
        return "\n".join(lines) + "\n"
    s_by = {p["name"]: p for p in short["points"]}
    for p in long["points"]:
        q = s_by.get(p["name"])
        name = f"**{p['label']}**" if p["name"] == c["reference"] else p["label"]
        lines.append(
            f"| {name} | "
            f"{_pm(q['bit_accuracy'], q['bit_accuracy_se']) if q else '—'} | "
            f"{_pm(p['bit_accuracy'], p['bit_accuracy_se'])} | "
            f"{_pm(q['tpr_strict'], q['tpr_strict_se'], 2) if q else '—'} | "
            f"{_pm(p.get('self_ppl_median'), p.get('self_ppl_median_se'), 2)} | "
            f"{_signed(p.get('bit_accuracy_minus_ref'), p.get('bit_accuracy_minus_ref_se'))} |"
        )
    u = long["unwatermarked"]
    lines.append(
        f"| unwatermarked | — | — | — | "
        f"{_pm(u.get('self_ppl_median'), u.get('self_ppl_median_se'), 2)} | — |"
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def _style(i: int) -> dict[str, Any]:
    return {"marker": "osD^v<>"[i % 7], "capsize": 2}


def plot_grid(results: Mapping[str, Any], path: Path) -> Path:
    """Bit accuracy by payload length at each text length, and self-PPL and strict TPR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = results["compare_config"]
    fig, axes = plt.subplots(2, 2, figsize=(11.5, 8.5))
    panels: list[tuple[Any, int, str, str]] = [
        (axes[0][0], 128, "bit_accuracy", "bit accuracy, 128 tokens"),
        (axes[0][1], 256, "bit_accuracy", "bit accuracy, 256 tokens"),
        (axes[1][0], 128, "tpr_strict", f"TPR at p < {c['strict']:g}, 128 tokens"),
        (axes[1][1], 256, "self_ppl_median", "self-PPL (median), 256 tokens"),
    ]
    for ax, length, key, title in panels:
        settings = [s for s in results["grid"] if s["length"] == length]
        for i, name in enumerate(c["schemes"]):
            pts = [
                (s["bits"], p)
                for s in settings
                for p in s["points"]
                if p["name"] == name and p.get(key) is not None
            ]
            if not pts:
                continue
            se_key = f"{key}_se"
            ax.errorbar(
                [b for b, _ in pts],
                [p[key] for _, p in pts],
                yerr=[p.get(se_key) or 0.0 for _, p in pts],
                label=label(name),
                **_style(i),
            )
        if key == "self_ppl_median" and settings:
            u = settings[0]["unwatermarked"].get("self_ppl_median")
            if u is not None:
                ax.axhline(u, color="grey", linestyle=":", label="unwatermarked")
        ax.set(title=title, xlabel="payload bits", xticks=c["bits"])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[1][1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_attacks(results: Mapping[str, Any], path: Path) -> Path:
    """Bit accuracy under each attack, one bar per scheme (SE bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["attacks"]["rows"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    by = {(r["attack"], r["name"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(11.5, 7.5), sharex=True)
    width = 0.8 / max(1, len(names))
    x = np.arange(len(attacks))
    for i, n in enumerate(names):
        for ax, key in ((axes[0], "bit_accuracy"), (axes[1], "tpr")):
            vals = [by[(a, n)][key] if (a, n) in by else np.nan for a in attacks]
            errs = [by[(a, n)][f"{key}_se"] if (a, n) in by else 0.0 for a in attacks]
            ax.bar(
                x + (i - (len(names) - 1) / 2) * width,
                vals,
                width,
                yerr=errs,
                capsize=2,
                label=label(n),
            )
    axes[0].set(ylabel="bit accuracy", ylim=(0.4, 1.08))
    axes[1].set(ylabel="TPR at p < 0.01", ylim=(0.0, 1.05))
    axes[1].set_xticks(x, attacks, rotation=20)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, ncol=len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_equal(results: Mapping[str, Any], path: Path) -> Path:
    """TPR and bit accuracy against self-PPL along each sweep; matched points ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = results["equal"]
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.8))
    for ax, key, ylabel in ((axes[0], "tpr", "TPR at p < 0.01"), (axes[1], "bit_accuracy", "")):
        for i, (scheme, points) in enumerate((w["scheme"], w["points"]) for w in e["sweeps"]):
            pts = [p for p in points if p.get("self_ppl_median") is not None]
            ax.errorbar(
                [p["self_ppl_median"] for p in pts],
                [p[key] for p in pts],
                yerr=[p[f"{key}_se"] or 0.0 for p in pts],
                label=label(scheme).removesuffix(" (default)"),
                **_style(i),
            )
            for p in pts:
                if p["strength"] is not None:
                    ax.annotate(
                        f"{p['strength']:g}",
                        (p["self_ppl_median"], p[key]),
                        textcoords="offset points",
                        xytext=(3, -9),
                        fontsize=7,
                    )
        matched = [m["point"] for m in e["matched"] if m["reached"] and m["point"]]
        if matched:
            ax.scatter(
                [p["self_ppl_median"] for p in matched],
                [p[key] for p in matched],
                s=200,
                facecolors="none",
                edgecolors="black",
                label="matched",
            )
        if "anchor" in e:
            a = e["anchor"]
            ax.scatter([a["self_ppl_median"]], [a[key]], marker="*", s=220, color="black", zorder=5)
            ax.annotate(
                "WorldCup",
                (a["self_ppl_median"], a[key]),
                xytext=(5, 5),
                textcoords="offset points",
                fontsize=8,
            )
        ax.set(xlabel="self-PPL (median)", ylabel=ylabel or "bit accuracy")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{e['bits']} bits, {e['length']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def write(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_grid(results, out_dir / "grid.png")
    plot_attacks(results, out_dir / "attacks.png")
    plot_equal(results, out_dir / "equal.png")
    write_text_atomic(out_dir / "report.md", render(results))
    write_results_json(out_dir / "results.json", results)


# --------------------------------------------------------------------------- generation


def generate_next(cfg: EvalConfig, ccfg: CompareConfig) -> int:
    """Generate the first missing cell of the plan (then its paraphrases); exit status 3
    when every cell and paraphrase is cached. One cell per call, so a loop around it
    picks up new code between cells (``docs/results/compare/run_queue.sh``)."""
    from worldcup_core.models import load_model
    from worldcup_eval.gen_queue import _claim, _held

    comp = Comparison(cfg, ccfg)
    plan = comp.plan()
    todo: list[tuple[str, Callable[[Any], list[Job]]]] = []
    for name, bits in plan:
        if any(comp.cache.load(j.path) is None for j in comp.jobs(name, bits)):
            todo.append((f"{name} {bits}", functools.partial(comp.jobs, name, bits)))
    # the attack setting's paraphrases come after the cells that the attack and sweep
    # tables need, before the rest of the grid
    early = {f"{n} {b}" for n, b in plan[: comp.early_cells()]}
    cut = next((i for i, t in enumerate(todo) if t[0] not in early), len(todo))
    para: list[tuple[str, Callable[[Any], list[Job]]]] = []
    if ccfg.attacks.paraphrase:
        b = ccfg.attacks.bits
        for name in ccfg.schemes:
            jobs = comp.para_jobs(name, b)
            if jobs is not None and any(comp.cache.load(j.path) is None for j in jobs):
                para_of = functools.partial(comp.para_jobs_of, name, b)
                para.append((f"{name} {b} paraphrase", para_of))
    todo = todo[:cut] + para + todo[cut:]
    todo = [t for t in todo if not _held(t[0])]
    if not todo:
        say("compare: every cell is cached (or claimed by another worker)")
        return ALL_DONE
    what, make = todo[0]
    _claim(what)
    lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    say(f"[{time.strftime('%H:%M:%S')}] {what}")
    for job in make(lm):
        if comp.cache.load(job.path) is not None:
            continue
        t0 = time.perf_counter()
        data = job.run()
        comp.cache.store(job.path, data)
        say(
            f"[{time.strftime('%H:%M:%S')}] {what} {job.path.name}: {data['tokens']} tokens "
            f"in {time.perf_counter() - t0:.0f} s"
        )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    say(f"{what}: {usage.ru_utime + usage.ru_stime:.0f} s of CPU (this process)")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="WorldCup against the multi-bit baselines.")
    ap.add_argument("--config", type=Path, default=Path("docs/results/compare/compare.toml"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--generate", action="store_true", help="generate the next missing cell")
    ap.add_argument("--missing", action="store_true", help="list the missing cells and exit")
    ap.add_argument("--readme", action="store_true", help="print the README's table and exit")
    args = ap.parse_args(argv)
    cfg, ccfg = load_compare(args.config)
    out = args.out or Path(ccfg.out)
    if args.readme:
        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
        sys.stdout.write(readme_table(results))
        return 0
    if args.generate:
        return generate_next(cfg, ccfg)
    comp = Comparison(cfg, ccfg)
    if args.missing:
        for name, bits in comp.plan():
            n = sum(comp.cache.load(j.path) is None for j in comp.jobs(name, bits))
            say(f"{name:36s} {bits!s:>4}  missing {n} batches")
        return 0
    results = comp.run()
    write(results, out)
    status = "complete" if results["complete"] else f"PARTIAL ({len(results['missing'])} missing)"
    say(f"{out / 'report.md'} ({status})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
