"""A layer-weighted message-free detection statistic for ``worldcup-v2`` (experimental).

The tournament's layers do not carry equal evidence: the sampler applies them in
order, and once the first layers have concentrated the distribution on a few
tokens the later ones barely move it, most of all at low entropy (temperature
0.7 chat answers). So a token's layer-``l`` g-bit is weighted by a fixed integer
``w_l``, decreasing with ``l`` (:func:`layer_weights`, chosen before any test text
was seen). Each (position, group) cell's statistic is ``S = sum_tokens sum_l w_l g``:
under H0 the g-bits are i.i.d. fair coins, so S is the sum of independent
``w_l * Binomial(n, 1/2)`` terms, whose exact law (symmetric about its mean) is
tabulated by convolution (:class:`WeightedTable`). Each cell gets the
randomised two-sided p ``P(|S - mu| > d) + U P(|S - mu| = d)``, exactly uniform,
and Fisher's combination is exactly chi-square, as for the unweighted statistic
(:mod:`worldcup_core.detector`). Tails below the smallest double are floored at
1e-300 (a larger p: conservative).

Only the statistic changes, not the encoding: texts of every scheme version keep
detecting and decoding as before through :mod:`worldcup_core.detector`.

**Token weights from the model** (issue #44). Every test here takes an optional
``token_weights`` (one array per text, as long as it: each token's informativeness from
the served model, :mod:`worldcup_core.token_weights`); given, the test is the
model-assisted one of :mod:`worldcup_core.detector_model` (exact under H0, as this one);
None, it is this module's statistic, bit for bit. Where the layer-weighted statistic
does not apply (``worldcup-v1`` keys, the ablation variants) the weights are ignored
and today's unweighted statistic stands.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from worldcup_core.config import Variant, WatermarkConfig
from worldcup_core.consistency import GATED_LOG_P, sign_gated
from worldcup_core.decoder import DEFAULT_LIST_SIZE, DecodeResult, RegistryMatch
from worldcup_core.detector import DEFAULT_SIGNIFICANCE, slot_count
from worldcup_core.detector_model import (
    TokenWeights,
    entry_cells,
    entry_units,
    gate_where_it_acts,
    model_decode_many,
    model_entry_log_p,
    model_log_p_many,
    model_text_cells,
    model_verdict_log_p_many,
    sign_upper_log_sf,
)
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
from worldcup_core.registry_lookup import TextCells, text_cells
from worldcup_core.scheme import WorldCup
from worldcup_core.scoring import fisher_log_sf, symbol_index, text_digest

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
_FLOOR = math.log(1e-300)


def layer_weights(layers: int, top: int = 4) -> I64:
    """Integer weights from ``top`` (first layer) down to 1 (last), linearly."""
    if layers == 1:
        return np.array([1], dtype=np.int64)
    steps = np.arange(layers, dtype=np.float64) / (layers - 1)
    return np.rint(top - (top - 1) * steps).astype(np.int64)


class WeightedTable:
    """Exact two-sided tails of ``S_n = sum_l w_l Binomial(n, 1/2)``, per token count n."""

    def __init__(self, weights: I64) -> None:
        self.weights = np.asarray(weights, dtype=np.int64)
        self._token = _token_law(self.weights)
        self._pmf: list[F64] = [np.array([1.0])]
        self._tails: dict[int, tuple[F64, F64]] = {}

    def _law(self, n: int) -> F64:
        while len(self._pmf) <= n:
            self._pmf.append(np.convolve(self._pmf[-1], self._token))
        return self._pmf[n]

    def _tail_arrays(self, n: int) -> tuple[F64, F64]:
        """(log strict, log equal) for every value 0..L of S_n."""
        cached = self._tails.get(n)
        if cached is not None:
            return cached
        pmf = self._law(n)
        top = len(pmf) - 1
        above = np.concatenate([np.cumsum(pmf[::-1])[::-1][1:], [0.0]])  # P(S > v)
        v = np.arange(top + 1)
        hi = np.maximum(v, top - v)  # the value's mirror on the upper side
        strict = np.minimum(2.0 * above[hi], 1.0)
        equal = np.where(2 * hi == top, pmf[hi], 2.0 * pmf[hi])
        with np.errstate(divide="ignore"):
            out = (np.maximum(np.log(strict), _FLOOR), np.maximum(np.log(equal), _FLOOR))
        self._tails[n] = out
        return out

    def parts(self, scores: I64, counts: I64) -> tuple[F64, F64]:
        """(log P(more extreme), log P(equally extreme)) of each cell's score."""
        strict = np.empty(len(scores))
        equal = np.empty(len(scores))
        for n in np.unique(counts):
            rows = counts == n
            s, e = self._tail_arrays(int(n))
            strict[rows], equal[rows] = s[scores[rows]], e[scores[rows]]
        return strict, equal


