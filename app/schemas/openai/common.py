"""What the OpenAI APIs share: strictness, the ``watermark`` extension, the sampling
and structured-output fields, usage, models and the error envelope.

Requests are strict (no lax coercion: ``"5"`` is not an integer) but ignore
unknown top-level fields, as the OpenAI SDKs and gateways expect. Fields we know
and cannot honour are declared, so that a request using them gets a 400 naming
the field instead of silence. The ``watermark`` extension forbids unknown keys:
it is ours, and a misspelt key must not silently fall back to the default.

Each API's own protocol is beside this one: :mod:`.chat`, :mod:`.completions`
and :mod:`.responses`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from app.schemas.common import IntegralFloats
from app.schemas.generation import (
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    METADATA_SCHEMA,
    PayloadIn,
    check_metadata,
    metadata_bytes,
)

MAX_CHOICES = 16  # n, times the number of prompts of a completion request
MAX_STOP = 4

# field -> the values that mean "not used", accepted silently. vLLM's extensions we
# do not implement are here too: a client moving from vLLM gets a 400, not silence.
VLLM_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "return_tokens_as_token_ids": (None, False),
    "vllm_xargs": (None,),
    "priority": (None, 0),
    "logits_processors": (None,),
}
MAX_LOGIT_BIAS = 300
# The /v1 rules the schema cannot state (a 400 with this code): each needs the served
# tokenizer, the grammar engine, or a comparison between two fields' values.
OPENAI_UNSTATED_RULES = {
    "invalid_structured_output": "the grammar engine (xgrammar) cannot compile the schema, "
    "regex, grammar or structural tag",
    "grammar_too_large": "a schema, regex or grammar serialises to more than 64 KiB",
    "invalid_json": "guided_json / structured_outputs.json / structural_tag is a string "
    "that is not a JSON object",
    "conflicting_fields": "more than one output constraint (response_format json_*, "
    "structured_outputs, guided_*, tools with tool_choice other than none); top_k and "
    "watermark.top_k both given and different",
    "tool_choice_needs_tools": "tool_choice other than none without tools",
    "unknown_tool": "a named tool_choice that is not in tools",
    "duplicate_tool_names": "two tools with one name",
    "token_not_in_vocabulary": "a logit_bias token id beyond the served vocabulary",
    "logprobs_mode_unavailable": "on the vllm engine, a logprobs_mode other than the "
    "engine-wide one (WORLDCUP_VLLM_LOGPROBS_MODE, default sampled)",
}
MAX_TOP_LOGPROBS = 20


class OpenAIRequestModel(IntegralFloats):
    """Strict types; unknown fields ignored (the SDKs send fields we do not know)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class OpenAIModel(BaseModel):
    """Response models."""


def _depth(value: Any, level: int = 0) -> int:
    if isinstance(value, dict):
        return max([_depth(v, level + 1) for v in value.values()], default=level + 1)
    if isinstance(value, list):
        return max([_depth(v, level + 1) for v in value], default=level + 1)
    return level


def unsupported(name: str, value: Any, accepted: tuple[Any, ...]) -> Any:
    """``value`` if it is one of the no-op ``accepted`` values (``False`` is not ``0``)."""
    if any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in accepted):
        return value
    raise ValueError(f"'{name}' is not supported by this server")


def unsupported_field() -> Any:
    return Field(None, description="Not supported: 400 unless absent, null or its no-op value.")


def schema_rules(
    table: dict[str, tuple[Any, ...]], examples: list[Any], rules: tuple[Any, ...] = ()
) -> Any:
    """``json_schema_extra`` stating what the validators enforce: an unsupported field
    takes only null or its no-op values, and stream_options needs stream: true."""

    def extra(schema: dict[str, Any], _: Any) -> None:
        properties = schema.get("properties", {})
        for name, accepted in table.items():
            if name in properties:
                properties[name] = {
                    "enum": [None, *accepted],
                    "description": properties[name].get("description", ""),
                }
        schema["allOf"] = [
            {
                "if": {
                    "required": ["stream_options"],
                    "properties": {"stream_options": {"not": {"type": "null"}}},
                },
                "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
            },
            *rules,
        ]
        schema["examples"] = examples

    return extra


