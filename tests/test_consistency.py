"""worldcup_core.consistency: the agreement gate against stolen-watermark spoofs.

``z`` is checked against its definition (pairwise products within cells), for its null
law when signs are fair coins given the magnitudes, and the gate on two synthetic texts
built without a model: a *spread* text whose every token is the candidate with the most
extreme g-values in either direction (what a stealing learner without payloads writes,
in its pure form), which the ungated tests call watermarked, and a *consistent* text
whose tokens lean towards their cell's bit (what the watermark writes), which the gate
leaves alone.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from worldcup_core import WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.config import SERVICE_PRESET, WATERMARK_PRESETS
from worldcup_core.consistency import (
    AGREEMENT_Z_MIN,
    GATED_LOG_P,
    agreement_z,
    gate_log_p,
    pooled_z,
)
from worldcup_core.detector import slot_count
from worldcup_core.detector_model import (
    agreement_z_many,
    entry_units,
    level_weights,
    sign_upper_log_sf,
)
from worldcup_core.detector_weighted import (
    entry_log_p,
    registry_verdict_log_p,
    verdict_log_p,
    weighted_log_p_many,
)
from worldcup_core.prf import PRFV2, SCHEME_V2, gvalue_words, v2_group_bits, v2_gwords, v2_positions
from worldcup_core.scoring import symbol_index

PRESET = WATERMARK_PRESETS[SERVICE_PRESET]
CONFIG = WatermarkConfig(groups=PRESET.groups, layers=PRESET.layers, alpha=PRESET.alpha)


def _brute_z(cells: list[list[float]]) -> float:
    u = sum(c[i] * c[j] for c in cells for i in range(len(c)) for j in range(i + 1, len(c)))
    v = sum(
        c[i] ** 2 * c[j] ** 2 for c in cells for i in range(len(c)) for j in range(i + 1, len(c))
    )
    return u / math.sqrt(v) if v else 0.0


def test_z_is_the_standardised_sum_of_pairwise_products() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        cells = [
            list(rng.integers(-9, 10, size=rng.integers(0, 6)).astype(float)) for _ in range(7)
        ]
        width = max(len(c) for c in cells) or 1
        sums = np.array([[sum(c) for c in cells]])
        dsq = np.array([[sum(x * x for x in c) for c in cells]])
        dquad = np.array([[sum(x**4 for x in c) for c in cells]])
        assert width >= 1
        assert agreement_z(sums, dsq, dquad)[0] == pytest.approx(_brute_z(cells), abs=1e-9)
        assert pooled_z(sums, dsq, dquad) == pytest.approx(_brute_z(cells), abs=1e-9)


def test_z_is_standard_when_signs_are_fair_coins_given_magnitudes() -> None:
    """The spoof's and the unwatermarked text's law: mean 0, variance 1, whatever the
    magnitudes (heavy, uneven ones here)."""
    rng = np.random.default_rng(2)
    mags = rng.integers(1, 60, size=(64, 3)).astype(float)  # 64 cells of 3 tokens
    zs = []
    for _ in range(4000):
        d = mags * rng.choice([-1.0, 1.0], size=mags.shape)
        zs.append(
            agreement_z(d.sum(axis=1)[None], (d**2).sum(axis=1)[None], (d**4).sum(axis=1)[None])[0]
        )
    z = np.asarray(zs)
    assert abs(z.mean()) < 0.06 and 0.9 < z.std() < 1.1
    assert np.mean(z >= AGREEMENT_Z_MIN) < 2 * (1 - _phi(AGREEMENT_Z_MIN)) + 0.01


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def test_the_gate_only_raises_p_values_below_the_verdicts_level() -> None:
    log_p = np.log(np.array([1e-9, 1e-9, 1e-3, 0.5]))
    z = np.array([AGREEMENT_Z_MIN - 0.1, AGREEMENT_Z_MIN, -5.0, -5.0])
    out = gate_log_p(log_p, z)
    assert out[0] == GATED_LOG_P and out[1] == log_p[1]
    assert out[2] == log_p[2] and out[3] == log_p[3]
    assert np.all(out >= log_p)


def _synthetic(key: WatermarkKey, length: int, seed: int, spread: bool) -> list[int]:
    """A text of ``length`` tokens over a 5 000-token vocabulary, each token the best of
    40 random candidates: by ``|d|`` (spread: extreme in either direction, as stolen
    counts without payloads favour) or by ``d`` towards its slot's bit (consistent: a
    random payload, as the watermark writes)."""
    rng = np.random.default_rng(seed)
    prf = PRFV2.of(key)
    k, m = CONFIG.groups, CONFIG.layers
    w = level_weights(m)[4]
    signs = rng.choice([-1, 1], size=slot_count(CONFIG))
    ids = [int(x) for x in rng.integers(0, 5000, size=2)]
    seen: set[tuple[int, int]] = set()
    while len(ids) < length:
        ctx = (ids[-2], ids[-1])
        cand = rng.integers(0, 5000, size=40).astype(np.uint64)
        if ctx in seen:  # a repeated context is scored once: any token will do
            ids.append(int(cand[0]))
            continue
        seen.add(ctx)
        context = [np.full(40, ctx[0], dtype=np.uint64), np.full(40, ctx[1], dtype=np.uint64)]
        bits = np.asarray(
            v2_group_bits(v2_gwords(prf.gvalue_key, context, cand, gvalue_words(k, m)), k, m)
        )[:, 0, :].astype(np.int64)
        d = (2 * bits - 1) @ w
        slot = symbol_index(
            v2_positions(prf.position_key, [c[:1] for c in context]), len(signs), SCHEME_V2
        )
        score = np.abs(d) if spread else d * signs[int(slot[0])]
        ids.append(int(cand[int(np.argmax(score))]))
    return ids


@pytest.fixture(scope="module")
def scheme() -> WorldCup:
    return WorldCup(WatermarkKey(b"consistency-test-key-0123456789a"), CONFIG)


def test_the_gate_stops_spread_texts_and_keeps_consistent_ones(scheme: WorldCup) -> None:
    n = 12
    spread = [_synthetic(scheme.key, 96, s, spread=True) for s in range(n)]
    consistent = [_synthetic(scheme.key, 96, 100 + s, spread=False) for s in range(n)]
    raw_spread = weighted_log_p_many(scheme.key, CONFIG, spread, None)
    raw_consistent = weighted_log_p_many(scheme.key, CONFIG, consistent, None)
    # the over-dispersion alone fools the ungated two-sided test ...
    assert np.all(raw_spread < GATED_LOG_P)
    assert np.all(raw_consistent < GATED_LOG_P)
    # ... and not the gate: z is centred where signs are fair coins, large where they agree
    z_spread = agreement_z_many(scheme.key, CONFIG, spread, None)
    z_consistent = agreement_z_many(scheme.key, CONFIG, consistent, None)
    assert abs(float(np.mean(z_spread))) < 1.0 and np.all(z_consistent > 4.0)
    gated_spread = verdict_log_p(scheme, spread, None)
    assert np.sum(gated_spread < GATED_LOG_P) <= 1
    np.testing.assert_array_equal(verdict_log_p(scheme, consistent, None), raw_consistent)
    # at a payload length and in the registry test, each in its own positions
    assert np.sum(verdict_log_p(scheme, spread, 32) < GATED_LOG_P) <= 1
    entry = "".join(str(int(b)) for b in np.random.default_rng(5).integers(0, 2, 32))
    reg = [registry_verdict_log_p(scheme, t, entry, 1) for t in spread]
    assert sum(lp is not None and lp < GATED_LOG_P for lp in reg) <= 1


def test_the_gate_keeps_model_weighted_p_values_of_consistent_text(scheme: WorldCup) -> None:
    consistent = [_synthetic(scheme.key, 96, 200 + s, spread=False) for s in range(4)]
    weights = [np.full(len(t), 0.6) for t in consistent]
    z = agreement_z_many(scheme.key, CONFIG, consistent, None, weights)
    assert np.all(z > AGREEMENT_Z_MIN)
    from worldcup_core.detector_model import model_log_p_many

    raw = model_log_p_many(scheme.key, CONFIG, consistent, None, weights)
    np.testing.assert_array_equal(verdict_log_p(scheme, consistent, None, weights), raw)


def test_z_is_computed_only_where_the_gate_can_act(
    scheme: WorldCup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model-free verdict computes ``z`` (a second pass over the tokens) only for the
    texts below the verdict's level, and answers as the gate applied to every text."""
    import worldcup_core.detector_model as dm

    rng = np.random.default_rng(9)
    plain = [[int(x) for x in rng.integers(0, 5000, size=96)] for _ in range(6)]
    spread = [_synthetic(scheme.key, 96, 300 + s, spread=True) for s in range(3)]
    consistent = [_synthetic(scheme.key, 96, 400 + s, spread=False) for s in range(3)]
    texts = plain + spread + consistent
    raw = weighted_log_p_many(scheme.key, CONFIG, texts, None)
    eager = gate_log_p(raw, agreement_z_many(scheme.key, CONFIG, texts, None))
    below = int(np.sum(raw < GATED_LOG_P))
    assert 0 < below < len(texts)  # both kinds, or the test shows nothing
    seen: list[int] = []
    real = dm.agreement_z_many

    def counting(*args: object, **kwargs: object) -> npt.NDArray[np.float64]:
        seen.append(len(args[2]))  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dm, "agreement_z_many", counting)
    np.testing.assert_array_equal(verdict_log_p(scheme, texts, None), eager)
    assert seen == [below]
    seen.clear()
    above = [t for t, lp in zip(texts, raw, strict=True) if lp >= GATED_LOG_P]
    entry = "".join(str(int(b)) for b in rng.integers(0, 2, 32))
    for t in above:  # an entry test above the level: no z at all
        registry_verdict_log_p(scheme, t, entry, 1)
    assert seen == []


