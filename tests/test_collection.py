"""worldcup_core.collection: many texts read together (issue #44, item 3).

The joint test's null calibration under random keys (KS and the rate at 1e-2, model-
weighted and model-free, message-free and at a known length), its de-duplication (a
text repeated N times, a copied sentence, the order of the texts), a set of one text
against the single-text statistic bit for bit, the sign-flip tail against brute force,
and the group search: never a wrong user at 1e-6 (unwatermarked sets, and sets
watermarked with the entries of a user outside the registry), the right user named on
simulated watermarked collections of 5 texts.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy import stats

from worldcup_core import Payload, WatermarkConfig, WatermarkKey, WorldCup
from worldcup_core.collection import (
    GROUP_DESIGNS,
    collection_units,
    group_search,
    joint_log_p,
    per_text_log_p,
    read_collection,
    sign_flip_upper_log_sf,
)
from worldcup_core.config import SERVICE_PRESET, WATERMARK_PRESETS
from worldcup_core.token_weights import informativeness

PRESET = WATERMARK_PRESETS[SERVICE_PRESET]
CONFIG = WatermarkConfig(groups=PRESET.groups, layers=PRESET.layers, alpha=PRESET.alpha)
PAPER = WatermarkConfig()  # k = 2


def _random_weights(rng: np.random.Generator, n: int) -> np.ndarray:
    w = rng.beta(0.6, 0.8, size=n)
    w[rng.random(n) < 0.2] = 0.0
    w[:1] = np.nan
    return w


def _null_set(rng: np.random.Generator) -> list[list[int]]:
    texts = [rng.integers(0, 49152, size=int(rng.integers(20, 100))).tolist() for _ in range(4)]
    texts.append(texts[0][:30] + rng.integers(0, 49152, size=20).tolist())  # a shared opening
    return texts


def test_joint_p_is_uniform_under_random_keys() -> None:
    rng = np.random.default_rng(11)
    found: dict[str, list[float]] = {"model": [], "model_free": []}
    for _ in range(150):
        key = WatermarkKey(rng.bytes(32))
        config = CONFIG if rng.random() < 0.75 else PAPER
        texts = _null_set(rng)
        weights = [_random_weights(rng, len(t)) for t in texts]
        bits = None if rng.random() < 0.5 else 32
        for name, w in (("model", weights), ("model_free", None)):
            units = collection_units(config, texts, w)
            assert units.statistic == name
            found[name].append(math.exp(joint_log_p(key, config, units, bits)))
    for name, values in found.items():
        p = np.array(values)
        assert stats.kstest(p, "uniform").pvalue > 1e-3, name
        assert abs(np.mean(p < 0.01) - 0.01) <= 4 * math.sqrt(0.01 * 0.99 / p.size) + 1e-9, name


def test_repeats_and_order_do_not_change_the_joint_p() -> None:
    rng = np.random.default_rng(12)
    key = WatermarkKey(rng.bytes(32))
    texts = [rng.integers(0, 49152, size=80).tolist() for _ in range(3)]
    weights = [_random_weights(rng, 80) for _ in texts]
    for w in (weights, None):
        once = collection_units(CONFIG, texts, w)
        w5 = None if w is None else [*w, w[1], w[1], w[1], w[1]]
        many = collection_units(CONFIG, [*texts, texts[1], texts[1], texts[1], texts[1]], w5)
        shuffled = collection_units(CONFIG, texts[::-1], None if w is None else w[::-1])
        assert many.num_units == once.num_units == shuffled.num_units
        for bits in (None, 32):
            want = joint_log_p(key, CONFIG, once, bits)
            assert joint_log_p(key, CONFIG, many, bits) == want
            assert math.isclose(
                joint_log_p(key, CONFIG, shuffled, bits), want, rel_tol=1e-12
            )  # sum order
    # a copied sentence counts once: the copy's units are all dropped
    copied = texts[0][:40]
    both = collection_units(CONFIG, [texts[0], copied + texts[2]], None)
    alone = collection_units(CONFIG, [texts[0], texts[2]], None)
    assert both.num_units <= alone.num_units + 2  # at most the seam's contexts are new


def test_one_text_is_the_single_text_statistic() -> None:
    rng = np.random.default_rng(13)
    key = WatermarkKey(rng.bytes(32))
    text = rng.integers(0, 49152, size=120).tolist()
    w = [_random_weights(rng, 120)]
    for weights in (w, None):
        for bits in (None, 32):
            units = collection_units(CONFIG, [text], weights)
            joint = joint_log_p(key, CONFIG, units, bits)
            own = float(per_text_log_p(key, CONFIG, [text], bits, weights)[0])
            assert math.isclose(joint, own, rel_tol=1e-12, abs_tol=1e-12)


def test_sign_flip_tail_is_brute_force() -> None:
    devs = [3, 1, 0, 2, 2]
    for excess in range(-9, 11):
        hits = sum(
            sum(s * d for s, d in zip(signs, devs, strict=True)) >= excess
            for signs in itertools.product((-1, 1), repeat=len(devs))
        )
        want = hits / 2 ** len(devs)
        got = sign_flip_upper_log_sf(devs, excess)
        assert (want == 0 and got == -math.inf) or math.isclose(math.exp(got), want, rel_tol=1e-12)
        assert sign_flip_upper_log_sf(devs, excess, coarse=2) <= got + 1e-12  # a lower bound


def _watermarked(
    rng: np.random.Generator, scheme: WorldCup, bits: str, n: int
) -> tuple[list[int], np.ndarray]:
    """As tests/test_model_weights.py: T 0.7-like next-token laws, a third near-forced."""
    seq = scheme.sequence(Payload.from_bits(bits))
    weights = []
    for _ in range(n):
        concentration = 0.01 if rng.random() < 0.35 else 0.3
        probs = np.sort(rng.dirichlet(np.full(50, concentration)))[::-1]
        keep = np.cumsum(probs) - probs < 0.95
        probs = probs[keep] / probs[keep].sum()
        cand = rng.choice(49000, probs.size, replace=False)
        weights.append(float(informativeness(probs)))
        seq.observe(int(cand[rng.choice(probs.size, p=seq.reweight(cand, probs))]))
    return list(seq.generated), np.array(weights)


def _registry(rng: np.random.Generator, users: int, per_user: int) -> dict[str, list[str]]:
    pay = rng.integers(0, 2, size=(users * per_user, 32))
    bits = ["".join(map(str, r)) for r in pay]
    return {f"user-{u}": bits[u * per_user : (u + 1) * per_user] for u in range(users)}


def test_group_search_never_names_a_wrong_user_on_null_sets() -> None:
    """Unwatermarked sets under random keys: every corrected p super-uniform, none below
    1e-6, over 50 searches of 50 users (both designs, model-free and model-weighted)."""
    rng = np.random.default_rng(14)
    found = []
    for r in range(50):
        key = WatermarkKey(rng.bytes(32))
        texts = _null_set(rng)
        weights = None if r % 2 else [_random_weights(rng, len(t)) for t in texts]
        units = collection_units(CONFIG, texts, weights)
        registry = _registry(rng, 50, 4)
        for design in GROUP_DESIGNS:
            g = group_search(key, CONFIG, units, registry, design)
            assert g.groups_searched == 50
            found.append(g.p_value)
    p = np.array(found)
    assert p.min() > 1e-6
    assert np.mean(p < 0.1) <= 0.1 + 4 * math.sqrt(0.1 / p.size)


def test_group_search_names_the_right_user_and_never_an_outsider() -> None:
    """Collections of 5 texts x 64 tokens, each text with a random entry of its user
    (100 users x 10 entries): the right user named at 1e-6; a collection written with
    the entries of a user outside the registry names no one at 1e-6."""
    rng = np.random.default_rng(15)
    named = 0
    trials = 5
    for _ in range(trials):
        scheme = WorldCup(WatermarkKey(rng.bytes(32)), CONFIG)
        groups = _registry(rng, 101, 10)
        outsider = groups.pop("user-100")
        texts, weights = zip(
            *(
                _watermarked(rng, scheme, groups["user-7"][int(rng.integers(10))], 64)
                for _ in range(5)
            ),
            strict=True,
        )
        found = read_collection(scheme.key, CONFIG, list(texts), None, list(weights), groups)
        assert found.num_texts == 5 and found.groups_searched == 100
        assert found.statistic == "model" and len(found.per_text_p) == 5
        assert found.is_watermarked
        if found.names_group:
            assert found.best_group == "user-7"
            named += 1
        other, other_w = zip(
            *(_watermarked(rng, scheme, outsider[int(rng.integers(10))], 64) for _ in range(5)),
            strict=True,
        )
        for design in GROUP_DESIGNS:
            units = collection_units(CONFIG, list(other), list(other_w))
            assert group_search(scheme.key, CONFIG, units, groups, design).p_value > 1e-6
    assert named >= trials - 1
    # the search's pruning is exact: each group searched alone (G = 1) gives its p, and
    # no ruled-out group beats the named one
    subset = {v: groups[v] for v in list(groups)[:12]}
    units = collection_units(CONFIG, list(texts), list(weights))
    whole = group_search(scheme.key, CONFIG, units, subset)
    alone = {v: group_search(scheme.key, CONFIG, units, {v: e}).log_p for v, e in subset.items()}
    assert whole.value == min(alone, key=lambda v: (alone[v], v))
    assert math.isclose(whole.log_p, min(alone[whole.value] + math.log(12), 0.0), abs_tol=1e-9)
