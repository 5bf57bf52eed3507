"""One verdict, and its wording, for every answer the project gives about a text.

Every place that turns a test's p-value into words calls :func:`verdict_of` (the
word) and :func:`verdict_sentence` (the sentence a person reads): the API's
``verdict`` keys, the console and its saved cases, ``worldcup detect`` and
``worldcup scan``. The levels are fixed on purpose, not settings: a public
checker's answers must mean the same thing everywhere.

* ``watermarked``: p < 1e-6 (a false accusation at most once in a million
  unwatermarked texts);
* ``not_watermarked``: p >= 0.05;
* ``inconclusive``: in between. Some evidence, not enough to accuse.

A verdict always names the statistic it was taken from (:data:`STATISTICS`): the
routes run different tests on purpose, and a reader must be able to tell which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

Verdict = Literal["watermarked", "not_watermarked", "inconclusive"]
Statistic = Literal["detect", "decode", "provenance"]

VERDICTS: Final[tuple[Verdict, ...]] = ("watermarked", "inconclusive", "not_watermarked")
VERDICT_WATERMARKED_BELOW: Final = 1e-6
VERDICT_CLEAN_FROM: Final = 0.05
VERDICT_LEVELS: Final[dict[str, float]] = {
    "watermarked": VERDICT_WATERMARKED_BELOW,
    "not_watermarked": VERDICT_CLEAN_FROM,
}

HEADLINES: Final[dict[Verdict, str]] = {
    "watermarked": "Watermarked",
    "not_watermarked": "No watermark found",
    "inconclusive": "Inconclusive",
}

# Which test a verdict was taken from, and why that route runs it.
STATISTICS: Final[dict[Statistic, str]] = {
    "detect": (
        "message-free detection: the calibrated test of the tenant's key versions, "
        "corrected for the number of versions (what /detect reports)"
    ),
    "decode": (
        "payload decoding: the test of the decoded message under the best key version, "
        "corrected for the number of versions; it reads the payload and registry entry, "
        "and is often more significant than message-free detection (what a full key's "
        "/decode reports)"
    ),
    "provenance": (
        "provenance search: the best of every tenant's key versions, Šidák-corrected for "
        "the number of keys searched (what /provenance reports)"
    ),
}


def verdict_of(p_value: float) -> Verdict:
    """The verdict of a p-value: the one function every route, page and tool uses."""
    if math.isnan(p_value):
        return "inconclusive"
    if p_value < VERDICT_WATERMARKED_BELOW:
        return "watermarked"
    if p_value >= VERDICT_CLEAN_FROM:
        return "not_watermarked"
    return "inconclusive"


def format_p(p_value: float) -> str:
    """A p-value as the console and the CLI print it."""
    if p_value == 0.0:
        return "< 1e-300"
    if p_value < 1e-3:
        return f"{p_value:.1e}"
    return f"{p_value:.2g}"


@dataclass(frozen=True)
class VerdictReport:
    """A verdict, the statistic it came from and the sentence that says it."""

    verdict: Verdict
    statistic: Statistic
    p_value: float | None  # None where the caller may not see it (verdict keys)
    headline: str
    sentence: str
    why: str


def verdict_sentence(verdict: Verdict, statistic: Statistic, p_value: float | None) -> str:
    """The words for a verdict: its headline, the p-value when shown, and the rule."""
    head = HEADLINES[verdict]
    shown = "" if p_value is None else f"p = {format_p(p_value)}; "
    rule = {
        "watermarked": "below 1e-6",
        "not_watermarked": "0.05 or more",
        "inconclusive": "between 1e-6 and 0.05: some evidence, not enough to say watermarked",
    }[verdict]
    return f"{head} ({shown}{statistic} statistic {rule})"


def report(p_value: float, statistic: Statistic, show_p: bool = True) -> VerdictReport:
    """The verdict of a test's p-value, worded; ``show_p`` False keeps the p-value out."""
    verdict = verdict_of(p_value)
    shown = p_value if show_p else None
    return VerdictReport(
        verdict=verdict,
        statistic=statistic,
        p_value=shown,
        headline=HEADLINES[verdict],
        sentence=verdict_sentence(verdict, statistic, shown),
        why=STATISTICS[statistic],
    )
