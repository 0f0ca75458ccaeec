"""Micro-benchmarks of the staleness-aware queue: compiled vs reference vs plain deques.

Run with ``pytest bench --benchmark-only``. Implementations:

* ``ext``          the compiled ``ext._squeue`` (required unless ASYNCRL_PUREPYTHON=1)
* ``ref``          the pure-Python reference ``ext._squeue_ref``
* ``deque+counts`` a collections.deque of (item, version) pairs with a per-version count dict:
                   the same semantics as the queue, none of the argument checks
* ``deque``        a plain collections.deque of (item, version) pairs: no capacity, no
                   staleness gate on put, no accounting; set_version always filters everything

* ``asyncio.Queue`` an unbounded asyncio.Queue of (item, version) pairs, put_nowait/get_nowait:
                   no staleness gate, no accounting (in the put256+get256 group only)

Groups: ``put256+get256`` (256 single puts then one get_batch of 256), ``put_many256+get256``,
``set_version 1% stale of 10k`` (a full 10k queue where 100 items, at random positions, become
stale) and ``set_version oldest 1% of 10k`` (the 100 oldest become stale, the usual case when
versions arrive in order). Eviction benchmarks rebuild the queue outside the timing each round.

``async put+get 4096 by 256`` is the path the system runs: in one event loop a producer
task puts every item and a consumer task awaits batches of 256, until 4096 items went
through. Each queue is used at its best: the producer puts without awaiting while there is
space (``put_nowait``) and awaits only when full. ``core``'s AsyncStalenessQueue (on ``ext``
or ``ref``) wakes the consumer once per batch; ``asyncio.Queue`` has no batch get, so its
consumer awaits one item and then takes whatever is already queued without awaiting;
``deque+Condition`` is a deque whose producer awaits every put, since notifying an
asyncio.Condition needs its lock, and notifies once a batch is ready. Each round
is one ``run_until_complete`` on a loop made once, so its fixed cost is the same for all.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import random
from collections import deque

import pytest

from core.pipeline.staleness_queue import AsyncStalenessQueue
from ext import _squeue_ref
from ext.errors import QueueFull


class DequeWithCounts:
    """Same semantics as StalenessQueue on a deque of (item, version) pairs, without checks."""

    def __init__(self, capacity: int, max_staleness: int) -> None:
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.version = 0
        self.items: deque = deque()
        self.per_version: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def put(self, item, version: int) -> bool:
        if len(self.items) >= self.capacity:
            raise QueueFull("full")
        if version < self.version - self.max_staleness:
            return False
        self.items.append((item, version))
        self.per_version[version] = self.per_version.get(version, 0) + 1
        return True

    def put_many(self, items, versions) -> int:
        if len(self.items) + len(items) > self.capacity:
            raise QueueFull("full")
        floor = self.version - self.max_staleness
        kept = [(item, v) for item, v in zip(items, versions) if v >= floor]
        self.items.extend(kept)
        for _, v in kept:
            self.per_version[v] = self.per_version.get(v, 0) + 1
        return len(kept)

    def get_batch(self, n: int) -> list:
        out = []
        popleft = self.items.popleft
        per_version = self.per_version
        for _ in range(min(n, len(self.items))):
            item, v = popleft()
            left = per_version[v] - 1
            if left:
                per_version[v] = left
            else:
                del per_version[v]
            out.append(item)
        return out

    def set_version(self, version: int) -> list:
        self.version = version
        floor = version - self.max_staleness
        if min(self.per_version, default=floor) >= floor:
            return []
        evicted = [item for item, v in self.items if v < floor]
        self.items = deque((item, v) for item, v in self.items if v >= floor)
        for v in [v for v in self.per_version if v < floor]:
            del self.per_version[v]
        return evicted


class PlainDeque:
    """A bare deque of (item, version) pairs: the floor for what a queue in Python costs."""

    def __init__(self, capacity: int, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.version = 0
        self.items: deque = deque()

    def __len__(self) -> int:
        return len(self.items)

    def put(self, item, version: int) -> bool:
        self.items.append((item, version))
        return True

    def put_many(self, items, versions) -> int:
        self.items.extend(zip(items, versions))
        return len(items)

    def get_batch(self, n: int) -> list:
        popleft = self.items.popleft
        return [popleft()[0] for _ in range(min(n, len(self.items)))]

    def set_version(self, version: int) -> list:
        self.version = version
        floor = version - self.max_staleness
        evicted = [item for item, v in self.items if v < floor]
        self.items = deque((item, v) for item, v in self.items if v >= floor)
        return evicted


def _compiled_queue():
    if os.environ.get("ASYNCRL_PUREPYTHON", "").strip() == "1":
        pytest.skip("ASYNCRL_PUREPYTHON=1: the compiled module is deliberately not used")
    return importlib.import_module("ext._squeue").StalenessQueue  # ImportError fails the bench


IMPLEMENTATIONS = {
    "ext": _compiled_queue,
    "ref": lambda: _squeue_ref.StalenessQueue,
    "deque+counts": lambda: DequeWithCounts,
    "deque": lambda: PlainDeque,
}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def queue_cls(request):
    return IMPLEMENTATIONS[request.param]()


BATCH = 256


class AsyncioQueueNowait:
    """asyncio.Queue used without awaiting: the cheapest way to use it."""

    def __init__(self, capacity: int, max_staleness: int) -> None:
        self.q: asyncio.Queue = asyncio.Queue()

    def __len__(self) -> int:
        return self.q.qsize()

    def put(self, item, version: int) -> bool:
        self.q.put_nowait((item, version))
        return True

    def get_batch(self, n: int) -> list:
        get = self.q.get_nowait
        return [get()[0] for _ in range(min(n, self.q.qsize()))]


@pytest.fixture(params=[*IMPLEMENTATIONS, "asyncio.Queue"])
def put_get_cls(request):
    if request.param == "asyncio.Queue":
        return AsyncioQueueNowait
    return IMPLEMENTATIONS[request.param]()


@pytest.mark.benchmark(group="put256+get256")
def test_put_get_cycle(benchmark, put_get_cls):
    q = put_get_cls(4 * BATCH, 2)
    items = [object() for _ in range(BATCH)]

    def cycle():
        put = q.put
        for item in items:
            put(item, 0)
        return q.get_batch(BATCH)

    out = benchmark(cycle)
    assert len(out) == BATCH and out[0] is items[0] and out[-1] is items[-1]
    assert len(q) == 0


@pytest.mark.benchmark(group="put_many256+get256")
def test_put_many_get_cycle(benchmark, queue_cls):
    q = queue_cls(4 * BATCH, 2)
    items = [object() for _ in range(BATCH)]
    versions = [0] * BATCH

    def cycle():
        q.put_many(items, versions)
        return q.get_batch(BATCH)

    out = benchmark(cycle)
    assert len(out) == BATCH and out[0] is items[0] and out[-1] is items[-1]
    assert len(q) == 0


SIZE = 10_000
STALE = SIZE // 100


def _bench_eviction(benchmark, queue_cls, stale_at: set[int]) -> None:
    """set_version(2) on a full queue of SIZE items where those at ``stale_at`` have version 0
    (too stale after the bump) and the others version 1; rebuilt for every round."""
    items = [object() for _ in range(SIZE)]
    versions = [0 if i in stale_at else 1 for i in range(SIZE)]
    queues = []

    def setup():
        q = queue_cls(SIZE, 1)
        q.set_version(1)
        assert q.put_many(items, versions) == SIZE
        queues.append(q)
        return (q,), {}

    def bump(q):
        return q.set_version(2)

    evicted = benchmark.pedantic(bump, setup=setup, rounds=40, warmup_rounds=1)
    assert len(evicted) == len(stale_at)
    assert evicted == [items[i] for i in sorted(stale_at)]
    assert len(queues[-1]) == SIZE - len(stale_at)


@pytest.mark.benchmark(group="set_version 1% stale of 10k")
def test_set_version_evicts_one_percent(benchmark, queue_cls):
    """The stale items are spread at random: every item moves."""
    _bench_eviction(benchmark, queue_cls, set(random.Random(0).sample(range(SIZE), STALE)))


@pytest.mark.benchmark(group="set_version oldest 1% of 10k")
def test_set_version_evicts_oldest_one_percent(benchmark, queue_cls):
    """The stale items are the oldest ones (versions arrived in order), the usual case."""
    _bench_eviction(benchmark, queue_cls, set(range(STALE)))


# --- the asyncio path: producer and consumer tasks in one loop --------------------------

THROUGH = 16 * BATCH


class AsyncioQueuePath:
    """asyncio.Queue: await one item, then take what is queued without awaiting."""

    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue(maxsize=4 * BATCH)

    def put_nowait(self, item, version: int) -> None:
        self.q.put_nowait((item, version))  # asyncio.QueueFull when full

    async def put(self, item, version: int) -> None:
        await self.q.put((item, version))

    async def get_batch(self, n: int) -> list:
        q = self.q
        out: list = []
        while len(out) < n:
            out.append((await q.get())[0])
            for _ in range(min(n - len(out), q.qsize())):
                out.append(q.get_nowait()[0])
        return out


class DequeConditionPath:
    """A deque and an asyncio.Condition notified once a whole batch is queued."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.cond = asyncio.Condition()
        self.want = 0

    async def put(self, item, version: int) -> None:
        self.items.append((item, version))
        if self.want and len(self.items) >= self.want:
            async with self.cond:  # notify needs the lock: one await per batch, not per item
                self.cond.notify()

    async def get_batch(self, n: int) -> list:
        if len(self.items) < n:
            async with self.cond:
                self.want = n
                await self.cond.wait_for(lambda: len(self.items) >= n)
                self.want = 0
        popleft = self.items.popleft
        return [popleft()[0] for _ in range(n)]


