"""How much of a text carries the watermark: ``coverage`` and ``attribution`` (issue #45).

An answer that is "watermarked" says the share of its scored tokens inside the
watermark's islands (:func:`worldcup_core.islands.island_coverage`) and claims the
whole text only when one island holds at least ``WHOLE_COVERAGE`` of them (the
threshold is measured: SECURITY.md, Forgery and framing). A genuine answer is
``whole``; the same answer followed by as much human text is ``part``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, fixed_watermark_keys, make_settings, new_tenant

from app.main import create_app
from worldcup_core.islands import WHOLE_COVERAGE, island_coverage

HUMAN = (
    "The harbour had been quiet since the storm. Fishermen mended their nets on the "
    "stone quay, arguing about the price of diesel and whether the council would ever "
    "repair the broken lamp by the chandlery. Children ran between the stacked crates, "
    "daring each other to touch the cold water at the slipway. By noon the clouds had "
    "lifted, and the ferry from the island came in low and slow, its horn sounding "
    "twice as it rounded the breakwater. Nobody on the quay looked up; they had heard "
    "it every day of their lives, and the nets would not mend themselves."
)


def _z(rng: np.random.Generator, length: int, watermarked: int, mu: float) -> list[float | None]:
    z = rng.normal(0.0, 1.0, length)
    z[:watermarked] += mu
    return [float(v) for v in z]


def test_coverage_of_simulated_texts() -> None:
    """Per-token z at the scheme's strength (mu ~ 1): fully watermarked texts of 160
    tokens are 'whole' in at least 90 of 100 (the measured rate on generated answers is
    in SECURITY.md); half-watermarked texts are 'part', their share near one half."""
    rng = np.random.default_rng(45)
    whole = [island_coverage(_z(rng, 160, 160, 1.0)) for _ in range(100)]
    assert sum(c.attribution == "whole" for c in whole) >= 90
    half = [island_coverage(_z(rng, 160, 80, 1.0)) for _ in range(100)]
    assert all(c.attribution == "part" for c in half)
    assert 0.35 <= float(np.median([c.share for c in half])) <= 0.65
    assert all(c.threshold == WHOLE_COVERAGE for c in whole + half)


@pytest.fixture
def client(tiny_model_dir: Path, tmp_path: Path) -> Iterator[TestClient]:
    # context_width 2: the "one in six" rate below was measured on the tiny random model at
    # c = 2. At c = 4 its repetitive text gives 'part' 12 of 30 times (1 of 30 at c = 2);
    # the real model's genuine answers do not (share >= threshold on the same 60 prompts:
    # 27 at c = 2, 34 at c = 4; docs/results/forgery/context-width.md)
    app = create_app(make_settings(tiny_model_dir, tmp_path, context_width=2))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_a_genuine_answer_is_whole_and_half_of_one_is_part(client: TestClient) -> None:
    """Genuine answers (tiny random model) are mostly 'whole': a genuine answer is 'part'
    about one time in six here (a stretch of it falls significantly below the rest by
    chance: 2 of 12 measured, and the real model's rate is in SECURITY.md), so of six at
    least three must be whole; one of them, followed by as much human text, is 'part'.
    Verbatim, each is 'whole' by its issued-text fingerprint anyway. The key is seeded
    (a fresh random key failed CI once: /detect reads the text in the default payload
    length's cells, where a 'whole' at 16 bits can come out 'part')."""
    with fixed_watermark_keys(45):
        _, auth = new_tenant(client)
    wholes: list[tuple[str, dict[str, Any]]] = []
    for seed in range(6):
        r = client.post("/generate", json=tides_body(seed), headers=auth)
        assert r.status_code == 200, r.text
        answer = r.json()["text"]
        got: dict[str, Any] = client.post(
            "/decode", json={"text": answer, "num_bits": 16}, headers=auth
        ).json()
        assert got["verdict"] == "watermarked" and got["registry_match"] is not None, got
        cov = got["coverage"]
        # verbatim: the issued-text fingerprint says so, whole whatever the share
        assert cov["issued_text_similarity"] == 1.0 and cov["attribution"] == "whole", cov
        if cov["share"] >= cov["threshold"]:  # the statistical coverage agrees
            assert cov["islands"] and "spans the text" in cov["message"], cov
            wholes.append((answer, got))
        else:
            assert "it is the issued text" in cov["message"], cov
    assert len(wholes) >= 3, len(wholes)
    text = wholes[0][0]
    detected = client.post("/detect", json={"text": text}, headers=auth).json()
    assert detected["coverage"]["attribution"] == "whole", detected

    mixed = text + "\n\n" + HUMAN  # half the answer's length of human text after it
    got = client.post("/decode", json={"text": mixed, "num_bits": 16}, headers=auth).json()
    assert got["verdict"] == "watermarked", got
    cov = got["coverage"]
    assert cov["attribution"] == "part", cov
    assert 0.35 <= cov["share"] <= 0.8, cov
    assert "not the issued one" in cov["message"], cov
    found = client.post("/provenance", json={"text": mixed}, headers=ADMIN).json()
    assert found["coverage"]["attribution"] == "part", found
    assert "in part only" in found["message"], found
    # a verdict that is not "watermarked" says nothing about coverage
    clean = client.post("/detect", json={"text": HUMAN}, headers=auth).json()
    assert clean["verdict"] != "watermarked" and clean["coverage"] is None, clean


def tides_body(seed: int) -> dict[str, Any]:
    """A registered 120-token answer about tides, 16-bit payload (seeded)."""
    return {
        "prompt": "Write about tides.",
        "max_new_tokens": 120,
        "min_new_tokens": 120,
        "seed": seed,
        "metadata": {"u": "me"},
        "num_bits": 16,
    }
