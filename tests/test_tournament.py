"""The closed-form tournament (Appendix E) against a literal run of Algorithm 1.

``tournament_distribution`` replaces sampling 2^m leaves by m vectorised
layer updates. These tests check it three ways: goodness of fit against the
brute-force ``simulate_tournament``, agreement with Theorem 2's formulas, and
the combination of the per-group distributions in ``combine_families``.
"""

from __future__ import annotations

import doctest

import numpy as np
import numpy.typing as npt
import pytest
from scipy import stats

import worldcup_core.encoder
import worldcup_core.tournament
from worldcup_core import Payload, Variant, WatermarkConfig, WatermarkKey
from worldcup_core.encoder import WorldCupEncoder, combine_families, lambda_for
from worldcup_core.prf import (
    PRF,
    PRFV2,
    context_at,
    pack_context,
    v2_group_bits,
    v2_gwords,
    v2_positions,
)
from worldcup_core.scoring import symbol_index
from worldcup_core.tournament import simulate_tournament, tournament_distribution

DRAWS = 20_000
MIN_EXPECTED = 5.0
# (seed, candidates n, layers m): n = 3..6 for each of m = 1..4.
CASES = [(100 * m + n, n, m) for m in (1, 2, 3, 4) for n in (3, 4, 5, 6)]


def _case(seed: int, n: int, m: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.uint8]]:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(n))
    g = rng.integers(0, 2, size=(m, n)).astype(np.uint8)
    return probs, g


