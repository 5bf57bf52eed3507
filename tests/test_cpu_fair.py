"""Issue 24, point 5: fair shares of the CPU pool between tenants.

Event-driven throughout: workers are held on ``threading.Event``s and the tests
wait for conditions (a job started, N jobs queued), never for a timer, so the
order the pool chose is what is asserted. Unit tests over ``CpuPool`` first,
then one test through the real app (tiny model) that the share is the tenant
of the API key.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_service_api import make_settings, new_tenant

import app.services.intake as intake_module
from app.services.cpu import ADMIN_SHARE, CpuPool, Overloaded, current_share, set_share

T = TypeVar("T")
WAIT_S = 30.0  # only a bound on a test that hangs: no outcome depends on it


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until ``condition`` holds (tasks reach their first await)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


class Blocker:
    """A job that signals ``started`` and holds its worker until ``release`` is set."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.release.wait(WAIT_S), "the test never released the worker"
        return "blocker"


async def hold_workers(pool: CpuPool, share: str) -> list[Blocker]:
    """Occupy every worker of ``pool`` with one running job of ``share``."""
    blockers = [Blocker() for _ in range(pool.workers)]
    for b in blockers:
        asyncio.ensure_future(pool.run(b, share=share))
        await until(lambda b=b: b.started.is_set())  # type: ignore[misc]
    return blockers


