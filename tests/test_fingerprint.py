"""The issued-text fingerprint (worldcup_core.fingerprint, issue #45).

CHANGING THE TEST VECTOR MEANS FINGERPRINTS ALREADY STORED STOP MATCHING their texts.
The edit measurements choose :data:`SIMILARITY_THRESHOLD`: 200 random edits of each of
five ELI5 human answers (tests/fixtures/fingerprint_answers.json), each under its own
random key.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from worldcup_core.fingerprint import (
    FINGERPRINT_BYTES,
    SIMILARITY_THRESHOLD,
    fingerprint_similarity,
    hamming,
    shingles,
    text_fingerprint,
    words,
)
from worldcup_core.prf import WatermarkKey

ANSWERS: list[str] = json.loads(
    (Path(__file__).parent / "fixtures" / "fingerprint_answers.json").read_text()
)["answers"]
KEY = WatermarkKey.from_hex("00" * 32)
EDITS = 200  # per answer and kind
VECTOR = "871842af7aeb5d63517df1f84a25970d"  # key 00..00, ANSWERS[0]


def _edit(rng: random.Random, w: list[str], share: float, contiguous: bool) -> str:
    """``share`` of the words (ceil) replaced by words not in the text, as one span
    or scattered."""
    w = list(w)
    k = math.ceil(share * len(w))
    if contiguous:
        start = rng.randrange(len(w) - k + 1)
        spots: list[int] = list(range(start, start + k))
    else:
        spots = rng.sample(range(len(w)), k)
    for p in spots:
        w[p] = f"zq{rng.randrange(10**6)}"
    return " ".join(w)


def _similarities(share: float, contiguous: bool, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    for text in ANSWERS:
        w = words(text)
        for _ in range(EDITS):
            key = WatermarkKey(rng.randbytes(32))
            edited = _edit(rng, w, share, contiguous)
            out.append(
                fingerprint_similarity(text_fingerprint(key, text), text_fingerprint(key, edited))
            )
    return out


def _report(name: str, sims: list[float]) -> None:
    above = sum(s >= SIMILARITY_THRESHOLD for s in sims) / len(sims)
    sys.stdout.write(
        f"{name}: n={len(sims)} mean={sum(sims) / len(sims):.3f} max={max(sims):.4f} "
        f"at/above {SIMILARITY_THRESHOLD}: {above:.3f}\n"
    )


def test_vector_locks_the_algorithm() -> None:
    assert text_fingerprint(KEY, ANSWERS[0]).hex() == VECTOR
    assert text_fingerprint(KEY, "").hex() == "00" * FINGERPRINT_BYTES


def test_normalisation() -> None:
    assert words("Ｆｕｌｌ-width CAFÉ, straße!") == ["full", "width", "café", "strasse"]
    assert shingles("two words") == {"two", "words"}
    assert shingles("a b c d") == {"a b c", "b c d"}
    assert shingles("a b c a b c") == {"a b c", "b c a", "c a b"}  # a set


def test_identical_and_cosmetic_changes_are_one() -> None:
    for text in ANSWERS:
        fp = text_fingerprint(KEY, text)
        assert len(fp) == FINGERPRINT_BYTES
        assert fingerprint_similarity(fp, text_fingerprint(KEY, text)) == 1.0
        cosmetic = "  " + "\n".join(text.upper().split()) + " \t"
        assert fingerprint_similarity(fp, text_fingerprint(KEY, cosmetic)) == 1.0
        unspaced = text.replace(" ,", ",").replace(" .", ".")
        assert fingerprint_similarity(fp, text_fingerprint(KEY, unspaced)) == 1.0


def test_another_key_is_unrelated() -> None:
    rng = random.Random(7)
    sims = []
    for text in ANSWERS:
        for _ in range(40):
            a, b = WatermarkKey(rng.randbytes(32)), WatermarkKey(rng.randbytes(32))
            sims.append(
                fingerprint_similarity(text_fingerprint(a, text), text_fingerprint(b, text))
            )
    _report("same text, another key", sims)
    assert max(sims) < 0.6
    assert abs(sum(sims) / len(sims)) < 0.05  # about 0 on average


def test_thirty_percent_contiguous_rewrite_is_below_threshold() -> None:
    sims = _similarities(0.3, contiguous=True, seed=1)
    _report("30 % contiguous", sims)
    # 128 bits are 128 coin flips: a crossing is possible (about 1e-4 a text at a
    # cosine of 0.67, binomial tail), so the bound is on the rate; none in these 1000
    assert sum(s >= SIMILARITY_THRESHOLD for s in sims) <= 1
    assert 0.6 < sum(sims) / len(sims) < 0.75  # the sets' cosine is about 0.67


def test_thirty_percent_scattered_replacements_are_far_below_threshold() -> None:
    sims = _similarities(0.3, contiguous=False, seed=2)
    _report("30 % scattered", sims)
    assert max(sims) < SIMILARITY_THRESHOLD - 0.1


def test_five_percent_contiguous_edit_stays_above_on_most() -> None:
    sims = _similarities(0.05, contiguous=True, seed=3)
    _report("5 % contiguous", sims)
    assert sum(s >= SIMILARITY_THRESHOLD for s in sims) / len(sims) > 0.5


def test_five_percent_scattered_edit_is_measured() -> None:
    """Each scattered word breaks three shingles: the sets' cosine is about 0.84, so
    most such texts are no longer claimed whole (they are not the issued text)."""
    sims = _similarities(0.05, contiguous=False, seed=4)
    _report("5 % scattered", sims)
    assert 0.8 < sum(sims) / len(sims) < 0.88


def test_bad_fingerprints_are_refused() -> None:
    good = text_fingerprint(KEY, "x")
    with pytest.raises(ValueError):
        fingerprint_similarity(good, b"\x00" * 15)
    assert hamming(good, good) == 0
    assert fingerprint_similarity(bytes(16), b"\xff" * 16) == pytest.approx(-1.0)


def test_the_coverage_harness_compares_each_edit_with_its_issued_text() -> None:
    from worldcup_eval.coverage import issued_similarities

    a, b = ANSWERS[0], ANSWERS[1]
    rewritten = _edit(random.Random(5), words(a), 0.3, contiguous=True)
    edits = [
        {"answer": 1, "edit": "unedited", "text": a},
        {"answer": 2, "edit": "unedited", "text": b},
        {"answer": 1, "edit": "30 % rewritten", "text": rewritten},
        {"answer": 2, "edit": "negations", "text": b.upper()},
    ]
    sims = issued_similarities(KEY, edits)
    assert sims[0] == sims[1] == sims[3] == 1.0
    assert sims[2] < SIMILARITY_THRESHOLD


def test_a_verbatim_text_is_whole_whatever_its_coverage() -> None:
    """The README's round trip: a verbatim T 0.7 answer whose evidence sits in 10 % of its
    tokens was answered 'part ... written or edited by someone else (100 % similar)'.
    The fingerprint is exact there: whole. Below VERBATIM_SIMILARITY the coverage rules."""
    from app.services.evidence import coverage_out
    from worldcup_core.fingerprint import VERBATIM_SIMILARITY
    from worldcup_core.islands import Coverage

    low = Coverage(0.1, 98, (), 0.8)
    assert low.attribution == "part"
    exact = coverage_out(low, True, 1.0)
    assert exact.attribution == "whole" and "it is the issued text" in exact.message
    assert coverage_out(low, True, VERBATIM_SIMILARITY).attribution == "whole"
    assert coverage_out(low, True, 0.99).attribution == "part"  # 3+ bits away: the coverage
    assert coverage_out(low, True, None).attribution == "part"  # no fingerprint: as before
    high = Coverage(0.95, 98, (), 0.8)
    assert coverage_out(high, True, 0.5).attribution == "part"  # a rewrite is never whole
