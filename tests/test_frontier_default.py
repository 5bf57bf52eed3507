"""The service default is the point the measured frontier chose (issue #29).

Pinned three ways: the settings new key versions get equal the service preset; the
service preset equals the choice written in ``docs/results/frontier/results.json`` by
the documented rule; and the README's decision table states the same numbers. Then
the upgrade itself: a key issued under the paper's setting keeps decoding after the
default moves, because a key version stores the k, m and alpha it was issued with.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, fixed_watermark_keys, make_settings

from app.core.config import Settings
from app.main import create_app
from app.stores.sqlite import SQLiteStore
from worldcup_core.config import SERVICE_PRESET, WATERMARK_PRESETS
from worldcup_eval.frontier import decision_table, select_default

ROOT = Path(__file__).resolve().parents[1]
FRONTIER = ROOT / "docs" / "results" / "frontier" / "results.json"


def test_new_key_versions_get_the_service_preset(tmp_path: Path) -> None:
    preset = WATERMARK_PRESETS[SERVICE_PRESET]
    settings = make_settings(tmp_path, tmp_path)
    assert (settings.groups, settings.layers, settings.alpha) == (
        preset.groups,
        preset.layers,
        preset.alpha,
    )
    for name in ("groups", "layers", "alpha"):
        assert Settings.model_fields[name].default == getattr(preset, name)


def test_the_service_preset_is_the_measured_choice() -> None:
    results = json.loads(FRONTIER.read_text(encoding="utf-8"))
    # the recorded choice is what the rule gives on the recorded points
    assert select_default(results) == results["selection"]
    chosen = results["selection"]["chosen_settings"]
    preset = WATERMARK_PRESETS["frontier"]
    assert chosen == {"groups": preset.groups, "layers": preset.layers, "alpha": preset.alpha}
    assert SERVICE_PRESET == "frontier"


def test_the_readme_decision_table_states_the_default() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Choosing the watermark settings", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if "**service default**" in line)
    preset = WATERMARK_PRESETS[SERVICE_PRESET]
    k = re.search(r"k = (\d+)", row)
    alpha = re.search(r"α = ([0-9.]+)", row)
    m = re.search(r"m = (\d+)", row)
    assert k and alpha and m, row
    assert (int(k[1]), float(alpha[1]), int(m[1])) == (preset.groups, preset.alpha, preset.layers)
    paper = next(line for line in section.splitlines() if "`paper`" in line)
    assert "k = 2" in paper and "α = 1.2" in paper
    # the README and the evaluation report agree: the table is the one results.json gives
    results = json.loads(FRONTIER.read_text(encoding="utf-8"))
    assert decision_table(results) in section


def test_the_paper_setting_is_selectable_by_name(tmp_path: Path) -> None:
    paper = make_settings(tmp_path, tmp_path, watermark_preset="paper")
    assert (paper.groups, paper.layers, paper.alpha) == (2, 30, 1.2)
    with pytest.raises(ValueError, match="contradicts"):
        make_settings(tmp_path, tmp_path, watermark_preset="paper", alpha=0.3)
    # agreeing explicit values are fine
    assert make_settings(tmp_path, tmp_path, watermark_preset="paper", groups=2).groups == 2


def _generate(client: TestClient, auth: dict[str, str], seed: int) -> dict[str, Any]:
    body = {
        "prompt": "Write about tides.",
        "max_new_tokens": 96,
        "min_new_tokens": 96,
        "seed": seed,
        "metadata": {"seed": seed},
        "num_bits": 16,
    }
    r = client.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_texts_issued_under_the_paper_setting_decode_after_the_default_moves(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    preset = WATERMARK_PRESETS[SERVICE_PRESET]
    with fixed_watermark_keys(29):
        old_settings = make_settings(tiny_model_dir, tmp_path, watermark_preset="paper")
        with TestClient(create_app(old_settings), raise_server_exceptions=False) as c:
            r = c.post("/admin/tenants", json={"name": "frontier"}, headers=ADMIN)
            assert r.status_code == 201, r.text
            tenant_id = r.json()["tenant_id"]
            auth = {"Authorization": f"Bearer {r.json()['api_key']}"}
            old = _generate(c, auth, seed=1)

        new_settings = make_settings(tiny_model_dir, tmp_path)  # the service default
        with TestClient(create_app(new_settings), raise_server_exceptions=False) as c:
            r = c.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN)
            assert r.status_code == 200 and r.json()["key_version"] == 2
            new = _generate(c, auth, seed=2)
            for text, version, message_id in (
                (old["text"], 1, old["message_id"]),
                (new["text"], 2, new["message_id"]),
            ):
                r = c.post("/decode", json={"text": text, "num_bits": 16}, headers=auth)
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["key_version"] == version and body["is_watermarked"]
                assert body["registry_match"]["message_id"] == message_id

    records = asyncio.run(SQLiteStore(tmp_path / "db.sqlite3").key_versions(tenant_id))
    shapes = [(r.version, r.groups, r.layers, r.alpha) for r in records]
    assert shapes == [(1, 2, 30, 1.2), (2, preset.groups, preset.layers, preset.alpha)]
