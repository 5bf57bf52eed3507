"""Issue 15, points 2 and 3: a responsive server under bulk load, and detection that
can be exposed (API keys with scopes and detail levels, probe budgets).

Over the tiny random-weight model through the real app (``TestClient``). The
load tests hold a worker job on a ``threading.Event`` instead of sleeping: the
probes are sent while the bulk request is provably in flight.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_service_api import (
    ADMIN,
    SECRETS_SEEN,
    assert_error,
    fixed_watermark_keys,
    gen_body,
    make_settings,
    metric_value,
    new_tenant,
)

import app.services.intake as intake_module
from app.main import create_app
from app.schemas.exposure import verdict_of
from app.services.probes import (
    ANCHOR_HITS,
    LINK,
    Canonical,
    Sketch,
    containment,
    probe_secret,
    sketch_tokens,
)
from app.services.probes import _hash_keys as hash_keys

TEXT = (
    "The storm reached the coast late on Tuesday, and by morning the harbour "
    "was full of broken boats and the streets were under water."
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def app(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    return create_app(
        make_settings(
            model_dir,
            tmp_path_factory.mktemp("db"),
            cpu_workers=1,
            cpu_max_pending=1,
            probe_budget_verdict=3,
            probe_budget_full=6,
            probe_full_answers=3,  # the default
            max_body_bytes=256 * 1024,
        )
    )


@pytest.fixture(scope="module")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


class Gate:
    """Replaces the tokenizer call of the scoring routes: the first call signals
    ``entered`` and blocks until ``release`` is set; later calls run normally."""

    def __init__(self, real: Callable[[Any, list[str]], list[list[int]]]) -> None:
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self._first = True
        self._lock = threading.Lock()

    def __call__(self, tokenizer: Any, texts: list[str]) -> list[list[int]]:
        with self._lock:
            first, self._first = self._first, False
        if first:
            self.entered.set()
            assert self.release.wait(30), "the test never released the gate"
        return self.real(tokenizer, texts)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(intake_module.encode_texts)
    monkeypatch.setattr(intake_module, "encode_texts", g)
    yield g
    g.release.set()


def test_probes_answer_while_a_bulk_request_is_in_flight(client: TestClient, gate: Gate) -> None:
    _, auth = new_tenant(client)
    with ThreadPoolExecutor(4) as pool:
        bulk = pool.submit(
            client.post, "/decode/batch", json={"texts": [TEXT * 10] * 50}, headers=auth
        )
        assert gate.entered.wait(30), "the bulk request never reached its worker"
        for path in ("/health", "/ready", "/metrics"):
            probe = pool.submit(client.get, path)
            r = probe.result(timeout=10)  # blocked event loop: TimeoutError here
            assert r.status_code == 200, (path, r.text)
            assert not bulk.done(), "the bulk request must still be in flight"
        gate.release.set()
        r = bulk.result(timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 50


def test_overload_is_shed_at_once_with_retry_after(client: TestClient, gate: Gate) -> None:
    """One admitted job at most (``cpu_max_pending=1``): while it runs, the next
    request is refused at once instead of queueing behind it."""
    _, auth = new_tenant(client)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.post, "/detect", json={"text": TEXT}, headers=auth)
        assert gate.entered.wait(30)
        r = client.post("/detect/batch", json={"texts": [TEXT]}, headers=auth)
        err = assert_error(r, 503, "overloaded")
        assert "capacity" in err["message"]
        assert r.headers["Retry-After"] == "1"
        gate.release.set()
        assert first.result(timeout=60).status_code == 200
    assert client.post("/detect", json={"text": TEXT}, headers=auth).status_code == 200
    metrics = client.get("/metrics").text
    assert 'worldcup_request_rejections_total{reason="overloaded"}' in metrics


def test_duplicate_authorization_headers_are_refused(client: TestClient) -> None:
    _, auth = new_tenant(client)
    headers = [
        ("Authorization", auth["Authorization"]),
        ("Authorization", f"Bearer wc_{uuid.uuid4().hex}"),
    ]
    r = client.post("/detect", json={"text": TEXT}, headers=headers)
    assert_error(r, 400, "duplicate_authorization")
    r = client.post("/admin/tenants", json={"name": "x"}, headers=[*headers, *ADMIN.items()])
    assert_error(r, 400, "duplicate_authorization")
    assert client.post("/detect", json={"text": TEXT}, headers=auth).status_code == 200


def test_batch_encoding_equals_the_tokenizer_call(smollm2_tokenizer: Any) -> None:
    """The worker encodes through the Rust backend; ids must equal the slow path's."""
    texts = [
        TEXT,
        "  leading and trailing spaces  ",
        "naïve café — “quotes” and emoji 🌊\nnew line\ttab",
        "x" * 3000,
        "日本語のテキストと English mixed",
    ]
    expected = [smollm2_tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert intake_module.encode_texts(smollm2_tokenizer, texts) == expected


@pytest.mark.anyio
async def test_accounting_off_allows_every_item_of_a_batch() -> None:
    """With no fingerprints (a detail level without a probe budget) or no probe store,
    every query of a batch is allowed, one decision per item: the accounting once
    answered an empty list here, which its callers had to patch."""
    from types import SimpleNamespace

    for detail in ("full", "verdict"):
        principal: Any = SimpleNamespace(key=SimpleNamespace(detail=detail))
        for probes in (None, SimpleNamespace()):
            runtime: Any = SimpleNamespace(probes=probes)
            got = await intake_module.account_sketches(runtime, principal, "x", None, 3)
            assert [a.decision.allowed for a in got] == [True, True, True]
            # unaccounted, a full key's answers are in full, a verdict key's never
            assert [a.full for a in got] == [detail == "full"] * 3
        runtime = SimpleNamespace(probes=None)
        sketches: list[Sketch | None] = [None, None]
        got = await intake_module.account_sketches(runtime, principal, "x", sketches, 2)
        assert len(got) == 2 and all(a.decision.allowed for a in got)


# --------------------------------------------------------------------------- API keys
def new_key(
    client: TestClient, tenant_id: str, scopes: list[str], detail: str = "full"
) -> tuple[dict[str, Any], dict[str, str]]:
    r = client.post(
        f"/admin/tenants/{tenant_id}/api-keys",
        json={"name": f"k {detail}", "scopes": scopes, "detail": detail},
        headers=ADMIN,
    )
    assert r.status_code == 201, r.text
    body = r.json()
    SECRETS_SEEN.add(body["api_key"])
    return body, {"Authorization": f"Bearer {body['api_key']}"}


def test_api_keys_scopes_listing_and_revocation(client: TestClient) -> None:
    tenant_id, primary = new_tenant(client)
    created, detect_only = new_key(client, tenant_id, ["detect"])
    assert created["scopes"] == ["detect"] and created["detail"] == "full"
    assert created["api_key"].startswith("wc_") and created["revoked_at"] is None

    r = client.post("/detect", json={"text": TEXT}, headers=detect_only)
    assert r.status_code == 200 and "p_value" in r.json()
    for path, body in (
        ("/decode", {"text": TEXT}),
        ("/decode/batch", {"texts": [TEXT]}),
        ("/generate", gen_body()),
        ("/provenance", {"text": TEXT}),
    ):
        err = assert_error(client.post(path, json=body, headers=detect_only), 403, "missing_scope")
        assert created["api_key"] not in err["message"]
    assert client.post("/detect/batch", json={"texts": [TEXT]}, headers=detect_only).is_success
    # the tenant's original key is its first key, with today's behaviour
    assert client.post("/decode", json={"text": TEXT}, headers=primary).status_code == 200
    assert client.post("/generate", json=gen_body(), headers=primary).status_code == 200

    listed = client.get(f"/admin/tenants/{tenant_id}/api-keys", headers=ADMIN)
    assert listed.status_code == 200, listed.text
    keys = listed.json()["keys"]
    assert [k["key_id"] for k in keys] == ["primary", created["key_id"]]
    assert keys[0]["scopes"] == ["generate", "detect", "decode", "provenance", "fixed_payload"]
    assert all("api_key" not in k and "key_hash" not in k for k in keys)
    assert created["api_key"] not in listed.text
    assert primary["Authorization"].removeprefix("Bearer ") not in listed.text

    # revoking one key leaves the others working
    r = client.delete(f"/admin/tenants/{tenant_id}/api-keys/{created['key_id']}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert_error(client.post("/detect", json={"text": TEXT}, headers=detect_only), 401)
    assert client.post("/detect", json={"text": TEXT}, headers=primary).status_code == 200
    r = client.delete(f"/admin/tenants/{tenant_id}/api-keys/primary", headers=ADMIN)
    assert r.status_code == 200
    assert_error(client.post("/detect", json={"text": TEXT}, headers=primary), 401)
    _, fresh = new_key(client, tenant_id, ["detect"])
    assert client.post("/detect", json={"text": TEXT}, headers=fresh).status_code == 200

    # admin only, unknown tenants and keys are 404, bad bodies 422
    url = f"/admin/tenants/{tenant_id}/api-keys"
    assert_error(client.get(url, headers=fresh), 401, "invalid_admin_token")
    assert_error(client.get(f"/admin/tenants/{'0' * 32}/api-keys", headers=ADMIN), 404)
    assert_error(client.delete(f"{url}/{'0' * 16}", headers=ADMIN), 404, "unknown_api_key")
    for bad in (
        {"name": "x", "scopes": ["admin"]},
        {"name": "x", "scopes": []},
        {"name": "x", "scopes": ["detect"], "detail": "some"},
        {"name": "x", "scopes": ["detect"], "extra": 1},
    ):
        assert_error(client.post(url, json=bad, headers=ADMIN), 422)


def test_provenance_scope_on_a_key_needs_the_tenant_grant(client: TestClient) -> None:
    tenant_id, _ = new_tenant(client)
    _, auth = new_key(client, tenant_id, ["provenance"])
    assert_error(client.post("/provenance", json={"text": TEXT}, headers=auth), 403)
    r = client.put(
        f"/admin/tenants/{tenant_id}/scopes", json={"scopes": ["provenance"]}, headers=ADMIN
    )
    assert r.status_code == 200
    assert client.post("/provenance", json={"text": TEXT}, headers=auth).status_code == 200


def test_verdict_levels() -> None:
    assert verdict_of(0.0) == verdict_of(9.99e-7) == "watermarked"
    assert verdict_of(1e-6) == verdict_of(0.0499) == "inconclusive"
    assert verdict_of(0.05) == verdict_of(1.0) == "not_watermarked"


GRADED = ("p_value", "z_score", "bits", "bit_confidence", "erasures", "num_scored_tokens")


def test_verdict_keys_see_three_words_only(client: TestClient) -> None:
    with fixed_watermark_keys(4321):
        tenant_id, primary = new_tenant(client)
    body = gen_body(metadata={"who": "v"}, max_new_tokens=96, min_new_tokens=96, seed=5)
    r = client.post("/generate", json=body, headers=primary)
    assert r.status_code == 200, r.text
    text, message_id = r.json()["text"], r.json()["message_id"]
    _, verdict = new_key(client, tenant_id, ["detect", "decode"], "verdict")

    # (the tenant's keys share one probe budget per text, so the full key's check
    # of this text comes last, below)
    r = client.post("/detect", json={"text": text}, headers=verdict)
    assert r.status_code == 200 and r.json() == {
        "detail": "verdict",
        "detail_reason": "verdict_key",
        "verdict": "watermarked",
    }
    r = client.post("/detect", json={"text": TEXT}, headers=verdict)
    full = client.post("/detect", json={"text": TEXT}, headers=primary).json()
    assert r.json() == {
        "detail": "verdict",
        "detail_reason": "verdict_key",
        "verdict": full["verdict"],
    }
    # the full answer's verdict is its p's, with the scored tokens' line
    assert full["verdict"] == verdict_of(full["p_value"], full["num_scored_tokens"])
    assert r.json()["verdict"] != "watermarked"

    r = client.post("/decode", json={"text": text, "num_bits": 32}, headers=verdict)
    assert r.status_code == 200, r.text
    dec = r.json()
    assert set(dec) == {"detail", "detail_reason", "verdict", "registry_match"}
    assert dec["verdict"] == "watermarked" and dec["detail_reason"] == "verdict_key"
    assert dec["registry_match"]["message_id"] == message_id
    assert dec["registry_match"]["metadata"] == {"who": "v"}
    assert set(dec["registry_match"]) == {"message_id", "metadata", "issued_at", "client_payload"}

    too_long = "x" * 2001  # over max_text_chars: that item's error
    r = client.post("/detect/batch", json={"texts": [text, TEXT, too_long]}, headers=verdict)
    batch = r.json()
    assert [i["result"] for i in batch["results"][:2]] == [
        {"detail": "verdict", "detail_reason": "verdict_key", "verdict": "watermarked"},
        {"detail": "verdict", "detail_reason": "verdict_key", "verdict": full["verdict"]},
    ]
    assert batch["results"][2]["error"]["code"] == "text_too_long"
    assert batch["num_watermarked"] == 1 and batch["num_errors"] == 1
    # that was the tenant's third query of the text (verdict budget 3): the next is
    # refused, under this key and under another verdict key of the tenant alike
    r = client.post("/decode/batch", json={"texts": [text]}, headers=verdict)
    assert r.json()["results"][0]["error"]["code"] == "probe_budget_exceeded"
    _, verdict2 = new_key(client, tenant_id, ["decode"], "verdict")
    r = client.post("/decode/batch", json={"texts": [text]}, headers=verdict2)
    assert r.json()["results"][0]["error"]["code"] == "probe_budget_exceeded"
    # a full key's own (larger) budget applies to the same shared count
    full = client.post("/detect", json={"text": text}, headers=primary).json()
    assert full["p_value"] < 1e-6  # the verdicts above had to be "watermarked"
    for answer in (batch, r.json(), dec):
        assert not any(f'"{name}"' in str(answer).replace("'", '"') for name in GRADED)


def test_a_full_key_gets_a_texts_p_value_three_times_then_the_verdict(
    client: TestClient,
) -> None:
    """The patient oracle attacker (SECURITY.md) climbs a full key's p-value one small
    edit at a time. A full key is answered in full about a text only 3 times a window
    (``probe_full_answers``), counted apart from the probe budget: later answers about
    that text, and about its near-copies (the same probe account), are the verdict
    only, on every scoring route. Verdict keys' queries never spend them; other texts
    keep their own; each downgraded answer is audited (the key id, never its secret)
    and counted by route."""
    with fixed_watermark_keys(1357):
        tenant_id, primary = new_tenant(client, scopes=("provenance", "fixed_payload"))
    body = gen_body(max_new_tokens=96, min_new_tokens=96, seed=11)
    r = client.post("/generate", json=body, headers=primary)
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    r = client.post("/generate", json={**body, "seed": 12}, headers=primary)
    second = r.json()["text"]
    before = metric_value(
        client.get("/metrics").text, "worldcup_probe_full_answers_spent_total", route="detect"
    )
    # a key version the tenant lacks is refused before the accounting: it spends neither
    # a full answer nor the budget (both counts below would be one off)
    for route, field in (("/decode", {"text": text}), ("/decode/batch", {"texts": [text]})):
        r = client.post(route, json={**field, "key_version": 99}, headers=primary)
        assert_error(r, 404, "unknown_key_version")
    for _ in range(3):
        answer = client.post("/detect", json={"text": text}, headers=primary).json()
        assert answer["p_value"] < 1e-6 and "detail" not in answer
    spent = {"detail": "verdict", "detail_reason": "full_answers_spent", "verdict": "watermarked"}
    # a near-copy is the same text's account: an edit does not buy a new p-value
    edited = _without_word(text, 5)
    assert client.post("/detect", json={"text": edited}, headers=primary).json() == spent
    r = client.post("/decode", json={"text": text, "evidence": True}, headers=primary)
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"detail", "detail_reason", "verdict", "registry_match"}
    assert r.json()["detail_reason"] == "full_answers_spent"
    r = client.post("/provenance", json={"text": text}, headers=primary)
    assert r.json() == {**spent, "tenant_id": tenant_id}
    # (full budget 6 in this fixture: that was the sixth query, and the next is refused)
    assert_error(client.post("/detect", json={"text": text}, headers=primary), 429)
    # the bulk routes: each item as its text's allowance says, near-copies in order
    r = client.post("/detect/batch", json={"texts": [second] * 4 + [TEXT]}, headers=primary)
    results = [i["result"] for i in r.json()["results"]]
    assert all("p_value" in a for a in results[:3]) and results[3] == spent
    assert "p_value" in results[4]  # another text: its own allowance
    assert r.json()["num_watermarked"] == 4
    r = client.post("/decode/batch", json={"texts": [second]}, headers=primary)
    assert r.json()["results"][0]["result"]["detail_reason"] == "full_answers_spent"

    # a verdict key's queries do not spend the full answers of another text
    other = (
        "Bees dance to tell the hive where flowers are: the angle of the dance points "
        "the way and its length says how far to fly."
    )
    _, verdict = new_key(client, tenant_id, ["detect"], "verdict")
    for _ in range(3):
        r = client.post("/detect", json={"text": other}, headers=verdict)
        assert r.json()["detail_reason"] == "verdict_key"
    assert "p_value" in client.post("/detect", json={"text": other}, headers=primary).json()

    metrics = client.get("/metrics").text
    after = metric_value(metrics, "worldcup_probe_full_answers_spent_total", route="detect")
    assert after - before == 1
    for route in ("decode", "provenance", "detect/batch", "decode/batch"):
        assert metric_value(metrics, "worldcup_probe_full_answers_spent_total", route=route) >= 1
    audit = client.get("/admin/audit?limit=100", headers=ADMIN).json()["entries"]
    mine = [e for e in audit if e["actor"] == f"tenant:{tenant_id}"]
    downgraded = [e for e in mine if e["action"] == "probe_full_answers_spent"]
    assert len(downgraded) == 5
    assert {e["outcome"]["route"] for e in downgraded} == {
        "detect", "decode", "provenance", "detect/batch", "decode/batch"
    }  # fmt: skip
    assert all(e["outcome"]["full_answers"] == 3 for e in downgraded)
    secret = primary["Authorization"].split()[1]
    assert secret not in json.dumps(audit) and secret not in metrics


def test_provenance_honours_verdict_and_is_accounted(client: TestClient) -> None:
    """Issue 24, point 2: a verdict key holding the provenance scope gets a verdict
    (verdict_of of the search's p-value) and whose key, nothing graded; its queries
    count against the tenant's probe budget (3 here) and its audit lines name the
    key. The admin token stays unmetered."""
    with fixed_watermark_keys(2468):
        tenant_id, primary = new_tenant(client)
    body = gen_body(max_new_tokens=96, min_new_tokens=96, seed=7)
    r = client.post("/generate", json=body, headers=primary)
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    grant = {"scopes": ["provenance"]}
    r = client.put(f"/admin/tenants/{tenant_id}/scopes", json=grant, headers=ADMIN)
    assert r.status_code == 200, r.text
    created, verdict = new_key(client, tenant_id, ["provenance"], "verdict")
    _, analyst = new_key(client, tenant_id, ["provenance"], "full")

    r = client.post("/provenance", json={"text": text}, headers=verdict)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "detail": "verdict",
        "detail_reason": "verdict_key",
        "verdict": "watermarked",
        "tenant_id": tenant_id,
    }
    admin = client.post("/provenance", json={"text": text}, headers=ADMIN).json()
    assert admin["p_value"] < 1e-6 and admin["match"]["tenant_id"] == tenant_id
    human = client.post("/provenance", json={"text": TEXT}, headers=verdict).json()
    full = client.post("/provenance", json={"text": TEXT}, headers=ADMIN).json()
    assert human == {
        "detail": "verdict",
        "detail_reason": "verdict_key",
        "verdict": full["verdict"],
        "tenant_id": None,
    }
    assert full["verdict"] == verdict_of(full["p_value"], full["num_scored_tokens"])
    for answer in (r.json(), human):
        assert not any(f'"{name}"' in str(answer).replace("'", '"') for name in GRADED)
        assert not {"candidates", "num_tokens", "match", "num_keys"} & set(answer)
    # a full analyst key of the tenant still gets the full answer, counted as well
    full = client.post("/provenance", json={"text": _without_word(text, 4)}, headers=analyst)
    assert full.status_code == 200 and full.json()["p_value"] < 1e-6
    # the tenant's third query of the text: the verdict budget (3) is then spent
    assert client.post("/provenance", json={"text": text}, headers=verdict).is_success
    err = assert_error(
        client.post("/provenance", json={"text": _without_word(text, 6)}, headers=verdict),
        429,
        "probe_budget_exceeded",
    )
    assert text not in err["message"]
    # the admin token is unmetered (and audited)
    for _ in range(4):
        assert client.post("/provenance", json={"text": text}, headers=ADMIN).is_success
    audit = client.get("/admin/audit?limit=50", headers=ADMIN).json()["entries"]
    mine = [e for e in audit if e["actor"] == f"tenant:{tenant_id}"]
    searches = [e for e in mine if e["action"] == "provenance"]
    assert [e["outcome"]["key_id"] for e in searches].count(created["key_id"]) == 3
    refusal = next(e for e in mine if e["action"] == "probe_budget_exceeded")
    assert refusal["outcome"]["route"] == "provenance"
    assert refusal["outcome"]["key_id"] == created["key_id"]
    assert sum(e["action"] == "provenance" and e["actor"] == "admin" for e in audit) >= 6
    assert created["api_key"] not in str(audit) and text not in str(audit)


