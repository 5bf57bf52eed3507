"""The Ray Serve application without a cluster: its config, KubeRay's copy of it, the
replica's checks, headers, health check and metrics mirror, and the proxy's errors.

(The application running on a real local Ray cluster: tests/test_serve.py, ``-m serve``.)
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import Message, Receive, Scope, Send

from app import serve as ray_app
from app.core.config import Settings
from app.services.readiness import NotReady

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kuberay" / "rayservice.yaml"


def _manifest() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    return data


def _containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["containers"]]


# ------------------------------------------------------------- the configs ---


def test_kuberay_serves_the_same_application_as_serve_yaml() -> None:
    manifest = _manifest()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"]) == ray_app.load_config()


def test_serve_yaml_is_a_valid_serve_config_of_this_application() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = ray_app.load_config()
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    assert (module, attr) == ("app.serve", "worldcup")
    options = ray_app.deployment_options(config)
    assert options["ray_actor_options"]["num_gpus"] == 1  # a GPU a replica
    scaling = options["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] <= scaling["initial_replicas"] <= scaling["max_replicas"]
    # the drain outlasts the longest request the app allows: downscale cuts nothing
    assert (
        options["graceful_shutdown_timeout_s"] > Settings.model_fields["request_timeout_s"].default
    )
    env = app.runtime_env.get("env_vars", {})
    assert not any(re.search("KEY|TOKEN|PASSWORD|REDIS_URL", name) for name in env), env


def test_kuberay_manifest_requests_gpus_and_takes_secrets_from_kubernetes() -> None:
    manifest = _manifest()
    cluster = manifest["spec"]["rayClusterConfig"]
    pin = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"ray[serve]=={cluster['rayVersion']}" in pin["serve-ray"]
    assert cluster["rayVersion"] == importlib.metadata.version("ray")
    per_replica = ray_app.deployment_options(ray_app.load_config())["ray_actor_options"]
    for group in cluster["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        for kind in ("requests", "limits"):
            gpus = int(worker["resources"][kind]["nvidia.com/gpu"])
            assert gpus >= per_replica["num_gpus"]
            assert float(worker["resources"][kind]["cpu"]) >= per_replica["num_cpus"]
    for container in _containers(manifest):
        env = {e["name"]: e for e in container["env"]}
        for secret in ("MASTER_KEY", "ADMIN_TOKEN"):
            assert f"WORLDCUP_{secret}" not in env  # never a literal in the manifest
            path = env[f"WORLDCUP_{secret}_FILE"]["value"]
            mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"]))
            assert mount["readOnly"] is True
        assert "secretKeyRef" in env["WORLDCUP_REDIS_URL"]["valueFrom"]  # Redis: external
        assert "WORLDCUP_REDIS_CLUSTER" in env
        proxy = env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]["value"]
        assert proxy == ray_app.PROXY_CALLBACK
    password = manifest["spec"]["gcsFaultToleranceOptions"]["redisPassword"]
    assert "secretKeyRef" in password["valueFrom"]


def test_override_changes_only_what_it_names() -> None:
    base = ray_app.load_config()
    config = ray_app.override(
        ray_app.load_config(),
        cpus_per_replica=0.5,
        engine="hf",
        replicas=(2, 3),
        http_port=9999,
        env={"WORLDCUP_REDIS_PREFIX": "p"},
    )
    options = ray_app.deployment_options(config)
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"], scaling["max_replicas"]) == (
        2,
        2,
        3,
    )
    env = ray_app.application(config)["runtime_env"]["env_vars"]
    assert env == {"WORLDCUP_ENGINE": "hf", "WORLDCUP_DEVICE": "cpu", "WORLDCUP_REDIS_PREFIX": "p"}
    assert config["http_options"] == {**base["http_options"], "port": 9999}
    untouched = ("max_ongoing_requests", "graceful_shutdown_timeout_s", "health_check_period_s")
    for key in untouched:
        assert options[key] == ray_app.deployment_options(base)[key]
    with pytest.raises(ValueError, match="no application"):
        ray_app.application({"applications": [{"name": "other"}]})


# -------------------------------------------------------------- the replica ---


def _settings(**kw: Any) -> Settings:
    values: dict[str, Any] = {
        "master_key": "1f" * 32,
        "admin_token": "serve-config-admin",
        "redis_url": "redis://127.0.0.1:6379/13",
    }
    return Settings(**{**values, **kw})


def test_replicas_refuse_settings_they_could_not_share() -> None:
    ray_app.check_replica_settings(_settings())
    with pytest.raises(ray_app.ReplicaConfigError, match="WORLDCUP_REDIS_URL"):
        ray_app.check_replica_settings(_settings(redis_url=None))
    with pytest.raises(ray_app.ReplicaConfigError, match="WORLDCUP_ADMIN_TOKEN, WORLDCUP_MASTER"):
        ray_app.check_replica_settings(_settings(env="dev", master_key="", admin_token=""))
    dev = _settings(env="dev")  # dev mode with real secrets: every replica shares them
    assert dev.throwaway_secrets == frozenset()
    ray_app.check_replica_settings(dev)


async def _run(app: Any, scope: Scope) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _http(path: str = "/decode") -> Scope:
    return {"type": "http", "path": path, "headers": []}


@pytest.mark.anyio
async def test_replica_headers_name_the_replica_and_leave_the_request_id_to_the_proxy() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"application/json"), (b"x-request-id", b"abc")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    sent = await _run(ray_app.ReplicaHeaders(app, replica="r1"), _http())
    assert sent[0]["headers"] == [
        (b"content-type", b"application/json"),
        (b"x-worldcup-replica", b"r1"),
    ]
    assert sent[1]["body"] == b"{}"


@pytest.mark.anyio
async def test_proxy_errors_become_the_service_envelope() -> None:
    async def died(scope: Scope, receive: Receive, send: Send) -> None:
        return  # the replica died: the Serve proxy sends nothing

    async def backpressure(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"2")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": b"Request dropped", "more_body": True})
        await send({"type": "http.response.body", "body": b" due to backpressure."})

    async def app_error(scope: Scope, receive: Receive, send: Send) -> None:
        body = b'{"error":{"code":"overloaded"}}'
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    sent = await _run(ray_app.ProxyErrors(died), _http("/generate"))
    assert sent[0]["status"] == 502
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "replica_unavailable" and "Idempotency-Key" in error["message"]
    openai_error = json.loads(
        (await _run(ray_app.ProxyErrors(died), _http("/v1/chat/completions")))[1]["body"]
    )
    assert (
        openai_error["error"]["code"] == "replica_unavailable" and "type" in openai_error["error"]
    )

    sent = await _run(ray_app.ProxyErrors(backpressure), _http())
    assert sent[0]["status"] == 503 and (b"retry-after", b"2") in sent[0]["headers"]
    assert (b"content-type", b"application/json") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error == {
        **error,
        "code": "unavailable",
        "message": "Request dropped due to backpressure.",
    }

    sent = await _run(ray_app.ProxyErrors(app_error), _http())  # the app's own: untouched
    assert sent[1]["body"] == b'{"error":{"code":"overloaded"}}'


@pytest.mark.anyio
async def test_health_check_raises_only_where_a_new_replica_would_help(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import app.services.readiness as readiness

    replica = ray_app.WorldCup.__new__(ray_app.WorldCup)
    replica._app = None
    with pytest.raises(RuntimeError, match="lifespan"):
        await replica.check_health()
    replica._app = SimpleNamespace(state=SimpleNamespace(runtime=object()))
    for problem, raises in [
        (None, False),
        (NotReady("store_unavailable", "down"), False),
        (NotReady("store_marker_lost", "wiped"), False),
        (NotReady("draining", "bye"), True),
        (NotReady("warming_up", "loading"), True),
    ]:

        async def not_ready(runtime: object, problem: NotReady | None = problem) -> NotReady | None:
            return problem

        monkeypatch.setattr(readiness, "not_ready", not_ready)
        if raises:
            with pytest.raises(RuntimeError, match=problem.code if problem else ""):
                await replica.check_health()
        else:
            await replica.check_health()


def test_metrics_mirror_copies_every_sample_with_its_labels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray.serve.metrics

    made: dict[str, Any] = {}

    class Gauge:
        def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]) -> None:
            self.tag_keys, self.values = tag_keys, {}
            made[name] = self

        def set(self, value: float, tags: dict[str, str]) -> None:
            assert tuple(sorted(tags)) == self.tag_keys
            self.values[tuple(sorted(tags.items()))] = value

    monkeypatch.setattr(ray.serve.metrics, "Gauge", Gauge)
    registry = CollectorRegistry()
    hist = Histogram("worldcup_t_seconds", "t", ["endpoint"], buckets=(0.1, 1), registry=registry)
    count = Counter("worldcup_n", "n", ["result"], registry=registry)
    hist.labels("/decode").observe(0.5)
    count.labels("clean").inc(3)
    mirror = ray_app.RayMetricsMirror(registry)
    assert mirror.sync() == 6  # 3 buckets, sum, count; the counter; no _created
    assert set(made) == {
        "worldcup_t_seconds_bucket",
        "worldcup_t_seconds_sum",
        "worldcup_t_seconds_count",
        "worldcup_n_total",
    }
    assert made["worldcup_n_total"].values == {(("result", "clean"),): 3.0}
    assert made["worldcup_t_seconds_bucket"].values[(("endpoint", "/decode"), ("le", "1.0"))] == 1
    count.labels("clean").inc()
    mirror.sync()  # the same gauges, new values
    assert made["worldcup_n_total"].values == {(("result", "clean"),): 4.0}


RAY_DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "worldcup-ray-serve.json"


def ray_dashboard_exprs() -> list[str]:
    dashboard = json.loads(RAY_DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_ray_dashboard_shows_every_metric_per_replica_and_summed() -> None:
    from servers import SERVICE_METRICS

    exprs = ray_dashboard_exprs()
    for metric in SERVICE_METRICS:  # as Ray exports the mirror: ray_ + the sample's name
        used = [e for e in exprs if re.search(rf"\bray_{metric}(_bucket|_count|_sum)?\b", e)]
        assert used, f"ray_{metric} is on no panel"
        assert any(re.search(r"by \((le, )?replica", e) for e in used), f"{metric}: per replica?"
    for summed in ("worldcup_request_duration_seconds_count", "worldcup_generated_tokens_total"):
        assert any(e.startswith(f"sum(rate(ray_{summed}") for e in exprs), summed
    dashboard = json.loads(RAY_DASHBOARD.read_text(encoding="utf-8"))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(
        p["datasource"]["uid"] == "prometheus" for p in dashboard["panels"] if "targets" in p
    )


# ------------------------------------------------------------ worldcup serve-ray ---


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--replicas", "3:1"], {}, "MIN:MAX"),
        (["--replicas", "two"], {}, "MIN:MAX"),
        (["--detach"], {}, "--detach needs --address"),
        (["--config", "/nonexistent/serve.yaml"], {}, "no Serve config"),
        ([], {"WORLDCUP_REDIS_URL": ""}, "WORLDCUP_REDIS_URL"),
        ([], {"WORLDCUP_ENV": "dev", "WORLDCUP_MASTER_KEY": ""}, "WORLDCUP_MASTER_KEY"),
        ([], {"WORLDCUP_ADMIN_TOKEN": "changeme"}, "WORLDCUP_ADMIN_TOKEN"),
    ],
)
def test_serve_ray_refuses_before_starting_anything(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bad arguments and settings the replicas could not start under fail here, in one
    line, before Ray starts (no ray.init: the test would hang or start a cluster)."""
    import ray
    from typer.testing import CliRunner

    from worldcup_cli.main import app

    good = {
        "WORLDCUP_MASTER_KEY": "2b" * 32,
        "WORLDCUP_ADMIN_TOKEN": "serve-ray-cli-admin",
        "WORLDCUP_REDIS_URL": "redis://127.0.0.1:6379/13",
        "WORLDCUP_ENV": "prod",
    }
    for name, value in {**good, **env}.items():
        monkeypatch.setenv(name, value)

    def no_ray(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ray.init was reached")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.chdir(ROOT / "tests")  # no .env here
    result = CliRunner().invoke(app, ["serve-ray", *argv])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output and "ray.init was reached" not in result.output


def test_a_local_ray_stays_on_loopback() -> None:
    """The driver of a Ray started here, or of one at a loopback address, joins and
    registers on 127.0.0.1 (tests/test_serve.py checks the sockets of a real cluster)."""
    assert ray_app.on_loopback(None)
    assert ray_app.on_loopback("127.0.0.1:6379") and ray_app.on_loopback("localhost:21300")
    assert ray_app.on_loopback("ray://127.0.0.1:10001") and ray_app.on_loopback("[::1]:6379")
    assert not ray_app.on_loopback("10.0.0.5:6379")
    assert not ray_app.on_loopback("auto")  # RAY_ADDRESS or the last cluster: Ray decides
