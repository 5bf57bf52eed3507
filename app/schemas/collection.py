"""Request and response models of POST /provenance/collection: many texts read together."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from app.schemas.common import StrictModel, StrictRequest
from app.schemas.exposure import DetailReason, reason_field
from app.schemas.watermark import BatchItemError, BatchText, _VerdictAnswer
from worldcup_core.verdict import Reason, Verdict

GROUP_BY_DESCRIPTION = (
    "A registry metadata field (e.g. user_id): the value whose issued entries best explain "
    "the set, corrected for the number of distinct values searched (not the number of "
    "entries). Named only when the joint verdict is watermarked and that corrected p is "
    "below the watermarked level. A field no entry holds searches nothing and says so."
)


class CollectionRequest(StrictRequest):
    texts: Annotated[list[BatchText], Field(min_length=1, max_length=10_000)] = Field(
        description="Texts declared to share a source (an account's posts), at most the "
        "server's batch limit (default 1000), each at most the text limit. Read together: "
        "a (context, token) repeated across texts counts once, so a copied sentence or a "
        "text posted twice adds nothing. Each text counts against the probe budget."
    )
    group_by: Annotated[str | None, Field(min_length=1, max_length=64)] = Field(
        None, description=GROUP_BY_DESCRIPTION
    )

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [
                {
                    "texts": ["The first post of an account.", "Its second post, a day later."],
                    "group_by": "user_id",
                }
            ]
        },
    }


class CollectionGroup(StrictModel):
    """The group search (``group_by``): which metadata value best explains the set."""

    field: str = Field(description="The metadata field searched.")
    value: str | None = Field(
        description="The named value, only when may_name: the joint verdict is watermarked "
        "and p_value is below threshold. None otherwise."
    )
    may_name: bool = Field(description="Whether the value may be named (see value).")
    p_value: float | None = Field(
        description="The best value's p, corrected for values_searched (union bound): "
        "min(1, values_searched x its own p). None when nothing was searched."
    )
    values_searched: int = Field(
        description="The distinct values of the field among the entries issued under the "
        "key that decided (the correction's count)."
    )
    entries_searched: int = Field(description="The registry entries those values hold.")
    message: str


class CollectionText(StrictModel):
    """One text's own answer, beside the joint one: its own test under the key the set
    chose (the message-free test, corrected for the keys searched), not de-duplicated."""

    index: int
    verdict: Verdict | None = Field(description="None when the text was refused (see error).")
    p_value: float | None = Field(
        description="This text alone: the message-free test under the key the set chose, "
        "corrected for the keys searched."
    )
    reason: Reason | None = None
    tokens_needed: int | None = None
    num_tokens: int = 0
    num_scored_tokens: int = 0
    num_units: int = Field(
        0,
        description="Its scored tokens the joint test kept: those whose (context, token) "
        "no other text of the set holds first.",
    )
    error: BatchItemError | None = Field(
        None, description="A refused text (probe_budget_exceeded): left out of the joint test."
    )


class CollectionResponse(_VerdictAnswer):
    found: bool = Field(description="The joint verdict is watermarked: tenant_id names the key.")
    message: str
    tenant_id: str | None = Field(description="The tenant whose key decided, when found.")
    tenant_name: str | None
    key_version: int | None = Field(description="That key's version, when found.")
    num_keys: int = Field(description="Every tenant's key versions searched.")
    num_tenants: int
    num_texts: int = Field(description="Texts read together (refused ones left out).")
    num_tokens: int
    num_units: int = Field(
        description="Scored tokens of the joint test, after de-duplication across the set."
    )
    group: CollectionGroup | None = Field(description="The group search; None without group_by.")
    texts: list[CollectionText]


class CollectionVerdict(StrictModel):
    """/provenance/collection under a ``verdict`` key: the joint verdict and, for
    ``watermarked``, whose key and the named group value; no p-values or counts."""

    detail: Literal["verdict"] = "verdict"
    detail_reason: DetailReason = reason_field()
    verdict: Verdict
    tenant_id: str | None = None
    group_value: str | None = None
