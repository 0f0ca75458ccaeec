"""``RunResult``: what every runtime returns of a finished mode, on one clock.

The report is a pure function of it (``harness.metrics``). In one process it is read off
the components; on Ray each actor sends its part and the driver moves every timestamp onto
its own clock, zero at the start (``clock_offsets_s`` keeps what it moved them by).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from core.model.config import Placement, Scenario
from core.model.faults import FaultLog
from core.model.ledger import Ledger
from core.model.timeline import Timeline


@dataclass(frozen=True)
class EngineCounters:
    """One rollout engine's totals."""

    name: str
    busy_s: float
    seq_s: float  # the running batch integrated over time
    tokens_generated: int
    prefill_tokens: int
    restarts: int = 0  # times its supervisor brought it back
    step_spans: Optional[dict] = None  # a real engine's per-step rows, for calibration (harness/calibrate.py)
    preemptions: int = 0  # requests it evicted from a full KV cache (the sim engine)
    recomputed_tokens: int = 0  # their context, prefilled again when they came back
    sticky_resumes: int = 0  # interrupted groups resumed here, the engine holding their prefix
    moved_resumes: int = 0  # interrupted groups resumed here because their holder was down or restarted

    @classmethod
    def of(cls, engine, restarts: int = 0, resumes: Optional[dict] = None) -> "EngineCounters":
        spans = getattr(engine, "step_spans", None)
        spans = spans() if callable(spans) else spans
        return cls(engine.name, engine.busy_s, engine.seq_s, engine.tokens_generated, engine.prefill_tokens, restarts, spans,
                   getattr(engine, "preemptions", 0), getattr(engine, "recomputed_tokens", 0), **(resumes or {}))


@dataclass(frozen=True)
class TrainerCounters:
    step: int
    version: int
    wait_s: float  # waiting for batches
    step_info: list  # what the backend said of each step, with its end time
    compute_s: float  # in the backend's steps
    flops: float
    peak_flops: float


@dataclass(frozen=True)
class SyncCounters:
    """Per weight sync: rollout paused (drain included), drained or aborted, weights moving."""

    pause_s: list
    drain_s: list
    transfer_s: list
    bytes: list = field(default_factory=list)  # what each moved, in the engines' dtype, where the transfer counts it


@dataclass
class RunResult:
    scenario: Scenario
    mode: str
    placement: Placement
    ledger: Ledger
    timeline: Timeline
    engines: list[EngineCounters]
    trainer: TrainerCounters
    sync: SyncCounters
    queue_counters: dict
    replay_counters: Optional[dict]
    in_flight: int  # samples observed in the components at the end (not derived from the ledger)
    faults: FaultLog
    end_s: float
    wall_s: float = 0.0
    evaluations: list = field(default_factory=list)  # held-out scores per version (real runtimes)
    clock_offsets_s: dict = field(default_factory=dict)  # per process, what its times were shifted by
    nodes: dict = field(default_factory=dict)  # ray: per component, the node ids it ran on (start, then any after a restart)
    # Agent episodes: the loop's counts and, per engine, when tools ran for its episodes
    # (core/agent/loop.py EpisodeLoop.state); None where each sample is one completion.
    agent: Optional[dict] = None