def _pooled(
    observed: npt.NDArray[np.int64], expected: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Merge the cells with expected count < MIN_EXPECTED (and more, if needed) into one."""
    order = np.argsort(expected)
    obs, exp = observed[order].astype(np.float64), expected[order]
    cut = int(np.sum(exp < MIN_EXPECTED))
    if cut == 0:
        return obs, exp
    while cut < len(exp) and exp[:cut].sum() < MIN_EXPECTED:
        cut += 1
    return (
        np.concatenate([[obs[:cut].sum()], obs[cut:]]),
        np.concatenate([[exp[:cut].sum()], exp[cut:]]),
    )


def _gof_pvalue(
    winners: npt.NDArray[np.int64], expected_probs: npt.NDArray[np.float64], n: int
) -> float:
    observed = np.bincount(winners, minlength=n).astype(np.int64)
    expected = expected_probs * len(winners)
    if np.any(observed[expected_probs == 0] > 0):
        return 0.0  # a token the hypothesis gives zero mass to was sampled
    keep = expected_probs > 0
    obs, exp = _pooled(observed[keep], expected[keep])
    assert len(obs) >= 2, "pooling left a single cell; the case has no power"
    assert exp.min() >= MIN_EXPECTED
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def simulations() -> dict[tuple[int, int, int], npt.NDArray[np.int64]]:
    out = {}
    for seed, n, m in CASES:
        probs, g = _case(seed, n, m)
        rng = np.random.default_rng(seed + 1_000_000)
        out[(seed, n, m)] = simulate_tournament(probs, g, rng, DRAWS)
    return out


@pytest.mark.parametrize(("seed", "n", "m"), CASES)
def test_closed_form_matches_algorithm_1(
    simulations: dict[tuple[int, int, int], npt.NDArray[np.int64]], seed: int, n: int, m: int
) -> None:
    probs, g = _case(seed, n, m)
    q = tournament_distribution(probs, g)
    winners = simulations[(seed, n, m)]
    assert winners.shape == (DRAWS,)
    assert _gof_pvalue(winners, q, n) > 1e-3


def test_goodness_of_fit_has_power(
    simulations: dict[tuple[int, int, int], npt.NDArray[np.int64]],
) -> None:
    """The same test rejects wrong answers: the base distribution, and reversed layers."""
    base = []
    reversed_layers = []
    for seed, n, m in CASES:
        probs, g = _case(seed, n, m)
        winners = simulations[(seed, n, m)]
        base.append(_gof_pvalue(winners, probs, n))
        if m > 1:
            reversed_layers.append(_gof_pvalue(winners, tournament_distribution(probs, g[::-1]), n))
    assert min(base) < 1e-6
    assert sum(p < 1e-6 for p in base) >= len(CASES) // 2
    assert min(reversed_layers) < 1e-6


def test_pooling_merges_small_cells() -> None:
    obs, exp = _pooled(np.array([1, 50, 2, 47]), np.array([1.0, 50.0, 2.5, 46.5]))
    np.testing.assert_allclose(exp, [50.0, 50.0])  # 1 + 2.5 < 5, so 46.5 joins the pool
    np.testing.assert_array_equal(obs, [50, 50])
    obs, exp = _pooled(np.array([3, 4, 93]), np.array([2.0, 6.0, 92.0]))
    np.testing.assert_allclose(exp, [8.0, 92.0])
    obs, exp = _pooled(np.array([10, 90]), np.array([10.0, 90.0]))
    np.testing.assert_allclose(exp, [10.0, 90.0])


def _theorem2_binary(probs: npt.NDArray[np.float64], g: npt.NDArray[np.uint8]) -> np.ndarray:
    """Theorem 2, binary g, N = 2 leaves."""
    p0 = probs[g == 0].sum()
    p1 = probs[g == 1].sum()
    return np.where(g == 0, probs * p0, probs * (1.0 - p0**2) / p1)


def _theorem2_general(probs: npt.NDArray[np.float64], g: npt.NDArray[np.uint8]) -> np.ndarray:
    """Theorem 2 for any g and N = 2: p(x) (p(V^{<=g(x)})^2 - p(V^{<g(x)})^2) / p(V^{=g(x)}).

    (The paper's "In particular if N=2" line, p(x)[p(x) + 2 p(V^{<g(x)})], has a
    typo: the first p(x) in the bracket must be p(V^{=g(x)}).)
    """
    below = np.array([probs[g < gx].sum() for gx in g])
    equal = np.array([probs[g == gx].sum() for gx in g])
    return probs * ((below + equal) ** 2 - below**2) / equal


@pytest.mark.parametrize("seed", range(20))
def test_single_layer_matches_theorem_2(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    probs = rng.dirichlet(np.ones(n) * 0.7)
    g = rng.integers(0, 2, size=n).astype(np.uint8)
    g[0], g[1] = 0, 1  # both classes non-empty, so p(V^{g=1}) > 0
    q = tournament_distribution(probs, g[None, :])
    np.testing.assert_allclose(q, _theorem2_binary(probs, g), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(q, _theorem2_general(probs, g), rtol=1e-12, atol=1e-15)


def test_multi_layer_is_iterated_single_layer() -> None:
    """Theorem 3: q^(l) is the single-layer map applied to q^(l-1)."""
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(9))
    g = rng.integers(0, 2, size=(30, 9)).astype(np.uint8)
    q = probs
    for layer in g:
        q = _theorem2_binary(q, layer)
    closed = tournament_distribution(probs, g)
    np.testing.assert_allclose(closed, q, rtol=1e-10, atol=1e-15)
    assert closed.sum() == pytest.approx(1.0, abs=1e-12)


def test_constant_layer_is_identity_and_bias_is_towards_g1() -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(tournament_distribution(probs, np.zeros((5, 4))), probs)
    np.testing.assert_allclose(tournament_distribution(probs, np.ones((5, 4))), probs)
    q = tournament_distribution(probs, np.array([[1, 0, 0, 1]] * 3))
    assert q[0] > probs[0] and q[3] > probs[3]
    assert q[1] < probs[1] and q[2] < probs[2]
    assert q[1] / q[2] == pytest.approx(probs[1] / probs[2])  # same g-history, same ratio


@pytest.mark.parametrize("seed", range(10))
def test_output_is_a_distribution(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    probs = rng.dirichlet(np.ones(n) * 0.3)
    probs[rng.random(n) < 0.2] = 0.0
    if probs.sum() == 0:
        probs[0] = 1.0
    probs /= probs.sum()
    g = rng.integers(0, 2, size=(int(rng.integers(1, 64)), n))
    q = tournament_distribution(probs, g)
    assert q.shape == (n,)
    assert np.all(q >= 0)
    assert q.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(q[probs == 0] == 0)


def test_broadcasting_over_leading_dims() -> None:
    rng = np.random.default_rng(3)
    batch, groups, m, n = 4, 3, 6, 7
    probs = rng.dirichlet(np.ones(n), size=batch)  # (batch, n)
    g = rng.integers(0, 2, size=(batch, groups, m, n))
    q = tournament_distribution(probs[:, None, :], g)  # (batch, groups, n)
    assert q.shape == (batch, groups, n)
    for b in range(batch):
        for j in range(groups):
            np.testing.assert_allclose(
                q[b, j], tournament_distribution(probs[b], g[b, j]), rtol=1e-13
            )
    # One distribution against k g-families: the shape the encoder uses.
    q_shared = tournament_distribution(probs[0], g[0])
    assert q_shared.shape == (groups, n)
    np.testing.assert_allclose(q_shared, q[0], rtol=1e-13)
    np.testing.assert_allclose(q.sum(axis=-1), 1.0, rtol=1e-12)


# --- combine_families ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0, 1.2])
def test_combine_families_is_a_distribution(seed: int, lam: float) -> None:
    rng = np.random.default_rng(seed)
    n, k, m = int(rng.integers(2, 40)), int(rng.integers(1, 9)), int(rng.integers(1, 31))
    probs = rng.dirichlet(np.ones(n) * 0.5)
    intended = rng.integers(0, 2, size=(k, m, n)).astype(np.uint8)
    other = intended ^ 1
    out = combine_families(probs, intended, other, lam)
    assert out.shape == (n,)
    assert np.all(out >= 0)
    assert out.sum() == pytest.approx(1.0, abs=1e-12)
    q_int = tournament_distribution(probs, intended).sum(axis=0)
    q_other = tournament_distribution(probs, other).sum(axis=0)
    scores = np.clip(q_int - lam * q_other, 0.0, None)
    if scores.sum() > 0:
        np.testing.assert_allclose(out, scores / scores.sum(), rtol=1e-12, atol=1e-15)


def test_combine_families_single_candidate_falls_back() -> None:
    """One candidate: q_int = q_other = k, so lambda = 1.2 clips everything."""
    for k in (1, 2, 8):
        g = np.zeros((k, 30, 1), dtype=np.uint8)
        out = combine_families(np.array([1.0]), g, g ^ 1, 1.2)
        np.testing.assert_array_equal(out, [1.0])


def test_combine_families_fallback_is_mean_of_intended() -> None:
    """Constant g-values make every tournament the identity: q_int = q_other = k p."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    k, m = 3, 5
    intended = np.zeros((k, m, 4), dtype=np.uint8)
    intended[1] = 1
    other = intended ^ 1
    q_int = tournament_distribution(probs, intended).sum(axis=0)
    out = combine_families(probs, intended, other, 1.2)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, q_int / k, rtol=1e-12)
    np.testing.assert_allclose(out, probs, rtol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_combine_families_k1_no_subtraction_is_plain_tournament(seed: int) -> None:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(20))
    g = rng.integers(0, 2, size=(1, 30, 20)).astype(np.uint8)
    out = combine_families(probs, g, g ^ 1, 0.0)
    np.testing.assert_allclose(out, tournament_distribution(probs, g[0]), rtol=1e-12)


