"""The service's context counts and its spoof-artifact check, in shadow (issue #45).

Every watermarked text the service returns has its contexts counted in its tenant's
sketch for the key version (registered or client-chosen payload, streamed or not); a
"watermarked" answer is then read against those counts
(:mod:`app.services.artifact`), and the outcome is counted in
``worldcup_spoof_artifact_checks_total`` without changing the verdict. Over the tiny
seeded model with seeded keys, on SQLite and on Redis (its own prefix).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from test_coverage import tides_body
from test_service_api import (
    ADMIN,
    fixed_watermark_keys,
    make_settings,
    new_tenant,
    sse_events,
    store_client,
)

from app.services.artifact import outcome_of
from app.services.intake import encode_texts
from worldcup_core.context_sketch import (
    WIDTH_LOG2,
    ContextSketch,
    context_cells,
    leave_one_out,
    split_evidence,
    text_cells,
)
from worldcup_core.evidence import text_evidence

HUMAN = (
    " The harbour was quiet after the storm, and the fishermen mended their nets on the "
    "stone quay while arguing about the price of diesel and the council's promise to repair "
    "the broken lamp by the chandlery, which nobody believed."
)


@pytest.fixture(params=["sqlite", "redis"])
def client(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    with store_client(request.param, tiny_model_dir, tmp_path, "spoofart") as c:
        yield c


def _checks(c: TestClient, route: str = "detect") -> dict[str, float]:
    """The metric's counts by outcome, for one route."""
    out: dict[str, float] = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("worldcup_spoof_artifact_checks_total{"):
            if f'route="{route}"' not in line:
                continue
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def _scheme(c: TestClient, tenant_id: str) -> Any:
    app: Any = c.app
    return c.portal.call(app.state.runtime.tenants.version, tenant_id, None).scheme  # type: ignore[union-attr]


def _ids(c: TestClient, text: str) -> list[int]:
    app: Any = c.app
    return encode_texts(app.state.runtime.tokenizer, [text])[0]


def _counts(c: TestClient, tenant_id: str, cells: Any) -> list[int]:
    app: Any = c.app
    store = app.state.runtime.store
    return list(c.portal.call(store.context_counts, tenant_id, 1, cells.tolist(), WIDTH_LOG2))  # type: ignore[union-attr]


def _tenant_with_texts(
    c: TestClient, name: str, key_seed: int, seeds: tuple[int, ...]
) -> tuple[str, dict[str, str], list[str]]:
    """A tenant (seeded keys) and its registered tides answers, one per seed."""
    with fixed_watermark_keys(key_seed):
        tenant_id, auth = new_tenant(c, name)
    texts = []
    for seed in seeds:
        r = c.post("/generate", json=tides_body(seed), headers=auth)
        assert r.status_code == 200, r.text
        texts.append(r.json()["text"])
    return tenant_id, auth, texts


def test_issued_texts_are_counted_as_the_sketch_counts_them(client: TestClient) -> None:
    """Registered texts (plain and streamed) and a client-chosen payload's are counted,
    each once: the store's counts equal a ContextSketch fed the same texts as /detect
    reads them. A text the service did not return counts nothing."""
    c = client
    tenant_id, auth, texts = _tenant_with_texts(c, "counted", 45, (1, 2))
    r = c.post("/generate", json={**tides_body(3), "stream": True}, headers=auth)
    assert r.status_code == 200
    texts.append(json.loads(dict(sse_events(r.text))["result"])["text"])
    body = {**tides_body(4), "payload": {"bits": "1" * 16}}
    body.pop("metadata")
    body.pop("num_bits")
    r = c.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    texts.append(r.json()["text"])
    scheme = _scheme(c, tenant_id)
    sketch = ContextSketch()
    for text in texts:
        sketch.add_text(text_cells(scheme, _ids(c, text)))
    every = np.concatenate([text_cells(scheme, _ids(c, t)) for t in texts])
    got = _counts(c, tenant_id, every)
    assert got == sketch.counts(every).tolist()
    assert min(got) >= 1
    human = text_cells(scheme, _ids(c, HUMAN))
    assert sum(_counts(c, tenant_id, human)) <= sum(sketch.counts(human).tolist()) == 0


