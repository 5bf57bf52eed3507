"""Issue 36 through the API (tiny model, SQLite): a text decodes to its own entry on the
list path as on the exhaustive one (/decode, /decode/batch, /provenance), and an entry
past the tenant's retention is reported as ``registry_expired``, never as a match (and
a match whose runner-up is close as ``registry_ambiguous``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, ANALYST, fixed_watermark_keys, make_settings, new_tenant
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


def test_a_close_runner_up_is_said_not_named(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watermarked text whose best entry is not clearly enough ahead of the next
    names none, and says why (``registry_ambiguous``) on both lookup paths and
    /provenance; a named entry or a human text never says it."""
    with fixed_watermark_keys(3638):
        tenant_id, auth = new_tenant(client)
    issued = generate(client, auth, 31)
    _fill(client, tenant_id, 300)
    # an excerpt: enough to name the entry, too little to put the runner-up at nothing
    # (the shortest such prefix: the statistic, model-assisted or not, decides which)
    settings = client.app.state.runtime.settings  # type: ignore[attr-defined]
    probes = client.app.state.runtime.probes  # type: ignore[attr-defined]
    monkeypatch.setitem(probes.budgets, "full", 0)  # many excerpts of one text: no budget
    # the model-free statistic, whose posteriors leave a runner-up in sight on short
    # excerpts (the model-assisted one names the entry outright on every excerpt here)
    watermark = client.app.state.runtime.watermark  # type: ignore[attr-defined]
    monkeypatch.setattr(watermark.weights, "weigher", None)
    words = issued["text"].split(" ")
    for n in range(12, len(words)):
        excerpt = " ".join(words[:n])
        one, _, prov = _answers(client, auth, [excerpt])
        match = one["registry_match"]
        if match is not None and 0.95 < match["confidence"] < 1.0:
            break
    else:
        raise AssertionError("no excerpt names the entry with a runner-up still in sight")
    assert one["registry_match"]["message_id"] == issued["message_id"]
    assert one["registry_ambiguous"] is False and prov["registry_ambiguous"] is False
    confidence = one["registry_match"]["confidence"]
    # a deployment that asks for more confidence than this excerpt has
    monkeypatch.setattr(settings, "registry_min_confidence", (confidence + 1.0) / 2)
    for forced in (False, True):
        monkeypatch.setattr(registry_module, "use_list", lambda _bits, _n, f=forced: f)
        one, batch, prov = _answers(client, auth, [excerpt, HUMAN])
        assert one["verdict"] == "watermarked", forced
        assert one["registry_match"] is None and one["registry_ambiguous"] is True
        assert batch[0]["registry_ambiguous"] is True and batch[0]["registry_match"] is None
        assert batch[1]["registry_ambiguous"] is False  # human: no test to name an entry
        assert prov["registry_entry"] is None and prov["registry_ambiguous"] is True
        assert one["registry_expired"] is False


def test_decode_without_a_length_shows_the_issued_one(client: TestClient) -> None:
    """/decode and /decode/batch with no ``num_bits`` show the payload length the tenant
    issued its entries at (here 16, the deployment's default 32), so the entry its
    verdict found is named; a tenant with no entries gets the default length."""
    settings = client.app.state.runtime.settings  # type: ignore[attr-defined]
    assert settings.default_num_bits != 16
    with fixed_watermark_keys(3639):
        _, auth = new_tenant(client, scopes=ANALYST)  # it reads the decoded bits
        _, empty = new_tenant(client, scopes=ANALYST)
    issued = generate(client, auth, 41)  # a 16-bit entry
    one = client.post("/decode", json={"text": issued["text"]}, headers=auth).json()
    assert len(one["bits"]) == 16 and one["verdict"] == "watermarked"
    assert one["registry_match"]["message_id"] == issued["message_id"]
    asked = client.post("/decode", json={"text": issued["text"], "num_bits": 16}, headers=auth)
    assert asked.json() == one  # the same answer
    batch = client.post("/decode/batch", json={"texts": [issued["text"], HUMAN]}, headers=auth)
    results = [item["result"] for item in batch.json()["results"]]
    assert [len(r["bits"]) for r in results] == [16, 16]
    assert results[0]["registry_match"]["message_id"] == issued["message_id"]
    assert results[1]["registry_match"] is None
    fresh = client.post("/decode", json={"text": issued["text"]}, headers=empty).json()
    assert len(fresh["bits"]) == settings.default_num_bits and fresh["registry_match"] is None


