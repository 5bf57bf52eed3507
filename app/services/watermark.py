"""The watermark operations on a tenant's keys: decode, detect and provenance.

Decoding and detecting try every key version of the caller's tenant (Šidák-corrected
over them); provenance searches every tenant's every version through a
:class:`~worldcup_core.provenance.KeyBank`, built once and cached. The keys
themselves (their versions, unwrapping, the scheme cache) belong to
:class:`~app.services.tenants.TenantService`; the scoring runs in the bounded
CPU pool (:mod:`app.services.cpu`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from app.schemas.watermark import EvidenceOut
from app.services.cpu import TOKEN_CHARS, CpuPool, offload, offload_map
from app.services.evidence import evidence_block
from app.services.registry import Found, Pending, RegistryLookup
from app.services.tenants import TenantService
from app.stores.base import RegistryEntry, Store, TenantRecord
from worldcup_core import DecodeResult, DetectionResult, WorldCup
from worldcup_core.decoder import RegistryMatch
from worldcup_core.detector import z_from_log_p
from worldcup_core.message import MessageIdCodec
from worldcup_core.provenance import KeyBank, ProvenanceResult
from worldcup_core.registry_lookup import text_cells
from worldcup_core.scoring import sidak_log_p

T = TypeVar("T")


def corrected(log10_p: float, tests: int, num_scored: int) -> tuple[float, float]:
    """(p, z) of the best of ``tests`` key versions, Šidák-corrected. Šidák, not
    Bonferroni: exact (uniform under H0, independent keys) and never clipped at 1,
    so z is standard normal on unwatermarked text."""
    log_p = sidak_log_p(log10_p * math.log(10.0), tests)
    return math.exp(log_p), z_from_log_p(log_p, num_scored)


@dataclass(frozen=True)
class DecodeOutcome:
    key_version: int
    result: DecodeResult
    match: RegistryMatch | None
    entry: RegistryEntry | None
    versions_tried: int = 1  # the best of these; its p-value is corrected for them
    entry_bits: str | None = None  # the matched entry's payload, as it was issued
    expired: bool = False  # the best candidate is an entry past the tenant's retention


@dataclass(frozen=True)
class DetectOutcome:
    key_version: int | None
    result: DetectionResult
    p_value: float  # corrected for the number of key versions tried
    z_score: float  # the normal quantile of the corrected p-value


@dataclass(frozen=True)
class ProvenanceOutcome:
    result: ProvenanceResult
    significant: bool
    tenant: TenantRecord | None  # the best key's owner, when significant
    key_version: int | None
    decoded: DecodeOutcome | None  # payload and registry entry under the best key
    num_tenants: int
    scan_seconds: float
    scheme: WorldCup | None  # the best key (for admin-only per-token scores)
    candidates: list[tuple[str, int, float]]  # (tenant id, key version, log10 p), best first


@dataclass
class _Bank:
    built_at: float
    epoch: int  # the tenants' key epoch it was built at (a local creation or rotation)
    bank: KeyBank
    refs: list[tuple[str, int]]  # (tenant id, key version) per bank entry


class WatermarkService:
    def __init__(
        self,
        store: Store,
        tenants: TenantService,
        cpu: CpuPool | None = None,
        provenance_refresh_s: float = 30.0,
    ) -> None:
        self.store = store
        self.tenants = tenants
        self.cpu = cpu
        self.provenance_refresh_s = provenance_refresh_s
        self._bank: _Bank | None = None
        self.registry = RegistryLookup(store)
        self._bank_lock = asyncio.Lock()

    async def offload(self, fn: Callable[[], T]) -> T:
        """Run scoring work off the event loop (see :func:`app.services.cpu.offload`)."""
        return await offload(self.cpu, fn)

    # decode / detect --------------------------------------------------------
    async def decode_texts(
        self,
        tenant_id: str,
        texts: Sequence[list[int]],
        num_bits: int,
        key_version: int | None,
    ) -> list[DecodeOutcome]:
        """Decode under each candidate key version, keep the most significant, and
        match it against that version's registry (:mod:`app.services.registry`: the
        registry's counters once per batch, then its cached payloads, or one lookup
        of the text's likeliest ids per text)."""
        versions = (
            [await self.tenants.version(tenant_id, key_version)]
            if key_version is not None
            else await self.tenants.versions(tenant_id)
        )
        plans = {
            v.version: await self.registry.plan(
                tenant_id, MessageIdCodec(v.scheme.key, num_bits), v.version
            )
            for v in versions
        }

        def work(
            chunk: list[list[int]],
        ) -> list[tuple[DecodeOutcome, Found | None, Pending | None]]:
            out = []
            for token_ids in chunk:
                best: DecodeOutcome | None = None
                for v in versions:
                    result = v.scheme.decode(token_ids, num_bits)
                    if best is None or (
                        result.detection.log10_p_value < best.result.detection.log10_p_value
                    ):
                        best = DecodeOutcome(v.version, result, None, None)
                assert best is not None
                scheme = next(v.scheme for v in versions if v.version == best.key_version)
                plan = plans[best.key_version]
                found, pending = None, None
                if plan.candidates > 0:
                    symbols = scheme.config.symbols_for(num_bits)
                    ones, trials, _ = scheme.evidence(token_ids).cells(symbols)
                    cells = text_cells(ones, trials, num_bits)
                    if plan.payloads is not None:
                        found = self.registry.match_small(plan, cells)
                    else:
                        pending = self.registry.prepare_list(plan, cells)
                out.append((best, found, pending))
            return out

        # one job per chunk of texts: a big batch does not hold the workers for long
        decoded = await offload_map(self.cpu, work, texts, lambda ids: TOKEN_CHARS * len(ids))
        waiting = [(best.key_version, p) for best, _, p in decoded if p is not None]
        listed = iter(await self.registry.finish_lists(tenant_id, plans, waiting))
        outcomes = []
        for best, found, pending in decoded:
            if pending is not None:
                found = next(listed)
            entry = None
            if found is not None and not found.expired:
                entry = await self.store.registry_entry(tenant_id, found.message_id)
            outcomes.append(
                DecodeOutcome(
                    best.key_version,
                    best.result,
                    found.match if found is not None else None,
                    entry,
                    len(versions),
                    found.match.bits if found is not None else None,
                    expired=found is not None and found.expired,
                )
            )
        return outcomes

    async def detector(
        self, tenant_id: str, significance: float
    ) -> Callable[[list[int]], DetectOutcome]:
        """The message-free test under every key version, Šidák over versions, as
        a plain function for a worker job (the store reads happen here, on the loop),
        so a route can tokenise and score in one job."""
        versions = await self.tenants.versions(tenant_id)

        def one(token_ids: list[int]) -> DetectOutcome:
            results = [
                (v.version, v.scheme.detect(token_ids, None, significance)) for v in versions
            ]
            version, best = min(results, key=lambda r: r[1].log10_p_value)
            p_value, z = corrected(best.log10_p_value, len(results), best.num_scored_tokens)
            return DetectOutcome(version if p_value < significance else None, best, p_value, z)

        return one

    async def token_evidence(
        self, tenant_id: str, outcome: DecodeOutcome, ids: list[int], pieces: list[str]
    ) -> EvidenceOut:
        """The per-token evidence block of a decoded text, under the key that decoded it."""
        scheme = (await self.tenants.version(tenant_id, outcome.key_version)).scheme
        found = outcome.result
        return await self.offload(lambda: evidence_block(scheme, ids, pieces, found))

    # provenance -------------------------------------------------------------
    async def key_bank(self) -> tuple[KeyBank, list[tuple[str, int]]]:
        """Every tenant's every key version, unwrapped and prepared once.

        Rebuilt after a local tenant creation or rotation, and at most every
        ``provenance_refresh_s`` seconds otherwise (changes made on another
        replica are picked up then).
        """
        async with self._bank_lock:
            now = time.monotonic()
            cached = self._bank
            fresh = cached is not None and now - cached.built_at < self.provenance_refresh_s
            if cached is not None and fresh and cached.epoch == self.tenants.key_epoch:
                return cached.bank, cached.refs
            epoch = self.tenants.key_epoch
            records = await self.store.all_key_versions()

            def build() -> _Bank:
                schemes = [self.tenants.scheme(r) for r in records]
                refs = [(r.tenant_id, r.version) for r in records]
                return _Bank(now, epoch, KeyBank(schemes), refs)

            self._bank = await asyncio.to_thread(build)
            return self._bank.bank, self._bank.refs

    async def provenance(
        self, token_ids: list[int], significance: float, default_num_bits: int
    ) -> ProvenanceOutcome:
        """Which tenant and key version watermarked this text, and for which registry entry?"""
        bank, refs = await self.key_bank()
        started = time.perf_counter()
        result = await self.offload(lambda: bank.search(token_ids))
        elapsed = time.perf_counter() - started
        num_tenants = len({t for t, _ in refs})
        candidates = [(*refs[c.index], c.log10_p_value) for c in result.top]
        significant = result.best is not None and result.p_value < significance
        if not significant or result.best is None:
            return ProvenanceOutcome(
                result, False, None, None, None, num_tenants, elapsed, None, candidates
            )
        tenant_id, version = refs[result.best.index]
        tenant = await self.store.get_tenant(tenant_id)
        lengths = await self.store.registry_bit_lengths(tenant_id, version) or [default_num_bits]
        decoded: DecodeOutcome | None = None
        for bits in lengths:
            outcome = (await self.decode_texts(tenant_id, [token_ids], bits, version))[0]
            if decoded is None or _better(outcome, decoded):
                decoded = outcome
        return ProvenanceOutcome(
            result,
            True,
            tenant,
            version,
            decoded,
            num_tenants,
            elapsed,
            bank.schemes[result.best.index],
            candidates,
        )


def _better(a: DecodeOutcome, b: DecodeOutcome) -> bool:
    """Prefer a registry match, then the more significant one, then the decode p-value."""
    if (a.entry is None) != (b.entry is None):
        return a.entry is not None
    if a.match is not None and b.match is not None and a.match.p_value != b.match.p_value:
        return a.match.p_value < b.match.p_value
    return a.result.detection.log10_p_value < b.result.detection.log10_p_value
