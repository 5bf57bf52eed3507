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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from app.services.corpus import Fields, Part, RawRow, read_part
from worldcup_core import WorldCup
from worldcup_core.assess import Assessment, TestP, assess
from worldcup_core.decoder import DecodeResult, RegistryMatch
from worldcup_core.detector_weighted import (
    best_verdict_log_p,
    verdict_decode_many,
    verdict_match,
    verdict_text_cells,
    weighted_applies,
)
from worldcup_core.message import MessageIdCodec
from worldcup_core.provenance import KeyBank
from worldcup_core.registry_lookup import (
    count_weights,
    exhaustive_match,
    list_match,
    payload_list,
    use_list,
)
from worldcup_core.verdict import MIN_SCORED_TOKENS
from worldcup_scan.keys import ScanKeys

MODES = ("detect", "provenance")

# Output columns, in order (Parquet schema in :func:`arrow_schema`).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "string"),
    ("source", "string"),
    ("row", "int64"),
    ("is_watermarked", "bool"),
    ("verdict", "string"),  # worldcup_core.assess: the API's verdict for the same asker
    ("verdict_statistic", "string"),  # the test that decided
    # which statistic the tests took: model where the Scanner has the model's token
    # weights (`worldcup scan --with-model`, the forgery judge), else model_free (the
    # tokenizer only), as the API's answers say it (issue #44)
    ("statistic", "string"),
    ("reason", "string"),  # why inconclusive: too_short, some_evidence or no_agreement (as the API)
    ("tokens_needed", "int64"),  # scored tokens an inconclusive answer would need
    ("p_value", "float64"),  # the verdict's p-value, every correction included
    ("tenant_id", "string"),
    ("tenant_name", "string"),
    ("key_version", "int64"),
    ("message_id", "int64"),
    ("bits", "string"),
    ("registry_metadata", "string"),
    ("registry_issued_at", "string"),  # ISO-8601 UTC, as the API writes it
    # the registry test could name an entry but another fits almost as well: none named
    ("registry_ambiguous", "bool"),
    # the text matches an entry past the tenant's retention: issued by it, entry deleted
    ("registry_expired", "bool"),
    # the text matches a payload a client of the tenant chose, recorded as a candidate:
    # no entry named (as the API's registry_match.client_payload); ``bits`` decoded
    ("client_payload", "bool"),
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
    significance: float = 0.01  # deprecated: carries no threshold (verdicts use 1e-6)
    default_num_bits: int = 32  # the payload length decoded where there is no registry
    registry_min_confidence: float = 0.95
    # fewer scored tokens than this: flagged short_text (the verdict's own line, where
    # "not_watermarked" is not said: worldcup_core.verdict.MIN_SCORED_TOKENS)
    short_tokens: int = MIN_SCORED_TOKENS
    model: str | None = None  # tokenizer directory; None = the embedded SmolLM2's
    # weigh every test by the model's token weights, as a generator replica answers
    # (the model loaded from ``model``, one copy per worker); False: model-free
    with_model: bool = False

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
    """One key's candidates at one length, as the service's plan: the ids past the
    tenant's retention (1 .. expired_below - 1) first, then the live ids (ascending)."""

    codec: MessageIdCodec
    ids: npt.NDArray[np.uint64]  # live, ascending
    payloads: npt.NDArray[np.uint64]  # of the expired ids, then of the live ones
    expired: int  # how many expired ids lead ``payloads``
    expired_below: int
    client: npt.NDArray[np.uint64]  # recorded client-chosen payloads (no entry's)
    client_uses: npt.NDArray[np.int64]  # their texts, the registry test's prior weights

    def weights_for(self, payloads: npt.NDArray[np.uint64]) -> npt.NDArray[np.float64]:
        """Each payload's prior weight: a client payload's texts, else 1 (an entry)."""
        return count_weights(payloads, self.client, self.client_uses)

    @property
    def candidates(self) -> int:
        return int(self.ids.size) + self.expired + int(self.client.size)


