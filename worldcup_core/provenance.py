"""Provenance: which of many keys, if any, watermarked a text?

A trust-and-safety search tries every tenant's every key version. Three
things make that cheap and sound:

* **Shared work is done once per text.** Which tokens are scored (first
  occurrences of each context) and their packed bytes do not depend on the
  key (:class:`~worldcup_core.prf.ScoredItems`); per key only the keyed
  hashes remain, on pre-keyed BLAKE2b states built once per bank.
* **Scoring is vectorised over keys.** Keys with one configuration share the
  scored tokens, so their evidence stacks into (K, n) arrays and the grouping
  statistics of all K keys come out of one numpy pass
  (:func:`~worldcup_core.detector.stacked_grouping_log_pvalues`, the same code
  single-key detection runs, so the two cannot disagree).
* **Big banks are screened.** Hashing dominates (three keyed BLAKE2b calls
  per key and scored token), so above a few hundred keys a pass over every
  4th scored token ranks the keys and only the best 2 % (at least 32) are
  scanned in full; see :meth:`KeyBank.search` for why the p-value stays valid.
* **The answer is corrected for the search.** Under the global null (the text
  was written with none of the keys) the keys' p-values are independent, as
  each key drives its own PRF, so the smallest of K is Šidák-corrected:
  ``1 - (1 - p_min)^K``, exact under independence and never above
  Bonferroni's ``K * p_min``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from worldcup_core.config import MAX_PAYLOAD_BITS, Variant, WatermarkConfig
from worldcup_core.detector import slot_count, stacked_grouping_log_pvalues, tiebreak_data
from worldcup_core.prf import (
    PRF,
    PRFV2,
    SCHEME_V2,
    ScoredItems,
    ScoredTokensV2,
    gvalue_words,
    unpack_g,
    v2_group_ones,
    v2_gwords,
    v2_positions,
    v2_tiebreak_seeds,
)
from worldcup_core.scheme import WorldCup
from worldcup_core.scoring import grouped_log_pvalues, sidak_log_p, symbol_index, text_digest

_LN10 = math.log(10.0)


@dataclass(frozen=True)
class KeyScore:
    index: int  # into the bank's schemes
    log10_p_value: float  # this key alone, Bonferroni over the groupings tried
    num_symbols: int  # the grouping that scored best


@dataclass(frozen=True)
class ProvenanceResult:
    best: KeyScore | None  # None when no token could be scored
    p_value: float  # the best key's p-value, Šidák-corrected for num_keys
    log10_p_value: float
    num_keys: int
    num_tokens: int
    num_scored_tokens: int
    top: tuple[KeyScore, ...]  # most significant first
    num_full_scans: int = 0  # keys scanned on every scored token
    screened: bool = False  # a screening pass chose which keys got the full scan


@dataclass(frozen=True)
class ScreenConfig:
    """When and how hard a big bank is screened before the exact scan."""

    min_keys: int = 256  # smaller banks are scanned exactly, key by key
    stride: int = 4  # the screen hashes every 4th scored token
    keep: int = 32  # at least this many keys get the full scan ...
    keep_fraction: float = 0.02  # ... or this share of the bank, if larger
    min_tokens: int = 16  # too short a subsample ranks poorly: scan everything


def _config_key(config: WatermarkConfig) -> tuple[int, int, int, Variant, str]:
    return (config.context_width, config.groups, config.layers, config.variant, config.version)


_V2_LANES = 1 << 16  # keys x scored tokens hashed per pass: bounded memory at any bank size


class KeyBank:
    """Many keys, prepared once, searched together.

    >>> from worldcup_core.prf import WatermarkKey
    >>> bank = KeyBank([WorldCup(WatermarkKey(bytes([i]) * 32)) for i in range(3)])
    >>> bank.search([5, 6, 7, 8]).num_keys
    3
    """

    def __init__(self, schemes: Sequence[WorldCup], chunk_size: int = 64) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be positive")
        self.schemes = tuple(schemes)
        self.chunk_size = chunk_size
        groups: dict[tuple[int, int, int, Variant, str], list[int]] = {}
        for i, scheme in enumerate(self.schemes):
            groups.setdefault(_config_key(scheme.config), []).append(i)
        self._groups = [(self.schemes[idx[0]].config, idx) for idx in groups.values()]

    def __len__(self) -> int:
        return len(self.schemes)

    def __repr__(self) -> str:
        return f"KeyBank({len(self.schemes)} keys)"

    def log10_p_values(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        keys: Sequence[int] | None = None,
        stride: int = 1,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], int]:
        """Per key: log10 p (as :meth:`WorldCup.detect` would give), best grouping, and
        the number of scored tokens of the first configuration.

        ``keys`` restricts the scan (the others get log10 p = 0); ``stride`` > 1
        scores only every ``stride``-th scored token (the cheap screening pass).
        """
        ids = [int(t) for t in token_ids]
        digest = text_digest(ids)
        out = np.zeros(len(self.schemes), dtype=np.float64)
        best_symbols = np.zeros(len(self.schemes), dtype=np.int64)
        wanted = None if keys is None else set(keys)
        scored = 0
        items_v1: dict[int, ScoredItems] = {}
        items_v2: dict[int, ScoredTokensV2] = {}
        for config, group in self._groups:
            indices = group if wanted is None else [i for i in group if i in wanted]
            width = config.context_width
            if config.version == SCHEME_V2:
                v2 = items_v2.get(width)
                if v2 is None:
                    v2 = ScoredTokensV2.of(ids, width)
                    if stride > 1:
                        v2 = v2.take(np.arange(0, len(v2), stride))
                    items_v2[width] = v2
                scored = scored or len(v2)
                if len(v2) and indices:
                    grouping = (
                        slot_count(config) if num_bits is None else config.symbols_for(num_bits)
                    )
                    step = max(1, _V2_LANES // len(v2))
                    for start in range(0, len(indices), step):
                        chunk = indices[start : start + step]
                        out[chunk] = self._score_v2(config, chunk, v2, digest, grouping) / _LN10
                        best_symbols[chunk] = grouping
                continue
            items = items_v1.get(width)
            if items is None:
                items = ScoredItems.of(ids, width)
                if stride > 1:
                    items = ScoredItems(
                        items.indices[::stride], items.contexts[::stride], items.tokens[::stride]
                    )
                items_v1[width] = items
            scored = scored or len(items)
            if len(items) == 0 or not indices:
                continue
            if num_bits is None:
                counts = list(range(1, config.symbols_for(MAX_PAYLOAD_BITS) + 1))
            else:
                counts = [config.symbols_for(num_bits)]
            for start in range(0, len(indices), self.chunk_size):
                chunk = indices[start : start + self.chunk_size]
                log_p, symbols = self._score_chunk(config, chunk, items, digest, counts)
                out[chunk] = log_p / _LN10
                best_symbols[chunk] = symbols
        return out, best_symbols, scored

    def _score_v2(
        self,
        config: WatermarkConfig,
        chunk: list[int],
        items: ScoredTokensV2,
        digest: bytes,
        num_symbols: int,
    ) -> npt.NDArray[np.float64]:
        """log p of every key of ``chunk`` at once: keys x tokens lanes, one SipHash pass each
        for positions and g-words, then the grouped statistic with keys as segments."""
        n, k, m = len(items), config.groups, config.layers
        prfs = [self.schemes[i].prf for i in chunk]
        assert all(isinstance(p, PRFV2) for p in prfs)
        v2 = [p for p in prfs if isinstance(p, PRFV2)]

        def lanes(subkeys: list[tuple[int, int]]) -> tuple[Any, Any]:
            arr = np.array(subkeys, dtype=np.uint64)
            return np.repeat(arr[:, 0], n), np.repeat(arr[:, 1], n)

        context = [np.tile(col, len(chunk)) for col in items.context]
        tokens = np.tile(items.tokens, len(chunk))
        positions = v2_positions(lanes([p.position_key for p in v2]), context)
        words = gvalue_words(k, m)
        ones = v2_group_ones(
            v2_gwords(lanes([p.gvalue_key for p in v2]), context, tokens, words), k, m
        )
        tau = m
        if config.variant is Variant.RANDOM_SECOND:
            alt = v2_gwords(lanes([p.alt_key for p in v2]), context, tokens, words)
            ones = ones + m - v2_group_ones(alt, k, m)
            tau = 2 * m
        tie = np.array([p.tiebreak_key for p in v2], dtype=np.uint64)
        seeds = v2_tiebreak_seeds((tie[:, 0], tie[:, 1]), [digest] * len(chunk))
        cells = grouped_log_pvalues(
            np.repeat(np.arange(len(chunk)), n),
            len(chunk),
            symbol_index(positions, num_symbols, SCHEME_V2),
            ones,
            tau,
            num_symbols,
            seeds,
        )
        return cells.log_p

    def _score_chunk(
        self,
        config: WatermarkConfig,
        chunk: list[int],
        items: ScoredItems,
        digest: bytes,
        counts: list[int],
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        n, k, m = len(items), config.groups, config.layers
        alternate = config.variant is Variant.RANDOM_SECOND
        positions = np.empty((len(chunk), n), dtype=np.uint64)
        g_raw: list[bytes] = []
        alt_raw: list[bytes] = []
        seeds = np.empty((len(chunk), len(counts)), dtype=np.uint64)
        for row, i in enumerate(chunk):
            prf = self.schemes[i].prf
            assert isinstance(prf, PRF)  # v1: keyed BLAKE2b, one call per item
            pos, g, alt = prf.hash_items(items, alternate=alternate)
            positions[row] = np.frombuffer(pos, dtype="<u8")
            g_raw.append(g)
            alt_raw.append(alt)
            seeds[row] = [prf.tiebreak_seed(tiebreak_data(digest, b)) for b in counts]
        ones = unpack_g(b"".join(g_raw), len(chunk) * n, k, m).sum(axis=2, dtype=np.int64)
        trials = m
        if alternate:
            alt = unpack_g(b"".join(alt_raw), len(chunk) * n, k, m).sum(axis=2, dtype=np.int64)
            ones = ones + m - alt
            trials = 2 * m
        log_p, _ = stacked_grouping_log_pvalues(
            seeds, positions, ones.reshape(len(chunk), n, k), trials, counts
        )
        best = np.argmin(log_p, axis=1)
        best_log_p = log_p[np.arange(len(chunk)), best]
        corrected = np.array([sidak_log_p(float(x), len(counts)) for x in best_log_p])
        return corrected, np.array(counts, dtype=np.int64)[best]

    def search(
        self,
        token_ids: Sequence[int],
        num_bits: int | None = None,
        top: int = 5,
        screen: ScreenConfig | None = None,
    ) -> ProvenanceResult:
        """The most significant key, its search-corrected p-value, and the runners-up.

        With a large bank, a cheap screening pass (every ``stride``-th scored token)
        ranks all keys and only the best ``keep`` get the exact full scan. The
        correction still counts every key in the bank, and the minimum over the
        survivors is never below the minimum over all keys, so the p-value stays
        valid (conservative); screening can only cost power, when the true key
        ranks below ``keep`` on the subsample.
        """
        screen = screen if screen is not None else ScreenConfig()
        ids = [int(t) for t in token_ids]
        keys: list[int] | None = None
        screened = False
        if len(self.schemes) > screen.min_keys and screen.stride > 1:
            rough, _, rough_scored = self.log10_p_values(ids, num_bits, stride=screen.stride)
            if rough_scored >= screen.min_tokens:
                keep = max(screen.keep, math.ceil(screen.keep_fraction * len(self.schemes)))
                keys = np.argsort(rough, kind="stable")[:keep].tolist()
                screened = True
        log10_p, symbols, scored = self.log10_p_values(ids, num_bits, keys=keys)
        if len(self.schemes) == 0 or scored == 0:
            return ProvenanceResult(None, 1.0, 0.0, len(self.schemes), len(ids), 0, ())
        candidates = np.arange(len(self.schemes)) if keys is None else np.array(keys)
        order = candidates[np.argsort(log10_p[candidates], kind="stable")][: max(1, top)]
        ranked = tuple(KeyScore(int(i), float(log10_p[i]), int(symbols[i])) for i in order.tolist())
        log_p = sidak_log_p(ranked[0].log10_p_value * _LN10, len(self.schemes))
        return ProvenanceResult(
            best=ranked[0],
            p_value=math.exp(log_p),
            log10_p_value=log_p / _LN10,
            num_keys=len(self.schemes),
            num_tokens=len(ids),
            num_scored_tokens=scored,
            top=ranked,
            num_full_scans=len(self.schemes) if keys is None else len(keys),
            screened=screened,
        )
