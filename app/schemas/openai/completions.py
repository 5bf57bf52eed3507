"""The completions protocol: ``POST /v1/completions``, its responses and stream chunks
(the shared fields: :mod:`.common`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from app.schemas.openai.common import (
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    VLLM_UNSUPPORTED,
    FinishReason,
    OpenAIModel,
    ResponseHead,
    SamplingRequest,
    UsageInfo,
    WatermarkInfo,
    schema_rules,
    unsupported,
    unsupported_field,
)

COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    **VLLM_UNSUPPORTED,
}


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``; unknown fields are ignored."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra=schema_rules(
            COMPLETION_UNSUPPORTED,
            [{"model": "SmolLM2-135M-Instruct", "prompt": "The tide", "max_tokens": 32}],
            (  # max_tokens 0 scores the prompt: it needs echo and logprobs (a 400 otherwise)
                {
                    "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
                    "then": {
                        "required": ["echo", "logprobs"],
                        "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}},
                    },
                },
            ),
        ),
    )

    prompt: (
        Annotated[str, Field(min_length=1, max_length=100_000)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=100_000)]],
            Field(min_length=1, max_length=MAX_CHOICES),
        ]
    ) = Field(description="A string or a list of strings (token-id prompts are unsupported).")
    max_tokens: Annotated[int | None, Field(ge=0)] = Field(
        None,
        description="0 only with echo and logprobs: the prompt scored, nothing generated "
        "(finish_reason length, watermark null, no registry entry).",
    )
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = Field(
        None,
        description="Log-probabilities of the sampled tokens and this many alternatives; "
        "with echo, of the prompt's tokens first (the first one null; the model's own "
        "distribution there, as nothing is sampled).",
    )
    echo: bool | None = Field(
        None,
        description="Return the prompt before the completion (with logprobs: scored; "
        "with max_tokens 0 too: only the prompt, scored).",
    )
    suffix: Any = unsupported_field()
    best_of: Any = unsupported_field()

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported_fields(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return unsupported(info.field_name, value, COMPLETION_UNSUPPORTED[info.field_name])

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


# --------------------------------------------------------------------------- responses
class CompletionLogprobs(OpenAIModel):
    """Completions' legacy shape; with ``echo`` the prompt's tokens come first (the
    first with a null logprob, the rest from the model's own distribution)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason
    watermark: WatermarkInfo | None = Field(
        description="The receipt; null only for max_tokens 0 (the prompt scored, nothing "
        "generated, nothing watermarked)."
    )


class Completion(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunkChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    watermark: WatermarkInfo | None = Field(None, description="Only in the choice's last chunk.")


class CompletionChunk(ResponseHead):
    """One ``data:`` event of a streamed completion (``object`` as OpenAI sends it)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]
    usage: UsageInfo | None = None
