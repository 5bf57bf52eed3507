"""Schemas of the ``verdict`` detail level (API keys themselves: :mod:`app.schemas.api_keys`).

A ``verdict`` key sees one of three words per text, at fixed levels of the
calibrated p-value (:mod:`worldcup_core.verdict`, the one verdict function of the
project, re-exported here), and nothing else that is
graded: no p-value, z, per-bit values or decoded bits. A removal attack then
gets one bit per query instead of a score to climb down.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from app.schemas.common import StrictModel
from worldcup_core.verdict import (
    VERDICT_CLEAN_FROM,
    VERDICT_LEVELS,
    VERDICT_WATERMARKED_BELOW,
    Verdict,
    verdict_of,
)

__all__ = [
    "VERDICT_CLEAN_FROM",
    "VERDICT_LEVELS",
    "VERDICT_WATERMARKED_BELOW",
    "FULL_ANSWERS_SPENT",
    "DetailReason",
    "Verdict",
    "verdict_of",
]


DetailReason = Literal["verdict_key", "full_answers_spent"]

DETAIL_REASON = (
    "Why this answer is the verdict only. verdict_key: the API key's detail level. "
    "full_answers_spent: a `full` key's answer about a text it (or another key of its "
    "tenant) already asked about `probe_full_answers` times within the probe window "
    "(default 3 a day): later answers about that text are the verdict only, so its "
    "p-value cannot be climbed query by query (SECURITY.md, the patient oracle "
    "attacker); full answers about it return as those queries leave the window."
)


FULL_ANSWERS_SPENT = (
    "this text was asked about more often within the probe window than a full key is "
    "answered in full (probe_full_answers): the verdict only, so its p-value cannot be "
    "climbed edit by edit"
)


def reason_of_detail(detail: str) -> DetailReason:
    """Why a verdict-only answer is one, from the asking key's detail level: a verdict
    key's level, or a full key's text past its full answers."""
    return "verdict_key" if detail == "verdict" else "full_answers_spent"


def reason_field() -> Any:
    """The ``detail_reason`` field of every verdict-only answer."""
    return Field("verdict_key", description=DETAIL_REASON)


BITS_WITHHELD = (
    "null unless the key holds the `provenance` scope (an analyst's key): payload bits "
    "are the labels a watermark-stealing attacker learns from (SECURITY.md, Forgery and "
    "framing; app.services.disclosure)"
)


class DetectVerdict(StrictModel):
    """/detect under a ``verdict`` key."""

    detail: Literal["verdict"] = "verdict"
    detail_reason: DetailReason = reason_field()
    verdict: Verdict = Field(
        description="watermarked: p < 1e-6; not_watermarked: p >= 0.05; inconclusive between."
    )


class ProvenanceVerdict(StrictModel):
    """/provenance under a ``verdict`` key holding the ``provenance`` scope: the verdict
    of the search (its Šidák-corrected p-value) and, for ``watermarked``, whose key;
    no p-values, bits, token counts or runner-ups."""

    detail: Literal["verdict"] = "verdict"
    detail_reason: DetailReason = reason_field()
    verdict: Verdict = Field(
        description="watermarked: p < 1e-6; not_watermarked: p >= 0.05; inconclusive between."
    )
    tenant_id: str | None = Field(
        None, description="The tenant whose key matched, when the verdict is watermarked."
    )


class VerdictRegistryMatch(StrictModel):
    message_id: int | None = Field(description="Null for a client-chosen payload.")
    metadata: dict[str, Any]
    issued_at: datetime | None = Field(description="Null for a client-chosen payload.")
    client_payload: bool = False


class DecodeVerdict(StrictModel):
    """/decode under a ``verdict`` key: the verdict and whose text it is, no bits or scores.

    The verdict is taken from the same statistic as /detect's (message-free detection),
    so one key's /decode and /detect of one text always agree."""

    detail: Literal["verdict"] = "verdict"
    detail_reason: DetailReason = reason_field()
    verdict: Verdict = Field(
        description="Of the message-free detection statistic, as /detect: watermarked: "
        "p < 1e-6; not_watermarked: p >= 0.05; inconclusive between."
    )
    registry_match: VerdictRegistryMatch | None
