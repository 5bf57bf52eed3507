"""The chat protocol: ``POST /v1/chat/completions``, its messages and tools, its
responses and stream chunks (the shared fields: :mod:`.common`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from app.schemas.openai.common import (
    MAX_TOP_LOGPROBS,
    VLLM_UNSUPPORTED,
    FinishReason,
    JsonSchema,
    OpenAIModel,
    OpenAIRequestModel,
    ResponseHead,
    SamplingRequest,
    UsageInfo,
    WatermarkInfo,
    schema_rules,
    unsupported,
    unsupported_field,
)

CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    **VLLM_UNSUPPORTED,
}
MAX_TOOLS = 64


class TextPart(OpenAIRequestModel):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=100_000)]


class ToolCallFunction(OpenAIRequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: Annotated[str, Field(max_length=100_000)] = Field(
        description="The arguments, a JSON string."
    )


class ToolCallIn(OpenAIRequestModel):
    """A tool call of an earlier assistant turn (sent back in a multi-turn chat)."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageIn(OpenAIRequestModel):
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "if": {"required": ["role"], "properties": {"role": {"not": {"const": "assistant"}}}},
            "then": {
                "properties": {
                    "tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
                }
            },
        },
    )

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="'developer' is read as 'system'; 'tool' answers an earlier tool call "
        "(the 'function' role is unsupported)."
    )
    content: (
        Annotated[str, Field(max_length=100_000)]
        | Annotated[list[TextPart], Field(min_length=1, max_length=64)]
        | None
    ) = Field(
        None,
        description="A string, or text parts (other part types are unsupported); "
        "null (read as empty) beside an assistant turn's tool_calls.",
    )
    name: Annotated[str | None, Field(max_length=256)] = None
    tool_calls: Annotated[list[ToolCallIn] | None, Field(max_length=MAX_TOOLS)] = None
    tool_call_id: Annotated[str | None, Field(max_length=256)] = None

    @model_validator(mode="after")
    def _roles(self) -> Self:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(OpenAIRequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str | None, Field(max_length=10_000)] = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class ToolDef(OpenAIRequestModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenAIRequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(OpenAIRequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``; unknown fields are ignored."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra=schema_rules(
            CHAT_UNSUPPORTED,
            [
                {
                    "model": "SmolLM2-135M-Instruct",
                    "messages": [{"role": "user", "content": "Write a note about tides."}],
                    "max_tokens": 64,
                    "watermark": {"metadata": {"user_id": "u-17"}},
                }
            ],
            (
                {
                    "if": {
                        "required": ["top_logprobs"],
                        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                    },
                    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                },
            ),
        ),
    )

    messages: Annotated[list[ChatMessageIn], Field(min_length=1, max_length=64)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = Field(
        None, description="Preferred over max_tokens when both are given."
    )
    tools: Annotated[list[ToolDef] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default 'auto' with tools, 'none' without."
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Accepted; a turn makes at most one tool call."
    )
    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    functions: Any = unsupported_field()
    function_call: Any = unsupported_field()
    audio: Any = unsupported_field()
    modalities: Any = unsupported_field()
    prediction: Any = unsupported_field()
    web_search_options: Any = unsupported_field()
    reasoning_effort: Any = unsupported_field()
    echo: Any = unsupported_field()
    add_generation_prompt: Any = unsupported_field()
    continue_final_message: Any = unsupported_field()
    chat_template: Any = unsupported_field()
    chat_template_kwargs: Any = unsupported_field()
    documents: Any = unsupported_field()
    mm_processor_kwargs: Any = unsupported_field()

    @field_validator(*(k for k in CHAT_UNSUPPORTED if k not in VLLM_UNSUPPORTED))
    @classmethod
    def _unsupported_fields(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return unsupported(info.field_name, value, CHAT_UNSUPPORTED[info.field_name])

    @field_validator("top_logprobs")
    @classmethod
    def _logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # logprobs is declared before
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# --------------------------------------------------------------------------- responses
class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(OpenAIModel):
    """Chat: one entry per generated token, under the distribution ``logprobs_mode``
    names (default ``sampled``: the watermarked one each token was drawn from)."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason
    watermark: WatermarkInfo


class ChatCompletion(ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionCallDelta(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    watermark: WatermarkInfo | None = Field(None, description="Only in the choice's last chunk.")


class ChatCompletionChunk(ResponseHead):
    """One ``data:`` event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
