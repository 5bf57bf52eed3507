"""The compose stack (docker-compose.yml as users run it: app + Redis + the tls profile's
proxy) under podman-compose.

``make test-container`` (CI) runs it after ``scripts/container-test.sh`` has built the
images; compose's own variables point the file at them (APP_IMAGE, REDIS_IMAGE: Redis
from Debian's package, as no image registry can be reached here), at a loopback port
(APP_PORT) and at this test's secret files (SECRETS_DIR). Checked: both healthchecks
report healthy; a tenant and a registry entry survive ``restart`` of the app and of
Redis, and a SIGKILL of Redis (the AOF, fsynced on every write, holds them).

The same stack runs the ``tls`` profile (docker/Dockerfile.tls, nginx-light) with a
certificate made at test time by scripts/tls-cert.sh (a private CA and a server cert for
localhost/127.0.0.1; TLS_CERT_FILE, TLS_KEY_FILE) on a loopback TLS_PORT, and the app
trusting the compose network's proxy (FORWARDED_ALLOW_IPS, as docs/deployment.md says).
Checked over https with the CA verified: tenant, /generate, /decode; an SSE stream
arriving event by event; plain http refused; the proxy's X-Forwarded-Proto believed by
the app; its body limit the app's, with the app's 413 envelope.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
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
    logs,
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
    tls_url: str
    ca_file: Path
    printed: list[str] = field(default_factory=list)

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [
            need("WORLDCUP_CT_COMPOSE"),
            "--profile",
            "tls",
            "-f",
            str(ROOT / "docker-compose.yml"),
        ]
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
        for service in ("redis", "app", "tls"):
            assert wait_healthy(self.container(service)) == "healthy"
        wait_ready(self.url, self.container("app"))

    def https(self, **kwargs: Any) -> httpx.Client:
        """A client of the proxy that trusts the test's CA only."""
        kwargs.setdefault("verify", str(self.ca_file))
        return httpx.Client(base_url=self.tls_url, timeout=300, **kwargs)


def _subnet(network: str) -> str:
    data = json.loads(podman("network", "inspect", network).stdout)
    subnets = [s["subnet"] for s in data[0]["subnets"]]
    assert subnets, data
    return ",".join(subnets)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    port, tls_port = free_port(), free_port()
    secrets_dir = tmp_path_factory.mktemp("compose-secrets")
    tls_dir = secrets_dir / "tls"
    # the certificate as docs/deployment.md makes it (no key is ever committed)
    subprocess.run(["bash", str(ROOT / "scripts" / "tls-cert.sh"), str(tls_dir), "localhost",
                    "127.0.0.1"], check=True, capture_output=True, timeout=60)  # fmt: skip
    project = f"worldcup-ct-{uuid.uuid4().hex[:6]}"
    # The app trusts X-Forwarded-* from the compose network only (docs/deployment.md: its
    # subnet in FORWARDED_ALLOW_IPS); made here first so that its subnet is known.
    network = f"{project}_default"
    podman("network", "create", network)
    running: Stack | None = None
    try:
        env = dict(os.environ)
        env.update(
            APP_IMAGE=need("WORLDCUP_CT_CPU_IMAGE"),
            REDIS_IMAGE=need("WORLDCUP_CT_REDIS_IMAGE"),
            TLS_IMAGE=need("WORLDCUP_CT_TLS_IMAGE"),
            APP_PORT=f"127.0.0.1:{port}",
            TLS_PORT=f"127.0.0.1:{tls_port}",
            SECRETS_DIR=str(secrets_dir),
            TLS_CERT_FILE=str(tls_dir / "server.crt"),
            TLS_KEY_FILE=str(tls_dir / "server.key"),
            TLS_HSTS="max-age=300",
            FORWARDED_ALLOW_IPS=_subnet(network),
        )
        running = Stack(
            project,
            env,
            f"http://127.0.0.1:{port}",
            write_secrets(secrets_dir),
            f"https://127.0.0.1:{tls_port}",
            tls_dir / "ca.crt",
        )
        up = running.compose("up", "-d", "app", "redis", "tls")
        running.healthy()
        print(f"podman-compose up printed:\n{up.stdout}{up.stderr}")
        print(podman("ps", "--filter", f"label=io.podman.compose.project={running.project}",
                     "--format", "{{.Names}} {{.Status}}").stdout)  # fmt: skip
        yield running
    except BaseException:
        for service in ("app", "redis", "tls"):
            print(logs(f"{project}_{service}_1"))
        raise
    finally:
        if running is not None:
            running.compose("down", "-v", "-t", "40", check=False)
        podman("network", "rm", "-f", network, check=False)


