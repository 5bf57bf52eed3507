"""POST /provenance/collection over the real app (tiny model, SQLite), issue #44 item 3:
a set of one user's texts is watermarked and that user named among several; human
texts are not, and name nobody; a text repeated N times counts once; bad input gets a
clear 4xx; each text counts against the probe budget."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, assert_error, fixed_watermark_keys, make_settings, new_tenant

from app.main import create_app

URL = "/provenance/collection"
USERS = 5
TARGET = "u-2"


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(
        tiny_model_dir,
        tmp_path_factory.mktemp("db"),
        max_batch_texts=12,
        probe_budget_full=6,
        probe_full_answers=3,  # the default
        max_batch_body_bytes=256 * 1024,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _generate(c: TestClient, auth: dict[str, str], user: str, seed: int) -> str:
    body = {
        "prompt": "Write a short post.",
        "max_new_tokens": 24,
        "min_new_tokens": 24,
        "seed": seed,
        "metadata": {"user_id": user},
        "num_bits": 16,
    }
    r = c.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    return str(r.json()["text"])


@pytest.fixture(scope="module")
def world(client: TestClient, data_dir: Path) -> dict[str, Any]:
    """Two tenants; the owner issued entries to 5 users, 4 texts to u-2, 1 to each other."""
    with fixed_watermark_keys(44):
        owner_id, owner = new_tenant(client, "coll-owner")
        new_tenant(client, "coll-other")
    texts: dict[str, list[str]] = {}
    for u in range(USERS):
        user = f"u-{u}"
        count = 4 if user == TARGET else 1
        texts[user] = [_generate(client, owner, user, seed=100 * u + j) for j in range(count)]
    human = []
    with open(data_dir / "cnn_dailymail_test.jsonl", encoding="utf-8") as f:
        for line in f:
            text = str(json.loads(line).get("article") or "")
            if len(text) > 600:
                human.append(text[:500])
            if len(human) == 4:
                break
    return {"owner_id": owner_id, "texts": texts, "human": human}


def _read(c: TestClient, texts: list[str], **kw: Any) -> dict[str, Any]:
    headers = kw.pop("headers", ADMIN)
    r = c.post(URL, json={"texts": texts, **kw}, headers=headers)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_one_users_texts_are_watermarked_and_the_user_named(
    client: TestClient, world: dict[str, Any]
) -> None:
    mine = world["texts"][TARGET]
    body = _read(client, mine, group_by="user_id")
    assert body["verdict"] == "watermarked" and body["found"], body["message"]
    assert body["p_value"] < body["threshold"] == 1e-6
    assert body["tenant_id"] == world["owner_id"] and body["key_version"] == 1
    assert body["statistic"] == "model"  # the tiny model is loaded: model-weighted
    # message-free, and at the one payload length the key issued entries at (16 bits),
    # each text in its own payload's cells; combined as a single text's tests
    assert [(t["test"], t["num_bits"]) for t in body["tests"]] == [("detect", None), ("decode", 16)]
    assert body["p_value"] == min(t["combined_p_value"] for t in body["tests"])
    group = body["group"]
    assert group["field"] == "user_id" and group["values_searched"] == USERS
    assert group["entries_searched"] == USERS + 3
    assert group["may_name"] and group["value"] == TARGET, group
    assert group["p_value"] < 1e-6
    # a per-text answer beside each text, in order, with its own p
    assert [t["index"] for t in body["texts"]] == list(range(len(mine)))
    for t in body["texts"]:
        assert t["verdict"] is not None and 0.0 <= t["p_value"] <= 1.0 and t["error"] is None
        assert t["num_units"] <= t["num_scored_tokens"] <= t["num_tokens"]
    # the joint test reads all the texts: below each text's own p
    assert body["p_value"] <= min(t["p_value"] for t in body["texts"])
    assert body["num_units"] == sum(t["num_units"] for t in body["texts"])


def test_human_texts_are_not_watermarked_and_name_nobody(
    client: TestClient, world: dict[str, Any]
) -> None:
    body = _read(client, world["human"], group_by="user_id")
    assert body["verdict"] != "watermarked" and not body["found"]
    assert body["tenant_id"] is None and body["key_version"] is None
    assert body["group"]["value"] is None and not body["group"]["may_name"]
    assert "not searched" in body["group"]["message"]  # no value named, so none searched
    assert all(t["verdict"] != "watermarked" for t in body["texts"])


def test_a_copied_text_counts_once(client: TestClient, world: dict[str, Any]) -> None:
    """Five copies of one text: the same units, the same joint p, never a lower one."""
    text = world["texts"]["u-0"][0]
    once = _read(client, [text])
    five = _read(client, [text] * 5)
    assert five["num_units"] == once["num_units"] > 0
    assert five["p_value"] >= once["p_value"] * (1 - 1e-9)
    assert [t["num_units"] for t in five["texts"]].count(0) == 4


def test_an_unknown_group_by_field_names_nobody_and_says_so(
    client: TestClient, world: dict[str, Any]
) -> None:
    body = _read(client, world["texts"][TARGET], group_by="no_such_field")
    group = body["group"]
    assert group["value"] is None and group["values_searched"] == 0 and not group["may_name"]
    assert "no_such_field" in group["message"]
    assert body["verdict"] == "watermarked"  # the joint verdict does not depend on it
    assert _read(client, world["texts"][TARGET])["group"] is None


def test_bad_input_gets_a_clear_error(client: TestClient, world: dict[str, Any]) -> None:
    assert_error(client.post(URL, json={"texts": []}, headers=ADMIN), 422)
    assert_error(client.post(URL, json={"texts": ["  "]}, headers=ADMIN), 422)
    assert_error(client.post(URL, json={"text": "one"}, headers=ADMIN), 422)
    too_many = {"texts": ["a text"] * 13}
    assert_error(client.post(URL, json=too_many, headers=ADMIN), 422, "batch_too_large")
    long = {"texts": ["fine", "x" * 2001]}
    assert_error(client.post(URL, json=long, headers=ADMIN), 422, "text_too_long")
    huge = json.dumps({"texts": ["y" * 1900] * 150})
    err = assert_error(
        client.post(URL, content=huge, headers={**ADMIN, "Content-Type": "application/json"}),
        413,
        "request_too_large",
    )
    assert "fewer texts" in err["message"]
    # the scope is /provenance's
    _, plain = new_tenant(client, scopes=())
    assert_error(client.post(URL, json={"texts": ["a"]}, headers=plain), 403, "missing_scope")


def test_each_text_counts_against_the_probe_budget(
    client: TestClient, world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full key's budget is 6 queries per text (this fixture): eight copies of one
    text in a collection spend it, the last two are refused and left out; the next
    collection of that text is refused whole (429). (Full answers unlimited here: the
    next test limits them.)"""
    monkeypatch.setattr(client.app.state.runtime.probes, "full_answers", 0)  # type: ignore[attr-defined]
    r = client.post("/admin/tenants", json={"name": "coll-tns", "scopes": ["provenance"]},
                    headers=ADMIN)  # fmt: skip
    assert r.status_code == 201, r.text
    auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
    text = world["human"][0]
    body = _read(client, [text] * 8, headers=auth)
    codes = [(t["error"] or {}).get("code") for t in body["texts"]]
    assert codes == [None] * 6 + ["probe_budget_exceeded"] * 2
    assert body["num_texts"] == 6
    assert_error(client.post(URL, json={"texts": [text]}, headers=auth), 429)
    # another text still has its budget
    assert _read(client, [world["human"][1]], headers=auth)["num_texts"] == 1
    audit = client.get("/admin/audit?limit=20", headers=ADMIN).json()["entries"]
    assert any(e["outcome"].get("collection") for e in audit)


