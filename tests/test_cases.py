"""Issue 27, cases: the console's saved checks through the API and the store.

The store contract (SQLite and Redis): save, reopen, list by tenant and batch,
retention, deletion. The API (tiny model, SQLite): a check is saved with who ran it
(never a secret), the text's SHA-256 and the text only when asked; its owner's
tenant and the admin reopen it, another tenant's key gets the same 404 as for no
case; JSON and CSV exports; deletion; batches and their limit; one verdict function.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, fixed_watermark_keys, make_settings
from test_store_contract import FakeClock, clock, store  # noqa: F401 - fixtures
from test_trust_safety import HUMAN, generate

from app.main import create_app
from app.services.cases import CSV_COLUMNS, record_id
from app.stores.base import CaseRecord, Store
from worldcup_core.verdict import VERDICTS, report, verdict_of, verdict_sentence

# --------------------------------------------------------------------------- the store


def _case(tenant: str | None, *, at: float, batch: str | None = None, **kw: Any) -> CaseRecord:
    case_id = uuid.uuid4().hex[:16]
    return CaseRecord(
        case_id=case_id,
        created_at=at,
        tenant_id=tenant,
        record={"case_id": case_id, "verdict": "watermarked"},
        text=kw.pop("text", None),
        batch_id=batch,
        expires_at=kw.pop("expires_at", None),
    )


@pytest.mark.anyio
async def test_store_saves_lists_expires_and_deletes_cases(store: Store) -> None:  # noqa: F811
    now = time.time()
    a1 = _case("t_a", at=now - 3, text="the secret text", expires_at=now + 3600)
    a2 = _case("t_a", at=now - 2, batch="b_1234567")
    b1 = _case("t_b", at=now - 1, batch="b_1234567")
    admin = _case(None, at=now)
    for c in (a1, a2, b1, admin):
        await store.put_case(c)
    got = await store.get_case(a1.case_id, now)
    assert got == a1 and got.text == "the secret text"
    assert "secret" not in repr(got)
    assert [c.case_id for c in await store.list_cases("t_a", None, 10, now)] == [
        a2.case_id,
        a1.case_id,
    ]
    everyone = await store.list_cases(None, None, 10, now)
    assert [c.case_id for c in everyone] == [admin.case_id, b1.case_id, a2.case_id, a1.case_id]
    assert len(await store.list_cases(None, None, 2, now)) == 2
    batch = await store.list_cases(None, "b_1234567", 10, now)
    assert {c.case_id for c in batch} == {a2.case_id, b1.case_id}
    assert [c.case_id for c in await store.list_cases("t_b", "b_1234567", 10, now)] == [b1.case_id]
    # retention: past its expiry a case is gone from reads and lists
    later = now + 3601
    assert await store.get_case(a1.case_id, later) is None
    assert a1.case_id not in {c.case_id for c in await store.list_cases("t_a", None, 10, later)}
    # deletion deletes the case and its text
    assert await store.delete_case(a1.case_id) is True
    assert await store.get_case(a1.case_id, now) is None
    assert await store.delete_case(a1.case_id) is False
    assert a1.case_id not in {c.case_id for c in await store.list_cases(None, None, 10, now)}
    assert await store.get_case("no-such-case", now) is None


@pytest.mark.anyio
async def test_long_histories_page_newest_first(store: Store) -> None:  # noqa: F811
    now = time.time()
    made = [_case("t_long", at=now - 1000 + i) for i in range(230)]
    for c in made:
        await store.put_case(c)
    got = await store.list_cases("t_long", None, 215, now)
    assert [c.case_id for c in got] == [c.case_id for c in reversed(made)][:215]
    assert len(await store.list_cases(None, None, 1000, now)) == 230


@pytest.mark.anyio
async def test_an_expired_case_is_gone_from_the_backend_itself(store: Store) -> None:  # noqa: F811
    """Expiry is the backend's (Redis TTL; SQLite sweeps on the next save)."""
    now = time.time()
    old = _case("t_a", at=now - 10, text="forget me", expires_at=now - 1)
    await store.put_case(old)
    await store.put_case(_case("t_a", at=now))  # a later save sweeps SQLite
    assert await store.get_case(old.case_id, 0.0) is None  # even asked as of long ago


