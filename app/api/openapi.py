"""The published schema states the limits this server enforces.

Some limits are settings (``WORLDCUP_MAX_TEXT_CHARS``, ``_MAX_BATCH_TEXTS``,
``_MAX_NEW_TOKENS_LIMIT``), so the static pydantic models cannot carry them; this
writes them into ``/openapi.json`` when it is first built. A client generated from
the schema then validates exactly as the server does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from app.core.config import Settings
from app.schemas.common import StrictRequest
from app.schemas.watermark import UNSTATED_RULES

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _copy_bounds(published: Any, exact: Any) -> None:
    """Copy numeric bounds from pydantic's schema onto FastAPI's, which passes them
    through a float (2**63 - 1 would be published as 2**63)."""
    if not isinstance(published, dict) or not isinstance(exact, dict):
        return
    for key in _BOUNDS:
        if key in published and key in exact:
            published[key] = exact[key]
    for name, sub in published.get("properties", {}).items():
        _copy_bounds(sub, exact.get("properties", {}).get(name))
    for key in ("anyOf", "oneOf", "allOf"):
        for a, b in zip(published.get(key, []), exact.get(key, []), strict=False):
            _copy_bounds(a, b)
    _copy_bounds(published.get("items"), exact.get("items"))


def _request_models() -> list[type[StrictRequest]]:
    found, todo = [], list(StrictRequest.__subclasses__())
    while todo:
        model = todo.pop()
        found.append(model)
        todo.extend(model.__subclasses__())
    return found


def _property(schema: dict[str, Any], model: str, field: str) -> dict[str, Any] | None:
    """The non-null schema of ``model.field``, if the component exists."""
    component = schema.get("components", {}).get("schemas", {}).get(model)
    if component is None:
        return None
    prop: dict[str, Any] | None = component.get("properties", {}).get(field)
    if prop is None:
        return None
    options: list[dict[str, Any]] = prop.get("anyOf", [])
    return next((o for o in options if o.get("type", "null") != "null"), prop)


def apply_limits(schema: dict[str, Any], settings: Settings) -> None:
    """Write this server's configured limits into an OpenAPI document, in place."""
    components = schema.get("components", {}).get("schemas", {})
    for request_model in _request_models():
        if request_model.__name__ in components:
            _copy_bounds(components[request_model.__name__], request_model.model_json_schema())
    for model in ("DecodeRequest", "DetectRequest", "ProvenanceRequest"):
        if (prop := _property(schema, model, "text")) is not None:
            prop["maxLength"] = settings.max_text_chars
    for model in ("DecodeBatchRequest", "DetectBatchRequest"):
        if (prop := _property(schema, model, "texts")) is not None:
            prop["maxItems"] = settings.max_batch_texts
    for field in ("max_new_tokens", "min_new_tokens"):
        if (prop := _property(schema, "GenerateRequest", field)) is not None:
            prop["maximum"] = min(prop.get("maximum", 2**31), settings.max_new_tokens_limit)
            if "default" in prop:
                prop["default"] = min(prop["default"], prop["maximum"])
    for model, field in (
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
        ("CompletionRequest", "max_tokens"),
    ):
        if (prop := _property(schema, model, field)) is not None:
            prop["maximum"] = settings.max_new_tokens_limit
    rules = "\n".join(f"* `{code}`: {text}" for code, text in UNSTATED_RULES.items())
    info = schema.setdefault("info", {})
    info["description"] = (
        info.get("description", "")
        + "\n\nEvery rule the server enforces on a request is in this schema, with this "
        "server's limits, except these (a 422 with the `code` named):\n\n"
        + rules
        + "\n\nAnd a request body over the server's byte limit "
        "(`WORLDCUP_MAX_BODY_BYTES`, `WORLDCUP_MAX_BATCH_BODY_BYTES` on `/…/batch`) "
        "is refused with 413 `request_too_large`, whatever it holds."
    )


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make ``app.openapi()`` return the document with this server's limits."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            apply_limits(build(), settings)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
