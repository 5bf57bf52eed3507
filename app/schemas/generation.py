"""Request and response models of /generate, and the metadata rules it shares."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from app.schemas.common import StrictModel, StrictRequest
from worldcup_core.config import MIN_TEMPERATURE

if TYPE_CHECKING:
    from app.core.config import Settings

MAX_METADATA_BYTES = 4096
MAX_PROMPT_CHARS = 100_000  # a prompt, or one chat message's content (within the body)
MAX_METADATA_DEPTH = 4
MAX_METADATA_ITEMS = 32  # keys of one object, items of one array
MAX_METADATA_STRING = 512
DEFAULT_NO_REPEAT_NGRAM = 4  # as in docs/results (the paper, Sec. 4.1)
BITS_PATTERN = r"^[01]{1,64}$"
HEX_PATTERN = r"^(0x)?[0-9a-fA-F]{1,16}$"

# Rules JSON Schema cannot state: a schema-valid request may still get a 422 with one
# of these codes (each is also described on its field). Everything else is in the schema.
UNSTATED_RULES = {
    "prompt_too_long": "the prompt (or the rendered chat) is longer than the server's "
    "token limit (`WORLDCUP_MAX_PROMPT_TOKENS`); a token count is not a string length",
    "invalid_payload": "payload.int or payload.hex is not below 2**payload.num_bits",
    "metadata_too_large": f"metadata serialises to more than {MAX_METADATA_BYTES} bytes "
    "of compact UTF-8 JSON",
}


def _not_null(*fields: str) -> dict[str, Any]:
    return {"required": list(fields), "properties": {f: {"not": {"type": "null"}} for f in fields}}


def _only(*fields: str, others: tuple[str, ...]) -> dict[str, Any]:
    """A ``oneOf`` branch: these fields given and not null, the others absent or null."""
    branch = _not_null(*fields)
    branch["properties"].update({f: {"type": "null"} for f in others})
    return branch


def _exactly_one(*fields: str) -> list[Any]:
    """``oneOf`` branches: exactly one of these (nullable) fields is given, not null."""
    return [_not_null(f) for f in fields]


def _metadata_value(levels: int) -> dict[str, Any]:
    """A JSON value nested at most ``levels`` more containers deep."""
    scalars: list[dict[str, Any]] = [
        {"type": "string", "maxLength": MAX_METADATA_STRING},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
    ]
    if levels > 0:
        inner = _metadata_value(levels - 1)
        scalars += [_metadata_object(inner), {"type": "array", "items": inner,
                                              "maxItems": MAX_METADATA_ITEMS}]  # fmt: skip
    return {"anyOf": scalars}


def _metadata_object(values: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": values,
        "maxProperties": MAX_METADATA_ITEMS,
        "propertyNames": {"maxLength": MAX_METADATA_STRING},
    }


METADATA_SCHEMA: dict[str, Any] = {
    "anyOf": [_metadata_object(_metadata_value(MAX_METADATA_DEPTH - 1)), {"type": "null"}],
    "description": (
        "A JSON object, stored with the message id and returned exactly as sent by "
        "/decode, /provenance and the admin registry route. Finite numbers, valid "
        f"Unicode (no lone surrogates), at most {MAX_METADATA_DEPTH} levels deep, "
        f"{MAX_METADATA_ITEMS} keys or items per container, strings of at most "
        f"{MAX_METADATA_STRING} characters, and at most {MAX_METADATA_BYTES} bytes as "
        "compact UTF-8 JSON (422 `metadata_too_large`). Anything else is refused with a "
        "422 that names the field."
    ),
}


def _valid_string(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: not valid Unicode (a lone surrogate)") from None


def check_metadata(value: Any, where: str = "metadata", level: int = 0) -> None:
    """Raise ValueError naming the first field that would not round-trip exactly."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, str):
        _valid_string(value, where)
        if len(value) > MAX_METADATA_STRING:
            raise ValueError(f"{where}: longer than {MAX_METADATA_STRING} characters")
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: not a finite number")
        return
    if isinstance(value, dict | list) and level >= MAX_METADATA_DEPTH:
        raise ValueError(f"{where}: metadata may nest at most {MAX_METADATA_DEPTH} levels")
    if isinstance(value, dict):
        if len(value) > MAX_METADATA_ITEMS:
            raise ValueError(f"{where}: more than {MAX_METADATA_ITEMS} keys")
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings")
            _valid_string(key, f"{where} (a key)")
            if len(key) > MAX_METADATA_STRING:
                raise ValueError(f"{where}: a key is longer than {MAX_METADATA_STRING} characters")
            check_metadata(item, f"{where}.{key}", level + 1)
        return
    if isinstance(value, list):
        if len(value) > MAX_METADATA_ITEMS:
            raise ValueError(f"{where}: more than {MAX_METADATA_ITEMS} items")
        for i, item in enumerate(value):
            check_metadata(item, f"{where}[{i}]", level + 1)
        return
    raise ValueError(f"{where}: not a JSON value")


