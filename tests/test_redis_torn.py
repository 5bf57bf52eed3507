"""redis-py races a topology change: a connection torn down by one coroutine while
another still writes on it raises AttributeError from inside redis-py (seen as a 500
in the cluster failover soak). The store maps it to an outage: retried once on a fresh
map, then StoreUnavailable (503), never an unhandled error; the same error raised by
our own code stays a bug."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from test_store_contract import REDIS_URL, redis_namespace

from app.stores.base import StoreUnavailable
from app.stores.redis import RedisStore
from app.stores.redis_base import torn_connection, unavailable

pytestmark = pytest.mark.anyio


async def _torn() -> BaseException:
    """The race itself: a write on a connection whose writer was already dropped."""
    conn = Connection()
    conn._writer = None
    try:
        await conn._send_packed_command([b"PING\r\n"])
    except Exception as exc:  # noqa: BLE001 - the error redis-py raises
        return exc
    raise AssertionError("the torn write did not fail")


async def test_torn_connection_is_an_outage_ours_is_a_bug() -> None:
    exc = await _torn()
    assert isinstance(exc, AttributeError) and "writelines" in str(exc)
    assert torn_connection(exc) and unavailable(exc)
    writer = None
    try:
        writer.writelines([b""])  # type: ignore[attr-defined]  # the same error, ours
    except AttributeError as ours:
        assert not torn_connection(ours) and not unavailable(ours)
    assert not torn_connection(ValueError("NoneType"))
    assert not torn_connection(RuntimeError("the handler is closed"))  # not from redis-py


async def test_closed_transport_is_an_outage() -> None:
    """uvloop's variant: the write reaches a transport already closed."""

    class Closed:
        def writelines(self, data: object) -> None:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; "
                               "the handler is closed")  # fmt: skip

    conn = Connection()
    conn._writer = Closed()  # type: ignore[assignment]
    with pytest.raises(RuntimeError) as info:
        await conn._send_packed_command([b"PING\r\n"])
    assert torn_connection(info.value) and unavailable(info.value)


async def test_store_retries_a_torn_call_then_answers_unavailable() -> None:
    async with redis_namespace() as prefix:
        store = RedisStore(REDIS_URL, prefix=prefix)
        try:
            calls = 0

            async def torn_once() -> str:
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise await _torn()
                return "ok"

            assert await store._retry(torn_once) == "ok" and calls == 2  # retried

            async def always_torn() -> str:
                raise await _torn()

            with pytest.raises(StoreUnavailable, match="AttributeError"):
                await store._retry(always_torn)

            async def ours() -> str:
                raise AttributeError("'NoneType' object has no attribute 'x'")

            with pytest.raises(AttributeError):  # a bug of ours is not hidden as a 503
                await store._retry(ours)
            with pytest.raises(StoreUnavailable):
                async with store._guard():
                    raise await _torn()
        finally:
            await store.close()
