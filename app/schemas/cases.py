"""Request bodies of the console's cases (``/console/api/cases``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from app.schemas.common import StrictRequest
from app.schemas.watermark import Text

ConsoleMode = Literal["provenance", "decode", "detect"]


class CheckRequest(StrictRequest):
    """One console check, saved as a case."""

    text: Text
    mode: ConsoleMode = "provenance"
    keep_text: bool = Field(
        False, description="Keep the text in the case (its SHA-256 is always kept)."
    )


class BatchRequest(StrictRequest):
    """A CSV or JSONL file of texts, read as ``worldcup scan`` reads it."""

    filename: Annotated[str, Field(min_length=1, max_length=255)]
    content: Annotated[str, Field(min_length=1)]
    field: Annotated[str, Field(min_length=1, max_length=255)] = "text"
    mode: ConsoleMode = "provenance"
    keep_text: bool = False
