"""An engine behind timeouts: a hang becomes a loss the Rollouter can recover from."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Optional

from core.api import Engine, ReservingClock
from core.model.faults import CallTimeout, RestartsExhausted


class _Call:
    """One call under a deadline: the task to cancel when it expires."""

    __slots__ = ("deadline", "task", "cancelling", "done", "expired")

    def __init__(self, deadline: float, task: asyncio.Task) -> None:
        self.deadline = deadline
        self.task = task
        self.cancelling = task.cancelling()
        self.done = False
        self.expired = False


class _Deadlines:
    """The deadlines of the calls made with one timeout, and one timer for the oldest live one.

    Every call gets the same timeout, so deadlines are in call order: a FIFO. An
    ``asyncio.timeout`` per call costs a timer and its cancellation on every call (the sim's
    hottest path); here a call that ends only marks itself done, and the timer moves on when
    the oldest live call ends. A call still running at its deadline has its task cancelled,
    exactly as ``asyncio.timeout`` would, at the same time."""

    __slots__ = ("seconds", "_calls", "_timer", "_armed")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._calls: deque[_Call] = deque()
        self._timer: Optional[asyncio.TimerHandle] = None
        self._armed: Optional[_Call] = None

    def start(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> _Call:
        call = _Call(loop.time() + self.seconds, task)
        self._calls.append(call)
        if self._armed is None:
            self._arm(loop)
        return call

    def place(self, loop: asyncio.AbstractEventLoop) -> Optional[int]:
        """For a call starting now that is entered only if it comes to wait (``enter``): the
        place its timer would take, reserved now, or None where an older call's timer serves."""
        return loop.reserve_timer() if self._armed is None else None

    def enter(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task, seq: Optional[int]) -> _Call:
        """``start`` for a call that started earlier in the same step of its task
        (the clock has not moved, and no other call has started or ended since), with the place
        ``place`` gave it."""
        call = _Call(loop.time() + self.seconds, task)
        self._calls.append(call)
        if self._armed is None:
            if seq is None:
                self._arm(loop)
            else:
                self._armed = call
                self._timer = loop.call_at_reserved(call.deadline, seq, self._expire)
        return call

    def end(self, call: _Call) -> None:
        call.done = True
        if call is self._armed:
            calls = self._calls
            while calls and calls[0].done:
                calls.popleft()
            if calls and calls[0].deadline == call.deadline:
                self._armed = calls[0]  # calls made together (a sync's): the timer stands
                return
            self._timer.cancel()
            self._timer = self._armed = None
            self._arm(asyncio.get_running_loop())

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        calls = self._calls
        while calls and calls[0].done:
            calls.popleft()
        if calls:
            self._armed = calls[0]
            self._timer = loop.call_at(calls[0].deadline, self._expire)

    def _expire(self) -> None:
        call = self._calls.popleft()
        self._timer = self._armed = None
        call.expired = True
        call.task.cancel()
        self._arm(asyncio.get_running_loop())


class _SetOnWait:
    """Awaits ``coro`` as ``await`` would; only if the coroutine comes to wait is the call
    entered among its deadlines (``entry``), its timer set in the place reserved at the start.
    A call that returns without waiting (most control calls to a simulated engine) needs none."""

    __slots__ = ("coro", "deadlines", "seq", "loop", "entry")

    def __init__(self, coro, deadlines: _Deadlines, loop: asyncio.AbstractEventLoop) -> None:
        self.coro, self.deadlines, self.loop = coro, deadlines, loop
        self.seq = deadlines.place(loop)
        self.entry: Optional[_Call] = None

    def __await__(self):
        it = self.coro.__await__()
        try:
            fut = it.send(None)
        except StopIteration as stop:
            return stop.value
        self.entry = self.deadlines.enter(self.loop, asyncio.current_task(), self.seq)
        # From its first wait on, what ``yield from it`` would do.
        while True:
            try:
                value = yield fut
            except GeneratorExit:
                it.close()
                raise
            except BaseException as exc:
                try:
                    fut = it.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    fut = it.send(value)
                except StopIteration as stop:
                    return stop.value


class SupervisedEngine:
    """An engine behind timeouts. A call that does not answer in time raises ``CallTimeout``
    naming the engine and the call; ``recover`` kills what is left of a lost worker, waits
    for its restart, and counts restarts against ``max_restarts``."""

    def __init__(self, engine: Engine, generate_s: float, control_s: float, restart_s: float, max_restarts: int) -> None:
        self.engine = engine
        self.name = engine.name
        self.generate_s, self.control_s, self.restart_s = generate_s, control_s, restart_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self._deadlines = {s: _Deadlines(s) for s in (generate_s, control_s, restart_s)}

    def answers_now(self) -> bool:
        """The engine's control calls return without waiting: no deadline can fire."""
        return self.engine.answers_now()

    def call_now(self, call: str, *args: Any) -> Any:
        """A control call of an engine that ``answers_now``, run to its end here, with no
        deadline (it cannot wait) and no task."""
        coro = getattr(self.engine, call)(*args)
        try:
            coro.send(None)
        except StopIteration as stop:
            return stop.value
        coro.close()
        raise RuntimeError(f"{self.name}: {call} waited though the engine answers at once")

    async def _call(self, call: str, coro, seconds: float, key: str, lazy: bool = True):
        loop = asyncio.get_running_loop()
        deadlines = self._deadlines[seconds]
        if lazy and isinstance(loop, ReservingClock):
            waits = _SetOnWait(coro, deadlines, loop)
            try:
                return await waits
            except asyncio.CancelledError:
                entry = waits.entry
                if entry is not None and entry.expired and entry.task.uncancel() <= entry.cancelling:
                    raise CallTimeout(self.name, call, seconds, key) from None
                raise
            finally:
                if waits.entry is not None and not waits.entry.expired:
                    deadlines.end(waits.entry)
        entry = deadlines.start(loop, asyncio.current_task())
        try:
            return await coro
        except asyncio.CancelledError:
            if entry.expired and entry.task.uncancel() <= entry.cancelling:
                raise CallTimeout(self.name, call, seconds, key) from None
            raise
        finally:
            if not entry.expired:
                deadlines.end(entry)

    async def generate(self, group, max_response_len: int, stop_ids: frozenset[int] = frozenset()) -> bool:
        # A generation always waits: its deadline's timer is set at once, without the wrapper.
        return await self._call(
            "generate", self.engine.generate(group, max_response_len, stop_ids), self.generate_s, "timeouts.generate_s", lazy=False
        )

    async def abort_all(self) -> int:
        return await self._call("abort_all", self.engine.abort_all(), self.control_s, "timeouts.control_s")

    async def update_weights(self, version: int, weights: Any) -> None:
        await self._call("update_weights", self.engine.update_weights(version, weights), self.control_s, "timeouts.control_s")

    async def clear_cache(self) -> None:
        await self._call("clear_cache", self.engine.clear_cache(), self.control_s, "timeouts.control_s")

    async def freeze(self) -> None:
        await self._call("freeze", self.engine.freeze(), self.control_s, "timeouts.control_s")

    async def thaw(self) -> None:
        await self._call("thaw", self.engine.thaw(), self.control_s, "timeouts.control_s")

    async def recover(self) -> None:
        """Bring the worker back: killed first if it only hangs, then restarted."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RestartsExhausted(
                f"{self.name}: lost {self.restarts} times, more than recovery.max_restarts = {self.max_restarts}; "
                "fix: raise timeouts.generate_s if its calls only run long, raise recovery.max_restarts, or find out why it keeps dying"
            )
        await self._call("restart", self.engine.recover(), self.restart_s, "timeouts.restart_s")


