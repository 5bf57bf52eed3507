"""Watermark stealing (worldcup_eval.forgery, issue #45) on a tiny budget, and its parts.

The end-to-end test runs the real attack (answers through ContinuousBatch under the
tenant's key, the learner, the boosted spoofer, the service's verdict) on a tiny random
model whose answers are drawn from 64 whole-word tokens, so that a few thousand tokens
repeat each one-token context often enough to learn from (the embedded model needs
10^5 tokens for that). There
the plain KGW anchor (context width 1) is spoofed, and WorldCup under per-request
payloads is not, while its genuine answers are detected.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

import worldcup_core.consistency as consistency
import worldcup_eval.forgery as forgery
from worldcup_core.baselines.cells import first_contexts
from worldcup_core.baselines.kgw import KGW, KGWConfig, green_of, kgw_seed
from worldcup_core.config import SERVICE_CONTEXT_WIDTH
from worldcup_core.message import Payload
from worldcup_core.models import LoadedModel, load_tokenizer, tiny_random_model
from worldcup_core.prf import SENTINEL, WatermarkKey, context_at
from worldcup_eval.forgery import (
    ANSWERS,
    BASE,
    CLIMB,
    CLIMB_LIMITED,
    ForgeryConfig,
    Judge,
    Tenant,
    answers_config,
    answers_p,
    base_rescorer,
    clopper_pearson,
    collect_answers,
    human_chunks,
    judge_weights,
    learn_from,
    load_prompts,
    main,
    negate,
    pack_answers,
    read_jsonl,
    run_forgery,
    spoof_set,
    unpack_answers,
    variants,
    with_base,
    within_budget,
)
from worldcup_eval.stealing import LearnerConfig, Spoofer, SpoofPlan, SpoofSequence, learn

WORDS = (
    "the a cat dog sat on mat and ran to big red blue house tree sun moon day night green "
    "small old new happy man woman child city river road car book door window water fire "
    "light dark cold warm fast slow good bad long short high low open close king queen bird "
    "fish horse garden field stone gold silver black white friend school"
).split()


class _Words(torch.nn.Module):
    """A causal LM whose next token is always one of ``allowed`` (the rest get -inf)."""

    def __init__(self, inner: Any, allowed: list[int], vocab: int) -> None:
        super().__init__()
        self.inner = inner
        self.generation_config = inner.generation_config
        mask = torch.full((vocab,), -torch.inf)
        mask[allowed] = 0.0
        self.register_buffer("mask", mask)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # only the last position's logits are sampled from (no prompt logprobs here); a
        # teacher-forced pass (forgery.base_rescorer) asks for more
        kwargs.setdefault("logits_to_keep", 1)
        out = self.inner(*args, **kwargs)
        out.logits = out.logits + self.mask
        return out


@pytest.fixture(scope="module")
def word_lm() -> LoadedModel:
    torch.set_num_threads(1)
    tok = load_tokenizer()
    allowed = [tok(" " + w, add_special_tokens=False).input_ids[0] for w in WORDS]
    inner = tiny_random_model(tok, seed=3)
    # scale the head so that the 64 words' probabilities differ by context (a random
    # init is near-uniform), with entropy left for a watermark
    with torch.no_grad():
        inner.model.lm_head.weight.mul_(15.0)
    model = _Words(inner.model, allowed, len(tok)).eval()
    return LoadedModel(model, tok, "tiny-words", torch.device("cpu"))


def _small(scenario: str, **kw: Any) -> ForgeryConfig:
    """A budget of a few thousand tokens, 8 spoofs at delta 8, 20 human texts."""
    config = ForgeryConfig(
        scenario,
        budget_tokens=2000,
        max_new_tokens=48,
        batch_size=24,
        spoof_prompts=8,
        deltas=(8.0,),
        best_of=1,
        piggyback=0,
        human_texts=20,
        bystanders=50,
        # the word world's 64 tokens repeat two-token contexts within this budget; the
        # service's wider default is measured against it in the anchor test below
        context_width=2,
    )
    return replace(config, **kw)


# ----------------------------------------------------------------------------- learner


def _base(probs: dict[int, float], token: int) -> list[Any]:
    return [math.log(probs[token]), [[t, math.log(p)] for t, p in probs.items()]]


def test_learner_counts_first_occurrences_against_the_base_model() -> None:
    """n and E at each width over the biased positions only (a repeated context is
    skipped), and the score log2((n + 1) / (E + 1)) clipped to [-1, 1]."""
    probs = {5: 0.5, 6: 0.3, 7: 0.2}
    a = [5, 6, 5, 7]  # contexts (S,)->5, (5,)->6, (6,)->5, (5,) again: skipped
    b = [6, 5, 6]  # (S,)->6, (6,)->5, (5,)->6
    answers = [(t, [_base(probs, x) for x in t], None) for t in (a, b)]
    learned = learn(answers, LearnerConfig(width=1, min_count=1))
    assert learned.positions == 6
    table = learned.tables[1]
    assert set(table) == {(SENTINEL,), (5,), (6,)}
    five = table[(5,)]
    score = dict(zip(five.ids.tolist(), five.scores.tolist(), strict=True))
    # (5,) was a fresh context twice, followed by 6 both times; E = 2 x base
    assert five.occurrences == 2
    assert score[6] == pytest.approx(math.log2((2 + 1) / (0.6 + 1)))
    assert score[5] == pytest.approx(math.log2(1 / (1.0 + 1)))
    assert score[7] == pytest.approx(math.log2(1 / (0.4 + 1)))
    six = dict(zip(table[(6,)].ids.tolist(), table[(6,)].scores.tolist(), strict=True))
    assert six[5] == pytest.approx(math.log2((2 + 1) / (1.0 + 1)))  # (6,)->5 twice
    assert table[(6,)].occurrences == 2


def test_the_adaptive_spoofer_steers_into_common_contexts() -> None:
    """``common_next`` against brute force over random answers (the contexts seen in at
    least m answers, by their first c-1 tokens), and the steer lands on exactly the
    tokens completing the current context's tail into one of them, beside the boost."""
    rng = random.Random(3)
    vocab = list(range(12))
    texts = [[rng.choice(vocab) for _ in range(30)] for _ in range(60)]
    probs = {t: 1 / len(vocab) for t in vocab}
    answers = [(t, [_base(probs, x) for x in t], None) for t in texts]
    learned = learn(answers, LearnerConfig(width=2))
    for m in (1, 3, 5):
        seen: dict[tuple[int, ...], set[int]] = {}  # context -> answers it opened in
        for n, t in enumerate(texts):
            for i, _ in first_contexts(t, 2):
                seen.setdefault(tuple(context_at(t, i, 2)), set()).add(n)
        want: dict[tuple[int, ...], set[int]] = {}
        for ctx, where in seen.items():
            if len(where) >= m:
                want.setdefault(ctx[:-1], set()).add(ctx[-1])
        got = {k: set(v.tolist()) for k, v in learned.common_next(m).items()}
        assert got == want
    spoofing = SpoofSequence(SpoofPlan(learned, 0.0, steer=3.0, common_min=5), None)
    spoofing.generated = [4, 7]
    logits = np.zeros(len(vocab))
    out = spoofing.process_logits(logits)
    favoured = learned.common_next(5).get((7,), np.array([], dtype=np.int64))
    assert favoured.size > 0
    assert np.flatnonzero(out == 3.0).tolist() == sorted(favoured.tolist())
    assert spoofing.boosted == 1  # the boost ran too (delta 0: it adds nothing)
    plain = SpoofSequence(SpoofPlan(learned, 0.0), None)
    plain.generated = [4, 7]
    assert plain.steering() is None


