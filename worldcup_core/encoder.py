"""WorldCup encoding (Sections 3.1-3.3 and Appendix E).

For each generation step the encoder receives the *final* sampling
distribution (after temperature, top-k and top-p) over its candidate tokens
and returns the watermarked distribution over the same candidates.

Decisions where the paper is vague:

* **Which entropy.** ``H`` in ``lambda = alpha * tanh(H)`` is the Shannon
  entropy (nats) of the filtered, renormalised distribution the tournament
  runs over, not of the raw full-vocabulary softmax. It is the distribution
  actually being watermarked, and it makes lambda independent of how much
  mass the discarded tail held.
* **Combination.** ``S = sum_j q_int(j) - lambda * sum_j q_other(j)``, clipped at
  zero and normalised (the paper's log + softmax is the same normalisation).
  If clipping leaves nothing (e.g. a single candidate with lambda > 1) we
  sample ``sum_j q_int(j) / k``, still a watermarked distribution.
* **Repeated contexts.** If the c-token context already occurred earlier in
  this response, the unmodified distribution is sampled (SynthID's rule) and
  the decoder skips that token, so a repeated seed never counts twice.
  Under ``worldcup-v2`` the first c tokens, whose context is sentinel padding and
  so identical in every text under a key, are sampled unmodified and never
  scored either.
* **Random second family (ablation).** Group j uses two independent families
  A (``g``) and B (``g'``, subkey ``gvalue-alt``); bit 0 favours A, bit 1
  favours B. The decoder then compares A's mean with B's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.message import Payload
from worldcup_core.prf import (
    PRF,
    PRFV2,
    SCHEME_V2,
    Context,
    WatermarkKey,
    context_at,
    gvalue_words,
    pack_context,
    v2_group_bits,
    v2_gwords,
    v2_positions,
)
from worldcup_core.scoring import symbol_index
from worldcup_core.tournament import FloatArray, tournament_distribution

IntArray = npt.NDArray[np.int64]


def entropy(probs: FloatArray) -> float:
    p = probs[probs > 0]
    return float(-(p * np.log(p)).sum())


def lambda_for(config: WatermarkConfig, probs: FloatArray) -> float:
    """The subtraction weight of each variant."""
    if config.variant in (Variant.NO_SUBTRACTION, Variant.NONDISTORTIONARY):
        return 0.0
    if config.variant is Variant.NO_ENTROPY:
        return 1.0
    return config.alpha * float(np.tanh(entropy(probs)))


def families(
    g: npt.NDArray[np.uint8], g_alt: npt.NDArray[np.uint8] | None, bits: npt.NDArray[np.uint8]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(intended, other) families of shape (k, m, n) for the symbol's bits (k,).

    Complementary variants: bit 0 plays g against 1 - g, bit 1 the reverse. The
    random-second ablation (``g_alt`` given) plays g against an independent g'.
    """
    flip = bits[:, None, None]
    if g_alt is not None:
        intended = np.where(flip == 0, g, g_alt).astype(np.uint8)
        return intended, np.where(flip == 0, g_alt, g).astype(np.uint8)
    intended = (g ^ flip).astype(np.uint8)
    return intended, intended ^ np.uint8(1)


def combine_families(
    probs: FloatArray,
    intended: npt.NDArray[np.uint8],
    other: npt.NDArray[np.uint8],
    lam: float,
) -> FloatArray:
    """``sum_j q_int(j) - lam * sum_j q_other(j)``, clipped and normalised.

    ``intended`` and ``other`` are g-values of shape (k, m, n): the family each
    group's bit selects, and the family it plays against.
    """
    k = intended.shape[0]
    if lam:
        q = tournament_distribution(probs, np.concatenate([intended, other]))
        q_int, q_other = q[:k].sum(axis=0), q[k:].sum(axis=0)
    else:
        q_int, q_other = tournament_distribution(probs, intended).sum(axis=0), 0.0
    scores = np.clip(q_int - lam * q_other, 0.0, None)
    total = scores.sum()
    if not total > 0.0:
        fallback: FloatArray = q_int / q_int.sum()
        return fallback
    out: FloatArray = scores / total
    return out