def test_a_capped_test_reads_as_no_agreement(scheme: WorldCup) -> None:
    """The answer says why: ``reason: "no_agreement"``, no ``tokens_needed``, no entry."""
    from worldcup_core.assess import TestP, assess

    spread = next(
        t
        for t in (_synthetic(scheme.key, 96, s, spread=True) for s in range(20))
        if verdict_log_p(scheme, [t], None)[0] == GATED_LOG_P
    )
    detect = math.exp(float(verdict_log_p(scheme, [spread], None)[0]))
    decode = math.exp(float(verdict_log_p(scheme, [spread], 32)[0]))
    entry = "".join(str(int(b)) for b in np.random.default_rng(6).integers(0, 2, 32))
    registry = registry_verdict_log_p(scheme, spread, entry, 1000)
    assert registry is not None
    tests = [
        TestP("detect", detect),
        TestP("decode", decode, 32),
        TestP("registry", math.exp(registry), 32, 1000),
    ]
    said = assess(tests, 1, "one key", 94)
    assert said.verdict == "inconclusive" and said.reason == "no_agreement"
    assert said.tokens_needed is None and not said.may_name_entry
    # an ordinary inconclusive answer keeps its reason
    plain = assess([TestP("detect", 1e-4), TestP("decode", 1e-3, 32)], 1, "one key", 94)
    assert plain.reason == "some_evidence"


