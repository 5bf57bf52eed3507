"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

The router only wires HTTP to :mod:`app.services.openai` (the adapter),
which runs on the same machinery as ``/generate``. Errors here use OpenAI's
envelope (``app.api.errors``); auth is the tenant API key as a bearer token,
exactly what the SDKs send.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from app.api.deps import CurrentTenant, EngineDep, RuntimeDep, UnchargedKey
from app.api.routes.generate import IdempotencyKey
from app.schemas.openai.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from app.schemas.openai.common import OPENAI_ERROR_RESPONSES, ModelCard, ModelList
from app.schemas.openai.completions import Completion, CompletionChunk, CompletionRequest
from app.services import receipt
from app.services.openai import chat as chat_api
from app.services.openai import completions as completions_api
from app.services.openai import models
from app.services.openai.completions import COMPLETIONS
from app.services.openai.serve import serve
from app.services.runtime import charge

router = APIRouter(prefix="/v1", tags=["openai"])
_STARTED = time.time()


def _streamed(chunk: type[Any], example: str) -> dict[int | str, dict[str, Any]]:
    return {
        **OPENAI_ERROR_RESPONSES,
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}, "example": example}},
            "headers": receipt.OPENAPI_HEADERS,
            "description": "JSON, or when stream is true OpenAI's Server-Sent Events: one "
            f"{chunk.__name__} per `data:` event, then `data: [DONE]`.",
        },
    }


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses=_streamed(
        ChatCompletionChunk,
        'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[...]}\n\n'
        "data: [DONE]\n\n",
    ),
    summary="Chat completion (OpenAI-compatible), watermarked",
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    runtime: RuntimeDep,
    key: UnchargedKey,
    engine: EngineDep,
    idempotency_key: IdempotencyKey = None,
) -> Any:
    await charge(runtime, key.tenant, body.n or 1)  # one token per sample
    pending = await chat_api.plan(runtime, body)
    tenant_id = key.tenant.tenant_id
    return await serve(
        runtime, engine, tenant_id, pending, request, idempotency_key, chat_api.CHAT, key.scopes
    )


@router.post(
    "/completions",
    response_model=Completion,
    responses=_streamed(
        CompletionChunk,
        'data: {"id":"cmpl-1","object":"text_completion","choices":[...]}\n\ndata: [DONE]\n\n',
    ),
    summary="Text completion (OpenAI-compatible), watermarked",
)
async def completions(
    body: CompletionRequest,
    request: Request,
    runtime: RuntimeDep,
    key: UnchargedKey,
    engine: EngineDep,
    idempotency_key: IdempotencyKey = None,
) -> Any:
    await charge(runtime, key.tenant, (body.n or 1) * len(body.prompts()))
    pending = await completions_api.plan(runtime, body)
    tenant_id = key.tenant.tenant_id
    return await serve(
        runtime, engine, tenant_id, pending, request, idempotency_key, COMPLETIONS, key.scopes
    )


@router.get(
    "/models",
    response_model=ModelList,
    responses=OPENAI_ERROR_RESPONSES,
    summary="The model this server generates with",
)
async def list_models(runtime: RuntimeDep, tenant: CurrentTenant) -> ModelList:
    return models.model_list(runtime, _STARTED)


@router.get(
    "/models/{model}",
    response_model=ModelCard,
    responses=OPENAI_ERROR_RESPONSES,
    summary="One model",
)
async def retrieve_model(model: str, runtime: RuntimeDep, tenant: CurrentTenant) -> ModelCard:
    return models.model_card(runtime, _STARTED, model)
