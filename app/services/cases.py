"""Console cases: every check an analyst runs in ``/console`` is saved, can be reopened
by its link, listed, exported (JSON, CSV) and deleted; batches of texts become one
case per text.

A case records who ran the check (the admin, or an API key by id and name, never its
secret), when, the mode (provenance, decode, detect), the verdict with the statistic
it was taken from (:mod:`worldcup_core.verdict`) and a summary of the evidence; the
text's SHA-256 always, the text itself only when the analyst asks for it. A check
runs through the very services the API routes use (:mod:`app.services.provenance`,
:mod:`app.services.detection`), so scopes, detail levels, rate limits, probe budgets
and the audit log apply to it as to the same API call.

Access: a tenant's keys see and open that tenant's cases; the admin sees every
case. Any other caller gets the same 404 as for a case that does not exist. Cases
expire after ``console_case_retention_days`` (0: kept until deleted); deleting one
deletes its text.

A batch (CSV or JSONL) is read in memory with :mod:`app.services.corpus`, the reader
of ``worldcup scan`` (same formats, same ``--text-field`` check, same per-row errors),
and its good rows are checked together through the bulk services (``decode_batch``,
``detect_batch``, ``provenance_batch``), each with a single check's verdict; beyond
``console_batch_limit`` texts the answer points to ``worldcup scan``.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from app.core.errors import APIError
from app.schemas.exposure import (
    FULL_ANSWERS_SPENT,
    DecodeVerdict,
    DetectVerdict,
    ProvenanceVerdict,
)
from app.schemas.watermark import (
    BatchItemError,
    DecodeBatchRequest,
    DecodeBatchResponse,
    DecodeRequest,
    DecodeResponse,
    DetectBatchRequest,
    DetectBatchResponse,
    DetectRequest,
    DetectResponse,
    ProvenanceRequest,
    ProvenanceResponse,
)
from app.services import detection
from app.services import provenance as search
from app.services.corpus import Fields, InputError, RawRow, read_bytes
from app.services.provenance import Investigator
from app.services.runtime import Runtime, charge
from app.services.tenants import Principal
from app.stores.base import CaseRecord
from worldcup_core.verdict import STATISTICS, Statistic, verdict_sentence

Mode = Literal["provenance", "decode", "detect"]
MODES: tuple[Mode, ...] = ("provenance", "decode", "detect")
Answer = (
    ProvenanceResponse
    | ProvenanceVerdict
    | DecodeResponse
    | DecodeVerdict
    | DetectResponse
    | DetectVerdict
)

_CASE_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
_LIST_LIMIT = 1000

# CSV columns of an export, in order (one row per case).
CSV_COLUMNS = (
    "case_id",
    "created_at",
    "role",
    "tenant_id",
    "tenant_name",
    "key_id",
    "key_name",
    "mode",
    "verdict",
    "statistic",
    "p_value",
    "matched_tenant",
    "key_version",
    "message_id",
    "issued_at",
    "num_tokens",
    "num_scored_tokens",
    "islands",
    "text_sha256",
    "num_chars",
    "text_kept",
    "batch_id",
    "source",
    "row",
    "text",
)


@dataclass(frozen=True)
class Analyst:
    """Who uses the console: the admin token, or a tenant API key (``principal``)."""

    principal: Principal | None  # None: the admin

    @property
    def is_admin(self) -> bool:
        return self.principal is None

    @property
    def tenant_id(self) -> str | None:
        return None if self.principal is None else self.principal.tenant.tenant_id

    def who(self) -> dict[str, Any]:
        """The case's "who": ids and names only, never a secret."""
        if self.principal is None:
            return {"role": "admin", "tenant_id": None, "tenant_name": None}
        p = self.principal
        return {
            "role": "api_key",
            "tenant_id": p.tenant.tenant_id,
            "tenant_name": p.tenant.name,
            "key_id": p.key.key_id,
            "key_name": p.key.name,
            "detail": p.key.detail,
        }


def iso(at: float | None) -> str | None:
    if at is None:
        return None
    return dt.datetime.fromtimestamp(at, tz=dt.UTC).isoformat().replace("+00:00", "Z")


def _missing_scope(scope: str) -> APIError:
    return APIError(
        403,
        f"this API key lacks the '{scope}' scope; an admin can issue a key with it",
        "missing_scope",
    )


def _not_found(case_id: str) -> APIError:
    # the same answer for a case that does not exist and for another tenant's case
    return APIError(404, f"no case {case_id!r}", "case_not_found")


# --------------------------------------------------------------------------- checking
def _check_mode(analyst: Analyst, mode: Mode) -> None:
    """The checks the mode's API route makes of the key (the admin searches only)."""
    p = analyst.principal
    if p is None:
        if mode != "provenance":
            raise APIError(
                403,
                f"{mode} checks a tenant's own keys: use an API key (the admin token "
                "searches every tenant with provenance)",
                "admin_has_no_tenant",
            )
    elif mode not in p.scopes:
        raise _missing_scope(mode)