def metadata_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


class PayloadIn(StrictRequest):
    """Exactly one of ``bits``, ``hex`` or ``int``; ``num_bits`` sizes hex and int."""

    bits: Annotated[
        str | None, WithJsonSchema({"type": ["string", "null"], "pattern": BITS_PATTERN})
    ] = Field(None, examples=["0110100110010110"], description="1 to 64 binary digits.")
    hex: Annotated[
        str | None, WithJsonSchema({"type": ["string", "null"], "pattern": HEX_PATTERN})
    ] = Field(
        None,
        examples=["69a5"],
        description="1 to 16 hex digits; 4 bits a digit unless num_bits is given, and then "
        "the value must be below 2**num_bits (422 `invalid_payload` otherwise).",
    )
    integer: Annotated[int | None, Field(ge=0, le=2**64 - 1, alias="int")] = Field(
        None,
        description="A non-negative integer below 2**num_bits (422 `invalid_payload` "
        "otherwise); needs num_bits.",
    )
    num_bits: Annotated[int | None, Field(ge=1, le=64)] = Field(
        None, description="Payload length for hex and int; not allowed with bits."
    )

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "oneOf": [
                _only("bits", others=("hex", "int", "num_bits")),
                _only("hex", others=("bits", "int")),
                _only("int", "num_bits", others=("bits", "hex")),
            ],
        },
    )

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        given = [f for f in ("bits", "hex", "integer") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of payload.bits, payload.hex or payload.int")
        if self.bits is not None and not re.fullmatch(BITS_PATTERN, self.bits):
            raise ValueError("payload.bits must be 1 to 64 characters of 0 and 1")
        if self.hex is not None and not re.fullmatch(HEX_PATTERN, self.hex):
            raise ValueError("payload.hex must be 1 to 16 hexadecimal digits")
        if self.integer is not None and self.num_bits is None:
            raise ValueError("payload.int needs payload.num_bits")
        if self.bits is not None and self.num_bits is not None:
            raise ValueError("payload.num_bits sizes hex and int; bits are sized by their length")
        return self


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class GenerateRequest(StrictRequest):
    prompt: Annotated[str | None, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] = Field(
        None,
        description="Raw text to continue. Instruct models answer `messages` better. "
        "At most the server's prompt token limit (422 `prompt_too_long`).",
    )
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1, max_length=64)] = Field(
        None,
        description="Chat turns, rendered with the model's chat template; the same token "
        "limit applies to the rendered chat.",
    )
    # one limit, the server's (published as this field's maximum): no second, fixed one
    max_new_tokens: Annotated[int, Field(ge=1)] = Field(
        128, description="At most the server's `WORLDCUP_MAX_NEW_TOKENS_LIMIT`."
    )
    min_new_tokens: Annotated[int, Field(ge=0, le=4096)] = Field(
        0, description="EOS is suppressed until this many tokens; capped at max_new_tokens."
    )
    temperature: Annotated[float, Field(ge=MIN_TEMPERATURE, le=10)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=1000)] = Field(50, description="0 disables top-k.")
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.95
    no_repeat_ngram_size: Annotated[int, Field(ge=0, le=16)] = Field(
        DEFAULT_NO_REPEAT_NGRAM,
        description="Ban repeating n-grams of this size (0: off). The default is the "
        "configuration docs/evaluation.md's quality figures were measured with.",
    )
    seed: Annotated[int | None, Field(ge=0, le=2**63 - 1)] = None
    payload: PayloadIn | None = Field(
        None,
        description="A client-chosen payload: needs the key's `fixed_payload` scope (403 "
        "`fixed_payload_not_allowed`), and each payload is capped per key version (429 "
        "`payload_repeats_exceeded`). Without payload, the service issues a registry "
        "entry (with `metadata`, or empty metadata) and its payload.",
    )
    metadata: Annotated[dict[str, Any] | None, WithJsonSchema(METADATA_SCHEMA)] = None
    num_bits: Annotated[int | None, Field(ge=1, le=64)] = Field(
        None, description="Payload length for metadata allocation (default: server setting)."
    )
    stream: bool = False

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "allOf": [
                {"oneOf": _exactly_one("prompt", "messages")},
                {  # payload excludes metadata and num_bits; neither: empty metadata
                    "not": {
                        "anyOf": [
                            _not_null("payload", "metadata"),
                            _not_null("payload", "num_bits"),
                        ]
                    }
                },
            ],
            "examples": [
                {
                    "messages": [{"role": "user", "content": "Write a short note about tides."}],
                    "max_new_tokens": 128,
                    "metadata": {"user_id": "u-123"},
                },
                {"prompt": "The tide rolls in", "payload": {"bits": "1011"}},
            ],
        },
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.payload is not None and self.metadata is not None:
            raise ValueError(
                "give at most one of payload or metadata (without either, the text gets a "
                "registry entry with empty metadata)"
            )
        if self.num_bits is not None and self.payload is not None:
            raise ValueError(
                "num_bits applies to metadata allocation; size payloads inside payload"
            )
        self.min_new_tokens = min(self.min_new_tokens, self.max_new_tokens)
        return self

    @field_validator("metadata")
    @classmethod
    def _small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        check_metadata(value)
        return value