def test_subtraction_sharpens_towards_intended_family() -> None:
    """With lambda > 0 the intended family's favourites gain mass against lambda = 0."""
    rng = np.random.default_rng(11)
    probs = rng.dirichlet(np.ones(30))
    g = rng.integers(0, 2, size=(2, 30, 30)).astype(np.uint8)
    plain = combine_families(probs, g, g ^ 1, 0.0)
    sharp = combine_families(probs, g, g ^ 1, 1.0)
    score = g.sum(axis=(0, 1))  # g-ones per candidate over all groups and layers
    assert float(sharp @ score) > float(plain @ score) > float(probs @ score)


# --- the encoder wires PRF, payload and combination together ------------------


@pytest.mark.parametrize("variant", list(Variant))
def test_encoder_reweight_recomputed_by_hand(variant: Variant) -> None:
    """Scheme v1: the first token's context is the sentinel padding, and it is watermarked."""
    key = WatermarkKey(bytes(range(32)))
    config = WatermarkConfig(groups=2, layers=12, variant=variant, version="worldcup-v1")
    payload = Payload("1001")
    seq = WorldCupEncoder(key, config, payload).start()
    rng = np.random.default_rng(5)
    cand = rng.choice(49152, 25, replace=False).astype(np.int64)
    probs = rng.dirichlet(np.ones(25))
    out = seq.reweight(cand, probs)

    prf = PRF(key)
    seed = prf.context_seed(pack_context(context_at([], 0, config.context_width)))
    pos = prf.position_u64(seed) % config.symbols_for(4)
    bits = np.array([int(b) for b in payload.bits[2 * pos : 2 * pos + 2]], dtype=np.uint8)
    g = prf.g_bits(seed, cand.tolist(), 2, 12).transpose(1, 2, 0)
    if variant is Variant.RANDOM_SECOND:
        g_alt = prf.g_bits(seed, cand.tolist(), 2, 12, alternate=True).transpose(1, 2, 0)
        intended = np.where(bits[:, None, None] == 0, g, g_alt)
        other = np.where(bits[:, None, None] == 0, g_alt, g)
    else:
        intended = g ^ bits[:, None, None]  # bit 0 favours g = 1, bit 1 favours g = 0
        other = intended ^ 1
    expected = combine_families(probs, intended, other, lambda_for(config, probs))
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert not np.allclose(out, probs)