def _investigator(analyst: Analyst) -> Investigator:
    p = analyst.principal
    if p is None:
        return Investigator("admin", True)
    return Investigator(f"tenant:{p.tenant.tenant_id}", False, p)


async def _answer(runtime: Runtime, analyst: Analyst, mode: Mode, text: str) -> Answer:
    """The mode's service call, with the checks its API route's dependencies make
    (scope, then one rate token for a tenant key; the admin is unmetered)."""
    _check_mode(analyst, mode)
    p = analyst.principal
    if p is not None:
        await charge(runtime, p.tenant)
    if mode == "provenance":
        return await search.provenance(
            runtime,
            _investigator(analyst),
            ProvenanceRequest(text=text, include_token_scores=False, evidence=p is None),
        )
    assert p is not None  # _check_mode: the admin has no decode or detect
    if mode == "decode":
        analyst_key = p.key.detail == "full" and "provenance" in p.scopes
        return await detection.decode(runtime, p, DecodeRequest(text=text, evidence=analyst_key))
    return await detection.detect(runtime, p, DetectRequest(text=text))


def _islands(evidence: Any) -> list[dict[str, Any]]:
    if evidence is None or not evidence.matched:
        return []
    return [
        {"start": i.start, "end": i.end, "mean_z": round(i.mean_z, 3)} for i in evidence.islands
    ]


def summarise(mode: Mode, answer: Answer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the verdict fields, the evidence summary) of an answer, for the case."""
    statistic: Statistic
    summary: dict[str, Any] = {}
    if isinstance(answer, ProvenanceVerdict | DetectVerdict | DecodeVerdict):
        # verdict keys: the word only, and not which test decided
        statistic = "withheld"
        if isinstance(answer, ProvenanceVerdict):
            summary["matched_tenant"] = answer.tenant_id
        if isinstance(answer, DecodeVerdict) and answer.registry_match is not None:
            hit = answer.registry_match
            summary.update(
                message_id=hit.message_id,
                issued_at=iso(hit.issued_at.timestamp() if hit.issued_at else None),
                client_payload=hit.client_payload,
                metadata=hit.metadata,
            )
        spent = answer.detail_reason == "full_answers_spent"
        verdict: dict[str, Any] = {
            "verdict": answer.verdict,
            "statistic": statistic,
            "p_value": None,
            "sentence": verdict_sentence(answer.verdict, statistic, None),
            "why": FULL_ANSWERS_SPENT if spent else STATISTICS[statistic],
        }
        return verdict, summary
    statistic = answer.verdict_statistic
    if isinstance(answer, ProvenanceResponse):
        summary.update(num_keys=answer.num_keys, num_tenants=answer.num_tenants)
        if answer.match is not None:
            m = answer.match
            summary.update(
                matched_tenant=m.tenant_id,
                matched_tenant_name=m.tenant_name,
                key_version=m.key_version,
                bits=m.bits,
            )
            entry = m.registry_entry
            if entry is not None:
                summary.update(
                    message_id=entry.message_id,
                    issued_at=iso(entry.issued_at.timestamp() if entry.issued_at else None),
                    client_payload=entry.client_payload,
                    metadata=entry.metadata,
                )
    elif isinstance(answer, DecodeResponse):
        summary.update(key_version=answer.key_version, bits=answer.bits)
        if answer.registry_match is not None:
            e = answer.registry_match
            summary.update(
                message_id=e.message_id,
                issued_at=iso(e.issued_at.timestamp() if e.issued_at else None),
                metadata=e.metadata,
                client_payload=e.client_payload,
            )
    else:
        summary.update(key_version=answer.key_version)
    summary.update(num_tokens=answer.num_tokens, num_scored_tokens=answer.num_scored_tokens)
    if not isinstance(answer, DetectResponse):
        summary["islands"] = _islands(answer.evidence)
    scored = answer.num_scored_tokens
    verdict_fields: dict[str, Any] = {
        "verdict": answer.verdict,
        "reason": answer.reason,
        "statistic": statistic,
        "p_value": answer.p_value,
        "sentence": verdict_sentence(answer.verdict, statistic, answer.p_value, scored),
        "why": f"{STATISTICS[statistic]}; keys searched: {answer.keys_searched}",
    }
    return verdict_fields, summary


def _expires_at(runtime: Runtime, now: float) -> float | None:
    days = runtime.settings.console_case_retention_days
    return None if days <= 0 else now + days * 86_400.0


def new_case(
    runtime: Runtime,
    analyst: Analyst,
    mode: Mode,
    text: str,
    keep_text: bool,
    verdict: dict[str, Any],
    summary: dict[str, Any],
    batch_id: str | None = None,
    source: dict[str, Any] | None = None,
) -> CaseRecord:
    now = time.time()
    case_id = record_id(12)
    expires = _expires_at(runtime, now)
    record = {
        "case_id": case_id,
        "created_at": iso(now),
        "expires_at": iso(expires),
        "who": analyst.who(),
        "mode": mode,
        **verdict,
        "summary": summary,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "num_chars": len(text),
        "text_kept": keep_text,
        "batch_id": batch_id,
        "source": source,
    }
    return CaseRecord(
        case_id=case_id,
        created_at=now,
        tenant_id=analyst.tenant_id,
        record=record,
        text=text if keep_text else None,
        batch_id=batch_id,
        expires_at=expires,
    )


async def check(
    runtime: Runtime, analyst: Analyst, mode: Mode, text: str, keep_text: bool
) -> tuple[dict[str, Any], Answer]:
    """Run one console check as its API route would, save it as a case; (case, answer)."""
    answer = await _answer(runtime, analyst, mode, text)
    verdict, summary = summarise(mode, answer)
    case = new_case(runtime, analyst, mode, text, keep_text, verdict, summary)
    await runtime.store.put_case(case)
    return case_view(case), answer


def case_view(case: CaseRecord) -> dict[str, Any]:
    """What the console and the exports show of a case."""
    return {**case.record, "text": case.text}


# --------------------------------------------------------------------------- access
def _visible(analyst: Analyst, case: CaseRecord) -> bool:
    return analyst.is_admin or case.tenant_id == analyst.tenant_id


async def get(runtime: Runtime, analyst: Analyst, case_id: str) -> dict[str, Any]:
    if not _CASE_ID.match(case_id):
        raise _not_found(case_id)
    case = await runtime.store.get_case(case_id, time.time())
    if case is None or not _visible(analyst, case):
        raise _not_found(case_id)
    return case_view(case)


async def history(
    runtime: Runtime, analyst: Analyst, limit: int, batch_id: str | None = None
) -> list[dict[str, Any]]:
    """Newest first: the tenant's cases for a tenant key, every case for the admin."""
    if batch_id is not None and not _CASE_ID.match(batch_id):
        return []
    cases = await runtime.store.list_cases(
        analyst.tenant_id, batch_id, min(max(1, limit), _LIST_LIMIT), time.time()
    )
    return [case_view(c) for c in cases if _visible(analyst, c)]


