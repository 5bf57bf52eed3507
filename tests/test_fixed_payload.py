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
    unsealed,
)

from app.services.corpus import Fields, RawRow
from worldcup_scan.keys import StoreSession, open_store
from worldcup_scan.run import fill_registry
from worldcup_scan.scanner import Scanner, ScanSpec

BODY: dict[str, Any] = {"prompt": "Tides.", "max_new_tokens": 4, "seed": 1}
FIXED = {**BODY, "payload": {"bits": "1011"}}


@pytest.fixture(params=["sqlite", "redis"])
def client(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    # context_width 2: the keys and seeds asserted below were chosen at c = 2 (the scan
    # test's neighbouring entry is named by these texts' evidence)
    overrides: dict[str, Any] = {"fixed_payload_repeats": 3, "context_width": 2}
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
    """A 64-token text that carries the client-chosen payload ``bits`` itself, as texts
    issued before sealing do."""
    with unsealed(client.app):  # as texts issued before sealing
        r = generate(client, auth, {**CHOSEN, "seed": 5, "payload": {"bits": bits}})
    assert r.status_code == 200, r.text
    return str(r.json()["text"])


def test_a_chosen_payload_is_sealed_in_a_registry_entry_and_decodes_back(client: Any) -> None:
    """A client-chosen payload is sealed (SECURITY.md, Forgery and framing): each text
    gets a registry entry recording the chosen bits and carries the entry's keyed
    payload, so the bits a client chose are no labels of the bits its texts carry. The
    answers name the entry with ``client_payload`` and the chosen bits, by /decode and
    /provenance alike, and never reveal the carried bits to the client."""
    with fixed_watermark_keys(71):
        tenant_id, auth = new_tenant(client, scopes=ANALYST)  # it reads decoded bits
    _other_entries(client, auth)  # other users' entries the text could be mistaken for
    bits = "0110100111000101"
    answers = []
    for seed in (5, 6):
        r = generate(client, auth, {**CHOSEN, "seed": seed, "payload": {"bits": bits}})
        assert r.status_code == 200, r.text
        answers.append(r.json())
    for a in answers:  # the echo is the client's own payload, the entry seals it
        assert a["payload"]["bits"] == bits and a["client_payload"] is True, a
        assert a["message_id"] is not None and a["num_bits"] == 16, a
    assert answers[0]["message_id"] != answers[1]["message_id"]
    carried = []
    for a in answers:
        dec = client.post("/decode", json={"text": a["text"], "num_bits": 16}, headers=auth)
        dec = dec.json()
        assert dec["verdict"] == "watermarked", dec
        match = dec["registry_match"]
        assert match is not None and match["message_id"] == a["message_id"], dec
        assert match["client_payload"] is True and match["bits"] == bits, match
        assert match["metadata"] == {}, match  # the seal is no metadata of the tenant's
        carried.append(dec["bits"])  # an analyst's key sees the decoded (carried) bits
    # one chosen payload, two carried payloads, neither the chosen one
    assert carried[0] != carried[1] and bits not in carried, carried
    # the entry records the chosen bits; a client cannot forge a seal through metadata
    entry = client.get(
        f"/admin/tenants/{tenant_id}/registry/{answers[0]['message_id']}", headers=ADMIN
    ).json()
    assert entry["metadata"] == {"worldcup:client_payload": bits}, entry
    forged = {**BODY, "metadata": {"worldcup:client_payload": "1111"}}
    assert_error(generate(client, auth, forged), 422, "reserved_metadata_key")
    # a key that may not choose payloads learns that a client chose one, not its bits
    body = {"name": "reader", "scopes": ["decode"], "detail": "full"}
    made = client.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
    reader = {"Authorization": f"Bearer {made.json()['api_key']}"}
    text = answers[0]["text"]
    seen = client.post("/decode", json={"text": text, "num_bits": 16}, headers=reader).json()
    assert seen["registry_match"]["client_payload"] is True, seen
    assert seen["registry_match"]["bits"] is None and seen["bits"] is None, seen
    # /decode without num_bits finds the entry's length; a short payload is sealed at
    # the default length (32 here), which the answer gives as num_bits
    dec = client.post("/decode", json={"text": text}, headers=reader).json()
    assert dec["registry_match"]["message_id"] == answers[0]["message_id"], dec
    short = generate(client, auth, {**BODY, "payload": {"bits": "101"}}).json()
    assert short["payload"]["bits"] == "101" and short["num_bits"] == 32, short
    # /v1: each choice sealed in its own entry, its receipt the chosen bits
    chat = {
        "model": served(client, auth),
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "n": 2,
        "watermark": {"payload": {"hex": "69a5", "num_bits": 16}},
    }
    r = client.post("/v1/chat/completions", json=chat, headers=auth)
    assert r.status_code == 200, r.text
    receipts = [c["watermark"] for c in r.json()["choices"]]
    assert {w["payload_bits"] for w in receipts} == {format(0x69A5, "016b")}, receipts
    assert all(w["client_payload"] and w["num_bits"] == 16 for w in receipts), receipts
    assert len({w["message_id"] for w in receipts} - {None}) == 2, receipts
    found = client.post("/provenance", json={"text": text}, headers=ADMIN).json()
    entry = found["match"]["registry_entry"]
    assert found["match"]["tenant_id"] == tenant_id and entry["client_payload"] is True, found
    assert entry["message_id"] == answers[0]["message_id"], found
    # a registry-issued text of the same tenant still names its own entry, unsealed
    body = {**CHOSEN, "metadata": {"u": "me"}, "num_bits": 16, "seed": 6}
    r = generate(client, auth, body)
    assert r.status_code == 200, r.text
    dec = client.post("/decode", json={"text": r.json()["text"], "num_bits": 16}, headers=auth)
    match = dec.json()["registry_match"]
    assert match["message_id"] == r.json()["message_id"] and not match["client_payload"], match
    assert match["bits"] is None and match["metadata"] == {"u": "me"}, match


def test_a_scan_of_the_store_names_a_client_payload_as_the_api_does(
    client: Any, smollm2_tokenizer: Any
) -> None:
    """``worldcup scan`` reads the payloads releases before sealing recorded: a text under a
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
    # and a text under a sealed payload (today's): named as its entry
    r = generate(client, auth, {**CHOSEN, "seed": 7, "payload": {"bits": "1" * 16}})
    assert r.status_code == 200, r.text
    sealed_text, sealed_id = r.json()["text"], r.json()["message_id"]
    session = StoreSession(store, bytes.fromhex(MASTER_KEY))
    try:
        keys = session.load_keys(tenant_id)
        assert keys.client_payloads == {(tenant_id, 1): {16: [int(bits, 2)]}}
        # and its texts, the registry test's weight of it: the one issued above
        assert keys.client_uses == {(tenant_id, 1): {16: {int(bits, 2): 1}}}
        spec = ScanSpec(keys, "detect", Fields("text", "id"))
        rows = [
            RawRow("under-client-payload", "api", 0, text, None),
            RawRow("sealed", "api", 1, sealed_text, None),
        ]
        row, sealed_row = Scanner(spec, smollm2_tokenizer).scan_rows(rows)
        fill_registry(session, [row, sealed_row])  # the driver's registry read
    finally:
        session.close()
    assert row["verdict"] == "watermarked" and row["key_version"] == 1, row
    assert row["client_payload"] is True and row["message_id"] is None, row
    assert not row["registry_ambiguous"] and not row["registry_expired"], row
    assert sealed_row["message_id"] == sealed_id and sealed_row["client_payload"], sealed_row
    assert sealed_row["registry_metadata"] == "{}", sealed_row  # the seal is not metadata
    # the scan before it read them: the neighbour, another user's entry, was named
    blind = replace(spec, keys=replace(keys, client_payloads={}))
    before = Scanner(blind, smollm2_tokenizer).scan_rows(rows)[0]
    assert before["message_id"] == near_id and before["client_payload"] is False, before
