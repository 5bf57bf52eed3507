"""Issue 4 over the real app (tiny model, SQLite): provenance across tenants with its
audit log and scope, bulk decode/detect, per-tenant rate limits and master-key
rotation without downtime."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import (
    ADMIN,
    ANALYST,
    MASTER_KEY,
    assert_error,
    fixed_watermark_keys,
    make_settings,
    metric_value,
    metrics_text,
    new_tenant,
)

from app.main import create_app
from worldcup_core.config import SERVICE_PRESET, WATERMARK_PRESETS

HUMAN = (
    "The committee met on Tuesday to discuss the budget for next year. Several members "
    "argued that the library needed a new roof before anything else, while others wanted "
    "to extend the opening hours. No decision was taken and the meeting ran late. The "
    "chair asked for written proposals by the end of the month, with costs, and promised "
    "that the next meeting would start on time and end with a vote on both questions."
)


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("db"), max_batch_texts=50)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def generate(c: TestClient, auth: dict[str, str], seed: int, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": "Write about tides.",
        "max_new_tokens": 64,
        "min_new_tokens": 64,
        "seed": seed,
    }
    body.update(kw)
    if "payload" not in body and "metadata" not in body:
        body["metadata"] = {"user": f"u-{seed}"}
        body["num_bits"] = 16
    r = c.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def investigator(c: TestClient) -> dict[str, str]:
    r = c.post("/admin/tenants", json={"name": "t-and-s", "scopes": ["provenance"]}, headers=ADMIN)
    assert r.status_code == 201, r.text
    assert r.json()["scopes"] == ["provenance"]
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


# --------------------------------------------------------------------------- provenance
def test_provenance_finds_tenant_key_version_and_registry_entry(client: TestClient) -> None:
    with fixed_watermark_keys(41):
        # analysts' keys: the issued payload bits are compared with the decoded ones
        tenants = [new_tenant(client, f"prov-{i}", scopes=ANALYST) for i in range(4)]
        owner_id, owner_auth = tenants[2]
        # the owner rotates: the text is made under version 2, version 1 stays searchable
        # (inside the fixed keys too: a random version-2 key made this test flaky)
        r = client.post(f"/admin/tenants/{owner_id}/rotate-key", headers=ADMIN)
        assert r.status_code == 200 and r.json()["key_version"] == 2
    gen = generate(client, owner_auth, seed=3)
    tns = investigator(client)

    r = client.post("/provenance", json={"text": gen["text"]}, headers=tns)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["found"] is True and body["p_value"] < 1e-6
    assert body["num_keys"] >= 6 and body["num_tenants"] >= 5  # 4 + rotation + investigator
    match = body["match"]
    assert match["tenant_id"] == owner_id and match["tenant_name"] == "prov-2"
    assert match["key_version"] == 2 and match["num_bits"] == 16
    entry = match["registry_entry"]
    assert entry["message_id"] == gen["message_id"] and entry["metadata"] == {"user": "u-3"}
    assert entry["p_value"] < 0.01
    assert sum(a == b for a, b in zip(match["bits"], gen["payload"]["bits"], strict=True)) >= 14
    assert body["candidates"][0]["tenant_id"] == owner_id
    # the answer's one p-value is its smallest combined test; each test's combined p
    # (corrected for the search) is no smaller than its own
    assert body["p_value"] == min(t["combined_p_value"] for t in body["tests"])
    assert all(t["combined_p_value"] >= (t["p_value"] or 1.0) for t in body["tests"])
    assert body["scan_seconds"] > 0 and body["scan_ms_per_1000_keys"] > 0
    assert body["token_scores"] is None


def test_provenance_on_human_text_finds_nothing(client: TestClient) -> None:
    r = client.post("/provenance", json={"text": HUMAN}, headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["found"] is False and body["match"] is None
    # the words are the verdict's (never "no watermark" of a text with some evidence)
    assert body["verdict"] != "watermarked" and body["p_value"] >= 1e-6
    assert body["message"].startswith(
        {"not_watermarked": "No watermark found"}.get(body["verdict"], "Inconclusive")
    ), body


def test_provenance_access_and_admin_only_token_scores(client: TestClient) -> None:
    _, plain = new_tenant(client)
    assert_error(
        client.post("/provenance", json={"text": HUMAN}, headers=plain), 403, "missing_scope"
    )
    assert_error(client.post("/provenance", json={"text": HUMAN}), 401)
    bad = {"Authorization": "Bearer wc_not-a-key"}
    assert_error(client.post("/provenance", json={"text": HUMAN}, headers=bad), 401)
    tns = investigator_named(client, "t-and-s-2")
    body = {"text": HUMAN, "include_token_scores": True}
    assert_error(client.post("/provenance", json=body, headers=tns), 403, "admin_only")

    with fixed_watermark_keys(43):
        _, auth = new_tenant(client)
    gen = generate(client, auth, seed=5)
    r = client.post("/provenance", json={**body, "text": gen["text"]}, headers=ADMIN)
    assert r.status_code == 200, r.text
    scores = r.json()["token_scores"]
    assert scores and len(scores) == r.json()["num_scored_tokens"]
    groups = WATERMARK_PRESETS[SERVICE_PRESET].groups  # one mean per group of the key
    assert all(len(s["g_mean"]) == groups and 0 <= min(s["g_mean"]) for s in scores)
    indices = [s["index"] for s in scores]
    assert indices == sorted(set(indices))


def investigator_named(c: TestClient, name: str) -> dict[str, str]:
    r = c.post("/admin/tenants", json={"name": name}, headers=ADMIN)
    tenant_id, key = r.json()["tenant_id"], r.json()["api_key"]
    auth = {"Authorization": f"Bearer {key}"}
    assert_error(c.post("/provenance", json={"text": HUMAN}, headers=auth), 403, "missing_scope")
    r = c.put(f"/admin/tenants/{tenant_id}/scopes", json={"scopes": ["provenance"]}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["scopes"] == ["provenance"], r.text
    assert client_sees_scope(c, auth)
    return auth


def client_sees_scope(c: TestClient, auth: dict[str, str]) -> bool:
    # the granting replica drops its cached copy of the tenant at once
    return c.post("/provenance", json={"text": HUMAN}, headers=auth).status_code == 200


def test_scope_validation_and_unknown_tenant(client: TestClient) -> None:
    r = client.post("/admin/tenants", json={"name": "x1", "scopes": ["root"]}, headers=ADMIN)
    assert_error(r, 422, "invalid_request")
    r = client.put(f"/admin/tenants/{'0' * 32}/scopes", json={"scopes": []}, headers=ADMIN)
    assert_error(r, 404, "unknown_tenant")
    _, auth = new_tenant(client)
    r = client.put(f"/admin/tenants/{'0' * 32}/scopes", json={"scopes": []}, headers=auth)
    assert_error(r, 401)


def test_every_provenance_query_is_audited_without_the_text(client: TestClient) -> None:
    secret_text = "A unique sentence about zebras 7f3a9c that must never be stored."
    tns = investigator_named(client, "auditor-probe")
    before = client.get("/admin/audit", params={"limit": 1000}, headers=ADMIN).json()["entries"]
    for headers in (ADMIN, tns):
        r = client.post("/provenance", json={"text": secret_text}, headers=headers)
        assert r.status_code == 200, r.text
    r = client.get("/admin/audit", params={"limit": 1000}, headers=ADMIN)
    assert r.status_code == 200, r.text
    entries = r.json()["entries"]
    assert len(entries) == len(before) + 2
    newest, second = entries[0], entries[1]
    assert newest["actor"].startswith("tenant:") and second["actor"] == "admin"
    assert newest["action"] == "provenance" and newest["outcome"]["found"] is False
    assert newest["request_id"] and newest["request_id"] != "-"
    assert {"found", "tenant_id", "key_version", "message_id", "p_value"} <= set(newest["outcome"])
    assert "zebras" not in json.dumps(entries)
    # only the admin reads the log
    assert_error(client.get("/admin/audit", headers=tns), 401)


def test_provenance_refuses_bad_text(client: TestClient) -> None:
    # only whitespace is nothing to search, as empty text is
    assert_error(client.post("/provenance", json={"text": " \n"}, headers=ADMIN), 422)
    coerced = {"text": "x", "include_token_scores": "true"}
    r = client.post("/provenance", json=coerced, headers=ADMIN)
    assert_error(r, 422, "invalid_request")  # no string-to-bool coercion
    r = client.post("/provenance", json={"text": "x", "extra": 1}, headers=ADMIN)
    assert_error(r, 422, "invalid_request")


# --------------------------------------------------------------------------- bulk
def test_batch_decode_and_detect(client: TestClient) -> None:
    with fixed_watermark_keys(47):
        _, auth = new_tenant(client)
    gens = [generate(client, auth, seed=s) for s in (11, 12)]
    texts = [gens[0]["text"], HUMAN, ".", gens[1]["text"], "y" * 2001]
    # a text of only whitespace is refused as an empty one is: the whole request, by index
    blank = {"texts": [*texts[:2], "   "], "num_bits": 16}
    r = client.post("/decode/batch", json=blank, headers=auth)
    assert_error(r, 422, "invalid_request")
    assert r.json()["error"]["message"].startswith("texts.2: only whitespace")
    r = client.post("/decode/batch", json={"texts": texts, "num_bits": 16}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [item["index"] for item in body["results"]] == list(range(5))
    res = body["results"]
    assert res[2]["error"] is None and res[2]["result"]["is_watermarked"] is False
    assert res[4]["error"]["code"] == "text_too_long" and body["num_errors"] == 1
    for i, gen in ((0, gens[0]), (3, gens[1])):
        assert res[i]["error"] is None and res[i]["result"]["is_watermarked"] is True
        assert res[i]["result"]["registry_match"]["message_id"] == gen["message_id"]
        single = client.post("/decode", json={"text": texts[i], "num_bits": 16}, headers=auth)
        assert single.json() == res[i]["result"]  # bulk and single answers are identical
    assert res[1]["result"]["registry_match"] is None
    assert body["num_watermarked"] == sum(
        1 for x in res if x["result"] and x["result"]["is_watermarked"]
    )

    r = client.post("/detect/batch", json={"texts": texts}, headers=auth)
    assert r.status_code == 200, r.text
    det = r.json()["results"]
    assert det[0]["result"]["is_watermarked"] and det[3]["result"]["is_watermarked"]
    assert det[2]["error"] is None and det[2]["result"]["is_watermarked"] is False
    single = client.post("/detect", json={"text": texts[1]}, headers=auth).json()
    assert single == det[1]["result"]


def test_batch_limits(client: TestClient) -> None:
    _, auth = new_tenant(client)
    r = client.post("/detect/batch", json={"texts": ["a b c"] * 51}, headers=auth)
    assert_error(r, 422, "batch_too_large")
    # ... and the published schema says so: a request it calls valid is never refused
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("DetectBatchRequest", "DecodeBatchRequest"):
        assert schemas[name]["properties"]["texts"]["maxItems"] == 50
    r = client.post("/decode/batch", json={"texts": ["a b"], "key_version": "1"}, headers=auth)
    assert_error(r, 422, "invalid_request")  # no string-to-int coercion
    assert_error(client.post("/detect/batch", json={"texts": []}, headers=auth), 422)
    assert_error(client.post("/decode/batch", json={"texts": "abc"}, headers=auth), 422)
    # bulk routes have their own body limit (default 16 MiB), far above the 64 KiB one
    r = client.post("/detect/batch", json={"texts": ["word " * 300] * 40}, headers=auth)
    assert r.status_code == 200, r.text
    r = client.post("/detect", json={"text": "word " * 14_000}, headers=auth)
    assert_error(r, 413, "request_too_large")
    big = b'{"texts":["' + b"a" * (17 * 1024 * 1024) + b'"]}'
    r = client.post(
        "/decode/batch", content=big, headers={**auth, "Content-Type": "application/json"}
    )
    assert_error(r, 413, "request_too_large")
    # a key version the tenant does not have
    r = client.post("/decode/batch", json={"texts": ["a b"], "key_version": 9}, headers=auth)
    assert_error(r, 404, "unknown_key_version")


# --------------------------------------------------------------------------- rate limits
def test_rate_limit_is_per_tenant_with_retry_after(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(tiny_model_dir, tmp_path, rate_limit_per_s=0.2, rate_limit_burst=4)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        _, a = new_tenant(c)
        _, b = new_tenant(c)
        statuses = [
            c.post("/detect", json={"text": HUMAN}, headers=a).status_code for _ in range(5)
        ]
        assert statuses == [200, 200, 200, 200, 429]
        r = c.post("/decode", json={"text": HUMAN}, headers=a)
        err = assert_error(r, 429, "rate_limited")
        assert "retry in" in err["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 5
        # another tenant's bucket is untouched; a batch costs one token per text
        r = c.post("/detect/batch", json={"texts": [HUMAN] * 3}, headers=b)
        assert r.status_code == 200, r.text
        assert_error(c.post("/detect/batch", json={"texts": [HUMAN] * 2}, headers=b), 429)
        assert c.post("/detect", json={"text": HUMAN}, headers=b).status_code == 200
        # the admin API is not rate limited
        assert all(
            c.post("/admin/tenants", json={"name": f"n{i}"}, headers=ADMIN).status_code == 201
            for i in range(6)
        )
        assert (
            metric_value(
                metrics_text(c), "worldcup_request_rejections_total", reason="rate_limited"
            )
            == 3
        )


# --------------------------------------------------------------------------- master key
def test_master_key_rotation_rewraps_without_downtime(tiny_model_dir: Path, tmp_path: Path) -> None:
    new_key = "cd" * 32
    # a chosen payload carried as chosen: the same seed gives the same text under any
    # master key, so the watermark key the text was written with is the check
    pin = {"seal_client_payloads": False}
    old = make_settings(tiny_model_dir, tmp_path, **pin)  # master key MASTER_KEY
    both = make_settings(
        tiny_model_dir, tmp_path, master_key=new_key, master_key_previous=MASTER_KEY, **pin
    )
    new_only = make_settings(tiny_model_dir, tmp_path, master_key=new_key, **pin)
    gen_body = {
        "prompt": "Write about tides.",
        "max_new_tokens": 48,
        "min_new_tokens": 48,
        "seed": 9,
        "payload": {"bits": "1011001110001111"},
    }
    with TestClient(create_app(old), raise_server_exceptions=False) as c:
        tenants = [new_tenant(c) for _ in range(3)]
        tid, auth = tenants[0]
        assert c.post(f"/admin/tenants/{tid}/rotate-key", headers=ADMIN).status_code == 200
        before = c.post("/generate", json=gen_body, headers=auth).json()
        decoded_before = c.post(
            "/decode", json={"text": before["text"], "num_bits": 16}, headers=auth
        ).json()
        assert decoded_before["is_watermarked"]

    # step 1: replicas run the new key and still accept the old one
    with TestClient(create_app(both), raise_server_exceptions=False) as c:
        assert (
            c.post("/decode", json={"text": before["text"], "num_bits": 16}, headers=auth).json()
            == decoded_before
        )
        # step 2: rewrap while requests keep flowing
        stop = threading.Event()
        failures: list[str] = []

        def traffic() -> int:
            n = 0
            while not stop.is_set():
                r = c.post("/detect", json={"text": before["text"]}, headers=auth)
                if r.status_code != 200 or not r.json()["is_watermarked"]:
                    failures.append(r.text)
                n += 1
            return n

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(traffic) for _ in range(2)]
            r = c.post("/admin/master-key/rewrap", headers=ADMIN)
            stop.set()
            served = sum(f.result() for f in futures)
        assert r.status_code == 200, r.text
        assert r.json() == {"rewrapped": 4, "already_current": 0}  # 3 tenants, one rotated
        assert not failures and served > 0
        again = c.post("/admin/master-key/rewrap", headers=ADMIN).json()
        assert again == {"rewrapped": 0, "already_current": 4}  # idempotent
        assert_error(c.post("/admin/master-key/rewrap", headers=auth), 401)

    # step 3: the old key is gone; every watermark is unchanged
    with TestClient(create_app(new_only), raise_server_exceptions=False) as c:
        after = c.post("/decode", json={"text": before["text"], "num_bits": 16}, headers=auth)
        assert after.json() == decoded_before
        regenerated = c.post("/generate", json=gen_body, headers=auth).json()
        assert regenerated["text"] == before["text"]  # same key, same seed: same text
        for _, other in tenants[1:]:
            assert c.post("/detect", json={"text": HUMAN}, headers=other).status_code == 200

    # a server still on the old key alone cannot unwrap: a clear 503, not a 500
    with TestClient(create_app(old), raise_server_exceptions=False) as c:
        r = c.post("/detect", json={"text": before["text"]}, headers=auth)
        err = assert_error(r, 503, "key_unavailable")
        assert MASTER_KEY not in err["message"] and new_key not in err["message"]


def test_previous_master_key_is_validated(tiny_model_dir: Path, tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="MASTER_KEY_PREVIOUS must be 64 hex"):
        make_settings(tiny_model_dir, tmp_path, master_key_previous="abc")
    settings = make_settings(tiny_model_dir, tmp_path, master_key_previous="ee" * 32)
    assert "ee" * 32 not in repr(settings)
    assert settings.previous_master_keys == (bytes.fromhex("ee" * 32),)


def test_registry_match_needs_significance_and_confidence(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A close runner-up withholds the match rather than risk naming the wrong entry."""
    from types import SimpleNamespace

    from app.services.intake import registry_match
    from app.services.watermark import DecodeOutcome
    from app.stores.base import RegistryEntry
    from worldcup_core import WatermarkKey, WorldCup
    from worldcup_core.assess import Assessment, TestP, assess
    from worldcup_core.message import MessageIdCodec

    settings = make_settings(tiny_model_dir, tmp_path)
    runtime: Any = SimpleNamespace(settings=settings)
    scheme = WorldCup(WatermarkKey(bytes(32)))
    entry = RegistryEntry("t", 7, 1, 16, {"u": 1}, 1_700_000_000.0)
    bits = MessageIdCodec(scheme.key, 16).payload(7).bits
    result: Any = SimpleNamespace(bits=bits)

    def outcome(p_value: float, posterior: float, issued: str = bits) -> DecodeOutcome:
        match: Any = SimpleNamespace(p_value=p_value, posterior=posterior)
        return DecodeOutcome(1, result, match, entry, entry_bits=issued)

    def said(p_value: float) -> Assessment:
        tests = [TestP("detect", 0.5), TestP("decode", 0.5, 16), TestP("registry", p_value, 16)]
        return assess(tests, 1, "one key", 100)

    def named(runtime: Any, p_value: float, posterior: float, issued: str = bits) -> Any:
        return registry_match(runtime, outcome(p_value, posterior, issued), said(p_value))

    found = named(runtime, 1e-9, 0.99)
    assert found is not None and found.message_id == 7 and found.exact
    flipped = ("1" if bits[0] == "0" else "0") + bits[1:]
    inexact = named(runtime, 1e-9, 0.99, flipped)
    assert inexact is not None and not inexact.exact  # decoded with a bit error
    assert named(runtime, 1e-9, 0.80) is None  # ambiguous
    assert named(runtime, 0.2, 0.999) is None  # not significant
    # significant at the old 0.01 but not at the verdict's 1e-6 (corrected): not named
    assert said(1e-4).verdict == "inconclusive" and named(runtime, 1e-4, 0.999) is None
    lenient: Any = SimpleNamespace(
        settings=settings.model_copy(update={"registry_min_confidence": 0.5})
    )
    assert named(lenient, 1e-9, 0.80) is not None
