"""Type stub of the compiled staleness-aware queue (ext/_squeue.pyx).

Same API and behaviour as the pure-Python reference ``ext._squeue_ref``; versions are
int64 (``set_version`` refuses a version above 2**63 - 1 with ValueError).
"""

from typing import Any, Callable, Iterable

from ext.errors import QueueFull as QueueFull

__all__ = ["QueueFull", "StalenessQueue"]

class StalenessQueue:
    """Bounded, version-tagged FIFO with a consumer-side staleness gate."""

    def __init__(self, capacity: int, max_staleness: int) -> None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_staleness(self) -> int: ...
    @property
    def version(self) -> int: ...
    def __len__(self) -> int: ...
    def put(self, item: Any, version: int) -> bool:
        """Store ``item``; False if it is already staler than the budget (counted, not stored).

        Raises ``QueueFull`` when the queue is at capacity.
        """
    def put_many(self, items: Iterable[Any], versions: Iterable[int]) -> int:
        """Store all items or none; returns how many were stored (stale ones are not)."""
    def notify_at(self, k: int, callback: Callable[[], object] | None) -> None:
        """Call ``callback()`` once the queue holds at least ``k`` items (now, if it does).

        One watch at a time: a new one replaces the last; ``callback=None`` cancels. It fires
        from the ``put``/``put_many`` that reaches ``k``, after the items are stored; not pickled.
        """
    def get_batch(self, n: int) -> list[Any]:
        """Pop up to ``n`` items, oldest first."""
    def set_version(self, version: int) -> list[Any]:
        """Advance the consumer version; returns the items evicted as too stale, oldest first."""
    def counters(self) -> dict[str, int]:
        """Cumulative counts: put, got, evicted, stale_on_put, rejected_full."""