# --------------------------------------------------------------------------- probes
def _without_word(text: str, i: int) -> str:
    words = text.split(" ")
    return " ".join(words[:i] + words[i + 1 :])


def test_probe_budget_429_audit_and_metric(client: TestClient) -> None:
    """Verdict keys here: 3 near-duplicate queries per text; full keys 6."""
    tenant_id, _ = new_tenant(client)
    _, auth = new_key(client, tenant_id, ["detect", "decode"], "verdict")
    _, other = new_key(client, tenant_id, ["detect"], "verdict")
    text = TEXT * 2
    before = metric_value(
        client.get("/metrics").text, "worldcup_probe_budget_exceeded_total", detail="verdict"
    )
    assert client.post("/detect", json={"text": text}, headers=auth).status_code == 200
    # near-duplicates (one word left out) of the same text count against its budget,
    # across /detect and /decode
    assert client.post("/detect", json={"text": _without_word(text, 3)}, headers=auth).is_success
    assert client.post("/decode", json={"text": _without_word(text, 9)}, headers=auth).is_success
    r = client.post("/detect", json={"text": _without_word(text, 12)}, headers=auth)
    err = assert_error(r, 429, "probe_budget_exceeded")
    assert "3 near-duplicate queries" in err["message"] and text not in err["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 86400  # the window: a day by default
    assert_error(client.post("/decode", json={"text": text}, headers=auth), 429)
    # an unrelated text has a budget of its own; another key of the tenant shares
    # this text's budget
    other_text = "Tides rise twice a day because the moon pulls the oceans toward it."
    assert client.post("/detect", json={"text": other_text}, headers=auth).status_code == 200
    assert_error(client.post("/detect", json={"text": text}, headers=other), 429)
    # batch items count one by one: the first two copies of a new text pass, the
    # third and fourth are refused as items, the spent text is refused too
    fresh = "A lighthouse keeper counted the ships that passed the point every night."
    r = client.post(
        "/detect/batch", json={"texts": [fresh, fresh, text, fresh, fresh]}, headers=auth
    )
    assert r.status_code == 200, r.text
    codes = [(i["error"] or {}).get("code") for i in r.json()["results"]]
    assert codes == [None, None, "probe_budget_exceeded", None, "probe_budget_exceeded"]
    assert r.json()["num_errors"] == 2

    after = metric_value(
        client.get("/metrics").text, "worldcup_probe_budget_exceeded_total", detail="verdict"
    )
    assert after - before == 5
    audit = client.get("/admin/audit?limit=50", headers=ADMIN).json()["entries"]
    mine = [
        e
        for e in audit
        if e["action"] == "probe_budget_exceeded" and e["actor"] == f"tenant:{tenant_id}"
    ]
    assert [e["outcome"]["refused"] for e in mine] == [2, 1, 1, 1]  # newest first
    assert {e["outcome"]["route"] for e in mine} == {"detect/batch", "decode", "detect"}
    assert all(e["outcome"]["budget"] == 3 and e["request_id"] for e in mine)
    assert text not in str(audit)


def test_a_tenants_keys_share_one_budget(client: TestClient) -> None:
    """Issue 24, point 1: accounted per tenant, audited per key. Two verdict keys of
    one tenant spend one budget of 3 together; another tenant's budget is its own."""
    tenant_id, primary = new_tenant(client)
    first, k1 = new_key(client, tenant_id, ["detect"], "verdict")
    second, k2 = new_key(client, tenant_id, ["detect", "decode"], "verdict")
    text = TEXT + " Cold rain fell on the square while the traders packed their stalls."
    assert client.post("/detect", json={"text": text}, headers=k1).is_success
    assert client.post("/detect", json={"text": _without_word(text, 2)}, headers=k2).is_success
    assert client.post("/decode", json={"text": text}, headers=k2).is_success
    # three queries by two keys: the tenant's verdict budget is spent, for both keys
    assert_error(client.post("/detect", json={"text": text}, headers=k1), 429)
    err = assert_error(client.post("/detect", json={"text": text}, headers=k2), 429)
    assert "all its API keys" in err["message"]
    # the full key's budget (6) applies to the same shared count of 3
    for i in range(3):
        r = client.post("/detect", json={"text": _without_word(text, i)}, headers=primary)
        assert r.status_code == 200, r.text
    assert_error(client.post("/detect", json={"text": text}, headers=primary), 429)
    # another tenant's keys have their own budget for the same text
    other_id, other_primary = new_tenant(client)
    _, other_verdict = new_key(client, other_id, ["detect"], "verdict")
    for headers in (other_verdict, other_verdict, other_primary):
        assert client.post("/detect", json={"text": text}, headers=headers).is_success
    # each refusal is audited under the tenant, naming the key that asked (never a secret)
    audit = client.get("/admin/audit?limit=50", headers=ADMIN).json()["entries"]
    refusals = [
        e
        for e in audit
        if e["action"] == "probe_budget_exceeded" and e["actor"] == f"tenant:{tenant_id}"
    ]
    assert [e["outcome"]["key_id"] for e in refusals] == [
        primary_key_id(client, tenant_id),
        second["key_id"],
        first["key_id"],
    ]
    assert not any(e["action"] == "probe_budget_exceeded" for e in audit if other_id in str(e))
    assert first["api_key"] not in str(audit) and second["api_key"] not in str(audit)


def primary_key_id(client: TestClient, tenant_id: str) -> str:
    keys = client.get(f"/admin/tenants/{tenant_id}/api-keys", headers=ADMIN).json()["keys"]
    return str(keys[0]["key_id"])  # oldest first: the key made with the tenant


def test_full_keys_have_the_larger_budget(client: TestClient) -> None:
    _, auth = new_tenant(client)
    texts = [_without_word(TEXT * 2, i) for i in range(8)]
    r = client.post("/detect/batch", json={"texts": texts}, headers=auth)
    codes = [(i["error"] or {}).get("code") for i in r.json()["results"]]
    assert codes == [None] * 6 + ["probe_budget_exceeded"] * 2
    assert_error(client.post("/detect", json={"text": texts[0]}, headers=auth), 429)


def test_a_console_batch_counts_each_row_against_the_probe_budget(client: TestClient) -> None:
    """A console batch goes through the bulk services: its rows count against the
    tenant's probe budget (6 for a full key) one by one, as /detect/batch's items do,
    and a refused row fails alone, in detect mode and in provenance mode (whose bulk
    form audits the refusal under its own route)."""
    tenant_id, _ = new_tenant(client)
    r = client.put(
        f"/admin/tenants/{tenant_id}/scopes", json={"scopes": ["provenance"]}, headers=ADMIN
    )
    assert r.status_code == 200, r.text
    _, key = new_key(client, tenant_id, ["provenance", "detect"], "full")
    texts = [_without_word(TEXT * 2, i) for i in range(8)]
    content = "\n".join(json.dumps({"text": t}) for t in texts)
    refused = "probe_budget_exceeded"
    for mode, expected in (("detect", [None] * 6 + [refused] * 2), ("provenance", [refused] * 8)):
        body = {"filename": "b.jsonl", "content": content, "mode": mode}
        r = client.post("/console/api/cases/batch", json=body, headers=key)
        assert r.status_code == 200, r.text
        codes = [(row["error"] or "").partition(":")[0] or None for row in r.json()["rows"]]
        assert codes == expected, mode
    audit = client.get("/admin/audit?limit=50", headers=ADMIN).json()["entries"]
    routes = {
        e["outcome"]["route"]
        for e in audit
        if e["action"] == refused and e["actor"] == f"tenant:{tenant_id}"
    }
    assert routes == {"detect/batch", "provenance/batch"}


def test_refused_batch_items_are_not_scored(
    app: FastAPI, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24, point 5: a refused item is fingerprinted and refused before any
    scoring, so it costs no scoring (or decoding) at all."""
    watermark = app.state.runtime.watermark
    scored: list[int] = []
    decoded: list[int] = []
    real_detector, real_decode = watermark.detector, watermark.decode_texts

    async def counting_detector(*args: Any, **kwargs: Any) -> Callable[[list[int]], Any]:
        score = await real_detector(*args, **kwargs)

        def counted(ids: list[int]) -> Any:
            scored.append(len(ids))
            return score(ids)

        return counted

    async def counting_decode(tenant_id: str, texts: Any, *args: Any) -> Any:
        decoded.append(len(texts))
        return await real_decode(tenant_id, texts, *args)

    monkeypatch.setattr(watermark, "detector", counting_detector)
    monkeypatch.setattr(watermark, "decode_texts", counting_decode)
    _, auth = new_tenant(client)  # a full key: budget 6 here
    texts = [_without_word(TEXT * 3, i) for i in range(10)]
    r = client.post("/detect/batch", json={"texts": texts}, headers=auth)
    codes = [(i["error"] or {}).get("code") for i in r.json()["results"]]
    assert codes == [None] * 6 + ["probe_budget_exceeded"] * 4
    assert len(scored) == 6  # not 10: the four refused items were never scored
    assert sum(decoded) == 6  # the verdict's decode test ran on the six allowed only
    r = client.post("/decode/batch", json={"texts": texts[:3]}, headers=auth)
    assert all(i["error"]["code"] == "probe_budget_exceeded" for i in r.json()["results"])
    assert sum(decoded) == 6  # the spent text is decoded for nobody
    assert len(scored) == 6


def _evasions(text: str, rng: Any, vocab: list[str]) -> dict[str, str | tuple[str, str]]:
    """The rewrites issue 24 found opening a fresh budget: each keeps most of the
    watermark evidence (the scored units) of ``text`` or of the text it is part of.
    A pair is (first query, later query) when both are rewritten."""
    words = text.split()
    n = len(words)

    def salt(k: int) -> list[str]:
        return [rng.choice(vocab) for _ in range(k)]

    def every(k: int) -> str:
        return " ".join(w for i in range(0, n, k) for w in [*words[i : i + k], *salt(1)])

    return {
        "salted, three words": " ".join(words[:5] + words[6:] + salt(3)),
        "salted, as many words as the text": " ".join(words + salt(n)),
        "both salted, as many words": (" ".join(words + salt(n)), " ".join(words[1:] + salt(n))),
        "first half": " ".join(words[: n // 2]),
        "second half": " ".join(words[n // 2 :]),
        "60-token window": " ".join(words[n // 3 : n // 3 + 45]),
        "sliding window": (" ".join(words[10:55]), " ".join(words[14:59])),
        "lower-cased": text.lower(),
        "re-spaced": "  ".join(words).replace(". ", ".\n\n"),
        "a random word every 5": every(5),
        "a random word every 10": every(10),
        "every 10th word replaced": " ".join(
            salt(1)[0] if i % 10 == 9 else w for i, w in enumerate(words)
        ),
        "padded": "Please check this for me. " * 3 + text + " Thank you.",
    }


def _articles(data_dir: Path, count: int, words: int) -> list[str]:
    import json

    with (data_dir / "cnn_dailymail_test.jsonl").open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [" ".join(r["article"].split()[:words]) for r in rows[:count]]


def test_containment_links_every_evasion_and_no_unrelated_text(
    smollm2_tokenizer: Any, data_dir: Path
) -> None:
    """Issue 24, point 1, on human news text through the real tokenizer: every rewrite
    that keeps the watermark evidence links to the original (either containment at
    least LINK), for all of 30 articles; 870 ordered pairs of different articles
    never do."""
    import random

    rng = random.Random(24)
    keys = hash_keys(probe_secret(b"k" * 32))
    canonical = Canonical(smollm2_tokenizer)
    texts = _articles(data_dir, 30, 216)
    vocab = [w for t in texts for w in t.split()]

    def sketch(text: str) -> Any:
        ids = smollm2_tokenizer(text, add_special_tokens=False).input_ids
        result = sketch_tokens(canonical.apply(ids), keys)
        assert result is not None
        return result.values

    def found(query: Any, stored: Any) -> bool:
        """The store's lookup: enough of the query's anchors are the account's."""
        return len(set(Sketch(query).anchors) & set(Sketch(stored).anchors)) >= ANCHOR_HITS

    sketches = [sketch(t) for t in texts]
    missed = []
    for text, original in zip(texts, sketches, strict=True):
        for name, rewrite in _evasions(text, rng, vocab).items():
            first, later = (
                (original, sketch(rewrite))
                if isinstance(rewrite, str)
                else (
                    sketch(rewrite[0]),
                    sketch(rewrite[1]),
                )
            )
            if max(containment(later, first)) < LINK or not found(later, first):
                missed.append(name)
    assert missed == []
    linked = [
        (i, j)
        for i in range(30)
        for j in range(30)
        if i != j and max(containment(sketches[i], sketches[j])) >= LINK
    ]
    assert linked == []


def test_containment_estimates_track_the_truth() -> None:
    """Statistical: on random token texts, the bottom-k estimate of each containment is
    within 4 standard errors of the true share (a sample of at least 64 units below
    the cut), near-copies clear LINK, unrelated texts share nothing, and the hashes
    are keyed."""
    import random

    keys = hash_keys(probe_secret(b"k" * 32))
    rng = random.Random(7)

    def units(t: list[int]) -> set[tuple[int, ...]]:
        return {tuple(t[i : i + 3]) for i in range(len(t) - 2)}

    for _ in range(40):
        base = [rng.randrange(49152) for _ in range(600)]
        a = sketch_tokens(base, keys)
        window = base[200:260]  # 58 units, all inside base
        padded = base + [rng.randrange(49152) for _ in range(1200)]  # base is a third
        other = [rng.randrange(49152) for _ in range(600)]
        for variant in (window, padded, other):
            b = sketch_tokens(variant, keys)
            assert a is not None and b is not None
            shared = len(units(base) & units(variant))
            for est, true, n in (
                (containment(b.values, a.values)[0], shared / len(units(variant)), 58),
                (containment(a.values, b.values)[0], shared / len(units(base)), 128),
            ):
                se = (max(true * (1 - true), 0.01) / min(n, 128)) ** 0.5
                assert abs(est - true) <= 4 * se + 0.02, (est, true)
        near = sketch_tokens(base[:300] + base[302:], keys)
        assert near is not None and min(containment(near.values, a.values)) >= 0.9
    other_keys = hash_keys(probe_secret(b"j" * 32))
    s1, s2 = sketch_tokens(base, keys), sketch_tokens(base, other_keys)
    assert s1 is not None and s2 is not None
    assert containment(s1.values, s2.values) == (0.0, 0.0)
    assert sketch_tokens([1, 2], keys) is None


def test_canonical_tokens_ignore_case_and_spacing(smollm2_tokenizer: Any) -> None:
    canonical = Canonical(smollm2_tokenizer)

    def ids(text: str) -> list[int]:
        return list(smollm2_tokenizer(text, add_special_tokens=False).input_ids)

    assert ids("The storm") != ids("the storm")
    assert canonical.apply(ids("The storm")).tolist() == canonical.apply(ids("the storm")).tolist()
    spaced = canonical.apply(ids("the  storm\n\nhit")).tolist()
    assert spaced == canonical.apply(ids("the storm hit")).tolist()
    # byte fragments of different characters stay apart
    assert len(set(canonical.apply(ids("\u00e9\u4e2d\U0001f600")).tolist())) == len(
        ids("\u00e9\u4e2d\U0001f600")
    )


def test_evasions_through_the_api_spend_the_originals_budget(
    client: TestClient, data_dir: Path
) -> None:
    """Issue 24, point 1, end to end: after the original text, two rewrites are
    answered and the third refused (verdict budget 3 here), whichever rewrite it is,
    and on another key of the same tenant."""
    import random

    rng = random.Random(5)
    text = _articles(data_dir, 1, 130)[0]  # salted with as many words: under 2 000 chars
    vocab = [w for t in _articles(data_dir, 40, 216)[1:] for w in t.split() if len(w) < 8]
    evasions = {k: v for k, v in _evasions(text, rng, vocab).items() if isinstance(v, str)}
    names = list(evasions)
    for i, name in enumerate(names):
        tenant_id, _ = new_tenant(client)
        _, k1 = new_key(client, tenant_id, ["detect"], "verdict")
        _, k2 = new_key(client, tenant_id, ["detect"], "verdict")
        assert client.post("/detect", json={"text": text}, headers=k1).is_success
        nxt, last = names[(i + 1) % len(names)], names[(i + 2) % len(names)]
        assert client.post("/detect", json={"text": evasions[name]}, headers=k2).is_success
        assert client.post("/detect", json={"text": evasions[nxt]}, headers=k1).is_success
        r = client.post("/detect", json={"text": evasions[last]}, headers=k2)
        assert_error(r, 429, "probe_budget_exceeded")
    # an unrelated article still has a budget of its own
    other = _articles(data_dir, 2, 130)[1]
    assert client.post("/detect", json={"text": other}, headers=k1).is_success


# --------------------------------------------------------------------------- attack bench
def test_attack_bench_budgets_stop_the_attack(model_dir: Path) -> None:
    """The removal-attack benchmark on the tiny model (a smoke run of the SECURITY.md
    table): with budgets on, no strategy gets more answers about the text than its
    key's budget, whether it salts, splits the text, spreads over keys or asks
    through /provenance (windows excepted: disjoint windows never asked as a whole
    are separate texts, each with its own budget: halves get two, windows four)."""
    from worldcup_cli.attack_bench import STRATEGIES, format_attack_bench, run_attack_bench

    result = run_attack_bench(model=str(model_dir), max_queries=300)
    runs = {(r["strategy"], r["budgets"]): r for r in result["runs"]}
    assert set(runs) == {(s, b) for s in STRATEGIES for b in (False, True)}
    assert result["initial_p_value"] < 1e-6 and result["text_words"] > 20
    # the attacked key is a new tenant's (the service's width) and the judge weighs tokens
    from worldcup_core.config import SERVICE_CONTEXT_WIDTH

    assert result["context_width"] == SERVICE_CONTEXT_WIDTH
    assert result["statistic"] == "model"
    budgets = result["budgets"]
    # the defaults
    assert budgets == {"full": 30, "verdict": 20, "full_answers": 3, "window_s": 86400.0}
    for name in STRATEGIES:
        on, off = runs[(name, True)], runs[(name, False)]
        assert off["refused"] == 0, off
        budget = budgets["verdict" if name == "greedy, verdict key" else "full"]
        pieces = {"halves": 2, "windows": 4}.get(name, 1)
        assert on["answered"] <= budget * pieces, on
        if on["outcome"] == "blocked by probe budget":
            assert on["refused"] > 0
    # the budget stops greedy, salted, spread and /provenance runs alike
    for name in ("greedy", "salted", "greedy, 4 keys", "greedy via /provenance"):
        assert runs[(name, True)]["answered"] == budgets["full"], runs[(name, True)]
    assert runs[("greedy, verdict key", True)]["survived"]
    for r in result["runs"]:  # the verdict's line is below the bench's 0.01
        assert r["watermarked"] == (r["final_p_value"] < 1e-6) and r["survived"] >= r["watermarked"]
    table = format_attack_bench(result)
    assert table.count("\n| ") == 2 * len(STRATEGIES) + 1 and "blocked by probe budget" in table
