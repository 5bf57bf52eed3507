"""Model-assisted detection (issue #44): token weights from the model, exact weighted tests.

The cell law is checked against brute-force enumeration, the chi-square helpers and
the registry tail against scipy and direct convolution, the p-values for uniformity
on null text under many random keys with random weights (Fisher and Lancaster, the
message-free test, the known-length test and the registry test), ``None`` weights
against today's statistic bit for bit, the weighted registry match on simulated
watermarked texts (it names the issued entry, the list path as the exhaustive one),
and the batched torch helper against the numpy function on one text's logits.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.config import SERVICE_PRESET, WATERMARK_PRESETS, SamplingConfig
from worldcup_core.detector_model import (
    LEVELS,
    CellLaws,
    chi2_isf_log,
    chi2_log_sf,
    level_weights,
    mixed_upper_log_sf,
    model_decode_many,
    model_entry_log_p,
    model_log_p_many,
    model_text_cells,
    token_levels,
)
from worldcup_core.detector_weighted import (
    layer_weights,
    verdict_decode_many,
    verdict_log_p,
    verdict_match,
    verdict_text_cells,
    weighted_log_p_many,
)
from worldcup_core.registry_lookup import exhaustive_match, list_match, payload_list, text_cells
from worldcup_core.token_weights import (
    informativeness,
    ngram_bans,
    token_weights_from_logits,
    token_weights_from_top,
)

PRESET = WATERMARK_PRESETS[SERVICE_PRESET]
CONFIG = WatermarkConfig(groups=PRESET.groups, layers=PRESET.layers, alpha=PRESET.alpha)
PAPER = WatermarkConfig()  # k = 2: two groups per cell


def _random_weights(rng: np.random.Generator, n: int) -> np.ndarray:
    """Weights as a model gives them: many near 0 (forced tokens), some NaN (no row)."""
    w = rng.beta(0.6, 0.8, size=n)
    w[rng.random(n) < 0.2] = 0.0
    w[:1] = np.nan
    return w


def test_levels_and_level_weights() -> None:
    table = level_weights(30)
    assert np.array_equal(table[4], layer_weights(30))  # level 4: today's weights
    assert not table[0].any() and table.shape == (LEVELS + 1, 30)
    assert np.all(np.diff(table, axis=0) >= 0)
    a = np.array([0.0, 0.04, 0.05, 1 / 3, 1.0, np.nan, 1.5, -0.2])
    assert token_levels(a, power=1.0).tolist() == [0, 0, 1, 4, 12, 4, 12, 0]
    assert token_levels(a).tolist() == [0, 0, 0, 2, 12, 4, 12, 0]  # a^1.5


@pytest.mark.parametrize("levels", [(4,), (2, 7), (1, 5, 12), (3, 3)])
def test_cell_tails_match_brute_force(levels: tuple[int, ...]) -> None:
    laws = CellLaws(layers=3)
    w = laws.weights[list(levels)]  # (tokens, layers)
    values = np.array(
        [
            int((w * np.array(g).reshape(w.shape)).sum())
            for g in itertools.product((0, 1), repeat=w.size)
        ]
    )
    total = int(w.sum())
    law = np.bincount(values, minlength=total + 1) / len(values)
    strict, equal, at_least = laws.tails(tuple(sorted(levels)))
    for s in range(total + 1):
        d = abs(s - total / 2)
        dev = np.abs(np.arange(total + 1) - total / 2)
        want_strict, want_equal = law[dev > d + 1e-9].sum(), law[np.abs(dev - d) < 1e-9].sum()
        assert math.isclose(math.exp(strict[s]), want_strict, abs_tol=1e-12) or want_strict == 0
        assert math.isclose(math.exp(equal[s]), want_equal, rel_tol=1e-9)
        assert math.isclose(math.exp(at_least[s]), want_strict + want_equal, rel_tol=1e-9)


def test_chi2_helpers_are_exact_in_the_bulk_and_finite_in_the_tail() -> None:
    x = np.array([0.1, 1.0, 5.0, 20.0, 80.0])
    for df in range(1, 9):
        np.testing.assert_allclose(chi2_log_sf(x, df), stats.chi2.logsf(x, df), rtol=1e-10)
        deep = chi2_log_sf(np.array([3000.0]), df)[0]
        assert -1600 < deep < -1400
        log_p = np.log(np.array([0.5, 1e-5, 1e-100, 1e-300]))
        back = chi2_log_sf(chi2_isf_log(log_p, df), df)
        np.testing.assert_allclose(back, log_p, rtol=1e-9)
    assert np.array_equal(chi2_isf_log(np.log([0.3]), 2), -2 * np.log([0.3]))


def test_registry_tail_is_the_direct_convolution_at_every_depth() -> None:
    laws = CellLaws(layers=30)
    for units in ([0, 0, 0, 0, 5], [3, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 20], [0] * 12 + [40]):
        counts = np.array(units + [0] * (LEVELS + 1 - len(units)))
        exact = np.array([1.0])
        for lv, c in enumerate(counts.tolist()):
            for _ in range(c):
                exact = np.convolve(exact, laws.token_laws[lv])
        top = len(exact) - 1
        for frac in (0.0, 0.5, 0.55, 0.7, 0.85, 1.0):
            a = round(frac * top)
            want = float(exact[a:].sum())
            got = mixed_upper_log_sf(laws.token_laws, counts.tolist(), a)
            if want < 1e-290:
                assert got < math.log(1e-280)
            else:
                assert math.isclose(got, math.log(want), rel_tol=1e-8, abs_tol=1e-9), (units, a)


def test_no_weights_is_todays_statistic_and_other_versions_ignore_weights() -> None:
    rng = np.random.default_rng(1)
    texts = [rng.integers(0, 49152, size=int(n)).tolist() for n in rng.integers(5, 200, size=12)]
    texts.append(np.repeat(rng.integers(0, 30, size=20), 6).tolist())
    key = WatermarkKey(rng.bytes(32))
    for config in (CONFIG, PAPER):
        scheme = WorldCup(key, config)
        for bits in (None, 32):
            today = weighted_log_p_many(key, config, texts, bits)
            assert np.array_equal(verdict_log_p(scheme, texts, bits, None), today)
            # every token at a third (or unknown): today's weights, and Fisher is today's test
            for fill in (1 / 3, np.nan):
                w = [np.full(len(t), fill) for t in texts]
                fisher = model_log_p_many(key, config, texts, bits, w, "fisher", power=1.0)
                np.testing.assert_allclose(fisher, today, rtol=1e-12, atol=1e-12)
    v1 = WorldCup(key, WatermarkConfig(version="worldcup-v1"))
    weights = [_random_weights(rng, len(t)) for t in texts]
    ref = np.array([r.log10_p_value for r in v1.detect_many(texts, 16)]) * math.log(10)
    np.testing.assert_allclose(verdict_log_p(v1, texts, 16, weights), ref)
    with pytest.raises(ValueError, match="weight arrays"):
        model_log_p_many(key, CONFIG, texts, None, weights[:-1])
    # decoding and registry cells: today's path without weights or under v1
    for scheme, w in ((v1, weights), (WorldCup(key, CONFIG), None)):
        ref = scheme.decode_many(texts, 32)
        got = verdict_decode_many(scheme, texts, 32, w)
        assert [d.bits for d in got] == [d.bits for d in ref]
        assert [d.bit_p_values for d in got] == [d.bit_p_values for d in ref]
        cells = verdict_text_cells(scheme, texts[0], 32, None if w is None else w[0])
        assert cells.weighted is None
    v2 = WorldCup(key, CONFIG)
    got = verdict_decode_many(v2, texts, 32, weights)
    want = model_decode_many(key, CONFIG, texts, 32, weights)
    assert [d.bits for d in got] == [d.bits for d in want]
    assert verdict_text_cells(v2, texts[0], 32, weights[0]).weighted is not None


def test_null_p_values_are_uniform_under_random_keys_and_weights() -> None:
    """Random text and model-like random weights (forced tokens, unknown rows, repeated
    contexts) under 80 random keys: every test's p is uniform (KS) and its rate below
    1e-2 within 4 SE; the registry test of a fixed entry is super-uniform and not dead."""
    rng = np.random.default_rng(2)
    found: dict[str, list[float]] = {"fisher": [], "lancaster": [], "entry": []}
    for _ in range(80):
        key = WatermarkKey(rng.bytes(32))
        config = CONFIG if rng.random() < 0.75 else PAPER
        texts = [rng.integers(0, 49152, size=int(rng.integers(20, 160))).tolist() for _ in range(5)]
        texts.append(np.repeat(rng.integers(0, 40, size=16), 8).tolist())
        weights = [_random_weights(rng, len(t)) for t in texts]
        for combiner in ("fisher", "lancaster"):
            for bits in (None, 32):
                log_p = model_log_p_many(key, config, texts, bits, weights, combiner)
                found[combiner].extend(np.exp(log_p).tolist())
        bits_str = "".join(rng.choice(["0", "1"], 32))
        for t, w in zip(texts[:3], weights[:3], strict=True):
            found["entry"].append(math.exp(model_entry_log_p(key, config, t, bits_str, w)))
    for name in ("fisher", "lancaster"):
        p = np.array(found[name])
        assert stats.kstest(p, "uniform").pvalue > 1e-3, name
        assert abs(np.mean(p < 0.01) - 0.01) <= 4 * math.sqrt(0.01 * 0.99 / p.size), name
    entry = np.array(found["entry"])
    for t in (0.1, 0.01):
        assert np.mean(entry < t) <= t + 4 * math.sqrt(t / entry.size)
    assert np.mean(entry < 0.1) >= 0.06


def _watermarked(
    rng: np.random.Generator, scheme: WorldCup, bits: str, n: int = 128
) -> tuple[list[int], np.ndarray]:
    """A simulated watermarked text with T 0.7-like next-token laws (a third of them
    near-deterministic) and each token's informativeness from its true law."""
    seq = scheme.sequence(Payload.from_bits(bits))
    weights = []
    for _ in range(n):
        concentration = 0.01 if rng.random() < 0.35 else 0.3
        probs = rng.dirichlet(np.full(50, concentration))
        probs = np.sort(probs)[::-1]
        keep = np.cumsum(probs) - probs < 0.95
        probs = probs[keep] / probs[keep].sum()
        cand = rng.choice(49000, probs.size, replace=False)
        weights.append(float(informativeness(probs)))
        seq.observe(int(cand[rng.choice(probs.size, p=seq.reweight(cand, probs))]))
    return list(seq.generated), np.array(weights)


