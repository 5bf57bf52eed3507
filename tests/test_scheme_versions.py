"""Upgrading a running service from scheme v1 to v2: nothing issued before stops decoding.

A tenant is created, and writes texts, on a server whose new keys are
``worldcup-v1``; the server restarts with ``worldcup-v2`` as the default (same
store); the tenant rotates its key. Texts of both versions must then decode to
their registry entries, detect, and be traced by provenance to the right key
version, because every key version records its scheme and every read path
dispatches on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_api import ADMIN, fixed_watermark_keys, make_settings

from app.main import create_app


def generate(client: TestClient, auth: dict[str, str], seed: int) -> dict[str, Any]:
    body = {
        "prompt": "Write about tides.",
        "max_new_tokens": 64,
        "min_new_tokens": 64,
        "seed": seed,
        "metadata": {"seed": seed},
        "num_bits": 16,
    }
    r = client.post("/generate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_v1_texts_survive_the_upgrade_to_v2(tiny_model_dir: Path, tmp_path: Path) -> None:
    with fixed_watermark_keys(77):
        v1_settings = make_settings(tiny_model_dir, tmp_path, scheme="worldcup-v1")
        with TestClient(create_app(v1_settings), raise_server_exceptions=False) as c:
            r = c.post("/admin/tenants", json={"name": "upgrader"}, headers=ADMIN)
            assert r.status_code == 201, r.text
            tenant_id, auth = (
                r.json()["tenant_id"],
                {"Authorization": f"Bearer {r.json()['api_key']}"},
            )
            old = generate(c, auth, seed=1)
            assert old["scheme"] == "worldcup-v1" and old["key_version"] == 1

        v2_settings = make_settings(tiny_model_dir, tmp_path)  # the default: worldcup-v2
        with TestClient(create_app(v2_settings), raise_server_exceptions=False) as c:
            assert c.get("/version").json()["scheme_version"] == "worldcup-v2"
            # until the tenant rotates, its newest key (v1) keeps generating
            assert generate(c, auth, seed=2)["scheme"] == "worldcup-v1"
            r = c.post(f"/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN)
            assert r.status_code == 200 and r.json()["key_version"] == 2
            new = generate(c, auth, seed=3)
            assert new["scheme"] == "worldcup-v2" and new["key_version"] == 2

            for text, version, message_id in (
                (old["text"], 1, old["message_id"]),
                (new["text"], 2, new["message_id"]),
            ):
                assert_traced(c, auth, tenant_id, text, version, message_id)


def assert_traced(
    c: TestClient, auth: dict[str, str], tenant_id: str, text: str, version: int, message_id: int
) -> None:
    """``text`` decodes to its registry entry, detects and is traced by /provenance to
    ``tenant_id``'s key ``version``."""
    r = c.post("/decode", json={"text": text, "num_bits": 16}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["key_version"] == version and body["is_watermarked"]
    assert body["registry_match"]["message_id"] == message_id
    r = c.post("/detect", json={"text": text}, headers=auth)
    assert r.json()["is_watermarked"] and r.json()["key_version"] == version
    r = c.post("/provenance", json={"text": text}, headers=ADMIN)
    assert r.status_code == 200, r.text
    match = r.json()["match"]
    assert match["tenant_id"] == tenant_id and match["key_version"] == version
    assert match["registry_entry"]["message_id"] == message_id


@pytest.mark.parametrize("version", ["worldcup-v1", "worldcup-v2"])
def test_cli_decodes_each_version_only_when_asked_for_it(
    tmp_path: Path, version: str, smollm2_tokenizer: Any
) -> None:
    """A key file holds only the secret: ``--scheme-version`` says how its texts were made."""
    import json
    import subprocess
    import sys

    import numpy as np

    from worldcup_core import Payload, SamplingConfig, WatermarkConfig, WatermarkKey, WorldCup
    from worldcup_core.generation import GenerationRequest
    from worldcup_core.generation import generate as run
    from worldcup_core.models import tiny_random_model

    key = WatermarkKey(bytes(range(32)))
    (tmp_path / "k.key").write_text(key.hex())
    lm = tiny_random_model(smollm2_tokenizer)
    scheme = WorldCup(key, WatermarkConfig(version=version))
    prompt = smollm2_tokenizer("Tides", add_special_tokens=False).input_ids
    payload = Payload.random(16, np.random.default_rng(0))
    request = GenerationRequest(
        prompt, SamplingConfig(max_new_tokens=96, min_new_tokens=96, seed=4), scheme, payload
    )
    (result,) = run(lm.model, [request], lm.eos_token_ids, lm.pad_token_id)
    text = smollm2_tokenizer.decode(result.token_ids, skip_special_tokens=True)

    def detect(as_version: str) -> dict[str, Any]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "worldcup_cli.main",
                "detect",
                "--key-file",
                str(tmp_path / "k.key"),
                "--num-bits",
                "16",
                "--scheme-version",
                as_version,
                "--json",
            ],
            input=text,
            capture_output=True,
            text=True,
            check=True,
        )
        parsed: dict[str, Any] = json.loads(out.stdout)
        return parsed

    other = "worldcup-v1" if version == "worldcup-v2" else "worldcup-v2"
    assert detect(version)["is_watermarked"]
    assert not detect(other)["is_watermarked"]
