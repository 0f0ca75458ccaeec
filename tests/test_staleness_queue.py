"""The asyncio wrapper of ext.squeue: blocking get and put, wake-ups, timeouts, cancellation."""

import asyncio

import pytest

from core.sim import virtual_clock
from core.pipeline.staleness_queue import AsyncStalenessQueue
from ext.errors import QueueFull


def test_the_consumer_wakes_once_k_items_are_there_not_before():
    async def main():
        loop = asyncio.get_running_loop()
        q = AsyncStalenessQueue(capacity=16, max_staleness=1)
        got = []

        async def consumer():
            items = await q.get_batch(3)
            got.append((loop.time(), items))

        task = asyncio.create_task(consumer())
        for i in range(3):
            await asyncio.sleep(1.0)
            await q.put(f"s{i}", 0)
            await asyncio.sleep(0)
            assert bool(got) == (i == 2)
        await task
        return got

    [(t, items)] = virtual_clock.run(main())
    assert t == pytest.approx(3.0) and items == ["s0", "s1", "s2"]


def test_a_full_queue_blocks_the_producer_until_the_consumer_takes():
    async def main():
        loop = asyncio.get_running_loop()
        q = AsyncStalenessQueue(capacity=2, max_staleness=0)
        await q.put("a", 0)
        await q.put("b", 0)
        put_done = []

        async def producer():
            await q.put("c", 0)
            put_done.append(loop.time())

        task = asyncio.create_task(producer())
        await asyncio.sleep(5.0)
        assert not put_done
        assert await q.get_batch(1) == ["a"]
        await task
        return put_done[0], await q.get_batch(2)

    t, rest = virtual_clock.run(main())
    assert t == pytest.approx(5.0) and rest == ["b", "c"]


def test_timeouts_and_cancellation_leave_the_queue_usable():
    async def main():
        q = AsyncStalenessQueue(capacity=1, max_staleness=0)
        with pytest.raises(asyncio.TimeoutError):
            await q.get_batch(1, timeout=2.0)
        getter = asyncio.create_task(q.get_batch(1))
        await asyncio.sleep(1.0)
        getter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await getter
        await q.put("x", 0)
        with pytest.raises(asyncio.TimeoutError):
            await q.put("y", 0, timeout=1.0)
        assert await q.get_batch(1) == ["x"]
        return len(q)

    assert virtual_clock.run(main()) == 0


def test_one_consumer_only_and_eviction_frees_space():
    async def main():
        q = AsyncStalenessQueue(capacity=4, max_staleness=0)
        first = asyncio.create_task(q.get_batch(2))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one consumer"):
            await q.get_batch(1)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        for i in range(4):
            await q.put(i, 0)
        evicted = q.set_version(1)
        stored = await q.put("new", 1)
        return evicted, stored, len(q), q.counters()

    evicted, stored, n, counters = virtual_clock.run(main())
    assert evicted == [0, 1, 2, 3] and stored and n == 1
    assert counters["evicted"] == 4 and counters["put"] == 5


def test_put_nowait_refuses_when_full_and_wakes_the_consumer_once_per_batch():
    async def main():
        q = AsyncStalenessQueue(capacity=3, max_staleness=0)
        got = []

        async def consumer():
            got.append(await q.get_batch(2))

        task = asyncio.create_task(consumer())
        await asyncio.sleep(0)
        assert q.put_nowait("a", 0) is True
        await asyncio.sleep(0)
        assert not got  # one item of two: the consumer is not woken
        q.put_nowait("b", 0)
        q.put_nowait("c", 0)
        with pytest.raises(QueueFull):
            q.put_nowait("d", 0)
        await task
        q.set_version(1)  # "c" is now too stale and evicted
        assert q.put_nowait("e", 0) is False  # refused as stale, not stored
        return got, len(q), q.counters()

    got, left, counters = virtual_clock.run(main())
    assert got == [["a", "b"]] and left == 0
    assert counters["put"] == 3 and counters["rejected_full"] == 1
    assert counters["evicted"] == 1 and counters["stale_on_put"] == 1
