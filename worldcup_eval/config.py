"""What an evaluation run is: the grid, the protocol and where things go.

One frozen dataclass, :class:`EvalConfig`, validated at construction. It is
built from defaults (the issue's full grid), then the ``--smoke`` preset, then
a config file (TOML, JSON or YAML, keys as the field names with ``_`` or
``-``), then command-line flags; later sources win.

Schemes are named, so that a cache key, a table row and a plot legend all say
the same thing:

* ``unwatermarked``: plain sampling (payload-independent, generated once);
* ``worldcup-k1``, ``worldcup-k2``: WorldCup with k groups, m=30, alpha=1.2, scheme
  ``worldcup-v1`` (the committed results were generated with it);
* ``worldcup-v2-k1``, ``worldcup-v2-k2``: the same under scheme ``worldcup-v2``;
* ``worldcup-k1-nondistortionary``, ``worldcup-k2-nondistortionary`` (and the
  ``worldcup-v2-`` forms): the non-distortionary preset (no subtraction; unbiased
  over keys), a main scheme users choose for text quality;
* ``mpac``, ``bimark``, ``segmark``, ``stealthink``: the paper's baselines (each
  module's ``SETTINGS``; any name in ``worldcup_core.baselines.BASELINES``);
* ``segmark``: the SegMark baseline (RSBH: Reed-Solomon segments, c=2, gamma=0.5, delta=2);
  every baseline's settings are in ``worldcup_core.baselines.BASELINE_SETTINGS``;
* ``worldcup-k2-no-entropy``, ``-no-subtraction``, ``-random-second``: the
  paper's ablations (Section 5.1), listed under ``ablations`` and run only at
  ``ablation_bits`` x ``ablation_lengths``.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from worldcup_core.baselines import BASELINES
from worldcup_core.config import MAX_PAYLOAD_BITS, SamplingConfig, Variant, WatermarkConfig

# The paper's Table 1: WorldCup and the four baselines (the non-distortionary preset is
# selected by name, e.g. --schemes unwatermarked,worldcup-k2-nondistortionary).
MAIN_SCHEMES = (
    "unwatermarked",
    "worldcup-k1",
    "worldcup-k2",
    "mpac",
    "bimark",
    "segmark",
    "stealthink",
)
ABLATIONS = ("no-entropy", "no-subtraction", "random-second")
PRESETS = ("nondistortionary",)  # variants run as main schemes, not as ablations
ATTACKS = ("deletion", "synonym", "copy-paste", "paraphrase")
DATASETS = ("cnn", "eli5")
ABLATION_BASE = "worldcup-k2"  # the ablations change one part of this configuration


@dataclass(frozen=True)
class SchemeSpec:
    """A named scheme configuration; ``describe()`` is what cache keys hash."""

    name: str
    kind: str  # "none", "worldcup" or a baseline's name (``worldcup_core.baselines.BASELINES``)
    groups: int = 2
    layers: int = 30
    alpha: float = 1.2
    variant: str = Variant.WORLDCUP.value
    version: str = "worldcup-v1"
    strength: float | None = None  # a baseline's bias (worldcup_core.baselines.STRENGTH)

    @property
    def watermarked(self) -> bool:
        return self.kind != "none"

    @property
    def is_ablation(self) -> bool:
        return self.kind == "worldcup" and self.variant in ABLATIONS

    def describe(self) -> dict[str, Any]:
        """What cache keys hash. ``version`` appears only when it is not v1 and
        ``strength`` only when set, so the cache written before either existed keeps
        hitting."""
        out = asdict(self)
        if out["version"] == "worldcup-v1":
            del out["version"]
        if out["strength"] is None:  # a baseline at its paper setting: the committed key
            del out["strength"]
        return out


def scheme_spec(name: str, layers: int = 30, alpha: float = 1.2) -> SchemeSpec:
    """Parse a scheme name (see the module docstring)."""
    if name == "unwatermarked":
        return SchemeSpec(name, "none")
    if name in BASELINES:
        return SchemeSpec(name, name, groups=1, layers=1, alpha=0.0)
    version = "worldcup-v1"
    rest = name
    if name.startswith("worldcup-v2-"):
        version, rest = "worldcup-v2", "worldcup-" + name.removeprefix("worldcup-v2-")
    for k in (1, 2):
        base = f"worldcup-k{k}"
        if rest == base:
            return SchemeSpec(name, "worldcup", k, layers, alpha, version=version)
        if rest.startswith(base + "-") and rest.removeprefix(base + "-") in ABLATIONS + PRESETS:
            variant = rest.removeprefix(base + "-")
            return SchemeSpec(name, "worldcup", k, layers, alpha, variant, version)
    names = (
        MAIN_SCHEMES
        + tuple(BASELINES)
        + ("worldcup-v2-k1", "worldcup-v2-k2")
        + tuple(f"worldcup{v}-k{k}-{p}" for v in ("", "-v2") for k in (1, 2) for p in PRESETS)
        + tuple(f"{ABLATION_BASE}-{a}" for a in ABLATIONS)
    )
    known = ", ".join(dict.fromkeys(names))  # each once, in this order
    raise ValueError(f"unknown scheme {name!r}; known: {known}")


@dataclass(frozen=True)
class EvalConfig:
    """An evaluation run. Defaults are the issue's full grid on the embedded model."""

    prompts: int = 100
    bits: tuple[int, ...] = (16, 24, 32, 48)
    lengths: tuple[int, ...] = (128, 256)
    schemes: tuple[str, ...] = MAIN_SCHEMES
    ablations: tuple[str, ...] = ABLATIONS
    ablation_bits: tuple[int, ...] = (32,)
    ablation_lengths: tuple[int, ...] = (256,)
    attacks: tuple[str, ...] = ATTACKS
    attack_bits: tuple[int, ...] | None = None  # None: every entry of ``bits``
    attack_length: int | None = None  # None: max(lengths)
    datasets: tuple[str, ...] = DATASETS
    # generation protocol (paper, Section 4.1)
    min_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.95
    no_repeat_ngram_size: int = 4
    layers: int = 30
    alpha: float = 1.2
    prompt_tokens: int = 40
    batch_size: int = 8
    seed: int = 2026
    # decoding
    list_size: int = 16
    registry_size: int = 1000
    human_texts: int = 2000  # cap on the human-text pool for the empirical FPR
    # attacks (paper, Appendix D)
    deletion_ratio: float = 0.2
    synonym_ratio: float = 0.2
    copy_paste_segments: int = 3
    copy_paste_human_fraction: float = 0.3
    paraphrase_temperature: float = 0.7
    # plots
    curve_step: int = 32
    # where
    out: str = "docs/results"
    cache_dir: str | None = None  # None: <out>/cache (git-ignored by a .gitignore inside it)
    data_dir: str | None = None  # None: $WORLDCUP_DATA_DIR or ../shared/data
    model: str | None = None  # None: the embedded SmolLM2
    device: str = "cpu"
    dtype: str = "auto"
    scorer_model: str | None = None
    scorer_device: str | None = None  # None: same as device
    smoke: bool = False

    def __post_init__(self) -> None:
        if not self.bits or not self.lengths:
            raise ValueError("bits and lengths must not be empty")
        for b in self.bits + self.ablation_bits + (self.attack_bits or ()):
            if not 1 <= b <= MAX_PAYLOAD_BITS:
                raise ValueError(f"payload bits must be in 1..{MAX_PAYLOAD_BITS}, got {b}")
        longest = max(self.lengths)
        for n in self.lengths + self.ablation_lengths:
            if not 1 <= n <= 4096:
                raise ValueError(f"lengths must be in 1..4096, got {n}")
            if n > longest:
                raise ValueError(f"ablation length {n} exceeds the longest length {longest}")
        if self.attack_length is not None and not 1 <= self.attack_length <= longest:
            raise ValueError(f"attack_length must be in 1..{longest}, got {self.attack_length}")
        if not 0 <= self.min_new_tokens <= longest:
            raise ValueError(f"min_new_tokens must be in 0..{longest}, got {self.min_new_tokens}")
        if self.prompts < 2:
            raise ValueError(f"prompts must be >= 2, got {self.prompts}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.list_size < 1 or self.registry_size < 2 or self.human_texts < 1:
            raise ValueError("list_size >= 1, registry_size >= 2 and human_texts >= 1 required")
        if not 0.0 <= self.deletion_ratio < 1.0 or not 0.0 <= self.synonym_ratio <= 1.0:
            raise ValueError("deletion_ratio must be in [0, 1) and synonym_ratio in [0, 1]")
        if not 0.0 < self.copy_paste_human_fraction < 1.0 or self.copy_paste_segments < 1:
            raise ValueError("copy_paste_human_fraction in (0, 1), copy_paste_segments >= 1")
        if self.curve_step < 1:
            raise ValueError(f"curve_step must be >= 1, got {self.curve_step}")
        for s in self.schemes:
            scheme_spec(s)
        for a in self.ablations:
            if a not in ABLATIONS:
                raise ValueError(f"unknown ablation {a!r}; known: {', '.join(ABLATIONS)}")
        for a in self.attacks:
            if a not in ATTACKS:
                raise ValueError(f"unknown attack {a!r}; known: {', '.join(ATTACKS)}")
        for d in self.datasets:
            if d not in DATASETS:
                raise ValueError(f"unknown dataset {d!r}; known: {', '.join(DATASETS)}")
        if not self.datasets:
            raise ValueError("datasets must not be empty")
        _ = self.sampling  # validates the sampling settings

    # ------------------------------------------------------------------ derived

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def attack_len(self) -> int:
        return self.attack_length if self.attack_length is not None else self.max_length

    @property
    def attacked_bits(self) -> tuple[int, ...]:
        return self.attack_bits if self.attack_bits is not None else self.bits

    @property
    def sampling(self) -> SamplingConfig:
        """Sampling for every generation, at the longest length (shorter ones are prefixes)."""
        return SamplingConfig(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_new_tokens=self.max_length,
            min_new_tokens=self.min_new_tokens,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
        )

    def spec(self, name: str) -> SchemeSpec:
        return scheme_spec(name, self.layers, self.alpha)

    @property
    def ablation_schemes(self) -> tuple[str, ...]:
        return tuple(f"{ABLATION_BASE}-{a}" for a in self.ablations)

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else self.out_dir / "cache"

    def watermark_config(self, spec: SchemeSpec) -> WatermarkConfig:
        return WatermarkConfig(
            groups=spec.groups,
            layers=spec.layers,
            alpha=spec.alpha,
            variant=Variant(spec.variant),
            version=spec.version,
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


SMOKE_OVERRIDES: dict[str, Any] = {
    "prompts": 4,
    "bits": (8, 16),
    "lengths": (32, 64),
    "schemes": ("unwatermarked", "worldcup-k2", "mpac"),
    "ablations": ("no-entropy",),
    "ablation_bits": (16,),
    "ablation_lengths": (64,),
    # paraphrase is kept: it exercises the batched, cached attack path, and is cheap here
    "attacks": ATTACKS,
    "attack_bits": (16,),
    "min_new_tokens": 16,
    "batch_size": 4,
    "human_texts": 200,
    "curve_step": 16,
    "smoke": True,
}


_TUPLE_INT = {"bits", "lengths", "ablation_bits", "ablation_lengths", "attack_bits"}
_TUPLE_STR = {"schemes", "ablations", "attacks", "datasets"}


def _coerce(name: str, value: Any) -> Any:
    """Lists or comma strings for tuple fields; ``none``/empty lists for empty tuples."""
    if value is None:
        return None
    if name in _TUPLE_INT | _TUPLE_STR:
        items: list[Any]
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",") if v.strip()]
            if items == ["none"]:
                items = []
        elif isinstance(value, int):
            items = [value]
        else:
            items = list(value)
        return tuple(int(v) for v in items) if name in _TUPLE_INT else tuple(map(str, items))
    return value