class PayloadOut(StrictModel):
    bits: str
    hex: str
    num_bits: int


class Usage(StrictModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timing(StrictModel):
    queue_seconds: float
    time_to_first_token_seconds: float | None
    total_seconds: float
    tokens_per_second: float | None


class GenerateResponse(StrictModel):
    text: str
    num_tokens: int
    finish_reason: Literal["eos", "length"]
    payload: PayloadOut | None = Field(
        description="The payload the request chose, echoed (client_payload: the text "
        "carries its registry entry's keyed payload instead, which /decode maps back to "
        "these bits); else the registry-issued payload the text carries, only to a key "
        "that holds the `provenance` scope (an analyst's key), null otherwise. Payload "
        "bits are the labels a watermark-stealing attacker learns from (SECURITY.md, "
        "Forgery and framing): keep message_id instead, which names the entry without "
        "revealing its bits."
    )
    client_payload: bool = Field(
        False,
        description="True: the request chose its payload, and the registry entry "
        "`message_id` seals it (decode at `num_bits`, or without num_bits).",
    )
    num_bits: int = Field(
        description="The length of the payload the text carries (decode at this length)."
    )
    message_id: int | None
    key_version: int
    scheme: str
    usage: Usage
    timing: Timing


def prompt_chars_limit(settings: Settings) -> int:
    """A prompt's (or a chat message's) length limit as published and enforced:
    ``MAX_PROMPT_CHARS``, within what the body limit holds."""
    return min(MAX_PROMPT_CHARS, settings.body_chars)