_TABLES: dict[tuple[int, ...], WeightedTable] = {}


def table_for(weights: I64) -> WeightedTable:
    key = tuple(int(w) for w in weights)
    if key not in _TABLES:
        _TABLES[key] = WeightedTable(weights)
    return _TABLES[key]


def _weighted_units(
    prf: PRFV2, config: WatermarkConfig, ids: Sequence[I64], symbols: int, w: I64
) -> tuple[I64, I64, I64] | None:
    """The scored (token, group) units of ``ids``: each token's ``sum_l w_l g_l`` per group
    (n, k), its message position among ``symbols`` (n,) and its text's index (n,); None
    when no token is scored."""
    k, m = config.groups, config.layers
    items = [ScoredTokensV2.of(t, config.context_width) for t in ids]
    scored = np.array([len(it) for it in items])
    if scored.sum() == 0:
        return None
    segment = np.repeat(np.arange(len(ids)), scored)
    context = [np.concatenate([it.context[j] for it in items]) for j in range(config.context_width)]
    tokens = np.concatenate([it.tokens for it in items])
    bits = np.asarray(
        v2_group_bits(v2_gwords(prf.gvalue_key, context, tokens, gvalue_words(k, m)), k, m)
    )
    per_token: I64 = bits.astype(np.int64) @ w
    sym = symbol_index(v2_positions(prf.position_key, context), symbols, SCHEME_V2)
    return per_token, np.asarray(sym, dtype=np.int64), segment


def weighted_log_p_many(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int | None,
    weights: I64 | None = None,
    token_weights: TokenWeights | None = None,
) -> F64:
    """log p of the layer-weighted statistic for each text (payload length ``num_bits``,
    or the ``S`` slots when unknown, as v2's detection). ``worldcup-v2``, variant
    ``worldcup`` only. With ``token_weights``, the model-assisted statistic
    (:func:`worldcup_core.detector_model.model_log_p_many`; ``weights`` must be None)."""
    if not weighted_applies(config):
        raise ValueError("the layer-weighted statistic is for worldcup-v2, variant worldcup")
    if token_weights is not None:
        if weights is not None:
            raise ValueError("token weights go with the default layer weights")
        return model_log_p_many(key, config, texts, num_bits, token_weights)
    k, m = config.groups, config.layers
    w = layer_weights(m) if weights is None else np.asarray(weights, dtype=np.int64)
    symbols = slot_count(config) if num_bits is None else config.symbols_for(num_bits)
    prf = PRFV2.of(key)
    ids = [np.asarray(t, dtype=np.int64) for t in texts]
    units = _weighted_units(prf, config, ids, symbols, w)
    if units is None:
        return np.zeros(len(ids))
    per_token, sym, segment = units
    row = segment * symbols + sym
    size = len(ids) * symbols
    counts = np.bincount(row, minlength=size).reshape(len(ids), symbols)
    score = (
        np.stack(
            [np.bincount(row, weights=per_token[:, j], minlength=size) for j in range(k)], axis=-1
        )
        .astype(np.int64)
        .reshape(len(ids), symbols, k)
    )
    seg_idx, b_idx = np.nonzero(counts > 0)
    cell_counts = np.repeat(counts[seg_idx, b_idx], k)
    cell_scores = score[seg_idx, b_idx].ravel()
    cell_seg = np.repeat(seg_idx, k)
    counters = (b_idx[:, None] * k + np.arange(k)).ravel()
    seeds = v2_tiebreak_seeds(prf.tiebreak_key, [text_digest(t) for t in ids])
    uniforms = uniforms_from_u64(splitmix64(seeds[cell_seg], counters.astype(np.int64)))
    strict, equal = table_for(w).parts(cell_scores, cell_counts)
    log_p = np.minimum(np.logaddexp(strict, np.log(uniforms) + equal), 0.0)
    fisher = np.bincount(cell_seg, weights=-2.0 * log_p, minlength=len(ids))
    cells = np.bincount(cell_seg, minlength=len(ids))
    out: F64 = fisher_log_sf(fisher.astype(np.float64), cells.astype(np.int64))
    return out


def weighted_applies(config: WatermarkConfig) -> bool:
    """Whether the layer-weighted statistic is defined for this configuration."""
    return config.version == SCHEME_V2 and config.variant is Variant.WORLDCUP


