"""Many texts read together (issue #44, item 3): one exact test over a set of texts
declared to share a source, and the registry group (e.g. a ``user_id``) that best
explains it.

**Units, de-duplicated across the set.** A text's scored units are its tokens at the
first occurrence of their context (:class:`~worldcup_core.prf.ScoredTokensV2`). A
collection keeps a unit only in the first text that holds its (context, token): a
copied sentence, a repeated signature, a text posted twice count once. Texts are
visited in the order of their digests, so the answer does not depend on the order
they are given in, and a text repeated N times adds nothing after its first copy.
Two kept units then never share a (context, token), so under H0 (texts written
without the key) their g-bits are independent fair coins, whatever the texts share.

**Joint test** (:func:`joint_log_p`). Every text keeps its own cells (its units at
their message positions): texts from one account may carry different payloads, and
cells pooled across texts would cancel where their bits differ. Each live cell gets
the randomised two-sided p of :mod:`worldcup_core.detector_model` (exact, the cell
law a convolution of the units' two-point laws); the cells of all texts are combined
in one chi-square:

* model-weighted (``token_weights`` given, one array per text, from the text and the
  model only): Lancaster, ``nu_b = max(1, round(2 M_b / mean M))``, the mean over the
  whole set's live cells;
* model-free (no weights): every unit at today's layer weights, Fisher.

A set of one text gets that text's own statistic bit for bit (the per-text answers,
:func:`per_text_log_p`). The same joint test runs at a known payload length too
(``num_bits``: the cells the decoder reads, each text in its own payload's cells),
and :meth:`CollectionResult.tests` hands both to :func:`~worldcup_core.assess.assess`,
which combines them as a single text's detect and decode tests (weighted Bonferroni).
The weights, the de-duplication and the degrees of freedom
depend on the texts and the model only, never on the key: the sum is exactly
chi-square under H0.

**Naming a group** (:func:`group_search`). ``groups`` maps each value of a metadata
field (a user id) to the payloads the registry issued under it. Each text may carry
a different entry of the user, so a user's evidence is read per text. Two exact
constructions (:data:`GROUP_DESIGNS`), measured on simulated collections
(``docs/design.md``):

* ``mixture``: per text, the user's best entry, its one-entry registry
  test (:class:`~worldcup_core.detector_model.WeightedCells`: exact tail of the
  weighted agreement) Bonferroni-corrected by the user's entry count ``n_u``; the
  corrected p's of the texts (independent under H0 after de-duplication, each
  super-uniform) combined by Fisher: a valid p;
* ``pooled``: the sum over texts of the best entry's weighted agreement, against the
  exact law of the sum over all units (the same law for every assignment of entries to
  texts, each unit's law being symmetric), Bonferroni over the ``n_u^T`` assignments
  of entries to the ``T`` texts with units. The default: on simulated collections of
  5 texts x 24 tokens (100 users x 100 entries) it names the user at 1e-6 in 29 of 40,
  the mixture in 1 of 40 (the mixture pays Fisher's degrees of freedom on top of the
  same per-text Bonferroni).

The winner is the value of smallest p, corrected by the number of **distinct values
searched** ``G`` (union bound): ``p_group = min(1, G p_u)``.

Where the texts carry another user's entries (same key, a user outside ``groups``)
the g-bits are not fair coins, and a one-entry test of a keyed-random wrong entry is
no longer exact (its agreement spreads with the watermark's strength). The group
answer therefore also takes, per text and entry, the **sign-flip** p: given the
text's cells, the agreement of an entry whose bits are fair coins independent of the
text is ``sum_b (M_b + s_b |D_b|) / 2`` with fair signs ``s_b``, ``D_b = 2 S_b - M_b``
(exact by convolution). Registry payloads are keyed permutations of message ids
(:class:`~worldcup_core.message.MessageIdCodec`), so a wrong user's entries are such
entries. A text's p for an entry is the larger of the two: valid under either null.
In the pooled design the guard is taken per assignment, the texts given one entry
sharing its signs (their deviations add per bit). The guard only raises a p, so the
groups are visited by their token-null bound and the search stops once a bound, or a
coarse lower bound of the guard, exceeds the best exact p: the exhaustive answer.
The mixture's Fisher step treats the texts' corrected p's as independent: true under
the unwatermarked null, not strictly for an outsider's texts (the user's entries are
shared by the texts); it is kept for comparison.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from worldcup_core.assess import TestP
from worldcup_core.config import WatermarkConfig
from worldcup_core.consistency import gated, pooled_z
from worldcup_core.detector import slot_count
from worldcup_core.detector_model import (
    MODEL_FREE_LEVEL,
    ModelCells,
    TokenWeights,
    WeightedCells,
    cell_laws,
    cell_log_p,
    cell_sums,
    cells_of_items,
    chi2_isf_log,
    chi2_log_sf,
    gate_where_it_acts,
    lancaster_df,
    model_applies,
    model_verdict_log_p_many,
    token_levels,
    weighted_cells_of,
)
from worldcup_core.detector_weighted import weighted_log_p_many
from worldcup_core.prf import ScoredTokensV2, WatermarkKey
from worldcup_core.provenance import KeyBank
from worldcup_core.scoring import fisher_log_sf, text_digest
from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Statistic = Literal["model", "model_free"]
GroupDesign = Literal["mixture", "pooled"]
GROUP_DESIGNS: Final[tuple[GroupDesign, ...]] = ("mixture", "pooled")
DEFAULT_GROUP_DESIGN: Final[GroupDesign] = "pooled"  # measured: docs/design.md
MAX_COLLECTION_TEXTS: Final = 1000  # a bound for callers (the service's limits are its own)
_LN10 = math.log(10.0)
_FLOOR = math.log(1e-300)


@dataclass(frozen=True)
class CollectionUnits:
    """A collection's scored units after de-duplication across the set (key-independent:
    computed once per collection, whatever the keys searched)."""

    ids: tuple[npt.NDArray[np.int64], ...]  # the texts' token ids, in the caller's order
    items: tuple[ScoredTokensV2, ...]  # per text: the units it keeps
    levels: tuple[I64, ...]  # per text: each kept unit's level
    statistic: Statistic

    @property
    def num_texts(self) -> int:
        return len(self.ids)

    @property
    def num_units(self) -> int:
        return sum(len(it) for it in self.items)


def _check(
    config: WatermarkConfig, texts: Sequence[Sequence[int]], weights: TokenWeights | None
) -> None:
    if not model_applies(config):
        raise ValueError("collections are read under worldcup-v2, variant worldcup")
    if len(texts) > MAX_COLLECTION_TEXTS:
        raise ValueError(f"at most {MAX_COLLECTION_TEXTS} texts in a collection, got {len(texts)}")
    if weights is not None:
        if len(weights) != len(texts):
            raise ValueError(f"{len(weights)} weight arrays for {len(texts)} texts")
        for text, w in zip(texts, weights, strict=True):
            if np.asarray(w).shape != (len(text),):
                raise ValueError(
                    f"token weights of shape {np.asarray(w).shape} for {len(text)} tokens"
                )


def collection_units(
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    token_weights: TokenWeights | None = None,
) -> CollectionUnits:
    """The set's units: each text's scored units, less every (context, token) an earlier
    text (in digest order) already holds; each unit's level from its text's weight
    (:func:`~worldcup_core.detector_model.token_levels`), or today's weights (level
    :data:`~worldcup_core.detector_model.MODEL_FREE_LEVEL`) without a model."""
    _check(config, texts, token_weights)
    width = config.context_width
    ids = tuple(np.asarray(t, dtype=np.int64).reshape(-1) for t in texts)
    own = [ScoredTokensV2.of(t, width) for t in ids]
    order = sorted(range(len(ids)), key=lambda i: text_digest(ids[i]))
    seen: set[tuple[int, ...]] = set()
    keep: list[I64] = [np.zeros(0, dtype=np.int64)] * len(ids)
    for i in order:
        rows = np.stack([*own[i].context, own[i].tokens], axis=1).tolist() if len(own[i]) else []
        kept = []
        for r, unit in enumerate(rows):
            u = tuple(unit)
            if u not in seen:
                seen.add(u)
                kept.append(r)
        keep[i] = np.asarray(kept, dtype=np.int64)
    items = tuple(it.take(rows) for it, rows in zip(own, keep, strict=True))
    if token_weights is None:
        levels = tuple(np.full(len(it), MODEL_FREE_LEVEL, dtype=np.int64) for it in items)
    else:
        pairs = zip(token_weights, items, strict=True)
        levels = tuple(token_levels(np.asarray(w)[it.indices]) for w, it in pairs)
    statistic: Statistic = "model_free" if token_weights is None else "model"
    return CollectionUnits(ids, items, levels, statistic)


def collection_cells(
    key: WatermarkKey, config: WatermarkConfig, units: CollectionUnits, symbols: int
) -> ModelCells:
    """The set's cells under one key: per text, its kept units at ``symbols`` positions."""
    return cells_of_items(key, config, units.ids, units.items, units.levels, symbols)