def test_weights_add_power_and_name_the_issued_entry() -> None:
    """On simulated watermarked texts the model statistic beats today's on most texts,
    the weighted decoder reads the payload at least as well, and the weighted registry
    match names the issued entry among 2 000 (the list path gives the exhaustive
    answer; the service's rescoring gives the same p)."""
    rng = np.random.default_rng(3)
    gains, acc_old, acc_new, named = [], [], [], 0
    trials = 10
    for _ in range(trials):
        scheme = WorldCup(WatermarkKey(rng.bytes(32)), CONFIG)
        bits = "".join(rng.choice(["0", "1"], 32))
        ids, w = _watermarked(rng, scheme, bits)
        today = float(weighted_log_p_many(scheme.key, CONFIG, [ids], None)[0])
        model = float(model_log_p_many(scheme.key, CONFIG, [ids], None, [w])[0])
        gains.append(today - model)
        acc_old.append(
            np.mean([a == b for a, b in zip(scheme.decode(ids, 32).bits, bits, strict=True)])
        )
        decoded = model_decode_many(scheme.key, CONFIG, [ids], 32, [w])[0]
        acc_new.append(np.mean([a == b for a, b in zip(decoded.bits, bits, strict=True)]))
        ones, trials_c, weighted = model_text_cells(scheme.key, CONFIG, ids, 32, w)
        cells = text_cells(ones, trials_c, 32, weighted)
        issued = np.uint64(int(bits, 2))
        registry = np.unique(rng.integers(0, 2**32, size=2000, dtype=np.uint64))
        registry = np.concatenate([registry[registry != issued][:1999], [issued]])
        match = exhaustive_match(cells, registry, registry_size=len(registry))
        assert match is not None
        if match.bits == bits and match.p_value < 1e-3:
            named += 1
            again = verdict_match(scheme, ids, match, len(registry), w)
            assert math.isclose(again.log10_p_value, match.log10_p_value, rel_tol=1e-9)
        plist = payload_list(cells)
        live = np.isin(plist.payloads, registry)
        found = list_match(cells, plist, plist.payloads, live, np.zeros_like(live), len(registry))
        if found is not None and found.exact:
            assert found.match.bits == match.bits
            assert math.isclose(found.match.p_value, match.p_value, rel_tol=1e-9)
    assert np.median(gains) > 0.5 and np.mean(np.array(gains) > 0) >= 0.7, gains
    assert np.mean(acc_new) >= np.mean(acc_old) - 0.01, (acc_new, acc_old)
    assert named >= trials - 2, named


