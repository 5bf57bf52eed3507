"""The quality frontier: WorldCup over alpha x k against the baselines (issue #29).

**Names.** A frontier point is a scheme name with optional settings after ``@``::

    worldcup-k1@0.6          WorldCup k=1, alpha 0.6 (m=30, scheme worldcup-v1)
    worldcup-k2@0.6/m10      ... k=2, alpha 0.6, m=10 layers
    worldcup-v2-k1@0.6       ... under scheme worldcup-v2
    worldcup-k2-flat@0.45    a design experiment (worldcup_eval.ideas) at alpha 0.45
    bimark, mpac, worldcup-k1-nondistortionary, ...   any name worldcup eval knows

The spec keeps the base scheme name, so a point's cache key is the one
``worldcup eval`` writes with ``alpha``/``layers`` set in a config file: the committed
cache's cells are reused, and a point generated here is reused there.
"""

from __future__ import annotations

import json
import math
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from worldcup_eval.cache import (
    BatchCache,
    say,
    stable_hash,
    write_results_json,
    write_text_atomic,
)
from worldcup_eval.config import EvalConfig, SchemeSpec, _jsonable, build_config
from worldcup_eval.data import EvalData, default_data_dir, load_data
from worldcup_eval.ideas import IDEAS
from worldcup_eval.metrics import auc, bit_accuracy, mean, median, standard_error
from worldcup_eval.quality import distinct_n, repetition, words
from worldcup_eval.runner import GenCell, build_scheme, gen_jobs, model_fingerprint
from worldcup_eval.seeding import eval_key

FRONTIER_SCHEMA = "worldcup-frontier-v1"


def frontier_spec(name: str, cfg: EvalConfig) -> SchemeSpec:
    """The :class:`SchemeSpec` of a frontier point's name (see the module docstring)."""
    base, sep, settings = name.partition("@")
    idea = next((i for i in IDEAS if base.endswith(f"-{i}")), None)
    if idea is not None:  # a design experiment (worldcup_eval.ideas) on a WorldCup base
        spec = cfg.spec(base.removesuffix(f"-{idea}"))
        if spec.kind != "worldcup" or spec.variant != "worldcup":
            raise ValueError(f"{name!r}: a design idea applies to worldcup-k1/-k2 only")
        spec = replace(spec, name=base, kind=f"worldcup-{idea}")
    else:
        spec = cfg.spec(base)
    if not sep:
        return spec
    if not spec.kind.startswith("worldcup"):
        raise ValueError(f"{name!r}: settings after '@' apply to WorldCup schemes only")
    alpha_text, _, layers_text = settings.partition("/")
    try:
        alpha = float(alpha_text)
        layers = int(layers_text.removeprefix("m")) if layers_text else spec.layers
    except ValueError:
        raise ValueError(f"{name!r}: expected NAME@ALPHA or NAME@ALPHA/mLAYERS") from None
    if layers_text and not layers_text.startswith("m"):
        raise ValueError(f"{name!r}: expected NAME@ALPHA/mLAYERS")
    return replace(spec, alpha=alpha, layers=layers)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class FrontierConfig:
    """What the frontier measures; the ``[frontier]`` table of the sweep's TOML file."""

    points: tuple[str, ...]
    # (payload bits, tokens) pairs; every cell is generated at the eval's longest length
    # and read as a prefix (sampling is causal, see worldcup_eval.runner)
    settings: tuple[tuple[int, int], ...] = ((32, 256), (48, 128))
    short_length: int = 128  # the detection-power length: TPR at p < fpr on this prefix
    fpr: float = 1e-3
    reference: str = "bimark"  # paired differences are taken against this point
    today: str = "worldcup-k2"  # the service default the frontier replaces (the paper's)
    ppl_margin: float = 0.05  # eligible: median self-PPL <= unwatermarked * (1 + margin)
    select_at: tuple[int, int] = (32, 256)  # the service's default payload length
    bootstrap: int = 2000  # resamples for the SE of a median
    # design ideas: (idea, base) pairs compared at every setting on the prompts both have
    # (an idea may be generated for its first batches only: a paired screen)
    ideas: tuple[tuple[str, str], ...] = ()
    # confirmations: (point, base) pairs compared at every setting on the prompts both
    # have; the chosen point under the scheme version new keys get (the sweep is v1's)
    confirm: tuple[tuple[str, str], ...] = ()
    out: str = "docs/results/frontier"

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("frontier points must not be empty")
        if not 0.0 < self.fpr < 1.0 or self.ppl_margin < 0 or self.bootstrap < 10:
            raise ValueError("fpr in (0, 1), ppl_margin >= 0 and bootstrap >= 10 required")
        if self.select_at not in self.settings:
            raise ValueError(f"select_at {self.select_at} is not one of the settings")
        for name in (self.reference, self.today):
            if name not in self.points:
                raise ValueError(f"{name!r} must be one of the frontier points")


