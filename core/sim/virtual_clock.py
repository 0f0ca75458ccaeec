"""An asyncio event loop whose clock is simulated.

``loop.time()`` is virtual: when nothing is ready, the loop jumps straight to the next
timer instead of sleeping. ``asyncio.sleep``, ``call_at`` and ``wait_for`` therefore
work unchanged, the component code is the real one, and a run is exactly reproducible.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import itertools
import selectors
from asyncio import events
from typing import Any, Callable, Coroutine, Mapping, TypeVar

from core.api import ReservingClock

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


class LightTimer:
    """A timer without a context or a repr, for the simulator's hottest callbacks (an engine's
    next completion): ``call_at_light``. Cancelled like a ``TimerHandle``."""

    __slots__ = ("_when", "_callback", "_loop", "_cancelled", "_scheduled")

    def __init__(self, when: float, callback: Callable[[], None], loop: "VirtualClockLoop") -> None:
        self._when = when
        self._callback = callback
        self._loop = loop
        self._cancelled = False
        self._scheduled = True

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            if self._scheduled:
                self._loop._timer_cancelled_count += 1
            self._callback = None

    def cancelled(self) -> bool:
        return self._cancelled

    def when(self) -> float:
        return self._when

    def _run(self) -> None:
        try:
            self._callback()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._loop.call_exception_handler(
                {"message": f"Exception in callback {self._callback!r}", "exception": exc, "handle": self}
            )


class VirtualClockLoop(asyncio.SelectorEventLoop, ReservingClock):
    """A SelectorEventLoop on virtual time, starting at t = 0.

    Its timers sit in one heap of ``(when, seq, timer)`` tuples, compared in C and, on equal
    times, first scheduled first (asyncio's heap of handles compares them in Python, and
    leaves ties to the heap's shape)."""

    def __init__(self) -> None:
        self._vselector = _VirtualSelector()
        self._timers: list = []
        self._timer_seq = itertools.count()
        super().__init__(selector=self._vselector)

    def time(self) -> float:
        return self._vselector.now

    def set_time(self, t: float) -> None:
        """Move the clock to ``t`` (a resumed run continues at its checkpoint's time). Only
        with no timer pending."""
        if any(not e[2]._cancelled for e in self._timers):
            raise RuntimeError("set_time with timers pending")
        self._vselector.now = t

    def call_at(self, when, callback, *args, context=None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()
        timer = events.TimerHandle(when, callback, args, self, context)
        if timer._source_traceback:
            del timer._source_traceback[-1]
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        timer._scheduled = True
        return timer

    def reserve_timer(self) -> int:
        """The place, among equal times, of a timer set now: ``call_at_reserved`` sets it later
        in that place. A caller that will need its timer only if it comes to wait (a deadline)
        keeps the order of timers it would have had, and sets none if it never waits."""
        return next(self._timer_seq)

    def call_at_reserved(self, when: float, seq: int, callback: Callable[[], None]) -> asyncio.TimerHandle:
        """``call_at(when, callback)`` in the place ``seq`` that ``reserve_timer`` gave."""
        self._check_closed()
        timer = events.TimerHandle(when, callback, (), self, None)
        if timer._source_traceback:
            del timer._source_traceback[-1]
        heapq.heappush(self._timers, (when, seq, timer))
        timer._scheduled = True
        return timer

    def call_at_light(self, when: float, callback: Callable[[], None]) -> LightTimer:
        """``call_at`` for a callback with no arguments and no context to run in."""
        timer = LightTimer(when, callback, self)
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        return timer

    def rearm_light(self, timer: LightTimer, when: float) -> LightTimer:
        """Schedule ``timer``, one of this loop's that has run and was not cancelled, again at
        ``when``: an engine sets one timer per completion, and this spares the allocation."""
        if timer._loop is not self or timer._scheduled or timer._cancelled:
            raise RuntimeError("rearm_light: only a timer of this loop that has run and was not cancelled")
        timer._when = when
        timer._scheduled = True
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        return timer

    def close(self) -> None:
        self._timers.clear()
        super().close()

    def _run_once(self) -> None:
        """asyncio's ``_run_once`` (3.11) on the tuple heap, with no I/O to poll, iterated
        until the loop is stopping: ``run_forever`` does nothing else between two iterations,
        and a simulation makes one iteration per event, so their calls and set-up were a
        noticeable part of its CPU."""
        ready = self._ready
        sel = self._vselector
        resolution = self._clock_resolution
        heappop = heapq.heappop
        while True:
            timers = self._timers
            n = len(timers)
            if n > 100 and self._timer_cancelled_count * 2 > n:
                live = []
                for e in timers:
                    if e[2]._cancelled:
                        e[2]._scheduled = False
                    else:
                        live.append(e)
                heapq.heapify(live)
                self._timers = timers = live
                self._timer_cancelled_count = 0
            else:
                while timers and timers[0][2]._cancelled:
                    self._timer_cancelled_count -= 1
                    heappop(timers)[2]._scheduled = False
            if ready or self._stopping:
                pass
            elif timers:
                # Straight to the next timer: asyncio caps a select at a day, which on a virtual
                # clock is only a day's step at a time (a 1e9 s tool delay: 11,574 steps).
                timeout = timers[0][0] - sel.now
                if timeout > 0:
                    sel.now += timeout
            else:
                sel.select(None)  # raises SimulationStalled
            end_time = sel.now + resolution
            if end_time == sel.now and timers and timers[0][0] - sel.now < resolution:
                # Past ~4.5e6 s one ulp of the clock is more than its resolution: the timer it
                # stepped to would never come due, and the loop would spin.
                end_time = math.nextafter(timers[0][0], math.inf)
            if not ready and timers and timers[0][0] < end_time:
                timer = heappop(timers)[2]  # live: cancelled ones were cleared off the top
                timer._scheduled = False
                if type(timer) is LightTimer and not (timers and timers[0][0] < end_time):
                    # Alone in its iteration, as nearly every completion of a simulated engine
                    # is: run it without the trip through the ready queue.
                    timer._run()
                    if self._stopping:
                        return
                    continue
                ready.append(timer)
            while timers and timers[0][0] < end_time:
                timer = heappop(timers)[2]
                timer._scheduled = False
                ready.append(timer)
            for _ in range(len(ready)):
                handle = ready.popleft()
                if not handle._cancelled:
                    handle._run()
            if self._stopping:
                return


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
