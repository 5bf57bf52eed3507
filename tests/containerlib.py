"""Helpers of the container tests: podman, the service over HTTP, secrets in files.

The images are built by ``scripts/container-test.sh`` (``make test-container``), which
exports their names in ``WORLDCUP_CT_*`` and ``CONTAINERS_CONF``; run any other way the
tests fail and say so, never skip.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a short, surprising story about a lighthouse keeper and a fox."
TOKENS = 160  # enough for a 16-bit payload to decode with p < 1e-6 (as in test_engines)


def need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run `make test-container` (scripts/container-test.sh)")
    return value


def podman(
    *args: str, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    need("CONTAINERS_CONF")  # runc and the rlimits of scripts/container-test.sh
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: rc={done.returncode}\n{done.stderr}")
    return done


def inspect(container: str) -> dict[str, Any]:
    data = json.loads(podman("inspect", container).stdout)
    assert isinstance(data, list) and len(data) == 1
    return dict(data[0])


def logs(container: str) -> str:
    done = podman("logs", "--tail", "60", container, check=False)
    return done.stdout + done.stderr


def write_secrets(directory: Path) -> dict[str, str]:
    """The secret files as an operator makes them (docker-compose.yml's header)."""
    directory.mkdir(parents=True, exist_ok=True)
    values = {
        "master_key.hex": secrets.token_hex(32),
        "admin_token": "adm_" + secrets.token_urlsafe(32),
        "grafana_admin_password": secrets.token_urlsafe(24),
    }
    for name, value in values.items():
        path = directory / name
        path.write_text(value + "\n", encoding="ascii")
        path.chmod(0o444)  # the app runs as uid 10001 and must read them
    return values


def wait_ready(url: str, container: str, timeout_s: float = 240) -> float:
    """Seconds until ``GET /ready`` answers 200; fails with the logs if the container dies."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        state = inspect(container)["State"]
        if not state.get("Running"):
            pytest.fail(f"{container} stopped (exit {state.get('ExitCode')}):\n{logs(container)}")
        time.sleep(1)
    pytest.fail(f"{container} not ready after {timeout_s} s:\n{logs(container)}")


def wait_healthy(container: str, timeout_s: float = 240) -> str:
    """Run the image's healthcheck until it passes (podman schedules healthchecks with
    systemd timers; without systemd, `podman healthcheck run` is that timer)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        podman("healthcheck", "run", container, check=False)
        status = str(inspect(container)["State"]["Health"]["Status"])
        if status == "healthy":
            return status
        time.sleep(2)
    pytest.fail(f"{container} not healthy after {timeout_s} s:\n{logs(container)}")


def create_tenant(http: httpx.Client, admin_token: str, name: str) -> str:
    r = http.post(
        "/admin/tenants", json={"name": name}, headers={"Authorization": f"Bearer {admin_token}"}
    )
    assert r.status_code == 201, r.text
    return str(r.json()["api_key"])


def generate(http: httpx.Client, api_key: str, metadata: dict[str, str]) -> dict[str, Any]:
    body = {
        "prompt": PROMPT,
        "metadata": metadata,
        "num_bits": 16,
        "max_new_tokens": TOKENS,
        "min_new_tokens": TOKENS,
        "seed": 7,
    }
    r = http.post("/generate", json=body, headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 200, r.text
    gen = dict(r.json())
    assert gen["message_id"] is not None and gen["num_tokens"] == TOKENS
    return gen


def decode(http: httpx.Client, api_key: str, text: str) -> dict[str, Any]:
    r = http.post(
        "/decode",
        json={"text": text, "num_bits": 16},
        headers={"Authorization": f"Bearer {api_key}"},
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def assert_registry_entry(dec: dict[str, Any], gen: dict[str, Any], metadata: Any) -> None:
    assert dec["p_value"] < 1e-6, dec
    match = dec["registry_match"]
    assert match is not None and match["message_id"] == gen["message_id"], dec
    assert match["metadata"] == metadata
