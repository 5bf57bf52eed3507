"""What the lifespan builds once and every request shares, and the per-tenant rate
limit every route charges against it."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from app.core.config import Settings
from app.core.errors import APIError
from app.core.metrics import Metrics
from app.engines.base import Engine
from app.services.cpu import CpuPool, offload, offload_map
from app.services.probes import ProbeAccountant
from app.services.tenants import TenantService
from app.services.watermark import WatermarkService
from app.stores.base import Store, TenantRecord

T = TypeVar("T")
X = TypeVar("X")
Y = TypeVar("Y")


@dataclass
class Runtime:
    """What the lifespan builds once and every request shares."""

    settings: Settings
    metrics: Metrics
    store: Store
    tenants: TenantService  # tenants, API keys, key versions
    watermark: WatermarkService  # decode, detect, provenance (and the CPU pool)
    tokenizer: Any
    model_id: str
    engine: Engine | None = None  # None in the detector role
    probes: ProbeAccountant | None = None
    warm: bool = False
    draining: bool = False
    marker: str | None = None  # the store's marker, once seen (see /ready)
    cpu: CpuPool | None = None  # the bounded worker pool of requests' CPU work

    async def offload(self, fn: Callable[[], T]) -> T:
        """Run a request's CPU work (tokenising, scoring) off the event loop."""
        return await offload(self.cpu, fn)

    async def offload_map(
        self,
        fn: Callable[[list[X]], list[Y]],
        items: Sequence[X],
        weight: Callable[[X], int] = len,  # type: ignore[assignment]
    ) -> list[Y]:
        """A batch's CPU work in chunks of bounded size, each its own job, so one bulk
        request cannot hold the workers for long (see :meth:`CpuPool.map`)."""
        return await offload_map(self.cpu, fn, items, weight)


async def charge(runtime: Runtime, tenant: TenantRecord, cost: int = 1) -> None:
    """Take ``cost`` tokens from the tenant's bucket (in the store, so every replica
    shares it) or answer 429 with Retry-After. A cost above the burst is capped at
    the burst: a full bucket always admits one maximal batch."""
    await _take(runtime, tenant.tenant_id, cost)


def client_bucket(host: str | None) -> str:
    """The rate bucket of an unauthenticated caller (the console's sign-in check), by
    its address: hashed (an IPv6 ':' may not appear in a bucket id) and prefixed
    with ``client-`` so it can never be a tenant id (those are bare hex)."""
    digest = hashlib.sha256((host or "unknown").encode()).hexdigest()[:24]
    return f"client-{digest}"


async def charge_client(runtime: Runtime, host: str | None) -> None:
    """The tenant rate limit's bucket, rate and burst, per client address: for checks
    that come before any credential is known to be good, so a bad one is limited too."""
    await _take(runtime, client_bucket(host), 1)


async def _take(runtime: Runtime, bucket: str, cost: int) -> None:
    settings = runtime.settings
    if settings.rate_limit_per_s <= 0:
        return
    burst = settings.rate_limit_burst
    decision = await runtime.store.take_tokens(
        bucket, settings.rate_limit_per_s, burst, min(cost, burst)
    )
    if not decision.allowed:
        runtime.metrics.rejections.labels("rate_limited").inc()
        retry = max(1, math.ceil(decision.retry_after_s))
        raise APIError(
            429,
            f"rate limit exceeded ({settings.rate_limit_per_s:g} requests/s, burst {burst}); "
            f"retry in {retry} s",
            "rate_limited",
            {"Retry-After": str(retry)},
        )
