"""One decision per text: the tests an asker may run, combined into one verdict.

Every answer about a text (``/detect``, ``/decode``, their batch forms,
``/provenance``, the console, ``worldcup detect`` and ``worldcup scan``) takes its
verdict from :func:`assess`, fed the same tests for the same text and asker, so
two answers about one text cannot contradict each other.

**The tests.** Under each key version ``v`` the asker holds:

* ``detect``: the message-free test (payload length unknown, :mod:`worldcup_core.detector`);
* ``decode``: the same test with the payload length known (the grouping the
  decoder reads, one per payload length ``L`` tested);
* ``registry``: the agreement of the text with the tenant's issued registry
  entries at length ``L`` (:func:`worldcup_core.decoder.registry_match`, its p
  already Bonferroni-corrected for the registry's size). Only where the tenant
  has issued entries at that length.

**Validity.** Each per-key p-value is exact or conservative under H0 ("this text
was not watermarked with this key"): the cell counts are binomial tails of
g-bits that, for a key independent of the text, are i.i.d. fair coins (the PRF
assumption: distinct (context, token) pairs give independent g-values;
repeated contexts are scored once), randomised within their lattice point so
that the message-free p is exactly uniform; the registry test's agreement is an
exact Binomial(n, 1/2) tail, Bonferroni over the entries. A test's p is reported
for the best key version, and the registry and decode tests run under the key
version chosen by the data; all of that is covered by one union bound:
``P(min_v p_v < t) <= V t`` for ``V`` versions tried, whatever the dependence
between versions. The tests are then combined by *weighted Bonferroni*: with
weights ``w_s`` fixed before looking at the text (by which tests exist, i.e. the
asker's keys and registry lengths, never by the scores) and summing to 1,

    p = min(1, min_s V * p_s / w_s),

and ``P(p < t) <= sum_s w_s t = t`` by the union bound, again under any
dependence between the tests (they share the text's tokens, so they are not
independent; Bonferroni does not need them to be). The only assumption left is
the PRF one above. The verdict is :func:`worldcup_core.verdict.verdict_of` of
this ``p``: ``watermarked`` below the fixed 1e-6.

**Evidence needed.** The verdict takes the number of tokens the tests scored:
"not_watermarked" needs :data:`~worldcup_core.verdict.MIN_SCORED_TOKENS` of them
(:func:`worldcup_core.verdict.verdict_of`); below, the verdict is "inconclusive" with
the reason ``too_short``.

**Naming a registry entry.** An answer names an entry only when the registry
test alone is below the watermarked level with every correction
(:attr:`Assessment.entry_p_value` ``< 1e-6``), so a named entry always goes with
the verdict ``watermarked`` (the decoder's posterior must also clear the
service's ``registry_min_confidence``, which only withholds a name).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

from worldcup_core.detector import z_from_log_p
from worldcup_core.scoring import sidak_log_p
from worldcup_core.verdict import (
    VERDICT_WATERMARKED_BELOW,
    Reason,
    Verdict,
    reason_of,
    tokens_needed,
    verdict_of,
)

TestName = Literal["detect", "decode", "registry"]

# Weights of the three kinds of test, split evenly over the payload lengths tested.
# The registry test is the most powerful where it exists (a few candidates instead of
# 2^L messages), so it gets most of the level; without a registry, detect and decode
# share it.
WEIGHTS_WITH_REGISTRY: Final[dict[TestName, float]] = {
    "registry": 0.8,
    "decode": 0.1,
    "detect": 0.1,
}
WEIGHTS_WITHOUT_REGISTRY: Final[dict[TestName, float]] = {"decode": 0.5, "detect": 0.5}
CORRECTION: Final = "weighted Bonferroni over the tests, Bonferroni over the key versions tried"


@dataclass(frozen=True)
class TestP:
    """One test's p-value: the best over the key versions tried (not yet corrected
    for them). ``num_bits`` is None for ``detect``; a registry test's p is already
    corrected for ``registry_size``. ``p_value`` None: the test exists (its weight is
    spent) but gave no p-value for this text (no registry entry under the version the
    data chose), counted as 1."""

    name: TestName
    p_value: float | None
    num_bits: int | None = None
    registry_size: int | None = None
    key_version: int | None = None


@dataclass(frozen=True)
class Assessment:
    """The verdict of a text for one asker, and what it was taken from."""

    verdict: Verdict
    p_value: float  # every correction included
    statistic: TestName  # the test that decided (the smallest corrected p)
    statistic_p_value: float  # that test's own p, before the corrections here
    num_bits: int | None
    key_version: int | None
    threshold: float
    keys_searched: str  # which key set was searched, in words
    versions_tried: int
    weights: tuple[tuple[str, float], ...]  # (test label, weight), as combined
    entry_p_value: float | None  # the registry test alone, fully corrected
    correction: str = CORRECTION
    num_scored: int | None = None  # the scored tokens the tests read
    reason: Reason | None = None  # why inconclusive: too_short, some_evidence, no_agreement
    tokens_needed: int | None = None  # scored tokens an inconclusive answer would need
    tests: tuple[TestP, ...] = ()  # as combined, in the order of ``weights``
    corrected: tuple[float, ...] = ()  # each test's p with every correction, as combined

    @property
    def is_watermarked(self) -> bool:
        return self.verdict == "watermarked"

    def alone(self, index: int) -> Verdict:
        """The verdict test ``index`` would give alone, corrected for the key versions
        searched only: beside the combined one, e.g. the message-free verdict, which
        does not drift as a registry grows."""
        p = self.tests[index].p_value
        shown = 1.0 if p is None else min(1.0, p * self.versions_tried)
        return verdict_of(shown, self.num_scored)

    @property
    def may_name_entry(self) -> bool:
        """Whether an answer may name the registry entry (see the module docstring)."""
        return self.entry_p_value is not None and self.entry_p_value < VERDICT_WATERMARKED_BELOW


def weights_for(tests: Sequence[TestP]) -> list[float]:
    """Each test's weight: its kind's share, split evenly over the tests of that kind.
    Depends only on which tests exist, never on their p-values."""
    kinds = {t.name for t in tests}
    table = WEIGHTS_WITH_REGISTRY if "registry" in kinds else WEIGHTS_WITHOUT_REGISTRY
    present = {k: v for k, v in table.items() if k in kinds}
    total = sum(present.values())
    counts = {k: sum(t.name == k for t in tests) for k in present}
    return [present[t.name] / total / counts[t.name] for t in tests]


def _log_corrected(p_value: float | None, factor: float) -> float:
    if p_value is None or math.isnan(p_value):
        return 0.0
    if p_value <= 0.0:
        return -math.inf
    return min(0.0, math.log(p_value) + math.log(factor))


def assess(
    tests: Sequence[TestP],
    versions_tried: int,
    keys_searched: str,
    num_scored: int | None = None,
) -> Assessment:
    """Combine ``tests`` into one verdict (see the module docstring); ``num_scored``, the
    scored tokens the tests read, decides whether absence may be said (None: no rule,
    for calibration work on p-values alone)."""
    if not tests:
        raise ValueError("assess needs at least one test")
    if versions_tried < 1:
        raise ValueError(f"versions_tried must be >= 1, got {versions_tried}")
    weights = weights_for(tests)
    logs = [
        _log_corrected(t.p_value, versions_tried / w) for t, w in zip(tests, weights, strict=True)
    ]
    best = min(range(len(tests)), key=lambda i: (logs[i], i))
    p_value = math.exp(logs[best])
    chosen = tests[best]
    entry = [math.exp(lp) for t, lp in zip(tests, logs, strict=True) if t.name == "registry"]
    reason = _reason(tests, p_value, num_scored)
    return Assessment(
        verdict=verdict_of(p_value, num_scored),
        p_value=p_value,
        statistic=chosen.name,
        statistic_p_value=1.0 if chosen.p_value is None else chosen.p_value,
        num_bits=chosen.num_bits,
        key_version=chosen.key_version,
        threshold=VERDICT_WATERMARKED_BELOW,
        keys_searched=keys_searched,
        versions_tried=versions_tried,
        weights=tuple((_label(t), w) for t, w in zip(tests, weights, strict=True)),
        entry_p_value=min(entry) if entry else None,
        num_scored=num_scored,
        reason=reason,
        tokens_needed=None if reason == "no_agreement" else tokens_needed(p_value, num_scored),
        tests=tuple(tests),
        corrected=tuple(math.exp(lp) for lp in logs),
    )


def gated_by_agreement(test: TestP) -> bool:
    """Whether the agreement gate (:mod:`worldcup_core.consistency`) capped this test: a
    capped test reports exactly the verdict's level, times the registry's size for the
    registry test (a p-value lands there otherwise with probability zero)."""
    if test.p_value is None:
        return False
    size = (test.registry_size or 1) if test.name == "registry" else 1
    level = VERDICT_WATERMARKED_BELOW * size
    return level < 1.0 and math.isclose(test.p_value, level, rel_tol=1e-9)


def _reason(tests: Sequence[TestP], p_value: float, num_scored: int | None) -> Reason | None:
    reason = reason_of(p_value, num_scored)
    if reason == "some_evidence" and any(gated_by_agreement(t) for t in tests):
        return "no_agreement"
    return reason


def _label(test: TestP) -> str:
    return test.name if test.num_bits is None else f"{test.name}@{test.num_bits}"


# What each test is, in plain words (the nested ``tests`` of every answer).
TEST_STATISTICS: Final[dict[TestName, str]] = {
    "detect": "message-free: do the tokens lean towards this key's watermark at all "
    "(payload unknown); does not change as a registry grows",
    "decode": "payload length known: the same, read in the cells the decoder reads",
    "registry": "registry: does the text agree with one of the tenant's issued entries "
    "(corrected for the registry's size, so it drifts as the registry grows)",
}


@dataclass(frozen=True)
class ComponentTest:
    """One test of an answer, as the nested ``tests`` list shows it."""

    test: TestName
    statistic: str  # TEST_STATISTICS: what it tests, in plain words
    num_bits: int | None
    key_version: int | None
    p_value: float | None  # this test alone, best over the key versions, uncorrected
    weight: float  # its share of the level in the weighted Bonferroni combination
    combined_p_value: float  # min(1, versions * p / weight): the smallest is the answer's p
    z_score: float  # Φ⁻¹(1 − p) of p Šidák-corrected for the versions (normal under H0)
    verdict_alone: Verdict  # this test alone, corrected for the key versions only
    registry_size: int | None  # the registry test: the entries it was corrected for
    decided: bool  # the test the answer's verdict was taken from


def components(assessment: Assessment) -> list[ComponentTest]:
    """The tests an assessment combined, each with its own and its combined p-value."""
    decided = min(
        range(len(assessment.corrected)),
        key=lambda i: (assessment.corrected[i], i),
        default=-1,
    )
    return [
        ComponentTest(
            test=t.name,
            statistic=TEST_STATISTICS[t.name],
            num_bits=t.num_bits,
            key_version=t.key_version,
            p_value=t.p_value,
            weight=w,
            combined_p_value=c,
            z_score=_z(t.p_value, assessment.versions_tried, assessment.num_scored),
            verdict_alone=assessment.alone(i),
            registry_size=t.registry_size if t.name == "registry" else None,
            decided=i == decided,
        )
        for i, (t, (_, w), c) in enumerate(
            zip(assessment.tests, assessment.weights, assessment.corrected, strict=True)
        )
    ]


def _z(p_value: float | None, versions: int, num_scored: int | None) -> float:
    if p_value is None or num_scored == 0:
        return 0.0
    log_p = math.log(p_value) if p_value > 0.0 else -745.0
    return z_from_log_p(sidak_log_p(log_p, versions), 1 if num_scored is None else num_scored)


def answer_tests(assessment: Assessment) -> list[dict[str, Any]]:
    """:func:`components` as JSON-ready dicts (the CLI's and scan's answers)."""
    return [asdict(c) for c in components(assessment)]
