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
the processor's report that a row lost its watermark (``!`` + its handle +
``:`` + a :class:`Fault`), which the engine reads as the request's tokens
arrive and fails the request on.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from enum import StrEnum
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from worldcup_core.config import SamplingConfig
from worldcup_core.message import Payload
from worldcup_core.scheme import WatermarkScheme

logger = logging.getLogger("worldcup.engine.vllm")

SOCKET_ENV = "WORLDCUP_VLLM_KEY_SOCKET"  # the socket's path (not a secret)
EXTRA_ARGS_KEY = "worldcup"  # SamplingParams.extra_args[...] = the request's handle
EOS_ARGS_KEY = "worldcup_eos"  # the EOS ids, forced if the handle is unknown (fail closed)
REPORT_PREFIX = "!"  # processor -> service: this handle's row is sampled unwatermarked
SCORES_ENV = "WORLDCUP_VLLM_SCORES"  # debug: a JSONL file the processor appends positions to


class Fault(StrEnum):
    """Why a row was sampled without its watermark (the metric's ``reason`` label). Each
    means the processor's view of the row and vLLM's disagree, so the context it would
    watermark on is not the text's: the row's request fails (never a silent text)."""

    PLACEHOLDER = "placeholder"  # async scheduling's -1 reached the step (v1 runner)
    SKIPPED = "skipped_row"  # a registered row had no logits row this step
    GREW = "growth"  # more than one new token between two steps (outside a replay)
    SHRANK = "shrink"  # the row's tokens got fewer (a truncation the processor missed)
    OUTSIDE = "outside_candidates"  # a new token the previous step gave no mass
    LAYOUT = "batch_layout"  # a step's rows are not one per request (speculative rows)


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
        self._faults: dict[str, Fault] = {}
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
            self._faults.pop(handle, None)

    def fault(self, handle: str) -> Fault | None:
        """The processor's report that this handle's row lost its watermark, if any."""
        with self._lock:
            return self._faults.get(handle)

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
                        reported, _, reason = handle.removeprefix(REPORT_PREFIX).partition(":")
                        known = reason in Fault._value2member_map_
                        self._faults.setdefault(reported, Fault(reason) if known else Fault.LAYOUT)
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

    def report_fault(self, handle: str, fault: Fault) -> None:
        """Tell the service this handle's row lost its watermark, and why (answered once
        recorded, so the fault is known before the token that follows it is)."""
        self._ask(f"{REPORT_PREFIX}{handle}:{fault.value}")

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


def read_scores(path: str, handle: str) -> list[dict[str, Any]]:
    """Debug: the processor's per-position records of one request (``SCORES_ENV``)."""
    out = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if f'"handle": "{handle}"' in line:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def readback_lost(tokens: list[int], retokenized: list[int]) -> int:
    """How many generated tokens a reader of the text does not get back: the text's own
    tokenization (what ``/decode`` scores) aligned with the generated ids. A model may emit
    a non-canonical split (``"  " + "eggs"`` where the tokenizer writes ``" " + " eggs"``);
    each such token and the contexts it enters are scored on other ids, so a text full of
    them decodes weakly although every step was watermarked."""
    matcher = difflib.SequenceMatcher(None, tokens, retokenized, autojunk=False)
    return len(tokens) - sum(block.size for block in matcher.get_matching_blocks())


def score_summary(
    records: list[dict[str, Any]], tokens: list[int], retokenized: list[int] | None = None
) -> dict[str, Any]:
    """What tells a weak text from a sync bug: how many positions the watermark moved
    (``tv`` > 0: not a first-c or repeated context, and not a near-certain token), the
    mean entropy of the filtered distribution, and how many steps watermarked on a
    context that is not the text's (a sync bug: 0 when the processor kept up), the
    replays of a preempted request, and (given the text's own tokenization) how many
    generated tokens do not survive it (:func:`readback_lost`)."""
    replays = [int(r["replay"]) for r in records if "replay" in r]
    records = [r for r in records if "pos" in r]
    moved = [r for r in records if r["tv"] > 1e-9]
    mismatches = [
        r["pos"]
        for r in records
        if r["ctx"] and tokens[max(0, r["pos"] - len(r["ctx"])) : r["pos"]] != r["ctx"]
    ]
    entropies = [float(r["entropy"]) for r in records]
    return {
        "positions": len(records),
        "moved": len(moved),
        "mean_entropy": round(sum(entropies) / len(entropies), 3) if entropies else None,
        "low_entropy": sum(e < 0.1 for e in entropies),
        "mean_tv": round(sum(r["tv"] for r in records) / len(records), 4) if records else None,
        "context_mismatches": len(mismatches),
        "first_mismatch": mismatches[0] if mismatches else None,
        "replays": replays,
        "readback_lost": None if retokenized is None else readback_lost(tokens, retokenized),
    }