def test_a_named_text_is_told_apart_as_quoting_an_own_answer_or_framing() -> None:
    """A climbed text that names an entry of one of the attacker's own answers, and
    quotes that answer, is a true partial attribution; one that names a bystander
    (no answer of the attacker's) is a frame. ``name_sources`` tells them apart."""
    rng = random.Random(3)
    own = [rng.randrange(100, 50_000) for _ in range(120)]
    answers = [
        {"message_id": 2054, "tokens": own},
        {"message_id": 2055, "tokens": [rng.randrange(100, 50_000) for _ in range(120)]},
        {"message_id": None, "tokens": own},  # an answer under no entry: never a source
    ]
    fresh = [rng.randrange(100, 50_000) for _ in range(60)]
    quoting = fresh[:30] + own[10:70]  # two thirds quoted from the answer of 2054
    texts = [
        {"tokens": quoting, "named": 2054},
        {"tokens": fresh, "named": 91},  # a bystander's entry
        {"tokens": quoting, "named": None},  # names nothing: not listed
        {"tokens": fresh, "named": 2055},  # an own entry, nothing quoted
    ]
    got = forgery.name_sources(texts, answers)
    assert got == [
        {"named": 2054, "own": True, "quoted": round(60 / 90, 3)},
        {"named": 91, "own": False, "quoted": None},
        {"named": 2055, "own": True, "quoted": 0.0},
    ]
    # seven shared tokens in a row are not a quote at the default length of eight
    assert forgery.quoted_share(own[:7] + fresh, own) == 0.0
    assert forgery.quoted_share(own[:8] + fresh, own) == pytest.approx(8 / 68)