def _joint_from_cells(cells: ModelCells, statistic: Statistic) -> float:
    seg, pos, log_p = cell_log_p(cells)
    if log_p.size == 0:
        return 0.0
    if statistic == "model_free":  # Fisher, as today's layer-weighted statistic
        stat = float(-2.0 * log_p.sum())
        joint = float(fisher_log_sf(np.array([stat]), np.array([log_p.size]))[0])
    else:
        nu = lancaster_df(cells.mass[seg, pos])
        stat = float(chi2_isf_log(log_p, nu).sum())
        joint = float(chi2_log_sf(np.array([stat]), np.array([int(nu.sum())]))[0])
    # the agreement gate over every text's own cells (worldcup_core.consistency)
    return gated(joint, pooled_z(cell_sums(cells), cells.dsq, cells.dquad))


def joint_log_p(
    key: WatermarkKey,
    config: WatermarkConfig,
    units: CollectionUnits,
    num_bits: int | None = None,
) -> float:
    """The joint test's log p under ``key``: message-free (``num_bits`` None: v2's ``S``
    slots) or at a known payload length. Exact under H0."""
    symbols = slot_count(config) if num_bits is None else config.symbols_for(num_bits)
    if units.num_units == 0:
        return 0.0
    return _joint_from_cells(collection_cells(key, config, units, symbols), units.statistic)


