"""Which GPUs each role gets in a mode, and the staleness budget the mode runs under."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import Scenario


@dataclass(frozen=True)
class Placement:
    """GPUs per role in one mode. ``sync`` colocates: every GPU generates, then trains."""

    colocated: bool
    engines: int
    gpus_per_engine: int
    trainer_gpus: int

    @classmethod
    def of(cls, sc: Scenario, mode: str) -> "Placement":
        r = sc.resources
        if mode == "sync":
            total = r.rollout_gpus + r.trainer_gpus
            return cls(True, total // r.gpus_per_engine, r.gpus_per_engine, total)
        return cls(False, r.rollout_gpus // r.gpus_per_engine, r.gpus_per_engine, r.trainer_gpus)

    @property
    def total_gpus(self) -> int:
        return self.trainer_gpus if self.colocated else self.trainer_gpus + self.engines * self.gpus_per_engine


def effective_staleness(sc: Scenario, mode: str) -> tuple[int, float]:
    """(max_staleness, admission lead); sync is on-policy whatever the scenario says."""
    if mode == "sync":
        return 0, 0.0
    return sc.staleness.max_staleness, sc.lead
