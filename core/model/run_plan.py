"""``RunPlan``: one mode of a scenario, resolved once.

What a mode changes (where each role runs, how stale a trained sample may be, how far
admission leads, how large the queue is, the bound the ledger checks, what a sync does to the
generations in flight) is worked out here, in one place, from ``(scenario, mode)``. The
dispatcher makes the plan and every runtime and wiring function below it reads it; none of
them looks at the mode's name to work any of it out again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.model.config import Placement, Scenario, effective_staleness

# What a sync does to generations in flight, per mode (sync has none in flight by then):
# core.api.PauseMode's values.
PAUSE: dict[str, str] = {"sync": "wait", "async": "wait", "partial": "abort", "inflight": "keep"}


def staleness_bound(max_staleness: int, capacity: int, fresh_per_step: int, sync_every: int) -> int:
    """The most versions a trained group can lag behind: its age on arrival plus its life in the ring.

    Fresh groups are added step by step (``get_batch`` interleaves adding and drawing even
    when it serves a whole window), at least ``fresh_per_step`` a step. A group added at step
    s is overwritten once ``capacity`` newer ones arrived, by step s + L, L = ceil(capacity /
    fresh_per_step), so it is trained at step s + L - 1 at the latest: at most
    ceil((L - 1) / sync_every) versions after it arrived, when it was at most
    ``max_staleness`` old.
    """
    steps = math.ceil(capacity / fresh_per_step)
    return max_staleness + math.ceil((steps - 1) / sync_every)


@dataclass(frozen=True)
class RunPlan:
    """One mode of a scenario, as every component below the dispatcher needs it."""

    scenario: Scenario
    mode: str
    placement: Placement
    max_staleness: int  # the queue's bound: sync is on-policy whatever the scenario says
    lead: float  # how many windows admission runs ahead of the trainer's version
    queue_capacity: int  # groups
    trained_bound: int  # the staleness no trained sample exceeds: the queue's, plus a replay ring's
    pause: str  # what a sync does to generations in flight (core.api.PauseMode)
    # What admission lets run beyond the staleness budget. ``pass_floor``: a filter's
    # min_pass_rate where admission counts unscored groups at the expected pass rate (never in
    # colocated sync, whose GPUs train while rollout waits), else 1. ``surplus``: samples
    # over-provisioned (rollout.overprovision), whole groups.
    pass_floor: float = 1.0
    surplus: int = 0

    @classmethod
    def of(cls, sc: Scenario, mode: str) -> "RunPlan":
        max_staleness, lead = effective_staleness(sc, mode)
        placement = Placement.of(sc, mode)
        n = sc.workload.group_size
        f = sc.filter
        pass_floor = f.min_pass_rate if f is not None and not placement.colocated else 1.0
        surplus = math.ceil((sc.rollout.overprovision - 1.0) * sc.window / n - 1e-9) * n
        # Admission keeps admitted-but-untrained samples under (max_staleness + 2) windows, so
        # a queue this large never blocks a producer while the trainer waits on a sync drain;
        # what admission lets run beyond the budget may all finish, and fits too.
        capacity = math.ceil(((max_staleness + 2) * sc.window / pass_floor + surplus) / n) + sc.warm_up_groups + 1
        rp = sc.replay
        bound = max_staleness
        if rp.enabled:
            bound = staleness_bound(max_staleness, rp.capacity_groups, sc.fresh_groups_per_step, sc.trainer.sync_every)
        return cls(sc, mode, placement, max_staleness, lead, capacity, bound, PAUSE[mode], pass_floor, surplus)