class Log:
    """Jobs that append their name, in the order the workers start them."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self._lock = threading.Lock()

    def job(self, name: str) -> Callable[[], str]:
        def fn() -> str:
            with self._lock:
                self.order.append(name)
            return name

        return fn

    def chunk_job(self, name: str) -> Callable[[list[int]], list[int]]:
        def fn(chunk: list[int]) -> list[int]:
            with self._lock:
                self.order.append(name)
            return [2 * x for x in chunk]

        return fn


@pytest.mark.parametrize("workers", [1, 4])
def test_another_tenants_job_runs_after_at_most_one_of_the_backlog(workers: int) -> None:
    """Every worker busy with tenant A; A queues 40 more jobs, then B queues one. When
    one worker frees, B's job starts after at most one of A's, not after all 40."""

    async def main() -> list[str]:
        pool = CpuPool(workers, 1000)
        log = Log()
        try:
            blockers = await hold_workers(pool, "A")
            backlog = [asyncio.ensure_future(pool.run(log.job("A"), share="A")) for _ in range(40)]
            await until(lambda: pool.queued("A") == 40)
            single = asyncio.ensure_future(pool.run(log.job("B"), share="B"))
            await until(lambda: pool.queued("B") == 1)
            blockers[0].release.set()  # one worker frees; the others stay held
            assert await single == "B"
            for b in blockers[1:]:
                b.release.set()
            await asyncio.gather(*backlog)
            return log.order
        finally:
            for b in blockers:
                b.release.set()
            pool.close()

    order = run(main())
    assert len(order) == 41
    assert order.index("B") <= 1, order


def test_first_come_first_served_makes_it_wait_for_the_whole_backlog() -> None:
    """The same scenario under ``fair=False`` (the old pool): B waits for all of A's
    jobs. The fair test above can fail, and this is what it guards against."""

    async def main() -> list[str]:
        pool = CpuPool(1, 1000, fair=False)
        log = Log()
        try:
            (blocker,) = await hold_workers(pool, "A")
            backlog = [asyncio.ensure_future(pool.run(log.job("A"), share="A")) for _ in range(40)]
            await until(lambda: pool.queued() == 40)
            single = asyncio.ensure_future(pool.run(log.job("B"), share="B"))
            await until(lambda: pool.queued() == 41)
            blocker.release.set()
            await asyncio.gather(single, *backlog)
            return log.order
        finally:
            blocker.release.set()
            pool.close()

    assert run(main()).index("B") == 40


def test_a_batch_is_split_into_chunks_and_another_tenant_gets_in_between() -> None:
    """A's batch of 60 items (10 characters each, chunks of 30) is 20 jobs; B's single
    job, queued after the whole batch, starts after at most one chunk of it."""

    async def main() -> tuple[list[str], list[int]]:
        pool = CpuPool(1, 100, chunk_chars=30)
        log = Log()
        try:
            (blocker,) = await hold_workers(pool, "A")
            items = list(range(60))
            batch = asyncio.ensure_future(
                pool.map(log.chunk_job("A"), items, weight=lambda _: 10, share="A")
            )
            await until(lambda: pool.queued("A") == 20)
            single = asyncio.ensure_future(pool.run(log.job("B"), share="B"))
            await until(lambda: pool.queued("B") == 1)
            assert pool.pending == 3  # admission is per call: blocker, batch, single
            blocker.release.set()
            assert await single == "B"
            return log.order, await batch
        finally:
            blocker.release.set()
            pool.close()

    order, doubled = run(main())
    assert doubled == [2 * x for x in range(60)]  # chunk results concatenated in order
    assert order.count("A") == 20
    assert order.index("B") <= 1, order


def test_chunks_respect_the_size_and_keep_oversized_items_whole() -> None:
    async def main() -> list[list[int]]:
        pool = CpuPool(2, 10, chunk_chars=100)
        seen: list[list[int]] = []
        lock = threading.Lock()

        def fn(chunk: list[int]) -> list[int]:
            with lock:
                seen.append(chunk)
            return chunk

        try:
            items = [40, 40, 40, 250, 10, 90, 5]
            assert await pool.map(fn, items, weight=lambda x: x, share="A") == items
            return sorted(seen)
        finally:
            pool.close()

    assert run(main()) == sorted([[40, 40], [40], [250], [10, 90], [5]])


def test_fifo_pool_runs_a_batch_as_one_job() -> None:
    async def main() -> int:
        pool = CpuPool(1, 10, chunk_chars=1, fair=False)
        calls: list[int] = []
        try:
            out = await pool.map(lambda c: calls.append(len(c)) or c, [1, 2, 3], weight=lambda _: 5)
            assert out == [1, 2, 3]
            return len(calls)
        finally:
            pool.close()

    assert run(main()) == 1


def test_one_tenant_is_shed_at_its_own_bound_while_others_are_admitted() -> None:
    async def main() -> None:
        pool = CpuPool(1, 4, retry_after_s=3, max_pending_per_share=2)
        gate = Blocker()
        try:
            held = [asyncio.ensure_future(pool.run(gate, share="A")) for _ in range(2)]
            await until(gate.started.is_set)
            with pytest.raises(Overloaded) as caught:
                await pool.run(gate, share="A")
            assert caught.value.scope == "share"
            assert caught.value.retry_after_s == 3
            assert pool.pending_of("A") == 2
            others = [asyncio.ensure_future(pool.run(gate, share=s)) for s in ("B", "C")]
            await until(lambda: pool.pending == 4)
            with pytest.raises(Overloaded) as caught:  # now the global bound
                await pool.run(gate, share="D")
            assert caught.value.scope == "pool"
            gate.release.set()
            await asyncio.gather(*held, *others)
            assert pool.pending == 0 and pool.pending_of("A") == 0
            assert await pool.run(lambda: "again", share="A") == "again"
        finally:
            gate.release.set()
            pool.close()

    run(main())


def test_a_cancelled_requests_queued_jobs_are_dropped() -> None:
    """Cancelled while queued: its jobs leave the queue at once, never run, and its
    admission is freed; a cancelled running job keeps its admission until it ends."""

    async def main() -> None:
        pool = CpuPool(1, 10)
        log = Log()
        try:
            (blocker,) = await hold_workers(pool, "A")
            single = asyncio.ensure_future(pool.run(log.job("single"), share="B"))
            batch = asyncio.ensure_future(
                pool.map(log.chunk_job("batch"), list(range(8)), weight=lambda _: 10**6, share="B")
            )
            await until(lambda: pool.queued("B") == 9)
            assert pool.pending == 3
            single.cancel()
            batch.cancel()
            await until(lambda: single.done() and batch.done())
            assert pool.queued() == 0
            assert pool.pending == 1 and pool.pending_of("B") == 0
            # the running job: its caller gives up, the worker is still busy with it
            running = next(t for t in asyncio.all_tasks() if t is not asyncio.current_task())
            running.cancel()
            await until(running.done)
            assert pool.pending == 1, "a running job holds its admission until it ends"
            blocker.release.set()
            assert await pool.run(log.job("after"), share="C") == "after"
            assert pool.pending == 0
            assert log.order == ["after"], "a dropped job must never run"
        finally:
            blocker.release.set()
            pool.close()

    run(main())


def test_exceptions_reach_the_caller_and_free_the_admission() -> None:
    async def main() -> None:
        pool = CpuPool(2, 10, chunk_chars=1)

        def boom(chunk: list[int]) -> list[int]:
            if 3 in chunk:
                raise ValueError("bad item")
            return chunk

        try:
            with pytest.raises(ValueError, match="bad item"):
                await pool.map(boom, [1, 2, 3, 4], weight=lambda _: 1, share="A")
            await until(lambda: pool.pending == 0)
            with pytest.raises(ValueError, match="one result per item"):
                await pool.map(lambda c: [], [1], weight=lambda _: 1, share="A")
        finally:
            pool.close()

    run(main())


def test_the_share_comes_from_the_request_context() -> None:
    async def main() -> None:
        pool = CpuPool(1, 10)
        try:
            (blocker,) = await hold_workers(pool, "X")

            async def request(share: str) -> str:
                set_share(share)  # what the authentication dependency does
                return await pool.run(lambda: share)

            tasks = [asyncio.ensure_future(request(s)) for s in ("t1", ADMIN_SHARE)]
            await until(lambda: pool.queued("t1") == 1 and pool.queued(ADMIN_SHARE) == 1)
            assert pool.queued() == 2 and current_share() == "-"  # the tasks' own contexts
            blocker.release.set()
            assert await asyncio.gather(*tasks) == ["t1", ADMIN_SHARE]
        finally:
            blocker.release.set()
            pool.close()

    run(main())


# through the app ---------------------------------------------------------------------
TEXT = (
    "The storm reached the coast late on Tuesday, and by morning the harbour "
    "was full of broken boats and the streets were under water."
)


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    return create_fair_app(tiny_model_dir, tmp_path_factory.mktemp("db"))


def create_fair_app(model_dir: Path, db_dir: Path) -> FastAPI:
    from app.main import create_app

    return create_app(
        make_settings(
            model_dir,
            db_dir,
            cpu_workers=1,
            cpu_max_pending=8,
            cpu_chunk_chars=len(TEXT),  # one chunk per text
            probe_budget_verdict=0,
            probe_budget_full=0,
        )
    )


@pytest.fixture(scope="module")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


class OrderedGate:
    """Replaces the tokenizer call of the scoring routes: records which text each job
    tokenised, and holds the first job until ``release`` is set."""

    def __init__(self, real: Callable[[Any, list[str]], list[list[int]]]) -> None:
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, tokenizer: Any, texts: list[str]) -> list[list[int]]:
        with self._lock:
            first = not self.calls
            self.calls.extend(t[:6] for t in texts)
        if first:
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the gate"
        return self.real(tokenizer, texts)


def test_another_tenants_detect_overtakes_a_bulk_batch(
    client: TestClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker. Tenant A's first request holds it; A's /detect/batch of 30 texts
    queues 30 chunks; tenant B's /detect, sent after, is tokenised after at most one
    of them. The share is the tenant of the API key (set by the auth dependency)."""
    gate = OrderedGate(intake_module.encode_texts)
    monkeypatch.setattr(intake_module, "encode_texts", gate)
    _, auth_a = new_tenant(client)
    _, auth_b = new_tenant(client)
    pool = app.state.runtime.cpu
    with ThreadPoolExecutor(3) as ex:
        try:
            body = {"text": "first " + TEXT}
            first = ex.submit(client.post, "/detect", json=body, headers=auth_a)
            assert gate.entered.wait(WAIT_S)
            texts = [f"bulk{i:02d} {TEXT}" for i in range(30)]
            bulk = ex.submit(client.post, "/detect/batch", json={"texts": texts}, headers=auth_a)
            while pool.queued() < 30:  # event-driven: the batch's chunks are queued
                assert not bulk.done(), bulk.result().text
                threading.Event().wait(0.001)
            body = {"text": "other " + TEXT}
            single = ex.submit(client.post, "/detect", json=body, headers=auth_b)
            while pool.queued() < 31:
                assert not single.done(), single.result().text
                threading.Event().wait(0.001)
        finally:
            gate.release.set()
        assert first.result(WAIT_S).status_code == 200
        assert single.result(WAIT_S).status_code == 200
        r = bulk.result(WAIT_S)
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 30
    after_first = gate.calls[1:]
    assert after_first.count("other ") == 1
    assert after_first.index("other ") <= 1, after_first


