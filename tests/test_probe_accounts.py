"""The probe accounts' lifetime and the full-answer count (app.services.probes) on the
default store, SQLite, under a fake clock: an account lives a window after its *last*
query, and a text's spent full answers stay spent however many other queries the store
sees in between (its periodic sweep once handed them back every 256 calls). Finding
or opening an account is one step on SQLite, Redis and a Redis Cluster: variants of a
never-asked text sent all at once share one account, and its full answers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from test_store_contract import FakeClock, clock, store  # noqa: F401 - fixtures

from app.core.metrics import Metrics
from app.services.probes import ProbeAccountant, probe_secret
from app.stores.base import Store
from app.stores.sqlite import SQLiteStore

WINDOW = 100.0
TENANT = "acme"


@pytest.fixture
async def accountant(
    tmp_path: Path,
    clock: FakeClock,  # noqa: F811 - the fixture
) -> AsyncIterator[ProbeAccountant]:
    sqlite = SQLiteStore(tmp_path / "probes.sqlite3", clock=clock)
    try:
        yield ProbeAccountant(
            sqlite, probe_secret(b"k" * 32), Metrics(), WINDOW, 30, 10, None, full_answers=3
        )
    finally:
        await sqlite.close()


def text(seed: int, length: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49_000) for _ in range(length)]


async def full(accountant: ProbeAccountant, tokens: list[int]) -> bool:
    (admission,) = await accountant.admit(TENANT, "k1", "full", accountant.sketches([tokens]))
    assert admission.decision.allowed
    return admission.full


@pytest.mark.anyio
async def test_spent_full_answers_survive_the_stores_sweep(accountant: ProbeAccountant) -> None:
    target = text(0)
    assert [await full(accountant, target) for _ in range(4)] == [True, True, True, False]
    # 300 queries about other texts: more than the SQLite store's sweep interval (256
    # probe calls), each one a new account with its own full answer
    for seed in range(1, 301):
        assert await full(accountant, text(seed))
    assert not await full(accountant, target)


@pytest.mark.anyio
async def test_an_account_lives_a_window_after_its_last_query(
    accountant: ProbeAccountant,
    clock: FakeClock,  # noqa: F811 - the fixture
) -> None:
    target = text(7)
    edited = list(target)
    edited[100] = 12_345  # a one-token edit: the same account, which does not move
    assert await full(accountant, target)  # t = 0
    clock.now += 0.9 * WINDOW
    assert [await full(accountant, edited) for _ in range(3)] == [True, True, False]
    # t = 1.05 W: the first query left the window, the three at 0.9 W did not. Anchors
    # written at t = 0 only would have expired, opening a new account with 3 full answers.
    clock.now += 0.15 * WINDOW
    assert [await full(accountant, target) for _ in range(2)] == [True, False]
    # a window after the last query, everything is forgotten: full answers again
    clock.now += WINDOW + 1
    assert [await full(accountant, edited) for _ in range(4)] == [True, True, True, False]


@pytest.mark.anyio
async def test_concurrent_first_queries_share_one_account(store: Store) -> None:  # noqa: F811
    """Eight one-word variants of a text nobody asked about, sent at once (by replicas
    sharing the store, or one client's parallel requests): finding an account and
    opening one used to be two store calls, so each variant found none and opened its
    own, with 3 full answers each (7 of 8 were answered in full). Now exactly the
    text's 3 are, whatever the interleaving, and the eight count in one account."""
    replicas = [
        ProbeAccountant(
            store, probe_secret(b"k" * 32), Metrics(), WINDOW, 30, 10, None, full_answers=3
        )
        for _ in range(4)
    ]
    for round_ in range(3):  # three never-asked texts, each hit by eight variants at once
        target = text(1_000 + round_)
        variants = []
        for i in range(8):
            edited = list(target)
            edited[20 + 20 * i] = 40_000 + i  # one token replaced: the same account
            variants.append(edited)
        admissions = await asyncio.gather(
            *(
                replicas[i % 4].admit(TENANT, f"k{i}", "full", replicas[0].sketches([v]))
                for i, v in enumerate(variants)
            )
        )
        decisions = [a.decision for (a,) in admissions]
        assert all(d.allowed for d in decisions)
        assert sorted(d.count for d in decisions) == list(range(1, 9))  # one account
        assert sum(a.full for (a,) in admissions) == 3


@pytest.mark.anyio
async def test_a_set_answered_as_one_spends_all_or_nothing_under_races(
    store: Store,  # noqa: F811 - the fixture
) -> None:
    """A set of texts answered as one (a collection) is answered in full only if every
    text in it has a full answer left, and then spends one of each. The counts used to
    be read, then spent one by one: a query racing the set could spend a text's last
    full answer in between, and the set, answered as the verdict, had spent the others'
    for nothing. Now the spend is one atomic store call: whatever the interleaving, a
    verdict-only set spends nothing, and no text gets more than its 3."""
    replicas = [
        ProbeAccountant(
            store, probe_secret(b"k" * 32), Metrics(), WINDOW, 30, 10, None, full_answers=3
        )
        for _ in range(3)
    ]
    sketch = replicas[0].sketches

    async def later(delay_s: float, call: Any) -> list[Any]:
        await asyncio.sleep(delay_s)
        return cast("list[Any]", await call)

    outcomes = []
    # the racing queries start before the set (-10 ms), within it, and after it (+10 ms)
    for round_, lead_ms in enumerate(range(-10, 11)):
        a, b = text(2_000 + round_), text(3_000 + round_)
        assert await full(replicas[0], a)  # a has 2 full answers left, b 3
        first, then = max(0.0, -lead_ms / 1000), max(0.0, lead_ms / 1000)
        together, one, two = await asyncio.gather(
            later(first, replicas[0].admit(TENANT, "k1", "full", sketch([b, a]), together=True)),
            later(then, replicas[1].admit(TENANT, "k2", "full", sketch([a]))),
            later(then, replicas[2].admit(TENANT, "k3", "full", sketch([a]))),
        )
        assert all(x.decision.allowed for x in [*together, *one, *two])
        set_full = {x.full for x in together}
        assert len(set_full) == 1  # the set is answered as one
        (in_full,) = set_full
        outcomes.append(in_full)
        # a: 3 full answers in all, whoever got them
        assert 1 + in_full + one[0].full + two[0].full == 3
        # b: a verdict-only set spent none of its full answers
        rest = [await full(replicas[0], b) for _ in range(4)]
        assert sum(rest) == 3 - in_full
    assert True in outcomes and False in outcomes  # both ways round were run
