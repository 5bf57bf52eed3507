"""Readiness: what ``GET /ready`` answers and what a Ray Serve replica's health check asks.

One function, so the route and the Serve health check (:mod:`app.serve`) can never
disagree about when a replica may take traffic.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from app.services.runtime import Runtime
from app.stores.base import StoreUnavailable


@dataclass(frozen=True)
class NotReady:
    """Why this process should not take traffic now (``/ready``'s 503)."""

    code: str  # draining, warming_up, store_unavailable, store_marker_lost
    message: str


async def not_ready(runtime: Runtime) -> NotReady | None:
    """None when the model is warm and the store answers with this service's marker."""
    if runtime.draining:
        return NotReady("draining", "draining for shutdown")
    if not runtime.warm:
        return NotReady("warming_up", "model is loading")
    try:
        await runtime.store.ping()
        if runtime.marker is None:  # the store was down at startup: first contact now
            runtime.marker = await runtime.store.ensure_marker(uuid.uuid4().hex)
        elif await runtime.store.marker() != runtime.marker:
            return NotReady(
                "store_marker_lost",
                "the store has lost this service's marker: it was wiped or replaced, so "
                "tenants and registries are gone; restore it (or restart to start afresh)",
            )
    except StoreUnavailable:
        return NotReady("store_unavailable", "the registry store is unreachable")
    return None