@pytest.mark.parametrize("variant", list(Variant))
def test_v2_encoder_reweight_recomputed_by_hand(variant: Variant) -> None:
    """Scheme v2: SipHash positions and g-words, recomputed for the third token."""
    key = WatermarkKey(bytes(range(32)))
    config = WatermarkConfig(groups=2, layers=12, variant=variant, version="worldcup-v2")
    payload = Payload("1001")
    seq = WorldCupEncoder(key, config, payload).start()
    rng = np.random.default_rng(5)
    cand = rng.choice(49152, 25, replace=False).astype(np.int64)
    probs = rng.dirichlet(np.ones(25))
    seq.observe(1111)
    seq.observe(2222)
    out = seq.reweight(cand, probs)

    prf = PRFV2.of(key)
    ctx = [np.full(25, 1111, dtype=np.uint64), np.full(25, 2222, dtype=np.uint64)]
    position = v2_positions(prf.position_key, [c[:1] for c in ctx])
    pos = int(symbol_index(position, config.symbols_for(4), "worldcup-v2")[0])
    bits = np.array([int(b) for b in payload.bits[2 * pos : 2 * pos + 2]], dtype=np.uint8)
    tokens = cand.astype(np.uint64)
    g = v2_group_bits(v2_gwords(prf.gvalue_key, ctx, tokens, 1), 2, 12).transpose(1, 2, 0)
    if variant is Variant.RANDOM_SECOND:
        alt = v2_group_bits(v2_gwords(prf.alt_key, ctx, tokens, 1), 2, 12).transpose(1, 2, 0)
        intended = np.where(bits[:, None, None] == 0, g, alt)
        other = np.where(bits[:, None, None] == 0, alt, g)
    else:
        intended = g ^ bits[:, None, None]
        other = intended ^ 1
    expected = combine_families(probs, intended, other, lambda_for(config, probs))
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert not np.allclose(out, probs)


@pytest.mark.parametrize("version", ["worldcup-v1", "worldcup-v2"])
def test_encoder_leaves_repeated_context_unchanged(version: str) -> None:
    """Repeated contexts are sampled unmodified; under v2 the padded start is too."""
    key = WatermarkKey(bytes(range(32)))
    config = WatermarkConfig(context_width=1, version=version)
    seq = WorldCupEncoder(key, config, Payload("01")).start()
    cand = np.arange(10, dtype=np.int64)
    probs = np.full(10, 0.1)
    first = seq.reweight(cand, probs)  # context (S,)
    assert np.allclose(first, probs) == (version == "worldcup-v2")
    seq.observe(7)
    assert not np.allclose(seq.reweight(cand, probs), probs)  # context (7,)
    seq.observe(7)
    np.testing.assert_array_equal(seq.reweight(cand, probs), probs)  # (7,) again
    seq.observe(3)
    assert not np.allclose(seq.reweight(cand, probs), probs)  # context (3,)
    assert seq.watermarked_steps == (2 if version == "worldcup-v2" else 3)


def test_lambda_per_variant() -> None:
    probs = np.full(8, 1 / 8)
    h = np.log(8)
    assert lambda_for(WatermarkConfig(alpha=1.2), probs) == pytest.approx(1.2 * np.tanh(h))
    assert lambda_for(WatermarkConfig(variant=Variant.NO_ENTROPY), probs) == 1.0
    assert lambda_for(WatermarkConfig(variant=Variant.NO_SUBTRACTION), probs) == 0.0
    assert lambda_for(WatermarkConfig(), np.array([1.0, 0.0])) == 0.0


@pytest.mark.parametrize("module", [worldcup_core.tournament, worldcup_core.encoder])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)  # type: ignore[arg-type]
    assert result.attempted > 0
    assert result.failed == 0


def test_rounding_never_makes_mass_negative() -> None:
    """Regression: E_q[g] rounded to 1 + 2^-52 gave g = 0 tokens negative mass.

    Here the three g = 1 tokens sum to 1.0000000000000002 in floating point;
    the fourth (g = 0) token then got -2e-36, and after clipping it was the
    only positive score, so combine_families put all the mass on it.
    """
    probs = np.array([0.29846844738462247, 0.042444653575122594, 0.6590868990402551, 1e-20])
    g = np.array([[[1, 1, 1, 0]]], dtype=np.uint8)
    q = tournament_distribution(probs, g[0])
    assert (q >= 0).all()
    out = combine_families(probs, g, g, 2.0)  # every score clipped: the fallback
    assert (out >= 0).all() and out[3] < 1e-12
    np.testing.assert_allclose(out[:3], probs[:3] / probs[:3].sum(), rtol=1e-12)
