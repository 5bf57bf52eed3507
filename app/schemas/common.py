"""Shared schema pieces: the error envelope and strict base models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown fields are an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    message: str
    type: str
    code: str


class ErrorEnvelope(BaseModel):
    error: ErrorBody


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorEnvelope, "description": text}
    for code, text in {
        400: "Bad request",
        401: "Missing or invalid credentials",
        403: "Not allowed",
        404: "Not found",
        409: "Conflict",
        413: "Request body too large",
        422: "Invalid request",
        429: "Too many requests (Retry-After set)",
        503: "Unavailable: store unreachable, draining, or role without a model",
        504: "Timed out",
    }.items()
}
