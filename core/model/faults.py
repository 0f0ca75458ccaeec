"""Faults as facts: what a lost component raises, the record of each fault and its
recovery, and the scenario's plan of which faults fire when.

A rollout worker that dies or stops answering raises ``WorkerLost`` to the Rollouter,
which requeues the worker's groups (nothing they generated there survives) and gets the
worker back through ``SupervisedEngine.recover`` (core/pipeline/supervised_engine.py).
Injection and trainer supervision are the runtimes' (core/runtimes/supervision.py).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Optional

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


class CollectiveBroken(RuntimeError):
    """A collective transfer (a weight broadcast) failed part-way: a member died or stopped
    answering, so every member's copy may be partial. The sync is sent again to those still up."""

    def __init__(self, who: str, reason: str) -> None:
        super().__init__(f"{who}: weight broadcast broken ({reason})")


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