@dataclass(frozen=True)
class _Decoded:
    result: DecodeResult
    match: RegistryMatch | None
    message_id: int | None  # the best candidate's, named only as scan_rows decides
    key_index: int
    expired: bool = False  # the best candidate is past the tenant's retention


@dataclass(frozen=True)
class _Assessed:
    assessment: Assessment
    key_index: int | None
    decoded: _Decoded | None
    scored: int


class Scanner:
    """Holds the tokenizer and the key bank of one worker; scans batches of rows."""

    def __init__(
        self,
        spec: ScanSpec,
        tokenizer: Any = None,
        token_weights: Callable[[list[list[int]]], list[npt.NDArray[np.float64]]] | None = None,
    ) -> None:
        """``token_weights``: the served model's weights of a batch of texts
        (:func:`worldcup_core.model_weights.model_token_weights` over a loaded model), for
        the model statistic in every test, as the API's generator replicas answer; None:
        model-free, as the detector role's."""
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker
        if token_weights is None and spec.with_model:
            tokenizer, token_weights = _model_weights(spec.model)
        if tokenizer is None:
            tokenizer = _tokenizer(spec.model)
        self.spec = spec
        self.tokenizer = tokenizer
        self.token_weights = token_weights
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
        weights: list[npt.NDArray[np.float64] | None] = [None] * len(ids)
        if self.token_weights is not None:
            weighed = [j for j, t in enumerate(ids) if t and out[good[j]]["error"] is None]
            for j, w in zip(weighed, self.token_weights([ids[j] for j in weighed]), strict=True):
                weights[j] = w
        for j, text_ids in enumerate(ids):
            row = out[good[j]]
            if row["error"] is not None:
                continue
            found = self._assess(text_ids, weights[j])
            said = found.assessment
            model = weights[j] is not None and any(weighted_applies(s.config) for s in self.schemes)
            row.update(
                is_watermarked=said.is_watermarked,
                verdict=said.verdict,
                verdict_statistic=said.statistic,
                statistic="model" if model else "model_free",
                reason=said.reason,
                tokens_needed=said.tokens_needed,
                p_value=said.p_value,
                num_tokens=len(text_ids),
                num_scored_tokens=found.scored,
                short_text=found.scored < self.spec.short_tokens,
                registry_ambiguous=False,
                registry_expired=False,
                client_payload=False,
            )
            if said.is_watermarked and found.key_index is not None:
                spec = self.spec.keys.keys[found.key_index]
                row.update(
                    tenant_id=spec.tenant_id, tenant_name=spec.tenant_name, key_version=spec.version
                )
                decoded = found.decoded
                if decoded is not None:
                    row["bits"] = decoded.result.bits
                    if said.may_name_entry and decoded.match is not None:
                        if decoded.match.posterior < self.spec.registry_min_confidence:
                            row["registry_ambiguous"] = True  # as the API's
                        elif decoded.expired:  # as the API's registry_expired
                            row["registry_expired"] = True
                        elif decoded.message_id is None:  # a recorded client payload
                            row["client_payload"] = True
                        else:
                            row["message_id"] = decoded.message_id
        return out

    # ------------------------------------------------------------------ scoring
    def _assess(self, ids: list[int], weights: npt.NDArray[np.float64] | None = None) -> _Assessed:
        """The text's one verdict, as the service gives it to the same asker
        (:func:`worldcup_core.assess.assess`, fed the same tests): in detect mode the
        tenant's versions, in provenance mode every key of the bank; with the text's
        model ``weights``, every test model-weighted where the scheme allows."""
        ws = None if weights is None else [weights]
        if self.spec.mode == "detect":
            indices = list(range(len(self.schemes)))
            per_key = [self.schemes[i].detect(ids, None, self.spec.significance) for i in indices]
            best = min(indices, key=lambda i: (per_key[i].log10_p_value, i))
            scored = per_key[0].num_scored_tokens
            tried = len(indices)
            searched = f"{self.spec.keys.source}: {tried} key version(s)"
        else:
            assert self.bank is not None
            result = self.bank.search(ids)
            tried, scored = max(result.num_keys, 1), result.num_scored_tokens
            searched = f"every key in the bank ({result.num_keys} keys)"
            if result.best is None:
                none = assess([TestP("detect", None)], tried, searched, scored)
                return _Assessed(none, None, None, 0)
            best = result.best.index
            indices = [best]
        schemes = [self.schemes[i] for i in indices]  # the verdict's statistics: as the service
        detect_p = math.exp(float(best_verdict_log_p(schemes, [ids], None, ws)[0][0]))
        issued = sorted({b for i in indices for b in self._registry(i)})
        lengths = self.payload_lengths(indices)
        tests = [TestP("detect", detect_p, key_version=best)]
        chosen: _Decoded | None = None
        for num_bits in lengths:
            decoded = self._decode(indices, ids, num_bits, weights)
            known = float(best_verdict_log_p(schemes, [ids], num_bits, ws)[0][0])
            tests.append(TestP("decode", math.exp(known), num_bits))
            if num_bits in issued:
                p = decoded.match.p_value if decoded.match is not None else None
                tests.append(TestP("registry", p, num_bits))
            if chosen is None or _better(decoded, chosen):
                chosen = decoded
        said = assess(tests, tried, searched, scored)
        key_index = chosen.key_index if chosen is not None else best
        return _Assessed(said, key_index, chosen, scored)

    # ------------------------------------------------------------------ payload and registry
    def payload_lengths(self, indices: list[int]) -> list[int]:
        """The payload lengths the verdict decodes at for these keys: those their
        registries hold entries at, else the spec's default length."""
        issued = sorted({b for i in indices for b in self._registry(i)})
        return issued or [self.spec.keys.num_bits or self.spec.default_num_bits]

    def _registry(self, key_index: int) -> dict[int, list[int]]:
        spec = self.spec.keys.keys[key_index]
        return self.spec.keys.registry.get((spec.tenant_id, spec.version), {})

    def _registry_of(self, key_index: int, num_bits: int) -> _Registry:
        """The key's registry at this payload length: ids (ascending) and their payloads
        (the vectorised codec), made once per scan."""
        cached = self._candidates.get((key_index, num_bits))
        if cached is None:
            ids = self._registry(key_index).get(num_bits, [])
            codec = MessageIdCodec(self.schemes[key_index].key, num_bits)
            ordered = np.unique(np.asarray(ids, dtype=np.uint64))
            tenant = self.spec.keys.keys[key_index].tenant_id
            below = self.spec.keys.expired_below.get(tenant, 0)
            expired = np.arange(1, min(max(below, 1), codec.capacity), dtype=np.uint64)
            payloads = np.concatenate([codec.payload_ints(expired), codec.payload_ints(ordered)])
            at = (tenant, self.spec.keys.keys[key_index].version)
            chosen = self.spec.keys.client_payloads.get(at, {}).get(num_bits, [])
            client = np.setdiff1d(np.asarray(chosen, dtype=np.uint64), payloads)
            uses = self.spec.keys.client_uses.get(at, {}).get(num_bits, {})
            counts = np.asarray([uses.get(int(x), 0) for x in client], dtype=np.int64)
            cached = _Registry(codec, ordered, payloads, int(expired.size), below, client, counts)
            self._candidates[(key_index, num_bits)] = cached
        return cached

    def _match(
        self,
        key_index: int,
        ids: list[int],
        num_bits: int,
        weights: npt.NDArray[np.float64] | None = None,
    ) -> tuple[RegistryMatch, int | None, bool] | None:
        """The registry's best entry for the text, its id (None: a recorded client
        payload) and whether it is past the retention: exhaustive for a small registry,
        else by list decoding (see :mod:`worldcup_core.registry_lookup`); expired ids
        stay candidates, as the API's."""
        registry = self._registry_of(key_index, num_bits)
        size = registry.candidates
        if size == 0:
            return None
        scheme = self.schemes[key_index]
        cells = verdict_text_cells(scheme, ids, num_bits, weights)
        if not use_list(num_bits, size):
            payloads = np.concatenate([registry.payloads, registry.client])
            match = exhaustive_match(cells, payloads, size, registry.weights_for(payloads))
            if match is None:
                return None
            if match.index >= registry.payloads.size:  # a client payload: no entry
                return verdict_match(scheme, ids, match, size, weights), None, False
            expired = match.index < registry.expired
            message_id = (
                match.index + 1 if expired else int(registry.ids[match.index - registry.expired])
            )
            # the registry test the verdict takes, as the service's (layer-weighted)
            return verdict_match(scheme, ids, match, size, weights), message_id, expired
        plist = payload_list(cells)
        listed = registry.codec.message_id_ints(plist.payloads)
        live = np.zeros(listed.shape, dtype=bool)
        if registry.ids.size:
            at = np.minimum(np.searchsorted(registry.ids, listed), registry.ids.size - 1)
            live = registry.ids[at] == listed
        gone = (listed >= 1) & (listed < registry.expired_below) & ~live
        chosen = np.isin(plist.payloads, registry.client) & ~live & ~gone
        prior = np.where(chosen, registry.weights_for(plist.payloads), 1.0)
        found = list_match(cells, plist, listed, live | chosen, gone, size, prior)
        if found is None:
            return None
        named = None if chosen[found.match.index] else found.message_id
        return verdict_match(scheme, ids, found.match, size, weights), named, found.expired

    def _decode(
        self,
        indices: list[int],
        ids: list[int],
        num_bits: int,
        weights: npt.NDArray[np.float64] | None = None,
    ) -> _Decoded:
        """As the service's decode_texts: decode under each key, keep the most
        significant, and match it against that key's registry at this length."""
        best_index, best_result = indices[0], None
        for i in indices:
            result = verdict_decode_many(
                self.schemes[i],
                [ids],
                num_bits,
                None if weights is None else [weights],
                significance=self.spec.significance,
            )[0]
            if best_result is None or (
                result.detection.log10_p_value < best_result.detection.log10_p_value
            ):
                best_index, best_result = i, result
        assert best_result is not None
        matched = self._match(best_index, ids, num_bits, weights)
        if matched is None:
            return _Decoded(best_result, None, None, best_index)
        match, message_id, expired = matched
        return _Decoded(best_result, match, message_id, best_index, expired)


