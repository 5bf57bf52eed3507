"""StealthInk, the stealthy multi-bit baseline (Jiang et al., ICML 2025), behind our protocols.

How it is built, and where it departs from the reference and why:
``docs/baselines.md`` (section StealthInk).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from worldcup_core.baselines.cells import CountCellScheme, hashed_contexts
from worldcup_core.baselines.mpac import mpac_z_score
from worldcup_core.baselines.sequence import ContextSequence
from worldcup_core.config import WatermarkConfig
from worldcup_core.message import Payload
from worldcup_core.prf import PRF, WatermarkKey, pack_context, splitmix64
from worldcup_core.scoring import TokenEvidence, text_digest

if TYPE_CHECKING:
    from worldcup_core.scheme import SequenceWatermark, WatermarkScheme

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]

STEALTHINK_VERSION: Final = "stealthink-v1"
SETTINGS: Final = (
    "StealthInk: keyed permutation seeded from the last c=2 generated tokens (the appendix's "
    "window; the reference's simple_3 reads 3), H=1 (two colour lists, one bit per position), "
    "red-interval removal with mirror doubling; calibrated p-value from exact binomial colour "
    "counts, native z (not calibrated) reported beside it"
)
SUBKEY_LABEL: Final = "stealthink"
# Prefix of the text digest that seeds the detector's tie-break uniforms.
_TIEBREAK_DOMAIN: Final = b"stealthink"
_CONTEXT_DOMAIN: Final = b"\x00"
_TOP_BIT: Final = np.uint64(63)


@dataclass(frozen=True)
class StealthInkConfig:
    """What StealthInk's generator and detector share (besides the key).

    >>> StealthInkConfig().chunk_bits
    1
    """

    chunk_bits: int = 1  # H: payload bits per message chunk (2^H colour lists)
    context_width: int = 2

    def __post_init__(self) -> None:
        if self.chunk_bits != 1:
            raise ValueError(
                f"only chunk_bits (H) = 1 is supported (two colour lists, one payload bit "
                f"per position, as in the paper's Appendix B), got {self.chunk_bits}"
            )
        if not 1 <= self.context_width <= 8:
            raise ValueError(f"context_width must be in 1..8, got {self.context_width}")

    @property
    def cell_config(self) -> WatermarkConfig:
        """The WorldCup configuration under which one cell is one payload bit."""
        return WatermarkConfig(groups=1, layers=1, context_width=self.context_width)


class StealthInkPRF:
    """StealthInk's keyed functions, under the subkey ``stealthink``."""

    __slots__ = ("_hasher",)

    def __init__(self, key: WatermarkKey) -> None:
        self._hasher = hashlib.blake2b(key=key.subkey(SUBKEY_LABEL), digest_size=16)

    def __repr__(self) -> str:
        return "StealthInkPRF(<keyed>)"

    def context_hash(self, packed_context: bytes) -> tuple[int, int]:
        """(permutation seed, position hash) of one context."""
        h = self._hasher.copy()
        h.update(_CONTEXT_DOMAIN + packed_context)
        digest = h.digest()
        return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")

    @staticmethod
    def token_words(seed: int | U64Array, token_ids: IntArray) -> U64Array:
        """``h(x)``: the permutation sorts by it, its top bit is the colour."""
        return splitmix64(seed, token_ids)


def stealthink_reweight(probs: FloatArray, words: U64Array, bit: int) -> FloatArray:
    """StealthInk's reweighting of a distribution over candidates.

    ``words`` are the candidates' keyed words ``h(x)`` (the order, and the colour
    in the top bit); the red list is the colour equal to ``bit``. Returns
    ``q(x) = p(x) [x not red] + |[L_x, U_x] ∩ J|`` with ``J`` the mirror of the red
    interval (see the module docstring).
    """
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    order = np.argsort(words, kind="stable")
    p_sorted = p[order]
    colour = (words[order] >> _TOP_BIT).astype(np.int64)
    upper = np.cumsum(p_sorted)
    lower = upper - p_sorted
    n0 = int(np.count_nonzero(colour == 0))  # colour 0 comes first in the order
    boundary = float(upper[n0 - 1]) if n0 else 0.0
    alpha, beta = (0.0, boundary) if bit == 0 else (boundary, 1.0)
    lo, hi = 1.0 - beta, 1.0 - alpha  # the mirror interval J
    overlap = np.clip(np.minimum(upper, hi) - np.maximum(lower, lo), 0.0, None)
    q_sorted = np.where(colour == bit, 0.0, p_sorted) + overlap
    q = np.empty_like(q_sorted)
    q[order] = q_sorted
    out: FloatArray = q / q.sum()
    return out


def extract_stealthink_evidence(
    prf: StealthInkPRF, config: StealthInkConfig, token_ids: Sequence[int]
) -> TokenEvidence:
    """Colour counts of a response (response tokens only, never the prompt).

    A token is scored only where its context occurs for the first time,
    mirroring :meth:`StealthInkSequence.reweight`.
    """
    ids = [int(t) for t in token_ids]
    seeds, positions, tokens = hashed_contexts(ids, config.context_width, prf.context_hash)
    n = len(positions)
    colour = (prf.token_words(seeds, tokens) >> _TOP_BIT).astype(np.int64)
    return TokenEvidence(
        position_u64=positions,
        ones=colour.reshape(n, 1),  # 1 <=> colour 1, the count favouring bit 0
        trials_per_token=1,
        num_tokens=len(ids),
        text_digest=_TIEBREAK_DOMAIN + text_digest(ids),
    )


class StealthInkSequence(ContextSequence):
    """Per-sequence StealthInk state: the payload's bits on top of the shared bookkeeping."""

    _config: StealthInkConfig

    def __init__(self, prf: StealthInkPRF, config: StealthInkConfig, payload: Payload) -> None:
        super().__init__(config)
        self._prf = prf
        self._bits = np.frombuffer(payload.bits.encode("ascii"), dtype=np.uint8) - ord("0")

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        """Remove the red interval's mass and double its mirror, over the candidates."""
        context = self.fresh_context()
        if context is None:
            return probs
        self.watermarked_steps += 1
        seed, position = self._prf.context_hash(pack_context(context))
        bit = int(self._bits[position % self._bits.shape[0]])
        words = self._prf.token_words(seed, np.asarray(candidates, dtype=np.int64))
        return stealthink_reweight(probs, words, bit)


class StealthInk(CountCellScheme):
    """The StealthInk baseline with one key and configuration.

    >>> stealthink = StealthInk(WatermarkKey(bytes(32)))
    >>> stealthink.detect([1, 2, 3], num_bits=8).num_scored_tokens
    3
    """

    name = "stealthink"
    version = STEALTHINK_VERSION

    def __init__(self, key: WatermarkKey, config: StealthInkConfig | None = None) -> None:
        self.key = key
        self.config = config or StealthInkConfig()
        self._cells = self.config.cell_config
        self._prf = PRF(key)  # the detector's tie-break stream only
        self._stealthink_prf = StealthInkPRF(key)

    def sequence(self, payload: Payload) -> StealthInkSequence:
        return StealthInkSequence(self._stealthink_prf, self.config, payload)

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        return extract_stealthink_evidence(self._stealthink_prf, self.config, token_ids)

    def _native_z(self, ev: TokenEvidence, num_bits: int) -> float:
        return mpac_z_score(ev, num_bits)


if TYPE_CHECKING:  # static proof that StealthInk fits the harness's protocols

    def _as_scheme(s: StealthInk) -> WatermarkScheme:
        return s

    def _as_sequence(s: StealthInkSequence) -> SequenceWatermark:
        return s
