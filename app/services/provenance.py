"""What POST /provenance does: whose watermark is this? Searches every tenant and key version.

For trust-and-safety: the admin token, or a tenant API key granted the
``provenance`` scope. Every query is written to the audit log (who, when, what
was found; never the text) *before* the answer is sent: if the audit write
fails, the caller gets a 503 and no answer.

A tenant key's queries count against the tenant's probe budget like ``/detect``
(route ``provenance``), its audit lines name the key, and a ``verdict`` key gets
a verdict only (:func:`worldcup_core.verdict.verdict_of` of the search's
p-value). The admin token is unmetered (and audited).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.core.errors import APIError
from app.core.logging import request_id_var
from app.schemas.exposure import DetailReason, ProvenanceVerdict, reason_of_detail
from app.schemas.watermark import (
    BatchItemError,
    ProvenanceCandidate,
    ProvenanceMatch,
    ProvenanceRequest,
    ProvenanceResponse,
    ProvenanceSuspect,
    TokenScore,
    verdict_fields,
)
from app.services import artifact
from app.services.evidence import (
    coverage_out,
    evidence_block,
    issued_similarity,
    unmatched_evidence,
)
from app.services.intake import (
    admit_one,
    check_text,
    encode_texts,
    registry_match,
    sketcher,
    take_batch,
    token_pieces,
)
from app.services.probes import Sketch
from app.services.registry import ambiguous_answer, expired_answer
from app.services.runtime import Runtime
from app.services.tenants import Principal
from app.services.watermark import ProvenanceOutcome
from app.stores.base import AuditRecord
from worldcup_core import WorldCup
from worldcup_core.evidence import text_coverage
from worldcup_core.verdict import VERDICT_WATERMARKED_BELOW, verdict_sentence


@dataclass(frozen=True)
class Investigator:
    """Who may run provenance searches: the admin, or a tenant granted the scope."""

    actor: str  # "admin" or "tenant:<id>", as written to the audit log
    is_admin: bool
    principal: Principal | None = None  # the tenant's API key; None for the admin

    @property
    def key_id(self) -> str | None:
        return None if self.principal is None else self.principal.key.key_id

    @property
    def is_verdict(self) -> bool:
        return self.principal is not None and self.principal.key.detail == "verdict"

    @property
    def detail_reason(self) -> DetailReason:
        """Why an answer to this asker is the verdict only (when it is one)."""
        return reason_of_detail(self.principal.key.detail if self.principal else "full")


def _token_scores(scheme: WorldCup, ids: list[int]) -> list[TokenScore]:
    """Mean g per group of each scored token under the matching key (admin only:
    per-token scores show an attacker exactly which tokens carry the watermark)."""
    evidence = scheme.evidence(ids)
    means = np.asarray(evidence.ones, dtype=np.float64) / evidence.trials_per_token
    return [
        TokenScore(index=i, g_mean=[round(float(x), 4) for x in row])
        for i, row in zip(scheme.scored_indices(ids), means, strict=True)
    ]


def _evidence_not_allowed() -> APIError:
    return APIError(
        403,
        "per-token evidence of a provenance search is for the admin token only",
        "evidence_not_allowed",
    )


def _outcome_summary(outcome: ProvenanceOutcome) -> dict[str, object]:
    found = outcome.significant
    entry = outcome.decoded.entry if outcome.decoded is not None and found else None
    return {
        "found": found,
        "tenant_id": outcome.tenant.tenant_id if outcome.tenant else None,
        "key_version": outcome.key_version if found else None,
        "message_id": entry.message_id if entry is not None else None,
        "p_value": outcome.assessment.p_value,  # the verdict's, as the answer's
        "verdict": outcome.assessment.verdict,
        "statistic": outcome.statistic,
        "num_keys": outcome.result.num_keys,
        "num_tokens": outcome.result.num_tokens,
    }


async def _tenant_ids(runtime: Runtime, who: Investigator, text: str) -> tuple[list[int], bool]:
    """Tokenise (and, for a tenant key, fingerprint) in one worker job; a tenant key's
    query is then counted against the tenant's probe budget, or refused with a 429.
    (token ids, whether the answer is the full one: :func:`app.services.intake.admit_one`)."""
    check_text(runtime, text)
    principal = who.principal
    sketch = sketcher(runtime, principal) if principal is not None else None

    def work() -> tuple[list[int], list[Sketch | None] | None]:
        ids = encode_texts(runtime.tokenizer, [text])
        return ids[0], (sketch(ids) if sketch else None)

    ids, sketches = await runtime.offload(work)
    if principal is None:
        return ids, True
    return ids, await admit_one(runtime, principal, "provenance", sketches)


async def audit_query(
    runtime: Runtime, who: Investigator, outcome: dict[str, Any], full: bool = True
) -> None:
    """One provenance query in the audit log (what was asked is never stored): the
    outcome, with the asking key's id and whether it was answered as the verdict only
    (a verdict key, or a full key past its text's full answers)."""
    await runtime.store.append_audit(
        AuditRecord(
            at=time.time(),
            actor=who.actor,
            action="provenance",
            request_id=request_id_var.get(),
            outcome={
                **outcome,
                **({"key_id": who.key_id} if who.key_id is not None else {}),
                **({"detail": "verdict"} if who.is_verdict or not full else {}),
            },
        )
    )


async def provenance(
    runtime: Runtime, who: Investigator, body: ProvenanceRequest
) -> ProvenanceResponse | ProvenanceVerdict:
    """Which tenant, key version and registry entry produced this text, if any;
    ``evidence`` (admin token only) adds the best key's per-token evidence."""
    if body.include_token_scores and not who.is_admin:
        raise APIError(403, "per-token scores are for the admin token only", "admin_only")
    if body.evidence and not who.is_admin:
        raise _evidence_not_allowed()
    pieces: list[str] = []
    full = True
    if body.evidence:  # the admin's: unmetered
        check_text(runtime, body.text)
        ids, pieces = await runtime.offload(lambda: token_pieces(runtime.tokenizer, body.text))
    else:
        ids, full = await _tenant_ids(runtime, who, body.text)
    return await _search(
        runtime, who, ids, pieces, body.evidence, body.include_token_scores, body.text, full
    )


async def provenance_batch(
    runtime: Runtime, who: Investigator, texts: list[str], evidence: bool
) -> list[ProvenanceResponse | ProvenanceVerdict | BatchItemError]:
    """Bulk /provenance (the console's batches): the texts are checked, tokenised and,
    for a tenant key, fingerprinted in bulk worker jobs, and a tenant key's queries
    counted against its probe budget in one call; a bad or refused text fails alone.
    Each text is then searched and audited as one /provenance query."""
    if evidence and not who.is_admin:
        raise _evidence_not_allowed()
    route = "provenance/batch"
    batch = await take_batch(runtime, who.principal, route, texts, evidence)
    found: dict[int, ProvenanceResponse | ProvenanceVerdict] = {}
    for index, text_ids, pieces, full in zip(
        batch.good, batch.ids, batch.pieces, batch.full, strict=True
    ):
        found[index] = await _search(
            runtime, who, text_ids, pieces, evidence, False, texts[index], full
        )
    return [found[i] if i in found else batch.errors[i] for i in range(len(texts))]


async def _search(
    runtime: Runtime,
    who: Investigator,
    ids: list[int],
    pieces: list[str],
    evidence: bool,
    token_scores: bool,
    text: str,
    full: bool,
) -> ProvenanceResponse | ProvenanceVerdict:
    """Search every tenant for one tokenised text, audit the query, answer it: in full,
    or (``full`` false: a verdict key, or a full key past its text's full answers) as
    the verdict and whose key."""
    settings = runtime.settings
    outcome = await runtime.watermark.provenance(
        ids, settings.significance, settings.default_num_bits
    )
    result = outcome.result
    match = None
    if outcome.significant and outcome.decoded is not None and outcome.key_version is not None:
        assert outcome.scheme is not None and outcome.tenant is not None
        decoded = outcome.decoded
        num_bits = decoded.result.num_bits
        checked = None
        if outcome.assessment.is_watermarked:  # as /decode's: the deciding key and length
            tenant_id, version = outcome.tenant.tenant_id, outcome.key_version
            bits = outcome.assessment.num_bits or num_bits
            checked = await artifact.check_one(runtime, tenant_id, ids, version, bits, "provenance")
        found_entry = registry_match(runtime, decoded, outcome.assessment)
        withheld = artifact.withholds(runtime, checked) and found_entry is not None
        match = ProvenanceMatch(
            tenant_id=outcome.tenant.tenant_id,
            tenant_name=outcome.tenant.name,
            key_version=outcome.key_version,
            key_p_value=10.0**result.best.log10_p_value if result.best else 1.0,
            bits=decoded.result.bits,
            num_bits=num_bits,
            registry_entry=None if withheld else found_entry,
            registry_expired=expired_answer(
                decoded.match, decoded.expired, outcome.assessment, settings
            ),
            registry_ambiguous=ambiguous_answer(decoded.match, outcome.assessment, settings),
            registry_withheld=withheld,
        )
    names = await _tenant_names(runtime, {t for t, _, _ in outcome.candidates})
    candidates = [
        ProvenanceCandidate(
            tenant_id=t, tenant_name=names.get(t), key_version=v, p_value=10.0**log10_p
        )
        for t, v, log10_p in outcome.candidates
    ]
    suspect = None
    if outcome.suspect is not None and outcome.key_version is not None:
        suspect = ProvenanceSuspect(
            tenant_id=outcome.suspect.tenant_id,
            tenant_name=outcome.suspect.name,
            key_version=outcome.key_version,
        )
    await audit_query(runtime, who, {**_outcome_summary(outcome), "evidence": evidence}, full)
    if not full:
        verdict = outcome.assessment.verdict
        owner = outcome.tenant.tenant_id if outcome.tenant is not None else None
        return ProvenanceVerdict(
            verdict=verdict,
            tenant_id=owner if verdict == "watermarked" else None,
            detail_reason=who.detail_reason,
        )
    scores = None
    if token_scores and outcome.scheme is not None:
        scores = _token_scores(outcome.scheme, ids)
    block = None
    if evidence:
        best, best_decode = outcome.scheme, outcome.decoded
        if best is not None and best_decode is not None:
            found = best_decode.result
            block = await runtime.offload(lambda: evidence_block(best, ids, pieces, found))
        else:
            block = unmatched_evidence(pieces, settings.groups, settings.default_num_bits)
    coverage = None
    if outcome.significant and outcome.scheme is not None and outcome.decoded is not None:
        key, bits = outcome.scheme, outcome.decoded.result.num_bits
        cov = await runtime.offload(lambda: text_coverage(key, ids, bits))
        named = match is not None and match.registry_entry is not None
        entry = outcome.decoded.entry
        similarity = None
        if (
            match is not None
            and match.registry_entry is not None
            and entry is not None
            and entry.fingerprint is not None
            and match.registry_entry.message_id == entry.message_id
            and entry.key_version == outcome.key_version  # the key that issued it
        ):
            similarity = await runtime.offload(lambda: issued_similarity(key.key, entry, text))
        coverage = coverage_out(cov, named, similarity)
    message = (
        f"watermarked for tenant {outcome.tenant.name!r}"
        if outcome.significant and outcome.tenant is not None
        else _unfound_message(outcome)
    )
    if coverage is not None and coverage.attribution == "part":
        message += f", in part only ({100 * coverage.share:.0f} % of the text)"
    per_1000 = 1000.0 * outcome.scan_seconds / result.num_keys if result.num_keys else None
    return ProvenanceResponse(
        **verdict_fields(outcome.assessment, outcome.statistic),
        found=outcome.significant,
        message=message,
        coverage=coverage,
        num_keys=result.num_keys,
        num_tenants=outcome.num_tenants,
        num_tokens=result.num_tokens,
        num_scored_tokens=result.num_scored_tokens,
        significance=VERDICT_WATERMARKED_BELOW,  # deprecated alias of threshold
        match=match,
        suspect=suspect,
        candidates=candidates,
        scan_seconds=round(outcome.scan_seconds, 6),
        scan_ms_per_1000_keys=round(1000.0 * per_1000, 3) if per_1000 is not None else None,
        screened=result.screened,
        num_full_scans=result.num_full_scans,
        token_scores=scores,
        evidence=block,
    )


def _unfound_message(outcome: ProvenanceOutcome) -> str:
    """The answer's words when no tenant is named: the verdict's, so they never say "no
    watermark" of a text too short to tell or one with some evidence."""
    a = outcome.assessment
    return verdict_sentence(a.verdict, a.statistic, a.p_value, a.num_scored)


async def _tenant_names(runtime: Runtime, tenant_ids: set[str]) -> dict[str, str]:
    """The names of the runners-up's tenants (the console shows names, not hex ids)."""
    names = {}
    for tenant_id in sorted(tenant_ids):
        tenant = await runtime.store.get_tenant(tenant_id)
        if tenant is not None:
            names[tenant_id] = tenant.name
    return names
