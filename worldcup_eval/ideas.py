"""Design experiments within WorldCup's framework (issue #29), for the evaluation only.

An idea here changes how one generation step is reweighted and nothing the detector
reads, so its texts decode with the plain :class:`~worldcup_core.WorldCup` of the same
k, m and key. An idea that wins on the frontier becomes a
:class:`~worldcup_core.config.Variant` with its batched step; one that does not stays
here, measured and documented.

* ``flat``: a constant subtraction weight, ``lambda = alpha`` at every step, instead of
  the paper's ``alpha * tanh(H)``. To first order (no clipping) a constant lambda is the
  schedule that maximises the decoder's expected signal for a given KL from the
  model's distribution (equal amplification of every step), so it is the natural
  challenger to an entropy-shaped schedule.
* ``nomask`` (issue #40, an ablation): repeated-context masking switched *off* at
  generation. WorldCup, like SynthID and vLLM's sampler-level watermarks, samples a
  step whose c-token context already occurred in the response from the unmodified
  distribution (``worldcup_core.encoder``); here every step is watermarked, repeats
  included. The detector still skips repeated contexts (a repeated seed would count
  twice), so this measures what the mask buys: the same decodable signal, and the text
  quality and repetition without it.
"""

from __future__ import annotations

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.encoder import WorldCupEncoder, WorldCupSequence
from worldcup_core.prf import SCHEME_V1
from worldcup_core.scheme import SequenceWatermark
from worldcup_core.tournament import FloatArray

IDEAS = ("flat", "nomask")


class _FlatSequence(WorldCupSequence):
    def subtraction_weight(self, probs: FloatArray) -> float:
        return float(self._enc.config.alpha)


class FlatLambdaWorldCup(WorldCup):
    """WorldCup (scheme worldcup-v1) with ``lambda = alpha`` at every step."""

    def sequence(self, payload: Payload) -> SequenceWatermark:
        if self.config.version != SCHEME_V1:
            raise ValueError("the flat-lambda experiment runs under worldcup-v1 only")
        return _FlatSequence(WorldCupEncoder(self.key, self.config, payload))


class _UnmaskedSequence(WorldCupSequence):
    def observe(self, token: int) -> None:
        self.generated.append(int(token))  # no context is ever recorded as seen


class UnmaskedWorldCup(WorldCup):
    """WorldCup (scheme worldcup-v1) that watermarks repeated contexts too (an ablation)."""

    def sequence(self, payload: Payload) -> SequenceWatermark:
        if self.config.version != SCHEME_V1:
            raise ValueError("the no-mask ablation runs under worldcup-v1 only")
        return _UnmaskedSequence(WorldCupEncoder(self.key, self.config, payload))


def idea_scheme(idea: str, key: WatermarkKey, config: WatermarkConfig) -> WorldCup:
    """The WorldCup variant of a design idea (``IDEAS``)."""
    kinds: dict[str, type[WorldCup]] = {"flat": FlatLambdaWorldCup, "nomask": UnmaskedWorldCup}
    if idea not in kinds:
        raise ValueError(f"unknown design idea {idea!r}; known: {', '.join(IDEAS)}")
    return kinds[idea](key, config)