def _tiny_lm(vocab: int = 300) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than at init, so filtering matters
        model.lm_head.weight.mul_(40.0)
    return model.eval()


def test_batched_model_weights_are_the_numpy_function_on_each_text() -> None:
    from worldcup_core.model_weights import model_token_weights

    torch.set_num_threads(1)
    model = _tiny_lm()
    rng = np.random.default_rng(4)
    loop = [5, 6, 7, 8, 9]
    texts = [
        rng.integers(0, 300, size=40).tolist(),
        (loop * 6)[:27],  # repeated 4-grams: the bans matter
        rng.integers(0, 300, size=3).tolist(),
    ]
    sampling = SamplingConfig(temperature=0.7, top_k=50, top_p=0.95, no_repeat_ngram_size=4)
    for prefix in ([], [1, 2, 3]):
        got = model_token_weights(model, texts, sampling, prefix, batch_size=2, chunk=16)
        for text, w in zip(texts, got, strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([prefix + text])).logits[0].numpy()
            first = 0 if prefix else 1
            rows = logits[len(prefix) - 1 + first : len(prefix) + len(text) - 1]
            want = token_weights_from_logits(rows, text, sampling, first)
            assert w.shape == (len(text),)
            np.testing.assert_allclose(w, want, atol=1e-5, equal_nan=True)
            assert np.isnan(w[0]) == (not prefix)
    banned = model_token_weights(model, [texts[1]], sampling)[0]
    free = model_token_weights(model, [texts[1]], SamplingConfig(temperature=0.7))[0]
    assert not np.allclose(banned[8:], free[8:])


