"""Text intake: how a text to score enters the service, for every route that scores one.

A text is checked against the published length limit, tokenised off the event loop
(in bulk where there are many), fingerprinted, and its query counted against the
caller's probe budget (:mod:`app.services.probes`). Once scored, a registry entry is
reported only when the match is significant and clearly ahead, and its metadata only
when it can be returned exactly. ``/decode``, ``/detect`` and their bulk forms
(:mod:`app.services.detection`), ``/provenance`` (:mod:`app.services.provenance`) and
the admin's registry lookup (:mod:`app.services.admin`) all take texts in here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from app.core.errors import APIError
from app.core.logging import request_id_var
from app.schemas.generation import check_metadata
from app.schemas.watermark import BatchItemError, RegistryMatchOut
from app.services.probes import Admission, Sketch
from app.services.runtime import Runtime
from app.services.tenants import Principal
from app.services.watermark import DecodeOutcome
from app.stores.base import ProbeDecision
from app.stores.client_payloads import sealed_bits, without_seal
from worldcup_core.assess import Assessment

Sketcher = Callable[[list[list[int]]], list[Sketch | None]]


def check_text(runtime: Runtime, text: str) -> None:
    """Raise a 422 if a text to score is over the (published) limit (cheap: no tokenising).
    Empty and whitespace-only texts are refused before (the schemas, the corpus reader)."""
    limit = runtime.settings.text_chars_limit
    if len(text) > limit:
        raise APIError(
            422,
            f"text is {len(text)} characters; the limit is {limit}: split it into parts of at "
            f"most {limit} characters and score each (/decode/batch and /detect/batch take up "
            f"to {runtime.settings.max_batch_texts} texts a request)",
            "text_too_long",
        )


def readable_metadata(metadata: dict[str, Any], message_id: int) -> dict[str, Any]:
    """Stored metadata, or a clear 409 if an entry written before metadata was checked
    holds something that cannot be returned exactly (a lone surrogate, NaN)."""
    try:
        check_metadata(metadata)
    except ValueError:
        raise APIError(
            409,
            f"registry entry {message_id} holds metadata that cannot be returned exactly "
            "(written before metadata was validated)",
            "registry_entry_unreadable",
        ) from None
    return metadata


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts in one call. Runs in a worker thread: the fast
    tokenizer's Rust backend encodes the batch with the GIL released."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [list(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]


def token_pieces(tokenizer: Any, text: str) -> tuple[list[int], list[str]]:
    """Token ids of ``text`` and the characters of each token, as consecutive pieces
    that concatenate to ``text`` (the ids are those :func:`encode_texts` gives)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encoding = backend.encode(text, add_special_tokens=False)
        ids, ends = list(encoding.ids), [end for _, end in encoding.offsets]
    else:  # a slow tokenizer has no offsets: the decoded prefix lengths stand in
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    pieces, cut = [], 0
    for end in ends:
        stop = min(max(end, cut), len(text))  # byte-level tokens of one character share it
        pieces.append(text[cut:stop])
        cut = stop
    if pieces:
        pieces[-1] += text[cut:]
    return ids, pieces


def registry_match(
    runtime: Runtime, outcome: DecodeOutcome, assessment: Assessment
) -> RegistryMatchOut | None:
    """The registry entry, named only when the registry test alone is below the
    watermarked level with every correction (``assessment.may_name_entry``: the search
    always has a best candidate, and any text, another tenant's or a human's, would
    otherwise "match" whichever entry happens to agree best; a named entry so always
    goes with the verdict "watermarked") and clearly ahead of the other entries
    (``registry_min_confidence``)."""
    found, entry = outcome.match, outcome.entry
    settings = runtime.settings
    if found is None or not assessment.may_name_entry:
        return None
    if entry is None and not outcome.client_payload:
        return None
    if found.posterior < settings.registry_min_confidence:
        return None  # a close runner-up: too likely to name the wrong entry
    if entry is None:  # a payload the client chose: no entry, no metadata, its own
        return RegistryMatchOut(
            message_id=None,
            metadata={},
            issued_at=None,
            num_bits=found.bits.__len__(),
            confidence=found.posterior,
            p_value=found.p_value,
            exact=found.bits == outcome.result.bits,
            client_payload=True,
            bits=found.bits,
        )
    sealed = sealed_bits(entry.metadata)  # an entry that seals a client-chosen payload
    return RegistryMatchOut(
        message_id=entry.message_id,
        metadata=readable_metadata(without_seal(entry.metadata), entry.message_id),
        issued_at=dt.datetime.fromtimestamp(entry.issued_at, tz=dt.UTC),
        num_bits=entry.num_bits,
        confidence=found.posterior,
        p_value=found.p_value,
        exact=outcome.entry_bits == outcome.result.bits,
        client_payload=sealed is not None,
        bits=sealed,
    )


def check_all(runtime: Runtime, texts: list[str]) -> tuple[list[int], dict[int, BatchItemError]]:
    """(indices of good texts, errors by index), without tokenising."""
    good: list[int] = []
    errors: dict[int, BatchItemError] = {}
    for i, text in enumerate(texts):
        try:
            check_text(runtime, text)
            good.append(i)
        except APIError as exc:
            errors[i] = BatchItemError(code=exc.code, message=exc.message)
    return good, errors


# ---------------------------------------------------------------- fingerprints, admission
def sketcher(runtime: Runtime, principal: Principal) -> Sketcher | None:
    """The fingerprinting function for a worker job; None when this key's detail
    level has no probe budget."""
    probes = runtime.probes
    if probes is None or probes.budget(principal.key.detail) <= 0:
        return None
    return probes.sketches


