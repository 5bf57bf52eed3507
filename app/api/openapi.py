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
from pydantic.json_schema import models_json_schema

from app.core.config import Settings
from app.schemas.common import IntegralFloats
from app.schemas.generation import UNSTATED_RULES, prompt_chars_limit
from app.schemas.openai.chat import ChatCompletionChunk
from app.schemas.openai.common import OPENAI_UNSTATED_RULES
from app.schemas.openai.completions import CompletionChunk
from app.schemas.openai.responses import RESPONSES_UNSTATED_RULES, STREAM_EVENTS

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


def _request_models() -> list[type[IntegralFloats]]:
    """Every request model: the native ones and the OpenAI-compatible ones."""
    found, todo = [], list(IntegralFloats.__subclasses__())
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
            prop["maxLength"] = settings.text_chars_limit
    for model, field in (("GenerateRequest", "prompt"), ("ChatMessage", "content")):
        if (prop := _property(schema, model, field)) is not None:
            prop["maxLength"] = prompt_chars_limit(settings)
    for model in ("DecodeBatchRequest", "DetectBatchRequest", "CollectionRequest"):
        if (prop := _property(schema, model, "texts")) is not None:
            prop["maxItems"] = settings.max_batch_texts
    if (prop := _property(schema, "CollectionRequest", "texts")) is not None:
        # one text over the limit refuses the whole collection (a batch fails that item)
        prop.setdefault("items", {})["maxLength"] = settings.text_chars_limit
    for field in ("max_new_tokens", "min_new_tokens"):
        if (prop := _property(schema, "GenerateRequest", field)) is not None:
            prop["maximum"] = min(prop.get("maximum", 2**31), settings.max_new_tokens_limit)
            if "default" in prop:
                prop["default"] = min(prop["default"], prop["maximum"])
    for model, field in (
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
        ("CompletionRequest", "max_tokens"),
        ("ResponsesRequest", "max_output_tokens"),
    ):
        if (prop := _property(schema, model, field)) is not None:
            prop["maximum"] = settings.max_new_tokens_limit
    rules = "\n".join(f"* `{code}`: {text}" for code, text in UNSTATED_RULES.items())
    rules += "\n\nOn `/v1` (a 400 with the `code` named):\n\n" + "\n".join(
        f"* `{code}`: {text}"
        for code, text in {**OPENAI_UNSTATED_RULES, **RESPONSES_UNSTATED_RULES}.items()
    )
    info = schema.setdefault("info", {})
    info["description"] = (
        info.get("description", "")
        + "\n\nEvery rule the server enforces on a request is in this schema, with this "
        "server's limits, except these (a 422 with the `code` named):\n\n"
        + rules
        + "\n\nAnd a request body over the server's byte limit "
        "(`WORLDCUP_MAX_BODY_BYTES`, `WORLDCUP_MAX_BATCH_BODY_BYTES` on `/…/batch`) "
        "is refused with 413 `request_too_large`, whatever it holds. A text's or a "
        "prompt's `maxLength` is never more than that limit holds in any JSON spelling "
        "(12 bytes a character), so a string over its `maxLength` gets the 422 first. "
        "A body that is not valid UTF-8 JSON is refused with 400 `invalid_json`, whose "
        "message says where it broke (line, column and character; the byte, if not UTF-8)."
    )


def _json_data(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """An SSE event's ``data``: a string that holds JSON matching ``schema``."""
    return {
        "type": "string",
        "description": description,
        "contentMediaType": "application/json",
        "contentSchema": schema,
    }


def _event(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """One Server-Sent Event as a parser reads it: ``event`` (``message`` when the
    stream names none), ``data`` (its lines joined), and no ``id`` or ``retry``."""
    return {
        "type": "object",
        "properties": {"event": {"const": name}, "data": data},
        "required": ["event", "data"],
        "additionalProperties": False,
    }


_DONE = {"const": "[DONE]", "description": "The stream's last event."}
_GENERATE_DELTA = {
    "type": "object",
    "properties": {
        "token_id": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "text": {"type": "string"},
    },
    "required": ["token_id", "text"],
    "additionalProperties": False,
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _stream_events() -> dict[str, dict[str, Any]]:
    """The event of each streamed route, by path (OpenAPI 3.2's ``itemSchema``)."""

    def openai(chunk: str) -> dict[str, Any]:
        data = _json_data(
            {"anyOf": [_ref(chunk), _ref("OpenAIErrorEnvelope")]},
            f"One {chunk} (or an error envelope), as JSON; `[DONE]` ends the stream.",
        )
        return _event("message", {"anyOf": [data, _DONE]})

    delta = _json_data(_GENERATE_DELTA, "A text delta, as JSON; `[DONE]` ends the stream.")
    return {
        "/generate": {
            "anyOf": [
                _event("message", {"anyOf": [delta, _DONE]}),
                _event("result", _json_data(_ref("GenerateResponse"), "The whole answer.")),
                _event("error", _json_data(_ref("ErrorEnvelope"), "Why the stream ended.")),
            ]
        },
        "/v1/chat/completions": openai("ChatCompletionChunk"),
        "/v1/completions": openai("CompletionChunk"),
        # the Responses API names each event by its type, and sends no [DONE]
        "/v1/responses": {
            "anyOf": [
                _event(kind, _json_data(_ref(model.__name__), f"One {kind} event, as JSON."))
                for model in STREAM_EVENTS
                for kind in model.model_fields["type"].annotation.__args__  # type: ignore[union-attr]
            ]
        },
    }


def describe_event_streams(schema: dict[str, Any]) -> None:
    """Document each ``text/event-stream`` response by its events (``itemSchema``,
    OpenAPI 3.2), not as one opaque string; the chunk models join the components."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema(
        [
            (ChatCompletionChunk, "serialization"),
            (CompletionChunk, "serialization"),
            *((model, "serialization") for model in STREAM_EVENTS),
        ],
        ref_template="#/components/schemas/{model}",
    )
    for name, component in defs.get("$defs", {}).items():
        components.setdefault(name, component)
    for path, item in _stream_events().items():
        for operation in schema.get("paths", {}).get(path, {}).values():
            media = operation.get("responses", {}).get("200", {}).get("content", {})
            stream = media.get("text/event-stream")
            if stream is not None:
                stream.pop("schema", None)  # in 3.2 it would describe the whole stream
                stream["itemSchema"] = item
    schema["openapi"] = "3.2.0"  # itemSchema is 3.2's; nothing else differs from 3.1


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make ``app.openapi()`` return the document with this server's limits."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            apply_limits(document, settings)
            describe_event_streams(document)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
