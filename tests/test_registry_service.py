"""Issue 36 through the API (tiny model, SQLite): a text decodes to its own entry on the
list path as on the exhaustive one (/decode, /decode/batch, /provenance), and an entry
past the tenant's retention is reported as ``registry_expired``, never as a match."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, fixed_watermark_keys, make_settings, new_tenant
from test_trust_safety import HUMAN, generate

import app.services.registry as registry_module
from app.main import create_app


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("db"))
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _fill(client: TestClient, tenant_id: str, n: int) -> None:
    """More registry entries, as /generate would write them (not through the model)."""
    store = client.app.state.runtime.store  # type: ignore[attr-defined]

    async def fill() -> None:
        for i in range(n):
            await store.allocate_message(tenant_id, 1, 16, {"filler": i}, time.time())

    assert client.portal is not None
    client.portal.call(fill)


def _answers(client: TestClient, auth: dict[str, str], texts: list[str]) -> list[Any]:
    one = client.post("/decode", json={"text": texts[0], "num_bits": 16}, headers=auth)
    batch = client.post("/decode/batch", json={"texts": texts, "num_bits": 16}, headers=auth)
    prov = client.post("/provenance", json={"text": texts[0]}, headers=ADMIN)
    assert one.status_code == batch.status_code == prov.status_code == 200
    return [
        one.json(),
        [item["result"] for item in batch.json()["results"]],
        prov.json()["match"],
    ]


def test_list_and_exhaustive_paths_name_the_same_entries(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fixed_watermark_keys(3636):
        tenant_id, auth = new_tenant(client)
    issued = [generate(client, auth, seed) for seed in (11, 12, 13)]
    texts = [g["text"] for g in issued]
    _fill(client, tenant_id, 300)
    answers = {}
    for path, forced in (("exhaustive", False), ("list", True)):
        monkeypatch.setattr(registry_module, "use_list", lambda _bits, _n, f=forced: f)
        answers[path] = _answers(client, auth, texts)
    for path, (one, batch, prov) in answers.items():
        assert one["registry_match"]["message_id"] == issued[0]["message_id"], path
        assert [b["registry_match"]["message_id"] for b in batch] == [
            g["message_id"] for g in issued
        ], path
        assert prov["registry_entry"]["message_id"] == issued[0]["message_id"], path
        assert one["registry_expired"] is False
    ex, li = answers["exhaustive"][0]["registry_match"], answers["list"][0]["registry_match"]
    assert li["p_value"] == pytest.approx(ex["p_value"], rel=1e-9)  # same registry size
    assert li["metadata"] == ex["metadata"] == {"user": "u-11"}
    for forced in (False, True):  # human text: no entry on either path
        monkeypatch.setattr(registry_module, "use_list", lambda _bits, _n, f=forced: f)
        human = client.post("/decode", json={"text": HUMAN, "num_bits": 16}, headers=auth)
        assert human.json()["registry_match"] is None
        assert human.json()["registry_expired"] is False


def test_an_entry_past_retention_is_expired_not_matched(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fixed_watermark_keys(3637):
        tenant_id, auth = new_tenant(client)
    old = generate(client, auth, 21)
    r = client.put(f"/admin/tenants/{tenant_id}/retention", json={"days": 1e-6}, headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"tenant_id": tenant_id, "days": 1e-6}
    assert (
        client.put(
            "/admin/tenants/" + "0" * 32 + "/retention", json={"days": 1}, headers=ADMIN
        ).status_code
        == 404
    )
    assert (
        client.put(
            f"/admin/tenants/{tenant_id}/retention", json={"days": -1}, headers=ADMIN
        ).status_code
        == 422
    )
    time.sleep(0.2)  # 1e-6 days = 86 ms
    swept = client.post("/admin/registry/sweep", headers=ADMIN)
    assert swept.status_code == 200 and swept.json()["expired"][tenant_id] == 1
    client.put(f"/admin/tenants/{tenant_id}/retention", json={"days": None}, headers=ADMIN)
    new = generate(client, auth, 22)  # issued after the sweep: kept
    assert new["message_id"] == old["message_id"] + 1
    for forced in (False, True):
        monkeypatch.setattr(registry_module, "use_list", lambda _bits, _n, f=forced: f)
        one, batch, prov = _answers(client, auth, [old["text"], new["text"]])
        assert one["registry_match"] is None and one["registry_expired"] is True
        assert batch[0]["registry_expired"] is True and batch[0]["registry_match"] is None
        assert batch[1]["registry_expired"] is False
        assert batch[1]["registry_match"]["message_id"] == new["message_id"]
        assert prov["registry_entry"] is None and prov["registry_expired"] is True
    admin_lookup = client.get(
        f"/admin/tenants/{tenant_id}/registry/{old['message_id']}", headers=ADMIN
    )
    assert admin_lookup.status_code == 404


def test_the_registry_test_is_corrected_for_what_was_scanned_if_the_counters_lag() -> None:
    """The Bonferroni count of the verdict's registry test: the counters, or the payloads
    an exhaustive match scanned where the cache holds more (rows written without their
    counters must not make the test liberal)."""
    import numpy as np

    from app.services.registry import Plan
    from app.stores.base import RegistrySize
    from worldcup_core.message import MessageIdCodec
    from worldcup_core.prf import WatermarkKey

    codec = MessageIdCodec(WatermarkKey(bytes(32)), 32)
    ids = np.arange(1, 1001, dtype=np.uint64)
    lagging = Plan(codec, RegistrySize(live=20), ids, codec.payload_ints(ids))
    assert lagging.candidates == 20 and lagging.bonferroni == 1000
    listed = Plan(codec, RegistrySize(live=100_000, expired=5))
    assert listed.bonferroni == listed.candidates == 100_005
    assert Plan(codec, RegistrySize(live=0)).bonferroni == 1