def test_a_set_holding_a_text_past_its_full_answers_gets_the_verdict_only(
    client: TestClient, world: dict[str, Any]
) -> None:
    """A full key gets a text's p-value 3 times a window (the default
    ``probe_full_answers``); a collection is one more road to it, so a set is answered
    in full only while every text in it is, and otherwise as the joint verdict, whose
    key and why (``full_answers_spent``), spending none of the other texts' full
    answers."""
    r = client.post("/admin/tenants", json={"name": "coll-full", "scopes": ["provenance"]},
                    headers=ADMIN)  # fmt: skip
    auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
    spent, fresh = world["texts"][TARGET][0], world["texts"][TARGET][1]
    assert "p_value" in _read(client, [spent] * 3, headers=auth)  # its three full answers
    answer = _read(client, [fresh, spent], headers=auth)
    assert answer == {
        "detail": "verdict",
        "detail_reason": "full_answers_spent",
        "verdict": answer["verdict"],
        "tenant_id": answer["tenant_id"],
        "group_value": None,
    }
    # that set spent none of the fresh text's full answers: it has its three
    assert ["p_value" in _read(client, [fresh], headers=auth) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    audit = client.get("/admin/audit?limit=50", headers=ADMIN).json()["entries"]
    tenant = f"tenant:{r.json()['tenant_id']}"
    mine = [e for e in audit if e["actor"] == tenant]
    assert any(e["action"] == "probe_full_answers_spent" for e in mine)
    assert any(
        e["action"] == "provenance" and e["outcome"].get("detail") == "verdict" for e in mine
    )
    # a verdict key of that tenant: the joint verdict, whose key and the value, nothing else
    body = {"name": "v", "scopes": ["provenance"], "detail": "verdict"}
    tenant_id = r.json()["tenant_id"]
    made = client.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
    assert made.status_code == 201, made.text
    verdict_key = {"Authorization": f"Bearer {made.json()['api_key']}"}
    answer = _read(client, world["texts"][TARGET], group_by="user_id", headers=verdict_key)
    assert answer == {
        "detail": "verdict",
        "detail_reason": "verdict_key",
        "verdict": "watermarked",
        "tenant_id": world["owner_id"],
        "group_value": TARGET,
    }


# --------------------------------------------------------------------------- scan --group-by
def test_scan_group_by_reads_each_group_together(
    tmp_path: Path, smollm2_tokenizer: Any, world: dict[str, Any]
) -> None:
    """``worldcup scan --group-by user``: one joint row per value. Four short texts of one
    account, each inconclusive alone, are watermarked together (model-free); four human
    texts are not; a row without a value and a bad row are counted, not scored."""
    import numpy as np
    from typer.testing import CliRunner

    from worldcup_cli.main import app as cli_app
    from worldcup_core import Payload, WatermarkKey
    from worldcup_scan.bench import watermarked_ids, word_tokens
    from worldcup_scan.keys import keys_from_files

    key_file = tmp_path / "acme.key"
    key_file.write_text(WatermarkKey(bytes(range(32))).secret.hex(), encoding="ascii")
    scheme = keys_from_files([key_file]).keys[0].worldcup()
    rng = np.random.default_rng(7)
    vocab = word_tokens(smollm2_tokenizer)
    rows = []
    for j in range(4):
        ids = watermarked_ids(scheme, Payload.random(16, rng), 28, vocab, rng)
        rows.append({"id": f"a{j}", "user": "acct-a", "text": smollm2_tokenizer.decode(ids)})
    rows += [{"id": f"h{j}", "user": "acct-h", "text": t} for j, t in enumerate(world["human"])]
    rows += [{"id": "loose", "text": world["human"][0]}, {"id": "bad", "user": "acct-a"}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "groups.jsonl"
    args = ["scan", str(src), "--out", str(out), "--key-file", str(key_file), "--id-field", "id"]
    result = CliRunner().invoke(cli_app, [*args, "--group-by", "user", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary == {
        "groups": 2, "rows": 10, "rows_without_group": 1, "bad_rows": 1, "watermarked_groups": 1,
    }  # fmt: skip
    found = {r["group"]: r for r in map(json.loads, out.read_text().splitlines())}
    a, h = found["acct-a"], found["acct-h"]
    assert a["verdict"] == "watermarked" and a["tenant_id"] == "acme.key" and a["num_texts"] == 4
    assert a["texts_watermarked_alone"] < 4  # the group, not each text, decides
    assert a["statistic"] == "model_free" and json.loads(a["row_ids"]) == ["a0", "a1", "a2", "a3"]
    assert h["verdict"] != "watermarked" and h["tenant_id"] is None
    # an unknown column is a clear error (exit 2), as --text-field's
    bad = CliRunner().invoke(cli_app, [*args, "--group-by", "nope"])
    assert bad.exit_code == 2 and "--group-by" in bad.output