def verdict_log_p(
    scheme: WorldCup,
    texts: Sequence[Sequence[int]],
    num_bits: int | None,
    token_weights: TokenWeights | None = None,
) -> F64:
    """The detection statistic the one verdict uses (:mod:`worldcup_core.assess`), log p
    per text: layer-weighted under ``worldcup-v2`` (variant ``worldcup``), model-assisted
    there when ``token_weights`` are given, the unweighted statistic of
    :mod:`worldcup_core.detector` otherwise (``worldcup-v1`` keys, the ablation
    variants, whatever the weights), so texts of every version keep their statistic.
    Under ``worldcup-v2`` a p below the verdict's level stands only where the text's
    tokens agree within the test's cells (:mod:`worldcup_core.consistency`)."""
    if not texts:
        return np.zeros(0)
    if weighted_applies(scheme.config):
        key, config = scheme.key, scheme.config
        if token_weights is not None:
            return model_verdict_log_p_many(key, config, texts, num_bits, token_weights)
        log_p = weighted_log_p_many(key, config, texts, num_bits)
        return gate_where_it_acts(key, config, texts, num_bits, log_p)
    found = scheme.detect_many(texts, num_bits)
    return np.array([r.log10_p_value for r in found]) * math.log(10.0)


def best_verdict_log_p(
    schemes: Sequence[WorldCup],
    texts: Sequence[Sequence[int]],
    num_bits: int | None,
    token_weights: TokenWeights | None = None,
) -> tuple[F64, I64]:
    """(the smallest :func:`verdict_log_p` over ``schemes``, which scheme gave it) per text."""
    stack = np.stack([verdict_log_p(s, texts, num_bits, token_weights) for s in schemes])
    best = np.argmin(stack, axis=0).astype(np.int64)
    out: F64 = stack[best, np.arange(len(texts))]
    return out, best


def _token_law(weights: I64) -> F64:
    """The law of one token's ``sum_l w_l g_l`` over 0..sum(w), the g-bits fair coins."""
    law = np.array([1.0])
    for w in np.asarray(weights, dtype=np.int64):
        step = np.zeros(int(w) + 1)
        step[0] = step[-1] = 0.5
        law = np.convolve(law, step)
    return law


def weighted_upper_log_sf(weights: I64, units: int, score: int) -> float:
    """``log P(S >= score)`` for ``S`` the sum of ``units`` i.i.d. copies of one token's
    ``sum_l w_l g_l`` (fair g-bits), exact to floating point at any depth.

    The n-fold law is computed under the exponentially tilted token law whose mean is
    ``score / units`` (so the mass near ``score`` is of order ``1/sqrt(n)`` and an FFT
    keeps its relative precision there), then untilted: ``P(S = s) = q_n(s) M^n
    exp(-theta s)``. Direct convolution of the same law agrees to 1e-9 relative
    (``tests/test_assess.py``)."""
    law = _token_law(weights)
    top = len(law) - 1
    if units <= 0:
        return 0.0 if score <= 0 else -math.inf
    if score > units * top:
        return -math.inf
    if score == units * top:
        return units * math.log(law[-1])
    x = np.arange(top + 1, dtype=np.float64)
    log_law = np.log(law)

    def tilted_mean(theta: float) -> float:
        z = log_law + theta * x
        w = np.exp(z - z.max())
        return float((w * x).sum() / w.sum())

    target = score / units
    theta = 0.0
    if target > tilted_mean(0.0):
        lo, hi = 0.0, 1.0
        while tilted_mean(hi) < target:
            hi *= 2.0
        for _ in range(80):
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if tilted_mean(mid) < target else (lo, mid)
        theta = lo
    z = log_law + theta * x
    log_m = float(z.max() + np.log(np.exp(z - z.max()).sum()))
    tilted = np.exp(z - log_m)
    size = 1 << int(math.ceil(math.log2(units * top + 1)))
    spectrum = np.fft.rfft(tilted, size) ** units
    q = np.clip(np.fft.irfft(spectrum, size)[: units * top + 1], 0.0, None)
    s = np.arange(score, units * top + 1, dtype=np.float64)
    mass = float((q[score:] * np.exp(-theta * (s - score))).sum())
    if mass <= 0.0:
        return _FLOOR
    return min(units * log_m - theta * score + math.log(mass), 0.0)


def entry_log_p(
    key: WatermarkKey,
    config: WatermarkConfig,
    token_ids: Sequence[int],
    bits: str,
    token_weights: npt.NDArray[np.floating] | None = None,
) -> float:
    """The registry test of one entry, layer-weighted: ``log P(A >= a)`` for ``A`` the
    text's layer-weighted agreement with the payload ``bits`` (pad bits 0), summed over
    its scored (token, group) units, each of which under H0 is one token's ``sum_l w_l
    g_l`` with fair g-bits: exact (:func:`weighted_upper_log_sf`). ``worldcup-v2``,
    variant ``worldcup`` only. With ``token_weights`` (this text's), the model-weighted
    agreement (:func:`worldcup_core.detector_model.model_entry_log_p`), exact too."""
    if not weighted_applies(config):
        raise ValueError("the layer-weighted statistic is for worldcup-v2, variant worldcup")
    if token_weights is not None:
        return model_entry_log_p(key, config, token_ids, bits, token_weights)
    k = config.groups
    w = layer_weights(config.layers)
    symbols = config.symbols_for(len(bits))
    ids = [np.asarray(token_ids, dtype=np.int64)]
    units = _weighted_units(PRFV2.of(key), config, ids, symbols, w)
    if units is None:
        return 0.0
    per_unit, sym, _ = units
    entry = entry_cells(bits, symbols, k)
    agree = np.where(entry[sym] == 0, per_unit, int(w.sum()) - per_unit)
    return weighted_upper_log_sf(w, int(agree.size), int(agree.sum()))