def test_a_redrawn_span_boosts_as_if_the_text_before_it_were_its_own() -> None:
    """The climber redraws a span of a text: its spoofer starts from the text so far,
    so the context at the cut is the text's own, and a context the text already scored
    is not boosted again (the scheme scores a repeated context once)."""
    probs = {5: 0.5, 6: 0.3, 7: 0.2}
    answers = [(t, [_base(probs, x) for x in t], None) for t in ([5, 6, 5, 7], [6, 5, 6])]
    learned = learn(answers, LearnerConfig(width=1, min_count=1))
    plan = SpoofPlan(learned, 2.0)
    fresh = Spoofer(plan, [6]).sequence(Payload.from_bits("0"))
    assert fresh.generated == [6] and fresh.boost() is not None  # (6,): not yet scored
    again = Spoofer(plan, [6, 5, 6]).sequence(Payload.from_bits("0"))
    assert again.boost() is None  # (6,) scored at the text's second token
    assert again.boosted == 0 and Spoofer(plan).sequence(Payload.from_bits("0")).generated == []
    with pytest.raises(ValueError, match="climb"):
        ForgeryConfig(scenario="fixed", budget_tokens=10, climb=-1)
    with pytest.raises(ValueError, match="full_answers"):
        ForgeryConfig(scenario="fixed", budget_tokens=10, full_answers=31)
    # a p-value for the first 3 of each day's 30 queries (the draft's pick is query 0)
    day = ForgeryConfig(scenario="fixed", budget_tokens=10, climb=60, full_answers=3)
    assert [q for q in range(64) if answers_p(day, q)] == [0, 1, 2, 30, 31, 32, 60, 61, 62]
    assert all(answers_p(replace(day, full_answers=0), q) for q in range(64))


def test_the_steered_variant_has_keys_and_a_set_of_its_own() -> None:
    """--steer adds best-of-n drafts at the largest delta under keys of their own, which
    the studies read as a set apart from the stolen boost's (aimed or not)."""
    config = ForgeryConfig(scenario="fixed", budget_tokens=10, deltas=(2.0, 4.0), steer=3.0)
    tenant = Tenant(config)
    steered = [v for v in variants(config, tenant) if v.steer]
    assert [(v.delta, v.draws, v.aim) for v in steered] == [(4.0, config.best_of, "steered")]
    assert not any(v.steer for v in variants(replace(config, steer=0.0), tenant))
    assert spoof_set("steered/4/7/2") == "steered d=4"
    assert spoof_set("plain/4/7/0") == spoof_set("aimed/4/7/0") == "stolen d=4"
    assert spoof_set("plain/0/7/0") == "plain model"
    with pytest.raises(ValueError, match="steer"):
        ForgeryConfig(scenario="fixed", budget_tokens=10, steer=-1.0)


def test_learner_recovers_the_payload_bit_a_context_carries() -> None:
    """A context whose continuation follows payload bit 5 (10 under 0, 11 under 1):
    the split picks bit 5, and each half favours its own token."""
    rng = random.Random(1)
    steps = [{1: 1.0}, {2: 1.0}, {10: 0.5, 11: 0.5}]  # the base model at each position
    answers = []
    for i in range(60):
        bits = "".join(rng.choice("01") for _ in range(32))
        bits = bits[:5] + "01"[i % 2] + bits[6:]  # bit 5 balanced: no preference overall
        tokens = [1, 2, 10 if bits[5] == "0" else 11]
        answers.append((tokens, [_base(p, t) for p, t in zip(steps, tokens, strict=True)], bits))
    learned = learn(answers, LearnerConfig(width=2))
    cond = learned.conditioned[(1, 2)]
    assert cond.bit == 5
    ids = cond.ids.tolist()
    zero, one = cond.scores
    assert zero[ids.index(10)] > 0.5 > -0.5 > zero[ids.index(11)]
    assert one[ids.index(11)] > 0.5 > -0.5 > one[ids.index(10)]
    # averaged over payloads the unconditioned table sees no preference
    plain = learned.tables[2][(1, 2)]
    assert np.abs(plain.scores).max() < 1e-9


