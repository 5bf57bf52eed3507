"""A real Redis Cluster for the tests: local ``redis-server`` processes, three primaries
with one replica each (six nodes) or two (nine), joined by ``redis-cli --cluster create``.

Ports ``WORLDCUP_TEST_CLUSTER_PORT`` + 0..5 (default 21201; the cluster bus uses
port + 10000); the nine-node cluster is given its own base (+ 10 .. 18). No
persistence; everything lives in one temporary folder, removed on stop. A missing
``redis-server`` fails the tests that need the cluster: never a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import RedisError

NODE_TIMEOUT_MS = 2000  # failure detection: a replica takes over ~2-4 s after a kill


class RedisClusterProcs:
    def __init__(self, base_port: int | None = None, replicas: int = 1) -> None:
        self.base_port = base_port or int(os.environ.get("WORLDCUP_TEST_CLUSTER_PORT", "21201"))
        self.replicas = replicas
        self.ports = [self.base_port + i for i in range(3 * (1 + replicas))]
        self.dir = Path(tempfile.mkdtemp(prefix="wc-redis-cluster-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def _server(self, port: int) -> subprocess.Popen[bytes]:
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        args = [
            "redis-server",
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--dir", str(node_dir),
            "--save", "",
            "--appendonly", "no",
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            "--logfile", str(node_dir / "redis.log"),
        ]  # fmt: skip
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return out.stdout

    def start(self) -> RedisClusterProcs:
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                pytest.fail(f"{tool} not found: the Redis Cluster tests need it", pytrace=False)
        for port in self.ports:
            self.procs[port] = self._server(port)
        for port in self.ports:
            self._wait(lambda p=port: self.cli(p, "ping").strip() == "PONG", f"node {port}")
        create = subprocess.run(
            ["redis-cli", "--cluster", "create"]
            + [f"127.0.0.1:{p}" for p in self.ports]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if create.returncode != 0:
            self.stop()
            pytest.fail(f"redis-cli --cluster create failed: {create.stdout[-2000:]}")
        self.wait_healthy()
        return self

    def _wait(self, ok: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every live node reports cluster_state:ok, 3 primaries cover all slots, and
        every replica's link to its primary is up (until then a write's ``WAIT`` finds no
        replica: a CI run's first cluster test once failed with "0 of 1 replicas")."""

        def healthy() -> bool:
            states = ["cluster_state:ok" in self.cli(p, "cluster", "info") for p in self._live()]
            if not (all(states) and len(self.primaries()) == 3):
                return False
            roles = [self.cli(p, "info", "replication") for p in self._live()]
            replicas = [r for r in roles if "role:slave" in r]
            if len(replicas) != len(roles) - 3:
                return False
            return all("master_link_status:up" in r for r in replicas) and self._acks()

        self._wait(healthy, "cluster_state:ok and every replica acknowledging", timeout)

    def _acks(self) -> bool:
        """Whether a write on each primary is acknowledged by a replica (``WAIT 1``), as
        the store's writes must be: a fresh replica may show its link up before it does."""
        for port in self.primaries():
            key = self._key_on(port)
            out = subprocess.run(
                ["redis-cli", "-p", str(port)],
                input=f"SET {key} 1\nWAIT 1 500\nDEL {key}\n",
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.split()
            if len(out) < 2 or out[1] != "1":
                return False
        return True

    def _key_on(self, port: int) -> str:
        """A key whose slot the primary on ``port`` serves."""
        ranges = [(a, b) for a, b, p in self.slots() if p == port]
        with Redis(port=port, socket_timeout=2) as r:
            for i in range(10_000):
                slot = int(r.execute_command("CLUSTER", "KEYSLOT", f"probe-{i}"))
                if any(a <= slot <= b for a, b in ranges):
                    return f"probe-{i}"
        raise RuntimeError(f"no probe key for the primary on {port}")

    def _live(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def slots(self) -> list[tuple[int, int, int]]:
        """(first slot, last slot, primary port) as a live node sees them."""
        for port in self._live():
            try:
                with Redis(port=port, socket_timeout=2) as r:
                    rows = r.execute_command("CLUSTER", "SLOTS")
            except RedisError:
                continue
            return [(int(row[0]), int(row[1]), int(row[2][1])) for row in rows]
        return []

    def primaries(self) -> list[int]:
        live = set(self._live())
        return sorted({port for _, _, port in self.slots() if port in live})

    def primary_of(self, key: str) -> int:
        with Redis(port=self._live()[0], socket_timeout=2) as r:
            slot = int(r.execute_command("CLUSTER", "KEYSLOT", key))
        for first, last, port in self.slots():
            if first <= slot <= last:
                return port
        raise RuntimeError(f"no primary serves slot {slot}")

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """The killed node again, from its nodes.conf: it rejoins as a replica."""
        self.procs[port] = self._server(port)
        self._wait(lambda: self.cli(port, "ping").strip() == "PONG", f"node {port}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(timeout=10)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
