"""The context width of new key versions is a setting, and each key version keeps its own.

``WORLDCUP_CONTEXT_WIDTH`` (issue #45: a wider context makes watermark stealing sparser)
sets the width ``c`` a new key version is issued under. The upgrade is the test: a
tenant writes under ``c = 2``, the server restarts with another width, the tenant
rotates, and texts of both widths decode to their entries, detect and are traced by
provenance, because every key version records its width and every read path uses the
record. The record is what decodes: the same text read under the other width is not
watermarked.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from test_scheme_versions import assert_traced, generate
from test_service_api import ADMIN, fixed_watermark_keys, make_settings, new_tenant

from app.core.config import Settings
from app.main import create_app
from app.stores.sqlite import SQLiteStore
from worldcup_core.config import SERVICE_CONTEXT_WIDTH


def test_the_setting_defaults_to_the_service_width_and_is_validated(tmp_path: Path) -> None:
    assert Settings.model_fields["context_width"].default == SERVICE_CONTEXT_WIDTH
    assert make_settings(tmp_path, tmp_path).context_width == SERVICE_CONTEXT_WIDTH
    assert make_settings(tmp_path, tmp_path, context_width=4).context_width == 4
    for bad in (0, 9):
        with pytest.raises(ValidationError, match="context_width"):
            make_settings(tmp_path, tmp_path, context_width=bad)


def test_texts_of_either_width_decode_after_the_width_moves(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    old_width, new_width = 2, 3
    with fixed_watermark_keys(45):
        settings = make_settings(tiny_model_dir, tmp_path, context_width=old_width)
        with TestClient(create_app(settings), raise_server_exceptions=False) as c:
            tenant_id, auth = new_tenant(c, "wider", scopes=())
            old = generate(c, auth, seed=1)

        settings = make_settings(tiny_model_dir, tmp_path, context_width=new_width)
        with TestClient(create_app(settings), raise_server_exceptions=False) as c:
            # until the tenant rotates, its newest key keeps its width
            assert generate(c, auth, seed=2)["key_version"] == 1
            r = c.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN)
            assert r.status_code == 200 and r.json()["key_version"] == 2
            new = generate(c, auth, seed=3)
            assert new["key_version"] == 2
            for text, version, message_id in (
                (old["text"], 1, old["message_id"]),
                (new["text"], 2, new["message_id"]),
            ):
                assert_traced(c, auth, tenant_id, text, version, message_id)

    db = tmp_path / "db.sqlite3"
    records = asyncio.run(SQLiteStore(db).key_versions(tenant_id))
    assert [(r.version, r.context_width) for r in records] == [(1, old_width), (2, new_width)]

    # the record is what decodes: the wider key's text read at the old width carries nothing
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE keys SET context_width = ? WHERE tenant_id = ? AND version = 2",
            (old_width, tenant_id),
        )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        r = c.post("/detect", json={"text": new["text"]}, headers=auth)
        assert r.status_code == 200, r.text
        assert not r.json()["is_watermarked"]
        r = c.post("/detect", json={"text": old["text"]}, headers=auth)
        assert r.json()["is_watermarked"] and r.json()["key_version"] == 1


def test_the_admin_lists_the_tenants_still_on_a_narrower_context(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SECURITY.md's advice for key versions of c = 2 is to rotate them: the operator
    finds them with ``GET /admin/tenants?narrow_context=true`` (the current version
    narrower than new ones get), and a rotation takes a tenant off that list. Every
    version is listed with its width; no key's secret is."""
    with fixed_watermark_keys(46):
        settings = make_settings(tiny_model_dir, tmp_path, context_width=2)
        with TestClient(create_app(settings), raise_server_exceptions=False) as c:
            old_a, _ = new_tenant(c, "old-a", scopes=())
            old_b, _ = new_tenant(c, "old-b", scopes=())
            r = c.get("/admin/tenants", params={"narrow_context": True}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["tenants"] == []  # 2 is the width here

        settings = make_settings(tiny_model_dir, tmp_path, context_width=4)
        with TestClient(create_app(settings), raise_server_exceptions=False) as c:
            new, _ = new_tenant(c, "new", scopes=())

            def listed(**params: object) -> dict[str, dict[str, object]]:
                r = c.get("/admin/tenants", params=params, headers=ADMIN)
                assert r.status_code == 200, r.text
                return {t["tenant_id"]: t for t in r.json()["tenants"]}

            every = listed()
            assert list(every) == [old_a, old_b, new]  # oldest first
            assert [every[t]["narrow_context"] for t in every] == [True, True, False]
            assert list(listed(narrow_context=True)) == [old_a, old_b]
            r = c.post(f"/admin/tenants/{old_a}/rotate-key", headers=ADMIN)
            assert r.status_code == 200
            assert list(listed(narrow_context=True)) == [old_b]
            rotated = listed()[old_a]
            assert rotated["key_version"] == 2 and not rotated["narrow_context"]
            versions = rotated["key_versions"]
            assert [(v["version"], v["context_width"], v["current"]) for v in versions] == [
                (1, 2, False),
                (2, 4, True),
            ]
            assert all(set(v) == {"version", "created_at", "context_width", "scheme", "current"}
                       for v in versions)  # fmt: skip
            # the admin's: a tenant's key is refused, as is a malformed filter
            r = c.get("/admin/tenants")
            assert r.status_code == 401
            r = c.get("/admin/tenants", params={"narrow_context": "maybe"}, headers=ADMIN)
            assert r.status_code == 422 and "narrow_context" in r.text