def per_text_log_p(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int | None = None,
    token_weights: TokenWeights | None = None,
) -> F64:
    """Each text's own test (no de-duplication across the set): the model-assisted
    statistic with weights, the layer-weighted one without."""
    if not texts:
        return np.zeros(0)
    if token_weights is None:
        log_p = weighted_log_p_many(key, config, texts, num_bits)
        return gate_where_it_acts(key, config, texts, num_bits, log_p)
    return model_verdict_log_p_many(key, config, texts, num_bits, token_weights)


# --------------------------------------------------------------------------- groups


def _entry_matrix(entries: Sequence[str], width: int) -> npt.NDArray[np.int64]:
    """(E, width) 0/1 of payloads padded with 0 bits (as the registry test pads)."""
    out = np.zeros((len(entries), width), dtype=np.int64)
    for r, bits in enumerate(entries):
        if not bits or len(bits) > width or set(bits) - {"0", "1"}:
            raise ValueError(f"an entry must be 1..{width} bits of 0/1, got {bits!r}")
        out[r, : len(bits)] = np.frombuffer(bits.encode("ascii"), dtype=np.uint8) - ord("0")
    return out


def sign_flip_upper_log_sf(deviations: npt.ArrayLike, excess: int, coarse: int = 1) -> float:
    """``log P(sum_b s_b |D_b| >= excess)`` for fair independent signs ``s_b`` (exact: the
    convolution of two-point laws, the same law as a cell's score, shifted). With
    ``coarse`` q > 1, a cheap lower bound: each |D_b| rounded down to a multiple of q
    (the sum can only drop, for every draw of the signs)."""
    d = np.abs(np.asarray(deviations, dtype=np.int64))
    d = d[d > 0]
    total = int(d.sum())
    if excess <= -total:
        return 0.0
    if excess > total:
        return -math.inf
    # sum s_b |D_b| = 2 X - total, X = sum over b of |D_b| times a fair bit
    need = -(-(excess + total) // 2)  # X >= ceil((excess + total) / 2)
    if coarse > 1:
        d = d // coarse
        d = d[d > 0]
        need = -(-need // coarse)
    law = np.array([1.0])
    for w in np.sort(d).tolist():
        step = np.zeros(w + 1)
        step[0] = step[-1] = 0.5
        law = np.convolve(law, step)
    if need >= len(law):
        return -math.inf
    tail = float(law[max(need, 0) :].sum())
    return math.log(tail) if tail > 0 else math.log(1e-300)


def _convolve_all(laws: Sequence[F64]) -> F64:
    out = np.array([1.0])
    for law in sorted(laws, key=len):
        out = np.convolve(out, law)
    return out


def _log_sf_table(pmf: F64) -> F64:
    """``log P(X >= v)`` for every v in 0..len(pmf) (floored at 1e-300: conservative)."""
    sf = np.concatenate([np.cumsum(pmf[::-1])[::-1], [0.0]])
    with np.errstate(divide="ignore"):
        out: F64 = np.minimum(np.maximum(np.log(sf), _FLOOR), 0.0)
    return out


def _two_point(weight: int) -> F64:
    step = np.zeros(weight + 1)
    step[0] = step[-1] = 0.5
    return step


class _TextEvidence:
    """One text's cells at one payload length, with both null laws of an entry's
    agreement tabulated once (direct convolution: exact to rounding)."""

    def __init__(self, cells: WeightedCells, num_bits: int) -> None:
        self.cells = cells
        self.base = int(cells.score.sum())  # agreement of the all-zero entry
        self.gain = (cells.mass[:, None] - 2 * cells.score).ravel()  # per bit set to 1
        dev = (2 * cells.score - cells.mass[:, None]).ravel()  # D per cell (bit 0 agrees)
        self.signed = dev[:num_bits]  # the payload's own bits; pad bits are 0 always
        self.dev = np.abs(self.signed)
        self.offset = cells.total + int(dev[num_bits:].sum())  # 2A - this = sum s_b |D_b|
        laws = cell_laws(cells.layers).token_laws
        units = cells.level_units.tolist()
        self.token_pmf = _convolve_all([laws[lv] for lv, c in enumerate(units) for _ in range(c)])
        self.token_sf = _log_sf_table(self.token_pmf)
        self.flip_pmf = _convolve_all([_two_point(int(d)) for d in self.dev if d > 0])
        self.flip_sf = _log_sf_table(self.flip_pmf)

    def agreements(self, entries: npt.NDArray[np.int64]) -> I64:
        out: I64 = self.base + entries @ self.gain
        return out

    def log_sf(self, agreement: int) -> float:
        """The entry's p: the larger of the token-null tail ``P(A >= a)`` and the sign-flip
        tail ``P(sum s_b |D_b| >= 2a - offset)`` (``X = sum |D_b| [s_b = +1]``)."""
        if self.cells.total == 0:
            return 0.0
        return max(_lookup(self.token_sf, agreement), self.flip_log_sf(agreement))

    def flip_log_sf(self, agreement: int) -> float:
        excess = 2 * agreement - self.offset
        need = -(-(excess + int(self.dev.sum())) // 2)  # X >= ceil((excess + sum|D|) / 2)
        return _lookup(self.flip_sf, need)


def _lookup(table: F64, value: int) -> float:
    if value <= 0:
        return 0.0
    if value >= len(table):
        return -math.inf
    return float(table[value])


def _pooled_tables(texts: Sequence[_TextEvidence]) -> F64:
    """The token-null law of the summed agreement over texts (their units independent)."""
    return _log_sf_table(_convolve_all([t.token_pmf for t in texts]))


def _assignment_flip_log_sf(
    texts: Sequence[_TextEvidence],
    entries: Sequence[str],
    agreements: Sequence[int],
    coarse: int = 1,
) -> float:
    """The sign-flip tail of the summed agreement for one assignment of entries to texts:
    texts given the same entry share its signs, so their deviations add per bit before
    the signs are drawn (``sum_i (2 A_i - offset_i) = sum_e sum_b s_eb C_eb``)."""
    combined: dict[str, I64] = {}
    excess = 0
    for ev, entry, agreement in zip(texts, entries, agreements, strict=True):
        excess += 2 * agreement - ev.offset
        if entry in combined:
            combined[entry] = combined[entry] + ev.signed
        else:
            combined[entry] = ev.signed.copy()
    devs = np.concatenate(list(combined.values())) if combined else np.zeros(0, dtype=np.int64)
    return sign_flip_upper_log_sf(devs, excess, coarse)


@dataclass(frozen=True)
class GroupScore:
    """One group's evidence over the set (its p not yet corrected for the groups searched)."""

    value: str
    log_p: float
    entries: tuple[str | None, ...]  # per text: the group's best entry (None: no units)
    exact: bool = True  # False: log_p is a lower bound (a group the search ruled out)


def _group_scores(
    key: WatermarkKey,
    config: WatermarkConfig,
    units: CollectionUnits,
    groups: Mapping[str, Sequence[str]],
    design: GroupDesign,
) -> list[GroupScore]:
    if design not in GROUP_DESIGNS:
        raise ValueError(f"design must be one of {GROUP_DESIGNS}, got {design!r}")
    lengths = sorted({len(b) for entries in groups.values() for b in entries})
    evidence: dict[int, list[_TextEvidence]] = {}
    for length in lengths:
        cells = collection_cells(key, config, units, config.symbols_for(length))
        evidence[length] = [
            _TextEvidence(weighted_cells_of(cells, i), length) for i in range(units.num_texts)
        ]
    live = [i for i in range(units.num_texts) if len(units.items[i])]
    k = config.groups
    pooled: dict[tuple[int, ...], F64] = {}
    pending: list[
        tuple[
            float,
            str,
            tuple[str | None, ...],
            tuple[list[_TextEvidence], list[str], list[int], float],
        ]
    ] = []
    out = []
    for value, entries in groups.items():
        if not entries:
            continue
        n_u = len(entries)
        by_length = []  # the user's entries of each length, as a matrix (parsed once)
        for length in sorted({len(b) for b in entries}):
            same = [b for b in entries if len(b) == length]
            by_length.append((length, same, _entry_matrix(same, config.symbols_for(length) * k)))
        best: list[tuple[float, int, str]] = []  # per live text: (log p, agreement, entry)
        for i in live:
            cand: tuple[float, int, str] | None = None
            for length, same, matrix in by_length:
                ev = evidence[length][i]
                agree = ev.agreements(matrix)
                r = int(np.argmax(agree))  # the first of the best: the user's order breaks ties
                lp = ev.log_sf(int(agree[r]))
                if cand is None or lp < cand[0]:
                    cand = (lp, int(agree[r]), same[r])
            assert cand is not None
            best.append(cand)
        chosen: list[str | None] = [None] * units.num_texts
        for i, c in zip(live, best, strict=True):
            chosen[i] = c[2]
        if not best:
            out.append(GroupScore(value, 0.0, tuple(chosen)))
            continue
        if design == "mixture":
            corrected = np.minimum(np.array([c[0] for c in best]) + math.log(n_u), 0.0)
            stat = float(-2.0 * corrected.sum())
            log_p = float(fisher_log_sf(np.array([stat]), np.array([len(best)]))[0])
        else:
            shape = tuple(len(c[2]) for c in best)  # the tables depend on the lengths only
            if shape not in pooled:
                pooled[shape] = _pooled_tables(
                    [evidence[len(c[2])][i] for i, c in zip(live, best, strict=True)]
                )
            token_sf = pooled[shape]
            total = sum(c[1] for c in best)
            penalty = len(best) * math.log(n_u)
            bound = min(_lookup(token_sf, total) + penalty, 0.0)
            if bound < 0.0:  # the sign-flip guard, below, for the likeliest groups only
                chosen_ev = [evidence[len(c[2])][i] for i, c in zip(live, best, strict=True)]
                args = (chosen_ev, [c[2] for c in best], [c[1] for c in best], penalty)
                pending.append((bound, value, tuple(chosen), args))
                continue
            log_p = bound
        out.append(GroupScore(value, log_p, tuple(chosen)))
    # The guard can only raise a p, so the groups are visited by their token-null bound
    # and the guard stops once a bound exceeds the best exact p: the others' exact p
    # is at least their bound (GroupScore.exact False, log_p that bound).
    best_exact = min((g.log_p for g in out), default=math.inf)
    for bound, value, chosen_t, (evs, entries, agreements, penalty) in sorted(
        pending, key=lambda x: (x[0], x[1])
    ):
        if bound > best_exact:
            out.append(GroupScore(value, bound, chosen_t, exact=False))
            continue
        if max(bound, _assignment_flip_log_sf(evs, entries, agreements, 16) + penalty) > best_exact:
            out.append(GroupScore(value, bound, chosen_t, exact=False))
            continue
        flip = _assignment_flip_log_sf(evs, entries, agreements)
        log_p = min(max(bound, flip + penalty), 0.0)
        best_exact = min(best_exact, log_p)
        out.append(GroupScore(value, log_p, chosen_t))
    return out


@dataclass(frozen=True)
class GroupSearch:
    """The group that best explains the set, corrected for the distinct values searched."""

    value: str | None
    log_p: float  # corrected: min(0, log G + the group's own log p)
    groups_searched: int
    entries: tuple[str | None, ...]  # per text: the named group's best entry
    scores: tuple[GroupScore, ...]  # every group's uncorrected score: exact ones best first

    @property
    def p_value(self) -> float:
        return math.exp(self.log_p)


def group_search(
    key: WatermarkKey,
    config: WatermarkConfig,
    units: CollectionUnits,
    groups: Mapping[str, Sequence[str]],
    design: GroupDesign = DEFAULT_GROUP_DESIGN,
) -> GroupSearch:
    """Which value of ``groups`` (value -> the payload bit strings issued under it) best
    explains the set under ``key``, and its p corrected for the distinct values searched
    (values with no entry are not searched)."""
    scores = sorted(
        _group_scores(key, config, units, groups, design),
        key=lambda g: (not g.exact, g.log_p, g.value),  # a ruled-out group's p is a bound
    )
    if not scores:
        return GroupSearch(None, 0.0, 0, (None,) * units.num_texts, ())
    top = scores[0]
    log_p = min(top.log_p + math.log(len(scores)), 0.0)
    return GroupSearch(top.value, log_p, len(scores), top.entries, tuple(scores))


# --------------------------------------------------------------------------- key choice

SCREEN_TOP: Final = 4  # keys the screen passes to the exact joint test


@dataclass(frozen=True)
class Chosen:
    """The key the set chose and its joint test (log p, uncorrected for the search)."""

    index: int
    log_p: float
    kept: tuple[int, ...]  # per text: its scored units the joint test kept


def choose_key(
    bank: KeyBank, ids: list[list[int]], weights: Sequence[F64] | None
) -> tuple[Chosen | None, int]:
    """Screen the bank on the texts concatenated (the screen only ranks keys: the
    correction counts every key), then the exact joint test under the best few
    ``worldcup-v2`` keys; (the best of them or None, the number of keys searched)."""
    concat = [t for text in ids for t in text]
    screen = bank.search(concat, top=SCREEN_TOP)
    best: Chosen | None = None
    for cand in screen.top:
        scheme = bank.schemes[cand.index]
        if not model_applies(scheme.config):
            continue
        units = collection_units(scheme.config, ids, weights)
        log_p = joint_log_p(scheme.key, scheme.config, units)
        if best is None or log_p < best.log_p:
            best = Chosen(cand.index, log_p, tuple(len(it) for it in units.items))
    return best, screen.num_keys


# --------------------------------------------------------------------------- answer


@dataclass(frozen=True)
class CollectionResult:
    """A collection's answer under one key."""

    log10_p_value: float  # the joint test
    num_texts: int
    num_units: int  # scored units after de-duplication across the set
    per_text_log10_p: tuple[float, ...]  # each text's own test
    statistic: Statistic
    num_bits: int | None
    best_group: str | None = None
    group_log10_p_value: float | None = None  # corrected for the groups searched
    groups_searched: int = 0
    group_entries: tuple[str | None, ...] = ()  # per text: the named group's best entry
    # the joint test at each known payload length: (bits, log10 p), and each text's own
    length_log10_p: tuple[tuple[int, float], ...] = ()
    per_text_length_log10_p: tuple[tuple[int, tuple[float, ...]], ...] = ()

    @property
    def p_value(self) -> float:
        return float(10.0**self.log10_p_value)

    def tests(self, key_version: int | None = None) -> list[TestP]:
        """The joint tests, for :func:`worldcup_core.assess.assess` to combine as a
        single text's are (weighted Bonferroni): message-free, and at each payload
        length read (the cells the decoder reads: each text's own payload, since texts
        of one account carry different entries)."""
        out = [TestP("detect", self.p_value, key_version=key_version)]
        for bits, log10_p in self.length_log10_p:
            out.append(TestP("decode", float(10.0**log10_p), bits, key_version=key_version))
        return out

    def text_tests(self, index: int, key_version: int | None = None) -> list[TestP]:
        """The ``index``-th text's own tests (no de-duplication across the set)."""
        out = [TestP("detect", self.per_text_p[index], key_version=key_version)]
        for bits, per_text in self.per_text_length_log10_p:
            out.append(
                TestP("decode", float(10.0 ** per_text[index]), bits, key_version=key_version)
            )
        return out

    @property
    def per_text_p(self) -> tuple[float, ...]:
        return tuple(float(10.0**x) for x in self.per_text_log10_p)

    @property
    def group_p_value(self) -> float | None:
        return None if self.group_log10_p_value is None else float(10.0**self.group_log10_p_value)

    @property
    def is_watermarked(self) -> bool:
        """The joint verdict at the service's level (p < 1e-6)."""
        return self.p_value < VERDICT_WATERMARKED_BELOW

    @property
    def names_group(self) -> bool:
        """Whether the group may be named: its corrected p below the verdict's level."""
        p = self.group_p_value
        return p is not None and p < VERDICT_WATERMARKED_BELOW


def read_collection(
    key: WatermarkKey,
    config: WatermarkConfig,
    texts: Sequence[Sequence[int]],
    num_bits: int | None = None,
    token_weights: TokenWeights | None = None,
    groups: Mapping[str, Sequence[str]] | None = None,
    design: GroupDesign = DEFAULT_GROUP_DESIGN,
    lengths: Sequence[int] = (),
) -> CollectionResult:
    """Read ``texts`` together under ``key``: the joint test (message-free, or at
    ``num_bits``), each text's own test, and with ``groups`` the group that best
    explains the set. Model-weighted when ``token_weights`` are given (one array per
    text, from the text and the model only), model-free otherwise. ``lengths``: also
    the joint test and each text's own at each of these payload lengths
    (:meth:`CollectionResult.tests`)."""
    units = collection_units(config, texts, token_weights)
    joint = joint_log_p(key, config, units, num_bits)
    own = per_text_log_p(key, config, texts, num_bits, token_weights)
    at_lengths = tuple(
        (int(b), joint_log_p(key, config, units, int(b)) / _LN10) for b in sorted(set(lengths))
    )
    own_at_lengths = tuple(
        (b, tuple(float(x) / _LN10 for x in per_text_log_p(key, config, texts, b, token_weights)))
        for b, _ in at_lengths
    )
    result = CollectionResult(
        log10_p_value=joint / _LN10,
        num_texts=units.num_texts,
        num_units=units.num_units,
        per_text_log10_p=tuple(float(x) / _LN10 for x in own),
        statistic=units.statistic,
        num_bits=num_bits,
        length_log10_p=at_lengths,
        per_text_length_log10_p=own_at_lengths,
    )
    if groups is None:
        return result
    found = group_search(key, config, units, groups, design)
    return CollectionResult(
        log10_p_value=result.log10_p_value,
        num_texts=result.num_texts,
        num_units=result.num_units,
        per_text_log10_p=result.per_text_log10_p,
        statistic=result.statistic,
        num_bits=num_bits,
        length_log10_p=at_lengths,
        per_text_length_log10_p=own_at_lengths,
        best_group=found.value,
        group_log10_p_value=found.log_p / _LN10 if found.groups_searched else None,
        groups_searched=found.groups_searched,
        group_entries=found.entries,
    )
