"""Faults: what a lost component raises, the timeouts that turn a hang into a loss, the
injection of faults a scenario declares, and the record of each fault and its recovery.

A rollout worker that dies or stops answering raises ``WorkerLost`` to the Rollouter,
which requeues the worker's groups (nothing they generated there survives) and gets the
worker back through ``SupervisedEngine.recover``. The trainer and the queue recover from
their checkpoint and journal (``core/driver.py``, ``core/queue_journal.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A component died or stopped answering; the message names it and the call."""

    def __init__(self, component: str, call: str, reason: str) -> None:
        self.component, self.call, self.reason = component, call, reason
        super().__init__(f"{component}.{call}: {reason}")


class CallTimeout(WorkerLost):
    """A call got no answer in time."""

    def __init__(self, component: str, call: str, seconds: float, key: str) -> None:
        super().__init__(
            component, call,
            f"no answer within {seconds:g} s; fix: raise {key} if the call is only slow, or find out why it hangs",
        )


class RestartsExhausted(RuntimeError):
    """A component died more often than ``recovery.max_restarts`` allows."""


@dataclass
class FaultRecord:
    """One injected fault: when it struck and when its component served again."""

    kind: str
    target: str
    at_s: float
    recovered_s: Optional[float] = None

    @property
    def recovery_s(self) -> Optional[float]:
        return None if self.recovered_s is None else self.recovered_s - self.at_s


class FaultLog:
    """Every fault of a run and its recovery. A fault is recovered when its component serves
    again: a worker back with the current weights, a queue replayed, a trainer restored and
    its weights synced; a slowdown when it ends."""

    def __init__(self, records: Optional[list[FaultRecord]] = None) -> None:
        self.records: list[FaultRecord] = records or []

    def injected(self, kind: str, target: str, now: float) -> FaultRecord:
        rec = FaultRecord(kind, target, now)
        self.records.append(rec)
        log.info("fault injected: %s %s at %.3f s", kind, target, now)
        return rec

    def recovered(self, target: str, now: float, kinds: tuple[str, ...] = ("kill", "hang")) -> None:
        """Close every open fault of ``target`` of these kinds (a kill during a hang is one
        recovery; a slowdown ends on its own)."""
        for rec in self.records:
            if rec.target == target and rec.kind in kinds and rec.recovered_s is None:
                rec.recovered_s = now
                log.info("recovered: %s %s after %.3f s", rec.kind, target, now - rec.at_s)

    def metrics(self) -> dict[str, float | int]:
        times = [r.recovery_s for r in self.records if r.kind != "slow" and r.recovery_s is not None]
        return {
            "faults/injected": len(self.records),
            "faults/recovered": sum(r.recovered_s is not None for r in self.records),
            "faults/recovery_mean_s": sum(times) / len(times) if times else 0.0,
            "faults/recovery_max_s": max(times) if times else 0.0,
        }

    def state(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    @classmethod
    def from_state(cls, rows: list[dict]) -> "FaultLog":
        return cls([FaultRecord(**r) for r in rows])


def worker_key(i: int) -> str:
    return f"rollout_worker{i}"


class SupervisedEngine:
    """An engine behind timeouts. A call that does not answer in time raises ``CallTimeout``
    naming the engine and the call; ``recover`` kills what is left of a lost worker, waits
    for its restart, and counts restarts against ``max_restarts``."""

    def __init__(self, engine: Any, generate_s: float, control_s: float, restart_s: float, max_restarts: int) -> None:
        self.engine = engine
        self.name = engine.name
        self.generate_s, self.control_s, self.restart_s = generate_s, control_s, restart_s
        self.max_restarts = max_restarts
        self.restarts = 0

    async def _call(self, call: str, coro, seconds: float, key: str):
        try:
            async with asyncio.timeout(seconds):
                return await coro
        except TimeoutError:
            raise CallTimeout(self.name, call, seconds, key) from None

    async def generate(self, group, max_response_len: int) -> bool:
        return await self._call("generate", self.engine.generate(group, max_response_len), self.generate_s, "timeouts.generate_s")

    async def abort_all(self) -> int:
        return await self._call("abort_all", self.engine.abort_all(), self.control_s, "timeouts.control_s")

    async def update_weights(self, version: int, weights: Any) -> None:
        await self._call("update_weights", self.engine.update_weights(version, weights), self.control_s, "timeouts.control_s")

    async def clear_cache(self) -> None:
        await self._call("clear_cache", self.engine.clear_cache(), self.control_s, "timeouts.control_s")

    async def recover(self) -> None:
        """Bring the worker back: killed first if it only hangs, then restarted."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RestartsExhausted(
                f"{self.name}: lost {self.restarts} times, more than recovery.max_restarts = {self.max_restarts}; "
                "fix: raise recovery.max_restarts, or find out why it keeps dying"
            )
        await self._call("restart", self.engine.recover(), self.restart_s, "timeouts.restart_s")


@dataclass
class FaultPlan:
    """The scenario's faults, and which have fired (a resumed run fires only the rest)."""

    faults: tuple
    fired: set

    def due_at_step(self, step: int) -> list[int]:
        return [i for i, f in enumerate(self.faults) if i not in self.fired and f.at_step is not None and f.at_step <= step]

    def due(self, step: int, now: float) -> list[int]:
        """Faults not yet fired whose step is done or whose time has come (a watcher that polls)."""
        return [
            i for i, f in enumerate(self.faults) if i not in self.fired
            and ((f.at_step is not None and f.at_step <= step) or (f.at_s is not None and f.at_s <= now))
        ]

    def timed(self) -> list[int]:
        return [i for i, f in enumerate(self.faults) if i not in self.fired and f.at_s is not None]


class FaultInjector:
    """Fires the scenario's faults on the sim runtime: at a time (a timer on the virtual
    clock) or after a trainer step. ``act(fault, record)`` does what each kind does."""

    def __init__(self, plan: FaultPlan, log_: FaultLog, act: Callable[[Any, FaultRecord], None]) -> None:
        self.plan, self.log, self.act = plan, log_, act
        self._timers: list[asyncio.TimerHandle] = []

    def arm(self) -> None:
        loop = asyncio.get_running_loop()
        for i in self.plan.timed():
            self._timers.append(loop.call_at(max(loop.time(), self.plan.faults[i].at_s), self._fire, i))

    def on_step(self, step: int) -> None:
        for i in self.plan.due_at_step(step):
            self._fire(i)

    def _fire(self, i: int) -> None:
        if i in self.plan.fired:
            return
        self.plan.fired.add(i)
        f = self.plan.faults[i]
        target = worker_key(f.worker) if f.target == "rollout_worker" else f.target
        rec = self.log.injected(f.kind, target, asyncio.get_running_loop().time())
        self.act(f, rec)

    def disarm(self) -> None:
        for t in self._timers:
            t.cancel()
        self._timers.clear()
