"""The per-batch scan function: tokenizer and key bank loaded once, then batch after batch.

:class:`Scanner` is what a local worker process and a Ray actor both hold, so
the two engines cannot disagree. Scoring stays in :mod:`worldcup_core`:

* ``detect`` mode mirrors ``POST /detect``: the message-free test under each of
  one tenant's key versions (vectorised over the batch's texts under v2), the
  best version Bonferroni-corrected for the number of versions.
* ``provenance`` mode mirrors ``POST /provenance``: :meth:`KeyBank.search` over
  every tenant and key version (vectorised over keys), Šidák-corrected for the
  size of the bank.

A significant text is then decoded under its best key, at every payload length
that key's registry holds, and matched against the registry as ``/decode``
does: a message id is reported only when the match is significant and its
posterior is at least ``registry_min_confidence``.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from app.core.corpus import Fields, Part, RawRow, read_part
from worldcup_core import WorldCup
from worldcup_core.decoder import DecodeResult, RegistryMatch
from worldcup_core.message import MessageIdCodec
from worldcup_core.provenance import KeyBank
from worldcup_core.registry_lookup import (
    exhaustive_match,
    list_match,
    payload_list,
    text_cells,
    use_list,
)
from worldcup_core.verdict import verdict_of
from worldcup_scan.keys import ScanKeys

MODES = ("detect", "provenance")

# Output columns, in order (Parquet schema in :func:`arrow_schema`).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "string"),
    ("source", "string"),
    ("row", "int64"),
    ("is_watermarked", "bool"),
    ("verdict", "string"),  # worldcup_core.verdict.verdict_of(p_value), as the API's
    ("p_value", "float64"),
    ("tenant_id", "string"),
    ("tenant_name", "string"),
    ("key_version", "int64"),
    ("message_id", "int64"),
    ("bits", "string"),
    ("registry_metadata", "string"),
    ("registry_issued_at", "string"),  # ISO-8601 UTC, as the API writes it
    ("num_tokens", "int64"),
    ("num_scored_tokens", "int64"),
    ("short_text", "bool"),
    ("error", "string"),
)


def iso_utc(timestamp: float) -> str:
    """A Unix time as ISO-8601 UTC with a ``Z`` (the API's form: ``2026-11-26T03:00:00Z``)."""
    moment = dt.datetime.fromtimestamp(timestamp, tz=dt.UTC)
    return moment.isoformat().replace("+00:00", "Z")


def arrow_schema() -> Any:
    import pyarrow as pa

    types = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64()}
    types["bool"] = pa.bool_()
    return pa.schema([(name, types[t]) for name, t in COLUMNS])


@dataclass(frozen=True)
class ScanSpec:
    """Everything a worker needs; picklable (it travels to processes and Ray actors)."""

    keys: ScanKeys
    mode: str = "provenance"
    fields: Fields = field(default_factory=Fields)
    significance: float = 0.01
    registry_min_confidence: float = 0.95
    short_tokens: int = 64  # fewer scored tokens than this: flagged short_text
    model: str | None = None  # tokenizer directory; None = the embedded SmolLM2's

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be detect or provenance, got {self.mode!r}")
        if not 0.0 < self.significance < 1.0:
            raise ValueError(f"significance must be in (0, 1), got {self.significance}")
        if not self.keys.keys:
            raise ValueError("no keys to scan with")
        if self.mode == "detect" and len(self.keys.tenants()) != 1:
            raise ValueError("detect mode takes one tenant's keys (or one key file)")


@dataclass(frozen=True)
class _Registry:
    codec: MessageIdCodec
    ids: npt.NDArray[np.uint64]
    payloads: npt.NDArray[np.uint64]


@dataclass(frozen=True)
class _Decoded:
    result: DecodeResult
    match: RegistryMatch | None
    message_id: int | None


