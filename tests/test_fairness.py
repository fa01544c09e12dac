"""Priority classes and fair share as pure logic: the weighted order, the shares, the slots (no Redis)."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from omniflow.engine.worker.slots import Slots
from omniflow.fairness import (WeightedPicker, allowed, cap, check_weight, parse_allowances, parse_priority_weights,
                               parse_weights, tenant_share)
from omniflow.models import Priority


def test_weighted_picker_gives_each_key_its_weights_share_and_nobody_starves() -> None:
    picker: WeightedPicker[str] = WeightedPicker({"interactive": 16, "api": 4, "batch": 1})
    picks = Counter(picker.pick(["interactive", "api", "batch"]) for _ in range(210))
    assert picks == {"interactive": 160, "api": 40, "batch": 10}
    # within any 21 picks with all three waiting, batch gets its one
    picker = WeightedPicker({"interactive": 16, "api": 4, "batch": 1})
    run = [picker.pick(["interactive", "api", "batch"]) for _ in range(21)]
    assert run.count("batch") == 1 and run[0] == "interactive"


def test_weighted_picker_takes_only_waiting_keys() -> None:
    picker: WeightedPicker[str] = WeightedPicker({"a": 100, "b": 1})
    assert [picker.pick(["b"]) for _ in range(3)] == ["b", "b", "b"]
    with pytest.raises(ValueError, match="nothing to pick"):
        picker.pick([])


def test_bad_weights_and_priorities_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="out of range"):
        check_weight(0)
    with pytest.raises(ValueError, match="out of range"):
        parse_weights("acme=5000")
    with pytest.raises(ValueError, match="not a number"):
        parse_weights("acme=lots")
    with pytest.raises(ValueError, match="not NAME=VALUE"):
        parse_weights("acme")
    with pytest.raises(ValueError, match="given twice"):
        parse_weights("a=1,a=2")
    with pytest.raises(ValueError, match="unknown priority 'urgent'"):
        Priority.parse("urgent")
    with pytest.raises(ValueError, match="no weight for"):
        parse_priority_weights("interactive=4,api=2")
    with pytest.raises(ValueError, match="weighs less than"):
        parse_priority_weights("interactive=1,api=4,batch=1")
    with pytest.raises(ValueError, match="unknown priority"):
        parse_allowances("acme=vip")
    assert parse_weights("acme=2, free:0.5") == {"acme": 2.0, "free": 0.5}
    assert parse_allowances("acme=realtime,free=batch") == {"acme": Priority.INTERACTIVE, "free": Priority.BATCH}


def test_allowance_caps_a_default_and_refuses_a_named_class_above_it() -> None:
    assert allowed(Priority.BATCH, Priority.API) and not allowed(Priority.INTERACTIVE, Priority.API)
    assert cap(Priority.INTERACTIVE, Priority.BATCH) is Priority.BATCH
    assert cap(Priority.BATCH, Priority.INTERACTIVE) is Priority.BATCH


def test_tenant_share_is_its_weights_part_among_the_active_tenants() -> None:
    assert tenant_share(100, "a", {}, []) == 100                     # alone: all of it
    assert tenant_share(100, "a", {}, ["b"]) == 50
    assert tenant_share(100, "a", {"a": 3}, ["b"]) == 75
    assert tenant_share(100, "b", {"a": 3}, ["a", "b"]) == 25
    assert tenant_share(3, "a", {"a": 0.01}, ["b"]) == 1             # never 0


async def _order_of_starts(slots: Slots, waiters: list[tuple[Priority, str]]) -> list[tuple[Priority, str]]:
    """Hold every slot, queue `waiters`, then free one slot at a time: the order they got it (each
    waiter keeps the slot it got, so every release hands exactly one on)."""
    started: list[tuple[Priority, str]] = []
    for _ in range(slots.n):
        await slots.acquire()

    async def one(prio: Priority, tenant: str) -> None:
        await slots.acquire(prio, tenant)
        started.append((prio, tenant))

    tasks = [asyncio.create_task(one(p, t)) for p, t in waiters]
    while slots.waiting < len(waiters):
        await asyncio.sleep(0)
    for _ in waiters:
        before = len(started)
        slots.release()
        while len(started) == before:
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return started


async def test_slots_start_the_higher_class_first_and_the_lower_ones_still_get_a_share() -> None:
    slots = Slots(1, class_weights=parse_priority_weights("interactive=16,api=4,batch=1"))
    waiters = [(Priority.BATCH, "t")] * 30 + [(Priority.API, "t")] * 30 + [(Priority.INTERACTIVE, "t")] * 30
    order = [p for p, _ in await _order_of_starts(slots, waiters)]
    first21 = Counter(order[:21])
    assert first21 == {Priority.INTERACTIVE: 16, Priority.API: 4, Priority.BATCH: 1}
    assert order.index(Priority.BATCH) < 21             # batch is not starved while the others wait
    # the interactive ones queued last are all started before two thirds of the batch ones
    assert max(i for i, p in enumerate(order) if p is Priority.INTERACTIVE) < order.index(Priority.BATCH) + 30


async def test_slots_take_tenants_of_one_class_in_weighted_turn() -> None:
    slots = Slots(1, tenant_weights={"flood": 1, "other": 1})
    waiters = [(Priority.API, "flood")] * 40 + [(Priority.API, "other")] * 5
    order = [t for _, t in await _order_of_starts(slots, waiters)]
    # the other tenant's five, queued behind forty of the flood, are started within the first ten,
    # neither tenant ever two slots ahead of the other until "other" has none left
    assert max(i for i, t in enumerate(order) if t == "other") < 10
    assert all(abs(order[:k].count("flood") - order[:k].count("other")) <= 1 for k in range(1, 11))


async def test_a_lower_class_gives_its_slot_way_when_a_higher_one_waits() -> None:
    slots = Slots(1)
    await slots.acquire(Priority.BATCH, "t")
    assert not await slots.give_way(Priority.BATCH, "t")    # nobody waits: it keeps the slot
    got: list[str] = []

    async def live() -> None:
        async with slots.held(Priority.INTERACTIVE, "t"):
            got.append("interactive")

    task = asyncio.create_task(live())
    while not slots.higher_waiting(Priority.BATCH):
        await asyncio.sleep(0)
    assert not slots.higher_waiting(Priority.INTERACTIVE)
    assert await slots.give_way(Priority.BATCH, "t")         # gave way, and has its slot again
    got.append("batch")
    await task
    assert got == ["interactive", "batch"] and slots.yields == 1
    slots.release("t")
    assert slots.free == 1 and slots.holding == {}


async def test_a_session_that_gave_way_resumes_before_the_unstarted_ones_of_its_class() -> None:
    slots = Slots(1)
    await slots.acquire(Priority.BATCH, "t")                    # a batch session mid-stream
    order: list[str] = []

    async def start(name: str, prio: Priority) -> None:
        async with slots.held(prio, "t"):
            order.append(name)

    queued = [asyncio.create_task(start(f"batch {i}", Priority.BATCH)) for i in range(3)]
    live = asyncio.create_task(start("live", Priority.INTERACTIVE))
    while slots.waiting < 4:
        await asyncio.sleep(0)
    gave_way = asyncio.create_task(slots.give_way(Priority.BATCH, "t"))
    while not gave_way.done():
        await asyncio.sleep(0)
    order.append("resumed")
    slots.release()
    await asyncio.gather(live, *queued)
    assert order == ["live", "resumed", "batch 0", "batch 1", "batch 2"]


async def test_a_tenant_holding_more_than_its_turn_gives_a_slot_to_one_waiting_with_none() -> None:
    slots = Slots(2)
    await slots.acquire(Priority.API, "flood")
    await slots.acquire(Priority.API, "flood")
    queued = [asyncio.create_task(slots.acquire(Priority.API, "flood")) for _ in range(5)]
    while slots.waiting < 5:
        await asyncio.sleep(0)
    assert not slots.should_give_way(Priority.API, "flood")       # only its own tenant waits
    other = asyncio.create_task(slots.acquire(Priority.API, "other"))
    while slots.waiting < 6:
        await asyncio.sleep(0)
    assert slots.should_give_way(Priority.API, "flood")           # "other" holds none of the two
    gave_way = asyncio.create_task(slots.give_way(Priority.API, "flood"))   # it queues again, first
    await other                                                   # the slot went to "other", not a queued flood one
    assert slots.holding == {"flood": 1, "other": 1}
    assert not slots.should_give_way(Priority.API, "flood")       # one each: no more swaps
    slots.release("other")                                        # the next goes to the one that gave way
    assert await gave_way
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    assert slots.holding == {"flood": 2} and all(task.cancelled() for task in queued)


async def test_a_cancelled_waiter_leaves_no_slot_behind() -> None:
    slots = Slots(1)
    await slots.acquire()
    waiter = asyncio.create_task(slots.acquire(Priority.BATCH, "t"))
    while not slots.waiting:
        await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.waiting == 0
    slots.release()
    assert slots.free == 1


async def test_the_kept_slot_waits_for_live_traffic_while_it_is_about() -> None:
    slots = Slots(4, reserve=1, window_s=30.0)
    async with slots.held(Priority.INTERACTIVE, "t"):           # live traffic asked just now
        pass
    for _ in range(3):
        await slots.acquire(Priority.BATCH, "t")
    batch = asyncio.create_task(slots.acquire(Priority.BATCH, "t"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not batch.done() and slots.free == 1                 # the last slot is kept
    await slots.acquire(Priority.INTERACTIVE, "t")              # a live session starts at once
    assert slots.free == 0 and not batch.done()
    slots.release("t")                                          # the live one ends: kept again
    for _ in range(5):
        await asyncio.sleep(0)
    assert not batch.done()
    slots.release("t")                                          # a batch one ends: above the reserve
    await asyncio.wait_for(batch, 5)
    assert slots.free == 1 and slots.holding == {"t": 3}


async def test_a_lower_class_borrows_the_kept_slots_once_live_traffic_went_quiet() -> None:
    slots = Slots(2, reserve=1, window_s=0.05)
    async with slots.held(Priority.INTERACTIVE, "t"):
        pass
    await slots.acquire(Priority.BATCH, "t")
    borrowed = asyncio.create_task(slots.acquire(Priority.BATCH, "t"))
    await asyncio.wait_for(borrowed, 5)     # granted by the timer as the window closes, no release needed
    assert slots.free == 0
    slots = Slots(2, reserve=1, window_s=30.0)                  # a stage that saw no live traffic lends it all
    await slots.acquire(Priority.BATCH, "t")
    await asyncio.wait_for(slots.acquire(Priority.BATCH, "t"), 5)
    assert slots.free == 0


async def test_a_tenant_holding_more_than_its_turn_leaves_the_kept_slot_to_the_others() -> None:
    slots = Slots(4, reserve=1, window_s=30.0, tenant_weights={"flood": 1, "other": 1})
    async with slots.held(Priority.API, "other"):               # "other" asked lately
        pass
    for _ in range(3):
        await slots.acquire(Priority.API, "flood")
    flood = asyncio.create_task(slots.acquire(Priority.API, "flood"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not flood.done()
    await slots.acquire(Priority.API, "other")                  # the other tenant starts at once
    assert slots.holding == {"flood": 3, "other": 1}
    slots.release("other")
    slots.release("flood")
    await asyncio.wait_for(flood, 5)                            # above the reserve again: the flood's turn
    assert slots.holding == {"flood": 3} and slots.free == 1
    # two tenants level with each other may use the kept slot: it keeps nobody out
    even = Slots(2, reserve=1, window_s=30.0)
    await even.acquire(Priority.API, "a")
    await asyncio.wait_for(even.acquire(Priority.API, "b"), 5)
    assert even.holding == {"a": 1, "b": 1}


def test_reserved_slots_are_checked() -> None:
    with pytest.raises(ValueError, match="reserved slots must be from 0 to 3"):
        Slots(4, reserve=4)
