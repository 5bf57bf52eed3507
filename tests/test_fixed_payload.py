"""Client-chosen payloads: refused without the ``fixed_payload`` scope, capped per payload.

Many texts under one payload are what a watermark-stealing attacker learns from
(SECURITY.md, Forgery and framing): a registry-issued payload differs per text, a
fixed one keeps every context's favoured tokens the same. So a key chooses its
payload only with the ``fixed_payload`` scope, which an admin grants to the tenant,
and each payload is counted per key version in the store (SQLite and Redis here).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from test_service_api import (
    ADMIN,
    ANALYST,
    MASTER_KEY,
    assert_error,
    fixed_watermark_keys,
    new_tenant,
    store_client,
)

from app.services.corpus import Fields, RawRow
from worldcup_scan.keys import StoreSession, open_store
from worldcup_scan.scanner import Scanner, ScanSpec

BODY: dict[str, Any] = {"prompt": "Tides.", "max_new_tokens": 4, "seed": 1}
FIXED = {**BODY, "payload": {"bits": "1011"}}


@pytest.fixture(params=["sqlite", "redis"])
def client(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    overrides: dict[str, Any] = {"fixed_payload_repeats": 3}
    with store_client(request.param, tiny_model_dir, tmp_path, "fixedpl", **overrides) as c:
        yield c


def served(c: TestClient, auth: dict[str, str]) -> str:
    return str(c.get("/v1/models", headers=auth).json()["data"][0]["id"])


def generate(c: TestClient, auth: dict[str, str], body: dict[str, Any]) -> httpx.Response:
    return c.post("/generate", json=body, headers=auth)


def test_a_payload_is_refused_without_the_scope_and_metadata_is_the_way(client: Any) -> None:
    tenant_id, auth = new_tenant(client, scopes=())
    err = assert_error(generate(client, auth, FIXED), 403, "fixed_payload_not_allowed")
    assert "fixed_payload" in err["message"] and '"metadata": {}' in err["message"]
    chat = {
        "model": served(client, auth),
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "watermark": {"payload": {"hex": "69a5", "num_bits": 16}},
    }
    r = client.post("/v1/chat/completions", json=chat, headers=auth)
    assert r.status_code == 403 and r.json()["error"]["code"] == "fixed_payload_not_allowed"
    # a bare request gets a registry entry with empty metadata, as /v1 does
    r = generate(client, auth, BODY)
    assert r.status_code == 200, r.text
    entry = client.get(
        f"/admin/tenants/{tenant_id}/registry/{r.json()['message_id']}", headers=ADMIN
    )
    assert entry.status_code == 200 and entry.json()["metadata"] == {}, entry.text
    # payload with metadata is still refused, and says that neither is fine
    both = {**FIXED, "metadata": {"u": 1}}
    assert "without either" in assert_error(generate(client, auth, both), 422)["message"]


def test_the_grant_needs_the_tenant_and_the_key(client: Any) -> None:
    tenant_id, auth = new_tenant(client)  # granted
    assert generate(client, auth, FIXED).status_code == 200
    # a key of the granted tenant without the scope is refused
    body = {"name": "gen only", "scopes": ["generate"], "detail": "full"}
    r = client.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    plain = {"Authorization": f"Bearer {r.json()['api_key']}"}
    assert_error(generate(client, plain, FIXED), 403, "fixed_payload_not_allowed")
    # the scope on a key of a tenant without the grant is not enough either
    other_id, _ = new_tenant(client, scopes=())
    body["scopes"] = ["generate", "fixed_payload"]
    r = client.post(f"/admin/tenants/{other_id}/api-keys", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    ungranted = {"Authorization": f"Bearer {r.json()['api_key']}"}
    assert_error(generate(client, ungranted, FIXED), 403, "fixed_payload_not_allowed")
    # granting the tenant later opens it for that key
    r = client.put(
        f"/admin/tenants/{other_id}/scopes", json={"scopes": ["fixed_payload"]}, headers=ADMIN
    )
    assert r.status_code == 200, r.text
    assert generate(client, ungranted, FIXED).status_code == 200


def test_repeats_of_one_payload_are_capped_per_key_version(client: Any) -> None:
    tenant_id, auth = new_tenant(client)
    for _ in range(3):  # fixed_payload_repeats = 3
        assert generate(client, auth, FIXED).status_code == 200
    r = generate(client, auth, FIXED)
    err = assert_error(r, 429, "payload_repeats_exceeded")
    assert int(r.headers["Retry-After"]) > 0 and "metadata" in err["message"]
    # the same bits spelt another way are the same payload
    hexed = {**BODY, "payload": {"hex": "b", "num_bits": 4}}
    assert_error(generate(client, auth, hexed), 429, "payload_repeats_exceeded")
    # another payload, or another length of the same digits, has its own count
    assert generate(client, auth, {**BODY, "payload": {"bits": "1010"}}).status_code == 200
    assert generate(client, auth, {**BODY, "payload": {"bits": "01011"}}).status_code == 200
    # OpenAI n counts every choice: 2 of the 3 left for this payload, n=3 is refused
    chat = {
        "model": served(client, auth),
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "n": 2,
        "watermark": {"payload": {"bits": "0110"}},
    }
    assert client.post("/v1/chat/completions", json=chat, headers=auth).status_code == 200
    r = client.post("/v1/chat/completions", json={**chat, "n": 2}, headers=auth)
    assert r.status_code == 429 and r.json()["error"]["code"] == "payload_repeats_exceeded"
    # other tenants are not affected; a new key version starts its own count
    _, other = new_tenant(client)
    assert generate(client, other, FIXED).status_code == 200
    assert client.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN).status_code == 200
    assert generate(client, auth, FIXED).status_code == 200
    # registry-issued payloads are never capped
    for i in range(4):
        assert generate(client, auth, {**BODY, "metadata": {"i": i}}).status_code == 200


CHOSEN = {"prompt": "Write about tides.", "max_new_tokens": 64, "min_new_tokens": 64}


def _other_entries(client: Any, auth: dict[str, str]) -> list[tuple[int, str]]:
    """Six registry entries of other users: (message id, payload bits)."""
    entries = []
    for i in range(6):
        body = {**BODY, "max_new_tokens": 1, "metadata": {"u": i}, "num_bits": 16}
        r = generate(client, auth, body)
        assert r.status_code == 200, r.text
        entries.append((r.json()["message_id"], r.json()["payload"]["bits"]))
    return entries


def _text_under(client: Any, auth: dict[str, str], bits: str) -> str:
    """A 64-token text under the client-chosen payload ``bits``."""
    r = generate(client, auth, {**CHOSEN, "seed": 5, "payload": {"bits": bits}})
    assert r.status_code == 200, r.text
    return str(r.json()["text"])


def test_texts_under_a_client_payload_are_named_as_that_payload(client: Any) -> None:
    """A client-chosen payload is recorded as a registry candidate: its texts are named
    as the client's own payload (``client_payload``), never as another user's entry,
    by /decode and /provenance alike."""
    with fixed_watermark_keys(71):
        tenant_id, auth = new_tenant(client, scopes=ANALYST)  # it reads issued bits
    _other_entries(client, auth)  # other users' entries the text could be mistaken for
    bits = "0110100111000101"
    text = _text_under(client, auth, bits)
    dec = client.post("/decode", json={"text": text, "num_bits": 16}, headers=auth).json()
    assert dec["verdict"] == "watermarked", dec
    match = dec["registry_match"]
    assert match is not None, dec
    assert match["client_payload"] is True and match["bits"] == bits, match
    assert match["message_id"] is None and match["metadata"] == {}, match
    # a key that may not choose payloads learns that a client chose one, not its bits
    body = {"name": "reader", "scopes": ["decode"], "detail": "full"}
    made = client.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
    reader = {"Authorization": f"Bearer {made.json()['api_key']}"}
    seen = client.post("/decode", json={"text": text, "num_bits": 16}, headers=reader).json()
    assert seen["registry_match"]["client_payload"] is True, seen
    assert seen["registry_match"]["bits"] is None and seen["bits"] is None, seen
    found = client.post("/provenance", json={"text": text}, headers=ADMIN).json()
    entry = found["match"]["registry_entry"]
    assert found["match"]["tenant_id"] == tenant_id and entry["client_payload"] is True, found
    # a registry-issued text of the same tenant still names its own entry
    body = {**CHOSEN, "metadata": {"u": "me"}, "num_bits": 16, "seed": 6}
    r = generate(client, auth, body)
    assert r.status_code == 200, r.text
    dec = client.post("/decode", json={"text": r.json()["text"], "num_bits": 16}, headers=auth)
    match = dec.json()["registry_match"]
    assert match["message_id"] == r.json()["message_id"] and not match["client_payload"], match


def test_a_scan_of_the_store_names_a_client_payload_as_the_api_does(
    client: Any, smollm2_tokenizer: Any
) -> None:
    """``worldcup scan`` reads the payloads the service recorded: a text under a
    client-chosen payload one bit from another user's entry is reported as the client's
    payload (``client_payload``, no ``message_id``), as /decode names it, never as that
    entry, which the same scan without the recorded payloads names."""
    with fixed_watermark_keys(71):
        tenant_id, auth = new_tenant(client, scopes=ANALYST)  # it reads issued bits
    entries = _other_entries(client, auth)
    near_id, near_bits = entries[2]  # the client's payload: one bit from this entry's
    bits = near_bits[:7] + ("1" if near_bits[7] == "0" else "0") + near_bits[8:]
    text = _text_under(client, auth, bits)
    dec = client.post("/decode", json={"text": text, "num_bits": 16}, headers=auth).json()
    assert dec["registry_match"]["client_payload"] is True, dec
    # the scan, keys and registry read from the service's store
    settings = client.app.state.runtime.settings
    if settings.redis_url:
        store = open_store(settings.redis_url, redis_prefix=settings.redis_prefix)
    else:
        store = open_store(str(settings.sqlite_path))
    session = StoreSession(store, bytes.fromhex(MASTER_KEY))
    try:
        keys = session.load_keys(tenant_id)
    finally:
        session.close()
    assert keys.client_payloads == {(tenant_id, 1): {16: [int(bits, 2)]}}
    spec = ScanSpec(keys, "detect", Fields("text", "id"))
    rows = [RawRow("under-client-payload", "api", 0, text, None)]
    row = Scanner(spec, smollm2_tokenizer).scan_rows(rows)[0]
    assert row["verdict"] == "watermarked" and row["key_version"] == 1, row
    assert row["client_payload"] is True and row["message_id"] is None, row
    assert not row["registry_ambiguous"] and not row["registry_expired"], row
    # the scan before it read them: the neighbour, another user's entry, was named
    blind = replace(spec, keys=replace(keys, client_payloads={}))
    before = Scanner(blind, smollm2_tokenizer).scan_rows(rows)[0]
    assert before["message_id"] == near_id and before["client_payload"] is False, before