def registry_verdict_log_p(
    scheme: WorldCup,
    token_ids: Sequence[int],
    bits: str,
    registry_size: int,
    token_weights: npt.NDArray[np.floating] | None = None,
) -> float | None:
    """The one verdict's registry test for the matched entry ``bits``: layer-weighted
    (:func:`entry_log_p`), Bonferroni-corrected for ``registry_size``. The entry is
    chosen by the unweighted maximum-likelihood match; the union bound covers any
    choice among the registry's entries, so the correction stays valid. None where the
    weighted statistic does not apply (the unweighted match's p stands). With
    ``token_weights`` the entry test is model-weighted; the entry is best chosen on the
    same weighted cells (:func:`worldcup_core.registry_lookup.text_cells` with
    ``weighted``), but the union bound holds for any choice. Gated, before the
    correction, by the agreement in the entry's positions and by the entry's own
    sign-conditional test (:mod:`worldcup_core.consistency`)."""
    if not weighted_applies(scheme.config):
        return None
    key, config = scheme.key, scheme.config
    log_p = entry_log_p(key, config, token_ids, bits, token_weights)
    weights = None if token_weights is None else [token_weights]
    log_p = float(
        gate_where_it_acts(key, config, [token_ids], len(bits), np.array([log_p]), weights)[0]
    )
    if log_p < GATED_LOG_P:  # the sign gate, where it can act (one more pass, this entry)
        units = entry_units(key, config, token_ids, bits, token_weights)
        log_p = sign_gated(log_p, sign_upper_log_sf(units), registry_size)
    return min(log_p + math.log(max(registry_size, 1)), 0.0)


def verdict_match(
    scheme: WorldCup,
    token_ids: Sequence[int],
    match: RegistryMatch,
    registry_size: int,
    token_weights: npt.NDArray[np.floating] | None = None,
) -> RegistryMatch:
    """``match`` with the p-value the one verdict takes from it
    (:func:`registry_verdict_log_p`), so an answer shows the registry test it was decided
    by; unchanged where the weighted statistic does not apply."""
    log_p = registry_verdict_log_p(scheme, token_ids, match.bits, registry_size, token_weights)
    if log_p is None:
        return match
    return replace(match, p_value=math.exp(log_p), log10_p_value=log_p / math.log(10.0))


def verdict_decode_many(
    scheme: WorldCup,
    texts: Sequence[Sequence[int]],
    num_bits: int,
    token_weights: TokenWeights | None = None,
    list_size: int = DEFAULT_LIST_SIZE,
    significance: float = DEFAULT_SIGNIFICANCE,
) -> list[DecodeResult]:
    """Decode ``texts``: from the model-weighted cells where ``token_weights`` are given
    and the statistic applies (:func:`worldcup_core.detector_model.model_decode_many`),
    else :meth:`WorldCup.decode_many` (today's path: ``worldcup-v1`` keys, the ablation
    variants, no model)."""
    if token_weights is None or not weighted_applies(scheme.config):
        return scheme.decode_many(texts, num_bits, list_size, significance)
    return model_decode_many(
        scheme.key, scheme.config, texts, num_bits, token_weights, list_size, significance
    )


def verdict_text_cells(
    scheme: WorldCup,
    token_ids: Sequence[int],
    num_bits: int,
    token_weights: npt.NDArray[np.floating] | None = None,
) -> TextCells:
    """A text's cells for the registry match (:mod:`worldcup_core.registry_lookup`):
    ranked and tested on the model-weighted evidence where ``token_weights`` are given
    and the statistic applies, on today's unweighted cells otherwise."""
    if token_weights is not None and weighted_applies(scheme.config):
        ones, trials, weighted = model_text_cells(
            scheme.key, scheme.config, token_ids, num_bits, token_weights
        )
        return text_cells(ones, trials, num_bits, weighted)
    ones, trials, _ = scheme.evidence(token_ids).cells(scheme.config.symbols_for(num_bits))
    return text_cells(ones, trials, num_bits)
