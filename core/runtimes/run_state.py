"""One snapshot of the components' state, written once for every runtime.

A run's state has two sides, each the components one process holds:

- ``TrainerSide``: the Trainer (step, version, learning curve, what it holds untrained), its
  ParamSync (every sync's times), the train backend's counters, the ledger and the spans;
- ``RolloutSide``: the Rollouter (admission, routing, interrupted and retried groups), the
  staleness queue (its version, counters and contents) and the ledger.

In one process (sim, local) both sides are of one system and go into one checkpoint
(``core/runtimes/run_checkpoint.py``); on ray the trainer actor writes its side and the
rollout actor adds its own to the same directory (``core/runtimes/ray_checkpoint.py``). The
same two classes take and put back the state either way; what differs is only where each side
lives. Times are stored as run times: ``zero`` is the reading of this process's clock at run
time 0 (0 in one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from core.api import TrainBackend
from core.model.ledger import Ledger
from core.model.sample import Group
from core.model.timeline import Timeline
from core.pipeline.param_sync import ParamSync
from core.pipeline.rollouter import Rollouter
from core.pipeline.staleness_queue import AsyncStalenessQueue
from core.pipeline.trainer import Trainer

ROLLOUT_GROUPS = ("queued", "interrupted", "retry")


def shifted_records(rows: list[dict], dt: float) -> list[dict]:
    """Fault records with their times moved by ``dt``."""
    out = []
    for r in rows:
        r = dict(r)
        r["at_s"] += dt
        if r.get("recovered_s") is not None:
            r["recovered_s"] += dt
        out.append(r)
    return out


def shifted_spans(spans: dict, dt: float) -> dict:
    return {w: [[k, a + dt, b + dt] for k, a, b in rows] for w, rows in spans.items()}


def trainer_state_at(state: dict, dt: float) -> dict:
    """The trainer's state with its step times moved by ``dt``."""
    return {**state, "step_info": [{**info, "end_s": info["end_s"] + dt} for info in state["step_info"]]}


@dataclass
class TrainerSide:
    """The components of the trainer's process whose state a checkpoint keeps."""

    trainer: Trainer
    param_sync: ParamSync
    backend: TrainBackend
    ledger: Ledger
    timeline: Timeline

    def state(self, zero: float = 0.0) -> tuple[dict, dict[str, list[Group]]]:
        """(state, groups), taken inside a sync; times in run time."""
        state = {
            "trainer": trainer_state_at(self.trainer.state(), -zero),
            "param_sync": self.param_sync.state(),
            "ledger": self.ledger.state(shift_s=-zero),
            "timeline": shifted_spans(self.timeline.spans, -zero),
            "backend": self.backend.state(),
        }
        return state, {"holding": list(self.trainer.holding.groups)}

    def restore(self, state: dict, groups: dict[str, list[Group]], zero: float = 0.0,
                ledger_fields: Optional[tuple[str, ...]] = None) -> None:
        """Back to ``state`` on a fresh trainer; ``ledger_fields``: the ledger's counts this side
        owns (None: all of them)."""
        self.trainer.restore(trainer_state_at(state["trainer"], zero), groups["holding"])
        self.param_sync.restore(state["param_sync"])
        self.ledger.restore(state["ledger"], fields=ledger_fields)
        self.ledger.shift_times(zero)
        self.backend.restore(state["backend"])
        for w, rows in shifted_spans(state["timeline"], zero).items():
            self.timeline.spans[w][:0] = rows

    def restart(self, state: dict, zero: float = 0.0) -> None:
        """A trainer restarted after a kill takes back only what died with it: step, version,
        learning curve and the ledger's trained counts (its waits, syncs and spans happened)."""
        self.trainer.restore(trainer_state_at(state["trainer"], zero), [], wait_s=False)
        self.ledger.restore(state["ledger"], fields=Ledger.TRAINED_FIELDS)
        self.ledger.shift_times(zero)


@dataclass
class RolloutSide:
    """The components of the rollout's process whose state a checkpoint keeps (the engines'
    own state is the runtime's to gather: in process, or from their actors)."""

    rollouter: Rollouter
    queue: AsyncStalenessQueue
    ledger: Ledger

    def state(self, clock: float, zero: float = 0.0) -> dict:
        """Taken inside a sync, rollout paused; ``clock``: this process's clock now."""
        return {
            "clock": clock - zero,
            "ledger": self.ledger.state(shift_s=-zero),
            "rollouter": self.rollouter.state(),
            "queue": self.queue.state(),
        }

    def groups(self) -> dict[str, list[Group]]:
        """The groups this side holds: queued, interrupted (partial tokens) and to be retried."""
        ro = self.rollouter
        return {"queued": self.queue.contents(), "interrupted": list(ro.cancel_queue), "retry": list(ro.retry_queue)}

    def restore(self, state: dict, groups: dict[str, list[Group]], zero: float = 0.0, paused: bool = True,
                new_engines: bool = False) -> None:
        """Back to ``state`` on a fresh rollout side, ``paused`` inside the sync it was taken in;
        ``new_engines``: the engines are new processes, holding no interrupted group's prefix."""
        self.ledger.restore(state["ledger"])
        self.ledger.shift_times(zero)
        ro = state["rollouter"]
        if new_engines:
            ro = {**ro, "holders": []}
        self.rollouter.restore(ro, groups["interrupted"], groups["retry"], paused=paused)
        self.queue.restore(state["queue"], groups["queued"])
