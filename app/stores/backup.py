"""Backup and restore of either store (``worldcup store backup`` / ``restore``).

SQLite: SQLite's online backup API (``sqlite3.Connection.backup``), page by page from a
read-only connection, so a running service keeps serving; the backup file is itself a
SQLite database. Restore checks it (``PRAGMA integrity_check``, the schema's tables)
and copies it over the target with the same API.

Redis (one server or a cluster): a logical dump through the store's key layout
(:mod:`app.stores.redis_layout`). Every key under the prefix (SCAN on every primary),
by type, with its remaining TTL, as JSON lines; keys are written without the prefix,
so a dump restores under any prefix and into one Redis or a cluster alike. Skipped:
the short-lived rate-limit, probe-accounting and creation-marker keys (but not the
probe tables' durable records: the recorded client-chosen payloads and their repeat
counts, :mod:`app.stores.client_payloads`). Binary strings (the tenants' context
sketches, ``ctxsketch``) are kept as base64, type ``bytes`` (format version 2). The registry's
counters (``msgseq``, ``msglive``, ``msgexp``) are read last: they only grow, so a
dump taken while texts are issued never holds an entry above its tenant's counter
(texts issued during the dump may or may not be in it). Restore refuses a namespace
that holds keys unless ``force`` (which deletes them first).
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from app.stores.client_payloads import durable_probe_key
from app.stores.redis_layout import check_prefix

FORMAT = "worldcup-store-backup"
VERSION = 2  # 2: binary strings (the context sketches) as type "bytes", base64
_BINARY_KINDS = ("ctxsketch",)  # strings that are not text: read raw, written as base64
SQLITE_MAGIC = b"SQLite format 3\x00"
SQLITE_TABLES = ("tenants", "keys", "messages", "api_keys", "cases", "marker")
_SKIPPED_KINDS = ("ratelimit", "ratelimit-op", "probe", "creating")
_LAST_KINDS = ("msgseq", "msglive", "msgexp")  # counters: read after everything else
_BATCH = 500


class BackupError(Exception):
    """A backup that cannot be made or restored (message safe to print)."""


@dataclass
class BackupReport:
    store: str  # "sqlite" or "redis"
    tenants: int
    entries: int  # registry entries
    keys: int = 0  # Redis keys written or read


# -- SQLite -----------------------------------------------------------------------------


def _sqlite_counts(conn: sqlite3.Connection) -> tuple[int, int]:
    tenants = conn.execute("SELECT COUNT(*) FROM tenants").fetchone()[0]
    entries = conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    return int(tenants), int(entries)


def backup_sqlite(db: Path, out: Path) -> BackupReport:
    """Copy the live database ``db`` to ``out`` (written whole, then renamed)."""
    if not db.is_file():
        raise BackupError(f"no SQLite store at {db}")
    part = out.with_name(out.name + ".part")
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        part.unlink(missing_ok=True)
        dst = sqlite3.connect(part)
        try:
            src.backup(dst)
            tenants, entries = _sqlite_counts(dst)
        finally:
            dst.close()
    finally:
        src.close()
    os.replace(part, out)
    return BackupReport("sqlite", tenants, entries)


def restore_sqlite(backup: Path, db: Path, force: bool = False) -> BackupReport:
    """Replace ``db`` by the backup (the service stopped); refuses a ``db`` that holds
    tenants unless ``force``."""
    with backup.open("rb") as fh:
        if fh.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise BackupError(f"{backup} is not a SQLite store backup")
    src = sqlite3.connect(f"file:{backup}?mode=ro", uri=True)
    try:
        if src.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            raise BackupError(f"{backup} fails SQLite's integrity check")
        tables = {r[0] for r in src.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if missing := [t for t in SQLITE_TABLES if t not in tables]:
            raise BackupError(f"{backup} is not a WorldCup store (no table {missing[0]})")
        dst = sqlite3.connect(db)
        try:
            present = {
                r[0] for r in dst.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            if "tenants" in present and _sqlite_counts(dst)[0] and not force:
                raise BackupError(f"{db} holds tenants: restore into an empty store, or --force")
            src.backup(dst)
            tenants, entries = _sqlite_counts(dst)
        finally:
            dst.close()
    finally:
        src.close()
    return BackupReport("sqlite", tenants, entries)


# -- Redis ------------------------------------------------------------------------------


def _client(url: str, cluster: bool, decode: bool = True) -> Any:
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, decode_responses=decode)
    from redis.asyncio import Redis

    return Redis.from_url(url, decode_responses=decode)


def _kind(rest: str) -> str:
    """The layout's kind of a key (its prefix removed): ``{t}:msgseq`` -> ``msgseq``;
    a durable probe record (``{t}:probe:cpayload-v1:...``) is ``probe-record``."""
    parts = rest.split(":")
    if rest.startswith("{"):
        tag_end = next(i for i, p in enumerate(parts) if p.endswith("}"))
        kind = parts[tag_end + 1] if tag_end + 1 < len(parts) else ""
        if kind == "probe" and tag_end + 2 < len(parts) and durable_probe_key(parts[tag_end + 2]):
            return "probe-record"
        return kind
    return parts[0]


async def _keys(client: Any, prefix: str) -> AsyncIterator[str]:
    async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        yield cast("str", key)


async def _read(client: Any, key: str, raw: Any = None) -> dict[str, Any] | None:
    """The key's record; ``raw`` (a client that does not decode): the key is a binary
    string, read through it and kept as base64 (type ``bytes``)."""
    kind = await client.type(key)
    value: Any
    if kind == "string" and raw is not None:
        data = await raw.get(key)
        kind, value = "bytes", None if data is None else base64.b64encode(data).decode()
    elif kind == "string":
        value = await client.get(key)
    elif kind == "hash":
        value = await client.hgetall(key)
    elif kind == "set":
        value = sorted(await client.smembers(key))
    elif kind == "zset":
        value = [[m, s] for m, s in await client.zrange(key, 0, -1, withscores=True)]
    elif kind == "list":
        value = await client.lrange(key, 0, -1)
    elif kind == "stream":
        value = [[i, f] for i, f in await client.xrange(key)]
    elif kind == "none":  # expired or deleted since the scan
        return None
    else:
        raise BackupError(f"unexpected Redis type {kind!r}")
    ttl = int(await client.pttl(key))
    if ttl == -2 or value is None:
        return None
    return {"type": kind, "ttl_ms": ttl, "value": value}


async def backup_redis(url: str, prefix: str, cluster: bool, out: Path) -> BackupReport:
    """Dump the namespace ``prefix`` to ``out`` (JSON lines, written whole, then renamed)."""
    check_prefix(prefix)
    client = _client(url, cluster)
    raw = _client(url, cluster, decode=False)
    part = out.with_name(out.name + ".part")
    report = BackupReport("redis", 0, 0)
    try:
        head = {"format": FORMAT, "version": VERSION, "store": "redis", "created_at": time.time()}
        last: list[str] = []
        with part.open("w", encoding="utf-8") as fh:
            fh.write(json.dumps(head) + "\n")

            async def dump(key: str) -> None:
                rest = key[len(prefix) + 1 :]
                kind = _kind(rest)
                record = await _read(client, key, raw if kind in _BINARY_KINDS else None)
                if record is None:
                    return
                report.keys += 1
                if kind == "tenant" and record["type"] == "hash":
                    report.tenants += 1
                elif kind == "msgs" and record["type"] == "hash":
                    report.entries += len(record["value"])
                fh.write(json.dumps({"key": rest, **record}, separators=(",", ":")) + "\n")

            async for key in _keys(client, prefix):
                kind = _kind(key[len(prefix) + 1 :])
                if kind in _SKIPPED_KINDS:
                    continue
                if kind in _LAST_KINDS:
                    last.append(key)
                    continue
                await dump(key)
            for key in last:
                await dump(key)
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
        await client.aclose()
        await raw.aclose()
    return report


def _write(pipe: Any, key: str, record: dict[str, Any]) -> None:
    kind, value = record["type"], record["value"]
    if kind == "string":
        pipe.set(key, value)
    elif kind == "bytes":
        pipe.set(key, base64.b64decode(value))
    elif kind == "hash":
        pipe.hset(key, mapping=value)
    elif kind == "set":
        pipe.sadd(key, *value)
    elif kind == "zset":
        pipe.zadd(key, {m: float(s) for m, s in value})
    elif kind == "list":
        pipe.rpush(key, *value)
    elif kind == "stream":
        for entry_id, fields in value:
            pipe.xadd(key, fields, id=entry_id)
    else:
        raise BackupError(f"unexpected type {kind!r} in the backup")
    if int(record["ttl_ms"]) > 0:
        pipe.pexpire(key, int(record["ttl_ms"]))


async def restore_redis(
    url: str, prefix: str, cluster: bool, backup: Path, force: bool = False
) -> BackupReport:
    """Write a dump into the namespace ``prefix``; refuses one that holds keys unless
    ``force`` (then they are deleted first). Run with the service stopped."""
    check_prefix(prefix)
    with backup.open(encoding="utf-8") as fh:
        try:
            head = json.loads(fh.readline() or "{}")
        except ValueError:
            head = {}
        if head.get("format") != FORMAT or head.get("store") != "redis":
            raise BackupError(f"{backup} is not a Redis store backup")
        if int(head.get("version", 0)) > VERSION:
            raise BackupError(f"{backup} has format version {head['version']}, newer than this")
        client = _client(url, cluster)
        report = BackupReport("redis", 0, 0)
        try:
            existing = [k async for k in _keys(client, prefix)]
            if existing and not force:
                raise BackupError(
                    f"the namespace {prefix!r} holds {len(existing)} keys: restore into an "
                    "empty one, or --force"
                )
            for i in range(0, len(existing), _BATCH):
                pipe = client.pipeline() if cluster else client.pipeline(transaction=False)
                for key in existing[i : i + _BATCH]:
                    pipe.delete(key)
                await pipe.execute()
            batch = 0
            pipe = client.pipeline() if cluster else client.pipeline(transaction=False)
            for line in fh:
                record = json.loads(line)
                rest = str(record["key"])
                _write(pipe, f"{prefix}:{rest}", record)
                report.keys += 1
                kind = _kind(rest)
                if kind == "tenant" and record["type"] == "hash":
                    report.tenants += 1
                elif kind == "msgs" and record["type"] == "hash":
                    report.entries += len(record["value"])
                batch += 1
                if batch >= _BATCH:
                    await pipe.execute()
                    pipe = client.pipeline() if cluster else client.pipeline(transaction=False)
                    batch = 0
            await pipe.execute()
        finally:
            await client.aclose()
    return report
