"""Schemas of the admin routes: tenants and their scopes, key rotation, master-key
rotation, the registry lookup and the provenance audit log (API keys:
:mod:`app.schemas.api_keys`)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import Field

from app.schemas.common import StrictModel

Scope = Literal["provenance", "fixed_payload"]


class CreateTenant(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w .@-]+$")]
    scopes: Annotated[list[Scope], Field(max_length=8)] = Field(
        default_factory=list,
        description="'provenance' lets this API key search every tenant (POST /provenance); "
        "'fixed_payload' lets its keys choose the payload a text carries (`payload` on "
        "/generate, `watermark.payload` on /v1) instead of a registry-issued one, each "
        "payload a capped number of times (WORLDCUP_FIXED_PAYLOAD_REPEATS).",
    )


class TenantCreated(StrictModel):
    tenant_id: str
    name: str
    api_key: str = Field(description="Shown once; only its hash is stored.")
    key_version: int
    scopes: list[str]


class SetScopes(StrictModel):
    scopes: Annotated[list[Scope], Field(max_length=8)]


class SetRetention(StrictModel):
    days: Annotated[float | None, Field(gt=0, le=36_500)] = Field(
        description="Registry retention in days; null keeps entries forever (the default)."
    )


class RetentionOut(StrictModel):
    tenant_id: str
    days: float | None


class SweepOut(StrictModel):
    expired: dict[str, int] = Field(description="Entries deleted, per tenant with retention.")


class TenantOut(StrictModel):
    tenant_id: str
    name: str
    scopes: list[str]
    created_at: dt.datetime


class KeyVersionOut(StrictModel):
    version: int
    created_at: dt.datetime
    context_width: int = Field(
        description="The tokens before each token that seed its watermark (c): 2 for key "
        "versions issued before 2026-11-29, 4 since."
    )
    scheme: str
    current: bool = Field(description="The version new texts are issued under (the newest).")


class TenantKeys(StrictModel):
    tenant_id: str
    name: str
    scopes: list[str]
    created_at: dt.datetime
    key_version: int = Field(description="The current key version.")
    narrow_context: bool = Field(
        description="The current key version's context is narrower than the one new key "
        "versions get (WORLDCUP_CONTEXT_WIDTH): its texts teach a watermark-stealing client "
        "more, so spoofs come easier (SECURITY.md, Forgery and framing). Rotating the key "
        "(POST /admin/tenants/{id}/rotate-key) issues new texts at the current width; "
        "texts of every version keep decoding."
    )
    key_versions: list[KeyVersionOut]


class TenantList(StrictModel):
    tenants: list[TenantKeys]


class Rewrapped(StrictModel):
    rewrapped: int = Field(description="Keys re-encrypted under the current master key.")
    already_current: int


class AuditEntry(StrictModel):
    id: str
    at: dt.datetime
    actor: str
    action: str
    request_id: str
    outcome: dict[str, Any]


class AuditLog(StrictModel):
    entries: list[AuditEntry]


class KeyRotated(StrictModel):
    tenant_id: str
    key_version: int


class RegistryEntryOut(StrictModel):
    tenant_id: str
    message_id: int
    key_version: int
    num_bits: int
    metadata: dict[str, Any]
    issued_at: dt.datetime
