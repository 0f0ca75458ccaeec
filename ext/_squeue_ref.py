"""Pure-Python reference of the staleness-aware queue (the oracle for ``ext._squeue``).

A bounded FIFO whose every item carries the policy version it was generated with.
The consumer side holds the current version; an item older than
``version - max_staleness`` is never handed out: it is evicted when the version
is bumped, or refused on arrival if it is already too old.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from ext.errors import QueueFull

__all__ = ["QueueFull", "StalenessQueue"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class StalenessQueue:
    """Bounded, version-tagged FIFO with a consumer-side staleness gate."""

    def __init__(self, capacity: int, max_staleness: int) -> None:
        self._capacity = _check_int("capacity", capacity, 1)
        self._max_staleness = _check_int("max_staleness", max_staleness, 0)
        self._items: deque[tuple[Any, int]] = deque()
        self._per_version: dict[int, int] = {}
        self._version = 0
        self._put = 0
        self._got = 0
        self._evicted = 0
        self._stale_on_put = 0
        self._rejected_full = 0
        self._watch: tuple[int, Any] | None = None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_staleness(self) -> int:
        return self._max_staleness

    @property
    def version(self) -> int:
        return self._version

    def __len__(self) -> int:
        return len(self._items)

    def _check_version(self, version: object) -> int:
        v = _check_int("version", version, 0)
        if v > self._version:
            raise ValueError(f"item version {v} is newer than the queue's version {self._version}")
        return v

    def _store(self, item: Any, version: int) -> bool:
        if version < self._version - self._max_staleness:
            self._stale_on_put += 1
            return False
        self._items.append((item, version))
        self._per_version[version] = self._per_version.get(version, 0) + 1
        self._put += 1
        return True

    def _fire_watch(self) -> None:
        if self._watch is not None and len(self._items) >= self._watch[0]:
            cb = self._watch[1]
            self._watch = None  # cleared first: the callback may set a new watch
            cb()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_watch"] = None  # a callback belongs to this process
        return state

    def notify_at(self, k: int, callback) -> None:
        """Call ``callback()`` once the queue holds at least ``k`` items (now, if it does).

        One watch at a time: a new one replaces the last; ``callback=None`` cancels. The watch
        fires from the ``put``/``put_many`` that reaches ``k``, after the items are stored, and
        is not pickled.
        """
        k = _check_int("k", k, 1)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        self._watch = None
        if callback is None:
            return
        if k <= len(self._items):
            callback()
            return
        self._watch = (k, callback)

    def put(self, item: Any, version: int) -> bool:
        """Store ``item``; False if it is already staler than the budget (counted, not stored).

        Raises ``QueueFull`` when the queue is at capacity.
        """
        v = self._check_version(version)
        if len(self._items) >= self._capacity:
            self._rejected_full += 1
            raise QueueFull(f"queue is full ({self._capacity} items)")
        stored = self._store(item, v)
        self._fire_watch()
        return stored

    def put_many(self, items: Iterable[Any], versions: Iterable[int]) -> int:
        """Store all items or none; returns how many were stored (stale ones are not)."""
        items = list(items)
        versions = [self._check_version(v) for v in versions]
        if len(items) != len(versions):
            raise ValueError(f"{len(items)} items but {len(versions)} versions")
        if len(self._items) + len(items) > self._capacity:
            self._rejected_full += 1
            raise QueueFull(f"{len(items)} items do not fit: {len(self._items)}/{self._capacity} used")
        stored = sum(self._store(item, v) for item, v in zip(items, versions))
        self._fire_watch()
        return stored

    def get_batch(self, n: int) -> list:
        """Pop up to ``n`` items, oldest first."""
        n = _check_int("n", n, 0)
        out = []
        for _ in range(min(n, len(self._items))):
            item, v = self._items.popleft()
            left = self._per_version[v] - 1
            if left:
                self._per_version[v] = left
            else:
                del self._per_version[v]
            out.append(item)
        self._got += len(out)
        return out

    def set_version(self, version: int) -> list:
        """Advance the consumer version; returns the items evicted as too stale, oldest first."""
        v = _check_int("version", version, 0)
        if v < self._version:
            raise ValueError(f"version must not go back: {v} < {self._version}")
        self._version = v
        floor = v - self._max_staleness
        if not any(ver < floor for ver in self._per_version):
            return []
        evicted = [item for item, ver in self._items if ver < floor]
        self._items = deque((item, ver) for item, ver in self._items if ver >= floor)
        for ver in [ver for ver in self._per_version if ver < floor]:
            del self._per_version[ver]
        self._evicted += len(evicted)
        return evicted

    def counters(self) -> dict[str, int]:
        """Cumulative counts: put, got, evicted, stale_on_put, rejected_full."""
        return {
            "put": self._put,
            "got": self._got,
            "evicted": self._evicted,
            "stale_on_put": self._stale_on_put,
            "rejected_full": self._rejected_full,
        }
