"""The registry lookup that does not read the registry (issue #36): the vectorised
codec against the scalar one, the list path against the exhaustive match on simulated
evidence, and the calibration of its p-value on null text."""

from __future__ import annotations

import numpy as np
import pytest

from worldcup_core.decoder import RegistryMatch, match_cells
from worldcup_core.detector_model import WeightedCells
from worldcup_core.message import MessageIdCodec
from worldcup_core.prf import WatermarkKey
from worldcup_core.registry_lookup import (
    ListMatch,
    exhaustive_match,
    flip_costs,
    list_match,
    payload_list,
    text_cells,
    use_list,
)

GROUPS = 2


def test_vectorised_codec_is_the_scalar_codec() -> None:
    rng = np.random.default_rng(7)
    for num_bits in [1, 2, 3, 5, 8, 15, 16, 17, 24, 31, 32, 33, 40, 64]:
        codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
        n = 400 if num_bits <= 32 else 40  # above 32 bits the array path is the scalar one
        ids = rng.integers(0, 2**num_bits, size=n, dtype=np.uint64, endpoint=False)
        payloads = codec.payload_ints(ids)
        assert payloads.tolist() == [codec.payload(int(i)).to_int() for i in ids.tolist()]
        assert codec.message_id_ints(payloads).tolist() == ids.tolist()
        if num_bits <= 12:  # a permutation of the whole range
            every = codec.payload_ints(np.arange(2**num_bits))
            assert sorted(every.tolist()) == list(range(2**num_bits))
    with pytest.raises(ValueError, match="fit in 8 bits"):
        MessageIdCodec(WatermarkKey(bytes(32)), 8).payload_ints([256])


def test_codec_payloads_are_pinned() -> None:
    """Texts issued before must decode to the same entries forever."""
    key = WatermarkKey(bytes(range(32)))
    pinned = {
        16: [24166, 11589, 13886, 2915],
        32: [2863596340, 1149824808, 3576439897, 988720068],
        33: [41695494, 5317426803, 2275813190, 1368927368],
    }
    for num_bits, want in pinned.items():
        codec = MessageIdCodec(key, num_bits)
        ids = [1, 2, 3, 12345]
        assert codec.payload_ints(ids).tolist() == want
        assert [codec.payload(i).to_int() for i in ids] == want


