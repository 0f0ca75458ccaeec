"""The Rollouter -> Trainer queue for asyncio: ``ext.squeue`` with blocking put and get.

One consumer waits for "at least k items": the queue itself watches its length
(``notify_at``) and wakes it once, so a put costs no Python code here. Producers wait for
space. Waits take a timeout and are cancellation-safe.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any, Iterable, Optional

from core.api import Batch
from core.store.queue_journal import GROUPS, QueueJournal, QueueWire
from ext.squeue import StalenessQueue


class QueueClosed(RuntimeError):
    """The queue was closed (the run is stopping) while a call waited, or before it was made."""


class AsyncStalenessQueue:
    """Bounded, version-gated queue; items older than ``version - max_staleness`` are evicted.

    ``impl`` is the synchronous queue class underneath; the backend ``ext.squeue`` selected
    unless a caller (the benchmarks) compares them side by side. The items are LLM groups
    unless the journal's wire says otherwise (the env pipeline's chunks).
    """

    def __init__(
        self, capacity: int, max_staleness: int, impl: type = StalenessQueue,
        journal: Optional[QueueJournal] = None, durable: bool = False,
    ) -> None:
        self._impl = impl
        self.wire: QueueWire = journal.wire if journal is not None else GROUPS
        self._q = impl(capacity, max_staleness)
        self._getter: Optional[asyncio.Future] = None
        self._putters: deque[asyncio.Future] = deque()
        # Durable queue (a journal): groups delivered stay here, unacknowledged, until the
        # trainer's checkpoint covers them; a restarted trainer gets them again, first.
        self.journal = journal
        self.durable = durable or journal is not None
        self._unacked: list = []
        self._redeliver: deque = deque()
        self._base: Counter = Counter()  # counts carried over from before a restore
        self._down: Optional[asyncio.Event] = None  # set once a dead queue is back
        self._closed = False

    def __len__(self) -> int:
        return len(self._q) + len(self._redeliver)

    @property
    def version(self) -> int:
        return self._q.version

    @property
    def capacity(self) -> int:
        return self._q.capacity

    def counters(self) -> dict[str, int]:
        base = self._base
        return {k: v + base.get(k, 0) for k, v in self._q.counters().items()} if base else self._q.counters()

    def _counters_full(self) -> dict[str, int]:
        c = self.counters()
        return {k: c.get(k, 0) for k in ("put", "got", "evicted", "stale_on_put", "rejected_full")}

    def put_nowait(self, item: Any, version: int) -> bool:
        """Store now; False if already too stale (not stored); QueueFull at capacity. A waiting
        consumer is woken by the queue's watch, so nothing else runs per item."""
        stored = self._q.put(item, version)
        if self.journal is not None:
            if stored:
                self.journal.put(item)
            else:
                self.journal.op("stale", (), self.version, self._counters_full())
        return stored

    async def put(self, item: Any, version: int, timeout: Optional[float] = None) -> bool:
        """Wait for space, then store; False if the item was already too stale (not stored)."""
        loop = asyncio.get_running_loop()
        await self._up()
        while len(self._q) >= self._q.capacity:
            self._check_open()
            fut = loop.create_future()
            self._putters.append(fut)
            try:
                await asyncio.wait_for(fut, timeout)
            finally:
                if not fut.done():
                    fut.cancel()
                try:
                    self._putters.remove(fut)
                except ValueError:
                    pass
        self._check_open()
        return self.put_nowait(item, version)

    async def get_batch(self, n: int, timeout: Optional[float] = None) -> list:
        """Wait until ``n`` items are queued, then pop them, oldest first (groups to deliver
        again before any other)."""
        if self._getter is not None:
            raise RuntimeError("AsyncStalenessQueue has one consumer; a second get_batch is already waiting")
        await self._up()
        while len(self._redeliver) + len(self._q) < n:
            self._check_open()
            q, k = self._q, n - len(self._redeliver)
            fut = asyncio.get_running_loop().create_future()
            self._getter = fut
            q.notify_at(k, lambda: fut.done() or fut.set_result(None))
            try:
                await asyncio.wait_for(fut, timeout)
            finally:
                if self._getter is fut:  # else drop_consumer() released it and another waits now
                    self._getter = None
                    q.notify_at(k, None)
            await self._up()
        first = min(n, len(self._redeliver))
        items = [self._redeliver.popleft() for _ in range(first)]
        if first < n:
            items += self._q.get_batch(n - first)
            self._wake_putters()
        self._delivered(items)
        return items

    def close(self) -> None:
        """Refuse every call from now on, and release the ones waiting with ``QueueClosed``: the
        run is stopping, and a producer or consumer must not wait for a partner that is gone."""
        self._closed = True
        waiting = [*self._putters, *([self._getter] if self._getter is not None else [])]
        for fut in waiting:
            if not fut.done():
                fut.set_exception(QueueClosed("the queue was closed"))

    def drop_consumer(self) -> None:
        """The consumer died while it waited in ``get_batch``: release that call (its answer
        would go nowhere; what it would have taken stays queued), so its restart can wait."""
        fut, self._getter = self._getter, None
        if fut is not None and not fut.done():
            fut.set_exception(QueueClosed("the consumer is gone"))
        self._q.notify_at(1, None)

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosed("the queue was closed")

    def _delivered(self, items: list) -> None:
        if self.durable:
            self._unacked.extend(items)
        if self.journal is not None:
            self.journal.op("got", items, self.version, self._counters_full())

    def set_version(self, version: int) -> list:
        """Bump the consumer version; returns the evicted items."""
        evicted = self._q.set_version(version)
        if evicted:
            self._wake_putters()
        if self.journal is not None and self._down is None:  # a dead queue writes nothing; recover() takes the version
            self.journal.op("removed", evicted, self.version, self._counters_full())
        return evicted

    def drain(self) -> list:
        """Pop everything (end of run)."""
        items = list(self._redeliver) + self._q.get_batch(len(self._q))
        self._redeliver.clear()
        self._wake_putters()
        if self.journal is not None:
            self.journal.op("removed", items, self.version, self._counters_full())
        return items

    # -- durability ------------------------------------------------------------------------------
    def ack(self, keys: Optional[Iterable[int]] = None) -> None:
        """The consumer's checkpoint covers the items delivered so far (or those of ``keys``,
        by the wire's key): forget them, and compact the journal to the contents. Acknowledging
        an item again is a no-op."""
        if keys is None:
            self._unacked.clear()
        else:
            done = set(keys)
            self._unacked = [g for g in self._unacked if self.wire.key(g) not in done]
        if self.journal is not None:
            self.journal.rewrite(self._peek(), list(self._redeliver), self.version, self._counters_full(), self._unacked)

    def redeliver(self, keep: Iterable[int] = ()) -> int:
        """A restarted trainer lost what it was given since its checkpoint: give it again, first.
        ``keep``: keys of items the consumer still holds (it lost an answer, not itself): they
        stay unacknowledged."""
        held = set(keep)
        again = [g for g in self._unacked if self.wire.key(g) not in held]
        n = len(again)
        self._redeliver.extendleft(reversed(again))
        self._unacked = [g for g in self._unacked if self.wire.key(g) in held]
        if self.journal is not None:
            if held:
                self.journal.rewrite(self._peek(), list(self._redeliver), self.version, self._counters_full(), self._unacked)
            else:
                self.journal.op("redelivered", (), self.version, self._counters_full())
        if n and self._getter is not None and not self._getter.done():
            self._getter.set_result(None)
        return n

    def unacked(self) -> list:
        return list(self._unacked)

    def contents(self) -> list:
        """The queued items, oldest first, left in place (groups to deliver again first)."""
        return list(self._redeliver) + self._peek()

    def _peek(self) -> list:
        # ext.squeue has no peek: pop everything and put it back, counts unchanged.
        items = self._q.get_batch(len(self._q))
        self._q.put_many(items, [self.wire.version(g) for g in items])
        self._base.update({"put": -len(items), "got": -len(items)})
        return items

    def is_down(self) -> bool:
        return self._down is not None

    def crash(self) -> None:
        """The queue's process dies: everything in memory is gone until ``recover``."""
        self._q = self._impl(self._q.capacity, self._q.max_staleness)
        self._unacked, self._redeliver, self._base = [], deque(), Counter()
        self._down = asyncio.Event()

    def recover(self) -> list:
        """Rebuild the contents from the journal; callers waiting on the queue go on. Returns
        what the version gate evicts from them (the version may have moved while it was down)."""
        st = self.journal.replay()
        q = self._impl(self._q.capacity, self._q.max_staleness)
        queued = list(st.queued.values())
        versions = [self.wire.version(g) for g in queued]
        if queued:  # no item is newer than the queue's version: store them all at the newest
            q.set_version(max(versions))
        q.put_many(queued, versions)
        version = max(st.version, self._q.version)
        evicted = q.set_version(version)
        self._q = q
        self._unacked = list(st.unacked.values())
        self._redeliver = deque(st.redeliver)
        self._base = Counter(st.counters)
        self._base.subtract(q.counters())
        self._base["evicted"] += len(evicted)
        if evicted:
            self.journal.op("removed", evicted, version, self._counters_full())
        down, self._down = self._down, None
        if down is not None:
            down.set()
        self._wake_putters()
        if self._getter is not None and not self._getter.done():
            # its watch was on the queue that died: it looks again and watches the new one
            self._getter.set_result(None)
        return evicted

    def state(self) -> dict:
        """What a checkpoint keeps besides the queued groups (``contents``)."""
        return {"version": self.version, "counters": self.counters()}

    def restore(self, state: dict, queued: list) -> None:
        """Take a checkpoint's ``state`` and contents (a resumed run)."""
        version, counters = state["version"], state["counters"]
        self._q.set_version(version)
        self._q.put_many(queued, [self.wire.version(g) for g in queued])
        self._base = Counter(counters)
        self._base.subtract(self._q.counters())
        if self.journal is not None:
            self.journal.rewrite(queued, [], version, self._counters_full())

    async def _up(self) -> None:
        while self._down is not None:
            await self._down.wait()

    def _wake_putters(self) -> None:
        free = self._q.capacity - len(self._q)
        while self._putters and free > 0:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)
                free -= 1


class QueueBatches:
    """The queue as the Trainer's ``BatchSource``: its groups, each of weight 1."""

    def __init__(self, queue: AsyncStalenessQueue) -> None:
        self.queue = queue

    async def get_batch(self, n: int) -> Batch:
        return Batch(await self.queue.get_batch(n))
