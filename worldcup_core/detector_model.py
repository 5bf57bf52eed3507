"""Model-assisted statistics for ``worldcup-v2``: every scored token weighted by what it can carry.

The layer-weighted statistic (:mod:`worldcup_core.detector_weighted`) gives every
scored token the same layer weights ``v_l`` (4 down to 1). Here token t also carries
its informativeness ``a_t`` from the served model (:mod:`worldcup_core.token_weights`:
``1 - sum p^2`` of its filtered next-token distribution, from the text alone, never
the key), as an integer **level** ``L_t = round(12 a_t^1.5)`` in 0..12, and its
layer-l g-bit weighs

    W_{t,l} = round(L_t v_l / 4)        (:func:`level_weights`; L = 4 gives v_l exactly).

A token with no model evidence (``a_t`` NaN) gets level 4: today's weights. So a text
whose every level is 4 gets today's cells exactly, and a forced token (a_t = 0) weighs
nothing. The exponent 1.5 (:data:`INFORMATIVENESS_POWER`) and Lancaster's combination
were chosen among a^0.5, a^1, a^1.5, a^2 x Fisher, Lancaster on 60 tuning chat answers
(T 0.7, 128 tokens), then measured on 40 held-out ones
(``python -m worldcup_eval.model_weights_study``).

**Cells (exact).** A (position, group) cell's score is ``S = sum_t sum_l W_{t,l} g``.
Under H0 (text written without the key) the g-bits are i.i.d. fair coins given the
positions and the weights (the weights depend on the text only), so S is a sum of
independent two-point laws {0, W}: its law is their convolution, symmetric about
``M/2`` (``M = sum W``, the cell's mass). It is computed by direct convolution of the
per-level token laws (:class:`CellLaws`), exact to rounding, and each cell gets the
randomised two-sided p ``P(|S - M/2| > d) + U P(|S - M/2| = d)``, U the keyed
tie-break uniform of today's statistic: exactly Uniform(0, 1). Cells of mass 0 (only
forced tokens) carry nothing and are left out, as empty cells are.

**Across cells** (:data:`COMBINERS`):

* ``fisher``: ``-2 sum log p`` against chi-square with 2C degrees of freedom;
* ``lancaster``: Lancaster's generalisation, ``sum F^{-1}_{nu_b}(1 - p_b)`` against
  chi-square with ``sum nu_b`` degrees of freedom, ``nu_b = max(1, round(2 M_b /
  mean M))``: cells with more mass (more informative tokens) count more. Each term is
  exactly chi-square(nu_b) under H0 and the cells are independent, so the sum is
  exactly chi-square: the p-value stays exact.

**Registry test** (:func:`model_entry_log_p`): the weighted agreement of the text
with one entry, ``A = sum_units W-weighted agreeing g-bits``, is under H0 a sum of
independent token laws (each symmetric, so agreeing with a 1-bit has the same law);
its upper tail is exact by exponential tilting and an FFT
(:func:`mixed_upper_log_sf`), finite at any depth.

**Decoding** (:func:`model_decode_many`, :func:`model_text_cells`): each payload bit is
read from the sign of its weighted cell, its confidence is the weighted z
``|2S - M| / sqrt(sum W^2)`` and the exact two-sided tail of its cell law; the
registry's list decoder ranks payloads by the weighted flip costs ``|2S - M|``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt
from scipy import special

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.consistency import GATED_LOG_P, agreement_z, gate_log_p
from worldcup_core.decoder import DEFAULT_LIST_SIZE, DecodeResult, decode_cells
from worldcup_core.detector import DEFAULT_SIGNIFICANCE, DetectionResult, slot_count, z_from_log_p
from worldcup_core.prf import (
    PRFV2,
    SCHEME_V2,
    ScoredTokensV2,
    WatermarkKey,
    gvalue_words,
    splitmix64,
    uniforms_from_u64,
    v2_group_bits,
    v2_gwords,
    v2_positions,
    v2_tiebreak_seeds,
)
from worldcup_core.scoring import fisher_log_sf, symbol_index, text_digest

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
TokenWeights = Sequence[npt.NDArray[np.floating]]
Combiner = Literal["fisher", "lancaster"]

LEVELS: Final = 12  # a token's level: round(LEVELS * a_t)
MODEL_FREE_LEVEL: Final = 4  # level_weights(.)[4] == layer_weights(.): today's weights
INFORMATIVENESS_POWER: Final = 1.5  # L_t = round(LEVELS * a_t ** INFORMATIVENESS_POWER)
LANCASTER_SCALE: Final = 2.0  # nu_b = max(1, round(LANCASTER_SCALE * M_b / mean M))
DEFAULT_COMBINER: Final[Combiner] = "lancaster"
COMBINERS: Final[tuple[Combiner, ...]] = ("fisher", "lancaster")
_FLOOR = math.log(1e-300)


def model_applies(config: WatermarkConfig) -> bool:
    """Whether the model-assisted statistics are defined for this configuration
    (``worldcup-v2``, variant ``worldcup``; every other text keeps today's path)."""
    return config.version == SCHEME_V2 and config.variant is Variant.WORLDCUP


def _layer_weights(layers: int, top: int = 4) -> I64:
    if layers == 1:
        return np.array([1], dtype=np.int64)
    steps = np.arange(layers, dtype=np.float64) / (layers - 1)
    return np.rint(top - (top - 1) * steps).astype(np.int64)


def level_weights(layers: int) -> I64:
    """(LEVELS + 1, layers): ``W[L, l] = floor(L v_l / 4 + 1/2)``, ``v`` today's layer
    weights (:func:`worldcup_core.detector_weighted.layer_weights`)."""
    v = _layer_weights(layers)
    levels = np.arange(LEVELS + 1, dtype=np.int64)[:, None]
    out: I64 = (levels * v[None, :] * 2 + 4) // 8  # floor(L v / 4 + 1/2), in integers
    return out


def token_levels(weights: npt.NDArray[np.floating], power: float = INFORMATIVENESS_POWER) -> I64:
    """Each token's level ``round(12 a_t^power)`` (half up), ``a_t`` clipped to [0, 1];
    NaN (no model evidence) gives :data:`MODEL_FREE_LEVEL`."""
    a = np.asarray(weights, dtype=np.float64)
    x = np.clip(np.nan_to_num(a, nan=0.0), 0.0, 1.0) ** power
    out = np.floor(x * LEVELS + 0.5)
    out = np.where(np.isnan(a), MODEL_FREE_LEVEL, out)
    return out.astype(np.int64)


def _two_point_law(weights: I64) -> F64:
    """The law over 0..sum(w) of ``sum_l w_l g_l``, fair g-bits (zero weights skipped)."""
    law = np.array([1.0])
    for w in np.asarray(weights, dtype=np.int64).tolist():
        if w <= 0:
            continue
        step = np.zeros(w + 1)
        step[0] = step[-1] = 0.5
        law = np.convolve(law, step)
    return law


class CellLaws:
    """Exact two-sided tails of cell scores, per multiset of token levels (cached)."""

    def __init__(self, layers: int, max_cached: int = 100_000) -> None:
        self.weights = level_weights(layers)
        self.token_laws = [_two_point_law(self.weights[lv]) for lv in range(LEVELS + 1)]
        self.max_cached = max_cached
        self._tails: dict[tuple[int, ...], tuple[F64, F64, F64]] = {}

    def law(self, levels: Sequence[int]) -> F64:
        """The law of a cell of tokens at these levels: the convolution of their laws."""
        law = np.array([1.0])
        for lv in levels:
            law = np.convolve(law, self.token_laws[lv])
        return law

    def tails(self, levels: tuple[int, ...]) -> tuple[F64, F64, F64]:
        """(log P(more extreme), log P(equally extreme), log P(at least as extreme)) of
        every score 0..M of a cell of tokens at ``levels`` (sorted)."""
        cached = self._tails.get(levels)
        if cached is not None:
            return cached
        pmf = self.law(levels)
        top = len(pmf) - 1
        above = np.concatenate([np.cumsum(pmf[::-1])[::-1][1:], [0.0]])  # P(S > v)
        v = np.arange(top + 1)
        hi = np.maximum(v, top - v)
        strict = np.minimum(2.0 * above[hi], 1.0)
        equal = np.where(2 * hi == top, pmf[hi], 2.0 * pmf[hi])
        with np.errstate(divide="ignore"):
            out = (
                np.maximum(np.log(strict), _FLOOR),
                np.maximum(np.log(equal), _FLOOR),
                np.maximum(np.log(np.minimum(strict + equal, 1.0)), _FLOOR),
            )
        if len(self._tails) >= self.max_cached:
            self._tails.clear()
        self._tails[levels] = out
        return out


_LAWS: dict[int, CellLaws] = {}


def cell_laws(layers: int) -> CellLaws:
    laws = _LAWS.get(layers)
    if laws is None:
        laws = _LAWS[layers] = CellLaws(layers)
    return laws


@dataclass(frozen=True)
class ModelCells:
    """Many texts' weighted cells under one grouping into ``symbols`` positions."""

    score: I64  # (S, B, k) weighted g-bits favouring bit 0
    mass: I64  # (S, B) sum of W over the cell's tokens and layers (M)
    sumsq: I64  # (S, B) sum of W^2 (the variance of 2S - M under H0)
    counts: I64  # (S, B) scored tokens per position (any level)
    ones: I64  # (S, B, k) unweighted g-bits favouring bit 0
    # per token t its signed evidence d_t = sum_l W_{t,l} (2 g - 1), per group: the cell's
    # sum of d_t^2 and of d_t^4 (the within-cell agreement test, worldcup_core.consistency)
    dsq: F64  # (S, B, k)
    dquad: F64  # (S, B, k)
    levels: tuple[tuple[tuple[int, ...], ...], ...]  # per text, per position: levels > 0
    scored: tuple[int, ...]  # scored tokens per text
    num_tokens: tuple[int, ...]
    seeds: npt.NDArray[np.uint64]  # (S,) tie-break seeds
    layers: int

    @property
    def groups(self) -> int:
        return int(self.score.shape[2])


def _check(config: WatermarkConfig, texts: Sequence[Sequence[int]], weights: TokenWeights) -> None:
    if not model_applies(config):
        raise ValueError("the model-assisted statistic is for worldcup-v2, variant worldcup")
    if len(weights) != len(texts):
        raise ValueError(f"{len(weights)} weight arrays for {len(texts)} texts")
    for text, w in zip(texts, weights, strict=True):
        if np.asarray(w).shape != (len(text),):
            raise ValueError(f"token weights of shape {np.asarray(w).shape} for {len(text)} tokens")


def model_cells(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    symbols: int,
    token_weights: TokenWeights,
    power: float = INFORMATIVENESS_POWER,
) -> ModelCells:
    """The weighted cells of ``texts`` (one weight array per text, as long as it; each
    token's level from its weight by :func:`token_levels` at ``power``)."""
    _check(config, texts, token_weights)
    ids = [np.asarray(t, dtype=np.int64) for t in texts]
    items = [ScoredTokensV2.of(t, config.context_width) for t in ids]
    pairs = zip(token_weights, items, strict=True)
    levels = [token_levels(np.asarray(w)[it.indices], power) for w, it in pairs]
    return cells_of_items(key, config, ids, items, levels, symbols)


def _unit_bits(
    prf: PRFV2,
    config: WatermarkConfig,
    context: Sequence[npt.NDArray[np.uint64]],
    tokens: npt.NDArray[np.uint64],
    levels: I64,
    symbols: int,
) -> tuple[I64, I64, I64]:
    """Of scored tokens (their contexts, ids and levels): the g-bits (n, k, m), 1
    favouring bit 0; each token's layer weights at its level (n, m); its position among
    ``symbols`` (n,)."""
    k, m = config.groups, config.layers
    words = v2_gwords(prf.gvalue_key, context, tokens, gvalue_words(k, m))
    bits = np.asarray(v2_group_bits(words, k, m), dtype=np.int64)
    sym = symbol_index(v2_positions(prf.position_key, context), symbols, SCHEME_V2)
    return bits, level_weights(m)[levels], np.asarray(sym, dtype=np.int64)


def entry_cells(bits: str, symbols: int, groups: int) -> I64:
    """A payload's bits (pad bits 0) as the (symbols, groups) cells they are written in."""
    padded = bits + "0" * (symbols * groups - len(bits))
    out: I64 = (
        (np.frombuffer(padded.encode("ascii"), dtype=np.uint8) - ord("0"))
        .reshape(symbols, groups)
        .astype(np.int64)
    )
    return out


def cells_of_items(
    key: WatermarkKey,
    config: WatermarkConfig,
    ids: Sequence[npt.NDArray[np.integer]],
    items: Sequence[ScoredTokensV2],
    levels_per_text: Sequence[I64],
    symbols: int,
) -> ModelCells:
    """The weighted cells of texts ``ids`` from the scored units ``items`` chosen for
    each (usually :meth:`ScoredTokensV2.of`; a collection drops the units an earlier
    text already holds) and their levels (one per unit, key-independent)."""
    k, m = config.groups, config.layers
    prf = PRFV2.of(key)
    scored = [len(it) for it in items]
    n_texts = len(ids)
    size = n_texts * symbols
    levels = (
        np.concatenate([np.asarray(lv, dtype=np.int64) for lv in levels_per_text])
        if n_texts
        else np.zeros(0, dtype=np.int64)
    )
    score = np.zeros((size, k), dtype=np.int64)
    ones = np.zeros((size, k), dtype=np.int64)
    dsq = np.zeros((size, k))
    dquad = np.zeros((size, k))
    mass = np.zeros(size, dtype=np.int64)
    sumsq = np.zeros(size, dtype=np.int64)
    counts = np.zeros(size, dtype=np.int64)
    per_text: list[list[list[int]]] = [[[] for _ in range(symbols)] for _ in range(n_texts)]
    if sum(scored):
        segment = np.repeat(np.arange(n_texts), scored)
        context = [
            np.concatenate([it.context[j] for it in items]) for j in range(config.context_width)
        ]
        tokens = np.concatenate([it.tokens for it in items])
        bits, w, sym = _unit_bits(prf, config, context, tokens, levels, symbols)
        row = segment * symbols + sym
        favour = np.einsum("nkm,nm->nk", bits, w)
        np.add.at(score, row, favour)
        np.add.at(ones, row, bits.sum(axis=2))
        sq = (2 * favour - w.sum(axis=1)[:, None]).astype(np.float64) ** 2
        np.add.at(dsq, row, sq)
        np.add.at(dquad, row, sq * sq)
        mass = np.bincount(row, weights=w.sum(axis=1), minlength=size).astype(np.int64)
        sumsq = np.bincount(row, weights=(w * w).sum(axis=1), minlength=size).astype(np.int64)
        counts = np.bincount(row, minlength=size).astype(np.int64)
        live = levels > 0
        order = np.lexsort((levels[live], row[live]))
        for r, lv in zip(row[live][order].tolist(), levels[live][order].tolist(), strict=True):
            per_text[r // symbols][r % symbols].append(lv)
    seeds = v2_tiebreak_seeds(prf.tiebreak_key, [text_digest(t) for t in ids])
    return ModelCells(
        score=score.reshape(n_texts, symbols, k),
        mass=mass.reshape(n_texts, symbols),
        sumsq=sumsq.reshape(n_texts, symbols),
        counts=counts.reshape(n_texts, symbols),
        ones=ones.reshape(n_texts, symbols, k),
        dsq=dsq.reshape(n_texts, symbols, k),
        dquad=dquad.reshape(n_texts, symbols, k),
        levels=tuple(tuple(tuple(c) for c in t) for t in per_text),
        scored=tuple(scored),
        num_tokens=tuple(len(t) for t in ids),
        seeds=np.asarray(seeds, dtype=np.uint64),
        layers=m,
    )


def cell_log_p(cells: ModelCells) -> tuple[I64, I64, F64]:
    """(text, position, log p) of every live (mass > 0) cell, groups flattened: the
    randomised two-sided p of each cell, exactly uniform under H0 (its uniform is the
    tie-break stream's counter ``b * k + j``, as today's statistic)."""
    k = cells.groups
    laws = cell_laws(cells.layers)
    seg_idx, b_idx = np.nonzero(cells.mass > 0)
    strict = np.empty((seg_idx.size, k))
    equal = np.empty((seg_idx.size, k))
    for c, (s, b) in enumerate(zip(seg_idx.tolist(), b_idx.tolist(), strict=True)):
        st, eq, _ = laws.tails(cells.levels[s][b])
        sc = cells.score[s, b]
        strict[c], equal[c] = st[sc], eq[sc]
    counters = (b_idx[:, None] * k + np.arange(k)).ravel()
    cell_seg = np.repeat(seg_idx, k)
    uniforms = uniforms_from_u64(splitmix64(cells.seeds[cell_seg], counters.astype(np.int64)))
    log_p = np.minimum(np.logaddexp(strict.ravel(), np.log(uniforms) + equal.ravel()), 0.0)
    return cell_seg.astype(np.int64), np.repeat(b_idx, k).astype(np.int64), log_p


def chi2_log_sf(x: npt.ArrayLike, df: npt.ArrayLike) -> F64:
    """``log P(chi2_df > x)`` for integer ``df >= 1``, exact and finite at any depth: the
    Poisson identity for even df, ``erfc(sqrt(x/2)) + exp(-x/2) sum_{j=1}^{n}
    (x/2)^{j-1/2} / Gamma(j+1/2)`` for odd df = 2n + 1, summed in log space."""
    xs = np.atleast_1d(np.asarray(x, dtype=np.float64))
    dfs = np.broadcast_to(np.atleast_1d(np.asarray(df, dtype=np.int64)), xs.shape)
    out = np.zeros(xs.shape)
    even = dfs % 2 == 0
    if even.any():
        out[even] = fisher_log_sf(xs[even], dfs[even] // 2)
    odd = ~even
    if odd.any():
        xo, n = np.maximum(xs[odd], 0.0), (dfs[odd] - 1) // 2
        h = np.maximum(xo / 2.0, 1e-300)
        j = np.arange(1, int(n.max(initial=0)) + 1, dtype=np.float64)[None, :]
        terms = (j - 0.5) * np.log(h)[:, None] - special.gammaln(j + 0.5) - h[:, None]
        terms = np.where(j <= n[:, None], terms, -np.inf)
        head = math.log(2.0) + special.log_ndtr(-np.sqrt(xo))
        both = np.concatenate([head[:, None], terms], axis=1)
        out[odd] = np.minimum(special.logsumexp(both, axis=1), 0.0)
    return out


def chi2_isf_log(log_p: npt.ArrayLike, df: npt.ArrayLike) -> F64:
    """The chi-square(df) quantile ``x`` with ``P(chi2_df > x) = p``, from ``log p``
    (``-2 log p`` exactly for df = 2)."""
    lp = np.asarray(log_p, dtype=np.float64)
    d = np.broadcast_to(np.asarray(df, dtype=np.int64), lp.shape)
    out = np.where(d == 2, -2.0 * lp, special.chdtri(d, np.exp(np.maximum(lp, -745.0))))
    result: F64 = np.maximum(out, 0.0)
    return result


def lancaster_df(mass: npt.ArrayLike, scale: float = LANCASTER_SCALE) -> I64:
    """Degrees of freedom per live cell: ``max(1, round(scale * M_b / mean M))`` over one
    text's live cells (mass > 0). A function of the weights and positions only."""
    m = np.asarray(mass, dtype=np.float64)
    if m.size == 0:
        return np.zeros(0, dtype=np.int64)
    out: I64 = np.maximum(1, np.floor(scale * m / m.mean() + 0.5)).astype(np.int64)
    return out


def combine_log_p(
    cells: ModelCells, combiner: Combiner = DEFAULT_COMBINER, scale: float = LANCASTER_SCALE
) -> F64:
    """One log p per text from its live cells (0 for a text with none)."""
    n = cells.score.shape[0]
    seg, pos, log_p = cell_log_p(cells)
    if combiner == "fisher":
        stat = np.bincount(seg, weights=-2.0 * log_p, minlength=n)
        df = 2 * np.bincount(seg, minlength=n)
    elif combiner == "lancaster":
        nu = np.zeros(seg.size, dtype=np.int64)
        for s in np.unique(seg).tolist():
            rows = seg == s
            nu[rows] = lancaster_df(cells.mass[s, pos[rows]], scale)
        stat = np.bincount(seg, weights=chi2_isf_log(log_p, nu), minlength=n)
        df = np.bincount(seg, weights=nu, minlength=n).astype(np.int64)
    else:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    out = np.zeros(n)
    live = df > 0
    if live.any():
        out[live] = chi2_log_sf(stat[live], df[live])
    return out


def model_log_p_many(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int | None,
    token_weights: TokenWeights,
    combiner: Combiner = DEFAULT_COMBINER,
    power: float = INFORMATIVENESS_POWER,
) -> F64:
    """log p of the model-assisted statistic for each text: payload length ``num_bits``,
    or the ``S`` slots when unknown (the message-free test). Exact under H0 for any
    ``combiner`` and ``power`` (both fixed before looking at the text)."""
    symbols = slot_count(config) if num_bits is None else config.symbols_for(num_bits)
    if not texts:
        return np.zeros(0)
    cells = model_cells(key, config, texts, symbols, token_weights, power)
    return combine_log_p(cells, combiner)


def cell_sums(cells: ModelCells) -> F64:
    """(S, B, k) each cell's sum of the signed token evidence ``d_t``: ``2 score - mass``."""
    out: F64 = (2 * cells.score - cells.mass[:, :, None]).astype(np.float64)
    return out


def cells_agreement_z(cells: ModelCells) -> F64:
    """Per text, the within-cell agreement ``z`` of its cells
    (:func:`worldcup_core.consistency.agreement_z`)."""
    return agreement_z(cell_sums(cells), cells.dsq, cells.dquad)


def agreement_z_many(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int | None,
    token_weights: TokenWeights | None = None,
) -> F64:
    """Per text, the within-cell agreement ``z`` (:mod:`worldcup_core.consistency`) in the
    cells of payload length ``num_bits`` (None: the ``S`` slots), each token weighted as
    the test it gates weighs it: by its model level, or today's layer weights
    (``token_weights`` None: every level :data:`MODEL_FREE_LEVEL`)."""
    symbols = slot_count(config) if num_bits is None else config.symbols_for(num_bits)
    if not texts:
        return np.zeros(0)
    weights = [np.full(len(t), np.nan) for t in texts] if token_weights is None else token_weights
    return cells_agreement_z(model_cells(key, config, texts, symbols, weights))


def gate_where_it_acts(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int | None,
    log_p: F64,
    token_weights: TokenWeights | None = None,
) -> F64:
    """``log_p`` (one per text) through the agreement gate, ``z`` computed
    (:func:`agreement_z_many`) only for the texts whose p is below the verdict's level:
    elsewhere the gate leaves the p as it is whatever ``z``, so most unwatermarked texts
    skip the second pass over their tokens."""
    lp = np.asarray(log_p, dtype=np.float64)
    at = np.flatnonzero(lp < GATED_LOG_P).tolist()
    z = np.full(lp.shape, np.inf)
    if at:
        weights = None if token_weights is None else [token_weights[i] for i in at]
        z[at] = agreement_z_many(key, config, [texts[i] for i in at], num_bits, weights)
    return gate_log_p(lp, z)


def model_verdict_log_p_many(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int | None,
    token_weights: TokenWeights,
) -> F64:
    """:func:`model_log_p_many` as the verdict takes it: through the agreement gate
    (:mod:`worldcup_core.consistency`), in the same cells."""
    symbols = slot_count(config) if num_bits is None else config.symbols_for(num_bits)
    if not texts:
        return np.zeros(0)
    cells = model_cells(key, config, texts, symbols, token_weights)
    return gate_log_p(combine_log_p(cells), cells_agreement_z(cells))


# --------------------------------------------------------------------------- registry


def _saddle_theta(logs: Sequence[tuple[F64, F64, int]], score: int) -> float:
    """The tilt ``theta >= 0`` that puts the mean of the sum of ``c`` copies of each law
    (``log_law``, its support ``x``) near ``score`` (0 when the mean is already above).

    Any ``theta`` makes :func:`mixed_upper_log_sf` exact (tilting is an identity); the
    saddle point only keeps the FFT's relative precision where the tail starts, so the
    mean need only come within half a unit. Newton steps (the derivative of the mean is
    the variance), kept inside a bracket by bisection, on all laws at once."""
    width = max(len(x) for _, x, _ in logs)
    table = np.full((len(logs), width), -np.inf)
    for row, (log_law, _, _) in enumerate(logs):
        table[row, : len(log_law)] = log_law
    x = np.arange(width, dtype=np.float64)
    counts = np.array([c for _, _, c in logs], dtype=np.float64)

    def moments(theta: float) -> tuple[float, float]:
        z = table + theta * x
        w = np.exp(z - z.max(axis=1, keepdims=True))
        mass = w.sum(axis=1)
        m1 = (w @ x) / mass
        m2 = (w @ (x * x)) / mass
        return float(counts @ m1), float(counts @ np.maximum(m2 - m1 * m1, 0.0))

    mean, var = moments(0.0)
    if mean >= score:
        return 0.0
    lo, hi, theta = 0.0, math.inf, 0.0
    for _ in range(200):
        if abs(mean - score) < 0.5:
            break
        if mean < score:
            lo = theta
        else:
            hi = theta
        step = theta + (score - mean) / var if var > 0 else math.inf
        if lo < step < hi:
            theta = step
        elif math.isfinite(hi):
            theta = (lo + hi) / 2.0
        else:
            theta = max(2.0 * theta, 1.0)
        mean, var = moments(theta)
    return theta


def mixed_upper_log_sf(laws: Sequence[F64], counts: Sequence[int], score: int) -> float:
    """``log P(A >= score)`` for ``A`` the sum of ``counts[i]`` independent copies of each
    law ``laws[i]`` (over 0..len-1), exact to floating point at any depth.

    As :func:`worldcup_core.detector_weighted.weighted_upper_log_sf`, for several laws:
    every law is tilted by the same ``theta`` that puts the sum's mean at ``score``, the
    tilted sum's law is one FFT (its mass near ``score`` is of order ``1/sqrt(var)``, so
    the FFT keeps its relative precision there), then untilted."""
    pairs = zip(laws, counts, strict=True)
    parts = [(np.asarray(law, dtype=np.float64), int(c)) for law, c in pairs if c > 0]
    parts = [(law, c) for law, c in parts if len(law) > 1]  # point masses at 0 add nothing
    if not parts:
        return 0.0 if score <= 0 else -math.inf
    top = sum(c * (len(law) - 1) for law, c in parts)
    if score <= 0:
        return 0.0
    if score > top:
        return -math.inf
    if score == top:
        return sum(c * math.log(law[-1]) for law, c in parts)
    with np.errstate(divide="ignore"):  # a law may have gaps (values no token reaches)
        logs = [(np.log(law), np.arange(len(law), dtype=np.float64), c) for law, c in parts]
    theta = _saddle_theta(logs, score)
    size = 1 << int(math.ceil(math.log2(top + 1)))
    spectrum = np.ones(size // 2 + 1, dtype=np.complex128)
    log_m = 0.0
    for log_law, x, c in logs:
        z = log_law + theta * x
        lm = float(z.max() + np.log(np.exp(z - z.max()).sum()))
        log_m += c * lm
        spectrum *= np.fft.rfft(np.exp(z - lm), size) ** c
    q = np.clip(np.fft.irfft(spectrum, size)[: top + 1], 0.0, None)
    s = np.arange(score, top + 1, dtype=np.float64)
    tail = float((q[score:] * np.exp(-theta * (s - score))).sum())
    if tail <= 0.0:
        return _FLOOR
    return min(log_m - theta * score + math.log(tail), 0.0)


@dataclass(frozen=True)
class WeightedCells:
    """One text's weighted evidence at one payload length, for matching entries."""

    score: I64  # (B, k)
    mass: I64  # (B,)
    sumsq: I64  # (B,)
    level_units: I64  # (LEVELS + 1,): scored (token, group) units per level
    layers: int

    @property
    def total(self) -> int:
        """The weighted agreement of the best possible entry with every cell: ``k sum M``."""
        return int(self.mass.sum()) * int(self.score.shape[1])

    @property
    def sd(self) -> float:
        """The standard deviation of ``2A - total`` under H0: ``sqrt(k sum W^2)``."""
        return math.sqrt(int(self.sumsq.sum()) * int(self.score.shape[1]))

    def upper_log_sf(self, agreement: int) -> float:
        """``log P(A >= agreement)`` under H0 for one fixed entry (exact)."""
        laws = cell_laws(self.layers).token_laws
        return mixed_upper_log_sf(laws, self.level_units.tolist(), agreement)

    def agreement(self, bits: str) -> int:
        """The weighted agreement of the entry ``bits`` (pad bits 0) with the cells."""
        symbols, k = self.score.shape
        entry = entry_cells(bits, int(symbols), int(k))
        agree = np.where(entry == 0, self.score, self.mass[:, None] - self.score)
        return int(agree.sum())


def weighted_cells_of(cells: ModelCells, i: int) -> WeightedCells:
    """Text ``i``'s :class:`WeightedCells` from a batch's cells."""
    k = cells.groups
    flat = [lv for pos in cells.levels[i] for lv in pos]
    units = np.bincount(np.asarray(flat, dtype=np.int64), minlength=LEVELS + 1) * k
    return WeightedCells(cells.score[i], cells.mass[i], cells.sumsq[i], units, cells.layers)


def model_entry_log_p(
    key: WatermarkKey,
    config: WatermarkConfig,
    token_ids: Sequence[int],
    bits: str,
    token_weights: npt.NDArray[np.floating],
) -> float:
    """The registry test of one entry, model-weighted: ``log P(A >= a)`` for the text's
    weighted agreement ``a`` with the payload ``bits`` (exact; not yet corrected for
    the registry's size)."""
    cells = model_cells(key, config, [token_ids], config.symbols_for(len(bits)), [token_weights])
    weighted = weighted_cells_of(cells, 0)
    if weighted.total == 0:
        return 0.0
    return weighted.upper_log_sf(weighted.agreement(bits))


def entry_units(
    key: WatermarkKey,
    config: WatermarkConfig,
    token_ids: Sequence[int],
    bits: str,
    token_weights: npt.NDArray[np.floating] | None = None,
) -> I64:
    """Each scored (token, group) unit's signed agreement with the entry ``bits`` (pad
    bits 0): ``a = sum_l W_l (2 g_l - 1)`` with ``g_l`` read as agreeing with the unit's
    bit, so ``a`` is positive where the unit leans towards the entry. ``W`` are the
    token's level weights (``token_weights`` None: today's layer weights, level
    :data:`MODEL_FREE_LEVEL`); units of weight 0 are dropped. The registry test's
    agreement is ``(sum a + sum W) / 2`` over the same units."""
    k = config.groups
    symbols = config.symbols_for(len(bits))
    ids = np.asarray(token_ids, dtype=np.int64)
    items = ScoredTokensV2.of(ids, config.context_width)
    if len(items) == 0:
        return np.zeros(0, dtype=np.int64)
    weights = np.full(len(ids), np.nan) if token_weights is None else np.asarray(token_weights)
    levels = token_levels(weights[items.indices])
    g, w, sym = _unit_bits(PRFV2.of(key), config, items.context, items.tokens, levels, symbols)
    d = 2 * np.einsum("nkm,nm->nk", g, w) - w.sum(axis=1)[:, None]  # (n, k): > 0 leans to 0
    entry = entry_cells(bits, symbols, k)
    signed: I64 = np.where(entry[sym] == 0, d, -d).ravel()
    live: I64 = signed[w.sum(axis=1).repeat(k) > 0]
    return live


def sign_upper_log_sf(units: npt.NDArray[np.integer]) -> float:
    """``log P(sum a >= observed)`` for the units' signed agreements ``a`` when each
    unit's sign is a fair coin given its magnitude (exact; 0 for no units).

    This is the registry test *conditional on the magnitudes*: valid under H0 (flipping
    all of a unit's g-bits maps ``a`` to ``-a`` and leaves the law of the g-bits
    unchanged) and under any text whose units point at random bits however extreme
    they are, such as a spoof written from payload-free stolen counts
    (:func:`worldcup_core.consistency.sign_gated`). The sum of ``|a|`` over the agreeing units is a
    sum of independent two-point laws ``{0, |a|}``, whose upper tail
    :func:`mixed_upper_log_sf` gives at any depth."""
    a = np.asarray(units, dtype=np.int64)
    mags = np.abs(a[a != 0])
    if mags.size == 0:
        return 0.0
    score = int((int(a.sum()) + int(mags.sum())) // 2)  # sum of |a| over agreeing units
    values, counts = np.unique(mags, return_counts=True)
    laws = []
    for v in values.tolist():
        law = np.zeros(v + 1)
        law[0] = law[-1] = 0.5
        laws.append(law)
    return mixed_upper_log_sf(laws, counts.tolist(), score)


def model_text_cells(
    key: WatermarkKey,
    config: WatermarkConfig,
    token_ids: Sequence[int],
    num_bits: int,
    token_weights: npt.NDArray[np.floating],
) -> tuple[I64, I64, WeightedCells]:
    """(unweighted ones, trials, weighted cells) of one text at a ``num_bits`` payload:
    what :func:`worldcup_core.registry_lookup.text_cells` takes to rank payloads by the
    weighted evidence (the unweighted counts keep the contradiction check binomial)."""
    cells = model_cells(key, config, [token_ids], config.symbols_for(num_bits), [token_weights])
    trials = np.repeat(cells.counts[0][:, None] * config.layers, config.groups, axis=1)
    return cells.ones[0], trials, weighted_cells_of(cells, 0)


# --------------------------------------------------------------------------- decoding


def model_decode_many(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int,
    token_weights: TokenWeights,
    list_size: int = DEFAULT_LIST_SIZE,
    significance: float = DEFAULT_SIGNIFICANCE,
    combiner: Combiner = DEFAULT_COMBINER,
) -> list[DecodeResult]:
    """Decode ``num_bits`` payloads from the weighted cells: each bit the sign of
    ``2S - M``, its z ``|2S - M| / sqrt(sum W^2)``, its p the exact two-sided tail of
    its cell law (1 for an erased cell: no token of positive weight), the list ranked
    by weighted flip costs; the detection is the model-assisted test at this length."""
    if not 0.0 < significance < 1.0:
        raise ValueError(f"significance must be in (0, 1), got {significance}")
    symbols = config.symbols_for(num_bits)
    cells = model_cells(key, config, texts, symbols, token_weights)
    log_p = combine_log_p(cells, combiner)
    k = cells.groups
    laws = cell_laws(cells.layers)
    bit_log_p = np.zeros(cells.score.shape)
    for s, b in zip(*(a.tolist() for a in np.nonzero(cells.mass > 0)), strict=True):
        bit_log_p[s, b] = laws.tails(cells.levels[s][b])[2][cells.score[s, b]]
    mass = np.repeat(cells.mass[:, :, None], k, axis=2)
    sumsq = np.repeat(cells.sumsq[:, :, None], k, axis=2)
    detections = []
    for i in range(len(texts)):
        lp = float(log_p[i]) if cells.scored[i] else 0.0
        p = math.exp(lp)
        detections.append(
            DetectionResult(
                p_value=p,
                log10_p_value=lp / math.log(10.0),
                z_score=z_from_log_p(lp, cells.scored[i]),
                paper_z_score=0.0,
                is_watermarked=p < significance,
                significance=significance,
                num_tokens=cells.num_tokens[i],
                num_scored_tokens=cells.scored[i],
                num_symbols=symbols,
            )
        )
    return decode_cells(
        cells.score,
        mass,
        cells.counts,
        num_bits,
        detections,
        list_size,
        scale=sumsq,
        bit_log_p=bit_log_p,
    )
