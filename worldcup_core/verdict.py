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

**No verdict without evidence.** "not_watermarked" is evidence of absence, so it is
said only where a watermark, had it been there, would probably have been found: from
:data:`MIN_SCORED_TOKENS` scored tokens on. Below that, a text that would have been
"not_watermarked" is "inconclusive" with the reason ``too_short`` (a 1-word text, a
text left empty by masking). The line comes from measured power, not a choice: the
number of scored tokens at which default-preset answers (``frontier``) reach the
verdict's level with the message-free test alone at least half the time, at
temperature 1.0, the service's default sampling temperature (``/generate`` and the
OpenAI routes). Source: ``docs/results/grid/results.json`` (``worldcup bench grid``, 40
answers a cell: 32 tokens 6 of 40, 64 tokens 19 of 40, 128 tokens 36 of 40; linear
between the lengths measured, 50 % at 68 generated tokens, of which at most 66 are
scored); :func:`worldcup_cli.grid_bench.absence_line` recomputes it and a test holds
this constant to it. Texts sampled cooler carry less per token (at 0.7 even 256
tokens reach the level only a third of the time), so for them "not_watermarked" is
weaker evidence than the line promises: docs/api.md says so.

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
# why a verdict is inconclusive: too few scored tokens for absence to mean anything,
# some evidence that is not enough to say watermarked, or evidence whose tokens do not
# agree within cells, as a stolen-watermark spoof's do not (worldcup_core.consistency)
Reason = Literal["too_short", "some_evidence", "no_agreement"]

VERDICTS: Final[tuple[Verdict, ...]] = ("watermarked", "inconclusive", "not_watermarked")
VERDICT_WATERMARKED_BELOW: Final = 1e-6
VERDICT_CLEAN_FROM: Final = 0.05
MIN_SCORED_TOKENS: Final = 66  # see the module docstring: derived from measured power
MIN_SCORED_SOURCE: Final = (
    "the message-free test reaches p < 1e-6 on half of the default preset's answers at "
    "temperature 1.0 from this many scored tokens (docs/results/grid/results.json)"
)
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
        "the message-free test: do the tokens lean towards the key's watermark at all "
        "(payload unknown); its p is multiplied for the other tests and key versions tried "
        "(Bonferroni), so trying several cannot make chance look significant"
    ),
    "decode": (
        "the test at the payload length: the same lean, read in the cells the decoder "
        "reads; its p is multiplied for the other tests and key versions tried"
    ),
    "registry": (
        "the registry test: does the text match one of the messages the tenant issued; "
        "its p is multiplied by the number issued (Bonferroni: so it grows as the registry "
        "grows) and "
        "for the other tests tried"
    ),
    "withheld": (
        "one decision from every test the asker's keys allow (worldcup_core.assess); "
        "a verdict key is not told which test decided"
    ),
}


def verdict_of(p_value: float, num_scored: int | None = None) -> Verdict:
    """The verdict of a p-value: the one function every route, page and tool uses.
    With ``num_scored`` (the scored tokens the test read), "not_watermarked" needs at
    least :data:`MIN_SCORED_TOKENS` of them; every answer about a text passes it."""
    if math.isnan(p_value):
        return "inconclusive"
    if p_value < VERDICT_WATERMARKED_BELOW:
        return "watermarked"
    if p_value >= VERDICT_CLEAN_FROM and not too_short(num_scored):
        return "not_watermarked"
    return "inconclusive"


def too_short(num_scored: int | None) -> bool:
    """Whether a text has too few scored tokens for "not_watermarked" to mean absence."""
    return num_scored is not None and num_scored < MIN_SCORED_TOKENS


def reason_of(p_value: float, num_scored: int | None) -> Reason | None:
    """Why a verdict is inconclusive (None for the other two verdicts)."""
    if verdict_of(p_value, num_scored) != "inconclusive":
        return None
    return "too_short" if too_short(num_scored) else "some_evidence"


def tokens_needed(p_value: float, num_scored: int | None) -> int | None:
    """For an inconclusive verdict, the scored tokens an answer would need: the line
    below which absence is not said, or, with enough tokens and some evidence, the
    length at which evidence of this strength per token would reach the watermarked
    level (log p grows about linearly with the tokens scored). None otherwise."""
    reason = reason_of(p_value, num_scored)
    if reason is None or num_scored is None:
        return None
    if reason == "too_short" and not 0.0 < p_value < VERDICT_CLEAN_FROM:
        return MIN_SCORED_TOKENS
    ratio = math.log(VERDICT_WATERMARKED_BELOW) / math.log(max(p_value, 1e-300))
    return max(MIN_SCORED_TOKENS, math.ceil(max(num_scored, 1) * ratio))


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
    reason: Reason | None = None


def verdict_sentence(
    verdict: Verdict,
    statistic: Statistic,
    p_value: float | None,
    num_scored: int | None = None,
) -> str:
    """The words for a verdict: its headline, the p-value when shown, and the rule."""
    head = HEADLINES[verdict]
    shown = "" if p_value is None else f"p = {format_p(p_value)}; "
    if verdict == "inconclusive" and too_short(num_scored):
        return (
            f"{head}: too short ({shown}{num_scored} scored tokens; 'not watermarked' needs "
            f"{MIN_SCORED_TOKENS}, where a watermark would have been found at least half "
            "the time)"
        )
    rule = {
        "watermarked": "below 1e-6",
        "not_watermarked": "0.05 or more",
        "inconclusive": "between 1e-6 and 0.05: some evidence, not enough to say watermarked",
    }[verdict]
    return f"{head} ({shown}{statistic} statistic {rule})"


def report(
    p_value: float, statistic: Statistic, show_p: bool = True, num_scored: int | None = None
) -> VerdictReport:
    """The verdict of a test's p-value, worded; ``show_p`` False keeps the p-value out."""
    verdict = verdict_of(p_value, num_scored)
    shown = p_value if show_p else None
    return VerdictReport(
        verdict=verdict,
        statistic=statistic,
        p_value=shown,
        headline=HEADLINES[verdict],
        sentence=verdict_sentence(verdict, statistic, shown, num_scored),
        why=STATISTICS[statistic],
        reason=reason_of(p_value, num_scored),
    )
