"""The CPU image started for real with podman, and the CUDA image's package set.

``make test-container`` (CI) builds the images with ``scripts/container-test.sh`` and
runs this module and ``test_container_compose.py``. Checked on a running container:
``/ready``, an admin creating a tenant, ``/generate`` with metadata then ``/decode``
returning its registry entry, a non-root process, secrets read from files (and the
refusal to start without them), the CLI's optional commands failing softly, and the
model cache volume reused by a second container.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from containerlib import (
    assert_registry_entry,
    create_tenant,
    decode,
    generate,
    inspect,
    logs,
    need,
    podman,
    wait_ready,
    write_secrets,
)
from servers import free_port

pytestmark = pytest.mark.container

CACHE = "/opt/worldcup/cache"


@dataclass
class App:
    image: str
    name: str
    volume: str
    secrets: dict[str, str]
    secrets_dir: Path
    url: str = ""
    ready_s: float = 0.0

    def start(self) -> None:
        port = free_port()
        podman(
            "run", "-d", "--name", self.name,
            "-p", f"127.0.0.1:{port}:8000",
            "-v", f"{self.volume}:{CACHE}",
            "-v", f"{self.secrets_dir / 'master_key.hex'}:/run/secrets/worldcup_master_key:ro",
            "-v", f"{self.secrets_dir / 'admin_token'}:/run/secrets/worldcup_admin_token:ro",
            "-e", "WORLDCUP_MASTER_KEY_FILE=/run/secrets/worldcup_master_key",
            "-e", "WORLDCUP_ADMIN_TOKEN_FILE=/run/secrets/worldcup_admin_token",
            self.image,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.ready_s = wait_ready(self.url, self.name)

    def stop(self) -> None:
        podman("rm", "-f", "-t", "40", self.name, check=False)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    image = need("WORLDCUP_CT_CPU_IMAGE")
    tag = uuid.uuid4().hex[:8]
    secrets_dir = tmp_path_factory.mktemp("ct-secrets")
    volume = f"worldcup-ct-cache-{tag}"
    podman("volume", "create", volume)
    running = App(image, f"worldcup-ct-{tag}", volume, write_secrets(secrets_dir), secrets_dir)
    try:
        running.start()
        print(f"container ready in {running.ready_s:.1f} s (fresh cache volume)")
        yield running
    finally:
        running.stop()
        podman("volume", "rm", "-f", volume, check=False)


def test_ready_and_non_root(app: App) -> None:
    assert httpx.get(f"{app.url}/ready", timeout=10).status_code == 200
    assert inspect(app.name)["Config"]["User"] == "worldcup"
    status = podman("exec", app.name, "cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == ["10001"] * 4, status  # real, effective, saved, filesystem: never root
    assert podman("exec", app.name, "id", "-u").stdout.strip() == "10001"


def test_secrets_come_from_files(app: App) -> None:
    env = inspect(app.name)["Config"]["Env"]
    names = {item.split("=", 1)[0] for item in env}
    assert {"WORLDCUP_MASTER_KEY_FILE", "WORLDCUP_ADMIN_TOKEN_FILE"} <= names
    assert not names & {"WORLDCUP_MASTER_KEY", "WORLDCUP_ADMIN_TOKEN"}, env
    assert not any(value in " ".join(env) for value in app.secrets.values())
    with httpx.Client(base_url=app.url, timeout=30) as http:
        wrong = http.post(
            "/admin/tenants", json={"name": "x"}, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401, wrong.text
        create_tenant(http, app.secrets["admin_token"], "from-file")  # the file's token works
    # production (the image's default) refuses to start without its secrets
    done = podman("run", "--rm", app.image, check=False, timeout=120)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "master key" in out.lower() or "master_key" in out.lower(), out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_admin_tenant_generate_decode_registry(app: App) -> None:
    with httpx.Client(base_url=app.url, timeout=300) as http:
        api_key = create_tenant(http, app.secrets["admin_token"], "container")
        meta = {"doc": "container-1", "user": "alice"}
        gen = generate(http, api_key, meta)
        assert_registry_entry(decode(http, api_key, gen["text"]), gen, meta)


def test_cli_optional_commands_fail_softly(app: App) -> None:
    """The image has no `scan` extra: its commands say so, the rest of the CLI works."""
    assert podman("exec", app.name, "worldcup", "--help").returncode == 0
    done = podman("exec", app.name, "worldcup", "scan", "in.jsonl", "--out", "o.parquet",
                  check=False)  # fmt: skip
    assert done.returncode == 2, done
    assert done.stderr.startswith("error: ") and "scan extra" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    key = podman("exec", app.name, "worldcup", "keygen").stdout.strip()
    assert len(key) == 64 and int(key, 16) >= 0


def test_zz_model_cache_volume_reused(app: App) -> None:
    """A second container on the same volume loads the cached model: nothing converted
    again, the first container's files (and a marker) still there."""
    mount = Path(
        podman("volume", "inspect", "--format", "{{.Mountpoint}}", app.volume).stdout.strip()
    )
    models = sorted(mount.glob("smollm2-135m-*/model.safetensors"))
    assert len(models) == 1, sorted(p.name for p in mount.iterdir())
    before = os.stat(models[0])
    marker = mount / "reused-marker"
    marker.write_text("first container", encoding="ascii")
    numba = sorted(p.name for p in (mount / "numba").rglob("*") if p.is_file())
    assert numba, "the image seeded no numba cache"
    app.stop()
    app.name = f"{app.name}-second"
    app.start()
    print(f"second container ready in {app.ready_s:.1f} s (reused cache volume)")
    after = os.stat(models[0])
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(mount.glob("smollm2-135m-*/model.safetensors")) == models
    assert marker.read_text(encoding="ascii") == "first container"
    assert not list(mount.glob("**/.convert-*")), "the model was converted again"
    assert "Converting" not in logs(app.name)


def test_cuda_image_package_set_runs_the_cli() -> None:
    """The CUDA Dockerfile's builder stage (built on the Debian base, ENGINE=hf: no GPU,
    no nvidia base image here) installs a package set that runs the CLI and the app."""
    cuda = need("WORLDCUP_CT_CUDA_BUILDER_IMAGE")
    cpu = need("WORLDCUP_CT_CPU_IMAGE")
    assert podman("run", "--rm", cuda, "worldcup", "--help").returncode == 0
    podman("run", "--rm", cuda, "python", "-c",
           "import app.main, app.engines.hf, worldcup_scan.cli, worldcup_cli.main")  # fmt: skip

    def packages(image: str) -> set[str]:
        out = podman("run", "--rm", image, "python", "-m", "pip", "list", "--format=freeze").stdout
        return {line.split("==")[0].lower() for line in out.splitlines() if "==" in line}

    # the same distributions as the CPU image, which runs (pip is gone from neither),
    # but Triton: the CPU image drops it (a GPU compiler), CUDA torch needs it
    assert packages(cuda) - {"triton"} == packages(cpu)
    assert "triton" not in packages(cpu)