ASYNC_PATHS = {
    "ext": lambda: (lambda: AsyncStalenessQueue(4 * BATCH, 2, impl=_compiled_queue())),
    "ref": lambda: (lambda: AsyncStalenessQueue(4 * BATCH, 2, impl=_squeue_ref.StalenessQueue)),
    "asyncio.Queue": lambda: AsyncioQueuePath,
    "deque+Condition": lambda: DequeConditionPath,
}


@pytest.fixture(params=list(ASYNC_PATHS))
def async_path(request):
    return ASYNC_PATHS[request.param]()


@pytest.mark.benchmark(group="async put+get 4096 by 256")
def test_async_put_get(benchmark, async_path):
    items = [object() for _ in range(THROUGH)]
    loop = asyncio.new_event_loop()

    async def produce(q) -> None:
        put_nowait = getattr(q, "put_nowait", None)
        if put_nowait is None:  # deque+Condition: notifying needs the lock, so put is awaited
            for item in items:
                await q.put(item, 0)
            return
        for item in items:
            try:
                put_nowait(item, 0)
            except (QueueFull, asyncio.QueueFull):
                await q.put(item, 0)

    async def consume(q) -> list:
        out: list = []
        while len(out) < THROUGH:
            out += await q.get_batch(BATCH)
        return out

    async def through() -> list:
        q = async_path()
        producer = asyncio.ensure_future(produce(q))
        out = await consume(q)
        await producer
        return out

    try:
        out = benchmark(lambda: loop.run_until_complete(through()))
    finally:
        loop.close()
    benchmark.extra_info["items"] = THROUGH
    assert len(out) == THROUGH and out[0] is items[0] and out[-1] is items[-1]
