"""The service on Ray Serve: the FastAPI app as the ingress of a Serve deployment.

Each replica builds the app of :func:`app.main.create_app` from its own
:class:`~app.core.config.Settings` (the ``WORLDCUP_*`` environment it inherits from its
Ray node, plus the application's ``runtime_env``), and Serve runs the app's lifespan
once per replica: the replica owns its engine (on its own GPU when the deployment asks
for one) and its store connection. Every route, ``/v1`` and the console included,
answers as it does under uvicorn; the Serve proxy streams SSE through.

Replicas share one Redis (tenants, registries, rate limits, probe accounts), so any of
them answers for any tenant; a replica on SQLite or on a throwaway dev secret would
not, and refuses to start. Serve's health check is ``/ready``'s own check
(:func:`app.services.readiness.not_ready`), except where replacing the replica cannot
help (the store is down or was wiped: every replica sees the same store). Each
replica's Prometheus registry is mirrored into Ray's metrics export with Serve's
``deployment``/``replica``/``application`` tags (:class:`RayMetricsMirror`).

The deployment's scaling, draining and resources live in ``deploy/ray/serve.yaml``
(the same application as KubeRay's ``serveConfigV2``); :func:`deploy` applies such a
config to a Ray cluster, as ``serve run`` and KubeRay do. See docs/deployment.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.config import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

logger = logging.getLogger("worldcup.serve")

APPLICATION = "worldcup"
DEPLOYMENT = "WorldCup"
CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "ray" / "serve.yaml"
# The two readiness failures a new replica would meet just the same: Serve replaces a
# replica whose health check fails, so these are reported, not raised.
SHARED_STORE_PROBLEMS = frozenset({"store_unavailable", "store_marker_lost"})
REPLICA_HEADER = b"x-worldcup-replica"
# the Serve proxy's own plain-text answers, and the envelope code each gets
PROXY_ERRORS = {408: "timeout", 429: "overloaded", 503: "unavailable"}
PROXY_CALLBACK = "app.serve:proxy_middlewares"  # RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
# Ray's switch for a cluster of this machine only: with it off (0), a node's and a
# driver's address is 127.0.0.1, and Ray's own servers then listen on 127.0.0.1 alone.
# Left on, Ray replaces 127.0.0.1 by the machine's outward address and listens on
# every interface.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def on_loopback(address: str | None) -> bool:
    """Whether a driver for ``address`` (None: a Ray started by this process) should stay
    on loopback: a Ray started here, or one whose GCS is at a loopback address."""
    if address is None:
        return True
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def pin_loopback() -> None:
    """This process's Ray (the driver, and a Ray it starts) on 127.0.0.1 only."""
    import os

    import ray._private.ray_constants as constants  # ray is pinned (pyproject)

    os.environ[RAY_LOOPBACK_ENV] = "0"  # read by the processes a local Ray starts
    constants.ENABLE_RAY_CLUSTER = False  # read by this one (Ray may be imported already)


class ReplicaConfigError(RuntimeError):
    """Settings a replica cannot serve under (the message says which and why)."""


def check_replica_settings(settings: Settings) -> None:
    """Refuse the settings under which replicas would not answer for each other."""
    if not settings.redis_url:
        raise ReplicaConfigError(
            "Serve replicas must share one Redis (WORLDCUP_REDIS_URL): on the embedded "
            "SQLite each replica would keep its own tenants and registries"
        )
    if settings.throwaway_secrets:
        names = ", ".join(f"WORLDCUP_{name.upper()}" for name in sorted(settings.throwaway_secrets))
        raise ReplicaConfigError(
            f"{names} must be set (or their *_FILE) for Serve: in dev mode each replica "
            "would draw its own secret, and could not unwrap the others' keys"
        )


