"""worldcup-v2's detection and decoding: many texts scored in one vectorised pass.

Under v2 a position is an interval of the multiply-shift position hash and the
keyed functions are SipHash over numpy arrays (:class:`~worldcup_core.prf.PRFV2`),
so the scored tokens of every text are hashed together and binned into
(text, position, group) cells by one :func:`~worldcup_core.scoring.grouped_log_pvalues`.
The statistic is :mod:`worldcup_core.detector`'s (randomised two-sided binomial
cells, Fisher's combination); with the payload length unknown it tests the
``S`` slots (see there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.decoder import DecodeResult, decode_cells
from worldcup_core.detector import DetectionResult, slot_count, z_from_log_p
from worldcup_core.prf import (
    PRFV2,
    SCHEME_V2,
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
    extract_evidence_v2,
    grouped_log_pvalues,
    symbol_index,
    text_digest,
)


class DetectorV2:
    """Detection and decoding under ``worldcup-v2`` for one key and configuration."""

    def __init__(self, key: WatermarkKey, config: WatermarkConfig) -> None:
        self.config = config
        self.prf = PRFV2.of(key)

    def evidence(self, token_ids: Sequence[int]) -> TokenEvidence:
        return extract_evidence_v2(self.prf, self.config, token_ids)

    def scored_indices(self, token_ids: Sequence[int]) -> list[int]:
        out: list[int] = ScoredTokensV2.of(token_ids, self.config.context_width).indices.tolist()
        return out

    def detect_many(
        self, texts: Sequence[Sequence[int]], num_bits: int | None, significance: float
    ) -> list[DetectionResult]:
        cells, scored, tokens = self._cells(texts, self._symbols(num_bits))
        return [
            self._detection(cells, i, scored[i], tokens[i], num_bits, significance)
            for i in range(len(texts))
        ]

    def decode_many(
        self, texts: Sequence[Sequence[int]], num_bits: int, list_size: int, significance: float
    ) -> list[DecodeResult]:
        cells, scored, tokens = self._cells(texts, self._symbols(num_bits))
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

    def _cells(
        self, texts: Sequence[Sequence[int]], symbols: int
    ) -> tuple[GroupedCells, list[int], list[int]]:
        cfg, prf = self.config, self.prf
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
