"""Where a scan's keys come from: key files, or the service's store (read-only).

A scan ships its keys to worker processes (and Ray actors), so they travel as
plain :class:`KeySpec` values: the unwrapped 32-byte secret plus the frozen
watermark configuration of that key version. Secrets never appear in a
``repr``, a log line or the output; the output names a key by its tenant and
version, or by the key file's name.

The store is touched only by the driver: :class:`StoreSession` lists tenants,
key versions, registry message ids and the recorded client-chosen payloads before
the scan, fetches registry metadata for hits and appends the audit record
afterwards. It never writes keys or registry entries.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.schemes import watermark_scheme
from worldcup_core import WatermarkKey, WorldCup

if TYPE_CHECKING:
    from app.stores.base import AuditRecord, RegistryEntry, Store


class KeySourceError(ValueError):
    """Keys could not be loaded (bad file, unreachable store, wrong master key)."""


@dataclass(frozen=True)
class KeySpec:
    """One key version, ready to rebuild its :class:`WorldCup` in any worker."""

    tenant_id: str  # the store's tenant id, or the key file's name
    tenant_name: str
    version: int
    secret: bytes = field(repr=False)
    groups: int = 2
    layers: int = 30
    alpha: float = 1.2
    context_width: int = 2
    scheme: str = "worldcup-v2"

    def __repr__(self) -> str:
        return f"KeySpec(tenant_id={self.tenant_id!r}, version={self.version})"

    def worldcup(self) -> WorldCup:
        return watermark_scheme(self.secret, self)


@dataclass(frozen=True)
class ScanKeys:
    """Every key a scan tries, and the registry message ids it can match against.

    ``registry[(tenant_id, version)][num_bits]`` lists the issued message ids;
    ``expired_below[tenant_id]``: every id below it is past the tenant's retention (its
    entry deleted), still a candidate so a text issued for it reads as expired, as the
    API's; ``num_bits`` is the payload length tried where there is no registry (key files).
    """

    keys: tuple[KeySpec, ...]
    registry: dict[tuple[str, int], dict[int, list[int]]] = field(default_factory=dict)
    num_bits: int | None = None
    source: str = "key files"
    expired_below: dict[str, int] = field(default_factory=dict)
    # client-chosen payloads (integers) recorded as candidates, as the service records
    # them: ``client_payloads[(tenant_id, version)][num_bits]``; a text matching one is
    # named by no entry (app.stores.client_payloads; the store's are read by
    # StoreSession.load_keys)
    client_payloads: dict[tuple[str, int], dict[int, list[int]]] = field(default_factory=dict)
    # the texts issued under each: ``client_uses[(tenant_id, version)][num_bits][payload]``,
    # the registry test's prior weight of the payload (absent or 0: weighs 1)
    client_uses: dict[tuple[str, int], dict[int, dict[int, int]]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"ScanKeys({len(self.keys)} keys from {self.source})"

    def fingerprint(self) -> str:
        """Identifies the key set for resuming (public key ids only, never secrets)."""
        h = hashlib.sha256()
        for k in self.keys:
            kid = WatermarkKey(k.secret).key_id
            h.update(f"{k.tenant_id}|{k.version}|{kid}|{k.scheme}|{k.groups}|{k.layers}\n".encode())
        for (tenant, version), lengths in sorted(self.registry.items()):
            for bits, ids in sorted(lengths.items()):
                h.update(f"r|{tenant}|{version}|{bits}|{len(ids)}|{max(ids, default=0)}\n".encode())
        for (tenant, version), lengths in sorted(self.client_payloads.items()):
            for bits, payloads in sorted(lengths.items()):
                h.update(f"c|{tenant}|{version}|{bits}|{sorted(payloads)}\n".encode())
        for (tenant, version), counted in sorted(self.client_uses.items()):
            for bits, uses in sorted(counted.items()):
                h.update(f"u|{tenant}|{version}|{bits}|{sorted(uses.items())}\n".encode())
        for tenant, below in sorted(self.expired_below.items()):
            h.update(f"e|{tenant}|{below}\n".encode())
        h.update(f"n|{self.num_bits}".encode())
        return h.hexdigest()[:16]

    def tenants(self) -> list[str]:
        return sorted({k.tenant_id for k in self.keys})


def keys_from_files(
    paths: Sequence[Path],
    scheme: str = "worldcup-v2",
    groups: int = 2,
    layers: int = 30,
    num_bits: int | None = None,
    context_width: int = 2,
) -> ScanKeys:
    """One key per file, labelled by the file's name (each file is its own "tenant")."""
    specs = []
    seen: set[str] = set()
    for path in paths:
        try:
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            raise KeySourceError(f"key file not found: {path}") from None
        except (OSError, UnicodeDecodeError):
            raise KeySourceError(f"key file is unreadable or not hex text: {path}") from None
        try:
            key = WatermarkKey.from_hex(text)
        except ValueError as exc:
            raise KeySourceError(f"malformed key file {path}: {exc}") from None
        label = path.name
        if label in seen:
            raise KeySourceError(f"two key files are named {label!r}; names label the output")
        seen.add(label)
        spec = KeySpec(
            label,
            label,
            1,
            key.secret,
            groups=groups,
            layers=layers,
            context_width=context_width,
            scheme=scheme,
        )
        try:
            spec.worldcup()
        except ValueError as exc:
            raise KeySourceError(str(exc)) from None
        specs.append(spec)
    return ScanKeys(tuple(specs), {}, num_bits, "key files")