class RayMetricsMirror:
    """Copies a replica's Prometheus registry into Ray's metrics export, every period.

    Every sample becomes a Ray gauge of the same name (counters keep their ``_total``
    and histograms their ``_bucket``/``_sum``/``_count`` samples, so ``rate()`` and
    ``histogram_quantile()`` work unchanged on them); Ray prefixes ``ray_`` and adds
    the replica's tags. Labels stay those of :mod:`app.core.metrics`: bounded, never a
    tenant or a key.
    """

    def __init__(self, registry: CollectorRegistry, period_s: float = 5.0) -> None:
        self._registry = registry
        self._period_s = period_s
        self._gauges: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worldcup-metrics", daemon=True)

    def sync(self) -> int:
        """Copy every sample once; returns how many were copied."""
        from ray.serve.metrics import Gauge

        copied = 0
        for family in self._registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):  # a timestamp, not a figure
                    continue
                gauge = self._gauges.get(sample.name)
                if gauge is None:
                    gauge = Gauge(
                        sample.name,
                        description=family.documentation or sample.name,
                        # Ray annotates Tuple[str] but takes any number of keys
                        tag_keys=tuple(sorted(sample.labels)),  # type: ignore[arg-type]
                    )
                    self._gauges[sample.name] = gauge
                gauge.set(sample.value, tags=dict(sample.labels))
                copied += 1
        return copied

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.sync()
            except Exception:  # a metrics hiccup must never take the replica down
                logger.exception("mirroring metrics into Ray failed")


class ReplicaHeaders:
    """The replica's outermost middleware: the headers a response gets under Serve.

    The Serve proxy echoes ``X-Request-ID`` itself (the client's, or the one it made
    and passed on, which :class:`~app.api.middleware.RequestContext` then uses), so the
    app's own copy is dropped rather than sent twice; ``X-WorldCup-Replica`` names the
    replica that answered (an opaque Serve id: which one, never what it holds).
    """

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, send_with_replica)


class ProxyErrors:
    """In the Serve proxy: its own failures answered in the service's error envelope.

    A replica that dies with a request in flight leaves the proxy with nothing to send
    (it would answer a bare ``500 Internal Server Error``): that becomes a 502
    ``replica_unavailable``. The proxy's own plain-text 408/429/503 (backpressure,
    timeouts, no replica yet) keep their status and headers in the envelope. Installed
    by ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=app.serve:proxy_middlewares``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from app.api.middleware import send_error

        path = str(scope.get("path", ""))
        started = False
        held: Message | None = None  # the proxy's own plain-text error, rewritten
        body = b""

        async def send_enveloped(message: Message) -> None:
            nonlocal started, held, body
            if message["type"] == "http.response.start":
                started = True
                headers = dict(message.get("headers", []))
                plain = headers.get(b"content-type", b"").startswith(b"text/plain")
                if message["status"] in PROXY_ERRORS and plain:
                    held = message
                    return
            elif held is not None and message["type"] == "http.response.body":
                body += message.get("body", b"")
                if message.get("more_body", False):
                    return
                kept = [
                    (k, v)
                    for k, v in held.get("headers", [])
                    if k not in (b"content-type", b"content-length", b"connection")
                ]
                text = body.decode("utf-8", "replace").strip() or "the Serve proxy refused it"
                code = PROXY_ERRORS[held["status"]]
                await send_error(send, held["status"], text, code, path, kept)
                return
            await send(message)

        await self.app(scope, receive, send_enveloped)
        if not started:
            await send_error(
                send,
                502,
                "the replica serving this request stopped before it answered; retry it "
                "(/generate with the same Idempotency-Key answers the same text)",
                "replica_unavailable",
                path,
            )


def proxy_middlewares() -> list[Any]:
    """The Serve proxy's middlewares (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyErrors)]


class WorldCup:
    """One replica: the whole service, its engine and its store connection."""

    def __init__(self, metrics_period_s: float = 5.0) -> None:
        settings = Settings()
        check_replica_settings(settings)
        self._settings = settings
        self._metrics_period_s = metrics_period_s
        self._app: FastAPI | None = None
        self._mirror: RayMetricsMirror | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this once per replica, then runs the app's lifespan."""
        from app.main import create_app

        self._app = create_app(self._settings)
        replica = serve.get_replica_context().replica_id.unique_id
        self._app.add_middleware(ReplicaHeaders, replica=replica)  # added last: outermost
        self._mirror = RayMetricsMirror(self._app.state.metrics.registry, self._metrics_period_s)
        self._mirror.start()
        return self._app

    async def check_health(self) -> None:
        """Serve's periodic health check: raising makes Serve replace this replica."""
        from app.services.readiness import not_ready

        runtime = getattr(self._app.state, "runtime", None) if self._app else None
        if runtime is None:
            raise RuntimeError("the app's lifespan has not run")
        problem = await not_ready(runtime)
        if problem is None:
            return
        if problem.code in SHARED_STORE_PROBLEMS:
            logger.warning("not ready (%s): %s; not restarting", problem.code, problem.message)
            return
        raise RuntimeError(f"not ready: {problem.code}: {problem.message}")

    def __del__(self) -> None:  # Serve calls it after the app's lifespan shut down
        mirror = getattr(self, "_mirror", None)  # None if __init__ refused the settings
        if mirror is not None:
            mirror.stop()