def test_one_tenant_at_its_bound_gets_503_while_another_is_admitted(
    client: TestClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-tenant shedding through the app: A's first request holds the one worker,
    A's second is refused at once (503 overloaded, Retry-After, the tenant's bound
    named), B's is admitted and answered once the worker frees."""
    from test_service_api import assert_error

    gate = OrderedGate(intake_module.encode_texts)
    monkeypatch.setattr(intake_module, "encode_texts", gate)
    monkeypatch.setattr(app.state.runtime.cpu, "max_pending_per_share", 1)
    _, auth_a = new_tenant(client)
    _, auth_b = new_tenant(client)
    with ThreadPoolExecutor(2) as ex:
        try:
            first = ex.submit(client.post, "/detect", json={"text": TEXT}, headers=auth_a)
            assert gate.entered.wait(WAIT_S)
            r = client.post("/detect", json={"text": TEXT}, headers=auth_a)
            err = assert_error(r, 503, "overloaded")
            assert "tenant" in err["message"]
            assert r.headers["Retry-After"] == "1"
            other = ex.submit(client.post, "/detect", json={"text": TEXT}, headers=auth_b)
            pool = app.state.runtime.cpu
            while pool.queued() < 1:  # B's job is admitted and waiting for the worker
                assert not other.done(), other.result().text
                threading.Event().wait(0.001)
        finally:
            gate.release.set()
        assert first.result(WAIT_S).status_code == 200
        assert other.result(WAIT_S).status_code == 200
    assert client.post("/detect", json={"text": TEXT}, headers=auth_a).status_code == 200


