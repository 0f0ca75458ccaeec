"""An asyncio event loop whose clock is simulated.

``loop.time()`` is virtual: when nothing is ready, the loop jumps straight to the next
timer instead of sleeping. ``asyncio.sleep``, ``call_at`` and ``wait_for`` therefore
work unchanged, the component code is the real one, and a run is exactly reproducible.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, Coroutine, Mapping, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is pending: every task waits for something that never comes."""


class _VirtualSelector(selectors.BaseSelector):
    """Never blocks; a select with a timeout advances the virtual clock by that timeout."""

    def __init__(self) -> None:
        self.now = 0.0
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise SimulationStalled(
                f"simulation stalled at t={self.now:.6f}s: no task is ready and no timer is pending"
            )
        if timeout > 0:
            self.now += timeout
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return dict(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A SelectorEventLoop on virtual time, starting at t = 0."""

    def __init__(self) -> None:
        self._vselector = _VirtualSelector()
        super().__init__(selector=self._vselector)

    def time(self) -> float:
        return self._vselector.now

    def set_time(self, t: float) -> None:
        """Move the clock to ``t`` (a resumed run continues at its checkpoint's time). Only
        with no timer pending."""
        if self._scheduled:
            raise RuntimeError("set_time with timers pending")
        self._vselector.now = t


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh virtual-clock loop."""
    loop = VirtualClockLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
