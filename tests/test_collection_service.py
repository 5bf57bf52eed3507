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
    assert [t["test"] for t in body["tests"]] == ["detect"]
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
    client: TestClient, world: dict[str, Any]
) -> None:
    """A full key's budget is 6 queries per text (this fixture): eight copies of one
    text in a collection spend it, the last two are refused and left out; the next
    collection of that text is refused whole (429)."""
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