# the benchmark's side-by-side "before" -----------------------------------------------
def test_the_benchmarks_fcfs_pool_is_the_old_pool_and_its_report_reads() -> None:
    from worldcup_cli.service_bench import (
        _fair_targets,
        _FirstComeFirstServed,
        format_fair_shares,
    )

    async def main() -> list[int]:
        pool = _FirstComeFirstServed(1, 2)
        sizes: list[int] = []
        try:
            out = await pool.map(lambda c: sizes.append(len(c)) or c, list(range(50)))
            assert out == list(range(50))
            return sizes
        finally:
            pool.close()

    assert run(main()) == [50]  # a batch is one job, as before fair shares
    mode = {
        "other_detect_p50_ms": 1.0,
        "other_detect_p99_ms": 2.0,
        "other_detect_max_ms": 3.0,
        "other_detect_answered": 4,
        "bulk_batches_ok": 5,
        "bulk_batches_shed": 0,
        "detect_rps_16": [100.0, 110.0],
        "detect_rps_16_mean": 105.0,
        "detect_p99_ms_16": 9.0,
    }
    fs = {
        "seconds_per_phase": 5.0,
        "rounds": 2,
        "bulk": "load",
        "chunk_chars": 16000,
        "workers": 4,
        "fcfs": {**mode, "other_detect_p99_ms": 9000.0},
        "fair": mode,
        "detect_rps_ratio_fair_over_fcfs": 0.85,
    }
    text = "\n".join(format_fair_shares(fs))
    assert "9000ms" in text and "0.850" in text
    targets = _fair_targets(fs)
    assert targets["other_tenant_detect_p99_ms_under_bulk"]["passed"] is True
    assert targets["other_tenant_p99_fair_over_fcfs"]["measured"] == round(2 / 9000, 3)
    assert targets["detect_rps_fair_over_fcfs"]["passed"] is False  # 0.85 < 0.9
