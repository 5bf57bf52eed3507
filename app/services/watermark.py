"""The watermark operations on a tenant's keys: decode, detect and provenance.

Decoding and detecting try every key version of the caller's tenant (Šidák-corrected
over them); provenance searches every tenant's every version through a
:class:`~worldcup_core.provenance.KeyBank`, built once and cached. The keys
themselves (their versions, unwrapping, the scheme cache) belong to
:class:`~app.services.tenants.TenantService`; the scoring runs in the bounded
CPU pool (:mod:`app.services.cpu`), never on the event loop.

**The model's evidence** (issue #44): where the served model is loaded, every test
(message-free, payload length known, registry, the decoder's per-bit evidence and
its list ranking) weighs each token by its informativeness under the model
(:mod:`app.services.weights`). The weights depend on the text and the model only,
so they are computed once per text (one batched request to the engine) and reused
under every key version and tenant searched; each answer names the statistic it
took (``model`` or ``model_free``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from app.engines.base import F64
from app.schemas.watermark import EvidenceOut
from app.services.cpu import TOKEN_CHARS, CpuPool, offload, offload_map
from app.services.evidence import evidence_block
from app.services.registry import NO_CLIENT, ClientCandidates, Found, Pending, RegistryLookup
from app.services.tenants import TenantService
from app.services.weights import ModelWeights, Statistic, statistic_of
from app.stores.base import RegistryEntry, Store, TenantRecord
from worldcup_core import DecodeResult, DetectionResult, WorldCup
from worldcup_core.assess import Assessment, TestP, assess
from worldcup_core.decoder import RegistryMatch
from worldcup_core.detector import z_from_log_p
from worldcup_core.detector_weighted import (
    best_verdict_log_p,
    verdict_decode_many,
    verdict_match,
    verdict_text_cells,
)
from worldcup_core.evidence import text_coverage
from worldcup_core.islands import Coverage
from worldcup_core.message import MessageIdCodec
from worldcup_core.provenance import KeyBank, ProvenanceResult
from worldcup_core.registry_lookup import U64, TextCells, payload_list
from worldcup_core.scoring import sidak_log_p
from worldcup_core.verdict import VERDICT_CLEAN_FROM

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
    registry_size: int | None = None  # the registry test's Bonferroni count, if it ran
    client_payload: bool = False  # the best candidate is a client-chosen payload


@dataclass(frozen=True)
class Deferred:
    """A small registry's match waiting for the recorded client payloads."""

    cells: TextCells
    listed: U64  # the text's likeliest payloads


@dataclass(frozen=True)
class DetectOutcome:
    key_version: int | None
    result: DetectionResult
    p_value: float  # corrected for the number of key versions tried
    z_score: float  # the normal quantile of the corrected p-value
    best_version: int | None = None  # the version with the smallest p, reported or not


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
    assessment: Assessment  # "watermarked by someone": every key searched
    # inconclusive: whose key the evidence leans towards (nothing is attributed), with
    # the best key's decoding and scheme for the analyst's evidence; None otherwise
    suspect: TenantRecord | None = None
    statistic: Statistic = "model_free"  # whether the model's token weights were used


@dataclass(frozen=True)
class Assessed:
    """One text's verdict for its asker (:mod:`worldcup_core.assess`) and the
    outcomes it was taken from: the message-free test and the decoding at each
    payload length tested."""

    assessment: Assessment
    detect: DetectOutcome
    decoded: dict[int, DecodeOutcome]
    statistic: Statistic = "model_free"  # whether the model's token weights were used
    weights: F64 | None = None  # the text's token weights (None: model-free)
    # the spoof-artifact check's outcome (app.services.artifact; None: not checked)
    artifact: str | None = None


@dataclass(frozen=True)
class VerdictStats:
    """The verdict's detection statistics of one text (:func:`verdict_stats`): log p and
    the key version, message-free and per payload length, each the best over versions."""

    detect: tuple[float, int]
    decode: dict[int, tuple[float, int]]


def verdict_stats(
    versions: Sequence[tuple[int, WorldCup]],
    texts: Sequence[list[int]],
    lengths: list[int],
    weights: Sequence[F64] | None = None,
) -> list[VerdictStats]:
    """The detect and decode tests of every text under every version (worker job);
    with ``weights`` (one array per text) model-assisted where the scheme allows."""
    schemes = [s for _, s in versions]
    free, free_best = best_verdict_log_p(schemes, texts, None, weights)
    known = {bits: best_verdict_log_p(schemes, texts, bits, weights) for bits in lengths}
    return [
        VerdictStats(
            (float(free[i]), versions[int(free_best[i])][0]),
            {b: (float(lp[i]), versions[int(at[i])][0]) for b, (lp, at) in known.items()},
        )
        for i in range(len(texts))
    ]