def _entry(stack: Stack) -> tuple[str, dict[str, Any], dict[str, str]]:
    with httpx.Client(base_url=stack.url, timeout=300) as http:
        api_key = create_tenant(http, stack.secrets["admin_token"], "compose")
        meta = {"doc": "compose-1"}
        gen = generate(http, api_key, meta)
        assert_registry_entry(decode(http, api_key, gen["text"]), gen, meta)
    return api_key, gen, meta


def _still_there(
    stack: Stack, api_key: str, gen: dict[str, Any], meta: Any, *, spent: bool = False
) -> None:
    """The tenant (its API key authenticates, its watermark key decodes) and the entry.
    ``spent``: the text's full answers (WORLDCUP_PROBE_FULL_ANSWERS, default 3) are used
    up, so the answer is the verdict and the entry without a p-value."""
    with httpx.Client(base_url=stack.url, timeout=300) as http:
        dec = decode(http, api_key, gen["text"])
    if not spent:
        assert_registry_entry(dec, gen, meta)
        return
    assert "p_value" not in dec and dec["detail"] == "verdict", dec
    assert dec["detail_reason"] == "full_answers_spent", dec
    assert dec["verdict"] == "watermarked", dec
    match = dec["registry_match"]
    assert match is not None and match["message_id"] == gen["message_id"], dec
    assert match["metadata"] == meta


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
    # the fourth answer on this text: the count of its full answers survived the crash too
    _still_there(stack, api_key, gen, meta, spent=True)
    aof = podman("exec", stack.container("redis"), "ls", "/data/appendonlydir").stdout
    assert ".aof" in aof, aof


def test_compose_file_as_users_run_it(stack: Stack) -> None:
    """No edits were needed: the stack ran from docker-compose.yml with its variables."""
    config = stack.compose("config").stdout
    assert str(Path(stack.env["SECRETS_DIR"]) / "master_key.hex") in config
    assert stack.env["APP_IMAGE"] in config


# ----------------------------------------------------------------- the tls profile ---
# After the restarts above: the proxy finds the app again by the network's DNS.


def test_https_round_trip_with_the_ca_verified(stack: Stack) -> None:
    """Tenant, /generate, /decode through the proxy, the server's certificate verified
    against the test's CA (and refused without it); HSTS as TLS_HSTS says."""
    with stack.https() as https:
        api_key = create_tenant(https, stack.secrets["admin_token"], "tls")
        meta = {"doc": "tls-1"}
        gen = generate(https, api_key, meta)
        assert_registry_entry(decode(https, api_key, gen["text"]), gen, meta)
        health = https.get("/health")
        assert health.status_code == 200
        assert health.headers["strict-transport-security"] == "max-age=300"
    # its access log: the requests, never a key or the admin token (they are headers)
    proxy_log = logs(stack.container("tls"))
    assert '"POST /generate HTTP/1.1" 200' in proxy_log, proxy_log
    assert api_key not in proxy_log and stack.secrets["admin_token"] not in proxy_log
    with pytest.raises(httpx.ConnectError) as refused, stack.https(verify=True) as public:
        public.get("/health")  # the system's CAs: the private CA is not among them
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value), repr(refused.value)


def test_sse_streams_through_the_proxy(stack: Stack) -> None:
    """proxy_buffering off: the events arrive as the app writes them, not all at the end."""
    with stack.https() as https:
        api_key = create_tenant(https, stack.secrets["admin_token"], "tls-stream")
        body = {"prompt": "The harbour", "max_new_tokens": 48, "min_new_tokens": 48,
                "stream": True, "metadata": {"doc": "tls-sse"}}  # fmt: skip
        arrivals: list[tuple[float, str]] = []
        with https.stream("POST", "/generate", json=body,
                          headers={"Authorization": f"Bearer {api_key}"}) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line:
                    arrivals.append((time.monotonic(), line))
    lines = [line for _, line in arrivals]
    assert lines[-1] == "data: [DONE]" and "event: result" in lines, lines[-5:]
    result_at = arrivals[lines.index("event: result")][0]
    data_before = [t for t, line in arrivals[: lines.index("event: result")]
                   if line.startswith("data:")]  # fmt: skip
    assert len(data_before) >= 3, lines[:10]
    spread = result_at - data_before[0]
    print(
        f"SSE through the proxy: {len(data_before)} events, first {spread:.2f} s before the result"
    )
    assert spread > 0.5, f"the events came together ({spread:.3f} s): buffered by the proxy?"


