"""Shared schema pieces: the error envelope, strict base models and documented errors."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    """Unknown fields are an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class IntegralFloats(BaseModel):
    """Mixin for strict request models: an integer field takes an integral float."""

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """JSON Schema counts 2.0 as an integer, so an integer field takes it too (and
        nothing else: not "2", not true)."""
        if not isinstance(data, dict):
            return data
        names = _integer_fields(cls)
        return {
            k: int(v) if k in names and isinstance(v, float) and v.is_integer() else v
            for k, v in data.items()
        }


class StrictRequest(IntegralFloats):
    """A request body: unknown fields are an error, and no type is coerced ("1" is not
    1, 0 is not false), so the server accepts exactly what ``/openapi.json`` states."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _integer_fields(model: type[BaseModel]) -> frozenset[str]:
    """Names (and aliases) of the fields typed ``int`` or ``int | None``."""
    names = set()
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = typing.get_args(ann) if isinstance(ann, types.UnionType) else (ann,)
        if int in args and float not in args:
            names.update({name, info.alias or name})
    return frozenset(names)


class ErrorBody(BaseModel):
    message: str
    type: str
    code: str


class ErrorEnvelope(BaseModel):
    error: ErrorBody


RETRY_AFTER: dict[str, object] = {
    "Retry-After": {
        "description": "Seconds to wait before retrying (sent with every 429 and most 503s).",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Bad request",
    401: "Missing or invalid credentials",
    403: "Not allowed",
    404: "Not found",
    409: "Conflict",
    413: "Request body too large",
    422: "Invalid request (the `code` names the rule)",
    429: "Too many requests (Retry-After set)",
    501: "Not implemented by this deployment's role",
    503: "Unavailable: store unreachable, draining, or key material missing (Retry-After set)",
    504: "Timed out",
}


def error_responses(*codes: int, **descriptions: str) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses`` for these error statuses: the envelope, and Retry-After
    on 429 and 503. ``descriptions`` (keyed ``e422=...``) replace the generic text."""
    out: dict[int | str, dict[str, object]] = {}
    for code in codes:
        entry: dict[str, object] = {
            "model": ErrorEnvelope,
            "description": descriptions.get(f"e{code}", ERROR_DESCRIPTIONS[code]),
        }
        if code in (409, 429, 503):  # 409: idempotency_in_progress
            entry["headers"] = RETRY_AFTER
        out[code] = entry
    return out


ERROR_RESPONSES = error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503, 504)