def test_weights_from_the_top_rows_are_the_full_rows_weights() -> None:
    """vLLM's prompt log-probs (each position's top N, issue #44): the top 64 of every
    row give the full rows' weights (bans included), a top 5 does not, and positions
    without a row (or whose whole row is banned) are NaN."""
    rng = np.random.default_rng(7)
    vocab = 1000
    loop = [11, 12, 13, 14, 15, 16]
    text = [int(t) for t in rng.integers(0, vocab, size=10)] + loop * 4 + [3, 4]
    sampling = SamplingConfig(temperature=0.7, top_k=50, top_p=0.95, no_repeat_ngram_size=4)
    logits = rng.normal(size=(len(text) - 1, vocab)) * 3.0
    bans = ngram_bans(text, 4)
    banned_rows = [i for i in range(len(logits)) if bans[i + 1]]
    assert len(banned_rows) > 10
    for i in banned_rows:  # the banned ids lead their rows: the bans change a_t
        logits[i, list(bans[i + 1])] = logits[i].max() + 2.0
    logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)

    def top(n: int) -> list[list[tuple[int, float]] | None]:
        order = np.argsort(-logprobs, axis=1)[:, :n]
        return [[(int(t), float(logprobs[i, t])) for t in row] for i, row in enumerate(order)]

    want = token_weights_from_logits(logits, text, sampling)
    got = token_weights_from_top(top(64), text, sampling)
    assert np.isnan(got[0]) and not np.isnan(got[1:]).any()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, equal_nan=True)
    unbanned = token_weights_from_logits(logits, text, SamplingConfig(temperature=0.7))
    assert np.abs(unbanned - want)[1:][banned_rows].min() > 1e-3  # the bans mattered
    short = token_weights_from_top(top(5), text, sampling)
    assert np.nanmean(np.abs(short - want)) > 0.01  # a top 5 misses candidates
    rows = top(64)
    rows[3] = None
    rows[banned_rows[0]] = [(t, 0.0) for t in bans[banned_rows[0] + 1]]
    holes = token_weights_from_top(rows, text, sampling)
    assert np.isnan(holes[[0, 4, banned_rows[0] + 1]]).all()
    assert np.isnan(holes).sum() == 3
    with pytest.raises(ValueError):
        token_weights_from_top(rows, text[:-1], sampling)


