"""Configuration dataclasses, validated at construction.

The watermark configuration is everything a detector must agree on with the
generator (besides the key): groups ``k``, layers ``m``, the context width
``c`` and the variant. ``alpha`` only shapes generation. Sampling settings
live apart because detection never needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from worldcup_core.prf import MAX_GROUPS, MAX_LAYERS, SCHEME_V2, SCHEME_VERSIONS


class Variant(StrEnum):
    """The paper's method, its ablations (Section 5.1) and the non-distortionary preset."""

    WORLDCUP = "worldcup"  # sum q_int - alpha*tanh(H) * sum q_comp
    NO_ENTROPY = "no-entropy"  # lambda = 1: q - q_bar
    NO_SUBTRACTION = "no-subtraction"  # lambda = 0: q
    RANDOM_SECOND = "random-second"  # q - lambda q', q' from independent g-values
    # The quality preset (the paper's appendix on distortionary and non-distortionary
    # g-value functions, after SynthID): each group plays SynthID's 2-leaf tournament,
    # which is unbiased over keys (E_key[q(x)] = p(x)), and the groups are averaged,
    # with no subtraction and so no clipping. The same sampler as the no-subtraction
    # ablation, named for the property users choose it for.
    NONDISTORTIONARY = "nondistortionary"


MAX_PAYLOAD_BITS = 64


@dataclass(frozen=True)
class WatermarkPreset:
    """Named generation settings (k, m, alpha) a key version can be issued under.

    A key version stores the k, m and alpha it was issued with, so changing which preset
    new keys get never changes how an issued text decodes.
    """

    name: str
    groups: int
    layers: int
    alpha: float
    source: str  # where the choice is measured or documented


# "paper": every figure of the paper and of docs/results before issue #29 (k = 2, alpha = 1.2).
# "frontier": chosen from the measured quality frontier by the rule in
# worldcup_eval.frontier.select_default (docs/results/frontier/report.md, README's
# decision table); tests/test_frontier_default.py pins it to the measured choice.
WATERMARK_PRESETS: dict[str, WatermarkPreset] = {
    "paper": WatermarkPreset("paper", 2, 30, 1.2, "the paper, Section 4.1"),
    "frontier": WatermarkPreset("frontier", 1, 30, 0.6, "docs/results/frontier/report.md"),
}
# the preset of new key versions when none is configured
SERVICE_PRESET = "frontier"
# the context width c of new key versions when none is configured (a key version stores
# its own, so changing this never changes how an issued text decodes)
SERVICE_CONTEXT_WIDTH = 4


# Below this the sampler's float32 logits / temperature overflow to inf and the
# softmax turns NaN: the batch step fails, and with it every generation in the
# batch (found by schemathesis: temperature 2e-89 gave a 500). 0.01 is already
# all but greedy; the service reads a requested 0 as this.
MIN_TEMPERATURE = 0.01
# "sampled": the distribution each token was drawn from (after penalties, grammar,
# filters and the watermark); "model": the model's own log-softmax, before all of them
LOGPROBS_MODES = ("sampled", "model")


@dataclass(frozen=True)
class WatermarkConfig:
    """What generator and detector share.

    >>> WatermarkConfig(groups=2, layers=30).symbols_for(16)
    8
    """

    groups: int = 2
    layers: int = 30
    alpha: float = 1.2
    context_width: int = 2
    variant: Variant = Variant.WORLDCUP
    # The PRF and scoring rules; a text decodes only under the version it was issued
    # with, so every stored key version records it (see ``prf.py``). v2 is the default
    # for new keys; v1 keys stay readable forever.
    version: str = SCHEME_V2

    def __post_init__(self) -> None:
        if self.version not in SCHEME_VERSIONS:
            raise ValueError(
                f"scheme version must be one of {', '.join(SCHEME_VERSIONS)}, got {self.version!r}"
            )
        if not 1 <= self.groups <= MAX_GROUPS:
            raise ValueError(f"groups (k) must be in 1..{MAX_GROUPS}, got {self.groups}")
        if not 1 <= self.layers <= MAX_LAYERS:
            raise ValueError(f"layers (m) must be in 1..{MAX_LAYERS}, got {self.layers}")
        if not 0.0 <= self.alpha <= 10.0:
            raise ValueError(f"alpha must be in [0, 10], got {self.alpha}")
        if not 1 <= self.context_width <= 8:
            raise ValueError(f"context_width (c) must be in 1..8, got {self.context_width}")
        object.__setattr__(self, "variant", Variant(self.variant))

    def symbols_for(self, num_bits: int) -> int:
        """Number of message positions B = ceil(b / k)."""
        if not 1 <= num_bits <= MAX_PAYLOAD_BITS:
            raise ValueError(f"num_bits must be in 1..{MAX_PAYLOAD_BITS}, got {num_bits}")
        return -(-num_bits // self.groups)


def service_config(version: str = SCHEME_V2) -> WatermarkConfig:
    """What the service gives a new key version when nothing is configured: the service
    preset's k, m and alpha at the service's context width.

    >>> service_config().context_width == SERVICE_CONTEXT_WIDTH
    True
    """
    preset = WATERMARK_PRESETS[SERVICE_PRESET]
    return WatermarkConfig(
        groups=preset.groups,
        layers=preset.layers,
        alpha=preset.alpha,
        context_width=SERVICE_CONTEXT_WIDTH,
        version=version,
    )


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request sampling; the watermark acts on the distribution these leave."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.95
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    seed: int | None = None
    # OpenAI/vLLM sampling fields, applied before the watermark (see ``pipeline``)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # per-token log-probabilities: None off; else how many alternatives (0..20)
    logprobs: int | None = None
    logprobs_mode: str = "sampled"  # "sampled" (q, what was drawn from) or "model"
    # log-probabilities of the prompt's own tokens (completions' echo): None off; else how
    # many alternatives (0..20). Always the model's distribution: nothing is sampled there
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Below 0.01 the float32 division by the temperature overflows and the
        # softmax turns into NaN (found by fuzzing); vLLM uses the same floor.
        if not MIN_TEMPERATURE <= self.temperature <= 10.0:
            raise ValueError(
                f"temperature must be in [{MIN_TEMPERATURE}, 10], got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias needs token ids >= 0 and biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in 0..20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in 0..20, got {self.prompt_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}")

    @property
    def penalised(self) -> bool:
        """Whether any repetition, presence or frequency penalty applies."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
