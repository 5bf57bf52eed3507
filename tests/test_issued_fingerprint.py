"""The issued-text fingerprint in the service (issue #45, "No framing").

A registered text's fingerprint is recorded when the service returns it (/generate,
streamed or not, and the OpenAI routes); an answer that names the entry claims the
whole text only if the submitted text is the issued one (similarity at or above
``SIMILARITY_THRESHOLD``). Run on SQLite and on Redis (its own prefix).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_coverage import tides_body
from test_service_api import ADMIN, fixed_watermark_keys, new_tenant, store_client

from app.stores.base import Store, StoreUnavailable
from worldcup_core.fingerprint import SIMILARITY_THRESHOLD

HUMAN = (
    "harbour quiet storm fishermen mended nets stone quay arguing price diesel council "
    "repair broken lamp chandlery children ran between stacked crates daring touch cold "
    "water slipway noon clouds lifted ferry island came low slow horn sounding twice"
).split()


@pytest.fixture(params=["sqlite", "redis"])
def client(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    # context_width 2: the keys and seeds below were chosen at c = 2 ("the 50 % rewrite of
    # seed 2 keeps a share of 1.0"); a key version's width changes its text
    overrides: dict[str, Any] = {"context_width": 2}
    with store_client(request.param, tiny_model_dir, tmp_path, "issuedfp", **overrides) as c:
        yield c


def _decode(c: TestClient, auth: dict[str, str], text: str) -> dict[str, Any]:
    r = c.post("/decode", json={"text": text, "num_bits": 16}, headers=auth)
    assert r.status_code == 200, r.text
    got: dict[str, Any] = r.json()
    return got


def _rewrite(text: str, share: float) -> str:
    """``share`` of the whitespace-separated words, a contiguous middle span, replaced."""
    words = text.split()
    k = -(-len(words) * share // 1)
    start = (len(words) - int(k)) // 2
    new = [HUMAN[i % len(HUMAN)] for i in range(int(k))]
    return " ".join(words[:start] + new + words[start + int(k) :])


def _provenance_similarity(c: TestClient, text: str, expected: float | None) -> int:
    """/provenance's coverage where it names the entry: the verbatim text ``expected``
    1.0, an edit (``expected`` None) below the threshold and 'part'. 1 if it named it."""
    r = c.post("/provenance", json={"text": text}, headers=ADMIN)
    assert r.status_code == 200, r.text
    found = r.json()
    if found["coverage"] is None or found["match"] is None:
        return 0
    if found["match"]["registry_entry"] is None:
        return 0
    cov = found["coverage"]
    if expected is not None:
        assert cov["issued_text_similarity"] == expected, cov
    else:
        assert cov["issued_text_similarity"] < SIMILARITY_THRESHOLD, cov
        assert cov["attribution"] == "part" and "in part only" in found["message"], found
    return 1


def _store(c: TestClient) -> Store:
    store: Store = c.app.state.runtime.store  # type: ignore[attr-defined]
    return store


def test_verbatim_is_the_issued_text_and_a_rewrite_is_never_whole(client: Any) -> None:
    named_edits = decided_by_fingerprint = provenance_checks = 0
    with fixed_watermark_keys(45):
        tenant_id, auth = new_tenant(client)
    for seed in range(4):
        r = client.post("/generate", json=tides_body(seed), headers=auth)
        assert r.status_code == 200, r.text
        issued = r.json()
        entry = client.portal.call(_store(client).registry_entry, tenant_id, issued["message_id"])
        assert entry is not None and entry.fingerprint is not None and len(entry.fingerprint) == 16
        got = _decode(client, auth, issued["text"])
        assert got["verdict"] == "watermarked" and got["registry_match"] is not None, got
        assert got["registry_match"]["message_id"] == issued["message_id"]
        cov = got["coverage"]
        assert cov["issued_text_similarity"] == 1.0, cov
        # attribution as before: the statistical coverage decides a verbatim text
        assert cov["attribution"] == ("whole" if cov["share"] >= cov["threshold"] else "part")
        # spacing and case are not edits
        cosmetic = _decode(client, auth, "  " + "\n".join(issued["text"].upper().split()))
        if cosmetic["coverage"] is not None and cosmetic["registry_match"] is not None:
            assert cosmetic["coverage"]["issued_text_similarity"] == 1.0, cosmetic
        provenance_checks += _provenance_similarity(client, issued["text"], 1.0)
        for share in (0.3, 0.5):
            provenance_checks += _provenance_similarity(
                client, _rewrite(issued["text"], share), None
            )
            edited = _decode(client, auth, _rewrite(issued["text"], share))
            if edited["registry_match"] is None or edited["coverage"] is None:
                continue
            named_edits += 1
            ecov = edited["coverage"]
            decided_by_fingerprint += ecov["share"] >= ecov["threshold"]
            assert ecov["attribution"] == "part", ecov
            assert ecov["issued_text_similarity"] < SIMILARITY_THRESHOLD, ecov
            assert "not the issued one" in ecov["message"], ecov
    assert named_edits >= 2, named_edits  # the check was exercised
    # and at least once the statistical coverage alone would have said "whole" (these
    # keys and seeds: the 50 % rewrite of seed 2 keeps a share of 1.0, similarity 0.65)
    assert decided_by_fingerprint >= 1
    assert provenance_checks >= 4, provenance_checks


def test_streamed_and_openai_texts_are_fingerprinted(client: Any) -> None:
    with fixed_watermark_keys(46):
        tenant_id, auth = new_tenant(client)
    with client.stream(
        "POST", "/generate", json={**tides_body(7), "stream": True}, headers=auth
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    i = events.index("event: result")
    result = json.loads(events[i + 1].removeprefix("data: "))
    entry = client.portal.call(_store(client).registry_entry, tenant_id, result["message_id"])
    assert entry is not None and entry.fingerprint is not None
    got = _decode(client, auth, result["text"])
    assert got["coverage"]["issued_text_similarity"] == 1.0, got

    model = client.get("/v1/models", headers=auth).json()["data"][0]["id"]
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "Write about tides."}],
        "max_tokens": 120,
        "seed": 3,
        "n": 2,
        "watermark": {"num_bits": 16},
    }
    r = client.post("/v1/chat/completions", json=chat, headers=auth)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        mid = choice["watermark"]["message_id"]
        entry = client.portal.call(_store(client).registry_entry, tenant_id, mid)
        assert entry is not None and entry.fingerprint is not None, choice
        got = _decode(client, auth, choice["message"]["content"])
        if got["registry_match"] is not None and got["coverage"] is not None:
            assert got["coverage"]["issued_text_similarity"] == 1.0, got


def test_a_failed_fingerprint_write_does_not_fail_the_generation(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry then has no fingerprint and answers fall back to today's coverage."""
    with fixed_watermark_keys(45):
        tenant_id, auth = new_tenant(client)

    async def down(*_: Any) -> bool:
        raise StoreUnavailable("store unavailable: test")

    monkeypatch.setattr(_store(client), "set_fingerprint", down)
    r = client.post("/generate", json=tides_body(0), headers=auth)
    assert r.status_code == 200, r.text
    issued = r.json()
    entry = client.portal.call(_store(client).registry_entry, tenant_id, issued["message_id"])
    assert entry is not None and entry.fingerprint is None
    got = _decode(client, auth, issued["text"])
    assert got["registry_match"] is not None, got
    assert got["coverage"]["issued_text_similarity"] is None, got
    assert "issued" not in got["coverage"]["message"] or got["coverage"]["attribution"] == "part"