def _with_spoof(
    c: TestClient, name: str, width_log2: int = WIDTH_LOG2
) -> tuple[str, dict[str, str], list[str], str]:
    """A tenant, two registered answers and a spoof made by hand: the second answer's
    opening (its contexts counted as if seen in many answers: a spoofer's lessons)
    followed by human text (rare contexts, no watermark)."""
    tenant_id, auth, issued = _tenant_with_texts(c, name, 46, (11, 12))
    scheme = _scheme(c, tenant_id)
    app: Any = c.app
    store = app.state.runtime.store
    opening = issued[1][: len(issued[1]) // 2]
    for _ in range(8):
        c.portal.call(
            store.count_contexts,
            tenant_id,
            1,
            text_cells(scheme, _ids(c, opening), width_log2).tolist(),
            width_log2,
        )  # type: ignore[union-attr]
    return tenant_id, auth, issued, opening + HUMAN


def test_a_key_version_keeps_its_sketch_width(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key version records its context sketch's width when it is created
    (``KeyRecord.sketch_width_log2``), and every write and read of its counters uses
    that width: a release that changes the default leaves older versions readable.
    Here a version created under a default of 2**12 counters a row, its spoof's opening
    counted as common there, is still flagged after the default is back at 2**20 and the
    tenant rotated to a version of that width (read at 2**20, its counters would be
    zeros: "one_group", not "flagged")."""
    import app.services.tenants as tenants_module

    c = client
    with monkeypatch.context() as m:
        m.setattr(tenants_module, "WIDTH_LOG2", 12)
        tenant_id, auth, issued, spoof = _with_spoof(c, "narrow", 12)
    scheme = _scheme(c, tenant_id)
    ids = _ids(c, issued[0])
    app: Any = c.app
    store = app.state.runtime.store
    narrow = text_cells(scheme, ids, 12)
    # the service counted the issued texts at the version's width: every context of the
    # first answer once (and a read at 2**20 would be refused: cells of another geometry)
    got = c.portal.call(store.context_counts, tenant_id, 1, narrow.tolist(), 12)  # type: ignore[union-attr]
    assert min(got) >= 1
    r = c.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN)
    assert r.status_code == 200, r.text
    records = c.portal.call(store.key_versions, tenant_id)  # type: ignore[union-attr]
    assert [k.sketch_width_log2 for k in records] == [12, WIDTH_LOG2]
    before = _checks(c)
    r = c.post("/decode", json={"text": spoof, "num_bits": 16}, headers=auth)
    assert r.status_code == 200 and r.json()["verdict"] == "watermarked", r.text
    assert r.json()["key_version"] == 1
    after = _checks(c)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {"flagged": 1.0}, delta


def test_the_check_reads_watermarked_answers_and_changes_no_verdict(client: TestClient) -> None:
    """A genuine answer whose contexts are rare: its evidence is everywhere (clear, or
    one group when nothing is common). A spoof made by hand, a genuine answer's opening
    (its contexts counted as common) followed by human text (rare contexts, no
    watermark), is flagged, and its verdict is still "watermarked". A text that is not
    watermarked is not checked. Each outcome is the one the core gives on the store's
    counts."""
    c = client
    tenant_id, auth, issued, spoof = _with_spoof(c, "checked")
    scheme = _scheme(c, tenant_id)

    def expected(text: str) -> str:
        ids = _ids(c, text)
        marks = [m for m in text_evidence(scheme, ids, 16) if m.z is not None]
        cells = context_cells(
            scheme.key, ids, [m.index for m in marks], scheme.config.context_width
        )
        seen = leave_one_out(_counts(c, tenant_id, cells))
        return outcome_of(split_evidence([float(m.z or 0) for m in marks], seen))

    before = _checks(c)
    answers = {}
    for name, text in (("genuine", issued[0]), ("spoof", spoof), ("human", HUMAN)):
        r = c.post("/decode", json={"text": text, "num_bits": 16}, headers=auth)
        assert r.status_code == 200, r.text
        answers[name] = r.json()
    assert answers["genuine"]["verdict"] == answers["spoof"]["verdict"] == "watermarked"
    assert answers["human"]["verdict"] != "watermarked"
    # by default a flag changes nothing: the spoof still names the entry it copied from
    assert answers["spoof"]["registry_match"] is not None
    assert not any(a["registry_withheld"] for a in answers.values())
    want = [expected(issued[0]), expected(spoof)]
    assert want[0] in ("clear", "one_group") and want[1] == "flagged"
    after = _checks(c)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {w: float(want.count(w)) for w in set(want)}, (
        delta
    )

    # /provenance checks the tenant its search named, under the deciding key version,
    # counted apart (route="provenance"); by default the spoof's entry is still named
    before, tenants_before = _checks(c, "provenance"), _checks(c)
    for text in (issued[0], spoof, HUMAN):
        r = c.post("/provenance", json={"text": text}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["found"] is (text != HUMAN), r.text
        if text != HUMAN:
            match = r.json()["match"]
            assert match["tenant_id"] == tenant_id and match["registry_entry"] is not None
            assert match["registry_withheld"] is False
    assert _checks(c) == tenants_before
    after = _checks(c, "provenance")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {w: float(want.count(w)) for w in set(want)}, (
        delta
    )


def test_with_counting_off_nothing_is_counted_and_the_check_says_so(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """count_contexts=False: the store keeps no counts and a watermarked answer's check
    is "unavailable" (its verdict as ever)."""
    with store_client("sqlite", tiny_model_dir, tmp_path, "off", count_contexts=False) as c:
        with fixed_watermark_keys(47):
            tenant_id, auth = new_tenant(c, "off")
        r = c.post("/generate", json=tides_body(21), headers=auth)
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        cells = text_cells(_scheme(c, tenant_id), _ids(c, text))
        assert set(_counts(c, tenant_id, cells)) == {0}
        before = _checks(c).get("unavailable", 0)
        r = c.post("/detect", json={"text": text}, headers=auth)
        assert r.status_code == 200 and r.json()["verdict"] == "watermarked", r.text
        assert _checks(c).get("unavailable", 0) == before + 1


def test_withhold_entry_names_no_entry_for_a_flagged_text(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """spoof_artifact_action="withhold_entry": the flagged spoof keeps its verdict, but
    /decode, a verdict key's /decode and /provenance name no entry and say
    registry_withheld; the genuine answer is named as ever."""
    with store_client(
        "sqlite", tiny_model_dir, tmp_path, "gate", spoof_artifact_action="withhold_entry"
    ) as c:
        tenant_id, auth, issued, spoof = _with_spoof(c, "gated")
        body = {"name": "verdict", "scopes": ["detect", "decode"], "detail": "verdict"}
        r = c.post(f"/admin/tenants/{tenant_id}/api-keys", json=body, headers=ADMIN)
        assert r.status_code == 201, r.text
        verdict_auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
        before = _checks(c)
        for text, withheld in ((issued[0], False), (spoof, True)):
            d = c.post("/decode", json={"text": text, "num_bits": 16}, headers=auth).json()
            assert d["verdict"] == "watermarked", d
            assert d["registry_withheld"] is withheld, d
            assert (d["registry_match"] is None) is withheld, d
            v = c.post("/decode", json={"text": text, "num_bits": 16}, headers=verdict_auth)
            assert v.status_code == 200, v.text
            assert v.json()["verdict"] == "watermarked"
            assert (v.json()["registry_match"] is None) is withheld, v.json()
            p = c.post("/provenance", json={"text": text}, headers=ADMIN).json()
            assert p["found"] and p["match"]["tenant_id"] == tenant_id, p
            assert p["match"]["registry_withheld"] is withheld, p
            assert (p["match"]["registry_entry"] is None) is withheld, p
        batch = c.post(
            "/decode/batch", json={"texts": [issued[0], spoof], "num_bits": 16}, headers=auth
        )
        assert batch.status_code == 200, batch.text
        got = [item["result"] for item in batch.json()["results"]]
        assert [g["verdict"] for g in got] == ["watermarked", "watermarked"], got
        assert [g["registry_withheld"] for g in got] == [False, True], got
        assert got[0]["registry_match"] is not None and got[1]["registry_match"] is None
        assert _checks(c).get("flagged", 0) == before.get("flagged", 0) + 3  # 2 /decode, 1 batch
        assert _checks(c, "provenance").get("flagged", 0) == 1


def test_withhold_entry_needs_the_counts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A gate that could never fire is a configuration error, not a silent no-op."""
    with pytest.raises(ValueError, match="WORLDCUP_COUNT_CONTEXTS"):
        make_settings(
            tiny_model_dir, tmp_path, spoof_artifact_action="withhold_entry", count_contexts=False
        )
