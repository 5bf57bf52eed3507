"""StealthInk, the stealthy multi-bit baseline (Jiang et al., ICML 2025), behind our protocols.

StealthInk ("StealthInk: A Multi-bit and Stealthy Watermark for Large Language
Models") hides a payload without changing the distribution of text averaged
over keys. At each step the context seeds a keyed permutation of the
vocabulary, cut into ``2^H`` colour lists (``H = 1``: two halves, one payload
bit per position), and picks a message position ``p``. The colour list named
by the message value at ``p`` is the *red* list. Lay the next-token
probabilities out on [0, 1] in permuted order: the red tokens fill one
interval ``I = [alpha, beta]``. The reweighting removes the mass of ``I`` and
doubles the mass of its mirror image ``J = [1 - beta, 1 - alpha]`` (where the
two overlap, the overlap keeps its mass): the new density on [0, 1] is
``1 - 1_I + 1_J``, so token ``x`` with interval ``[L_x, U_x]`` gets
``q(x) = p(x) [x not red] + |[L_x, U_x] ∩ J|``. This is the piecewise
cumulative map of the paper's Fig. 2 (``reweight`` in the authors' code),
written as one formula. Under the key pairing that reverses the permutation
(and so swaps the two colour lists) the densities sum to 2 everywhere, so
``E_key[q] = p``: the scheme is distortion-free. The decoder counts, per
position, the tokens of each colour and takes the *least* frequent colour as
the message value.

Settings (Appendix B of the WorldCup paper): "simple_3" seeding, ``H = 1``,
window 2, hash key 15485863. The appendix is ambiguous on two points, read
here as follows. ``H = 1`` is the chunk capacity of one bit (two colour
lists, one payload bit per position), the reference's own default
(``capacity = 1``). "simple_3" in the reference is an additive PRF over the
last *three* tokens, while the appendix says window 2: we use window 2, the
window every scheme in the comparison shares, with our keyed PRF (below).

Departures from the reference implementation
(``every_step_1_24_direct_detect.py`` and ``hash_scheme.py`` of the authors'
code), each so that StealthInk draws from the project's audited key
derivation or so that its p-value is exact:

* **Seeding.** The reference's "simple_3" is an *additive* PRF,
  ``15485863 * sum(last 3 tokens)`` fed to ``torch.Generator``: unkeyed, and
  symmetric in the order of the context. Here the seed is keyed BLAKE2b under
  StealthInk's own subkey (``WatermarkKey.subkey("stealthink")``) of the
  packed context, over the ``context_width = 2`` last *generated* tokens with
  WorldCup's sentinel padding, as in the WorldCup paper's setting (window 2)
  and as MPAC does; prompts never enter. No other scheme hashes under this
  subkey.
* **Position and permutation.** ``BLAKE2b(0x00 || context)`` gives two 64-bit
  words: the position hash (``mod b`` the message position) and the
  permutation seed. Token ``x`` gets the keyed word ``h(x) = SplitMix64(seed,
  x)``; the permutation sorts by ``h`` and the colour of ``x`` is the top bit
  of ``h`` (colour 0 first), instead of ``torch.randperm`` cut by
  ``torch.chunk`` into two equal halves. Each token's colour is then an
  independent fair bit (lists hold ``|V|/2 +- O(sqrt|V|)`` tokens), which
  makes the detector's colour counts exactly binomial under H0; and the
  pairing ``h -> NOT h`` reverses the order and swaps the colours for every
  vocabulary size, which is what unbiasedness needs (``torch.chunk`` of an odd
  vocabulary does not swap exactly).
* **Where it acts.** On the final filtered distribution (after temperature,
  top-k and top-p: :meth:`StealthInkSequence.reweight`), not on the
  full-vocabulary softmax before the other warpers; unbiasedness then holds
  for the distribution actually sampled. Computing it over the candidates
  only is exact: the other tokens have zero width on the permuted cdf.
* **Repeated contexts** are neither reweighted nor scored. The reference skips
  them at generation but counts them again at detection, where a repeated
  seed counts twice and the null distribution is no longer binomial.

Detection. The reference sums, over positions, the count ``t`` of the least
frequent colour and reports ``Phi((t - T/2) / sqrt(T/4))``. The least
frequent colour is chosen after looking at the counts, so under H0 this
statistic is biased (it is the negative of MPAC's native z at ``gamma = 1/2``,
``E[z] ~ sqrt(2b/pi)``): it is reported only as
``DetectionResult.paper_z_score`` (sign turned so that larger means more
watermarked). The calibrated ``p_value`` is WorldCup's detector on the colour
counts: a randomised two-sided exact binomial test per position,
Fisher-combined, with a Šidák scan over ``b = 1..64`` when ``b`` is unknown.

Reuse. A scored token is :class:`~worldcup_core.scoring.TokenEvidence` with one
group and one trial, ``ones = 1`` iff its colour is 1 (the count favouring bit
0: bit 0 makes colour 0 red). With ``WatermarkConfig(groups=1, layers=1)`` one
cell is one payload bit, so ``detect``, ``decode`` and ``match_registry`` apply
unchanged.
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