def test_the_study_judges_ungated_then_at_each_line_and_restores_the_line() -> None:
    import worldcup_core.consistency as consistency
    from worldcup_eval.agreement_study import judge_at_lines

    class _Judge:  # watermarked while the line is below 1.8 (what the study varies)
        def judge(self, texts: list[str]) -> list[dict[str, object]]:
            wm = consistency.AGREEMENT_Z_MIN < 1.8
            return [{"watermarked": wm, "named": 7 if wm else None} for _ in texts]

    rows = judge_at_lines({"j": _Judge()}, ["a", "b"], [1.5, 2.0])  # type: ignore[dict-item]
    assert rows[0] == {
        "j/raw": True,
        "j/raw/named": True,
        "j/1.5": True,
        "j/1.5/named": True,
        "j/2": False,
        "j/2/named": False,
    }
    assert consistency.AGREEMENT_Z_MIN == AGREEMENT_Z_MIN
    assert consistency.SIGN_GATE_LEVEL == 1e-2


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--run", "/nonexistent"],
        ["--genuine", "/nonexistent"],
        ["--run", "RUN", "--tokens", "0"],
    ],
)
def test_the_study_answers_bad_input_with_a_usage_error(
    args: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worldcup_eval.agreement_study import main

    monkeypatch.chdir(tmp_path)  # nothing it might write lands in the checkout
    (tmp_path / "RUN").mkdir()
    # a run folder, so that only --tokens is wrong in the last case
    (tmp_path / "RUN" / "spoofs-200000.jsonl").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


# ------------------------------------------------------------------ the sign-conditional entry test


def test_the_sign_tail_is_the_enumerated_law() -> None:
    rng = np.random.default_rng(11)
    for _ in range(30):
        units = rng.integers(-9, 10, size=int(rng.integers(1, 11)))
        observed = int(units.sum())
        mags = np.abs(units)
        total = sum(
            int(np.dot(mags, signs)) >= observed
            for signs in itertools.product((-1, 1), repeat=len(units))
        )
        expected = total / 2 ** len(units)
        assert math.isclose(math.exp(sign_upper_log_sf(units)), expected, rel_tol=1e-9)
    assert sign_upper_log_sf(np.zeros(4, dtype=np.int64)) == 0.0
    # deep: 200 units of 7 all agreeing is 2^-200
    assert math.isclose(sign_upper_log_sf(np.full(200, 7)), -200 * math.log(2), rel_tol=1e-9)


@pytest.mark.parametrize("weighted", [False, True])
def test_entry_units_sum_to_the_registry_tests_agreement(scheme: WorldCup, weighted: bool) -> None:
    from worldcup_core.detector_model import model_cells, weighted_cells_of

    rng = np.random.default_rng(12)
    for _ in range(5):
        ids = [int(x) for x in rng.integers(0, 5000, size=90)]
        w = rng.random(len(ids)) if weighted else np.full(len(ids), np.nan)
        bits = "".join(rng.choice(["0", "1"], 32))
        units = entry_units(scheme.key, CONFIG, ids, bits, w if weighted else None)
        cells = model_cells(scheme.key, CONFIG, [ids], CONFIG.symbols_for(32), [w])
        wc = weighted_cells_of(cells, 0)
        masses = wc.total  # k * sum of every scored token's weight mass
        assert (int(units.sum()) + masses) // 2 == wc.agreement(bits)
        assert (int(units.sum()) + masses) % 2 == 0


def test_the_sign_test_holds_its_level_on_null_and_on_spread_text(scheme: WorldCup) -> None:
    """On unwatermarked text both entry tests hold their level. On spread text (every
    token the most extreme of 40 in either direction: a payload-free spoof) the exact
    test over-rejects a random entry, the sign-conditional one does not."""
    rng = np.random.default_rng(13)
    entries = ["".join(rng.choice(["0", "1"], 32)) for _ in range(25)]
    spread = [_synthetic(scheme.key, 96, 500 + s, spread=True) for s in range(16)]
    plain = [[int(x) for x in rng.integers(0, 5000, size=96)] for _ in range(16)]
    found: dict[str, list[float]] = {"spread/exact": [], "spread/sign": [], "plain/sign": []}
    for kind, texts in (("spread", spread), ("plain", plain)):
        for t in texts:
            for bits in entries:
                sign = math.exp(sign_upper_log_sf(entry_units(scheme.key, CONFIG, t, bits)))
                found[f"{kind}/sign"].append(sign)
                if kind == "spread":
                    exact = math.exp(entry_log_p(scheme.key, CONFIG, t, bits))
                    found["spread/exact"].append(exact)
    n = len(entries) * 16
    level = 0.01
    bound = level + 4 * math.sqrt(level * (1 - level) / n)
    # entries of one text share its magnitudes, so rates are compared with room to spare
    assert np.mean(np.array(found["spread/exact"]) < level) > 3 * bound
    assert np.mean(np.array(found["spread/sign"]) < level) <= bound
    assert np.mean(np.array(found["plain/sign"]) < level) <= bound


def test_the_sign_test_keeps_a_consistent_texts_entry(scheme: WorldCup) -> None:
    """Genuine-like text (every token leaning to its cell's bit of the issued entry) is
    far below the verdict's level under the sign-conditional test as well."""
    from worldcup_core import Payload

    rng = np.random.default_rng(14)
    for _ in range(4):
        bits = "".join(rng.choice(["0", "1"], 32))
        seq = scheme.sequence(Payload.from_bits(bits))
        for _ in range(128):
            cand = rng.choice(5000, 20, replace=False)
            probs = rng.dirichlet(np.full(20, 0.5))
            seq.observe(int(cand[rng.choice(20, p=seq.reweight(cand, probs))]))
        ids = list(seq.generated)
        exact = entry_log_p(scheme.key, CONFIG, ids, bits)
        sign = sign_upper_log_sf(entry_units(scheme.key, CONFIG, ids, bits))
        assert exact < GATED_LOG_P and sign < GATED_LOG_P, (exact, sign)


@pytest.mark.parametrize(
    "args", [[], ["--genuine", "/nonexistent"], ["--genuine", "G", "--sizes", "0"]]
)
def test_the_entry_sign_study_answers_bad_input_with_a_usage_error(
    args: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worldcup_eval.entry_sign_study import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "G").mkdir()
    (tmp_path / "G" / "answers.jsonl").write_text("")  # a folder of answers: only --sizes is wrong
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_the_sign_gate_stops_spread_text_naming_an_entry(
    scheme: WorldCup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the z gate off, spread text names one of 60 random entries (corrected for the
    60) in some texts; the sign gate, which bounds that at 1 % whatever the spread, in
    none. A genuine-like text keeps its registry p bit for bit."""
    import worldcup_core.consistency as consistency
    from worldcup_core import Payload

    monkeypatch.setattr(consistency, "AGREEMENT_Z_MIN", -math.inf)
    rng = np.random.default_rng(21)
    size = 60
    ungated = gated = 0
    for s in range(16):
        text = _synthetic(scheme.key, 96, 700 + s, spread=True)
        entries = ["".join(rng.choice(["0", "1"], 32)) for _ in range(size)]
        exact = [entry_log_p(scheme.key, CONFIG, text, b) + math.log(size) for b in entries]
        ungated += min(exact) < GATED_LOG_P
        verdicts = [registry_verdict_log_p(scheme, text, b, size) for b in entries]
        gated += any(v is not None and v < GATED_LOG_P for v in verdicts)
    assert ungated >= 2 and gated == 0, (ungated, gated)
    bits = "".join(rng.choice(["0", "1"], 32))
    seq = scheme.sequence(Payload.from_bits(bits))
    for _ in range(128):
        cand = rng.choice(5000, 20, replace=False)
        seq.observe(int(cand[rng.choice(20, p=seq.reweight(cand, rng.dirichlet(np.ones(20))))]))
    ids = list(seq.generated)
    kept = registry_verdict_log_p(scheme, ids, bits, 10**5)
    assert kept == min(entry_log_p(scheme.key, CONFIG, ids, bits) + math.log(10**5), 0.0)
    assert kept < GATED_LOG_P
