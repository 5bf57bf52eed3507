"""The compose stack (docker-compose.yml as users run it: app + Redis) under podman-compose.

``make test-container`` (CI) runs it after ``scripts/container-test.sh`` has built the
images; compose's own variables point the file at them (APP_IMAGE, REDIS_IMAGE: Redis
from Debian's package, as no image registry can be reached here), at a loopback port
(APP_PORT) and at this test's secret files (SECRETS_DIR). Checked: both healthchecks
report healthy; a tenant and a registry entry survive ``restart`` of the app and of
Redis, and a SIGKILL of Redis (the AOF, fsynced on every write, holds them).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from containerlib import (
    ROOT,
    assert_registry_entry,
    create_tenant,
    decode,
    generate,
    need,
    podman,
    wait_healthy,
    wait_ready,
    write_secrets,
)
from servers import free_port

pytestmark = pytest.mark.container


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    url: str
    secrets: dict[str, str]
    printed: list[str] = field(default_factory=list)

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [need("WORLDCUP_CT_COMPOSE"), "-f", str(ROOT / "docker-compose.yml")]
        done = subprocess.run(
            [*cmd, "-p", self.project, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        self.printed.append(f"$ podman-compose {' '.join(args)}\n{done.stdout}{done.stderr}")
        if check and done.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)}: rc={done.returncode}\n"
                                 f"{done.stdout}\n{done.stderr}")  # fmt: skip
        return done

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def healthy(self) -> None:
        for service in ("redis", "app"):
            assert wait_healthy(self.container(service)) == "healthy"
        wait_ready(self.url, self.container("app"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    port = free_port()
    secrets_dir = tmp_path_factory.mktemp("compose-secrets")
    env = dict(os.environ)
    env.update(
        APP_IMAGE=need("WORLDCUP_CT_CPU_IMAGE"),
        REDIS_IMAGE=need("WORLDCUP_CT_REDIS_IMAGE"),
        APP_PORT=f"127.0.0.1:{port}",
        SECRETS_DIR=str(secrets_dir),
    )
    running = Stack(
        f"worldcup-ct-{uuid.uuid4().hex[:6]}",
        env,
        f"http://127.0.0.1:{port}",
        write_secrets(secrets_dir),
    )
    try:
        up = running.compose("up", "-d", "app", "redis")
        running.healthy()
        print(f"podman-compose up printed:\n{up.stdout}{up.stderr}")
        print(podman("ps", "--filter", f"label=io.podman.compose.project={running.project}",
                     "--format", "{{.Names}} {{.Status}}").stdout)  # fmt: skip
        yield running
    except BaseException:
        for service in ("app", "redis"):
            print(podman("logs", "--tail", "40", running.container(service), check=False).stderr)
        raise
    finally:
        running.compose("down", "-v", "-t", "40", check=False)


def _entry(stack: Stack) -> tuple[str, dict[str, Any], dict[str, str]]:
    with httpx.Client(base_url=stack.url, timeout=300) as http:
        api_key = create_tenant(http, stack.secrets["admin_token"], "compose")
        meta = {"doc": "compose-1"}
        gen = generate(http, api_key, meta)
        assert_registry_entry(decode(http, api_key, gen["text"]), gen, meta)
    return api_key, gen, meta


def _still_there(stack: Stack, api_key: str, gen: dict[str, Any], meta: Any) -> None:
    """The tenant (its API key authenticates, its watermark key decodes) and the entry."""
    with httpx.Client(base_url=stack.url, timeout=300) as http:
        assert_registry_entry(decode(http, api_key, gen["text"]), gen, meta)


def test_healthchecks_report_healthy(stack: Stack) -> None:
    for service in ("redis", "app"):
        state = podman("inspect", "--format", "{{.State.Health.Status}}", stack.container(service))
        assert state.stdout.strip() == "healthy"


def test_tenant_and_registry_survive_restarts(stack: Stack) -> None:
    api_key, gen, meta = _entry(stack)
    stack.compose("restart", "app")
    stack.healthy()
    _still_there(stack, api_key, gen, meta)
    stack.compose("restart", "redis")
    stack.healthy()
    _still_there(stack, api_key, gen, meta)
    # a crash, not a clean shutdown (which could save a snapshot): only the AOF remains
    podman("kill", "-s", "KILL", stack.container("redis"))
    podman("start", stack.container("redis"))
    stack.healthy()
    _still_there(stack, api_key, gen, meta)
    aof = podman("exec", stack.container("redis"), "ls", "/data/appendonlydir").stdout
    assert ".aof" in aof, aof


def test_compose_file_as_users_run_it(stack: Stack) -> None:
    """No edits were needed: the stack ran from docker-compose.yml with its variables."""
    config = stack.compose("config").stdout
    assert str(Path(stack.env["SECRETS_DIR"]) / "master_key.hex") in config
    assert stack.env["APP_IMAGE"] in config
