"""OpenAI's Responses API: ``POST /v1/responses`` and ``GET /v1/responses/{response_id}``.

The router only wires HTTP to :mod:`app.services.openai.responses`, which
translates a Responses request onto the chat route's machinery. Errors use
OpenAI's envelope; auth is the tenant API key (``generate`` scope) as a bearer.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse

from app.api.deps import EngineDep, GeneratingKey, RuntimeDep, UnchargedKey
from app.schemas.openai.common import OPENAI_ERROR_RESPONSES
from app.schemas.openai.responses import ResponseObject, ResponsesRequest
from app.services import receipt
from app.services.openai import responses as serving
from app.services.runtime import charge

router = APIRouter(prefix="/v1", tags=["openai"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    **OPENAI_ERROR_RESPONSES,
    404: {**OPENAI_ERROR_RESPONSES[404], "description": "Unknown model or response id"},
}


@router.post(
    "/responses",
    response_model=ResponseObject,
    responses={
        **_ERRORS,
        200: {
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string"},
                    "example": "event: response.created\n"
                    'data: {"type":"response.created","sequence_number":0,"response":{...}}\n\n',
                }
            },
            "headers": receipt.OPENAPI_HEADERS,
            "description": "A Response, or when stream is true OpenAI's named Server-Sent "
            "Events (response.created ... response.completed).",
        },
    },
    summary="Create a model response (OpenAI Responses API), watermarked",
)
async def create_response(
    body: ResponsesRequest,
    request: Request,
    runtime: RuntimeDep,
    key: UnchargedKey,
    engine: EngineDep,
) -> Any:
    await charge(runtime, key.tenant, 1)
    return await serving.serve(runtime, engine, key.tenant.tenant_id, body, request, key.scopes)


@router.get(
    "/responses/{response_id}",
    response_model=ResponseObject,
    responses={
        **_ERRORS,
        200: {"description": "The stored Response", "headers": receipt.OPENAPI_HEADERS},
    },
    summary="A stored response of this tenant",
)
async def retrieve_response(
    response_id: Annotated[str, Path(min_length=1, max_length=128)],
    runtime: RuntimeDep,
    key: GeneratingKey,
) -> Any:
    stored = await serving.retrieve(runtime, key.tenant.tenant_id, response_id, key.scopes)
    return JSONResponse(stored, headers=receipt.headers([stored["watermark"]]))