async def delete(runtime: Runtime, analyst: Analyst, case_id: str) -> None:
    await get(runtime, analyst, case_id)  # the same 404 for another tenant's case
    if not await runtime.store.delete_case(case_id):
        raise _not_found(case_id)


def record_id(nbytes: int) -> str:
    """A random URL-safe id (``nbytes`` of entropy, less a bit) that starts with a letter
    or a digit: one starting with ``-`` reads as an option on a command line, and a CSV
    export quotes it as a would-be formula (:func:`_cell`), so the exported id would not
    be the id (1 case in 32 before)."""
    while True:
        out = secrets.token_urlsafe(nbytes)
        if out[0].isalnum():
            return out


# --------------------------------------------------------------------------- export
def _cell(value: Any) -> str:
    """A CSV cell; one that a spreadsheet would run as a formula is quoted with '."""
    text = "" if value is None else str(value)
    if text[:1] in ("=", "+", "-", "@", "\t", "\r"):
        text = "'" + text
    return text


def csv_row(case: dict[str, Any]) -> list[str]:
    who, summary, source = case["who"], case.get("summary") or {}, case.get("source") or {}
    islands = " ".join(f"{i['start']}-{i['end']}" for i in summary.get("islands") or [])
    values = {
        **{k: case.get(k) for k in CSV_COLUMNS},
        "role": who.get("role"),
        "tenant_id": who.get("tenant_id"),
        "tenant_name": who.get("tenant_name"),
        "key_id": who.get("key_id"),
        "key_name": who.get("key_name"),
        "matched_tenant": summary.get("matched_tenant"),
        "key_version": summary.get("key_version"),
        "message_id": summary.get("message_id"),
        "issued_at": summary.get("issued_at"),
        "num_tokens": summary.get("num_tokens"),
        "num_scored_tokens": summary.get("num_scored_tokens"),
        "islands": islands,
        "source": source.get("file"),
        "row": source.get("row"),
    }
    return [_cell(values[c]) for c in CSV_COLUMNS]


