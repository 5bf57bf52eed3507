"""Payload bits leave the service only to analysts (app.services.disclosure).

A payload's bits are the labels a watermark-stealing attacker learns from: with them
the learner of ``worldcup_eval.forgery`` tells which bit each frequent context carries,
and with a victim's it frames that victim (SECURITY.md, Forgery and framing). So an
ordinary key (generate, detect, decode) gets the registry entry's ``message_id`` and
the verdict, never a registry payload's bits: not on ``/generate`` (JSON or SSE), not
on ``/v1`` (chat, completions, Responses, a stored Response), not on an idempotent
replay of an analyst's answer, and not as decoded bits or per-bit confidence on
``/decode``. A key with the ``provenance`` scope sees all of it; a client-chosen payload
is echoed to the key that chose it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, new_tenant, store_client

from app.services.disclosure import redact_stored, reveals_generated, sees_client_bits

PROMPT: dict[str, Any] = {"prompt": "Write about tides.", "max_new_tokens": 24, "seed": 3}


@pytest.fixture
def client(tiny_model_dir: Path, tmp_path: Path) -> Iterator[TestClient]:
    with store_client("sqlite", tiny_model_dir, tmp_path, "disclose") as c:
        yield c


def _key(c: TestClient, tenant_id: str, scopes: list[str]) -> dict[str, str]:
    body = {"name": "k " + " ".join(scopes), "scopes": scopes, "detail": "full"}
    r = c.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


@pytest.fixture
def keys(client: TestClient) -> dict[str, dict[str, str]]:
    """One tenant granted both gated scopes, and three of its keys: an ordinary one,
    an analyst's (provenance) and one that may choose payloads (fixed_payload)."""
    tenant_id, _ = new_tenant(client, scopes=("fixed_payload", "provenance"))
    return {
        "ordinary": _key(client, tenant_id, ["generate", "detect", "decode"]),
        "analyst": _key(client, tenant_id, ["generate", "detect", "decode", "provenance"]),
        "chooser": _key(client, tenant_id, ["generate", "decode", "fixed_payload"]),
    }


def _model(c: TestClient, auth: dict[str, str]) -> str:
    return str(c.get("/v1/models", headers=auth).json()["data"][0]["id"])


