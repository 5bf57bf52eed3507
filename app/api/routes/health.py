"""Liveness, readiness, metrics and version."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import RuntimeDep
from app.api.errors import error_response
from app.stores.base import StoreUnavailable
from worldcup_core import SCHEME_VERSIONS, __version__

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "not ready"}})
async def ready(runtime: RuntimeDep) -> JSONResponse:
    """200 only when the model is warm and the store answers; 503 while draining."""
    if runtime.draining:
        return error_response(503, "draining for shutdown", "draining")
    if not runtime.warm:
        return error_response(503, "model is loading", "warming_up")
    try:
        await runtime.store.ping()
    except StoreUnavailable:
        return error_response(503, "the registry store is unreachable", "store_unavailable")
    return JSONResponse({"status": "ready"})


@router.get("/metrics", include_in_schema=False)
async def metrics(runtime: RuntimeDep) -> Response:
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version(runtime: RuntimeDep) -> dict[str, str]:
    return {
        "app_version": __version__,
        "scheme_version": runtime.settings.scheme,  # of new key versions
        "schemes_supported": ", ".join(SCHEME_VERSIONS),
        "model_id": runtime.model_id,
        "role": runtime.settings.role.value,
    }