# The Serve deployment (ingress: the app this class builds), and the application that
# deploy/ray/serve.yaml's import_path names.
WorldCupDeployment = serve.deployment(name=DEPLOYMENT)(serve.ingress()(WorldCup))
worldcup = WorldCupDeployment.bind()


# ------------------------------------------------------------------ deploying ---


def load_config(path: Path = CONFIG) -> dict[str, Any]:
    """A Serve config file (``serve.yaml``'s layout) as a dict."""
    import yaml  # type: ignore[import-untyped,unused-ignore]

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a Serve config (a mapping with 'applications')")
    return data


def application(config: Mapping[str, Any], name: str = APPLICATION) -> dict[str, Any]:
    """The named application of a Serve config."""
    for app in config.get("applications", []):
        if app.get("name") == name:
            found: dict[str, Any] = app
            return found
    raise ValueError(f"the Serve config has no application {name!r}")


def deployment_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The options of the WorldCup deployment in ``config``'s application."""
    for deployment in application(config).get("deployments", []):
        if deployment.get("name") == DEPLOYMENT:
            options: dict[str, Any] = deployment
            return options
    raise ValueError(f"the Serve config's {APPLICATION!r} has no {DEPLOYMENT!r} deployment")


def override(
    config: dict[str, Any],
    *,
    cpus_per_replica: float | None = None,
    engine: str | None = None,
    replicas: tuple[int, int] | None = None,
    http_host: str | None = None,
    http_port: int | None = None,
    proxy_location: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``config`` changed in place for another machine: ``cpus_per_replica`` runs it
    without GPUs (the engine on the CPU, this many CPUs a replica), ``replicas`` is
    (min, max) for the autoscaler, ``env`` adds to the replicas' environment."""
    options = deployment_options(config)
    env_vars = application(config).setdefault("runtime_env", {}).setdefault("env_vars", {})
    if cpus_per_replica is not None:
        options["ray_actor_options"] = {
            **options.get("ray_actor_options", {}),
            "num_gpus": 0,
            "num_cpus": cpus_per_replica,
        }
        env_vars["WORLDCUP_DEVICE"] = "cpu"
    if engine is not None:
        env_vars["WORLDCUP_ENGINE"] = engine
    env_vars.update(env or {})
    if replicas is not None:
        low, high = replicas
        scaling = options.setdefault("autoscaling_config", {})
        scaling.update(min_replicas=low, max_replicas=high)
        scaling["initial_replicas"] = min(max(low, scaling.get("initial_replicas", low)), high)
    http = config.setdefault("http_options", {})
    if http_host is not None:
        http["host"] = http_host
    if http_port is not None:
        http["port"] = http_port
    if proxy_location is not None:
        config["proxy_location"] = proxy_location
    return config


def deploy(config: Mapping[str, Any], *, timeout_s: float = 600.0) -> None:
    """Apply a Serve config to the connected Ray cluster and wait until it runs.

    The path of ``serve run serve.yaml`` and of KubeRay (the controller's
    ``apply_config``), so what runs is exactly the config's application.
    """
    from ray.serve._private import api as private_api  # ray is pinned (pyproject)
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(dict(config))
    client = private_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
    )
    client.deploy_apps(schema)
    wait_running([app.name for app in schema.applications], timeout_s)


def wait_running(apps: list[str], timeout_s: float) -> None:
    """Until every named application is RUNNING; a failed deploy raises at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status()
        states = {name: status.applications.get(name) for name in apps}
        failed = {n: s.message for n, s in states.items() if s and s.status == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"Serve deploy failed: {failed}")
        if all(s is not None and s.status == "RUNNING" for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve applications not running after {timeout_s:.0f} s")
        time.sleep(1.0)
