"""A store deadline that passes while the service's own event loop is stalled (CPU or
GIL starvation, a blocking callback) measures the process, not Redis: the fault soak
saw 503 ``store_unavailable`` on a loaded 2-core machine tens of seconds before Redis
was killed. Such a call gets one fresh deadline; a store that really hangs still
answers 503 within about one deadline, and a stall on every attempt within two."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_store_contract import REDIS_URL, redis_namespace

from app.stores.base import StoreUnavailable
from app.stores.redis import RedisStore
from app.stores.redis_base import stall_allowance

pytestmark = pytest.mark.anyio

TIMEOUT_S = 0.2


async def test_a_stalled_loop_is_not_a_store_outage() -> None:
    async with redis_namespace() as prefix:
        store = RedisStore(REDIS_URL, prefix=prefix, timeout_s=TIMEOUT_S)
        try:
            calls = 0

            async def stalls_once() -> str:
                nonlocal calls
                calls += 1
                if calls == 1:
                    time.sleep(2 * TIMEOUT_S)  # blocks the loop past the deadline
                    await asyncio.sleep(0.01)  # awaiting the reply: the late timer fires
                return "ok"

            assert await store._retry(stalls_once) == "ok" and calls == 2

            async def stalls_always() -> str:
                time.sleep(2 * TIMEOUT_S)
                await asyncio.sleep(0.01)
                return "never"

            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="TimeoutError"):
                await store._retry(stalls_always)
            assert time.monotonic() - t0 < 5 * TIMEOUT_S  # one extension, not more

            await store.ping()  # the client still works
        finally:
            await store.close()


async def test_a_hung_store_gets_no_extension() -> None:
    """The loop runs on time while the store does not answer: 503 after one deadline."""
    async with redis_namespace() as prefix:
        store = RedisStore(REDIS_URL, prefix=prefix, timeout_s=1.0)
        try:

            async def hangs() -> str:
                await asyncio.sleep(10)
                return "never"

            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="TimeoutError"):
                await store._retry(hangs)
            assert 1.0 <= time.monotonic() - t0 < 1.5  # an extension would take 2 s
        finally:
            await store.close()


def test_stall_allowance_scales_with_the_deadline() -> None:
    assert stall_allowance(0.1) == 0.05
    assert stall_allowance(2.0) == pytest.approx(0.4)
