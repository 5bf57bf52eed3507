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
    "Verdict",
    "verdict_of",
]


BITS_WITHHELD = (
    "null unless the key holds the `provenance` scope (an analyst's key): payload bits "
    "are the labels a watermark-stealing attacker learns from (SECURITY.md, Forgery and "
    "framing; app.services.disclosure)"
)


class DetectVerdict(StrictModel):
    """/detect under a ``verdict`` key."""

    detail: Literal["verdict"] = "verdict"
    verdict: Verdict = Field(
        description="watermarked: p < 1e-6; not_watermarked: p >= 0.05; inconclusive between."
    )


class ProvenanceVerdict(StrictModel):
    """/provenance under a ``verdict`` key holding the ``provenance`` scope: the verdict
    of the search (its Šidák-corrected p-value) and, for ``watermarked``, whose key;
    no p-values, bits, token counts or runner-ups."""

    detail: Literal["verdict"] = "verdict"
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
    verdict: Verdict = Field(
        description="Of the message-free detection statistic, as /detect: watermarked: "
        "p < 1e-6; not_watermarked: p >= 0.05; inconclusive between."
    )
    registry_match: VerdictRegistryMatch | None
