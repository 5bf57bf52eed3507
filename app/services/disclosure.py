"""Who may see payload bits (SECURITY.md, "Forgery and framing").

A payload's bits are the labels a watermark-stealing attacker needs. An ordinary
client that learns the payload of each of its answers can tell which bit each
frequent context carries, and one that learns a victim's payload can write spoofs
aimed at it: at 2·10⁵ tokens such a learner named a chosen victim's entry in 14 to 20
of 40 spoofs (docs/results/forgery). Without the bits the same learner has only the
mixed, payload-averaged counts, and names no victim at all. So registry payload
bits never leave the service except to analysts:

* a registry-issued payload (the default: one per text) is shown only to keys that
  hold the ``provenance`` scope, an admin's grant to a tenant's trust-and-safety
  analysts: on ``/generate`` and ``/v1`` (``payload``, ``payload_bits``/``payload_hex``),
  and as decoded ``bits`` and per-bit confidence on ``/decode``. Everyone else gets the
  ``message_id`` and metadata, which name the entry without revealing its bits (the
  message id's payload is keyed);
* a client-chosen payload is the client's own: it is echoed to the key that chose it,
  and a matched one (``registry_match.bits``) is shown to keys that may choose payloads
  (``fixed_payload``) or are analysts (``provenance``). It is sealed: the text carries
  the keyed payload of a registry entry that records the chosen bits, so the echo is no
  label of the carried bits (a key that chose its payloads once framed a chosen victim
  in 17 of 40 spoofs).

These functions decide it, from the asking key's effective scopes
(:attr:`app.services.tenants.Principal.scopes`); the routes' services apply them to
fresh answers and to replayed (idempotent) ones alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PROVENANCE_SCOPE = "provenance"
FIXED_PAYLOAD_SCOPE = "fixed_payload"


def sees_registry_bits(scopes: frozenset[str]) -> bool:
    """Whether a key may see registry-issued payload bits (its analysts' keys only)."""
    return PROVENANCE_SCOPE in scopes


def sees_client_bits(scopes: frozenset[str]) -> bool:
    """Whether a key may see a matched client-chosen payload's bits."""
    return PROVENANCE_SCOPE in scopes or FIXED_PAYLOAD_SCOPE in scopes


def reveals_generated(scopes: frozenset[str]) -> bool:
    """Whether a generation's answer shows the registry-issued payload its text carries
    (to an analyst's key). A client-chosen payload is always echoed to the key that
    chose it, and it is sealed: the text carries its registry entry's payload instead,
    whose bits the answer shows only to analysts (``Sample.shown_payload``)."""
    return sees_registry_bits(scopes)


def redact_stored(response: Mapping[str, Any], scopes: frozenset[str]) -> dict[str, Any]:
    """A stored (idempotent) generation response as this key may see it: a registry
    payload's bits removed unless the key is an analyst's. The response was stored as
    the key that first asked saw it; another key of the tenant may replay it."""
    out = dict(response)
    if sees_registry_bits(scopes):
        return out
    own = out.get("client_payload") is True  # the client's chosen bits: its own
    if out.get("message_id") is not None and out.get("payload") is not None and not own:
        out["payload"] = None  # /generate
    if isinstance(out.get("watermark"), Mapping):  # a Responses object
        out["watermark"] = _redact_info(out["watermark"])
    choices = out.get("choices")
    if isinstance(choices, list):
        out["choices"] = [
            {**c, "watermark": _redact_info(c["watermark"])}
            if isinstance(c, Mapping) and isinstance(c.get("watermark"), Mapping)
            else c
            for c in choices
        ]
    return out


def _redact_info(info: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(info)
    if out.get("message_id") is not None and out.get("client_payload") is not True:
        out["payload_bits"] = None
        out["payload_hex"] = None
    return out