@dataclass(frozen=True)
class WorldCupEncoder:
    """Key, configuration and payload of one watermarked sequence.

    >>> enc = WorldCupEncoder(WatermarkKey(bytes(32)), WatermarkConfig(), Payload("0110"))
    >>> seq = enc.start()
    >>> out = seq.reweight(np.array([5, 9]), np.array([0.5, 0.5]))
    >>> bool(abs(out.sum() - 1) < 1e-12)
    True
    """

    key: WatermarkKey
    config: WatermarkConfig
    payload: Payload
    prf: PRF = field(init=False, repr=False, compare=False)
    symbol_bits: npt.NDArray[np.uint8] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prf", PRF(self.key))
        object.__setattr__(self, "symbol_bits", self.payload.bit_array(self.config.groups))

    def start(self) -> WorldCupSequence:
        if self.config.version == SCHEME_V2:
            return WorldCupSequenceV2(self)
        return WorldCupSequence(self)


class WorldCupSequence:
    """Per-sequence encoder state: the response so far and the contexts seen."""

    modifies_logits = False

    def __init__(self, encoder: WorldCupEncoder) -> None:
        self._enc = encoder
        self.generated: list[int] = []
        self._seen: set[Context] = set()
        self.watermarked_steps = 0

    def _context(self) -> Context:
        return context_at(self.generated, len(self.generated), self._enc.config.context_width)

    def process_logits(self, logits: FloatArray) -> FloatArray:
        """WorldCup does not touch logits; it reweights the final distribution."""
        return logits

    def subtraction_weight(self, probs: FloatArray) -> float:
        """lambda of this step (:func:`lambda_for`); a design experiment overrides it."""
        return lambda_for(self._enc.config, probs)

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        """Watermarked distribution over ``candidates`` (probs sum to 1)."""
        context = self._context()
        if context in self._seen:
            return probs
        cfg, prf = self._enc.config, self._enc.prf
        seed = prf.context_seed(pack_context(context))
        num_symbols = self._enc.symbol_bits.shape[0]
        bits = self._enc.symbol_bits[prf.position_u64(seed) % num_symbols]  # (k,)
        tokens = candidates.tolist()
        g = prf.g_bits(seed, tokens, cfg.groups, cfg.layers).transpose(1, 2, 0)  # (k, m, n)
        g_alt = None
        if cfg.variant is Variant.RANDOM_SECOND:
            g_alt = prf.g_bits(seed, tokens, cfg.groups, cfg.layers, alternate=True)
            g_alt = g_alt.transpose(1, 2, 0)
        intended, other = families(g, g_alt, bits)
        self.watermarked_steps += 1
        return combine_families(probs, intended, other, self.subtraction_weight(probs))

    def observe(self, token: int) -> None:
        self._seen.add(self._context())
        self.generated.append(int(token))


class WorldCupSequenceV2(WorldCupSequence):
    """The per-row reference of scheme ``worldcup-v2`` (numpy, one row at a time).

    The batched step (:mod:`worldcup_core.batched`) must equal it; it stays the
    readable definition of what a v2 step does.
    """

    def __init__(self, encoder: WorldCupEncoder) -> None:
        super().__init__(encoder)
        self._v2 = PRFV2.of(encoder.key)

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray:
        cfg = self._enc.config
        if len(self.generated) < cfg.context_width:
            return probs  # the padded context is the same in every text: never watermarked
        context = self._context()
        if context in self._seen:
            return probs
        lanes = [np.full(len(candidates), x, dtype=np.uint64) for x in context]
        position = v2_positions(self._v2.position_key, [c[:1] for c in lanes])
        num_symbols = self._enc.symbol_bits.shape[0]
        bits = self._enc.symbol_bits[int(symbol_index(position, num_symbols, SCHEME_V2)[0])]
        tokens = np.asarray(candidates, dtype=np.uint64)
        words = gvalue_words(cfg.groups, cfg.layers)
        g = v2_group_bits(v2_gwords(self._v2.gvalue_key, lanes, tokens, words), *_km(cfg))
        g_alt = None
        if cfg.variant is Variant.RANDOM_SECOND:
            alt = v2_gwords(self._v2.alt_key, lanes, tokens, words)
            g_alt = v2_group_bits(alt, *_km(cfg)).transpose(1, 2, 0)
        intended, other = families(g.transpose(1, 2, 0), g_alt, bits)
        self.watermarked_steps += 1
        return combine_families(probs, intended, other, self.subtraction_weight(probs))

    def observe(self, token: int) -> None:
        if len(self.generated) >= self._enc.config.context_width:
            self._seen.add(self._context())
        self.generated.append(int(token))


def _km(config: WatermarkConfig) -> tuple[int, int]:
    return config.groups, config.layers
