"""Finished work on disk, so an interrupted run continues where it stopped.

Layout: ``<cache>/<kind>/<cell key>/<batch>-<batch key>.json``. The cell key
hashes everything that shapes the cell's output (model, scheme, payload
length, sampling, seed, batch size, harness version); the batch key hashes
the batch's prompt indices and prompt token ids. A batch file is written only
when the batch is done, atomically (temporary file + ``os.replace``), so a
crash leaves either the whole batch or nothing. Growing ``--prompts`` reuses
every full batch of the smaller run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# Bump when a change in the harness changes what a cached batch holds.
CACHE_VERSION = "worldcup-eval-cache-v1"


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hex digest of ``obj``'s canonical JSON."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` in one ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary outputs
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_results_json(path: Path, obj: object) -> None:
    """``obj`` as indented, key-sorted JSON (a results file that diffs line by line)."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def say(line: str) -> None:
    """One progress or status line on stdout, flushed (a queue's log reads it live)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class BatchCache:
    """Batches of one kind of work (``gen``, ``paraphrase``, ``scorer``) under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        ignore = root / ".gitignore"
        if not ignore.exists():  # generations are bulky: keep them out of git by default
            write_text_atomic(ignore, "*\n")

    def path(self, kind: str, cell_key: str, batch_index: int, batch_key: str) -> Path:
        return self.root / kind / cell_key / f"{batch_index:04d}-{batch_key}.json"

    def load(self, path: Path) -> dict[str, Any] | None:
        """The batch at ``path``, or None when absent or unreadable (it is then redone)."""
        try:
            with path.open(encoding="utf-8") as fh:
                data = json.load(fh)
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None

    def store(self, path: Path, data: dict[str, Any]) -> None:
        write_json_atomic(path, {**data, "version": CACHE_VERSION})
