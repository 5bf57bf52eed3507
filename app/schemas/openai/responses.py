"""The OpenAI Responses protocol (``POST /v1/responses``, ``GET /v1/responses/{id}``).

A Responses request is read here and translated, in
:mod:`app.services.openai.responses`, into the chat request the chat route runs:
``instructions`` and the stored conversation of ``previous_response_id`` become
messages, ``text.format`` becomes ``response_format``, function ``tools`` and
``tool_choice`` become the chat ones. What the chat route refuses is refused here
too, under the Responses field's name.

As on the chat route, requests are strict but ignore unknown top-level fields,
and fields this server knows and cannot honour (built-in tools, ``background``,
``reasoning``, ...) get a 400 that names them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from app.schemas.openai.common import (
    OpenAIModel,
    OpenAIRequestModel,
    WatermarkInfo,
    WatermarkRequest,
    schema_rules,
    unsupported,
    unsupported_field,
)

# field -> the values that mean "not used", accepted silently
RESPONSES_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "include": (None, []),
    "prompt": (None,),
    "reasoning": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "context_management": (None,),
}
MAX_ITEMS = 63  # with the instructions, the chat route's 64 messages
# the rules of this route the OpenAPI schema cannot state (error.code -> why)
RESPONSES_UNSTATED_RULES = {
    "conversation_too_long": "the stored conversation of previous_response_id and this "
    "input make more than 64 messages",
}
Text = Annotated[str, Field(max_length=100_000)]


# --------------------------------------------------------------------------- input
class InputTextPart(OpenAIRequestModel):
    """A text part (``input_text`` from users, ``output_text`` in assistant turns)."""

    type: Literal["input_text", "output_text"] = Field(
        description="Text parts only: images, files and audio are not supported."
    )
    text: Text


class MessageItem(OpenAIRequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[InputTextPart], Field(min_length=1, max_length=64)]


class FunctionCallItem(OpenAIRequestModel):
    """A function call the model made earlier (sent back with its output)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: Text


class FunctionCallOutputItem(OpenAIRequestModel):
    """The result of a function call, for the model's next turn."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: Text


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return kind if kind in ("message", "function_call", "function_call_output") else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


# --------------------------------------------------------------------------- tools, format
class FunctionTool(OpenAIRequestModel):
    type: Literal["function"] = Field(
        description="Only function tools; built-in tools (web_search, file_search, ...) are "
        "not supported."
    )
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str | None, Field(max_length=10_000)] = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIRequestModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]


class FormatText(OpenAIRequestModel):
    type: Literal["text"]


class FormatJSONObject(OpenAIRequestModel):
    type: Literal["json_object"]


class FormatJSONSchema(OpenAIRequestModel):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema_: dict[str, Any] = Field(alias="schema")
    description: Annotated[str | None, Field(max_length=10_000)] = None
    strict: bool | None = None


class TextConfig(OpenAIRequestModel):
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra=lambda schema, _: schema["properties"].update(
            verbosity={"type": "null", "description": "Not supported: absent or null."}
        ),
    )

    format: (
        Annotated[FormatText | FormatJSONObject | FormatJSONSchema, Field(discriminator="type")]
        | None
    ) = None
    verbosity: Any = Field(None, description="Not supported: 400 unless absent or null.")

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: Any) -> Any:
        return unsupported("text.verbosity", value, (None,))


class ResponsesStreamOptions(OpenAIRequestModel):
    include_obfuscation: bool | None = Field(
        None, description="Accepted; no obfuscation padding is ever sent."
    )


# --------------------------------------------------------------------------- request
class ResponsesRequest(OpenAIRequestModel):
    """``POST /v1/responses``; unknown fields are ignored."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra=schema_rules(
            RESPONSES_UNSUPPORTED,
            [
                {
                    "model": "SmolLM2-135M-Instruct",
                    "instructions": "Be brief.",
                    "input": "Write a note about tides.",
                    "max_output_tokens": 64,
                    "watermark": {"metadata": {"user_id": "u-17"}},
                }
            ],
        ),
    )

    model: Annotated[str, Field(min_length=1, max_length=256)] = Field(
        description="A model id from GET /v1/models."
    )
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)] = Field(
        description="A string (one user message) or items: messages with text content, "
        "function calls and their outputs."
    )
    instructions: Text | None = Field(
        None, description="A system message for this request only (not carried over)."
    )
    previous_response_id: Annotated[str | None, Field(max_length=128)] = Field(
        None, description="Continue the conversation of a stored response of this tenant."
    )
    max_output_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2)] = Field(
        None, description="Default 1; 0 is read as 0.01 (all but greedy)."
    )
    top_p: Annotated[float | None, Field(gt=0, le=1)] = Field(None, description="Default 1.")
    seed: Annotated[int | None, Field(ge=-(2**63), le=2**63 - 1)] = Field(
        None, description="Extension (as on the chat route): a seeded draw."
    )
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = Field(
        None, description="Keep the response for previous_response_id and GET (default true)."
    )
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = Field(None, description="Up to 16 string pairs, echoed on the response.")
    user: Annotated[str | None, Field(max_length=256)] = Field(
        None, description="Recorded in the registry entry of a default allocation."
    )
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    watermark: WatermarkRequest | None = None
    background: Any = unsupported_field()
    conversation: Any = unsupported_field()
    include: Any = unsupported_field()
    prompt: Any = unsupported_field()
    reasoning: Any = unsupported_field()
    max_tool_calls: Any = unsupported_field()
    top_logprobs: Any = unsupported_field()
    truncation: Any = unsupported_field()
    service_tier: Any = unsupported_field()
    context_management: Any = unsupported_field()

    @field_validator(*RESPONSES_UNSUPPORTED)
    @classmethod
    def _unsupported_fields(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return unsupported(info.field_name, value, RESPONSES_UNSUPPORTED[info.field_name])

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for tool in value:
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise ValueError(
                        f"the built-in tool '{kind[:64]}' is not supported by this server: "
                        "only 'function' tools"
                    )
        return value

    @field_validator("stream_options")
    @classmethod
    def _options(
        cls, value: ResponsesStreamOptions | None, info: ValidationInfo
    ) -> ResponsesStreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


# --------------------------------------------------------------------------- response
class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(OpenAIModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIModel):
    code: str
    message: str


class ResponseObject(OpenAIModel):
    """A response, as OpenAI's (``output_text`` is the SDK's own property), plus
    ``watermark``: the payload the output carries and its registry entry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    watermark: WatermarkInfo


# --------------------------------------------------------------------------- stream events
class _Event(OpenAIModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal[
        "response.created", "response.in_progress", "response.completed", "response.incomplete"
    ]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


ResponseStreamEvent = Annotated[
    ResponseLifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | OutputTextDeltaEvent
    | OutputTextDoneEvent
    | FunctionCallArgumentsDeltaEvent
    | FunctionCallArgumentsDoneEvent
    | ErrorEvent,
    Field(discriminator="type"),
]
STREAM_EVENTS: tuple[type[BaseModel], ...] = (
    ResponseLifecycleEvent,
    OutputItemEvent,
    ContentPartEvent,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    ErrorEvent,
)