def test_top_values_and_informativeness_are_the_full_filters() -> None:
    """The block-maxima top-k is torch.topk's values exactly (ties, -inf, a vocabulary not
    a multiple of the block), and a_t from it is the sampler's filter's, bit for bit."""
    from worldcup_core.model_weights import informativeness_torch, top_values
    from worldcup_core.sampling import filter_logits_torch

    gen = torch.Generator().manual_seed(5)
    sampling = SamplingConfig(temperature=0.7, top_k=50, top_p=0.95)
    for vocab in (49152, 8000, 6401):
        tied = torch.randint(-20, 20, (40, vocab), generator=gen).float()  # many ties
        smooth = torch.randn((40, vocab), generator=gen) * 4
        smooth[:, :300] = -torch.inf  # banned ids
        for x in (tied, smooth, smooth.bfloat16()):
            assert torch.equal(top_values(x, 50), torch.topk(x, 50).values)
        _, probs = filter_logits_torch(smooth, [0.7] * 40, [50] * 40, [0.95] * 40)
        want = (1.0 - (probs * probs).sum(dim=1)).clamp(0.0, 1.0)
        assert torch.equal(informativeness_torch(smooth, sampling), want)


def test_bfloat16_weights_are_near_float32_and_keep_the_null_exact() -> None:
    """A bfloat16 copy (WORLDCUP_WEIGHTS_DTYPE=bfloat16) gives weights within a few
    hundredths of float32's, the served model untouched; weighted by them, null text
    under 60 random keys gets uniform p-values (they depend on the text alone)."""
    from worldcup_core.model_weights import model_token_weights, weights_dtype, weights_model

    torch.set_num_threads(1)
    model = _tiny_lm(vocab=8192)  # wide enough for top_values' block path
    half = weights_model(model, "bfloat16")
    assert half is not model and next(model.parameters()).dtype == torch.float32
    assert weights_model(model, "float32") is model
    assert weights_dtype("auto", half) == torch.bfloat16
    with pytest.raises(ValueError, match="weights dtype"):
        weights_dtype("int8", model)
    rng = np.random.default_rng(6)
    texts = [rng.integers(0, 8192, size=int(rng.integers(30, 120))).tolist() for _ in range(12)]
    full = model_token_weights(model, texts)
    got = model_token_weights(half, texts)
    diff = np.concatenate([np.abs(a - b)[1:] for a, b in zip(full, got, strict=True)])
    assert np.mean(diff) < 0.02 and np.quantile(diff, 0.99) < 0.1, (diff.mean(), diff.max())
    assert np.std(np.concatenate([w[1:] for w in got])) > 0.05  # not constant weights
    p = []
    for _ in range(60):
        key = WatermarkKey(rng.bytes(32))
        p.extend(np.exp(model_log_p_many(key, CONFIG, texts, None, got)).tolist())
    assert stats.kstest(p, "uniform").pvalue > 1e-3
    assert abs(np.mean(np.array(p) < 0.05) - 0.05) <= 4 * math.sqrt(0.05 * 0.95 / len(p))


def test_forced_bfloat16_without_native_support_is_flagged() -> None:
    """'auto' never picks emulated bfloat16; asking for it where the device lacks AMX or
    AVX512-BF16 is flagged (the hf engine warns at load: about 5x slower on AVX2)."""
    from worldcup_core.model_weights import emulated_bfloat16, native_bfloat16

    cpu = torch.device("cpu")
    assert emulated_bfloat16("bfloat16", cpu) is (not native_bfloat16(cpu))
    assert emulated_bfloat16("bfloat16", "meta")  # no native bfloat16 there
    assert not emulated_bfloat16("auto", "meta") and not emulated_bfloat16("float32", "meta")


def test_the_hf_engine_warns_when_bfloat16_is_forced_and_emulated(
    tiny_model_dir: Any, tmp_path: Any
) -> None:
    import logging

    from fastapi.testclient import TestClient
    from test_service_api import make_settings

    from app.main import create_app
    from worldcup_core.model_weights import native_bfloat16

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    engine_log = logging.getLogger("worldcup.engine.hf")
    engine_log.addHandler(handler)
    try:
        settings = make_settings(tiny_model_dir, tmp_path, weights_dtype="bfloat16")
        with TestClient(create_app(settings)) as c:
            assert c.get("/ready").status_code == 200
    finally:
        engine_log.removeHandler(handler)
    warned = any("WORLDCUP_WEIGHTS_DTYPE=bfloat16" in m for m in seen)
    assert warned is (not native_bfloat16(torch.device("cpu"))), seen
