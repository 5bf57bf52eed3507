"""The interface every watermark scheme offers, and WorldCup behind it.

The generation loop, the Hugging Face adapter, the CLI and the evaluation
harness only see these protocols, so WorldCup and the MPAC baseline run side
by side through identical code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.decoder import (
    DEFAULT_LIST_SIZE,
    DecodeResult,
    RegistryMatch,
    decode,
    decode_cells,
)
from worldcup_core.decoder import match_registry as _match_registry
from worldcup_core.detector import (
    DEFAULT_SIGNIFICANCE,
    DetectionResult,
    detect,
    slot_count,
    z_from_log_p,
)
from worldcup_core.encoder import IntArray, WorldCupEncoder
from worldcup_core.message import Payload
from worldcup_core.prf import (
    PRF,
    PRFV2,
    SCHEME_V2,
    ScoredItems,
    ScoredTokensV2,
    WatermarkKey,
    gvalue_words,
    v2_group_ones,
    v2_gwords,
    v2_positions,
    v2_tiebreak_seeds,
)
from worldcup_core.scoring import (
    GroupedCells,
    TokenEvidence,
    extract_evidence,
    extract_evidence_v2,
    grouped_log_pvalues,
    symbol_index,
    text_digest,
)
from worldcup_core.tournament import FloatArray


class SequenceWatermark(Protocol):
    """Per-sequence hooks, called once per generation step.

    ``process_logits`` sees the full-vocabulary logits before any filtering
    (KGW-style schemes bias them); ``reweight`` sees the final filtered
    distribution over the surviving candidates (WorldCup acts here);
    ``observe`` is told the token that was sampled. ``modifies_logits`` tells
    the loop whether ``process_logits`` is worth a full-vocabulary copy.
    """

    modifies_logits: bool

    def process_logits(self, logits: FloatArray) -> FloatArray: ...

    def reweight(self, candidates: IntArray, probs: FloatArray) -> FloatArray: ...

    def observe(self, token: int) -> None: ...


class WatermarkScheme(Protocol):
    name: str
    version: str

    def sequence(self, payload: Payload) -> SequenceWatermark: ...

    def detect(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DetectionResult: ...

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult: ...

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None: ...


class WorldCup:
    """WorldCup sampling with one key and configuration.

    >>> wc = WorldCup(WatermarkKey(bytes(32)))  # scheme worldcup-v2
    >>> wc.detect([1, 2, 3, 4]).num_scored_tokens  # the first c = 2 tokens carry nothing
    2
    """

    name = "worldcup"

    def __init__(self, key: WatermarkKey, config: WatermarkConfig | None = None) -> None:
        self.key = key
        self.config = config or WatermarkConfig()
        self.version = self.config.version
        self._prf: PRF | PRFV2 = PRFV2.of(key) if self.version == SCHEME_V2 else PRF(key)

    def __repr__(self) -> str:
        return f"WorldCup(key_id={self.key.key_id!r}, config={self.config!r})"

    @property
    def prf(self) -> PRF | PRFV2:
        """The keyed functions of this scheme's version (BLAKE2b v1, SipHash v2)."""
        return self._prf

    def sequence(self, payload: Payload) -> SequenceWatermark:
        return WorldCupEncoder(self.key, self.config, payload).start()

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        if isinstance(self._prf, PRFV2):
            return extract_evidence_v2(self._prf, self.config, token_ids)
        return extract_evidence(self._prf, self.config, token_ids)

    def scored_indices(self, token_ids: Sequence[int]) -> list[int]:
        """Which tokens of a response this scheme scores (the others carry no evidence)."""
        width = self.config.context_width
        if self.version == SCHEME_V2:
            out: list[int] = ScoredTokensV2.of(token_ids, width).indices.tolist()
            return out
        return list(ScoredItems.of(token_ids, width).indices)

    def detect(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DetectionResult:
        return self.detect_many([token_ids], num_bits, significance)[0]

    def decode(
        self,
        token_ids: Sequence[int],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> DecodeResult:
        return self.decode_many([token_ids], num_bits, list_size, significance)[0]

    def detect_many(
        self,
        texts: Sequence[Sequence[int]],
        num_bits: int | None = None,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> list[DetectionResult]:
        """:meth:`detect` for many texts; under v2 one vectorised pass serves them all."""
        if not isinstance(self._prf, PRFV2):
            return [
                detect(self._prf, self.config, self.evidence(t), num_bits, significance)
                for t in texts
            ]
        symbols = self._symbols(num_bits)
        cells, scored, tokens = self._v2_cells(self._prf, texts, symbols)
        return [
            self._detection(cells, i, scored[i], tokens[i], num_bits, significance)
            for i in range(len(texts))
        ]

    def decode_many(
        self,
        texts: Sequence[Sequence[int]],
        num_bits: int,
        list_size: int = DEFAULT_LIST_SIZE,
        significance: float = DEFAULT_SIGNIFICANCE,
    ) -> list[DecodeResult]:
        """:meth:`decode` for many texts; under v2 one vectorised pass serves them all."""
        if not isinstance(self._prf, PRFV2):
            out = []
            for t in texts:
                ev = self.evidence(t)
                detection = detect(self._prf, self.config, ev, num_bits, significance)
                out.append(decode(self.config, ev, num_bits, detection, list_size))
            return out
        symbols = self._symbols(num_bits)
        cells, scored, tokens = self._v2_cells(self._prf, texts, symbols)
        trials = np.repeat(cells.counts[:, :, None] * self._tau, self.config.groups, axis=2)
        detections = [
            self._detection(cells, i, scored[i], tokens[i], num_bits, significance)
            for i in range(len(texts))
        ]
        return decode_cells(cells.ones, trials, cells.counts, num_bits, detections, list_size)

    @property
    def _tau(self) -> int:
        m = self.config.layers
        return 2 * m if self.config.variant is Variant.RANDOM_SECOND else m

    def _symbols(self, num_bits: int | None) -> int:
        if num_bits is None:
            return slot_count(self.config)
        return self.config.symbols_for(num_bits)

    def _v2_cells(
        self, prf: PRFV2, texts: Sequence[Sequence[int]], symbols: int
    ) -> tuple[GroupedCells, list[int], list[int]]:
        cfg = self.config
        ids = [np.asarray(text, dtype=np.int64) for text in texts]
        items = [ScoredTokensV2.of(t, cfg.context_width) for t in ids]
        scored = [len(it) for it in items]
        segment = np.repeat(np.arange(len(ids)), scored)
        context = [
            np.concatenate([it.context[j] for it in items]) for j in range(cfg.context_width)
        ]
        tokens = np.concatenate([it.tokens for it in items])
        k, m, words = cfg.groups, cfg.layers, gvalue_words(cfg.groups, cfg.layers)
        positions = v2_positions(prf.position_key, context)
        ones = v2_group_ones(v2_gwords(prf.gvalue_key, context, tokens, words), k, m)
        if cfg.variant is Variant.RANDOM_SECOND:
            alt = v2_gwords(prf.alt_key, context, tokens, words)
            ones = ones + m - v2_group_ones(alt, k, m)
        seeds = v2_tiebreak_seeds(prf.tiebreak_key, [text_digest(t) for t in ids])
        cells = grouped_log_pvalues(
            segment,
            len(ids),
            symbol_index(positions, symbols, SCHEME_V2),
            ones.reshape(-1, k),
            self._tau,
            symbols,
            seeds,
        )
        return cells, scored, [len(t) for t in ids]

    @staticmethod
    def _detection(
        cells: GroupedCells,
        i: int,
        scored: int,
        tokens: int,
        num_bits: int | None,
        significance: float,
    ) -> DetectionResult:
        if not 0.0 < significance < 1.0:
            raise ValueError(f"significance must be in (0, 1), got {significance}")
        log_p = float(cells.log_p[i]) if scored else 0.0
        p_value = math.exp(log_p)
        return DetectionResult(
            p_value=p_value,
            log10_p_value=log_p / math.log(10.0),
            z_score=z_from_log_p(log_p, scored),
            paper_z_score=float(cells.paper_z[i]) if scored else 0.0,
            is_watermarked=p_value < significance,
            significance=significance,
            num_tokens=tokens,
            num_scored_tokens=scored,
            num_symbols=cells.counts.shape[1] if num_bits is not None else None,
        )

    def match(self, token_ids: Sequence[int], candidates: list[str]) -> RegistryMatch | None:
        return _match_registry(self.config, self.evidence(token_ids), candidates)
