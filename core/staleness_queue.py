"""The Rollouter -> Trainer queue for asyncio: ``ext.squeue`` with blocking put and get.

One consumer waits for "at least k items": the queue itself watches its length
(``notify_at``) and wakes it once, so a put costs no Python code here. Producers wait for
space. Waits take a timeout and are cancellation-safe.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Optional

from ext.squeue import StalenessQueue


class AsyncStalenessQueue:
    """Bounded, version-gated queue; items older than ``version - max_staleness`` are evicted.

    ``impl`` is the synchronous queue class underneath; the backend ``ext.squeue`` selected
    unless a caller (the benchmarks) compares them side by side.
    """

    def __init__(self, capacity: int, max_staleness: int, impl: type = StalenessQueue) -> None:
        self._q = impl(capacity, max_staleness)
        # put_nowait(item, version) -> bool: store now; False if already too stale (not
        # stored); QueueFull at capacity. The queue's own method: a waiting consumer is woken
        # by the queue's watch, so nothing here runs per item.
        self.put_nowait = self._q.put
        self._getter: Optional[asyncio.Future] = None
        self._putters: deque[asyncio.Future] = deque()

    def __len__(self) -> int:
        return len(self._q)

    @property
    def version(self) -> int:
        return self._q.version

    @property
    def capacity(self) -> int:
        return self._q.capacity

    def counters(self) -> dict[str, int]:
        return self._q.counters()

    async def put(self, item: Any, version: int, timeout: Optional[float] = None) -> bool:
        """Wait for space, then store; False if the item was already too stale (not stored)."""
        loop = asyncio.get_running_loop()
        while len(self._q) >= self._q.capacity:
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
        return self.put_nowait(item, version)

    async def get_batch(self, n: int, timeout: Optional[float] = None) -> list:
        """Wait until ``n`` items are queued, then pop them, oldest first."""
        if self._getter is not None:
            raise RuntimeError("AsyncStalenessQueue has one consumer; a second get_batch is already waiting")
        while len(self._q) < n:
            fut = asyncio.get_running_loop().create_future()
            self._getter = fut
            self._q.notify_at(n, lambda: fut.done() or fut.set_result(None))
            try:
                await asyncio.wait_for(fut, timeout)
            finally:
                self._getter = None
                self._q.notify_at(n, None)
        items = self._q.get_batch(n)
        self._wake_putters()
        return items

    def set_version(self, version: int) -> list:
        """Bump the consumer version; returns the evicted items."""
        evicted = self._q.set_version(version)
        if evicted:
            self._wake_putters()
        return evicted

    def drain(self) -> list:
        """Pop everything (end of run)."""
        items = self._q.get_batch(len(self._q))
        self._wake_putters()
        return items

    def _wake_putters(self) -> None:
        free = self._q.capacity - len(self._q)
        while self._putters and free > 0:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)
                free -= 1
