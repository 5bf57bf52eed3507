"""Request and response models of /generate, /decode and /detect."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from app.schemas.common import StrictModel
from app.schemas.exposure import DecodeVerdict, DetectVerdict

MAX_METADATA_BYTES = 4096
MAX_METADATA_DEPTH = 4
# Below this the sampler's float32 logits / temperature overflow to inf and the
# softmax turns NaN: the batch step fails, and with it every generation in the
# batch (found by schemathesis: temperature 2e-89 gave a 500). 0.01 is already
# all but greedy.
MIN_TEMPERATURE = 0.01
_BITS = re.compile(r"^[01]{1,64}$")
_HEX = re.compile(r"^(0x)?[0-9a-fA-F]{1,16}$")


def _depth(value: Any, level: int = 0) -> int:
    if isinstance(value, dict):
        return max([_depth(v, level + 1) for v in value.values()], default=level + 1)
    if isinstance(value, list):
        return max([_depth(v, level + 1) for v in value], default=level + 1)
    return level


class PayloadIn(StrictModel):
    """Exactly one of ``bits``, ``hex`` or ``int``; ``num_bits`` sizes hex/int."""

    bits: str | None = Field(None, examples=["0110100110010110"])
    hex: str | None = Field(None, examples=["69a5"])
    integer: Annotated[int | None, Field(ge=0, alias="int")] = None
    num_bits: Annotated[int | None, Field(ge=1, le=64)] = None

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        given = [f for f in ("bits", "hex", "integer") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of payload.bits, payload.hex or payload.int")
        if self.bits is not None and not _BITS.match(self.bits):
            raise ValueError("payload.bits must be 1 to 64 characters of 0 and 1")
        if self.hex is not None and not _HEX.match(self.hex):
            raise ValueError("payload.hex must be 1 to 16 hexadecimal digits")
        if self.integer is not None and self.num_bits is None:
            raise ValueError("payload.int needs payload.num_bits")
        if self.bits is not None and self.num_bits not in (None, len(self.bits)):
            raise ValueError("payload.num_bits disagrees with the length of payload.bits")
        return self


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=100_000)]


class GenerateRequest(StrictModel):
    prompt: Annotated[str | None, Field(min_length=1, max_length=100_000)] = None
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1, max_length=64)] = None
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 128
    min_new_tokens: Annotated[int, Field(ge=0, le=4096)] = 0
    temperature: Annotated[float, Field(ge=MIN_TEMPERATURE, le=10)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=1000)] = 50
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.95
    no_repeat_ngram_size: Annotated[int, Field(ge=0, le=16)] = 0
    seed: Annotated[int | None, Field(ge=0, le=2**63 - 1)] = None
    payload: PayloadIn | None = None
    metadata: dict[str, Any] | None = Field(
        None, description="Small JSON object; the service allocates a message id for it."
    )
    num_bits: Annotated[int | None, Field(ge=1, le=64)] = Field(
        None, description="Payload length for metadata allocation (default: server setting)."
    )
    stream: bool = False

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [
                {
                    "prompt": "Write a short note about tides.",
                    "max_new_tokens": 128,
                    "metadata": {"user_id": "u-123"},
                },
                {"messages": [{"role": "user", "content": "Hi!"}], "payload": {"bits": "1011"}},
            ]
        },
    }

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if (self.payload is None) == (self.metadata is None):
            raise ValueError("give exactly one of payload or metadata")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        if self.num_bits is not None and self.metadata is None:
            raise ValueError(
                "num_bits applies to metadata allocation; size payloads inside payload"
            )
        return self

    @field_validator("metadata")
    @classmethod
    def _small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if len(json.dumps(value)) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata must serialise to at most {MAX_METADATA_BYTES} bytes")
        if _depth(value) > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata may nest at most {MAX_METADATA_DEPTH} levels")
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
    payload: PayloadOut
    message_id: int | None
    key_version: int
    scheme: str
    usage: Usage
    timing: Timing


class DecodeRequest(StrictModel):
    text: Annotated[str, Field(min_length=1)]
    num_bits: Annotated[int | None, Field(ge=1, le=64)] = None
    key_version: Annotated[int | None, Field(ge=1)] = None

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"text": "The tide rolls in ...", "num_bits": 32}]},
    }


class BitConfidence(StrictModel):
    z: float
    p_value: float


class RegistryMatchOut(StrictModel):
    message_id: int
    metadata: dict[str, Any]
    issued_at: datetime
    num_bits: int
    confidence: float = Field(description="Posterior of this entry among the registry.")
    p_value: float = Field(description="Exact, Bonferroni-corrected for the registry size.")
    exact: bool = Field(description="True if the decoded bits equal the entry's payload.")


class DecodeResponse(StrictModel):
    bits: str = Field(description="'0'/'1' per bit; '?' marks an erasure")
    bit_confidence: list[BitConfidence]
    erasures: list[int]
    p_value: float
    z_score: float
    is_watermarked: bool
    num_tokens: int
    num_scored_tokens: int
    key_version: int
    registry_match: RegistryMatchOut | None


class DetectRequest(StrictModel):
    text: Annotated[str, Field(min_length=1)]

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"text": "Is this text watermarked?"}]},
    }


class DetectResponse(StrictModel):
    is_watermarked: bool
    p_value: float
    z_score: float
    num_tokens: int
    num_scored_tokens: int
    significance: float
    key_version: int | None = Field(description="The key version that matched, if any.")


# --------------------------------------------------------------------------- bulk scans
class BatchItemError(StrictModel):
    code: str
    message: str


class DecodeBatchRequest(StrictModel):
    texts: Annotated[list[str], Field(min_length=1, max_length=10_000)] = Field(
        description="Up to the server's batch limit (default 1000) texts; each is decoded "
        "independently, and a bad text fails only its own item."
    )
    num_bits: Annotated[int | None, Field(ge=1, le=64)] = None
    key_version: Annotated[int | None, Field(ge=1)] = None

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"texts": ["First text ...", "Second ..."]}]},
    }


class DecodeBatchItem(StrictModel):
    index: int
    result: DecodeResponse | DecodeVerdict | None
    error: BatchItemError | None


class DecodeBatchResponse(StrictModel):
    results: list[DecodeBatchItem]
    num_watermarked: int
    num_errors: int


class DetectBatchRequest(StrictModel):
    texts: Annotated[list[str], Field(min_length=1, max_length=10_000)] = Field(
        description="Up to the server's batch limit (default 1000) texts."
    )

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"texts": ["First text ...", "Second ..."]}]},
    }


class DetectBatchItem(StrictModel):
    index: int
    result: DetectResponse | DetectVerdict | None
    error: BatchItemError | None


class DetectBatchResponse(StrictModel):
    results: list[DetectBatchItem]
    num_watermarked: int
    num_errors: int


# --------------------------------------------------------------------------- provenance
class ProvenanceRequest(StrictModel):
    text: Annotated[str, Field(min_length=1)]
    include_token_scores: bool = Field(
        False, description="Per-token scores of the best key; admin token only (403 otherwise)."
    )

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {"examples": [{"text": "Who was this text generated for?"}]},
    }


class ProvenanceCandidate(StrictModel):
    tenant_id: str
    key_version: int
    p_value: float = Field(description="This key alone, before the correction for the search.")


class ProvenanceMatch(StrictModel):
    tenant_id: str
    tenant_name: str | None
    key_version: int
    key_p_value: float = Field(description="This key alone, before the search correction.")
    bits: str = Field(description="The decoded payload under this key ('?' = erasure).")
    num_bits: int
    registry_entry: RegistryMatchOut | None


class TokenScore(StrictModel):
    index: int = Field(description="Token index in the text (tokenizer of this service).")
    g_mean: list[float] = Field(description="Mean g-value per group; 0.5 is chance.")


class ProvenanceResponse(StrictModel):
    found: bool
    message: str
    p_value: float = Field(description="Best key's p-value, Šidák-corrected for num_keys.")
    correction: Literal["sidak"] = "sidak"
    num_keys: int
    num_tenants: int
    num_tokens: int
    num_scored_tokens: int
    significance: float
    match: ProvenanceMatch | None
    candidates: list[ProvenanceCandidate]
    scan_seconds: float
    scan_ms_per_1000_keys: float | None
    screened: bool = Field(
        description="A cheap pass over every 4th token chose which keys got the full scan."
    )
    num_full_scans: int
    token_scores: list[TokenScore] | None = None