# --------------------------------------------------------------------------- watermark
class WatermarkPayload(PayloadIn):
    """Exactly one of ``bits``, ``hex`` or ``int``; ``num_bits`` sizes hex/int."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "oneOf": PayloadIn.model_config["json_schema_extra"]["oneOf"]  # type: ignore[index]
        },
    )


class WatermarkRequest(IntegralFloats):
    """The ``watermark`` extension (send it through the SDK's ``extra_body``).

    ``metadata`` (the service allocates a message id and records it) or an
    explicit ``payload``, not both; with neither, the tenant default applies: a
    metadata allocation recording the request's ``user``.
    """

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "not": {
                "anyOf": [
                    {
                        "required": [a, b],
                        "properties": {a: {"not": {"type": "null"}}, b: {"not": {"type": "null"}}},
                    }
                    for a, b in (("metadata", "payload"), ("num_bits", "payload"))
                ]
            },
            "examples": [{"metadata": {"user_id": "u-17"}}, {"payload": {"hex": "69a5"}}],
        },
    )

    metadata: Annotated[dict[str, Any] | None, WithJsonSchema(METADATA_SCHEMA)] = None
    payload: WatermarkPayload | None = None
    num_bits: Annotated[int | None, Field(ge=1, le=64)] = Field(
        None, description="Payload length of the allocation (default: server setting)."
    )
    top_k: Annotated[int | None, Field(ge=0, le=1000)] = Field(
        None, description="Top-k filter before watermarking (default 50; 0 disables)."
    )
    no_repeat_ngram_size: Annotated[int | None, Field(ge=0, le=16)] = None

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if self.metadata is not None and self.payload is not None:
            raise ValueError("give at most one of watermark.metadata or watermark.payload")
        if self.num_bits is not None and self.payload is not None:
            raise ValueError("watermark.num_bits sizes allocations; size payloads inside payload")
        return self

    @field_validator("metadata")
    @classmethod
    def _small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        check_metadata(value)  # round-trips exactly, as on /generate
        if metadata_bytes(value) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata must serialise to at most {MAX_METADATA_BYTES} bytes")
        if _depth(value) > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata may nest at most {MAX_METADATA_DEPTH} levels")
        return value


class WatermarkInfo(OpenAIModel):
    """What each choice carries: the payload it embeds and where it is registered."""

    message_id: int | None = Field(description="Registry entry, when the service allocated it.")
    key_version: int
    scheme: str
    num_bits: int = Field(description="The length of the payload the text carries.")
    payload_hex: str | None = Field(
        description="The payload as hex: the one the request chose, echoed (sealed: the "
        "text carries registry entry `message_id`'s keyed payload instead); a "
        "registry-issued one only to a key with the `provenance` scope, null otherwise "
        "(payload bits are what a watermark-stealing attacker learns from: SECURITY.md)."
    )
    payload_bits: str | None = Field(description="The payload as bits; null as payload_hex.")
    client_payload: bool = Field(
        False, description="True: the request chose the payload, sealed in `message_id`."
    )


# ------------------------------------------------------------------ structured outputs
JsonSchema = dict[str, Any]


class JSONSchemaSpec(OpenAIRequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str | None, Field(max_length=10_000)] = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = Field(
        None, description="true: no properties or items beyond the schema's (default false)."
    )


class ResponseFormat(OpenAIRequestModel):
    """``text``; ``json_object`` (any JSON object); ``json_schema`` (the schema, compiled
    by xgrammar and enforced token by token, before the watermark)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {
                    "properties": {
                        "type": {"enum": ["text", "json_object"]},
                        "json_schema": {"type": "null"},
                    }
                },
                {
                    "required": ["json_schema"],
                    "properties": {
                        "type": {"const": "json_schema"},
                        "json_schema": {"not": {"type": "null"}},
                    },
                },
            ]
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema(self) -> Self:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and only with it")
        return self