def merge(base: EvalConfig, overrides: Mapping[str, Any]) -> EvalConfig:
    """``base`` with ``overrides`` applied; unknown keys are an error, not a silent no-op."""
    known = {f.name for f in fields(EvalConfig)}
    clean: dict[str, Any] = {}
    for raw_key, value in overrides.items():
        key = raw_key.replace("-", "_")
        if key not in known:
            raise ValueError(f"unknown config key {raw_key!r}")
        clean[key] = _coerce(key, value)
    return replace(base, **clean)


def load_config_file(path: Path) -> dict[str, Any]:
    """A mapping from a .toml, .json, .yaml or .yml file."""
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    data: Any
    if suffix == ".toml":
        data = tomllib.loads(text)
    elif suffix == ".json":
        data = json.loads(text)
    elif suffix in (".yaml", ".yml"):
        import yaml  # type: ignore[import-untyped,unused-ignore]

        data = yaml.safe_load(text)
    else:
        raise ValueError(f"config file must be .toml, .json, .yaml or .yml: {path}")
    if not isinstance(data, dict):
        raise ValueError(f"config file must hold a mapping at the top level: {path}")
    section = data.get("eval", data)  # a [eval] table is accepted too
    if not isinstance(section, dict):
        raise ValueError(f"[eval] must be a table in {path}")
    return section


def build_config(
    smoke: bool = False,
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EvalConfig:
    """Defaults, then ``--smoke``, then the file, then flags (``None`` flags are skipped)."""
    cfg = EvalConfig()
    if smoke:
        cfg = merge(cfg, SMOKE_OVERRIDES)
    if config_file is not None:
        cfg = merge(cfg, load_config_file(config_file))
    if overrides:
        cfg = merge(cfg, {k: v for k, v in overrides.items() if v is not None})
    return cfg


__all__ = [
    "ABLATIONS",
    "ATTACKS",
    "DATASETS",
    "MAIN_SCHEMES",
    "EvalConfig",
    "SchemeSpec",
    "build_config",
    "load_config_file",
    "merge",
    "scheme_spec",
]