def to_csv(cases: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for case in cases:
        writer.writerow(csv_row(case))
    return out.getvalue()


# --------------------------------------------------------------------------- batches
def _suffix(filename: str) -> str:
    suffix = Path(filename).suffix.lower()
    if suffix == ".ndjson":
        suffix = ".jsonl"
    if suffix not in (".csv", ".jsonl"):
        raise APIError(
            422,
            f"a batch is a .csv or .jsonl file, not {filename!r}",
            "unsupported_batch_format",
        )
    return suffix


def read_rows(runtime: Runtime, filename: str, content: str, field: str) -> list[RawRow]:
    """The rows of an uploaded file, read in memory by ``worldcup scan``'s reader; a 422
    for a field the file does not have, or more rows than ``console_batch_limit``."""
    limit = runtime.settings.console_batch_limit
    _suffix(filename)
    fields = Fields(text=field, max_chars=runtime.settings.text_chars_limit)
    data = content.encode("utf-8", errors="surrogateescape")
    try:
        rows = read_bytes(Path(filename).name, data, fields)
    except InputError as exc:
        message = str(exc).replace("--text-field", "column")
        raise APIError(422, message, "bad_batch_file") from None
    if len(rows) > limit:
        raise APIError(
            422,
            f"{filename} has {len(rows)} rows; the console checks at most {limit} at once. "
            "For more, run `worldcup scan` (see docs/scans.md).",
            "batch_too_large",
        )
    return rows


async def _score_rows(
    runtime: Runtime, analyst: Analyst, mode: Mode, texts: list[str]
) -> list[Answer | str]:
    """Every text's answer, or its error as ``code: message``, through the bulk
    services (``/decode/batch``, ``/detect/batch``, and the provenance search's bulk
    form): one rate token and one probe count per text, as there, in bulk worker
    jobs. A key that cannot run the mode at all gets one 403 for the whole batch."""
    if not texts:
        return []
    _check_mode(analyst, mode)
    out: list[Answer | str] = []
    size = runtime.settings.max_batch_texts
    for start in range(0, len(texts), size):
        chunk = texts[start : start + size]
        try:
            items = await _bulk(runtime, analyst, mode, chunk)
        except APIError as exc:  # the rate limit: the chunk's texts fail, each with it
            if exc.status in (401, 403):
                raise
            items = [BatchItemError(code=exc.code, message=exc.message)] * len(chunk)
        out += [f"{i.code}: {i.message}" if isinstance(i, BatchItemError) else i for i in items]
    return out


async def _bulk(
    runtime: Runtime, analyst: Analyst, mode: Mode, texts: list[str]
) -> Sequence[Answer | BatchItemError]:
    p = analyst.principal
    if mode == "provenance":
        if p is not None:
            await charge(runtime, p.tenant, len(texts))
        return await search.provenance_batch(runtime, _investigator(analyst), texts, p is None)
    assert p is not None  # _check_mode: the admin has no decode or detect
    found: DecodeBatchResponse | DetectBatchResponse
    if mode == "decode":
        found = await detection.decode_batch(runtime, p, DecodeBatchRequest(texts=texts))
    else:
        found = await detection.detect_batch(runtime, p, DetectBatchRequest(texts=texts))
    return [_item(i.result, i.error) for i in found.results]


def _item(result: Answer | None, error: BatchItemError | None) -> Answer | BatchItemError:
    if error is not None:
        return error
    assert result is not None  # a bulk item holds its result or its error
    return result


async def batch(
    runtime: Runtime,
    analyst: Analyst,
    mode: Mode,
    filename: str,
    content: str,
    field: str,
    keep_text: bool,
) -> dict[str, Any]:
    """Check every row of a file and save each as a case of one batch. A row the file
    cannot give (no text, empty, too long) or the service refuses (a probe budget, the
    rate limit) carries its error code instead of a case."""
    rows = read_rows(runtime, filename, content, field)
    batch_id = record_id(9)
    texts = {row.row: row.text for row in rows if row.text is not None}
    answers = await _score_rows(runtime, analyst, mode, list(texts.values()))
    answer_of = dict(zip(texts, answers, strict=True))
    out: list[dict[str, Any]] = []
    for row in rows:
        item: dict[str, Any] = {"row": row.row, "id": row.id, "error": row.error, "case": None}
        answer = answer_of.get(row.row)
        if isinstance(answer, str):
            item["error"] = answer
        elif answer is not None:
            verdict, summary = summarise(mode, answer)
            source = {"file": row.source, "row": row.row, "id": row.id}
            case = new_case(
                runtime,
                analyst,
                mode,
                texts[row.row],
                keep_text,
                verdict,
                summary,
                batch_id=batch_id,
                source=source,
            )
            await runtime.store.put_case(case)
            item["case"] = case_view(case)
        out.append(item)
    counts = {"watermarked": 0, "inconclusive": 0, "not_watermarked": 0, "error": 0}
    for item in out:
        counts["error" if item["case"] is None else item["case"]["verdict"]] += 1
    return {
        "batch_id": batch_id,
        "file": Path(filename).name,
        "mode": mode,
        "field": field,
        "limit": runtime.settings.console_batch_limit,
        "counts": counts,
        "rows": out,
    }
