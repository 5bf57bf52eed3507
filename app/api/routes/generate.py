"""POST /generate: embed an explicit payload, or allocate a message id for metadata.

The request's flow is :mod:`app.services.generate_serving`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request

from app.api.deps import EngineDep, GeneratingKey, RuntimeDep
from app.schemas.common import error_responses
from app.schemas.generation import UNSTATED_RULES, GenerateRequest, GenerateResponse
from app.services import generate_serving as serving

router = APIRouter(tags=["watermark"])

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        max_length=128,
        description="Retries with the same key and body return the stored response.",
    ),
]


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={
        **error_responses(
            400,
            401,
            403,
            409,
            413,
            422,
            429,
            501,
            503,
            504,
            e409="Idempotency-Key conflict or still running (Retry-After), or registry_full",
            e422="Invalid request. Beyond the schema: "
            + "; ".join(f"`{code}`: {text}" for code, text in UNSTATED_RULES.items()),
        ),  # fmt: skip
        200: {
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string"},
                    "example": 'data: {"token_id": 42, "text": "Hi"}\n\ndata: [DONE]\n\n',
                }
            },
            "description": "JSON, or Server-Sent Events when stream is true.",
        },
    },
    summary="Generate watermarked text",
)
async def generate(
    body: GenerateRequest,
    request: Request,
    runtime: RuntimeDep,
    key: GeneratingKey,
    engine: EngineDep,
    idempotency_key: IdempotencyKey = None,
) -> Any:
    tenant_id = key.tenant.tenant_id
    return await serving.serve(
        runtime, engine, tenant_id, body, request, idempotency_key, key.scopes
    )