# ----------------------------------------------------------------------------- KGW


def test_kgw_green_share_and_calibrated_p_values() -> None:
    """A gamma share of the vocabulary is green, and on text independent of the key
    p < alpha happens at most alpha of the time (exact binomial tail, conservative)."""
    key = WatermarkKey(bytes(range(32)))
    vocab = np.arange(49152, dtype=np.int64)
    green = int(green_of(kgw_seed(key, (7,)), vocab, 0.25).sum())
    assert abs(green - 0.25 * 49152) < 5 * math.sqrt(49152 * 0.25 * 0.75)
    kgw = KGW(key, KGWConfig())
    rng = np.random.default_rng(0)
    ps = [kgw.detect(rng.integers(0, 49152, 60).tolist()).p_value for _ in range(400)]
    below = sum(p < 0.05 for p in ps)
    assert below <= stats.binom.ppf(1 - 1e-6, 400, 0.05)
    assert sum(p < 0.5 for p in ps) >= stats.binom.ppf(1e-6, 400, 0.3)  # not all 1s


def test_negate_and_clopper_pearson() -> None:
    assert negate("It is red and can fly. It is not blue.") == (
        "It is not red and can not fly. It is not blue."
    )
    lo, hi = clopper_pearson(0, 1000)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 1000), rel=1e-6)


# ----------------------------------------------------------------------------- the run


def test_answers_resume_where_they_stopped(
    word_lm: LoadedModel, data_dir: Path, tmp_path: Path
) -> None:
    config = _small("per-request", budget_tokens=300, batch_size=4)
    prompts = load_prompts(data_dir, config.spoof_prompts)
    tenant = Tenant(config)
    first = collect_answers(word_lm, config, tenant, prompts, tmp_path, False)
    assert sum(len(a["tokens"]) for a in first) >= 300
    before = (tmp_path / ANSWERS).read_bytes()
    again = collect_answers(word_lm, config, tenant, prompts, tmp_path, False)
    assert (tmp_path / ANSWERS).read_bytes() == before  # nothing regenerated
    assert [a["index"] for a in again] == [a["index"] for a in first]
    bigger = _small("per-request", budget_tokens=600, batch_size=4)
    more = collect_answers(word_lm, bigger, Tenant(bigger), prompts, tmp_path, False)
    stored = read_jsonl(tmp_path / ANSWERS)
    indices = [a["index"] for a in stored]
    assert len(indices) == len(set(indices))  # no answer generated twice
    assert [a["index"] for a in more[: len(first)]] == [a["index"] for a in first]
    bare = [{k: v for k, v in a.items() if k != "base"} for a in stored]
    assert within_budget(bare, 300) == within_budget(first, 300)
    # what comes back leaves the base log-probs in the file; the learner streams them
    assert all("base" not in a for a in more) and all("base" in a for a in stored)
    streamed = list(with_base(tmp_path, first))
    assert streamed == within_budget(stored, 300)
    assert (
        learn_from(with_base(tmp_path, first), config).summary()
        == learn_from(within_budget(stored, 300), config).summary()
    )
    with pytest.raises(ValueError, match="answer 999"):
        list(with_base(tmp_path, [*first, {"index": 999}]))
    # each answer carries its registry entry's payload, as /generate returns it
    codec = tenant.codec()
    for a in more:
        assert a["message_id"] == config.bystanders + a["index"] + 1
        assert a["bits"] == codec.payload(a["message_id"]).bits


