"""The backup drill of docs/operations.md, on each store: texts issued through the
service, ``worldcup store backup``, the store wiped, ``worldcup store restore``; then
every text decodes to its own entry, the case, the API keys and the counter survived,
and so did the client-chosen payload's record (its text still decodes as the client's
payload, not as an entry) and its repeat count (the cap still holds).
SQLite in a temporary folder; Redis on the test server (DB 15) under a private prefix.
The cluster drill is in tests/test_redis_cluster.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from test_service_api import ADMIN, make_settings
from test_store_contract import REDIS_URL
from test_trust_safety import generate
from typer.testing import CliRunner

from app.main import create_app
from app.services.intake import encode_texts
from worldcup_cli.main import app as cli
from worldcup_core.context_sketch import WIDTH_LOG2, text_cells

runner = CliRunner()


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"wcbackup{uuid.uuid4().hex[:10]}"
    yield prefix
    with redis.Redis.from_url(REDIS_URL) as client:
        _wipe_redis(client, prefix)


def _wipe_redis(client: Any, prefix: str) -> int:
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    return len(keys)


def _state(c: TestClient, auth: dict[str, str], texts: list[dict[str, Any]], case_id: str,
           tenant_id: str) -> dict[str, Any]:  # fmt: skip
    """What the drill must find again: each text's registry match and its similarity to
    the issued text (the entry's fingerprint came back too), the case, the keys."""
    matches = []
    for g in texts:
        r = c.post("/decode", json={"text": g["text"], "num_bits": 16}, headers=auth)
        assert r.status_code == 200, r.text
        coverage = r.json()["coverage"] or {}
        matches.append((r.json()["registry_match"], coverage.get("issued_text_similarity")))
    case = c.get(f"/console/api/cases/{case_id}", headers=ADMIN)
    keys = c.get(f"/admin/tenants/{tenant_id}/api-keys", headers=ADMIN)
    assert case.status_code == 200 and keys.status_code == 200, (case.text, keys.text)
    runtime: Any = c.app.state.runtime  # type: ignore[attr-defined]
    scheme = c.portal.call(runtime.tenants.version, tenant_id, None).scheme  # type: ignore[union-attr]
    cells = [text_cells(scheme, encode_texts(runtime.tokenizer, [g["text"]])[0]) for g in texts]
    contexts = c.portal.call(  # type: ignore[union-attr]
        runtime.store.context_counts, tenant_id, 1, np.concatenate(cells).tolist(), WIDTH_LOG2
    )
    assert min(contexts) >= 1  # the issued texts' contexts (the binary sketch) came back too
    return {"matches": matches, "case": case.json(), "api_keys": keys.json(), "ctx": contexts}


def _client_match(c: TestClient, auth: dict[str, str], text: str) -> tuple[Any, Any]:
    """How /decode names a text under a client-chosen payload: (client_payload, id)."""
    r = c.post("/decode", json={"text": text, "num_bits": 16}, headers=auth)
    assert r.status_code == 200, r.text
    match = r.json()["registry_match"] or {}
    return match.get("client_payload"), match.get("message_id")


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_backup_wipe_restore_drill(
    kind: str, tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = tmp_path / "db.sqlite3"
    # the chosen payload's record, as releases before sealing wrote it (texts under it
    # must keep decoding; a sealed one is a registry entry like the others)
    cap = {"fixed_payload_repeats": 2, "seal_client_payloads": False}
    if kind == "redis":
        prefix = request.getfixturevalue("redis_prefix")
        settings = make_settings(
            tiny_model_dir, tmp_path, redis_url=REDIS_URL, redis_prefix=prefix, **cap
        )
        where = ["--redis-url", REDIS_URL, "--prefix", prefix]
    else:
        settings = make_settings(tiny_model_dir, tmp_path, **cap)
        where = ["--sqlite-path", str(db)]
    env = {"WORLDCUP_REDIS_URL": "", "WORLDCUP_REDIS_CLUSTER": "false"}
    with TestClient(create_app(settings)) as c:
        tenant = {"name": f"drill-{kind}", "scopes": ["fixed_payload"]}
        r = c.post("/admin/tenants", json=tenant, headers=ADMIN)
        assert r.status_code == 201, r.text
        tenant_id, auth = r.json()["tenant_id"], {"Authorization": f"Bearer {r.json()['api_key']}"}
        body = {"name": "analyst", "scopes": ["provenance"], "detail": "full"}
        r = c.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
        assert r.status_code == 201, r.text
        texts = [generate(c, auth, seed=i, max_new_tokens=96, min_new_tokens=96) for i in range(3)]
        chosen = {"payload": {"bits": "1011001110001111"}, "max_new_tokens": 96}
        mine = [generate(c, auth, seed=10 + i, min_new_tokens=96, **chosen) for i in range(2)]
        r = c.post("/console/api/cases", json={"text": texts[0]["text"]}, headers=ADMIN)
        assert r.status_code == 201, r.text
        case_id = r.json()["case"]["case_id"]
        before = _state(c, auth, texts, case_id, tenant_id)
        before["mine"] = _client_match(c, auth, mine[0]["text"])
        r = c.post("/generate", json={"prompt": "Tides?", "seed": 12, **chosen}, headers=auth)
        assert r.status_code == 429, r.text  # the cap: 2 texts per payload
    for g, (match, similarity) in zip(texts, before["matches"], strict=True):  # the premise
        assert match is not None and match["message_id"] == g["message_id"], match
        assert similarity == 1.0, similarity  # the issued text's fingerprint was recorded
    assert before["mine"] == (True, None), before["mine"]  # the client's payload, no entry

    out = tmp_path / "store.backup"
    done = runner.invoke(cli, ["store", "backup", "--out", str(out), *where], env=env)
    assert done.exit_code == 0, done.output
    assert "1 tenants, 3 registry entries" in done.output
    if kind == "redis":  # wiped
        with redis.Redis.from_url(REDIS_URL) as client:
            assert _wipe_redis(client, prefix) > 0
    else:
        for path in tmp_path.glob("db.sqlite3*"):
            path.unlink()
    restore = ["store", "restore", "--from", str(out), *where]
    done = runner.invoke(cli, restore, env=env)
    assert done.exit_code == 0, done.output
    again = runner.invoke(cli, restore, env=env)  # into a store that is not empty
    assert again.exit_code == 2 and "--force" in again.output, again.output

    with TestClient(create_app(settings)) as c:
        after = _state(c, auth, texts, case_id, tenant_id)
        after["mine"] = _client_match(c, auth, mine[0]["text"])
        assert after == before
        assert generate(c, auth, seed=9)["message_id"] == 4  # the counter came back too
        r = c.post("/generate", json={"prompt": "Tides?", "seed": 13, **chosen}, headers=auth)
        assert r.status_code == 429, r.text  # and the payload's repeat count