_TOKENIZERS: dict[str | None, Any] = {}


def _tokenizer(model: str | None) -> Any:
    """One tokenizer per process and model: loading one costs seconds, a scan reuses it."""
    if model not in _TOKENIZERS:
        from worldcup_core.models import load_tokenizer

        _TOKENIZERS[model] = load_tokenizer(model)
    return _TOKENIZERS[model]


def _model_weights(
    model: str | None,
) -> tuple[Any, Callable[[list[list[int]]], list[npt.NDArray[np.float64]]]]:
    """The model's tokenizer and its token weights for a batch of texts, as the service's
    HF engine computes them (windows of 2 048 tokens, the forward passes in float32 on
    the CPU unless bfloat16 is native there); one model per worker process."""
    import torch

    from worldcup_core.model_weights import weights_model, windowed_token_weights
    from worldcup_core.models import load_model

    torch.set_num_threads(1)  # one core per worker, as the tokenizers
    lm = load_model(model)
    weigher = weights_model(lm.model)

    def weigh(texts: list[list[int]]) -> list[npt.NDArray[np.float64]]:
        with torch.inference_mode():
            return windowed_token_weights(weigher, texts, pad_token_id=lm.pad_token_id)

    return lm.tokenizer, weigh


def _better(a: _Decoded, b: _Decoded) -> bool:
    """As the service's provenance: a registry match first, then the more significant."""
    if a.match is not None and b.match is not None and a.match.p_value != b.match.p_value:
        return a.match.p_value < b.match.p_value
    return a.result.detection.log10_p_value < b.result.detection.log10_p_value


def _empty(row: RawRow) -> dict[str, Any]:
    out: dict[str, Any] = {name: None for name, _ in COLUMNS}
    out.update(id=row.id, source=row.source, row=row.row, error=row.error)
    return out