def test_a_collection_packs_and_goes_on_elsewhere(
    word_lm: LoadedModel, data_dir: Path, tmp_path: Path
) -> None:
    """A long collection carried to another session: the pack holds the answers without
    their base log-probs; unpacked into a new folder, the run goes on from there, and the
    learner gets the packed answers' log-probs from a teacher-forced pass that agrees
    with what the generation recorded. Other answer settings are refused."""
    config = _small("per-request", budget_tokens=300, batch_size=4)
    prompts = load_prompts(data_dir, config.spoof_prompts)
    tenant = Tenant(config)
    first = tmp_path / "first"
    first.mkdir()
    got = collect_answers(word_lm, config, tenant, prompts, first, False)
    pack = tmp_path / "answers.jsonl.gz"
    header = pack_answers(first, pack)
    assert header["answers"] == len(read_jsonl(first / ANSWERS)) >= len(got)
    assert header["answers_config"] == answers_config(config)

    second = tmp_path / "second"
    unpack_answers(pack, second, config)
    moved = read_jsonl(second / ANSWERS)
    stored = sorted(read_jsonl(first / ANSWERS), key=lambda a: a["index"])
    assert [{k: v for k, v in a.items() if k != BASE} for a in stored] == moved
    with pytest.raises(ValueError, match="no base log-probs"):
        list(with_base(second, got))
    rescored = list(with_base(second, got, base_rescorer(word_lm, prompts)))
    recorded = list(with_base(first, got))
    for new, old in zip(rescored, recorded, strict=True):
        assert len(new[BASE]) == len(old[BASE]) == len(old["tokens"])
        for (lp_new, top_new), (lp_old, top_old) in zip(new[BASE], old[BASE], strict=True):
            assert lp_new == pytest.approx(lp_old, abs=2e-3)
            old_top = dict(map(tuple, top_old))
            for token, value in top_new:
                # ties in the 64-word world may order the 20th place differently
                if token in old_top:
                    assert value == pytest.approx(old_top[token], abs=2e-3)
            assert len(set(old_top) & {t for t, _ in top_new}) >= 18
    assert learn_from(iter(rescored), config).summary() == learn_from(recorded, config).summary()

    # the run goes on from the pack: the answers not yet collected, and no other
    bigger = replace(config, budget_tokens=600)
    more = collect_answers(word_lm, bigger, Tenant(bigger), prompts, second, False)
    indices = [a["index"] for a in read_jsonl(second / ANSWERS)]
    assert len(indices) == len(set(indices))
    assert sum(len(a["tokens"]) for a in more) >= 600
    assert {a["index"] for a in moved} <= {a["index"] for a in more}

    # other answer settings: refused before anything is written
    with pytest.raises(ValueError, match="top_p 0.95 \\(now 0.9\\)"):
        unpack_answers(pack, tmp_path / "third", replace(config, top_p=0.9))
    assert not (tmp_path / "third").exists()
    with pytest.raises(ValueError, match="seed 0 \\(now 1\\)"):
        collect_answers(word_lm, replace(config, seed=1), tenant, prompts, second, False)
    with pytest.raises(ValueError, match="already holds answers"):
        unpack_answers(pack, second, config)
    (tmp_path / "cut.gz").write_bytes(pack.read_bytes()[:200])
    with pytest.raises(ValueError, match="not a readable pack|cut short"):
        unpack_answers(tmp_path / "cut.gz", tmp_path / "fourth", config)


def test_a_sealed_fixed_payload_teaches_no_labels(
    word_lm: LoadedModel, data_dir: Path, tmp_path: Path
) -> None:
    """``fixed`` as the service is: each answer under a chosen payload carries a fresh
    registry entry's keyed payload, so the attacker's labels (the payloads its four
    accounts chose) agree with the carried bits no better than chance; before sealing
    they were the carried bits, and the judge held them as registry candidates."""
    config = _small("fixed", budget_tokens=300, batch_size=4, accounts=4)
    prompts = load_prompts(data_dir, config.spoof_prompts)
    tenant = Tenant(config)
    for sub in ("sealed", "unsealed"):
        (tmp_path / sub).mkdir()
    sealed = collect_answers(word_lm, config, tenant, prompts, tmp_path / "sealed", False)
    codec = tenant.codec()
    agree = total = 0
    for a in sealed:
        assert a["message_id"] == config.bystanders + a["index"] + 1
        assert a["bits"] == codec.payload(a["message_id"]).bits
        assert a["label"] == tenant.fixed_payload(a["index"] % 4)
        agree += sum(x == y for x, y in zip(a["bits"], a["label"], strict=True))
        total += len(a["bits"])
    assert len({a["bits"] for a in sealed}) == len(sealed) >= 4  # one payload per answer
    assert stats.binomtest(agree, total).pvalue > 1e-3, (agree, total)  # chance agreement
    before = replace(config, sealed=False)
    old = Tenant(before)
    unsealed = collect_answers(word_lm, before, old, prompts, tmp_path / "unsealed", False)
    assert all(a["bits"] == a["label"] and a["message_id"] is None for a in unsealed)
    judge = Judge(before, old, word_lm.tokenizer, old.registry_ids(unsealed))
    assert judge.scanner.spec.keys.client_payloads  # the releases before recorded them
    judge = Judge(config, tenant, word_lm.tokenizer, tenant.registry_ids(sealed))
    assert not judge.scanner.spec.keys.client_payloads  # sealed entries are entries