def simulated_cells(
    rng: np.random.Generator, payload: int | None, num_bits: int, delta: float, per_cell: int
) -> tuple[np.ndarray, np.ndarray]:
    """Cells of a text: each payload bit's cell ~ Binomial(trials, 1/2 +- delta); a
    ``None`` payload is null text (delta 0). Pad cells (b odd) carry no watermark."""
    symbols = -(-num_bits // GROUPS)
    trials = rng.integers(per_cell // 2, per_cell * 3 // 2 + 1, size=symbols * GROUPS)
    bias = np.zeros(symbols * GROUPS)
    if payload is not None:
        bits = np.array([int(c) for c in format(payload, f"0{num_bits}b")])
        bias[:num_bits] = np.where(bits == 0, delta, -delta)
    ones = rng.binomial(trials, 0.5 + bias)
    return ones.reshape(symbols, GROUPS), trials.reshape(symbols, GROUPS)


def lookup(
    codec: MessageIdCodec, ones: np.ndarray, trials: np.ndarray, size: int
) -> ListMatch | None:
    """The list path against a registry of ids 1..size."""
    cells = text_cells(ones, trials, codec.num_bits)
    plist = payload_list(cells)
    ids = codec.message_id_ints(plist.payloads)
    live = (ids >= 1) & (ids <= size)
    return list_match(cells, plist, ids, live, np.zeros_like(live), size)


def confident(m: RegistryMatch | None) -> bool:
    return m is not None and m.p_value < 0.01 and m.posterior >= 0.95


def test_vectorised_exhaustive_match_is_match_cells() -> None:
    """The service's exhaustive path (payload integers, cached) is the reference match."""
    rng = np.random.default_rng(11)
    for num_bits in [7, 16, 32]:
        codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
        size = min(2**num_bits - 1, 3000)
        payloads = codec.payload_ints(np.arange(1, size + 1))
        registry = [format(int(p), f"0{num_bits}b") for p in payloads]
        for delta in [0.05, 0.02, 0.0]:
            for _ in range(20):
                true = int(payloads[rng.integers(size)])
                ones, trials = simulated_cells(rng, true, num_bits, delta, 60)
                want = match_cells(ones, trials, registry, 5 * size)
                got = exhaustive_match(text_cells(ones, trials, num_bits), payloads, 5 * size)
                assert want is not None and got is not None
                assert got.index == want.index and got.bits == want.bits
                assert got.p_value == pytest.approx(want.p_value, rel=1e-12)
                assert got.posterior == pytest.approx(want.posterior, rel=1e-9, abs=1e-300)
                assert got.runner_up_index == want.runner_up_index


def test_list_path_gives_the_exhaustive_answer() -> None:
    """1 200 texts, from clean to ~8 bit errors in 24, in registries where the service
    uses the list: whenever the list finds the registry's ML entry provably (``exact``)
    it is the exhaustive match's entry with the same p-value; the list never makes a
    confident claim the exhaustive match does not make; and it misses few of the
    exhaustive match's confident answers."""
    rng = np.random.default_rng(36)
    num_bits = 24
    codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
    stats = {"exact": 0, "confident": 0, "missed": 0}
    for size in [4096, 65_536]:  # the densities of 1e6 and 1.7e7 entries at 32 bits
        assert use_list(num_bits, size)
        payloads = codec.payload_ints(np.arange(1, size + 1))
        for delta in [0.1, 0.06, 0.035, 0.0]:
            for _ in range(150):
                true = int(rng.integers(1, size + 1))
                ones, trials = simulated_cells(rng, int(payloads[true - 1]), num_bits, delta, 90)
                cells = text_cells(ones, trials, num_bits)
                ex = exhaustive_match(cells, payloads, size)
                found = lookup(codec, ones, trials, size)
                assert ex is not None
                if found is not None and found.exact:
                    stats["exact"] += 1
                    assert found.message_id == ex.index + 1
                    assert found.match.p_value == pytest.approx(ex.p_value, rel=1e-9)
                if confident(found.match if found else None):
                    assert found is not None and found.message_id == ex.index + 1
                    assert ex.posterior >= 0.5
                if confident(ex):
                    stats["confident"] += 1
                    stats["missed"] += found is None or found.message_id != ex.index + 1
    assert stats["exact"] > 400, stats
    assert stats["confident"] > 200, stats
    assert stats["missed"] <= 0.03 * stats["confident"], stats


def test_list_path_p_value_is_calibrated_on_null_text() -> None:
    """On unwatermarked text the registry-size Bonferroni p-value is conservative, on
    either path: P(p < alpha) <= alpha, and no confident claim."""
    rng = np.random.default_rng(3636)
    num_bits = 24  # a registry of a tenth of the payload space: many chance hits
    codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
    size = 2**num_bits // 10
    small = codec.payload_ints(np.arange(1, 2001))
    p_list, p_exhaustive = [], []
    for _ in range(1500):
        ones, trials = simulated_cells(rng, None, num_bits, 0.0, 90)
        found = lookup(codec, ones, trials, size)
        assert found is not None  # with 10% of payloads issued the list always hits
        assert not confident(found.match)
        p_list.append(found.match.p_value)
        ex = exhaustive_match(text_cells(ones, trials, num_bits), small)
        assert ex is not None
        p_exhaustive.append(ex.p_value)
    for p in (np.array(p_list), np.array(p_exhaustive)):
        for alpha in (0.05, 0.2, 0.5):
            assert (p < alpha).mean() <= alpha + 0.02


def test_contradiction_rules_out_an_unregistered_payload_and_rarely_the_true_entry() -> None:
    """The entry check (:func:`worldcup_core.decoder.contradicted`: the weakest cell,
    Bonferroni, at 1e-3, or all cells combined by Fisher at 1e-2). Validity: on the
    boundary of the true entry's hypothesis (cells exactly binomial, no push its way) it
    rules the entry out at most at 1e-3 + 1e-2, within 3 SE over 4 000 texts; with a
    watermark carrying the entry it never does. Power: a payload 9 of 32 bits away from
    the entry (the unregistered text issue 35's test found), its cells at bias 0.1 over
    about 240 g-bits (8 tokens of 30 layers), is ruled out in at least 90 % of 400 texts
    (measured 0.98), where the weakest cell alone catches about 0.83. Weaker texts stay
    a limit: at bias 0.12 over 90 g-bits the two catch 0.45 and 0.31 (SECURITY.md)."""
    from worldcup_core.decoder import contradicted
    from worldcup_core.scoring import log_binom_half_cdf

    rng = np.random.default_rng(35)
    num_bits, n = 32, 4000
    entry = 0x9E3779B9

    def check(payload: int | None, delta: float, per_cell: int) -> tuple[bool, bool]:
        ones, trials = simulated_cells(rng, payload, num_bits, delta, per_cell)
        bits = np.array([int(c) for c in format(entry, f"0{num_bits}b")], dtype=np.int64)
        flat = np.zeros(ones.size, dtype=np.int64)
        flat[:num_bits] = bits
        o, t = ones.ravel().astype(np.int64), trials.ravel().astype(np.int64)
        agree = np.where(bits == 0, o[:num_bits], t[:num_bits] - o[:num_bits])
        weakest = float(log_binom_half_cdf(agree, t[:num_bits]).min()) + np.log(num_bits)
        return contradicted(flat, o, t, num_bits), weakest < np.log(1e-3)

    boundary = sum(check(None, 0.0, 90)[0] for _ in range(n)) / n
    bound = 1e-3 + 1e-2
    assert boundary < bound + 3 * np.sqrt(bound * (1 - bound) / n), boundary
    assert not any(check(entry, 0.1, 90)[0] for _ in range(400))
    far = entry ^ sum(1 << b for b in rng.choice(num_bits, 9, replace=False).tolist())
    runs = [check(far, 0.1, 240) for _ in range(400)]
    combined, alone = (sum(r[i] for r in runs) / len(runs) for i in (0, 1))
    assert combined >= 0.9 and combined >= alone + 0.08, (combined, alone)


def test_weighted_posterior_is_bayes_with_the_weights() -> None:
    """A candidate's prior weight (:func:`worldcup_core.decoder.prior_logits`: a client
    payload's texts) enters the posterior as Bayes says, on both paths: exhaustively,
    ``posterior = w_best / sum_x w_x exp(beta (a_x - a_best))`` by brute force; by list,
    raising one listed competitor's weight from 1 to W adds exactly ``(W - 1) exp(-beta
    (c_j - c_best))`` to ``1 / posterior``, and weighing the best itself W divides the
    rest of ``1 / posterior - 1`` (the unseen entries' tail included) by W. Weights of 1
    change nothing, the best stays
    the likeliest candidate, and weights below 1 are refused."""
    from worldcup_core.decoder import llr_scale, prior_logits

    rng = np.random.default_rng(4545)
    num_bits = 24
    codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
    size = 3000
    payloads = codec.payload_ints(np.arange(1, size + 1))
    for _ in range(40):
        true = int(payloads[rng.integers(size)])
        ones, trials = simulated_cells(rng, true, num_bits, 0.06, 60)
        cells = text_cells(ones, trials, num_bits)
        weights = rng.choice([1.0, 3.0, 1000.0], size=size)
        plain = exhaustive_match(cells, payloads, size)
        got = exhaustive_match(cells, payloads, size, weights)
        assert plain is not None and got is not None
        assert exhaustive_match(cells, payloads, size, np.ones(size)) == plain
        assert got.index == plain.index and got.p_value == plain.p_value
        agreement = cells.agreement_max - np.rint(flip_costs(cells, payloads))
        beta = llr_scale(agreement[got.index] / cells.total - 0.5)
        mass = weights * np.exp(beta * (agreement - agreement[got.index]))
        want = weights[got.index] / mass.sum()
        if plain.posterior > 0:  # not contradicted
            assert got.posterior == pytest.approx(want, rel=1e-9)

    list_size = 65_536
    for _ in range(40):
        true = int(rng.integers(1, list_size + 1))
        ones, trials = simulated_cells(rng, int(codec.payload_ints([true])[0]), num_bits, 0.06, 60)
        cells = text_cells(ones, trials, num_bits)
        plist = payload_list(cells)
        ids = codec.message_id_ints(plist.payloads)
        live = (ids >= 1) & (ids <= list_size)
        if live.sum() < 2:
            continue
        none = np.zeros_like(live)
        first = list_match(cells, plist, ids, live, none, list_size)
        assert first is not None and first.match.posterior > 0
        rival = int(
            np.flatnonzero(live)[1]
            if first.match.index == np.flatnonzero(live)[0]
            else np.flatnonzero(live)[0]
        )
        for w in (1.0, 16.0, 1000.0):
            weights = np.ones(plist.payloads.size)
            weights[rival] = w
            found = list_match(cells, plist, ids, live, none, list_size, weights)
            assert found is not None and found.message_id == first.message_id
            a_best = cells.agreement_max - round(float(plist.costs[first.match.index]))
            beta = llr_scale(a_best / cells.total - 0.5)
            gap = float(plist.costs[rival] - plist.costs[first.match.index])
            want = 1 / first.match.posterior + (w - 1) * np.exp(-beta * gap)
            assert 1 / found.match.posterior == pytest.approx(want, rel=1e-9)
            # the best itself weighed w: every rival, the unseen entries' tail included,
            # counts 1 / w as much
            weights = np.ones(plist.payloads.size)
            weights[first.match.index] = w
            found = list_match(cells, plist, ids, live, none, list_size, weights)
            assert found is not None and found.message_id == first.message_id
            want = 1 + (1 / first.match.posterior - 1) / w
            assert 1 / found.match.posterior == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match=">= 1"):
        prior_logits(np.array([1.0, 0.5]), 0, 2)


def test_a_much_used_client_payload_keeps_its_damaged_copies_off_bystanders() -> None:
    """Issue #45: a stolen spoof carries a damaged copy of the attacker's chosen payload
    P (recorded as a candidate, unsealed), and with 2 000 entries one may lie nearer the
    copy than P does; named, it frames a bystander. Weighing P by its texts (1 000, as
    in the forgery run) keeps many such copies on P. 1 500 simulated copies: P's cells
    at bias 0.15 over ~60 g-bits, 16 of its 32 cells carrying nothing. Unweighted,
    138 of the copies (9.2 %) name a bystander at the watermarked level (p < 1e-6,
    posterior >= 0.95); weighted, 37 (2.5 %): the test asks for at most half. It is no
    exclusion: a copy that happens to fit an entry in every cell it kept is that
    entry's text as far as the cells tell. The weights cost the registry's own texts
    nothing: 600 genuine texts at bias 0.1 name their entry as often either way (597)."""
    rng = np.random.default_rng(45)
    num_bits, size, uses = 32, 2000, 1000.0
    codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
    payloads = codec.payload_ints(np.arange(1, size + 1))
    chosen = int(rng.integers(0, 2**num_bits))
    candidates = np.concatenate([payloads, np.array([chosen], dtype=np.uint64)])
    weighted = np.ones(candidates.size)
    weighted[-1] = uses

    def named(ones: np.ndarray, trials: np.ndarray, weights: np.ndarray | None) -> int | None:
        m = exhaustive_match(text_cells(ones, trials, num_bits), candidates, None, weights)
        ok = m is not None and m.p_value < 1e-6 and m.posterior >= 0.95
        return m.index if ok and m is not None else None

    framed = {"unweighted": 0, "weighted": 0}
    for _ in range(1500):
        ones, trials = simulated_cells(rng, chosen, num_bits, 0.15, 60)
        flat, t = ones.ravel(), trials.ravel()
        damaged = rng.choice(num_bits, 16, replace=False)
        flat[damaged] = rng.binomial(t[damaged], 0.5)
        ones = flat.reshape(ones.shape)
        for label, w in (("unweighted", None), ("weighted", weighted)):
            got = named(ones, trials, w)
            framed[label] += got is not None and got < size
    assert framed["unweighted"] >= 75, framed  # the failure is there to fix
    assert framed["weighted"] <= framed["unweighted"] / 2, framed

    genuine = {"unweighted": 0, "weighted": 0}
    for _ in range(600):
        entry = int(rng.integers(size))
        ones, trials = simulated_cells(rng, int(payloads[entry]), num_bits, 0.1, 60)
        for label, w in (("unweighted", None), ("weighted", weighted)):
            genuine[label] += named(ones, trials, w) == entry
    assert genuine["unweighted"] >= 400, genuine
    assert abs(genuine["weighted"] - genuine["unweighted"]) <= 3, genuine


def _weighted_text(
    rng: np.random.Generator, payload: int, num_bits: int, tokens: int, bias: float
) -> tuple[np.ndarray, np.ndarray, WeightedCells]:
    """A simulated model-weighted text (:class:`~worldcup_core.detector_model.WeightedCells`):
    ``tokens`` tokens, each at a level 1..LEVELS drawn uniformly, on a random position;
    each of its (group, layer) g-bits favours the payload's bit with probability
    ``1/2 + bias * level / LEVELS`` (the informative tokens carry more) and counts its
    layer weight at that level (:func:`~worldcup_core.detector_model.level_weights`)."""
    from worldcup_core.detector_model import LEVELS, level_weights

    layers, symbols = 3, num_bits // GROUPS
    bits = np.array([int(c) for c in format(payload, f"0{num_bits}b")]).reshape(symbols, GROUPS)
    level = rng.integers(1, LEVELS + 1, size=tokens)
    pos = rng.integers(0, symbols, size=tokens)
    w = level_weights(layers)[level]  # (n, layers)
    lean = np.where(bits[pos] == 0, 1.0, -1.0)  # (n, k): towards bit 0 or 1
    p = 0.5 + (bias * level / LEVELS)[:, None, None] * lean[:, :, None]
    g = rng.random((tokens, GROUPS, layers)) < p  # 1: favours bit 0
    score = np.zeros((symbols, GROUPS), dtype=np.int64)
    np.add.at(score, pos, (g * w[:, None, :]).sum(axis=2))
    ones = np.zeros((symbols, GROUPS), dtype=np.int64)
    np.add.at(ones, pos, g.sum(axis=2))
    trials = np.repeat(np.bincount(pos, minlength=symbols)[:, None] * layers, GROUPS, axis=1)
    mass = np.bincount(pos, weights=w.sum(axis=1), minlength=symbols).astype(np.int64)
    sumsq = np.bincount(pos, weights=(w * w).sum(axis=1), minlength=symbols).astype(np.int64)
    units = np.bincount(level, minlength=LEVELS + 1) * GROUPS
    return ones, trials, WeightedCells(score, mass, sumsq, units, layers)


def test_weighted_posterior_is_calibrated() -> None:
    """The posterior on model-weighted cells says how often the best entry is the text's
    own (``TextCells.llr_factor``: a weighted unit of agreement is worth ``sum M /
    sum W^2`` of a g-bit's log-likelihood ratio). 2 000 simulated weighted texts of 40
    tokens under one of 2 000 16-bit entries: where the posterior is at least 0.95 (366
    texts, mean 0.982) the best entry is the text's own 97.3 % of the time (the test
    asks 93 %), and from 0.5 to 0.95 (953 texts) 68.7 % against a mean posterior of
    0.733 (the test asks within 0.07). Counting each unit as a g-bit, as before, the
    posterior was at least 0.95 for 1 571 texts, mean 0.996, and right for 71.5 % of
    them (the test asks below 0.85, so that it fails if the factor is lost)."""
    from dataclasses import replace

    rng = np.random.default_rng(4547)
    num_bits, size = 16, 2000
    payloads = rng.choice(2**num_bits, size, replace=False).astype(np.uint64)
    said: dict[str, list[tuple[float, bool]]] = {"calibrated": [], "as g-bits": []}
    for _ in range(2000):
        true = int(rng.integers(size))
        ones, trials, weighted = _weighted_text(rng, int(payloads[true]), num_bits, 40, 0.3)
        for label, w in (
            ("calibrated", weighted),
            ("as g-bits", replace(weighted, sumsq=weighted.mass)),
        ):
            m = exhaustive_match(text_cells(ones, trials, num_bits, w), payloads, size)
            assert m is not None
            said[label].append((m.posterior, m.index == true))
    post, right = (np.array([s[i] for s in said["calibrated"]]) for i in (0, 1))
    sure = post >= 0.95
    assert sure.sum() >= 300 and right[sure].mean() >= 0.93, (sure.sum(), right[sure].mean())
    mid = (post >= 0.5) & ~sure
    assert mid.sum() >= 300 and abs(right[mid].mean() - post[mid].mean()) <= 0.07
    post, right = (np.array([s[i] for s in said["as g-bits"]]) for i in (0, 1))
    assert right[post >= 0.95].mean() < 0.85


def test_decoded_alternatives_weigh_a_weighted_unit_as_the_posterior_does() -> None:
    """The decoder's list of alternatives (``decode_cells``) scales its log-likelihood
    ratios as the registry posterior does: with the cells' variance given (``scale``,
    weighted cells' ``sum W^2``) at k times their mass, every ratio is 1/k of the unit
    g-bits' one, and with ``scale`` equal to the mass nothing changes."""
    from worldcup_core.decoder import decode_cells
    from worldcup_core.detector import DetectionResult

    rng = np.random.default_rng(4549)
    ones, trials = simulated_cells(rng, 0xBEEF, 16, 0.08, 40)
    det = DetectionResult(0.5, -0.3, 0.0, 0.0, False, 0.01, 100, 100, 8)
    counts = trials[:, 0][None] // 3

    def llrs(scale: np.ndarray | None) -> np.ndarray:
        result = decode_cells(ones[None], trials[None], counts, 16, [det], 32, scale=scale)[0]
        return np.array([a.log_likelihood_ratio for a in result.alternatives])

    plain = llrs(None)
    assert plain.size == 32 and plain[1:].max() < 0
    assert np.array_equal(llrs(trials[None]), plain)
    assert llrs(5 * trials[None]) == pytest.approx(plain / 5, rel=1e-12)