# --------------------------------------------------------------------------- the API


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(
        tiny_model_dir,
        tmp_path_factory.mktemp("db"),
        console_case_retention_days=30,
        console_batch_limit=12,
        probe_budget_verdict=0,
        probe_budget_full=0,
        max_body_bytes=256 * 1024,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _tenant(c: TestClient, name: str, seed: int) -> tuple[str, str]:
    with fixed_watermark_keys(seed):
        r = c.post("/admin/tenants", json={"name": name, "scopes": ["provenance"]}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["tenant_id"], r.json()["api_key"]


def _key(c: TestClient, tenant_id: str, scopes: list[str], detail: str) -> dict[str, str]:
    body = {"name": f"analyst-{detail}", "scopes": scopes, "detail": detail}
    r = c.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


@pytest.fixture(scope="module")
def world(client: TestClient) -> dict[str, Any]:
    acme_id, acme_secret = _tenant(client, "acme", 2701)
    other_id, other_secret = _tenant(client, "globex", 2702)
    acme = {"Authorization": f"Bearer {acme_secret}"}
    gen = generate(
        client, acme, seed=27, max_new_tokens=96, min_new_tokens=96, metadata={"case": "27"}
    )
    analyst = _key(client, acme_id, ["provenance", "decode", "detect"], "full")
    return {
        "acme_id": acme_id,
        "acme": acme,
        "acme_secret": acme_secret,
        "analyst": analyst,
        "other_id": other_id,
        "other": {"Authorization": f"Bearer {other_secret}"},
        "text": gen["text"],
        "message_id": gen["message_id"],
    }


def _check(c: TestClient, auth: dict[str, str], text: str, **kw: Any) -> dict[str, Any]:
    r = c.post("/console/api/cases", json={"text": text, **kw}, headers=auth)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_check_is_saved_as_a_case_with_its_verdict(
    client: TestClient, world: dict[str, Any]
) -> None:
    text = world["text"]
    out = _check(client, world["analyst"], text, mode="decode")
    case, result = out["case"], out["result"]
    assert case["mode"] == "decode" and case["statistic"] == result["verdict_statistic"]
    assert case["verdict"] == verdict_of(result["verdict_p_value"]) == "watermarked"
    assert result["verdict"] == "watermarked" and result["is_watermarked"] is True
    assert case["sentence"] == verdict_sentence(
        "watermarked", result["verdict_statistic"], result["verdict_p_value"]
    )
    assert case["who"]["role"] == "api_key" and case["who"]["tenant_name"] == "acme"
    assert case["who"]["key_name"] == "analyst-full" and case["who"]["key_id"]
    assert case["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert case["text"] is None and case["text_kept"] is False
    assert case["summary"]["message_id"] == world["message_id"]
    assert case["summary"]["islands"], case["summary"]  # evidence of an analyst's key
    created = time.mktime(time.strptime(case["created_at"][:19], "%Y-%m-%dT%H:%M:%S"))
    expires = time.mktime(time.strptime(case["expires_at"][:19], "%Y-%m-%dT%H:%M:%S"))
    assert expires - created == pytest.approx(30 * 86_400, abs=2)  # the retention setting
    secret = world["analyst"]["Authorization"].split()[1]
    assert secret not in json.dumps(out)
    # the text is kept only when asked, and the human text is not watermarked
    kept = _check(client, world["acme"], HUMAN, mode="provenance", keep_text=True)["case"]
    assert kept["text"] == HUMAN and kept["text_kept"] is True
    assert kept["verdict"] in VERDICTS and kept["verdict"] != "watermarked"
    assert world["acme_secret"] not in json.dumps(kept)


def test_a_case_reopens_for_its_tenant_and_the_admin_only(
    client: TestClient, world: dict[str, Any]
) -> None:
    case = _check(client, world["acme"], world["text"], keep_text=True)["case"]
    url = f"/console/api/cases/{case['case_id']}"
    for auth in (world["acme"], world["analyst"], ADMIN):
        r = client.get(url, headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["case_id"] == case["case_id"] and r.json()["text"] == world["text"]
    refused = client.get(url, headers=world["other"])
    missing = client.get("/console/api/cases/AAAAAAAAAAAAAAAA", headers=world["other"])
    assert refused.status_code == missing.status_code == 404
    assert refused.json()["error"]["code"] == missing.json()["error"]["code"] == "case_not_found"
    assert client.delete(url, headers=world["other"]).status_code == 404
    assert client.get(url, headers=world["acme"]).status_code == 200  # still there
    assert client.get(url).status_code == 401  # no credential
    # the link itself is the page: it opens the case once signed in
    page = client.get(f"/console/cases/{case['case_id']}?utm_source=chat")
    assert page.status_code == 200 and f'data-case-id="{case["case_id"]}"' in page.text


def test_history_is_per_tenant_and_everyone_for_the_admin(
    client: TestClient, world: dict[str, Any]
) -> None:
    mine = _check(client, world["acme"], world["text"])["case"]
    theirs = _check(client, world["other"], HUMAN)["case"]
    acme = client.get("/console/api/cases", headers=world["acme"]).json()["cases"]
    other = client.get("/console/api/cases", headers=world["other"]).json()["cases"]
    admin = client.get("/console/api/cases?limit=1000", headers=ADMIN).json()["cases"]
    assert mine["case_id"] in {c["case_id"] for c in acme}
    assert theirs["case_id"] not in {c["case_id"] for c in acme}
    assert {c["who"]["tenant_id"] for c in acme} == {world["acme_id"]}
    assert {c["who"]["tenant_id"] for c in other} == {world["other_id"]}
    names = {c["who"]["tenant_name"] for c in admin}
    assert {"acme", "globex"} <= names
    assert [c["created_at"] for c in admin] == sorted(
        (c["created_at"] for c in admin), reverse=True
    )


def test_exports_as_json_and_csv(client: TestClient, world: dict[str, Any]) -> None:
    case = _check(client, world["analyst"], '=HYPERLINK("x") ' + HUMAN, keep_text=True)["case"]
    base = f"/console/api/cases/{case['case_id']}/export"
    j = client.get(base + "?format=json", headers=world["acme"])
    assert j.status_code == 200 and j.headers["content-type"].startswith("application/json")
    assert "attachment" in j.headers["content-disposition"]
    assert j.json() == case
    c = client.get(base + "?format=csv", headers=world["acme"])
    assert c.status_code == 200 and c.headers["content-type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(c.text)))
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == 2
    row = dict(zip(rows[0], rows[1], strict=True))
    assert row["case_id"] == case["case_id"] and row["verdict"] == case["verdict"]
    assert row["key_name"] == "analyst-full" and row["tenant_name"] == "acme"
    assert row["text_sha256"] == case["text_sha256"]
    assert row["text"].startswith("'=HYPERLINK")  # a formula stays text in a spreadsheet
    assert client.get(base + "?format=xml", headers=world["acme"]).status_code == 422
    assert client.get(base + "?format=csv", headers=world["other"]).status_code == 404
    everything = client.get("/console/api/cases/export?format=csv", headers=world["other"])
    assert case["case_id"] not in everything.text


def test_deleting_a_case_deletes_its_text(client: TestClient, world: dict[str, Any]) -> None:
    case = _check(client, world["acme"], HUMAN + " delete me", keep_text=True)["case"]
    url = f"/console/api/cases/{case['case_id']}"
    assert client.delete(url, headers=world["acme"]).status_code == 204
    assert client.get(url, headers=world["acme"]).status_code == 404
    assert client.get(url, headers=ADMIN).status_code == 404
    listed = client.get("/console/api/cases?limit=1000", headers=ADMIN).json()["cases"]
    assert case["case_id"] not in {c["case_id"] for c in listed}
    assert "delete me" not in json.dumps(listed)
    assert client.delete(url, headers=world["acme"]).status_code == 404


def test_an_expired_case_is_refused(client: TestClient, world: dict[str, Any]) -> None:
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    past = time.time() - 10
    old = CaseRecord("expiredcase01", past - 5, world["acme_id"], {"case_id": "x"}, "t", None, past)
    client.portal.call(runtime.store.put_case, old)  # type: ignore[union-attr]
    assert client.get("/console/api/cases/expiredcase01", headers=world["acme"]).status_code == 404


def test_modes_follow_the_keys_scopes(client: TestClient, world: dict[str, Any]) -> None:
    r = client.post("/console/api/cases", json={"text": HUMAN, "mode": "decode"}, headers=ADMIN)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_has_no_tenant"
    detect_only = _key(client, world["acme_id"], ["detect"], "full")
    r = client.post(
        "/console/api/cases", json={"text": HUMAN, "mode": "decode"}, headers=detect_only
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope"
    writer = _key(client, world["acme_id"], ["generate"], "full")
    r = client.get("/console/api/cases", headers=writer)
    assert r.status_code == 403
    r = client.post("/console/api/cases", json={"text": HUMAN, "mode": "x"}, headers=ADMIN)
    assert r.status_code == 422


def test_verdict_keys_cases_hold_no_p_value_and_decode_agrees_with_detect(
    client: TestClient, world: dict[str, Any]
) -> None:
    """Issue 24 point 6: a verdict key's /decode takes /detect's statistic, so the two
    agree on every text, here on prefixes of a watermarked text from weak to strong."""
    verdict_key = _key(client, world["acme_id"], ["detect", "decode"], "verdict")
    words = world["text"].split(" ")
    seen = set()
    for n in (2, 3, 4, 6, 12, 20, 30, 45, len(words)):
        text = " ".join(words[:n])
        dec = client.post("/decode", json={"text": text}, headers=verdict_key).json()
        det = client.post("/detect", json={"text": text}, headers=verdict_key).json()
        full = client.post("/detect", json={"text": text}, headers=world["acme"]).json()
        assert dec["verdict"] == det["verdict"] == full["verdict"], (n, dec, det)
        assert full["verdict"] == verdict_of(full["p_value"], full["num_scored_tokens"])
        assert "p_value" not in dec
        seen.add(det["verdict"])
    assert "watermarked" in seen and len(seen) >= 2  # the prefixes span the verdicts
    case = _check(client, verdict_key, world["text"], mode="decode")["case"]
    assert case["p_value"] is None and case["statistic"] == "withheld"
    assert case["verdict"] == "watermarked" and "p =" not in case["sentence"]


def test_a_case_of_a_spent_text_says_why_it_holds_no_p_value() -> None:
    """A full key past its text's full answers gets the verdict only; the case saved
    from it says so, instead of calling the key a verdict key."""
    from app.schemas.exposure import FULL_ANSWERS_SPENT, DecodeVerdict, DetectVerdict
    from app.services.cases import summarise
    from worldcup_core.verdict import STATISTICS

    spent = DetectVerdict(verdict="watermarked", detail_reason="full_answers_spent")
    verdict, _ = summarise("detect", spent)
    assert verdict["p_value"] is None and verdict["why"] == FULL_ANSWERS_SPENT
    key = DecodeVerdict(verdict="inconclusive", registry_match=None)
    assert key.detail_reason == "verdict_key"
    assert summarise("decode", key)[0]["why"] == STATISTICS["withheld"]


def _csv(rows: list[dict[str, str]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def test_a_batch_makes_one_case_per_row_and_has_a_limit(
    client: TestClient, world: dict[str, Any]
) -> None:
    rows = [{"doc": f"d{i}", "body": HUMAN if i % 2 else world["text"]} for i in range(6)]
    rows[3]["body"] = ""  # an empty row: its error, as worldcup scan reports it
    body = {"filename": "reports.csv", "content": _csv(rows), "field": "body"}
    r = client.post("/console/api/cases/batch", json=body, headers=world["acme"])
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["counts"]["error"] == 1 and out["counts"]["watermarked"] == 3
    assert [i["row"] for i in out["rows"]] == list(range(6))
    assert out["rows"][3]["case"] is None and out["rows"][3]["error"].startswith("empty")
    for item in out["rows"]:
        if item["case"] is not None:
            assert item["case"]["batch_id"] == out["batch_id"]
            assert item["case"]["source"]["file"] == "reports.csv"
    listed = client.get(
        f"/console/api/cases?batch_id={out['batch_id']}", headers=world["acme"]
    ).json()["cases"]
    assert len(listed) == 5
    exported = client.get(
        f"/console/api/cases/export?format=csv&batch_id={out['batch_id']}", headers=world["acme"]
    )
    assert len(list(csv.reader(io.StringIO(exported.text)))) == 6
    assert client.get(
        f"/console/api/cases?batch_id={out['batch_id']}", headers=world["other"]
    ).json() == {"cases": []}
    # JSONL too; a column the file lacks fails fast
    jsonl = "\n".join(json.dumps({"text": t}) for t in (HUMAN, world["text"]))
    body = {"filename": "x.jsonl", "content": jsonl, "field": "text", "mode": "detect"}
    r = client.post("/console/api/cases/batch", json=body, headers=world["acme"])
    assert r.status_code == 200 and r.json()["counts"]["watermarked"] == 1, r.text
    body["field"] = "body"
    r = client.post("/console/api/cases/batch", json=body, headers=world["acme"])
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_batch_file"
    assert "'body' is not a field of x.jsonl" in r.json()["error"]["message"]
    # over the limit (12 here): refused, with the way to scan more
    big = _csv([{"text": HUMAN} for _ in range(13)])
    body = {"filename": "big.csv", "content": big, "field": "text"}
    r = client.post("/console/api/cases/batch", json=body, headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "batch_too_large"
    assert "at most 12" in r.json()["error"]["message"]
    assert "worldcup scan" in r.json()["error"]["message"]
    body = {"filename": "x.txt", "content": "hello", "field": "text"}
    r = client.post("/console/api/cases/batch", json=body, headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "unsupported_batch_format"


def test_a_batchs_rows_answer_as_single_checks_of_their_texts(
    client: TestClient, world: dict[str, Any]
) -> None:
    """A batch is scored through the bulk services, not row by row: every row's case
    holds the verdict, statistic, p-value and evidence summary that a single check of
    its text gives (what each row went through before), in every mode, for a tenant's
    key, an analyst's, a verdict key and the admin. The single decode check of an
    analyst's key adds per-token evidence; a batch, like /decode/batch, has none."""
    words = world["text"].split(" ")
    texts = [world["text"], HUMAN, " ".join(words[:12]), " ".join(words[:40])]
    verdict_key = _key(client, world["acme_id"], ["provenance", "decode", "detect"], "verdict")
    askers = {
        "tenant": (world["acme"], ["provenance"]),
        "analyst": (world["analyst"], ["provenance", "decode", "detect"]),
        "verdict": (verdict_key, ["provenance", "decode", "detect"]),
        "admin": (ADMIN, ["provenance"]),
    }
    fields = ("verdict", "statistic", "p_value", "sentence", "mode")
    verdicts = set()
    for who, (auth, modes) in askers.items():
        for mode in modes:
            body = {"filename": "b.jsonl", "mode": mode, "field": "text"}
            body["content"] = "\n".join(json.dumps({"text": t}) for t in texts)
            r = client.post("/console/api/cases/batch", json=body, headers=auth)
            assert r.status_code == 200, (who, mode, r.text)
            rows = r.json()["rows"]
            assert [row["error"] for row in rows] == [None] * len(texts), (who, mode)
            for text, row in zip(texts, rows, strict=True):
                single = _check(client, auth, text, mode=mode)["case"]
                case = row["case"]
                assert {f: case[f] for f in fields} == {f: single[f] for f in fields}, (who, mode)
                summary, alone = dict(case["summary"]), dict(single["summary"])
                if mode == "decode" and who == "analyst":
                    alone.pop("islands")
                    assert summary.pop("islands") == []
                assert summary == alone, (who, mode, text[:20])
                verdicts.add(case["verdict"])
    assert {"watermarked", "not_watermarked"} <= verdicts  # the texts span the verdicts


def test_a_batch_larger_than_the_bulk_limit_goes_in_several_bulk_calls(
    client: TestClient, world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The console's batch limit may exceed the API's (``max_batch_texts``): the rows
    then go to the bulk services in chunks, each row answered as in one call."""
    monkeypatch.setattr(client.app.state.runtime.settings, "max_batch_texts", 2)
    texts = [world["text"], HUMAN, world["text"], HUMAN, world["text"]]
    content = "\n".join(json.dumps({"text": t}) for t in texts)
    for mode in ("detect", "provenance"):
        body = {"filename": "b.jsonl", "content": content, "mode": mode}
        r = client.post("/console/api/cases/batch", json=body, headers=world["analyst"])
        assert r.status_code == 200, r.text
        verdicts = [row["case"]["verdict"] for row in r.json()["rows"]]
        assert verdicts[0::2] == ["watermarked"] * 3, mode
        assert "watermarked" not in verdicts[1::2], mode


def test_the_one_verdict_function_and_its_words() -> None:
    """worldcup_core.verdict: the levels, NaN, and wording with and without a p-value."""
    assert [verdict_of(p) for p in (0.0, 9.99e-7, 1e-6, 0.0499, 0.05, 1.0)] == [
        "watermarked",
        "watermarked",
        "inconclusive",
        "inconclusive",
        "not_watermarked",
        "not_watermarked",
    ]
    assert verdict_of(float("nan")) == "inconclusive"
    shown = report(3.6e-4, "registry")
    assert shown.verdict == "inconclusive" and shown.p_value == 3.6e-4
    assert shown.sentence.startswith("Inconclusive (p = 3.6e-04; registry statistic between")
    assert "Bonferroni" in shown.why
    hidden = report(3.6e-4, "detect", show_p=False)
    assert hidden.p_value is None and "p =" not in hidden.sentence
    assert (
        report(2e-9, "decode").sentence == "Watermarked (p = 2.0e-09; decode statistic below 1e-6)"
    )
    assert report(0.5, "detect").headline == "No watermark found"


def test_case_and_batch_ids_never_start_with_a_formula_or_option_character() -> None:
    """A case id starting with '-' was exported to CSV as "'-…" (the formula guard) and
    read as an option on a command line: one case in 32. Ids now start alphanumeric;
    over 4 000 draws about 125 would have started with '-' or '_' before."""
    ids = [record_id(n) for n in (9, 12) for _ in range(2000)]
    assert all(i[0].isalnum() for i in ids)
    assert len(set(ids)) == len(ids) and {len(i) for i in ids} == {12, 16}
    assert len({i[0] for i in ids}) > 40  # still spread over the alphabet