_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputs(OpenAIRequestModel):
    """vLLM's ``structured_outputs``: exactly one constraint. Keys of vLLM's we do not
    implement (``disable_any_whitespace``, ``whitespace_pattern``, ...) are a 400."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {
                    "required": [f],
                    "properties": {
                        f: {"not": {"type": "null"}},
                        **{o: {"type": "null"} for o in _STRUCTURED if o != f},
                    },
                }
                for f in _STRUCTURED
            ]
        },
    )

    json_: JsonSchema | Annotated[str, Field(max_length=65_536)] | None = Field(None, alias="json")
    regex: Annotated[str | None, Field(min_length=1, max_length=65_536)] = None
    choice: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=4096)]] | None,
        Field(min_length=1, max_length=256),
    ] = None
    grammar: Annotated[str | None, Field(min_length=1, max_length=65_536)] = None
    json_object: Literal[True] | None = None
    structural_tag: dict[str, Any] | Annotated[str, Field(max_length=65_536)] | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        given = [k for k, v in self if v is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             "grammar, json_object, structural_tag")  # fmt: skip
        return self


# --------------------------------------------------------------------------- requests
class StreamOptions(OpenAIRequestModel):
    include_usage: bool | None = None


StopString = Annotated[str, Field(min_length=1, max_length=256)]
Stop = StopString | Annotated[list[StopString], Field(min_length=1, max_length=MAX_STOP)]


class SamplingRequest(OpenAIRequestModel):
    model: Annotated[str, Field(min_length=1, max_length=256)] = Field(
        description="A model id from GET /v1/models."
    )
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    min_tokens: Annotated[int | None, Field(ge=0)] = Field(
        None,
        description="vLLM's extension: no end-of-sequence before this many tokens "
        "(capped at the maximum).",
    )
    temperature: Annotated[float | None, Field(ge=0, le=2)] = Field(
        None, description="Default 1; 0 is read as 0.01 (all but greedy)."
    )
    top_p: Annotated[float | None, Field(gt=0, le=1)] = Field(None, description="Default 1.")
    n: Annotated[int | None, Field(ge=1, le=MAX_CHOICES)] = Field(
        None, description="Choices per prompt, each its own watermarked sample."
    )
    seed: Annotated[int | None, Field(ge=-(2**63), le=2**63 - 1)] = None
    stop: Stop | None = Field(None, description="Up to 4 stop strings (not part of the text).")
    user: Annotated[str | None, Field(max_length=256)] = Field(
        None, description="Recorded in the registry entry of a default allocation."
    )
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    watermark: WatermarkRequest | None = None
    # sampling fields, applied before the watermark (worldcup_core.pipeline)
    top_k: Annotated[int | None, Field(ge=-1, le=100_000)] = Field(
        None, description="vLLM's extension: top-k before watermarking (-1 or 0 disables; "
        "default 50, or watermark.top_k)."
    )  # fmt: skip
    min_p: Annotated[float | None, Field(ge=0, le=1)] = Field(
        None, description="vLLM's extension: drop tokens below min_p times the top probability."
    )
    repetition_penalty: Annotated[float | None, Field(gt=0, le=2)] = Field(
        None, description="vLLM's extension: >1 discourages prompt and output tokens."
    )
    presence_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                Annotated[float, Field(ge=-100, le=100)],
            ],
            # keys must match the pattern: the schema says so (JSON Schema's
            # patternProperties alone would admit any other key)
            Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False}),
        ]
        | None
    ) = Field(None, description="Token id (a string) -> bias added to its logit.")
    # structured outputs (a grammar, applied before the watermark)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extension (one of json, regex, choice, grammar, ...)."
    )
    guided_json: JsonSchema | Annotated[str, Field(max_length=65_536)] | None = Field(
        None, description="vLLM's older spelling of structured_outputs.json."
    )
    guided_regex: Annotated[str | None, Field(min_length=1, max_length=65_536)] = None
    guided_choice: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=4096)]] | None,
        Field(min_length=1, max_length=256),
    ] = None
    guided_grammar: Annotated[str | None, Field(min_length=1, max_length=65_536)] = None
    use_beam_search: Any = unsupported_field()
    length_penalty: Any = unsupported_field()
    ignore_eos: Any = unsupported_field()
    stop_token_ids: Any = unsupported_field()
    bad_words: Any = unsupported_field()
    allowed_token_ids: Any = unsupported_field()
    prompt_logprobs: Any = unsupported_field()
    truncate_prompt_tokens: Any = unsupported_field()
    include_stop_str_in_output: Any = unsupported_field()
    skip_special_tokens: Any = unsupported_field()
    spaces_between_special_tokens: Any = unsupported_field()
    guided_decoding_backend: Any = unsupported_field()
    guided_whitespace_pattern: Any = unsupported_field()
    return_tokens_as_token_ids: Any = unsupported_field()
    vllm_xargs: Any = unsupported_field()
    priority: Any = unsupported_field()
    logits_processors: Any = unsupported_field()
    logprobs_mode: Literal["sampled", "model"] | None = Field(
        None,
        description="Our extension: which distribution logprobs report: 'sampled' (default), "
        "the watermarked distribution each token was drawn from; 'model', the model's own. "
        "The hf engine offers both; on vllm the mode is engine-wide "
        "(WORLDCUP_VLLM_LOGPROBS_MODE) and the other one is a 400. The prompt's logprobs "
        "(completions' echo) are always the model's.",
    )

    @field_validator(*VLLM_UNSUPPORTED)
    @classmethod
    def _vllm_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return unsupported(info.field_name, value, VLLM_UNSUPPORTED[info.field_name])

    @field_validator("stream_options")
    @classmethod
    def _options(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # stream is declared before
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# --------------------------------------------------------------------------- responses
class ResponseHead(OpenAIModel):
    """What a completion and each of its chunks start with (``object`` is each one's)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class UsageInfo(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorBody(OpenAIModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorEnvelope(OpenAIModel):
    error: OpenAIErrorBody


OPENAI_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": OpenAIErrorEnvelope, "description": text}
    for code, text in {
        400: "Invalid request (param names the field)",
        401: "Missing or invalid API key",
        403: "The API key lacks the 'generate' scope",
        404: "Unknown model",
        409: "Idempotency conflict, or the registry is full",
        413: "Request body too large",
        422: "Not used here: an invalid request answers 400, as OpenAI's API does",
        429: "Rate limit or full queue (Retry-After set)",
        501: "Detector-only deployment",
        503: "Unavailable: store unreachable or draining",
        504: "Timed out",
    }.items()
}
