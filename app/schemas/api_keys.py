"""Schemas of a tenant's API keys (admin routes): their scopes and detail level
(what a ``verdict`` key sees: :mod:`app.schemas.exposure`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from app.schemas.common import StrictModel

Scope = Literal["generate", "detect", "decode", "provenance", "fixed_payload"]
Detail = Literal["full", "verdict"]


class CreateApiKey(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w .@-]+$")]
    scopes: Annotated[list[Scope], Field(min_length=1, max_length=5)] = Field(
        description="What the key may call: generate, detect, decode, provenance, "
        "fixed_payload (choosing the payload a generated text carries); provenance and "
        "fixed_payload also need the tenant's grant (admin scopes)."
    )
    detail: Detail = Field(
        "full", description="full: today's detection answers; verdict: three words only."
    )


class ApiKeyOut(StrictModel):
    key_id: str
    name: str
    scopes: list[str]
    detail: Detail
    created_at: datetime
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyOut):
    api_key: str = Field(description="Shown once; only its hash is stored.")


class ApiKeyList(StrictModel):
    keys: list[ApiKeyOut]
