"""POST /provenance: whose watermark is this? Searches every tenant and key version.

For trust-and-safety: the admin token, or a tenant API key granted the
``provenance`` scope. Every query is written to the audit log (who, when, what
was found; never the text) *before* the answer is sent: if the audit write
fails, the caller gets a 503 and no answer.
"""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import InvestigatorDep, RuntimeDep
from app.schemas.collection import CollectionRequest, CollectionResponse, CollectionVerdict
from app.schemas.common import ERROR_RESPONSES
from app.schemas.exposure import ProvenanceVerdict
from app.schemas.watermark import ProvenanceRequest, ProvenanceResponse
from app.services import collection
from app.services import provenance as search

router = APIRouter(tags=["trust and safety"])


@router.post(
    "/provenance",
    response_model=ProvenanceResponse | ProvenanceVerdict,
    responses=ERROR_RESPONSES,
)
async def provenance(
    body: ProvenanceRequest, runtime: RuntimeDep, who: InvestigatorDep
) -> ProvenanceResponse | ProvenanceVerdict:
    """Which tenant, key version and registry entry produced this text, if any.
    ``evidence`` (admin token only) adds the best key's per-token evidence. A
    ``verdict`` key gets one word (see VERDICT_LEVELS); a tenant key's queries
    count against its tenant's probe budget."""
    return await search.provenance(runtime, who, body)


@router.post(
    "/provenance/collection",
    response_model=CollectionResponse | CollectionVerdict,
    responses=ERROR_RESPONSES,
)
async def provenance_collection(
    body: CollectionRequest, runtime: RuntimeDep, who: InvestigatorDep
) -> CollectionResponse | CollectionVerdict:
    """Many texts declared to share a source (an account's posts), read together: one
    joint verdict from an exact joint test (a (context, token) repeated across the set
    counts once), the tenant and key that decided, with ``group_by`` the metadata value
    that best explains the set (corrected for the distinct values searched), and each
    text's own answer. Same scopes as /provenance; each text counts against the probe
    budget."""
    return await collection.read_together(runtime, who, body)
