"""The private channel that hands each request's watermark material to the vLLM processor.

vLLM runs its engine core (and so our logits processor) in a spawned process,
and it prints ``SamplingParams`` (``extra_args`` included) in debug logs and
reprs. So key material never goes into a request: the service registers a
:class:`RowSpec` under a random opaque handle, puts only the handle in
``extra_args``, and the processor fetches the spec over a Unix socket that
lives in a fresh ``0700`` directory (the socket itself ``0600``): only this
user can connect. The service forgets a handle when its request ends.

Both ends are ours and the socket is private, so the spec travels pickled
(:mod:`multiprocessing.connection`). The same channel carries the other way
the processor's report that a row lost its watermark (``!`` + its handle),
which the engine reads when the request ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from worldcup_core.config import SamplingConfig
from worldcup_core.message import Payload
from worldcup_core.scheme import WatermarkScheme

logger = logging.getLogger("worldcup.engine.vllm")

SOCKET_ENV = "WORLDCUP_VLLM_KEY_SOCKET"  # the socket's path (not a secret)
EXTRA_ARGS_KEY = "worldcup"  # SamplingParams.extra_args[...] = the request's handle
EOS_ARGS_KEY = "worldcup_eos"  # the EOS ids, forced if the handle is unknown (fail closed)
REPORT_PREFIX = "!"  # processor -> service: this handle's row is sampled unwatermarked


@dataclass(frozen=True)
class RowSpec:
    """What the processor needs for one request; ``scheme`` None: filtering only."""

    sampling: SamplingConfig
    eos_token_ids: tuple[int, ...]
    scheme: WatermarkScheme | None = field(default=None, repr=False)
    payload: Payload | None = field(default=None, repr=False)
    # ids banned while others remain: a JSON spec's control-character tokens (as on hf)
    banned: tuple[int, ...] = field(default=(), repr=False)

    def __repr__(self) -> str:  # never the key, never the payload
        return f"RowSpec(watermarked={self.scheme is not None})"


class KeyServer:
    """Service side: answers handle -> :class:`RowSpec` for the engine core's processor."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="worldcup-vllm-"))  # mode 0700
        self.path = str(self._dir / "keys.sock")
        self._specs: dict[str, RowSpec] = {}
        self._unwatermarked: set[str] = set()
        self._lock = threading.Lock()
        self._listener = Listener(self.path, family="AF_UNIX")
        os.chmod(self.path, 0o600)
        self._closed = False
        threading.Thread(target=self._accept, name="worldcup-vllm-keys", daemon=True).start()

    def __repr__(self) -> str:
        return f"KeyServer({len(self._specs)} handles)"

    def register(self, handle: str, spec: RowSpec) -> None:
        with self._lock:
            self._specs[handle] = spec

    def forget(self, handle: str) -> None:
        with self._lock:
            self._specs.pop(handle, None)
            self._unwatermarked.discard(handle)

    def unwatermarked(self, handle: str) -> bool:
        """Did the processor report this handle's row as sampled without its watermark?"""
        with self._lock:
            return handle in self._unwatermarked

    def __len__(self) -> int:
        return len(self._specs)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name="worldcup-vllm-keys-conn", daemon=True
            ).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    handle = conn.recv_bytes(256).decode("ascii", "replace")
                except (EOFError, OSError):
                    return
                with self._lock:
                    if handle.startswith(REPORT_PREFIX):
                        self._unwatermarked.add(handle.removeprefix(REPORT_PREFIX))
                        spec = None
                    else:
                        spec = self._specs.get(handle)
                try:
                    conn.send(spec)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class KeyClient:
    """Processor side: one connection, opened on first use, reopened after an error."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.environ.get(SOCKET_ENV)
        self._conn: Connection | None = None

    def fetch(self, handle: str) -> RowSpec | None:
        spec = self._ask(handle)
        return spec if isinstance(spec, RowSpec) else None

    def report_unwatermarked(self, handle: str) -> None:
        """Tell the service this handle's row lost its watermark (answered once recorded)."""
        self._ask(REPORT_PREFIX + handle)

    def _ask(self, message: str) -> object:
        if self.path is None:
            raise RuntimeError(
                f"{SOCKET_ENV} is not set: the WorldCup processor has no key channel"
            )
        for attempt in (1, 2):
            try:
                if self._conn is None:
                    self._conn = Client(self.path, family="AF_UNIX")
                self._conn.send_bytes(message.encode("ascii"))
                return self._conn.recv()
            except (EOFError, OSError):
                self._conn = None
                if attempt == 2:
                    raise
        return None
