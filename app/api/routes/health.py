"""Liveness, readiness, metrics and version."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import RuntimeDep
from app.api.errors import error_response
from app.schemas.common import ErrorEnvelope
from app.services.readiness import not_ready
from worldcup_core import SCHEME_VERSIONS, __version__

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get(
    "/ready",
    responses={
        503: {
            "model": ErrorEnvelope,
            "description": "Not ready: `draining`, `warming_up`, `store_unavailable`, or "
            "`store_marker_lost` (the store was wiped or replaced since this service started)",
        }
    },
)
async def ready(runtime: RuntimeDep) -> JSONResponse:
    """200 only when the model is warm and the store answers with this service's marker;
    503 while draining."""
    problem = await not_ready(runtime)
    if problem is not None:
        return error_response(503, problem.message, problem.code)
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
