"""BiMark, the unbiased multilayer baseline (Feng et al., ICML 2025), behind WorldCup's protocols.

How it is built, and where it departs from the reference and why:
``docs/baselines.md`` (section BiMark).
"""

from __future__ import annotations

import hashlib
import math
import struct
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
BoolArray = npt.NDArray[np.bool_]
U64Array = npt.NDArray[np.uint64]

BIMARK_VERSION: Final = "bimark-v1"
SETTINGS: Final = (
    "BiMark: bit-flip unbiased multilayer reweighting over the last c=2 generated tokens, "
    "d=10 layers, base scaling delta~=1.0, gamma=0.5; calibrated p-value from exact binomial "
    "layer votes, native z (not calibrated) reported beside it"
)
SUBKEY_LABEL: Final = "bimark"
# Prefix of the text digest that seeds the detector's tie-break uniforms, so BiMark's
# randomisation of a text is independent of WorldCup's and MPAC's.
_TIEBREAK_DOMAIN: Final = b"bimark"
_CONTEXT_DOMAIN: Final = b"\x00"
_PARTITION_DOMAIN: Final = b"\x01"
_TOP_BIT: Final = np.uint64(63)


@dataclass(frozen=True)
class BiMarkConfig:
    """What BiMark's generator and detector share (besides the key).

    >>> BiMarkConfig().layers, BiMarkConfig().base_delta
    (10, 1.0)
    """

    layers: int = 10  # d
    base_delta: float = 1.0  # delta~
    gamma: float = 0.5
    context_width: int = 2

    def __post_init__(self) -> None:
        if self.gamma != 0.5:
            raise ValueError(
                f"only gamma = 0.5 is supported (BiMark's half/half partitions, as in the "
                f"paper's Appendix B), got {self.gamma}"
            )
        if not 1 <= self.layers <= 64:
            raise ValueError(f"layers (d) must be in 1..64, got {self.layers}")
        if not (math.isfinite(self.base_delta) and 0.0 <= self.base_delta <= 1.0):
            # above 1 the down-scaled side 1 - delta would go negative
            raise ValueError(f"base_delta must be in [0, 1], got {self.base_delta}")
        if not 1 <= self.context_width <= 8:
            raise ValueError(f"context_width must be in 1..8, got {self.context_width}")

    @property
    def cell_config(self) -> WatermarkConfig:
        """The WorldCup configuration under which one cell is one payload bit."""
        return WatermarkConfig(groups=1, layers=self.layers, context_width=self.context_width)


class BiMarkPRF:
    """BiMark's keyed functions, all under the subkey ``bimark``."""

    __slots__ = ("_hasher", "partition_seeds")

    def __init__(self, key: WatermarkKey, layers: int) -> None:
        self._hasher = hashlib.blake2b(key=key.subkey(SUBKEY_LABEL), digest_size=16)
        seeds = []
        for layer in range(layers):
            h = self._hasher.copy()
            h.update(_PARTITION_DOMAIN + struct.pack("<I", layer))
            seeds.append(int.from_bytes(h.digest()[:8], "little"))
        self.partition_seeds: U64Array = np.array(seeds, dtype=np.uint64)

    def __repr__(self) -> str:
        return "BiMarkPRF(<keyed>)"

    def context_hash(self, packed_context: bytes) -> tuple[int, int]:
        """(flip seed, position hash) of one context."""
        h = self._hasher.copy()
        h.update(_CONTEXT_DOMAIN + packed_context)
        digest = h.digest()
        return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")

    def flips(self, flip_seeds: U64Array) -> npt.NDArray[np.uint8]:
        """The bit flips ``c_l``, shape (n, d), for n flip seeds."""
        layers = np.arange(self.partition_seeds.shape[0], dtype=np.int64)
        bits = splitmix64(flip_seeds[:, None], layers[None, :]) >> _TOP_BIT
        return bits.astype(np.uint8)

    def in_v0(self, token_ids: IntArray) -> BoolArray:
        """Partition membership ``x in V0_l``, shape (d, n)."""
        raw = splitmix64(self.partition_seeds[:, None], token_ids[None, :]) >> _TOP_BIT
        out: BoolArray = raw.astype(bool)
        return out