def test_kgw_anchor_is_spoofed_and_worldcup_names_no_victim(
    word_lm: LoadedModel, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The anchor: stolen counts spoof KGW (width 1) at its FPR 1e-3, where the plain
    model is not. WorldCup with per-request payloads on the same budget: its genuine
    answers are detected and named, the plain model, human text and every spoof under
    another tenant's key are not watermarked, and no spoof, even one aimed at the
    victim's leaked payload, names the victim's entry.

    The agreement gate (worldcup_core.consistency), before and after on the same spoofs:
    averaged over payloads the tokens with extreme g-values in either direction are the
    favoured ones, and the tests are two-sided per message position (or take the best of
    many entries), so ungated a spoof built of them crosses the verdict; gated, whose
    tokens do not agree within cells, it does not."""
    kgw = run_forgery(_small("kgw", budget_tokens=3000), tmp_path / "kgw", word_lm, data_dir, False)
    rows = {r["label"]: r for r in kgw["spoofs"]}
    assert rows["plain model d=0"]["accepted"]["k"] <= 1
    assert rows["stolen d=8"]["accepted"]["k"] >= 6  # of 8
    assert kgw["human"]["accepted"]["k"] <= 1

    # before the disclosure defence: the API showed every key its answers' payloads and
    # a victim's (exposure "all"), so the learner conditions and aims at the victim
    config = _small("per-request", exposure="all")
    wc = run_forgery(config, tmp_path / "wc", word_lm, data_dir, False)
    assert wc["learned"]["conditioned_contexts"] > 0
    assert any(r["label"].startswith("aimed at victim") for r in wc["spoofs"])
    assert (tmp_path / "wc" / "summary-2000-exposed.json").is_file()
    # the service as it is (payload bits only to analysts): the same answers teach no
    # conditioned counts, and there is no victim payload to aim at
    after = run_forgery(
        replace(config, exposure="analysts"), tmp_path / "wc", word_lm, data_dir, False
    )
    assert after["learned"]["conditioned_contexts"] == 0
    stolen = {r["label"]: r for r in after["spoofs"]}["stolen d=8"]
    with monkeypatch.context() as m:
        m.setattr(consistency, "AGREEMENT_Z_MIN", -math.inf)  # the verdict before the gates
        m.setattr(consistency, "SIGN_GATE_LEVEL", math.inf)
        ungated = run_forgery(
            replace(config, exposure="analysts"), tmp_path / "wc", word_lm, data_dir, False
        )
    before = {r["label"]: r for r in ungated["spoofs"]}["stolen d=8"]
    assert before["watermarked"]["k"] >= 2 and stolen["watermarked"]["k"] == 0, (before, stolen)
    # the service's default width (c = 4 since issue #45), the same budget, still before
    # the gates: the width alone starves the learner, and no spoof crosses the verdict
    wide = replace(config, exposure="analysts", context_width=SERVICE_CONTEXT_WIDTH)
    with monkeypatch.context() as m:
        m.setattr(consistency, "AGREEMENT_Z_MIN", -math.inf)
        m.setattr(consistency, "SIGN_GATE_LEVEL", math.inf)
        widened = run_forgery(wide, tmp_path / "wide", word_lm, data_dir, False)
    top = str(SERVICE_CONTEXT_WIDTH)
    assert widened["learned"]["contexts"][top] > 2 * ungated["learned"]["contexts"]["2"]
    assert {r["label"]: r for r in widened["spoofs"]}["stolen d=8"]["watermarked"]["k"] == 0
    assert widened["human"]["watermarked"]["k"] == 0
    wide_answers = read_jsonl(tmp_path / "wide" / ANSWERS)[:16]
    wide_tenant = Tenant(wide)
    judge = Judge(wide, wide_tenant, word_lm.tokenizer, wide_tenant.registry_ids(wide_answers))
    said = judge.judge([word_lm.tokenizer.decode(a["tokens"]) for a in wide_answers])
    assert sum(s["watermarked"] for s in said) >= 12  # its genuine answers keep their power
    assert not any(r["label"].startswith("aimed") for r in after["spoofs"])
    assert after["learned"]["positions"] == wc["learned"]["positions"]
    rows = {r["label"]: r for r in wc["spoofs"]}
    assert rows["plain model d=0"]["watermarked"]["k"] == 0
    for r in wc["spoofs"]:
        assert r["named_victim"]["k"] == 0, r
        assert r.get("other_key", {"k": 0})["k"] == 0, r
    assert wc["human"]["watermarked"]["k"] == 0
    # power: the service's verdict detects the genuine answers the attacker stole from
    answers = read_jsonl(tmp_path / "wc" / ANSWERS)[:16]
    tenant = Tenant(config)
    judge = Judge(config, tenant, word_lm.tokenizer, tenant.registry_ids(answers))
    said = judge.judge([word_lm.tokenizer.decode(a["tokens"]) for a in answers])
    assert sum(s["watermarked"] for s in said) >= 12
    assert sum(s["named"] == a["message_id"] for s, a in zip(said, answers, strict=True)) >= 8
    assert {s["statistic"] for s in said} == {"model_free"}
    # the generator replica's verdict: every test weighed by the model's token weights
    by_model = replace(config, judge="model")
    # (the inner model's weights: the word mask keeps only the last position's logits)
    weigh = judge_weights(replace(word_lm, model=word_lm.model.inner), by_model)
    assert weigh is not None and judge_weights(word_lm, config) is None
    model_judge = Judge(by_model, tenant, word_lm.tokenizer, tenant.registry_ids(answers), weigh)
    said = model_judge.judge([word_lm.tokenizer.decode(a["tokens"]) for a in answers])
    assert {s["statistic"] for s in said} == {"model"}
    assert sum(s["watermarked"] for s in said) >= 12
    assert sum(s["named"] == a["message_id"] for s, a in zip(said, answers, strict=True)) >= 8
    humans = human_chunks(load_prompts(data_dir, 4), word_lm.tokenizer, 30, 120)
    assert not any(s["watermarked"] for s in model_judge.judge(humans))


def test_the_p_value_climber_spoofs_the_anchor_and_not_the_service_default(
    word_lm: LoadedModel, data_dir: Path, tmp_path: Path
) -> None:
    """The patient oracle attacker (``--climb``): on one text per prompt it redraws a
    span with the spoofer and keeps the edit when the oracle's p falls. Its anchor: KGW
    at a boost too weak for single drafts, where ten queries a text get spoofs accepted.
    The service's default width (c = 4), the same budget and queries: none crosses the
    verdict or names an entry. Every text's p only falls, a text stops once accepted,
    and a larger budget of queries resumes from the rounds already run."""
    kgw = _small("kgw", budget_tokens=3000, deltas=(0.5,), climb=10)
    got = run_forgery(kgw, tmp_path / "kgw", word_lm, data_dir, False)
    rounds = got["climb"]["by_round"]
    assert len(got["climb"]["names"]) == rounds[-1]["named"]
    assert [r["round"] for r in rounds] == list(range(11))
    assert rounds[-1]["accepted"] > rounds[0]["accepted"], rounds
    assert got["spoofs"][-1]["label"] == "stolen d=0.5, then 10 p-value queries"
    path = tmp_path / "kgw" / CLIMB.format(budget=kgw.budget_tokens)
    saved = read_jsonl(path)
    for i in range(kgw.spoof_prompts):
        ps = [rd["texts"][i]["p"] for rd in saved]
        assert all(b <= a for a, b in zip(ps, ps[1:], strict=False)), ps
        queries = [rd["texts"][i]["queries"] for rd in saved]
        accepted = [rd["texts"][i]["accepted"] for rd in saved]
        first = accepted.index(True) if True in accepted else len(saved) - 1
        assert queries[-1] == first <= kgw.climb  # one query a round until accepted
    lines = path.read_text().splitlines()
    more = run_forgery(replace(kgw, climb=12), tmp_path / "kgw", word_lm, data_dir, False)
    assert path.read_text().splitlines()[: len(lines)] == lines
    assert len(read_jsonl(path)) == 13 and len(more["climb"]["by_round"]) == 13

    # against the service's defence: a p-value for the first 3 queries a day, the
    # verdict word after; the same answers and drafts (resumed), a file of its own
    limited = replace(kgw, full_answers=3)
    held = run_forgery(limited, tmp_path / "kgw", word_lm, data_dir, False)
    assert held["climb"]["full_answers"] == 3
    assert held["spoofs"][-1]["label"].startswith("stolen d=0.5, then 10 queries, a p-value")
    assert held["climb"]["by_round"][-1]["accepted"] <= rounds[-1]["accepted"]
    kept = read_jsonl(tmp_path / "kgw" / CLIMB_LIMITED.format(budget=3000, full=3))
    edits = {"p": 0, "word": 0}
    for i in range(kgw.spoof_prompts):
        for before, after in zip(kept, kept[1:], strict=False):
            a, b = before["texts"][i], after["texts"][i]
            if a["tokens"] == b["tokens"]:
                continue
            if b["queries"] < 3:  # a p-value answered: the edit is kept when p falls
                assert b["p"] < a["p"]
                edits["p"] += 1
            else:  # the word only: kept when the word is better, its p then unknown
                assert b["word"] > a["word"] and b["known"] is False
                edits["word"] += 1
    assert edits["p"] > 0 and edits["word"] > 0, edits  # both answers were climbed on

    wide = _small("per-request", context_width=SERVICE_CONTEXT_WIDTH, climb=10)
    wc = run_forgery(wide, tmp_path / "wide", word_lm, data_dir, False)
    row = wc["climb"]["row"]
    assert row["watermarked"]["k"] == 0 and row["named_any"]["k"] == 0, wc["climb"]


def test_progress_in_a_log_file_is_a_line_a_minute(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where stderr is not a terminal (``nohup ... > log``), the bar writes plain lines:
    at the start, every LOG_EVERY_S seconds and at the end, with the counts, the share
    and an ETA from this run's own rate (a resumed run starts at its count)."""
    monkeypatch.setattr(forgery, "LOG_EVERY_S", 0.0)
    bar = forgery._bar(1000, "answers (fixed)", True, initial=200)
    assert bar is not None
    bar(300)
    bar(500)
    forgery._close(bar)
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "answers (fixed): 200/1000 tokens 20 %",
        "answers (fixed): 500/1000 tokens 50 %",
        "answers (fixed): 1000/1000 tokens 100 %",
        "answers (fixed): 1000/1000 tokens 100 %",
    ]
    assert "ETA -" in lines[0] and "ETA 00:00:" in lines[1] and lines[-1].endswith("(done)")