def master_key_from_env(path: Path | None) -> bytes:
    """The master key: ``--master-key-file``, else WORLDCUP_MASTER_KEY(_FILE)."""
    if path is None and os.environ.get("WORLDCUP_MASTER_KEY_FILE"):
        path = Path(os.environ["WORLDCUP_MASTER_KEY_FILE"])
    if path is not None:
        try:
            raw = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            raise KeySourceError(f"master key file is unreadable: {path}") from None
    else:
        raw = os.environ.get("WORLDCUP_MASTER_KEY", "").strip()
        if not raw:
            raise KeySourceError(
                "the store needs the master key: --master-key-file or WORLDCUP_MASTER_KEY(_FILE)"
            )
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise KeySourceError("the master key must be 64 hex characters")
    return key


def open_store(
    url: str, redis_prefix: str = "wc", timeout_s: float = 5.0, cluster: bool = False
) -> Store:
    """``redis://…`` or ``rediss://…``, ``sqlite:///path`` or a plain path to a SQLite file.

    A SQLite file must exist: opening a missing one would create an empty store.
    """
    if url.startswith(("redis://", "rediss://", "unix://")):
        from app.stores.redis import RedisStore

        return RedisStore(url, prefix=redis_prefix, timeout_s=timeout_s, cluster=cluster)
    path = Path(url.removeprefix("sqlite://")) if url.startswith("sqlite://") else Path(url)
    if not path.is_file():
        raise KeySourceError(f"no SQLite store at {path}")
    from app.stores.sqlite import SQLiteStore

    return SQLiteStore(path, timeout_s=timeout_s)


class StoreSession:
    """Synchronous access to the async store for the (single-threaded) scan driver."""

    def __init__(self, store: Store, master_key: bytes) -> None:
        from app.core.security import KeyWrapper

        self.store = store
        self._wrapper = KeyWrapper(master_key)
        self._runner = asyncio.Runner()

    def __repr__(self) -> str:
        return f"StoreSession({self.store!r})"

    def _run(self, coro: Any) -> Any:
        from app.stores.base import StoreError

        try:
            return self._runner.run(coro)
        except StoreError as exc:
            raise KeySourceError(f"store unavailable: {exc}") from None

    def close(self) -> None:
        try:
            self._run(self.store.close())
        finally:
            self._runner.close()

    def load_keys(self, tenant: str | None = None) -> ScanKeys:
        """Every tenant's every key version (``tenant`` None), or one tenant's."""
        from app.core.security import KeyUnwrapError
        from app.stores.client_payloads import client_payload_uses, recorded_client_payloads

        tenants = {t.tenant_id: t for t in self._run(self.store.list_tenants())}
        if tenant is not None:
            found = tenants.get(tenant) or next(
                (t for t in tenants.values() if t.name == tenant), None
            )
            if found is None:
                raise KeySourceError(f"no tenant {tenant!r} in the store")
            records = self._run(self.store.key_versions(found.tenant_id))
        else:
            records = self._run(self.store.all_key_versions())
        specs = []
        registry: dict[tuple[str, int], dict[int, list[int]]] = {}
        expired_below: dict[str, int] = {}
        client_payloads: dict[tuple[str, int], dict[int, list[int]]] = {}
        client_uses: dict[tuple[str, int], dict[int, dict[int, int]]] = {}
        for r in records:
            try:
                secret = self._wrapper.unwrap(r.tenant_id, r.version, r.wrapped_key)
            except KeyUnwrapError as exc:
                raise KeySourceError(str(exc)) from None
            name = tenants[r.tenant_id].name if r.tenant_id in tenants else r.tenant_id
            specs.append(
                KeySpec(
                    r.tenant_id,
                    name,
                    r.version,
                    secret,
                    groups=r.groups,
                    layers=r.layers,
                    alpha=r.alpha,
                    context_width=r.context_width,
                    scheme=r.scheme,
                )
            )
            lengths = self._run(self.store.registry_bit_lengths(r.tenant_id, r.version))
            registry[(r.tenant_id, r.version)] = {
                bits: [
                    i
                    for i in self._run(self.store.message_ids(r.tenant_id, r.version, bits))
                    if i < 2**bits
                ]
                for bits in lengths
            }
            for bits in lengths[:1]:  # the retention's line is the tenant's, whatever the length
                size = self._run(self.store.registry_size(r.tenant_id, r.version, bits))
                below = max(expired_below.get(r.tenant_id, 0), size.expired_below)
                expired_below[r.tenant_id] = below
            # the payloads its clients chose, at the lengths the registry test runs at (as
            # the service's: a text under one is named as that payload, never an entry)
            chosen = self._run(
                recorded_client_payloads(self.store, r.tenant_id, r.version, lengths)
            )
            if chosen:
                client_payloads[(r.tenant_id, r.version)] = chosen
                client_uses[(r.tenant_id, r.version)] = {
                    bits: self._run(
                        client_payload_uses(self.store, r.tenant_id, r.version, bits, payloads)
                    )
                    for bits, payloads in chosen.items()
                }
        return ScanKeys(
            tuple(specs),
            registry,
            None,
            "store",
            expired_below,
            client_payloads=client_payloads,
            client_uses=client_uses,
        )

    def registry_entries(
        self, tenant_id: str, message_ids: list[int]
    ) -> list[RegistryEntry | None]:
        entries: list[RegistryEntry | None] = self._run(
            self.store.registry_entries(tenant_id, message_ids)
        )
        return entries

    def append_audit(self, record: AuditRecord) -> None:
        self._run(self.store.append_audit(record))
