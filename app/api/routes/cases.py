"""The console's cases: ``/console/api/cases``. Parse, call :mod:`app.services.cases`, answer.

The credential is the admin token or a tenant API key that holds the provenance,
decode or detect scope; what each may see is decided in the service.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response

from app.api.deps import Credentials, RuntimeDep, get_principal, is_admin
from app.core.errors import APIError
from app.schemas.cases import BatchRequest, CheckRequest
from app.services import cases
from app.services.cases import Analyst

router = APIRouter(prefix="/console/api", include_in_schema=False)

_CONSOLE_SCOPES = {"provenance", "decode", "detect"}


async def console_analyst(runtime: RuntimeDep, credentials: Credentials) -> Analyst:
    if is_admin(runtime, credentials):
        return Analyst(None)
    principal = await get_principal(runtime, credentials)
    if not _CONSOLE_SCOPES & principal.scopes:
        raise APIError(
            403,
            "the console needs a key with the provenance, decode or detect scope",
            "missing_scope",
        )
    return Analyst(principal)


AnalystDep = Annotated[Analyst, Depends(console_analyst)]
Format = Literal["json", "csv"]


def _download(items: list[dict[str, Any]] | dict[str, Any], fmt: Format, name: str) -> Response:
    rows = items if isinstance(items, list) else [items]
    if fmt == "csv":
        body, media = cases.to_csv(rows), "text/csv; charset=utf-8"
    else:
        body, media = json.dumps(items, indent=2, ensure_ascii=False), "application/json"
    return Response(
        body,
        media_type=media,
        headers={"Content-Disposition": f'attachment; filename="{name}.{fmt}"'},
    )


@router.post("/cases", status_code=201)
async def create_case(body: CheckRequest, runtime: RuntimeDep, analyst: AnalystDep) -> Any:
    case, answer = await cases.check(runtime, analyst, body.mode, body.text, body.keep_text)
    return {"case": case, "result": answer.model_dump(mode="json")}


@router.post("/cases/batch")
async def create_batch(body: BatchRequest, runtime: RuntimeDep, analyst: AnalystDep) -> Any:
    return await cases.batch(
        runtime, analyst, body.mode, body.filename, body.content, body.field, body.keep_text
    )


@router.get("/cases")
async def list_cases(
    runtime: RuntimeDep,
    analyst: AnalystDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    batch_id: Annotated[str | None, Query(max_length=64)] = None,
) -> Any:
    return {"cases": await cases.history(runtime, analyst, limit, batch_id)}


@router.get("/cases/export")
async def export_cases(
    runtime: RuntimeDep,
    analyst: AnalystDep,
    format: Format = "json",  # noqa: A002 - the query parameter's name
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
    batch_id: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    found = await cases.history(runtime, analyst, limit, batch_id)
    return _download(found, format, f"batch-{batch_id}" if batch_id else "cases")


@router.get("/cases/{case_id}")
async def get_case(case_id: str, runtime: RuntimeDep, analyst: AnalystDep) -> Any:
    return await cases.get(runtime, analyst, case_id)


@router.get("/cases/{case_id}/export")
async def export_case(
    case_id: str,
    runtime: RuntimeDep,
    analyst: AnalystDep,
    format: Format = "json",  # noqa: A002 - the query parameter's name
) -> Response:
    return _download(await cases.get(runtime, analyst, case_id), format, f"case-{case_id}")


@router.delete("/cases/{case_id}", status_code=204)
async def delete_case(case_id: str, runtime: RuntimeDep, analyst: AnalystDep) -> Response:
    await cases.delete(runtime, analyst, case_id)
    return Response(status_code=204)