def test_plain_http_to_the_proxy_is_refused(stack: Stack) -> None:
    plain = stack.tls_url.replace("https://", "http://")
    r = httpx.get(f"{plain}/health", timeout=30, follow_redirects=False)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "https_required"


def test_app_believes_the_proxys_forwarded_headers(stack: Stack) -> None:
    """The app builds its redirects from X-Forwarded-Proto, which uvicorn believes from
    FORWARDED_ALLOW_IPS only: https through the proxy (which overwrites a client's own
    header), http on the app's own port, which no proxy fronts."""
    with stack.https() as https:
        r = https.get("/health/", follow_redirects=False, headers={"X-Forwarded-Proto": "http"})
    assert r.status_code == 307, r.text
    assert r.headers["location"] == f"{stack.tls_url}/health"
    direct = httpx.get(f"{stack.url}/health/", timeout=30, follow_redirects=False)
    assert direct.status_code == 307
    assert direct.headers["location"] == f"{stack.url}/health"


def test_proxy_body_limit_is_the_apps(stack: Stack) -> None:
    """WORLDCUP_MAX_BODY_BYTES (default) at the proxy: one byte over gets the app's 413
    envelope; /batch paths keep the larger WORLDCUP_MAX_BATCH_BODY_BYTES (the app answers)."""
    from app.core.config import Settings

    limit = Settings.model_fields["max_body_bytes"].default
    pre, post = b'{"texts": ["', b'"]}'
    body = pre + b"a" * (limit + 1 - len(pre) - len(post)) + post
    assert len(body) == limit + 1
    json_type = {"Content-Type": "application/json"}
    with stack.https() as https:
        over = https.post("/decode", content=body, headers=json_type)
        assert over.status_code == 413, over.text
        error = over.json()["error"]
        assert error["code"] == error["type"] == "request_too_large"
        assert f"exceeds {limit} bytes" in error["message"]
        assert "nginx" not in over.text
        batch = https.post("/decode/batch", content=body, headers=json_type)
        # past the proxy: the app asks for a key (it would have said 413 itself)
        assert batch.status_code == 401, batch.text


def test_only_the_https_port_is_published(stack: Stack) -> None:
    ports = podman("port", stack.container("tls")).stdout.split()
    assert ports == ["8443/tcp", "->", stack.tls_url.removeprefix("https://")], ports


def test_proxy_alone_answers_envelopes_and_checks_its_settings(tmp_path: Path) -> None:
    """The proxy image without its app: a 502 in the service's envelope (Retry-After), not
    nginx's page; and its entrypoint refuses a body limit that is not a number of bytes,
    and a missing certificate, before nginx starts."""
    image = need("WORLDCUP_CT_TLS_IMAGE")
    tls_dir = tmp_path / "tls"
    subprocess.run(["bash", str(ROOT / "scripts" / "tls-cert.sh"), str(tls_dir)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    mounts = ["-v", f"{tls_dir / 'server.crt'}:/run/secrets/tls_cert:ro",
              "-v", f"{tls_dir / 'server.key'}:/run/secrets/tls_key:ro"]  # fmt: skip
    bad = podman("run", "--rm", *mounts, "-e", "WORLDCUP_MAX_BODY_BYTES=1mb", image, check=False)
    assert bad.returncode == 2 and "whole numbers of bytes" in bad.stderr, bad.stderr
    nocert = podman("run", "--rm", image, check=False)
    assert nocert.returncode == 2 and "/run/secrets/tls_cert is missing" in nocert.stderr
    port, name = free_port(), f"worldcup-ct-tls-{uuid.uuid4().hex[:6]}"
    podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8443", *mounts, image)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/ready", verify=str(tls_dir / "ca.crt"),
                              timeout=10)  # fmt: skip
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert r.status_code == 502, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "upstream_unavailable"
    finally:
        podman("rm", "-f", "-t", "5", name, check=False)
