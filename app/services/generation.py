"""The one generation path behind every protocol: ``/generate`` and the OpenAI ``/v1`` routes.

Routes are adapters: they parse their protocol's request, then call these
functions for what must not differ between them (prompt limits, idempotency
claims, registry allocation, batching, deadlines, disconnect cancellation,
incremental detokenisation), and finally shape their protocol's response.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from app.core.errors import APIError
from app.engines.base import Engine, EngineStopped, GenerationJob, QueueFull, UnwatermarkedError
from app.services.disclosure import FIXED_PAYLOAD_SCOPE
from app.services.intake import encode_texts
from app.services.runtime import Runtime
from app.services.tenants import KeyVersion, RegistryExhausted
from app.stores.base import COUNT_ONLY, IDEMPOTENCY_PENDING, IdempotencyRecord, StoreUnavailable
from app.stores.client_payloads import (
    SEALED_METADATA_KEY,
    record_client_payload,
    repeats_key,
    sealed_length,
    sealed_metadata,
)
from worldcup_core import Payload, SamplingConfig
from worldcup_core.context_sketch import text_cells
from worldcup_core.fingerprint import text_fingerprint
from worldcup_core.generation import (
    GenerationRequest,
    GenerationResult,
    StepEvent,
    TokenConstraint,
)

logger = logging.getLogger("worldcup.generate")


def parse_payload(
    bits: str | None, hex_digits: str | None, integer: int | None, num_bits: int | None
) -> Payload:
    """An explicit payload in one of its three spellings (validated shapes)."""
    try:
        if bits is not None:
            return Payload.from_bits(bits)
        if hex_digits is not None:
            return Payload.from_hex(hex_digits, num_bits)
        assert integer is not None and num_bits is not None
        return Payload.from_int(integer, num_bits)
    except ValueError as exc:
        raise APIError(422, f"payload: {exc}", "invalid_payload") from None


async def fixed_payload(
    runtime: Runtime,
    scopes: frozenset[str],
    tenant_id: str,
    key: KeyVersion,
    spelled: tuple[str | None, str | None, int | None, int | None],
    uses: int = 1,
) -> Payload:
    """A client-chosen payload (``bits``, ``hex``, ``int``, ``num_bits``), if the asking
    key may choose one and this payload is under its repeat cap; ``uses`` texts are
    counted against the cap (OpenAI ``n``).

    Many texts under one payload are exactly what a watermark-stealing attacker learns
    from (SECURITY.md, Forgery and framing): registry-issued payloads differ per text, so
    no context's favoured tokens stay fixed across texts. A key chooses payloads only
    with the ``fixed_payload`` scope (an admin's grant to the tenant, held by the key),
    and each payload at most ``fixed_payload_repeats`` times per key version within
    ``fixed_payload_window_s`` (counted in the store, shared by replicas).

    The payload is then sealed, not embedded (:func:`allocate_sealed`): each text gets a
    registry entry that records the chosen bits, and carries the entry's keyed payload.
    The client's labels (the bits it chose) say nothing about the bits its texts carry,
    so its texts teach a stealing attacker what a metadata request's do."""
    if FIXED_PAYLOAD_SCOPE not in scopes:
        runtime.metrics.rejections.labels("fixed_payload_not_allowed").inc()
        raise APIError(
            403,
            "a client-chosen payload needs the 'fixed_payload' scope (an admin grants it to "
            "the tenant, and the key must hold it); without it, send metadata instead "
            '("metadata": {} will do) and the service issues a registry payload per text',
            "fixed_payload_not_allowed",
            param="payload",
        )
    payload = parse_payload(*spelled)
    settings = runtime.settings
    cap, window = settings.fixed_payload_repeats, settings.fixed_payload_window_s
    digest = hashlib.sha256(f"{payload.num_bits}:{payload.bits}".encode()).hexdigest()[:32]
    for _ in range(uses):
        decision = await runtime.store.probe_hit(
            tenant_id, repeats_key(key.version), digest, COUNT_ONLY, [], window, cap
        )
        if not decision.allowed:
            runtime.metrics.rejections.labels("payload_repeats_exceeded").inc()
            retry = max(1, math.ceil(decision.retry_after_s))
            raise APIError(
                429,
                f"this payload was chosen for {decision.count} texts under this key version "
                f"within {window / 86400:g} days, the limit (WORLDCUP_FIXED_PAYLOAD_REPEATS): "
                "many texts under one payload teach a forger the watermark; send metadata "
                "for registry-issued payloads",
                "payload_repeats_exceeded",
                {"Retry-After": str(retry)},
                param="payload",
            )
    return payload


def prompt_ids(
    runtime: Runtime, prompt: str | None, messages: Sequence[dict[str, str]] | None
) -> list[int]:
    """Tokenise a prompt, or render chat messages through the model's chat template."""
    tok = runtime.tokenizer
    if messages is not None:
        if not getattr(tok, "chat_template", None):
            raise APIError(422, "this model has no chat template; send prompt", "no_chat_template")
        rendered = tok.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
        ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    else:
        assert prompt is not None
        ids = tok(prompt, add_special_tokens=False).input_ids
    ids = list(ids)
    limit = runtime.settings.max_prompt_tokens
    if not ids:
        raise APIError(422, "the prompt is empty after tokenisation", "empty_prompt")
    if len(ids) > limit:
        raise APIError(422, f"prompt is {len(ids)} tokens; the limit is {limit}", "prompt_too_long")
    return ids


def queue_full(runtime: Runtime) -> APIError:
    runtime.metrics.rejections.labels("queue_full").inc()
    return APIError(
        429, "the generation queue is full; retry shortly", "queue_full", {"Retry-After": "1"}
    )


def ensure_queue_room(runtime: Runtime, engine: Engine, rows: int = 1) -> None:
    """Refuse before allocating a message id when ``rows`` more jobs cannot wait."""
    if engine.queue_depth + rows > engine.max_queue:
        raise queue_full(runtime)


def body_hash(body: Any) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# --------------------------------------------------------------------------- idempotency
def in_progress() -> APIError:
    return APIError(
        409,
        "a request with this Idempotency-Key is still running; retry shortly",
        "idempotency_in_progress",
        {"Retry-After": "1"},
    )


def check_stored(stored: IdempotencyRecord, digest: str) -> IdempotencyRecord:
    """The stored response to replay, or 409 for another body or a running request."""
    if stored.body_hash != digest:
        raise APIError(
            409, "Idempotency-Key was used with a different body", "idempotency_conflict"
        )
    if stored.status_code == IDEMPOTENCY_PENDING:
        raise in_progress()
    return stored


async def stored_response(
    runtime: Runtime, tenant_id: str, key: str, digest: str
) -> IdempotencyRecord | None:
    stored = await runtime.store.idempotency_get(tenant_id, key)
    return None if stored is None else check_stored(stored, digest)


@dataclass
class IdempotencyClaim:
    """An Idempotency-Key claimed before anything is allocated or generated."""

    runtime: Runtime
    tenant_id: str
    key: str
    body_hash: str
    remembered: bool = False  # the final response replaced the claim

    async def remember(self, response: dict[str, Any]) -> None:
        record = IdempotencyRecord(self.body_hash, 200, response)
        await self.runtime.store.idempotency_put(
            self.tenant_id,
            self.key,
            record,
            self.runtime.settings.idempotency_ttl_s,
            overwrite=True,
        )
        self.remembered = True

    async def release(self) -> None:
        """Drop the claim of a request that failed, so that its retry can run."""
        if self.remembered:
            return
        with contextlib.suppress(StoreUnavailable):  # otherwise it expires by itself
            await self.runtime.store.idempotency_delete(self.tenant_id, self.key)


async def claim(
    runtime: Runtime, tenant_id: str, key: str, digest: str
) -> IdempotencyClaim | IdempotencyRecord:
    """Claim ``key`` (two concurrent requests with one key cannot both run, or one
    would issue a second message id), or return the stored response to replay.
    The claim expires on its own if this replica dies mid-request."""
    pending = IdempotencyRecord(digest, IDEMPOTENCY_PENDING, {})
    ttl = int(runtime.settings.request_timeout_s) + 30
    if await runtime.store.idempotency_put(tenant_id, key, pending, ttl):
        return IdempotencyClaim(runtime, tenant_id, key, digest)
    stored = await runtime.store.idempotency_get(tenant_id, key)
    if stored is None:  # it expired in between: the client may simply retry
        raise in_progress()
    return check_stored(stored, digest)


# --------------------------------------------------------------------------- samples
async def allocate(
    runtime: Runtime,
    tenant_id: str,
    key: KeyVersion,
    metadata: dict[str, Any],
    num_bits: int | None,
) -> tuple[Payload, int]:
    """A registry entry (durably, before generating) and the payload it maps to."""
    if SEALED_METADATA_KEY in metadata:
        raise APIError(
            422,
            f"metadata: the key {SEALED_METADATA_KEY!r} is the service's own (it records a "
            "sealed client-chosen payload)",
            "reserved_metadata_key",
            param="metadata",
        )
    return await _allocate(runtime, tenant_id, key, metadata, num_bits)


async def allocate_sealed(
    runtime: Runtime, tenant_id: str, key: KeyVersion, chosen: Payload
) -> tuple[Payload, int | None]:
    """A registry entry that seals the client-chosen payload ``chosen`` (its bits in the
    entry's metadata, :func:`app.stores.client_payloads.sealed_metadata`), and the keyed
    payload the text carries instead: the entry's, of :func:`sealed_length` bits.

    With ``seal_client_payloads`` off, the text carries ``chosen`` itself and no entry
    is issued; the payload is recorded as a registry candidate instead, so that its
    texts are named as the client's payload, never as another user's entry."""
    if not runtime.settings.seal_client_payloads:
        await record_client_payload(runtime.store, tenant_id, key.version, chosen.bits)
        return chosen, None
    length = sealed_length(chosen.num_bits, runtime.settings.default_num_bits)
    return await _allocate(runtime, tenant_id, key, sealed_metadata(chosen.bits), length)


async def _allocate(
    runtime: Runtime,
    tenant_id: str,
    key: KeyVersion,
    metadata: dict[str, Any],
    num_bits: int | None,
) -> tuple[Payload, int]:
    try:
        entry, payload = await runtime.tenants.allocate(
            tenant_id, key, num_bits or runtime.settings.default_num_bits, metadata
        )
    except RegistryExhausted:
        raise APIError(
            409, "every message id of this payload length is taken", "registry_full"
        ) from None
    return payload, entry.message_id


@dataclass(eq=False)
class Sample:
    """One submitted generation and what its response needs."""

    runtime: Runtime
    tenant_id: str
    key: KeyVersion
    payload: Payload | None  # None: nothing kept is generated (completions' max_tokens 0)
    message_id: int | None
    prompt_ids: list[int]
    job: GenerationJob
    # whether the answer shows the payload's bits (app.services.disclosure)
    reveal_payload: bool = False
    # the client-chosen payload its registry entry seals (allocate_sealed), or None
    chosen: Payload | None = None
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.runtime.settings.request_timeout_s

    def shown_payload(self) -> Payload | None:
        """The payload the answer shows: the client's own where it chose one (never the
        keyed payload that seals it: those bits would be a stealing attacker's labels),
        the carried one where the key may see it, else None."""
        if self.chosen is not None:
            return self.chosen
        return self.payload if self.reveal_payload else None


def submit(
    runtime: Runtime,
    engine: Engine,
    tenant_id: str,
    key: KeyVersion,
    ids: list[int],
    sampling: SamplingConfig,
    payload: Payload | None,
    message_id: int | None,
    constraint: TokenConstraint | None = None,
    reveal_payload: bool = False,
    chosen: Payload | None = None,
) -> Sample:
    """Queue one generation; without a payload it runs unwatermarked (only for a
    completion that keeps no generated token: max_tokens 0, the prompt scored).
    ``reveal_payload``: whether its answer may show the payload's bits
    (:func:`app.services.disclosure.reveals_generated`); ``chosen``: the client-chosen
    payload ``payload``'s registry entry seals (:func:`allocate_sealed`)."""
    scheme = key.scheme if payload is not None else None
    try:
        job = engine.submit(GenerationRequest(ids, sampling, scheme, payload, constraint))
    except QueueFull:
        raise queue_full(runtime) from None
    except EngineStopped:
        raise APIError(503, "the server is shutting down", "draining") from None
    return Sample(runtime, tenant_id, key, payload, message_id, ids, job, reveal_payload, chosen)


async def next_event(sample: Sample) -> StepEvent | GenerationResult:
    """The job's next token or its result; TimeoutError past the request deadline."""
    remaining = sample.deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    item = await asyncio.wait_for(sample.job.events.get(), timeout=remaining)
    if isinstance(item, EngineStopped):
        raise APIError(503, "the server is shutting down", "draining", {"Retry-After": "5"})
    if isinstance(item, UnwatermarkedError):
        raise await watermark_failed(sample, item.reason)
    if isinstance(item, BaseException):
        raise APIError(500, "generation failed; it has been logged", "generation_failed")
    return item


async def record_issued(sample: Sample, text: str) -> None:
    """What the service keeps of a text it returns (issue #45): a registered text's
    fingerprint (:func:`record_fingerprint`), and every watermarked text's contexts in
    its tenant's context sketch (:func:`record_contexts`)."""
    await record_fingerprint(sample, text)
    await record_contexts(sample, text)


async def record_contexts(sample: Sample, text: str) -> None:
    """Count the contexts of a watermarked text the service returns, as /detect will read
    the text (:mod:`worldcup_core.context_sketch`), in the sketch of the tenant's key
    version it was issued with: the memory of the spoof-artifact check. Registered or
    client-chosen payload alike (a stealing spoofer learns from both). A failed write
    never fails the generation: the contexts then look rarer than they are."""
    runtime = sample.runtime
    if sample.payload is None or not runtime.settings.count_contexts:
        return
    scheme, width_log2 = sample.key.scheme, sample.key.sketch_width_log2
    try:
        cells = await runtime.offload(
            lambda: text_cells(
                scheme, encode_texts(runtime.tokenizer, [text])[0], width_log2
            ).tolist()
        )
        await runtime.store.count_contexts(sample.tenant_id, sample.key.version, cells, width_log2)
    except Exception as exc:  # a store error, an outage: the text is still issued
        logger.warning("contexts of an issued text not counted (%s)", type(exc).__name__)


async def record_fingerprint(sample: Sample, text: str) -> None:
    """Record the fingerprint of the text a registered sample returns with its entry
    (issue #45), under the key version it was issued with. A failed write never fails
    the generation: the entry then has no fingerprint, and answers that name it fall
    back to the statistical coverage alone."""
    if sample.message_id is None or sample.payload is None:
        return
    fp = text_fingerprint(sample.key.scheme.key, text)
    try:
        await sample.runtime.store.set_fingerprint(sample.tenant_id, sample.message_id, fp)
    except Exception as exc:  # a store error, an outage: the text is still issued
        logger.warning(
            "issued-text fingerprint of registry entry %d not recorded (%s)",
            sample.message_id,
            type(exc).__name__,
        )


WATERMARK_FAILED = "watermark_failed"


async def watermark_failed(sample: Sample, reason: str) -> APIError:
    """The engine could not watermark this sample (a guard failed closed): its registry
    entry is voided, so that it never claims a watermark the text lacks, and the client
    gets a 500 (or a stream's error event) saying the text is not watermarked."""
    voided = ""
    if sample.message_id is not None:
        await sample.runtime.store.void_message(sample.tenant_id, sample.message_id, reason)
        sample.runtime.metrics.voided_entries.inc()
        voided = f"; registry entry {sample.message_id} is voided"
    return APIError(
        500,
        f"the text could not be watermarked ({reason}) and is withheld: what was streamed "
        f"of it is NOT watermarked{voided}",
        WATERMARK_FAILED,
    )


def timed_out(sample: Sample, engine: Engine) -> APIError:
    engine.cancel(sample.job)
    sample.runtime.metrics.rejections.labels("timeout").inc()
    return APIError(504, "generation timed out", "timeout")


async def collect(sample: Sample, engine: Engine) -> GenerationResult:
    try:
        while True:
            item = await next_event(sample)
            if isinstance(item, GenerationResult):
                return item
    except TimeoutError:
        raise timed_out(sample, engine) from None


async def watch_disconnect(request: Request, engine: Engine, jobs: list[GenerationJob]) -> None:
    """Stop generating for a client that went away."""
    while not all(job.done for job in jobs):
        if await request.is_disconnected():
            for job in jobs:
                engine.cancel(job)
            return
        await asyncio.sleep(0.25)


class TextDeltas:
    """Incremental detokenisation whose deltas add up to the final text.

    A multi-byte character split across tokens decodes as U+FFFD until its last
    byte arrives: it is held back until then.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return str(delta)

    def rest(self, final_text: str) -> str:
        """What is still held back of ``final_text`` (the text ended inside a character)."""
        if final_text != self.sent and final_text.startswith(self.sent):
            return final_text[len(self.sent) :]
        return ""
