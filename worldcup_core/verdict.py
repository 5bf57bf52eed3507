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

A verdict always names the statistic it was taken from (:data:`STATISTICS`):
:mod:`worldcup_core.assess` combines the tests an asker may run into one verdict,
and a reader must be able to tell which test decided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

Verdict = Literal["watermarked", "not_watermarked", "inconclusive"]
Statistic = Literal["detect", "decode", "registry", "withheld"]

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

# Which test a verdict was taken from (worldcup_core.assess combines them into one
# verdict per text and asker; every route reports the same one).
STATISTICS: Final[dict[Statistic, str]] = {
    "detect": (
        "message-free detection (payload length unknown), the best of the key versions "
        "searched; weighted-Bonferroni-combined with the decode and registry tests and "
        "corrected for the key versions searched"
    ),
    "decode": (
        "detection with the payload length known (the grouping the decoder reads), the "
        "best of the key versions searched; combined and corrected as above"
    ),
    "registry": (
        "agreement with the tenant's issued registry entries, Bonferroni over the "
        "registry's size, under the key version the data chose; combined and corrected "
        "as above"
    ),
    "withheld": (
        "one decision from every test the asker's keys allow (worldcup_core.assess); "
        "a verdict key is not told which test decided"
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