class Scanner:
    """Holds the tokenizer and the key bank of one worker; scans batches of rows."""

    def __init__(self, spec: ScanSpec, tokenizer: Any = None) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker
        if tokenizer is None:
            tokenizer = _tokenizer(spec.model)
        self.spec = spec
        self.tokenizer = tokenizer
        self.schemes: list[WorldCup] = [k.worldcup() for k in spec.keys.keys]
        self.bank = KeyBank(self.schemes) if spec.mode == "provenance" else None
        self._candidates: dict[tuple[int, int], _Registry] = {}

    def __repr__(self) -> str:
        return f"Scanner({self.spec.mode}, {len(self.schemes)} keys)"

    # ------------------------------------------------------------------ entry points
    def scan_part(self, part: Part) -> list[dict[str, Any]]:
        return self.scan_rows(read_part(part, self.spec.fields))

    def scan_rows(self, rows: Sequence[RawRow]) -> list[dict[str, Any]]:
        """One result per row, in order; bad rows carry their error and no verdict."""
        out = [_empty(r) for r in rows]
        good = [i for i, r in enumerate(rows) if r.text is not None]
        if not good:
            return out
        texts = [rows[i].text or "" for i in good]
        try:
            ids: list[list[int]] = self.tokenizer(texts, add_special_tokens=False).input_ids
        except Exception:  # one undecodable text must not lose the batch: retry one by one
            ids = []
            for j, text in enumerate(texts):
                try:
                    ids.append(self.tokenizer(text, add_special_tokens=False).input_ids)
                except Exception:
                    ids.append([])
                    out[good[j]]["error"] = "untokenizable: the tokenizer rejected the text"
        verdicts = self._detect(ids) if self.spec.mode == "detect" else self._provenance(ids)
        for j, (p_value, key_index, scored) in enumerate(verdicts):
            row = out[good[j]]
            if row["error"] is not None:
                continue
            significant = key_index is not None and p_value < self.spec.significance
            row.update(
                is_watermarked=significant,
                verdict=verdict_of(p_value),
                p_value=p_value,
                num_tokens=len(ids[j]),
                num_scored_tokens=scored,
                short_text=scored < self.spec.short_tokens,
            )
            if significant and key_index is not None:
                spec = self.spec.keys.keys[key_index]
                row.update(
                    tenant_id=spec.tenant_id, tenant_name=spec.tenant_name, key_version=spec.version
                )
                decoded = self._decode(key_index, ids[j])
                if decoded is not None:
                    row["bits"] = decoded.result.bits
                    row["message_id"] = decoded.message_id
        return out

    # ------------------------------------------------------------------ scoring
    def _detect(self, ids: list[list[int]]) -> list[tuple[float, int | None, int]]:
        """Each version's message-free test, the best Bonferroni-corrected (as /detect)."""
        per_version = [s.detect_many(ids, None, self.spec.significance) for s in self.schemes]
        log_p = np.array([[d.log10_p_value for d in v] for v in per_version])  # (V, texts)
        best = np.argmin(log_p, axis=0)
        versions = len(self.schemes)
        out = []
        for j in range(len(ids)):
            b = int(best[j])
            corrected = min(float(log_p[b, j]) * math.log(10.0) + math.log(versions), 0.0)
            scored = per_version[0][j].num_scored_tokens
            out.append((math.exp(corrected), b if scored else None, scored))
        return out

    def _provenance(self, ids: list[list[int]]) -> list[tuple[float, int | None, int]]:
        assert self.bank is not None
        out = []
        for t in ids:
            result = self.bank.search(t)
            best = result.best.index if result.best is not None else None
            out.append((result.p_value, best, result.num_scored_tokens))
        return out

    # ------------------------------------------------------------------ payload and registry
    def _registry(self, key_index: int, num_bits: int) -> _Registry:
        """The key's registry at this payload length: ids (ascending) and their payloads
        (the vectorised codec), made once per scan."""
        cached = self._candidates.get((key_index, num_bits))
        if cached is None:
            spec = self.spec.keys.keys[key_index]
            ids = self.spec.keys.registry.get((spec.tenant_id, spec.version), {}).get(num_bits, [])
            codec = MessageIdCodec(self.schemes[key_index].key, num_bits)
            ordered = np.unique(np.asarray(ids, dtype=np.uint64))
            cached = _Registry(codec, ordered, codec.payload_ints(ordered))
            self._candidates[(key_index, num_bits)] = cached
        return cached

    def _match(
        self, key_index: int, ids: list[int], num_bits: int
    ) -> tuple[RegistryMatch, int] | None:
        """The registry's best entry for the text, and its id: exhaustive for a small
        registry, else by list decoding (see :mod:`worldcup_core.registry_lookup`)."""
        registry = self._registry(key_index, num_bits)
        size = int(registry.ids.size)
        if size == 0:
            return None
        scheme = self.schemes[key_index]
        ones, trials, _ = scheme.evidence(ids).cells(scheme.config.symbols_for(num_bits))
        cells = text_cells(ones, trials, num_bits)
        if not use_list(num_bits, size):
            match = exhaustive_match(cells, registry.payloads, size)
            return None if match is None else (match, int(registry.ids[match.index]))
        plist = payload_list(cells)
        listed = registry.codec.message_id_ints(plist.payloads)
        at = np.minimum(np.searchsorted(registry.ids, listed), size - 1)
        live = registry.ids[at] == listed
        found = list_match(cells, plist, listed, live, np.zeros_like(live), size)
        return None if found is None else (found.match, found.message_id)

    def _decode(self, key_index: int, ids: list[int]) -> _Decoded | None:
        """The payload under the best key at each registry payload length; the best match."""
        spec = self.spec.keys.keys[key_index]
        registry = self.spec.keys.registry.get((spec.tenant_id, spec.version), {})
        lengths = sorted(registry) or ([self.spec.keys.num_bits] if self.spec.keys.num_bits else [])
        scheme = self.schemes[key_index]
        best: _Decoded | None = None
        for num_bits in lengths:
            result = scheme.decode(ids, num_bits, significance=self.spec.significance)
            matched = self._match(key_index, ids, num_bits)
            match = matched[0] if matched is not None else None
            message_id = None
            if (
                matched is not None
                and matched[0].p_value < self.spec.significance
                and matched[0].posterior >= self.spec.registry_min_confidence
            ):
                message_id = matched[1]
            decoded = _Decoded(result, match, message_id)
            if best is None or _better(decoded, best):
                best = decoded
        return best


_TOKENIZERS: dict[str | None, Any] = {}


def _tokenizer(model: str | None) -> Any:
    """One tokenizer per process and model: loading one costs seconds, a scan reuses it."""
    if model not in _TOKENIZERS:
        from worldcup_core.models import load_tokenizer

        _TOKENIZERS[model] = load_tokenizer(model)
    return _TOKENIZERS[model]


def _better(a: _Decoded, b: _Decoded) -> bool:
    """As the service's provenance: a registry match first, then the more significant."""
    if (a.message_id is None) != (b.message_id is None):
        return a.message_id is not None
    if a.match is not None and b.match is not None and a.match.p_value != b.match.p_value:
        return a.match.p_value < b.match.p_value
    return a.result.detection.log10_p_value < b.result.detection.log10_p_value


def _empty(row: RawRow) -> dict[str, Any]:
    out: dict[str, Any] = {name: None for name, _ in COLUMNS}
    out.update(id=row.id, source=row.source, row=row.row, error=row.error)
    return out
