"""Fault injection and trainer supervision, written once for every runtime.

``FaultInjector`` decides *when* a scenario's fault fires (a time, or a finished trainer
step); ``strike`` decides *what* each kind of fault does, through the ``FaultTargets`` a
runtime implements (*how*: cancel a task on the virtual clock, or kill a Ray actor).
``supervise_trainer`` restarts a trainer whose process died from its latest checkpoint,
up to ``recovery.max_restarts`` times. ``RestartBudget`` counts, bounds and logs the restarts
of a runtime's components: the trainer's here, the env actors' (``ray.max_restarts``) in
``core/runtimes/ray_env.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Awaitable, Callable, Mapping, Optional, Protocol

from core.model.config import FaultSpec
from core.model.faults import FaultLog, FaultPlan, RestartsExhausted, worker_key

log = logging.getLogger(__name__)


class FaultTargets(Protocol):
    """What a fault can do to a runtime's components."""

    def kill_trainer(self) -> None: ...

    def kill_queue(self) -> None: ...

    def kill_worker(self, worker: int) -> None: ...

    def slow_worker(self, worker: int, factor: float, duration_s: float) -> None: ...

    def hang_worker(self, worker: int, call: str) -> None: ...

    def kill_node(self, of: str, worker: int) -> None: ...


def fault_target(f: FaultSpec) -> str:
    """The name a fault's records go under."""
    if f.target == "node":
        return f"node_of_{worker_key(f.worker) if f.node_of == 'rollout_worker' else f.node_of}"
    return worker_key(f.worker) if f.target == "rollout_worker" else f.target


def strike(f: FaultSpec, targets: FaultTargets, faults: FaultLog, now: float) -> None:
    """Record the fault and do it."""
    faults.injected(f.kind, fault_target(f), now)
    if f.target == "trainer":
        targets.kill_trainer()
    elif f.target == "queue":
        targets.kill_queue()
    elif f.target == "node":
        targets.kill_node(f.node_of, f.worker)
    elif f.kind == "kill":
        targets.kill_worker(f.worker)
    elif f.kind == "slow":
        targets.slow_worker(f.worker, f.factor, f.duration_s)
    else:
        targets.hang_worker(f.worker, f.call)


class FaultInjector:
    """Fires the scenario's faults once each: at their time or after their trainer step.

    On an event loop the timed ones are timers (``arm``) and the stepped ones fire from the
    trainer's step callback (``on_step``); a watcher that polls calls ``poll`` instead.
    ``fire(i, fault)`` does the firing (usually ``strike`` on the right targets).
    """

    def __init__(self, plan: FaultPlan, fire: Callable[[int, FaultSpec], None]) -> None:
        self.plan, self.fire = plan, fire
        self._timers: list[asyncio.TimerHandle] = []

    def arm(self) -> None:
        loop = asyncio.get_running_loop()
        for i in self.plan.timed():
            self._timers.append(loop.call_at(max(loop.time(), self.plan.faults[i].at_s), self._fire, i))

    def on_step(self, step: int) -> None:
        for i in self.plan.due_at_step(step):
            self._fire(i)

    def poll(self, step: int, now: float) -> None:
        for i in self.plan.due(step, now):
            self._fire(i)

    def _fire(self, i: int) -> None:
        if i in self.plan.fired:
            return
        self.plan.fired.add(i)
        self.fire(i, self.plan.faults[i])

    def disarm(self) -> None:
        for t in self._timers:
            t.cancel()
        self._timers.clear()


class RestartBudget:
    """Restarts per component, each allowed ``max_restarts`` (the setting named ``setting``).
    ``counts``: restarts before this process (a resumed run's), which number the incarnations
    but spent the budget of actors gone since: Ray's budget is per actor."""

    def __init__(self, max_restarts: int, setting: str, counts: Optional[Mapping[str, int]] = None) -> None:
        self.max_restarts, self.setting = max_restarts, setting
        self.counts: Counter[str] = Counter(counts or {})
        self._before = Counter(self.counts)

    def spend(self, component: str) -> int:
        """One more restart of ``component``: its count so far, this one included;
        ``RestartsExhausted`` past the budget."""
        self.counts[component] += 1
        n = self.counts[component] - self._before[component]
        if n > self.max_restarts:
            raise RestartsExhausted(f"{component}: killed {n} times, more than {self.setting} = {self.max_restarts}")
        return self.counts[component]

    def restarted(self, component: str, how: str) -> None:
        """``component`` is back, as ``how`` says."""
        log.info("%s restarted (%d of %s = %d): %s", component, self.counts[component] - self._before[component],
                 self.setting, self.max_restarts, how)


class TrainerDied(Exception):
    """The trainer's process died (killed, or its actor lost)."""


async def supervise_trainer(
    run: Callable[[bool], Awaitable[None]],
    restart: Callable[[], Awaitable[None]],
    max_restarts: int,
    died: tuple[type[BaseException], ...] = (TrainerDied,),
) -> None:
    """Train to the end: ``run(resync)`` trains; when it raises one of ``died``, ``restart()``
    brings a new trainer back from the latest checkpoint, and it runs again with ``resync``
    (first moving the engines to its weights, which may be older than theirs)."""
    budget = RestartBudget(max_restarts, "recovery.max_restarts")
    resync = False
    while True:
        try:
            await run(resync)
            return
        except died as exc:
            log.info("trainer died: %s", exc)
        budget.spend("trainer")
        await restart()
        resync = True

