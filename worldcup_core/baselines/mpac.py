"""MPAC, the multi-bit baseline (Yoo et al., NAACL 2024), behind WorldCup's protocols.

How it is built, and where it departs from the reference and why:
``docs/baselines.md`` (section MPAC).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from worldcup_core.baselines.cells import CountCellScheme, first_contexts
from worldcup_core.baselines.sequence import GreenListConfig, GreenListSequence
from worldcup_core.config import WatermarkConfig
from worldcup_core.message import Payload
from worldcup_core.prf import PRF, Context, WatermarkKey, pack_context, vocab_bits
from worldcup_core.scoring import TokenEvidence, text_digest

if TYPE_CHECKING:
    from worldcup_core.scheme import SequenceWatermark, WatermarkScheme

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MPAC_VERSION: Final = "mpac-v1"
# What the evaluation report says about this baseline (``describe_settings``).
SETTINGS: Final = (
    "MPAC: lefthash over the last c=2 generated tokens, gamma=0.5 (binary colours, one "
    "payload bit per position), delta=2; calibrated p-value from exact binomial cells, "
    "native z (anti-conservative) reported beside it"
)
# Prefix of the text digest: it seeds the detector's tie-break uniforms, so
# MPAC's and WorldCup's randomisations of the same text stay independent.
_TIEBREAK_DOMAIN: Final = b"mpac"


@dataclass(frozen=True)
class MPACConfig(GreenListConfig):
    """:class:`~worldcup_core.baselines.sequence.GreenListConfig` (binary MPAC, one
    payload bit per position, as in the paper's Appendix B), plus its cell layout.

    >>> MPACConfig().delta
    2.0
    """

    @property
    def cell_config(self) -> WatermarkConfig:
        """The WorldCup configuration under which one cell is one MPAC position."""
        return WatermarkConfig(groups=1, layers=1, context_width=self.context_width)


def _position_u64(prf: PRF, seed: int) -> int:
    return prf.position_u64(seed.to_bytes(8, "little"))


def extract_mpac_evidence(prf: PRF, config: MPACConfig, token_ids: Sequence[int]) -> TokenEvidence:
    """Colour counts of a response (response tokens only, never the prompt).

    A token is scored only where its context occurs for the first time,
    mirroring :meth:`MPACSequence.process_logits`.
    """
    ids = [int(t) for t in token_ids]
    positions: list[int] = []
    colours: list[int] = []
    for t, packed in first_contexts(ids, config.context_width):
        seed = prf.mpac_seed(packed)
        positions.append(_position_u64(prf, seed))
        colours.append(int(vocab_bits(seed, np.array([ids[t]], dtype=np.int64))[0]))
    n = len(positions)
    return TokenEvidence(
        position_u64=np.array(positions, dtype=np.uint64).reshape(n),
        ones=(1 - np.array(colours, dtype=np.int64)).reshape(n, 1),  # 1 <=> colour 0
        trials_per_token=1,
        num_tokens=len(ids),
        text_digest=_TIEBREAK_DOMAIN + text_digest(ids),
    )


def mpac_z_score(evidence: TokenEvidence, num_bits: int, gamma: float = 0.5) -> float:
    """MPAC's native z, ``(G - gamma*T) / sqrt(T*gamma*(1 - gamma))``.

    Anti-conservative (see the module docstring): ``G`` counts each
    position's majority colour, chosen after looking at the counts.
    """
    ones, trials, _ = evidence.cells(num_bits)
    total = int(trials.sum())
    if total == 0:
        return 0.0
    majority = int(np.maximum(ones, trials - ones).sum())
    return (majority - gamma * total) / math.sqrt(total * gamma * (1.0 - gamma))


class MPACSequence(GreenListSequence):
    """Per-sequence MPAC state: the payload's bits on top of the shared bookkeeping."""

    _config: MPACConfig

    def __init__(self, prf: PRF, config: MPACConfig, payload: Payload) -> None:
        super().__init__(config)
        self._prf = prf
        self._bits = np.frombuffer(payload.bits.encode("ascii"), dtype=np.uint8) - ord("0")

    def _green(self, context: Context, vocab: IntArray) -> npt.NDArray[np.bool_]:
        seed = self._prf.mpac_seed(pack_context(context))
        bit = self._bits[_position_u64(self._prf, seed) % self._bits.shape[0]]
        mask: npt.NDArray[np.bool_] = vocab_bits(seed, vocab) == bit
        return mask


class MPAC(CountCellScheme):
    """The MPAC baseline with one key and configuration.

    >>> mpac = MPAC(WatermarkKey(bytes(32)))
    >>> mpac.detect([1, 2, 3], num_bits=8).num_scored_tokens
    3
    """

    name = "mpac"
    version = MPAC_VERSION

    def __init__(self, key: WatermarkKey, config: MPACConfig | None = None) -> None:
        self.key = key
        self.config = config or MPACConfig()
        self._cells = self.config.cell_config
        self._prf = PRF(key)

    def sequence(self, payload: Payload) -> MPACSequence:
        return MPACSequence(self._prf, self.config, payload)

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        return extract_mpac_evidence(self._prf, self.config, token_ids)

    def _native_z(self, ev: TokenEvidence, num_bits: int) -> float:
        return mpac_z_score(ev, num_bits, self.config.gamma)


if TYPE_CHECKING:  # static proof that MPAC fits the harness's protocols

    def _as_scheme(m: MPAC) -> WatermarkScheme:
        return m

    def _as_sequence(s: MPACSequence) -> SequenceWatermark:
        return s