def assess_outcomes(
    stats: VerdictStats,
    decoded: dict[int, DecodeOutcome],
    lengths: list[int],
    registry_lengths: set[int],
    versions_tried: int,
    keys_searched: str,
    num_scored: int,
) -> Assessment:
    """The one verdict of a text (see :mod:`worldcup_core.assess`): the detect and decode
    tests from ``stats``, the registry test from each length's decoding as it comes;
    ``num_scored``, the tokens they read, decides whether absence may be said."""
    log_p, version = stats.detect
    tests = [TestP("detect", math.exp(log_p), key_version=version)]
    for bits in lengths:
        log_p, version = stats.decode[bits]
        tests.append(TestP("decode", math.exp(log_p), bits, key_version=version))
        if bits in registry_lengths:
            outcome = decoded[bits]
            match = outcome.match
            p = None if match is None else match.p_value
            size = outcome.registry_size
            tests.append(TestP("registry", p, bits, size, outcome.key_version))
    return assess(tests, versions_tried, keys_searched, num_scored)


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
        weights: ModelWeights | None = None,
    ) -> None:
        self.store = store
        self.weights = weights if weights is not None else ModelWeights(None)
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
        weights: Sequence[F64] | None = None,
    ) -> list[DecodeOutcome]:
        """Decode under each candidate key version, keep the most significant, and
        match it against that version's registry (:mod:`app.services.registry`: the
        registry's counters once per batch, then its cached payloads, or one lookup
        of the text's likeliest ids per text). ``weights``: the texts' token weights
        (:mod:`app.services.weights`), None for the model-free statistic."""
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

        per_text: list[F64 | None] = list(weights) if weights is not None else [None] * len(texts)
        items = list(zip(texts, per_text, strict=True))

        def work(
            chunk: list[tuple[list[int], F64 | None]],
        ) -> list[tuple[DecodeOutcome, Found | None, Pending | None, Deferred | None]]:
            out = []
            for token_ids, w in chunk:
                best: DecodeOutcome | None = None
                for v in versions:
                    result = verdict_decode_many(
                        v.scheme, [token_ids], num_bits, None if w is None else [w]
                    )[0]
                    if best is None or (
                        result.detection.log10_p_value < best.result.detection.log10_p_value
                    ):
                        best = DecodeOutcome(v.version, result, None, None)
                assert best is not None
                scheme = next(v.scheme for v in versions if v.version == best.key_version)
                plan = plans[best.key_version]
                found, pending, deferred = None, None, None
                if plan.candidates > 0:
                    cells = verdict_text_cells(scheme, token_ids, num_bits, w)
                    if plan.payloads is None:
                        pending = self.registry.prepare_list(plan, cells)
                    elif plan.client == 0:
                        found = self.registry.match_small(plan, cells)
                    else:  # matched once the recorded client payloads are known
                        listed = payload_list(cells, self.registry.list_size).payloads
                        deferred = Deferred(cells, listed)
                out.append((best, found, pending, deferred))
            return out

        # one job per chunk of texts: a big batch does not hold the workers for long
        decoded = await offload_map(self.cpu, work, items, lambda it: TOKEN_CHARS * len(it[0]))
        # client-chosen payloads recorded as candidates: those among each text's list
        client: dict[int, ClientCandidates] = {}
        for version, plan in plans.items():
            if plan.client == 0:
                continue
            asked: list[tuple[int, U64]] = []
            for n, (best, _, pending, deferred) in enumerate(decoded):
                if best.key_version != version:
                    continue
                if pending is not None:
                    asked.append((n, pending.plist.payloads))
                elif deferred is not None:
                    asked.append((n, deferred.listed))
            among = await self.registry.client_among(
                tenant_id, version, num_bits, [listed for _, listed in asked]
            )
            client.update({n: found for (n, _), found in zip(asked, among, strict=True)})
        waiting = [(best.key_version, p) for best, _, p, _ in decoded if p is not None]
        extras = [
            client.get(n, NO_CLIENT) for n, (_, _, p, _) in enumerate(decoded) if p is not None
        ]
        listed = iter(await self.registry.finish_lists(tenant_id, plans, waiting, extras))

        def small() -> list[Found | None]:
            return [
                self.registry.match_small(plans[best.key_version], d.cells, client.get(n))
                if d is not None
                else None
                for n, (best, _, _, d) in enumerate(decoded)
            ]

        deferred_found = (
            await self.offload(small) if any(d is not None for *_, d in decoded) else []
        )
        founds = [
            next(listed)
            if pending is not None
            else deferred_found[n]
            if deferred is not None
            else found
            for n, (_, found, pending, deferred) in enumerate(decoded)
        ]
        schemes = {v.version: v.scheme for v in versions}

        def rescore() -> list[Found | None]:
            """Each match with the registry test the verdict takes (layer-weighted, or
            model-weighted with the text's weights)."""
            return [
                None
                if found is None
                else replace(
                    found,
                    match=verdict_match(
                        schemes[best.key_version],
                        ids,
                        found.match,
                        plans[best.key_version].bonferroni,
                        w,
                    ),
                )
                for (ids, w), (best, *_), found in zip(items, decoded, founds, strict=True)
            ]

        founds = await self.offload(rescore)
        named = {
            n: found.message_id
            for n, found in enumerate(founds)
            if found is not None and not found.expired and not found.client
        }
        read = await self.store.registry_entries(tenant_id, list(named.values()))
        entries = dict(zip(named, read, strict=True))  # the batch's entries, one bulk read
        outcomes = []
        for n, ((best, *_), found) in enumerate(zip(decoded, founds, strict=True)):
            entry = entries.get(n)
            outcomes.append(
                DecodeOutcome(
                    best.key_version,
                    best.result,
                    found.match if found is not None else None,
                    entry,
                    len(versions),
                    found.match.bits if found is not None else None,
                    expired=found is not None and found.expired,
                    client_payload=found is not None and found.client,
                    registry_size=(
                        plans[best.key_version].bonferroni
                        if plans[best.key_version].candidates > 0
                        else None
                    ),
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
            shown = version if p_value < significance else None
            return DetectOutcome(shown, best, p_value, z, version)

        return one

    async def registry_lengths(self, tenant_id: str, versions: list[int]) -> list[int]:
        """The payload lengths at which the tenant has issued registry entries."""
        lengths: set[int] = set()
        for version in versions:
            lengths.update(await self.store.registry_bit_lengths(tenant_id, version))
        return sorted(lengths)

    async def assess_texts(
        self,
        tenant_id: str,
        texts: Sequence[list[int]],
        default_num_bits: int,
        significance: float,
        also_num_bits: int | None = None,
    ) -> list[Assessed]:
        """Every test the tenant's keys allow, on each text, combined into one verdict.

        The tests: the message-free one, and decoding (with the registry test) at each
        payload length the tenant has issued entries at, or at ``default_num_bits``
        when it has none; ``also_num_bits`` is decoded too (for a /decode at another
        length) but takes no part in the verdict, so the verdict is the same whatever
        a route asks for."""
        records = await self.tenants.versions(tenant_id)
        versions = [v.version for v in records]
        issued = await self.registry_lengths(tenant_id, versions)
        lengths = issued or [default_num_bits]
        wanted = lengths + (
            [also_num_bits] if also_num_bits is not None and also_num_bits not in lengths else []
        )
        weights = await self.weights.of(texts)  # once per text, for every version
        scorer = await self.detector(tenant_id, significance)
        detects = await offload_map(
            self.cpu,
            lambda chunk: [scorer(t) for t in chunk],
            texts,
            lambda t: TOKEN_CHARS * len(t),
        )
        decoded = {
            bits: await self.decode_texts(tenant_id, texts, bits, None, weights) for bits in wanted
        }
        pairs = [(v.version, v.scheme) for v in records]
        given: list[F64 | None] = list(weights) if weights is not None else [None] * len(texts)
        items = list(zip(texts, given, strict=True))

        def stats_of(chunk: list[tuple[list[int], F64 | None]]) -> list[VerdictStats]:
            held = [w for _, w in chunk if w is not None]
            return verdict_stats(pairs, [ids for ids, _ in chunk], lengths, held or None)

        stats = await offload_map(self.cpu, stats_of, items, lambda it: TOKEN_CHARS * len(it[0]))
        searched = f"tenant {tenant_id}'s {len(versions)} key version(s)"
        out = []
        for i, detect in enumerate(detects):
            by_length = {bits: decoded[bits][i] for bits in wanted}
            assessment = assess_outcomes(
                stats[i],
                by_length,
                lengths,
                set(issued),
                len(versions),
                searched,
                detect.result.num_scored_tokens,
            )
            deciding = [v.scheme for v in records if v.version == assessment.key_version]
            statistic = statistic_of(weights, deciding or [v.scheme for v in records])
            text_weights = None if weights is None else weights[i]
            out.append(Assessed(assessment, detect, by_length, statistic, text_weights))
        return out

    async def token_evidence(
        self, tenant_id: str, outcome: DecodeOutcome, ids: list[int], pieces: list[str]
    ) -> EvidenceOut:
        """The per-token evidence block of a decoded text, under the key that decoded it."""
        scheme = (await self.tenants.version(tenant_id, outcome.key_version)).scheme
        found = outcome.result
        return await self.offload(lambda: evidence_block(scheme, ids, pieces, found))

    async def coverage(
        self, tenant_id: str, items: Sequence[tuple[list[int], int, int]]
    ) -> list[Coverage]:
        """The watermark's coverage of each (token ids, key version, payload length),
        under that key version (:func:`worldcup_core.evidence.text_coverage`)."""
        schemes = {
            v: (await self.tenants.version(tenant_id, v)).scheme for v in {v for _, v, _ in items}
        }
        return await self.offload(
            lambda: [text_coverage(schemes[v], ids, bits) for ids, v, bits in items]
        )

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
        keys = f"every tenant's key versions ({result.num_keys} keys, {num_tenants} tenants)"
        if result.best is None:
            tried = max(result.num_keys, 1)
            none = assess([TestP("detect", None)], tried, keys, result.num_scored_tokens)
            return ProvenanceOutcome(
                result, False, None, None, None, num_tenants, elapsed, None, candidates, none
            )
        tenant_id, version = refs[result.best.index]
        issued = await self.store.registry_bit_lengths(tenant_id, version)
        lengths = issued or [default_num_bits]
        # the key search above screens on the model-free statistic (a union bound over
        # every key in the bank covers any choice); the chosen key's tests are weighted
        weights = await self.weights.of([token_ids])
        decoded = {
            bits: (await self.decode_texts(tenant_id, [token_ids], bits, version, weights))[0]
            for bits in lengths
        }
        # the best key's tests, each corrected for the search (every key in the bank)
        best_scheme = bank.schemes[result.best.index]
        statistic = statistic_of(weights, [best_scheme])
        stats = await self.offload(
            lambda: verdict_stats([(version, best_scheme)], [token_ids], lengths, weights)[0]
        )
        assessment = assess_outcomes(
            stats, decoded, lengths, set(issued), result.num_keys, keys, result.num_scored_tokens
        )
        if assessment.p_value >= VERDICT_CLEAN_FROM:  # no evidence: nobody to lean to
            return ProvenanceOutcome(
                result,
                False,
                None,
                None,
                None,
                num_tenants,
                elapsed,
                None,
                candidates,
                assessment,
                statistic=statistic,
            )
        tenant = await self.store.get_tenant(tenant_id)
        found = assessment.is_watermarked  # else inconclusive: the lean, named, not attributed
        return ProvenanceOutcome(
            result,
            found,
            tenant if found else None,
            version,
            decoded[best_length(decoded)],
            num_tenants,
            elapsed,
            bank.schemes[result.best.index],
            candidates,
            assessment,
            suspect=None if found else tenant,
            statistic=statistic,
        )


def best_length(decoded: dict[int, DecodeOutcome]) -> int:
    """Of a text's decodings by payload length, the one an answer shows: the length
    whose registry entry is found (:func:`_better`), so the answer shows the entry, the
    near tie or the expiry its verdict saw."""
    best: int | None = None
    for bits, outcome in decoded.items():
        if best is None or _better(outcome, decoded[best]):
            best = bits
    assert best is not None, "no decoding"
    return best


def _better(a: DecodeOutcome, b: DecodeOutcome) -> bool:
    """Prefer a registry match, then the more significant one, then the decode p-value."""
    if (a.entry is None) != (b.entry is None):
        return a.entry is not None
    if a.match is not None and b.match is not None and a.match.p_value != b.match.p_value:
        return a.match.p_value < b.match.p_value
    return a.result.detection.log10_p_value < b.result.detection.log10_p_value