def load_frontier(path: Path) -> tuple[EvalConfig, FrontierConfig]:
    """The eval protocol (``[eval]``) and the frontier (``[frontier]``) of one TOML file."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    cfg = build_config(overrides=data.get("eval", {}))
    raw = dict(data.get("frontier", {}))
    for key in ("settings",):
        if key in raw:
            raw[key] = tuple(tuple(int(v) for v in pair) for pair in raw[key])
    for key in ("points",):
        if key in raw:
            raw[key] = tuple(str(v) for v in raw[key])
    for key in ("ideas", "confirm"):
        if key in raw:
            raw[key] = tuple((str(a), str(b)) for a, b in raw[key])
    if "select_at" in raw:
        raw["select_at"] = tuple(int(v) for v in raw["select_at"])
    known = {f.name for f in fields(FrontierConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"unknown [frontier] keys: {', '.join(sorted(unknown))}")
    fcfg = FrontierConfig(**raw)
    longest = cfg.max_length
    for bits, length in fcfg.settings:
        if length > longest or fcfg.short_length > longest:
            raise ValueError(f"length {length} exceeds the generated length {longest}")
        if not 1 <= bits <= 64:
            raise ValueError(f"payload bits must be in 1..64, got {bits}")
    return cfg, fcfg


# --------------------------------------------------------------------------- statistics


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n > 0 else math.nan


def auc_se(a: float, n_pos: int, n_neg: int) -> float:
    """Hanley and McNeil's (1982) standard error of an AUC (0 at AUC = 1)."""
    if not n_pos or not n_neg or not math.isfinite(a):
        return math.nan
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    var = (a * (1 - a) + (n_pos - 1) * (q1 - a * a) + (n_neg - 1) * (q2 - a * a)) / (n_pos * n_neg)
    return math.sqrt(max(var, 0.0))


def median_se(values: Sequence[float], resamples: int, seed: int) -> float:
    """Bootstrap standard error of the median (seeded: the report is reproducible)."""
    v = np.asarray([x for x in values if math.isfinite(x)], float)
    if len(v) < 2:
        return math.nan
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(v), size=(resamples, len(v)))
    return float(np.median(v[draws], axis=1).std(ddof=1))


def mean_se(values: Sequence[float | None]) -> tuple[float, float]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return mean(v), standard_error(v)


def paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the paired differences a - b."""
    d = [x - y for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)]
    return mean(d), standard_error(d)


# --------------------------------------------------------------------------- measurement


@dataclass
class _Texts:
    """The per-text values of one set of texts (a cell, the unwatermarked or human texts)."""

    index: list[int]
    log_ppl: list[float]  # mean negative log-probability (nan without log-probabilities)
    distinct2: list[float | None]
    distinct3: list[float | None]
    rep3: list[float | None]

    def summary(self, resamples: int, seed: int) -> dict[str, Any]:
        ppl = [math.exp(x) for x in self.log_ppl]
        out: dict[str, Any] = {"n": len(self.index)}
        if any(math.isfinite(x) for x in self.log_ppl):
            out["self_ppl_median"] = _r(median(ppl), 4)
            out["self_ppl_median_se"] = _r(median_se(ppl, resamples, seed), 4)
            m, se = mean_se(self.log_ppl)
            out["log_ppl_mean"], out["log_ppl_mean_se"] = _r(m, 5), _r(se, 5)
        for key, values in (
            ("distinct2", self.distinct2),
            ("distinct3", self.distinct3),
            ("rep3", self.rep3),
        ):
            m, se = mean_se(values)
            out[key], out[f"{key}_se"] = _r(m, 5), _r(se, 5)
        return out


def _texts(
    tokenizer: Any, items: list[tuple[int, Sequence[int], Sequence[float] | None]], length: int
) -> _Texts:
    out = _Texts([], [], [], [], [])
    for index, ids, logprobs in items:
        w = words(tokenizer.decode(list(ids[:length]), skip_special_tokens=True))
        out.index.append(index)
        lp = list(logprobs[:length]) if logprobs is not None else []
        out.log_ppl.append(-float(np.mean(lp)) if lp else math.nan)
        out.distinct2.append(distinct_n(w, 2))
        out.distinct3.append(distinct_n(w, 3))
        out.rep3.append(repetition(w, 3))
    return out


def _r(x: float | None, nd: int = 5) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), nd)


def _detector_key(spec: SchemeSpec) -> tuple[Any, ...]:
    """What a detector depends on: alpha only shapes generation, so it is left out."""
    return (spec.kind, spec.groups, spec.layers, spec.variant, spec.version)


class Frontier:
    """Loads the cached cells of a sweep and measures every point (model-free)."""

    def __init__(self, cfg: EvalConfig, fcfg: FrontierConfig) -> None:
        from worldcup_core.models import load_tokenizer

        self.cfg, self.fcfg = cfg, fcfg
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
        self._negatives: dict[tuple[Any, ...], list[float]] = {}
        self.missing: list[str] = []

    def rows(
        self, name: str, bits: int | None, partial: bool = False
    ) -> list[dict[str, Any]] | None:
        """The cached rows of one cell, by prompt index; None when any batch is missing
        (with ``partial``: the batches that are cached, None when there are none)."""
        cell = GenCell(frontier_spec(name, self.cfg), bits)
        out: list[dict[str, Any]] = []
        for job in gen_jobs(self.cfg, None, cell, self.data.prompts, self.cache, self.model_fp):
            batch = self.cache.load(job.path)
            if batch is None:
                if partial:
                    continue
                return None
            out += batch["rows"]
        return sorted(out, key=lambda r: int(r["index"])) if out else None

    def negatives(self, spec: SchemeSpec, scheme: Any, bits: int, length: int) -> list[float]:
        """``-log10 p`` of the unwatermarked generations and the human continuations."""
        key = (*_detector_key(spec), bits, length)
        if key not in self._negatives:
            ids = [r["token_ids"][:length] for r in self.unwatermarked]
            ids += [list(p.human_ids[:length]) for p in self.data.prompts]
            self._negatives[key] = [
                -scheme.detect(list(x), num_bits=bits).log10_p_value for x in ids
            ]
        return self._negatives[key]

    def run(self) -> dict[str, Any]:
        cfg, fcfg = self.cfg, self.fcfg
        unwm = self.rows("unwatermarked", None)
        if unwm is None:
            raise RuntimeError("no unwatermarked generations cached: nothing can be measured")
        self.unwatermarked = unwm
        settings: list[dict[str, Any]] = []
        for bits, length in fcfg.settings:
            seed = int(stable_hash([cfg.seed, bits, length], 8), 16)
            base = _texts(
                self.tokenizer,
                [(r["index"], r["token_ids"], r["logprobs"]) for r in unwm],
                length,
            )
            human = _texts(
                self.tokenizer,
                [(p.index, p.human_ids, None) for p in self.data.prompts],
                length,
            )
            points: list[dict[str, Any]] = []
            per_text: dict[str, dict[str, list[float]]] = {}
            for name in fcfg.points:
                rows = self.rows(name, bits)
                if rows is None:
                    self.missing.append(f"{name} {bits}")
                    continue
                point, values = self.point(name, rows, bits, length, seed)
                points.append(point)
                per_text[name] = values
            ref = per_text.get(fcfg.reference)
            for point in points:
                if ref is not None and point["name"] != fcfg.reference:
                    mine = per_text[point["name"]]
                    for key in ("bit_accuracy", "log_ppl"):
                        d, se = paired(mine[key], ref[key])
                        point[f"{key}_minus_reference"] = _r(d)
                        point[f"{key}_minus_reference_se"] = _r(se)
            settings.append(
                {
                    "bits": bits,
                    "length": length,
                    "unwatermarked": base.summary(fcfg.bootstrap, seed),
                    "human": human.summary(fcfg.bootstrap, seed),
                    "points": points,
                }
            )
        results: dict[str, Any] = {
            "schema": FRONTIER_SCHEMA,
            "complete": not self.missing,
            "missing": self.missing,
            "eval_config": cfg.to_dict(),
            "frontier_config": _jsonable(asdict(fcfg)),
            "protocol": {
                "model": self.model_fp,
                "key_id": eval_key(cfg.seed).key_id,
                "prompts": len(self.data.prompts),
                "generated_length": cfg.max_length,
            },
            "settings": settings,
        }
        results["ideas"] = self.ideas()
        results["confirm"] = [
            pair
            for bits, length in fcfg.settings
            for pair in self.pairs(fcfg.confirm, bits, length, "confirm")
        ]
        results["selection"] = select_default(results)
        return results

    def ideas(self) -> list[dict[str, Any]]:
        """Each design idea against its base at every setting, paired."""
        return [
            pair
            for bits, length in self.fcfg.settings
            for pair in self.pairs(self.fcfg.ideas, bits, length, "ideas")
        ]

    def pairs(
        self, pairs: Sequence[tuple[str, str]], bits: int, length: int, tag: str
    ) -> list[dict[str, Any]]:
        """Each (point, base) pair at (bits, length), paired on the prompts both have
        (a point generated for its first batches only is compared on those)."""
        seed = int(stable_hash([self.cfg.seed, tag, bits, length], 8), 16)
        out: list[dict[str, Any]] = []
        for idea, base in pairs:
            a, b = self.rows(idea, bits, partial=True), self.rows(base, bits, partial=True)
            if a is None or b is None:
                self.missing.append(f"{idea} or its base {base} at {bits}")
                continue
            common = {r["index"] for r in a} & {r["index"] for r in b}
            a = [r for r in a if r["index"] in common]
            b = [r for r in b if r["index"] in common]
            pa, va = self.point(idea, a, bits, length, seed)
            pb, vb = self.point(base, b, bits, length, seed)
            d_acc, se_acc = paired(va["bit_accuracy"], vb["bit_accuracy"])
            d_lp, se_lp = paired(va["log_ppl"], vb["log_ppl"])
            out.append(
                {
                    "idea": pa,
                    "base": pb,
                    "n": len(common),
                    "bit_accuracy_minus_base": _r(d_acc),
                    "bit_accuracy_minus_base_se": _r(se_acc),
                    "log_ppl_minus_base": _r(d_lp),
                    "log_ppl_minus_base_se": _r(se_lp),
                }
            )
        return out

    def point(
        self, name: str, rows: list[dict[str, Any]], bits: int, length: int, seed: int
    ) -> tuple[dict[str, Any], dict[str, list[float]]]:
        """Every number of one frontier point at (bits, length)."""
        fcfg = self.fcfg
        spec = frontier_spec(name, self.cfg)
        scheme = build_scheme(self.cfg, spec)
        assert scheme is not None
        acc, exact, scores, short_hits = [], [], [], []
        for r in rows:
            ids = list(r["token_ids"][:length])
            res = scheme.decode(ids, bits, list_size=1)
            acc.append(bit_accuracy(res.bits, r["payload"]))
            exact.append(float(res.bits == r["payload"]))
            scores.append(-res.detection.log10_p_value)
            short = scheme.detect(list(r["token_ids"][: fcfg.short_length]), num_bits=bits)
            short_hits.append(float(short.p_value < fcfg.fpr))
        neg = self.negatives(spec, scheme, bits, length)
        neg_short = self.negatives(spec, scheme, bits, fcfg.short_length)
        threshold = -math.log10(fcfg.fpr)
        texts = _texts(
            self.tokenizer, [(r["index"], r["token_ids"], r["logprobs"]) for r in rows], length
        )
        n = len(rows)
        a = auc(scores, neg)
        tpr = mean(short_hits)
        point: dict[str, Any] = {
            "name": name,
            "scheme": spec.kind,
            "groups": spec.groups if spec.kind.startswith("worldcup") else None,
            "alpha": (0.0 if spec.variant == "nondistortionary" else spec.alpha)
            if spec.kind.startswith("worldcup")
            else None,
            "layers": spec.layers if spec.kind.startswith("worldcup") else None,
            "variant": spec.variant if spec.kind.startswith("worldcup") else None,
            "version": spec.version if spec.kind.startswith("worldcup") else None,
            "bits": bits,
            "length": length,
            "bit_accuracy": _r(mean(acc)),
            "bit_accuracy_se": _r(standard_error(acc)),
            "exact": _r(mean(exact)),
            "exact_se": _r(binomial_se(mean(exact), n)),
            "auc": _r(a),
            "auc_se": _r(auc_se(a, n, len(neg))),
            "tpr_short": _r(tpr),
            "tpr_short_se": _r(binomial_se(tpr, n)),
            "fpr_short_negatives": _r(float(np.mean([s > threshold for s in neg_short]))),
            "n_negatives": len(neg),
            **{k: v for k, v in texts.summary(fcfg.bootstrap, seed).items() if k != "n"},
            "n": n,
        }
        return point, {"bit_accuracy": acc, "log_ppl": texts.log_ppl}


# --------------------------------------------------------------------------- the default


def deployable(point: Mapping[str, Any]) -> bool:
    """A point the service can issue keys under: WorldCup's own sampler (a key version
    stores k, m, alpha, c and the scheme version, not a variant). The non-distortionary
    preset is WorldCup at alpha = 0, so it counts."""
    return point["scheme"] == "worldcup" and point["variant"] in ("worldcup", "nondistortionary")


def effective_alpha(point: Mapping[str, Any]) -> float:
    """alpha as the service would store it: 0 for the non-distortionary preset."""
    return 0.0 if point["variant"] == "nondistortionary" else float(point["alpha"])


def select_default(results: Mapping[str, Any]) -> dict[str, Any]:
    """The service default from the frontier, by the documented rule.

    At ``select_at`` (the service's default payload length): among the deployable
    points whose median self-PPL is within ``ppl_margin`` of unwatermarked text and
    whose detection power at ``short_length`` tokens (TPR at p < fpr) is not below
    today's default's, the highest bit accuracy; ties go to the lower PPL.
    """
    fcfg = results["frontier_config"]
    bits, length = fcfg["select_at"]
    setting = next(
        (s for s in results["settings"] if (s["bits"], s["length"]) == (bits, length)), None
    )
    out: dict[str, Any] = {
        "rule": (
            f"at {bits} bits / {length} tokens: highest bit accuracy among WorldCup settings "
            f"with median self-PPL <= {1 + fcfg['ppl_margin']:.2f} x unwatermarked and TPR at "
            f"p < {fcfg['fpr']:g} on {fcfg['short_length']}-token prefixes >= today's "
            f"default ({fcfg['today']}); ties to the lower PPL"
        ),
        "chosen": None,
    }
    if setting is None:
        out["reason"] = "the selection setting has no measured points"
        return out
    points = {p["name"]: p for p in setting["points"]}
    today = points.get(fcfg["today"])
    limit = setting["unwatermarked"]["self_ppl_median"] * (1 + fcfg["ppl_margin"])
    out["ppl_limit"] = _r(limit, 4)
    if today is None:
        out["reason"] = f"today's default {fcfg['today']} is not measured"
        return out
    out["today_tpr_short"] = today["tpr_short"]
    eligible = [
        p
        for p in points.values()
        if deployable(p) and p["self_ppl_median"] <= limit and p["tpr_short"] >= today["tpr_short"]
    ]
    out["eligible"] = sorted(p["name"] for p in eligible)
    if not eligible:
        out["reason"] = "no measured WorldCup setting meets the rule"
        return out
    best = max(eligible, key=lambda p: (p["bit_accuracy"], -p["self_ppl_median"]))
    out["chosen"] = best["name"]
    out["chosen_settings"] = {
        "groups": best["groups"],
        "layers": best["layers"],
        "alpha": effective_alpha(best),
    }
    return out


# --------------------------------------------------------------------------- outputs


def _pm(value: float | None, se: float | None, nd: int = 3) -> str:
    if value is None:
        return "—"
    return f"{value:.{nd}f} ± {se:.{nd}f}" if se is not None else f"{value:.{nd}f}"


def _setting_label(p: Mapping[str, Any]) -> tuple[str, str, str]:
    if not str(p["scheme"]).startswith("worldcup"):
        return "—", "—", "—"
    return str(p["groups"]), f"{p['alpha']:g}", str(p["layers"])


def _pair_table(pairs: Sequence[Mapping[str, Any]], what: str) -> list[str]:
    """The Markdown rows of paired comparisons (design ideas, confirmations)."""
    lines = [
        f"| setting | {what} | base | prompts | {what} bit acc | base bit acc | Δacc | {what} PPL "
        f"| base PPL | Δlog-PPL | {what} dist-2 | base dist-2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i in pairs:
        a, b = i["idea"], i["base"]
        lines.append(
            f"| {a['bits']} bits / {a['length']} tokens | `{a['name']}` | `{b['name']}` | "
            f"{i['n']} | "
            f"{_pm(a['bit_accuracy'], a['bit_accuracy_se'])} | "
            f"{_pm(b['bit_accuracy'], b['bit_accuracy_se'])} | "
            f"{_pm(i['bit_accuracy_minus_base'], i['bit_accuracy_minus_base_se'])} | "
            f"{_pm(a['self_ppl_median'], a['self_ppl_median_se'], 2)} | "
            f"{_pm(b['self_ppl_median'], b['self_ppl_median_se'], 2)} | "
            f"{_pm(i['log_ppl_minus_base'], i['log_ppl_minus_base_se'])} | "
            f"{_pm(a['distinct2'], a['distinct2_se'])} | "
            f"{_pm(b['distinct2'], b['distinct2_se'])} |"
        )
    return [*lines, ""]


def render_frontier(results: Mapping[str, Any]) -> str:
    """The frontier's Markdown report, entirely from ``results``."""
    fcfg = results["frontier_config"]
    lines = ["# The quality frontier (issue #29)", ""]
    if results["missing"]:
        lines += [
            "**Status: PARTIAL** -- these cells were not (yet) generated and are left out: "
            + ", ".join(f"`{m}`" for m in results["missing"]),
            "",
        ]
    else:
        lines += ["**Status: complete** -- every listed point was generated and measured.", ""]
    proto = results["protocol"]
    lines += [
        "## Protocol",
        "",
        f"- {proto['prompts']} prompts (the committed grid's: same seed, prompts, payloads and "
        f"sampling as `docs/results`), model {proto['model']['model']}, key id "
        f"`{proto['key_id']}`; every cell generated once at {proto['generated_length']} tokens "
        "and read as a prefix.",
        f"- Bit accuracy and exact match at the setting's length; AUC of the calibrated score "
        "against the unwatermarked generations and the human continuations of the same prompts "
        "(SE: Hanley-McNeil); TPR at p < "
        f"{fcfg['fpr']:g} on the {fcfg['short_length']}-token prefixes (binomial SE; the "
        "negatives' rate at the same threshold is in results.json as a calibration check).",
        "- Self-PPL: median over texts of the generator's perplexity (bootstrap SE of the "
        "median). Second opinion, without the generator: mean distinct word 2-grams per text "
        "(`dist-2`, higher is more diverse) and the share of word 3-grams that repeat an "
        "earlier one (`rep-3`, lower is better).",
        f"- `Δacc vs {fcfg['reference']}`: the paired mean difference in bit accuracy "
        "(same prompts and payloads) and its SE.",
        "- WorldCup alpha = 0 is the non-distortionary preset's sampler (lambda = 0 either way, "
        "`worldcup_core.encoder.lambda_for`), so the preset's cell is that point.",
        "",
    ]
    for setting in results["settings"]:
        bits, length = setting["bits"], setting["length"]
        u, h = setting["unwatermarked"], setting["human"]
        lines += [
            f"## {bits} bits, {length} tokens",
            "",
            f"| point | k | α | m | bit acc | exact | AUC | TPR p<{fcfg['fpr']:g} "
            f"@{fcfg['short_length']} | self-PPL (median) | dist-2 | rep-3 | "
            f"Δacc vs {fcfg['reference']} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| unwatermarked | — | — | — | — | — | — | — | "
            f"{_pm(u.get('self_ppl_median'), u.get('self_ppl_median_se'), 2)} | "
            f"{_pm(u['distinct2'], u['distinct2_se'])} | {_pm(u['rep3'], u['rep3_se'])} | — |",
            f"| human continuation | — | — | — | — | — | — | — | — | "
            f"{_pm(h['distinct2'], h['distinct2_se'])} | {_pm(h['rep3'], h['rep3_se'])} | — |",
        ]
        for p in setting["points"]:
            k, a, m = _setting_label(p)
            delta = (
                _pm(p.get("bit_accuracy_minus_reference"), p.get("bit_accuracy_minus_reference_se"))
                if p["name"] != fcfg["reference"]
                else "—"
            )
            lines.append(
                f"| `{p['name']}` | {k} | {a} | {m} | "
                f"{_pm(p['bit_accuracy'], p['bit_accuracy_se'])} | "
                f"{_pm(p['exact'], p['exact_se'], 2)} | {_pm(p['auc'], p['auc_se'])} | "
                f"{_pm(p['tpr_short'], p['tpr_short_se'], 2)} | "
                f"{_pm(p['self_ppl_median'], p['self_ppl_median_se'], 2)} | "
                f"{_pm(p['distinct2'], p['distinct2_se'])} | {_pm(p['rep3'], p['rep3_se'])} | "
                f"{delta} |"
            )
        lines.append("")
    if results.get("ideas"):
        lines += [
            "## Design ideas against their base (paired)",
            "",
            "Each idea and its base on the same prompts (an idea generated for its first "
            "batches only is compared on those). `Δlog-PPL` is the paired mean difference of "
            "the per-text log self-perplexity (0.01 is about 1 % of PPL).",
            "",
            *_pair_table(results["ideas"], "idea"),
        ]
    if results.get("confirm"):
        lines += [
            "## The chosen point under the scheme new keys get (paired)",
            "",
            "The sweep runs under scheme `worldcup-v1`, whose cells the committed grid already "
            "had; the service issues new key versions under `worldcup-v2` (a vectorised PRF, "
            "the same sampler). Each row: the v2 cell against its v1 twin on the same prompts "
            "and payloads.",
            "",
            *_pair_table(results["confirm"], "point"),
        ]
    sel = results["selection"]
    lines += ["## The service default, chosen by rule", "", f"Rule: {sel['rule']}.", ""]
    if sel.get("ppl_limit") is not None:
        lines.append(f"PPL limit: {sel['ppl_limit']:.2f}.")
    if sel.get("eligible") is not None:
        lines.append("Eligible: " + (", ".join(f"`{e}`" for e in sel["eligible"]) or "none") + ".")
    if sel["chosen"]:
        s = sel["chosen_settings"]
        lines.append(
            f"Chosen: `{sel['chosen']}` (k = {s['groups']}, m = {s['layers']}, "
            f"alpha = {s['alpha']:g})."
        )
    else:
        lines.append(f"Nothing chosen: {sel.get('reason', '')}.")
    lines += ["", "![frontier](frontier.png)", ""]
    return "\n".join(lines)


def decision_table(results: Mapping[str, Any]) -> str:
    """The README's decision table, from ``results`` (tests check the README holds it)."""
    sel = results["selection"]
    fcfg = results["frontier_config"]
    rows: list[tuple[str, str, str]] = []  # (label, point name, settings)
    if sel["chosen"]:
        s = sel["chosen_settings"]
        rows.append(
            (
                "**service default** (`frontier`)",
                sel["chosen"],
                f"k = {s['groups']}, m = {s['layers']}, α = {s['alpha']:g}",
            )
        )
    rows += [
        ("`paper` (reproduces the paper)", fcfg["today"], "k = 2, m = 30, α = 1.2"),
        ("best text quality (α = 0)", "worldcup-k1-nondistortionary", "k = 1, m = 30, α = 0"),
        ("BiMark (baseline, not served)", "bimark", "—"),
    ]
    header = ["| setting | WorldCup parameters |"]
    rule = ["|---|---|"]
    for st in results["settings"]:
        where = f"{st['bits']} b / {st['length']} t"
        header.append(f" bit acc ({where}) | self-PPL ({where}) |")
        rule.append("---|---|")
    short = (
        f" TPR p<{fcfg['fpr']:g} @{fcfg['short_length']} t ({results['settings'][0]['bits']} b) |"
    )
    lines = ["".join(header) + short, "".join(rule) + "---|"]
    unwm = ["| unwatermarked text | — |"]
    for st in results["settings"]:
        u = st["unwatermarked"]
        unwm.append(f" — | {_pm(u.get('self_ppl_median'), u.get('self_ppl_median_se'), 2)} |")
    lines.append("".join(unwm) + " — |")
    for label, name, params in rows:
        cells = [f"| {label} | {params} |"]
        tpr = "—"
        for i, st in enumerate(results["settings"]):
            p = next((q for q in st["points"] if q["name"] == name), None)
            if p is None:
                cells.append(" not measured | — |")
                continue
            cells.append(
                f" {_pm(p['bit_accuracy'], p['bit_accuracy_se'])} | "
                f"{_pm(p['self_ppl_median'], p['self_ppl_median_se'], 2)} |"
            )
            if i == 0:
                tpr = _pm(p["tpr_short"], p["tpr_short_se"], 2)
        lines.append("".join(cells) + f" {tpr} |")
    return "\n".join(lines) + "\n"


def plot_frontier(results: Mapping[str, Any], path: Path) -> Path:
    """Bit accuracy against median self-PPL with SE bars, one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = results["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(6.4 * len(settings), 5.0), squeeze=False)
    margin = results["frontier_config"]["ppl_margin"]
    for ax, setting in zip(axes[0], settings, strict=True):
        u = setting["unwatermarked"].get("self_ppl_median")
        curves: dict[str, list[Mapping[str, Any]]] = {}
        for p in setting["points"]:
            if deployable(p) and p["layers"] == 30 and p["version"] == "worldcup-v1":
                curves.setdefault(f"WorldCup k={p['groups']}", []).append(p)
            else:
                curves.setdefault(p["name"], []).append(p)
        for label, pts in curves.items():
            pts = sorted(pts, key=lambda p: p["alpha"] or 0.0)
            ax.errorbar(
                [p["self_ppl_median"] for p in pts],
                [p["bit_accuracy"] for p in pts],
                xerr=[p["self_ppl_median_se"] or 0.0 for p in pts],
                yerr=[p["bit_accuracy_se"] or 0.0 for p in pts],
                marker="o" if len(pts) > 1 else "s",
                linestyle="-" if len(pts) > 1 else "none",
                capsize=2,
                label=label,
            )
            if len(pts) > 1:
                for p in pts:
                    ax.annotate(
                        f"α={p['alpha']:g}",
                        (p["self_ppl_median"], p["bit_accuracy"]),
                        textcoords="offset points",
                        xytext=(4, -10),
                        fontsize=7,
                    )
        chosen = next(
            (p for p in setting["points"] if p["name"] == results["selection"].get("chosen")), None
        )
        if chosen is not None:  # ring the service default in every panel
            ax.scatter(
                [chosen["self_ppl_median"]],
                [chosen["bit_accuracy"]],
                s=260,
                facecolors="none",
                edgecolors="black",
                linewidths=1.5,
                zorder=5,
                label="service default",
            )
        if u is not None:
            ax.axvline(u, color="grey", linestyle=":", linewidth=1, label="unwatermarked PPL")
            ax.axvspan(u, u * (1 + margin), color="green", alpha=0.08, label=f"+{margin:.0%}")
        ax.set(
            xlabel="self-PPL (median over texts)",
            ylabel="bit accuracy",
            title=f"{setting['bits']} bits, {setting['length']} tokens",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def write_frontier(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_frontier(results, out_dir / "frontier.png")
    write_text_atomic(out_dir / "report.md", render_frontier(results))
    write_results_json(out_dir / "results.json", results)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Measure the quality frontier from the eval cache.")
    ap.add_argument("--config", type=Path, default=Path("docs/results/frontier/frontier.toml"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--decision-table", action="store_true", help="print the README's table and exit"
    )
    args = ap.parse_args(argv)
    if args.decision_table:
        out_dir = args.out or Path(load_frontier(args.config)[1].out)
        results = json.loads((out_dir / "results.json").read_text(encoding="utf-8"))
        sys.stdout.write(decision_table(results))
        return 0
    cfg, fcfg = load_frontier(args.config)
    results = Frontier(cfg, fcfg).run()
    out = args.out or Path(fcfg.out)
    write_frontier(results, out)
    status = "complete" if results["complete"] else f"PARTIAL ({len(results['missing'])} missing)"
    say(f"{out / 'report.md'} ({status}); chosen: {results['selection']['chosen']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