async def account_sketches(
    runtime: Runtime,
    principal: Principal,
    route: str,
    sketches: list[Sketch | None] | None,
    count: int,
    together: bool = False,
) -> list[Admission]:
    """One admission for each of ``count`` fingerprinted queries, counted against its
    text's budget (``together``: answered as one, in full only if all may be:
    :meth:`~app.services.probes.ProbeAccountant.admit`); with accounting off (no
    sketches, no probe store) every query is allowed, and a ``full`` key's answered in
    full. Refusals are audited and counted once per request."""
    probes = runtime.probes
    if sketches is None or probes is None:
        return [Admission(ProbeDecision(True, 0, 0.0), principal.key.detail == "full")] * count
    key = principal.key
    return await probes.account(
        principal.tenant.tenant_id,
        key.key_id,
        key.detail,
        route,
        sketches,
        request_id_var.get(),
        together,
    )


async def admit_one(
    runtime: Runtime, principal: Principal, route: str, sketches: list[Sketch | None] | None
) -> bool:
    """Count a single query against its text's budget, or raise its 429; whether it is
    answered in full: only a ``full`` key's, and only within the first
    ``probe_full_answers`` full answers about its text in the probe window (the tenant's
    keys together). Past them a ``full`` key gets the verdict only (``detail_reason:
    full_answers_spent``), so a p-value cannot be climbed edit by edit."""
    probes = runtime.probes
    if sketches is None or probes is None:
        return principal.key.detail == "full"
    key = principal.key
    admission = await probes.admit_one(
        principal.tenant.tenant_id, key.key_id, key.detail, route, sketches[0], request_id_var.get()
    )
    return admission.full


async def tokenise(
    runtime: Runtime, principal: Principal, text: str, pieces: bool
) -> tuple[list[int], list[str], list[Sketch | None] | None]:
    """One worker job: the text's token ids (and, for evidence, each token's
    characters) and its fingerprint for probe accounting; a 422 if it is too long."""
    check_text(runtime, text)
    sketch = sketcher(runtime, principal)

    def work() -> tuple[list[int], list[str], list[Sketch | None] | None]:
        if pieces:
            ids, parts = token_pieces(runtime.tokenizer, text)
        else:
            ids, parts = encode_texts(runtime.tokenizer, [text])[0], []
        return ids, parts, (sketch([ids]) if sketch else None)

    return await runtime.offload(work)


@dataclass(frozen=True)
class Intake:
    """A batch's admitted texts: their indices in the request, token ids, token pieces
    (for evidence) and whether each is answered in full (:func:`admit_one`), with the
    errors of the others by index."""

    good: list[int]
    ids: list[list[int]]
    pieces: list[list[str]]
    errors: dict[int, BatchItemError]
    full: list[bool]


async def take_batch(
    runtime: Runtime,
    principal: Principal | None,
    route: str,
    texts: list[str],
    pieces: bool = False,
    together: bool = False,
) -> Intake:
    """A batch's intake: every text checked, the good ones tokenised (with each token's
    characters, for evidence, when ``pieces``) and fingerprinted in bulk worker jobs,
    and a tenant key's queries counted against its probe budget in one call (None:
    the admin, unmetered, always answered in full): a bad or refused text fails
    alone. ``together``: the texts are answered as one (a collection), in full only if
    every admitted one may be, spending their full answers only then."""
    good, errors = check_all(runtime, texts)
    sketch = sketcher(runtime, principal) if principal is not None else None
    tokens, sketches = await _tokenise_chunks(runtime, sketch, [texts[i] for i in good], pieces)
    full = [True] * len(tokens)
    if principal is not None:
        admissions = await account_sketches(
            runtime, principal, route, sketches, len(tokens), together
        )
        good, kept = _keep_allowed(
            runtime, principal, good, list(zip(tokens, admissions, strict=True)), errors
        )
        tokens = [t for t, _ in kept]
        full = [a.full for _, a in kept]
    return Intake(good, [ids for ids, _ in tokens], [parts for _, parts in tokens], errors, full)


async def _tokenise_chunks(
    runtime: Runtime, sketch: Sketcher | None, texts: list[str], pieces: bool
) -> tuple[list[tuple[list[int], list[str]]], list[Sketch | None] | None]:
    """Token ids (and pieces) and fingerprints of a batch's texts, in chunks of bounded
    size (one worker job each, so one bulk request does not hold the CPU pool for long)."""

    def work(chunk: list[str]) -> list[tuple[tuple[list[int], list[str]], Sketch | None]]:
        tokens: list[tuple[list[int], list[str]]]
        if pieces:
            tokens = [token_pieces(runtime.tokenizer, text) for text in chunk]
        else:
            tokens = [(ids, []) for ids in encode_texts(runtime.tokenizer, chunk)]
        marks = sketch([ids for ids, _ in tokens]) if sketch else [None] * len(tokens)
        return list(zip(tokens, marks, strict=True))

    pairs = await runtime.offload_map(work, texts)
    return [t for t, _ in pairs], ([s for _, s in pairs] if sketch else None)


_Item = TypeVar("_Item")


def _keep_allowed(
    runtime: Runtime,
    principal: Principal,
    good: list[int],
    items: list[tuple[_Item, Admission]],
    errors: dict[int, BatchItemError],
) -> tuple[list[int], list[tuple[_Item, Admission]]]:
    """Batch items count one by one; a refused item becomes that item's error."""
    kept_good, kept = [], []
    for index, item in zip(good, items, strict=True):
        if item[1].decision.allowed:
            kept_good.append(index)
            kept.append(item)
        else:
            assert runtime.probes is not None
            message = runtime.probes.budget_message(principal.key.detail)
            errors[index] = BatchItemError(code="probe_budget_exceeded", message=message)
    return kept_good, kept