def test_a_client_payload_weighs_its_texts_on_both_match_paths() -> None:
    """The service's matches (:class:`app.services.registry.RegistryLookup`) weigh a
    recorded client payload by its texts (``ClientCandidates.uses``; 0, a payload
    recorded before the count, weighs 1): the exhaustive path moves the best entry's
    posterior by exactly the Bayes factor of that weight, and leaves the best candidate
    and the p-value alone (the list path: ``test_registry_lookup``)."""
    import numpy as np
    from test_registry_lookup import simulated_cells

    from app.services.registry import ClientCandidates, Plan, RegistryLookup
    from app.stores.base import RegistrySize
    from worldcup_core.decoder import llr_scale
    from worldcup_core.message import MessageIdCodec
    from worldcup_core.prf import WatermarkKey
    from worldcup_core.registry_lookup import flip_costs, text_cells

    rng = np.random.default_rng(4546)
    num_bits, size = 16, 200
    codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
    ids = np.arange(1, size + 1, dtype=np.uint64)
    payloads = codec.payload_ints(ids)
    plan = Plan(codec, RegistrySize(size, 0, 0, size), ids, payloads, 0, client=1)
    lookup = RegistryLookup(store=None)  # type: ignore[arg-type]  # CPU-only methods
    entry = int(payloads[7])
    ones, trials = simulated_cells(rng, entry, num_bits, 0.08, 40)
    cells = text_cells(ones, trials, num_bits)
    rival = entry ^ 0b1  # a client payload one bit from the entry
    plain = lookup.match_small(
        plan, cells, ClientCandidates(np.array([rival], dtype=np.uint64), np.array([0]))
    )
    assert plain is not None and plain.message_id == 8 and not plain.client
    beta = llr_scale(plain.match.agreement_z / (2 * np.sqrt(cells.total)))
    gap = float(flip_costs(cells, np.array([rival], dtype=np.uint64))[0]) - float(
        flip_costs(cells, np.array([entry], dtype=np.uint64))[0]
    )
    for uses in (1, 16, 1000):
        got = lookup.match_small(
            plan, cells, ClientCandidates(np.array([rival], dtype=np.uint64), np.array([uses]))
        )
        assert got is not None and got.message_id == 8
        assert got.match.p_value == plain.match.p_value
        want = 1 / plain.match.posterior + (uses - 1) * np.exp(-beta * gap)
        assert 1 / got.match.posterior == pytest.approx(want, rel=1e-6)


def test_the_list_path_weighs_a_listed_client_payload_but_not_an_entry() -> None:
    """``RegistryLookup.finish_lists`` (the list path, big registries): a recorded client
    payload among a text's likeliest weighs its texts (``1 / posterior`` grows by exactly
    ``(W - 1) exp(-beta (c_payload - c_best))``), and a client payload that is a live
    entry's own payload stays that entry, weighing 1, whatever its count."""
    import asyncio

    import numpy as np
    from test_registry_lookup import simulated_cells

    from app.services.registry import NO_CLIENT, ClientCandidates, Plan, RegistryLookup
    from app.stores.base import RegistrySize
    from worldcup_core.decoder import llr_scale
    from worldcup_core.message import MessageIdCodec
    from worldcup_core.prf import WatermarkKey
    from worldcup_core.registry_lookup import text_cells, use_list

    num_bits, size = 24, 65_536
    assert use_list(num_bits, size)

    class _Issued:  # the one store call the list path makes
        async def issued_among(
            self, tenant_id: str, version: int, bits: int, ids: list[int]
        ) -> list[bool]:
            return [1 <= i <= size for i in ids]

    rng = np.random.default_rng(4548)
    codec = MessageIdCodec(WatermarkKey(rng.bytes(32)), num_bits)
    plan = Plan(codec, RegistrySize(size, 0, 0, size))
    lookup = RegistryLookup(store=_Issued())  # type: ignore[arg-type]
    checked = 0
    for _ in range(30):
        true = int(rng.integers(1, size + 1))
        ones, trials = simulated_cells(rng, int(codec.payload_ints([true])[0]), num_bits, 0.06, 60)
        cells = text_cells(ones, trials, num_bits)
        pending = lookup.prepare_list(plan, cells)

        def finish(client: ClientCandidates, p: Any = pending) -> Any:
            return asyncio.run(lookup.finish_lists("t", {1: plan}, [(1, p)], [client]))[0]

        plain = finish(NO_CLIENT)
        if plain is None or plain.match.posterior == 0:
            continue
        at = plain.match.index
        c_best = float(pending.plist.costs[at])
        issued = (pending.ids >= 1) & (pending.ids <= size)
        dearer = np.flatnonzero(~issued & (pending.plist.costs > c_best))
        if dearer.size == 0:
            continue
        rival = pending.plist.payloads[dearer[:1]]
        gap = float(pending.plist.costs[dearer[0]]) - c_best
        beta = llr_scale((cells.agreement_max - round(c_best)) / cells.total - 0.5)
        one = finish(ClientCandidates(rival, np.array([1])))
        assert one.message_id == plain.message_id and not one.client
        for uses in (0, 16, 1000):
            got = finish(ClientCandidates(rival, np.array([uses])))
            assert got.message_id == plain.message_id and not got.client
            assert got.match.p_value == plain.match.p_value
            want = 1 / one.match.posterior + (max(uses, 1) - 1) * np.exp(-beta * gap)
            assert 1 / got.match.posterior == pytest.approx(want, rel=1e-9)
        own = pending.plist.payloads[at : at + 1]  # the named entry's own payload
        same = finish(ClientCandidates(own, np.array([1000])))
        assert same.message_id == plain.message_id and not same.client
        assert same.match.posterior == plain.match.posterior
        checked += 1
    assert checked >= 10
