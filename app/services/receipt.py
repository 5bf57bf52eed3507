"""The watermark receipt as response headers, for clients that drop unknown body fields.

Every ``/v1`` answer carries its receipt in the body (``choices[i].watermark``, or
``watermark`` on a Responses object). Some clients drop fields they do not know
(LangChain's ``response_metadata`` keeps no ``watermark``), but most can read the
HTTP headers (``ChatOpenAI(include_response_headers=True)``), so the same receipt
is sent as headers too, streaming included: every message id is allocated, durably,
before the first token, so the headers are known before the stream starts.

* ``X-Watermark-Message-Id``: the registry entry of each choice, comma-separated in
  choice order; absent when the request gave an explicit payload (no entry).
* ``X-Watermark-Key-Version``: the tenant key version of each choice, in choice order.
* ``X-Watermark-Scheme``: the scheme of each choice (``worldcup-v2``), in choice order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from app.schemas.openai.common import WatermarkInfo

MESSAGE_ID = "X-Watermark-Message-Id"
KEY_VERSION = "X-Watermark-Key-Version"
SCHEME = "X-Watermark-Scheme"


def _fields(info: WatermarkInfo | Mapping[str, Any]) -> tuple[int | None, int, str]:
    if isinstance(info, WatermarkInfo):
        return info.message_id, info.key_version, info.scheme
    return info["message_id"], int(info["key_version"]), str(info["scheme"])


def headers(infos: Iterable[WatermarkInfo | Mapping[str, Any] | None]) -> dict[str, str]:
    """The receipt headers of the choices' watermark infos, in choice order; a choice
    without one (a completion's max_tokens 0: nothing generated) has none."""
    rows = [_fields(info) for info in infos if info is not None]
    if not rows:
        return {}
    out = {
        KEY_VERSION: ",".join(str(version) for _, version, _ in rows),
        SCHEME: ",".join(scheme for _, _, scheme in rows),
    }
    if any(message_id is not None for message_id, _, _ in rows):
        out[MESSAGE_ID] = ",".join("" if m is None else str(m) for m, _, _ in rows)
    return out


def of_response(body: Mapping[str, Any]) -> dict[str, str]:
    """The receipt headers of a stored (replayed) chat or completion response."""
    choices = body.get("choices") or []
    return headers(c.get("watermark") for c in choices if isinstance(c, Mapping))


OPENAPI_HEADERS: dict[str, dict[str, Any]] = {
    MESSAGE_ID: {
        "description": "Registry entry of each choice, comma-separated in choice order; "
        "absent for an explicit payload.",
        "schema": {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$"},
    },
    KEY_VERSION: {
        "description": "Tenant key version of each choice, comma-separated in choice order.",
        "schema": {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$"},
    },
    SCHEME: {
        "description": "Watermark scheme of each choice, comma-separated in choice order.",
        "schema": {"type": "string"},
    },
}