def bimark_reweight(
    probs: FloatArray, in_v0: BoolArray, scale_v0_up: npt.NDArray[np.bool_], base_delta: float
) -> FloatArray:
    """Apply the ``d`` bit-flip layers in order to a distribution over candidates.

    ``in_v0`` is (d, n); ``scale_v0_up[l]`` is ``e_l = c_l XOR b``. A layer whose
    partition leaves one side empty (``P0`` or ``P1`` = 0) does nothing. Each layer
    keeps the total mass; the final division only removes rounding.
    """
    q = np.array(probs, dtype=np.float64)
    for layer in range(in_v0.shape[0]):
        mask = in_v0[layer]
        p0 = float(q[mask].sum())
        p1 = float(q[~mask].sum())
        if p0 <= 0.0 or p1 <= 0.0:
            continue
        delta = min(base_delta, p1 / p0)
        beta = delta * p0 / p1
        if scale_v0_up[layer]:
            q = np.where(mask, q * (1.0 + delta), q * (1.0 - beta))
        else:
            q = np.where(mask, q * (1.0 - delta), q * (1.0 + beta))
    q = np.maximum(q, 0.0)
    out: FloatArray = q / q.sum()
    return out


def extract_bimark_evidence(
    prf: BiMarkPRF, config: BiMarkConfig, token_ids: Sequence[int]
) -> TokenEvidence:
    """Layer votes of a response (response tokens only, never the prompt).

    A token is scored only where its context occurs for the first time,
    mirroring :meth:`BiMarkSequence.reweight`.
    """
    ids = [int(t) for t in token_ids]
    seeds, positions, tokens = hashed_contexts(ids, config.context_width, prf.context_hash)
    n = len(positions)
    flips = prf.flips(seeds)  # (n, d)
    in_v0 = prf.in_v0(tokens).T  # (n, d)
    votes_for_one = in_v0.astype(np.int64) ^ flips.astype(np.int64)
    ones = (config.layers - votes_for_one.sum(axis=1)).reshape(n, 1)  # votes for bit 0
    return TokenEvidence(
        position_u64=positions,
        ones=ones.astype(np.int64),
        trials_per_token=config.layers,
        num_tokens=len(ids),
        text_digest=_TIEBREAK_DOMAIN + text_digest(ids),
    )


class BiMarkSequence(ContextSequence):
    """Per-sequence BiMark state: the payload's bits on top of the shared bookkeeping."""

    _config: BiMarkConfig

    def __init__(self, prf: BiMarkPRF, config: BiMarkConfig, payload: Payload) -> None:
        super().__init__(config)
        self._prf = prf
        self._bits = np.frombuffer(payload.bits.encode("ascii"), dtype=np.uint8) - ord("0")

    def layer_directions(self) -> npt.NDArray[np.bool_] | None:
        """``e_l = c_l XOR b`` for this step (True: scale V0 up), or None on a repeat."""
        context = self.fresh_context()
        if context is None:
            return None
        seed, position = self._prf.context_hash(pack_context(context))
        bit = self._bits[position % self._bits.shape[0]]
        flips = self._prf.flips(np.array([seed], dtype=np.uint64))[0]
        out: npt.NDArray[np.bool_] = (flips ^ bit).astype(bool)
        return out

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        """The ``d`` bit-flip layers on the surviving candidates."""
        directions = self.layer_directions()
        if directions is None:
            return probs
        self.watermarked_steps += 1
        in_v0 = self._prf.in_v0(np.asarray(candidates, dtype=np.int64))
        return bimark_reweight(probs, in_v0, directions, self._config.base_delta)


class BiMark(CountCellScheme):
    """The BiMark baseline with one key and configuration.

    >>> bimark = BiMark(WatermarkKey(bytes(32)))
    >>> bimark.detect([1, 2, 3], num_bits=8).num_scored_tokens
    3
    """

    name = "bimark"
    version = BIMARK_VERSION

    def __init__(self, key: WatermarkKey, config: BiMarkConfig | None = None) -> None:
        self.key = key
        self.config = config or BiMarkConfig()
        self._cells = self.config.cell_config
        self._prf = PRF(key)  # the detector's tie-break stream only
        self._bimark_prf = BiMarkPRF(key, self.config.layers)

    def sequence(self, payload: Payload) -> BiMarkSequence:
        return BiMarkSequence(self._bimark_prf, self.config, payload)

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        return extract_bimark_evidence(self._bimark_prf, self.config, token_ids)

    def _native_z(self, ev: TokenEvidence, num_bits: int) -> float:
        return mpac_z_score(ev, num_bits)


if TYPE_CHECKING:  # static proof that BiMark fits the harness's protocols

    def _as_scheme(b: BiMark) -> WatermarkScheme:
        return b

    def _as_sequence(s: BiMarkSequence) -> SequenceWatermark:
        return s