def test_generate_shows_registry_bits_to_analysts_only(
    client: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    plain = client.post("/generate", json=PROMPT, headers=keys["ordinary"])
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["payload"] is None and body["num_bits"] == 32
    assert isinstance(body["message_id"], int)
    analyst = client.post("/generate", json=PROMPT, headers=keys["analyst"]).json()
    assert len(analyst["payload"]["bits"]) == analyst["num_bits"] == 32
    assert analyst["payload"]["hex"] == format(int(analyst["payload"]["bits"], 2), "x")
    # the stream's result event is the same answer
    streamed = client.post("/generate", json={**PROMPT, "stream": True}, headers=keys["ordinary"])
    result = next(
        json.loads(line.removeprefix("data: "))
        for block in streamed.text.split("\n\n")
        if block.startswith("event: result")
        for line in block.splitlines()
        if line.startswith("data: ")
    )
    assert result["payload"] is None and result["message_id"] is not None


def test_a_chosen_payload_is_echoed_to_its_chooser(
    client: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    """Sealed: the answer echoes the chosen bits (never the carried payload of the entry
    that seals them), to the chooser and on a replay by another key of the tenant."""
    body = {**PROMPT, "payload": {"bits": "1011"}}
    idem = {"Idempotency-Key": "disclose-chosen"}
    r = client.post("/generate", json=body, headers={**keys["chooser"], **idem})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["payload"] == {"bits": "1011", "hex": "b", "num_bits": 4}, answer
    assert answer["client_payload"] is True and answer["message_id"] is not None, answer
    assert answer["num_bits"] == 32, answer  # the entry's length: the carried payload's
    again = client.post("/generate", json=body, headers={**keys["ordinary"], **idem})
    assert again.status_code == 200 and again.json() == answer, again.text


def test_v1_answers_and_stored_responses_withhold_registry_bits(
    client: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    chat = {
        "model": _model(client, keys["ordinary"]),
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "n": 2,
    }
    for who, shown in (("ordinary", False), ("analyst", True)):
        r = client.post("/v1/chat/completions", json=chat, headers=keys[who])
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            wm = choice["watermark"]
            assert wm["message_id"] is not None and wm["num_bits"] == 32
            assert (wm["payload_bits"] is not None) is shown, (who, wm)
            assert (wm["payload_hex"] is not None) is shown, (who, wm)
    completion = {"model": chat["model"], "prompt": "Tides", "max_tokens": 6}
    r = client.post("/v1/completions", json=completion, headers=keys["ordinary"])
    assert r.status_code == 200 and r.json()["choices"][0]["watermark"]["payload_bits"] is None
    # a Response the analyst created, retrieved by an ordinary key of the tenant
    made = client.post(
        "/v1/responses",
        json={"model": chat["model"], "input": "Hi", "max_output_tokens": 6},
        headers=keys["analyst"],
    )
    assert made.status_code == 200, made.text
    assert made.json()["watermark"]["payload_bits"] is not None
    rid = made.json()["id"]
    seen = client.get(f"/v1/responses/{rid}", headers=keys["ordinary"])
    assert seen.status_code == 200, seen.text
    assert seen.json()["watermark"]["payload_bits"] is None
    assert seen.json()["watermark"]["message_id"] == made.json()["watermark"]["message_id"]
    again = client.get(f"/v1/responses/{rid}", headers=keys["analyst"]).json()
    assert again["watermark"]["payload_bits"] == made.json()["watermark"]["payload_bits"]


def test_an_idempotent_replay_is_redacted_for_the_replaying_key(
    client: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    """An analyst's stored answer replayed (same Idempotency-Key and body) by an
    ordinary key of the tenant: the same text and entry, no bits."""
    first = client.post(
        "/generate", json=PROMPT, headers={**keys["analyst"], "Idempotency-Key": "disclose-1"}
    )
    assert first.status_code == 200 and first.json()["payload"] is not None
    again = client.post(
        "/generate", json=PROMPT, headers={**keys["ordinary"], "Idempotency-Key": "disclose-1"}
    )
    assert again.status_code == 200, again.text
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json()["text"] == first.json()["text"]
    assert again.json()["message_id"] == first.json()["message_id"]
    assert again.json()["payload"] is None


def test_decode_shows_decoded_bits_to_analysts_only(
    client: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    """The same text decoded by both keys: one verdict and entry, bits for the analyst."""
    gen = client.post(
        "/generate", json={**PROMPT, "max_new_tokens": 64}, headers=keys["analyst"]
    ).json()
    answers = {
        who: client.post("/decode", json={"text": gen["text"]}, headers=keys[who]).json()
        for who in ("ordinary", "analyst")
    }
    plain, analyst = answers["ordinary"], answers["analyst"]
    assert plain["bits"] is None and plain["bit_confidence"] is None
    assert plain["num_bits"] == analyst["num_bits"] == 32
    assert len(analyst["bits"]) == 32 and len(analyst["bit_confidence"]) == 32
    for field in ("verdict", "p_value", "registry_match", "erasures"):
        assert plain[field] == analyst[field], field
    batch = client.post("/decode/batch", json={"texts": [gen["text"]]}, headers=keys["ordinary"])
    assert batch.status_code == 200, batch.text
    assert batch.json()["results"][0]["result"]["bits"] is None


def test_the_policy() -> None:
    assert not reveals_generated(frozenset({"generate", "decode"}))
    assert not reveals_generated(frozenset({"generate", "fixed_payload"}))
    assert reveals_generated(frozenset({"generate", "provenance"}))
    assert sees_client_bits(frozenset({"fixed_payload"}))
    assert not sees_client_bits(frozenset({"generate", "decode", "detect"}))
    stored = {
        "payload": {"bits": "1011", "hex": "b", "num_bits": 4},
        "message_id": 7,
        "choices": [{"watermark": {"message_id": 7, "payload_bits": "1", "payload_hex": "1"}}],
    }
    out = redact_stored(stored, frozenset({"generate"}))
    assert out["payload"] is None and out["choices"][0]["watermark"]["payload_bits"] is None
    assert stored["payload"] is not None  # the stored record itself is left as it was
    assert redact_stored(stored, frozenset({"provenance"})) == stored
    # a client's own payload (no message id) is not redacted
    own = {"payload": {"bits": "1"}, "message_id": None}
    assert redact_stored(own, frozenset()) == own
    # nor one sealed in an entry (the chosen bits, not the carried ones)
    sealed = {"payload": {"bits": "1"}, "message_id": 8, "client_payload": True}
    assert redact_stored(sealed, frozenset()) == sealed
    receipt = {"message_id": 8, "payload_bits": "1", "payload_hex": "1", "client_payload": True}
    chosen = {"choices": [{"watermark": receipt}]}
    assert redact_stored(chosen, frozenset()) == chosen
