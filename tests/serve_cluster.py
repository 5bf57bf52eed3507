"""A local Ray cluster for the Serve tests: real ``ray start`` nodes on one machine.

Every port Ray opens is named (GCS, node manager, object manager, agents, metrics
export, the Serve proxies, a worker-port range per node) from one base,
``WORLDCUP_TEST_RAY_PORT_BASE`` (default 21300, 100 ports), so the cluster never takes
Redis's 6379 (Ray's default GCS port) or another job's ports. Each node's ``ray start``
runs in a session of its own: stopping the cluster ends exactly the processes of those
sessions (never ``ray stop``, which would end every Ray on the machine).

The cluster runs with Ray's token authentication, on a token of its own (not the
``~/.ray/auth_token`` that any local ``ray.init()`` on this machine may have written, and
that a ``ray start`` without ``RAY_AUTH_MODE`` would otherwise pick up); the driver joins
it inside :meth:`LocalRayCluster.driver_env`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# ``ray start`` on loopback. Ray replaces 127.0.0.1 (``--node-ip-address``, ``--address``)
# by the machine's outward address, so that other machines can reach the node: the
# nodes then registered, and talked to each other and to the driver, on that address.
# Here every node process gets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's switch
# for "this machine only" (its node address is 127.0.0.1), and ``ray start`` itself runs
# with that one check lifted (the switch would refuse a second node) and its node
# address pinned to 127.0.0.1.
RAY_START = (
    "import sys\n"
    "import ray._private.ray_constants as constants\n"
    "import ray._private.services as services\n"
    "constants.ENABLE_RAY_CLUSTER = True\n"
    "services.get_node_ip_address = lambda address=None: '127.0.0.1'\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv[0] = 'ray'\n"
    "main()\n"
)
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
REPLICA_TITLE = "ray::ServeReplica:worldcup:WorldCup"


def port_base() -> int:
    return int(os.environ.get("WORLDCUP_TEST_RAY_PORT_BASE", "21300"))


def _reload_ray_auth() -> None:
    """Ray reads RAY_AUTH_MODE and the token once per process and caches them; a process
    that imported Ray already rereads them this way (as Ray's own auth setup does)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@dataclass
class Node:
    """One ``ray start``: its session id ends every process it started."""

    index: int
    session: int  # the sid (= pid of its `ray start`)
    proxy_port: int
    metrics_port: int


@dataclass
class LocalRayCluster:
    """``ray start --head`` plus ``ray start --address``, every port from ``base``."""

    env: dict[str, str]
    base: int = field(default_factory=port_base)
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rwc", dir="/tmp"))
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        token = Path(self.temp_dir) / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}

    @contextlib.contextmanager
    def driver_env(self) -> Iterator[None]:
        """This process's environment for ``ray.init`` on the cluster (restored after):
        its token, and the driver on loopback (it joins 127.0.0.1, not the machine's
        outward address, and registers its own address as 127.0.0.1)."""
        import ray._private.ray_constants as constants

        saved = {name: os.environ.get(name) for name in [*self.auth, *LOOPBACK_ENV]}
        os.environ.update({**self.auth, **LOOPBACK_ENV})
        cluster_mode, constants.ENABLE_RAY_CLUSTER = constants.ENABLE_RAY_CLUSTER, False
        _reload_ray_auth()
        try:
            yield
        finally:
            constants.ENABLE_RAY_CLUSTER = cluster_mode
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _reload_ray_auth()

    @property
    def gcs(self) -> str:
        return f"127.0.0.1:{self.base}"

    @property
    def http_port(self) -> int:
        return self.base + 9  # the head's Serve proxy

    def _ports(self, index: int) -> dict[str, int]:
        b = self.base + 10 * index
        workers = self.base + 20 + 30 * index
        return {
            "--node-manager-port": b + 1,
            "--object-manager-port": b + 2,
            "--metrics-export-port": b + 3,
            "--dashboard-agent-listen-port": b + 4,
            "--dashboard-agent-grpc-port": b + 5,
            "--runtime-env-agent-port": b + 6,
            "--min-worker-port": workers,
            "--max-worker-port": workers + 29,
        }

    def check_ports_free(self, nodes: int) -> None:
        wanted = [self.base, self.base + 7, self.base + 8, self.base + 9]
        for i in range(nodes):
            ports = self._ports(i)
            wanted += [p for k, p in ports.items() if "worker" not in k]
            wanted += [self.base + 10 * i + 9]
        busy = []
        for port in wanted:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    busy.append(port)
        if busy:
            raise RuntimeError(
                f"ports {busy} are taken: set WORLDCUP_TEST_RAY_PORT_BASE to a free block "
                "of 100 ports"
            )

    def start(self, cpus: list[float]) -> None:
        """One node per entry of ``cpus`` (the first is the head)."""
        self.check_ports_free(len(cpus))
        for index, num_cpus in enumerate(cpus):
            self._start_node(index, num_cpus)

    def _start_node(self, index: int, num_cpus: float) -> None:
        args = [
            sys.executable,
            "-c",
            RAY_START,
            "start",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
            *(f"{k}={v}" for k, v in self._ports(index).items()),
        ]
        env = {**os.environ, **self.env, **self.auth, **LOOPBACK_ENV}
        if index == 0:
            args += [
                "--head",
                f"--port={self.base}",
                f"--ray-client-server-port={self.base + 7}",
                f"--dashboard-port={self.base + 8}",
                "--include-dashboard=false",
                f"--temp-dir={self.temp_dir}",
            ]
        else:
            args += [f"--address={self.gcs}"]
            # this node's Serve proxy: its own port (two proxies, one machine)
            env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] = str(self.base + 10 * index + 9)
        proc = subprocess.Popen(
            args,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.nodes.append(
            Node(
                index,
                proc.pid,
                self.base + 10 * index + 9,
                self._ports(index)["--metrics-export-port"],
            )
        )
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start (node {index}) failed:\n{out.decode()[-3000:]}")

    def session_pids(self, node: Node) -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == node.session:  # field 6 of stat: the session id
                pids.append(int(entry.name))
        return pids

    def replica_pids(self) -> dict[int, int]:
        """The live replica processes: pid -> index of the node that runs it."""
        found = {}
        for node in self.nodes:
            for pid in self.session_pids(node):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if cmdline.startswith(REPLICA_TITLE.encode()) and state != "Z":
                    found[pid] = node.index
        return found

    def stop(self) -> None:
        """End every process of every node's session: TERM, then KILL what stays."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [pid for node in reversed(self.nodes) for pid in self.session_pids(node)]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(
                self._alive(pid) for node in self.nodes for pid in self.session_pids(node)
            ):
                time.sleep(0.3)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"