def test_a_bad_device_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--scenario", "kgw", "--budget-tokens", "10", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--device", "nonsense"])
    assert stopped.value.code == 2
    assert "unknown device 'nonsense'" in capsys.readouterr().err


def test_dtype_reaches_the_model_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import worldcup_core.models as models

    args = ["--scenario", "kgw", "--budget-tokens", "10", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--dtype", "float16"])
    assert stopped.value.code == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err
    asked: list[str] = []

    def refuse(model: str | None, device: str = "cpu", dtype: str = "auto") -> None:
        asked.append(dtype)
        raise models.ModelLoadError("not loaded in this test")

    monkeypatch.setattr(models, "load_model", refuse)
    for dtype in ("bfloat16", None):
        with pytest.raises(SystemExit) as stopped:
            main([*args, *(("--dtype", dtype) if dtype else ())])
        assert stopped.value.code == 2
        assert "not loaded in this test" in capsys.readouterr().err
    assert asked == ["bfloat16", "auto"]


def test_naming_study_tallies_own_and_other_entries() -> None:
    """The naming study counts an answer named for its own entry as right, for any
    other entry as a false attribution, and ambiguity and the verdict apart."""
    from worldcup_eval.naming_study import tally

    said = [
        {"watermarked": True, "named": 5, "ambiguous": False},
        {"watermarked": True, "named": 9, "ambiguous": False},
        {"watermarked": True, "named": None, "ambiguous": True},
        {"watermarked": False, "named": None, "ambiguous": False},
    ]
    assert tally([5, 6, 7, 8], said) == {
        "answers": 4, "watermarked": 3, "right": 1, "wrong": 1, "ambiguous": 1,
    }  # fmt: skip
    with pytest.raises(ValueError):
        tally([5], said)
