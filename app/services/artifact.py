"""The spoof-artifact check on "watermarked" answers, in shadow (issue #45).

A watermark-stealing spoof carries the watermark only in the contexts its maker saw
often in the tenant's answers; a genuine text carries it in rare contexts too
(:mod:`worldcup_core.context_sketch`). The service counts the contexts of every
watermarked text it returns (:func:`app.services.generation.record_contexts`), and
here reads a "watermarked" text's evidence against those counts, under the key
version and payload length that decided.

It never changes a verdict. By default it only counts: the cost of a gate on genuine
answers grows with a tenant's volume (more of its contexts become common), and that
has to be measured where the volume is. So each check is counted, by route and
outcome, in ``worldcup_spoof_artifact_checks_total``: an operator sees what a gate
would take on the deployment's own traffic (route ``detect``: the tenants' own
checks) before turning on ``spoof_artifact_action="withhold_entry"``, under which a
flagged text names no registry entry (:mod:`app.services.detection`,
:mod:`app.services.provenance`). The check never fails an answer: a store error is
the outcome ``unavailable``, and then an entry is named as without the check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Literal

from app.services.runtime import Runtime
from app.services.watermark import Assessed, best_length
from worldcup_core.context_sketch import (
    Split,
    context_cells,
    leave_one_out,
    split_evidence,
    spoof_artifact,
)
from worldcup_core.evidence import text_evidence
from worldcup_core.scheme import WorldCup

logger = logging.getLogger(__name__)

Outcome = Literal["flagged", "clear", "one_group", "unavailable"]
Route = Literal["detect", "provenance"]


def _marks(
    scheme: WorldCup, ids: list[int], num_bits: int, width_log2: int
) -> tuple[list[float], list[list[int]]]:
    """The text's scored tokens' leave-one-out z and their contexts' cells in a sketch of
    ``2**width_log2`` counters a row (worker job)."""
    marks = [m for m in text_evidence(scheme, ids, num_bits) if m.z is not None]
    width = scheme.config.context_width
    cells = context_cells(scheme.key, ids, [m.index for m in marks], width, width_log2=width_log2)
    return [float(m.z or 0.0) for m in marks], cells.tolist()


def outcome_of(split: Split) -> Outcome:
    if spoof_artifact(split):
        return "flagged"
    return "one_group" if split.rare == 0 or split.common == 0 else "clear"


async def check(
    runtime: Runtime, tenant_id: str, ids: Sequence[list[int]], assessed: Sequence[Assessed]
) -> list[Outcome | None]:
    """Each watermarked text's outcome (None for the others), counted in the metric."""
    out: list[Outcome | None] = [None] * len(ids)
    want = [  # the payload length that decided, else the one the answer shows
        (i, a.assessment.key_version, a.assessment.num_bits or best_length(a.decoded))
        for i, a in enumerate(assessed)
        if a.assessment.is_watermarked and a.assessment.key_version is not None
    ]
    got = await asyncio.gather(
        *(
            check_one(runtime, tenant_id, ids[i], version, bits, "detect")
            for i, version, bits in want
        )
    )
    for (i, _, _), outcome in zip(want, got, strict=True):
        out[i] = outcome
    return out


async def check_one(
    runtime: Runtime,
    tenant_id: str,
    ids: list[int],
    key_version: int,
    num_bits: int,
    route: Route,
) -> Outcome:
    """One watermarked text's outcome under the key version and payload length that
    decided (/provenance's, whose search named the tenant), counted in the metric."""
    outcome = await _one(runtime, tenant_id, ids, key_version, num_bits)
    runtime.metrics.spoof_artifact.labels(route, outcome).inc()
    return outcome


def withholds(runtime: Runtime, outcome: str | None) -> bool:
    """Whether an answer names no registry entry for this outcome: a flagged text, with
    ``spoof_artifact_action="withhold_entry"`` (the verdict is never changed)."""
    gate = runtime.settings.spoof_artifact_action == "withhold_entry"
    return gate and outcome == "flagged"


async def _one(
    runtime: Runtime, tenant_id: str, ids: list[int], key_version: int, num_bits: int
) -> Outcome:
    if not runtime.settings.count_contexts:
        return "unavailable"
    try:
        key = await runtime.tenants.version(tenant_id, key_version)
        zs, cells = await runtime.offload(
            lambda: _marks(key.scheme, ids, num_bits, key.sketch_width_log2)
        )
        counts = await runtime.store.context_counts(
            tenant_id, key_version, cells, key.sketch_width_log2
        )
    except Exception as exc:  # a store outage, a key version gone: no check, no failure
        logger.warning("spoof-artifact check not run (%s)", type(exc).__name__)
        return "unavailable"
    return outcome_of(split_evidence(zs, leave_one_out(counts)))
