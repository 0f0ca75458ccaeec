"""All wiring in one place: ``connect_components`` builds one mode's system from its workers.

One sample's life, file by file: ``rollouter.py`` admits its group and hands it to an
engine (``core/sim/engine.py``, a real one in ``core/real/``, or a proxy to one in a Ray
actor); the finished group goes through ``staleness_queue.py`` (and, when the scenario
enables it, the replay ring of ``replay_stage.py``) to ``trainer.py``; every
``sync_every`` steps ``param_sync.py`` pauses rollout, moves the weights and bumps the
version; ``core/model/ledger.py`` accounts for it at each transition. The runtimes
(``core/runtimes/``) supply the workers and run what is built here.

Modes:
- ``sync``: colocated baseline. Every GPU generates one sync window, then every GPU trains
  it, then the weights are resharded in place. Staleness is 0 by construction.
- ``async``: rollout and trainer GPUs apart, overlapping; a sync drains in-flight work.
- ``partial``: as async, but a sync aborts in-flight work and resumes it after.
- ``inflight``: as async, but a sync freezes in-flight work between two decode steps; the
  engines load the new weights under it and decode on with its KV cache, so each token
  carries the version that produced it (PipelineRL's in-flight weight updates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from core.api import Batch, BatchSource, Engine, LocalEngine, PauseMode, PromptSource, RewardFn, RolloutControl, TrainBackend, WeightTransfer
from core.model.config import Placement, Scenario, effective_staleness
from core.model.faults import FaultLog, FaultPlan
from core.model.ledger import Ledger
from core.model.progress import ProgressFn
from core.model.result import EngineCounters, RunResult, SyncCounters, TrainerCounters
from core.model.sample import Group
from core.model.timeline import Timeline
from core.pipeline.param_sync import ParamSync
from core.pipeline.replay_stage import ReplayStage, staleness_bound
from core.pipeline.rollouter import Rollouter
from core.pipeline.staleness_queue import AsyncStalenessQueue, QueueBatches
from core.pipeline.supervised_engine import SupervisedEngine
from core.pipeline.trainer import Trainer
from core.store.queue_journal import QueueJournal

# What a sync does to generations in flight, per mode (sync has none in flight by then).
PAUSE: dict[str, PauseMode] = {"sync": "wait", "async": "wait", "partial": "abort", "inflight": "keep"}


@dataclass
class Workers:
    """What does the work, which is all that differs between runtimes: engines (simulated,
    in process, or proxies to Ray actors), the train backend, how weights move, and, for
    real engines, where prompts and rewards come from."""

    engines: list[Engine]
    backend: Optional[TrainBackend]
    transfer: Optional[WeightTransfer]
    prompts: Optional[PromptSource] = None
    reward: Optional[RewardFn] = None
    # A prompt's modelled reward spread: the replay priority of a group whose samples carry no reward.
    spread: Optional[Callable[[int], float]] = None


@dataclass
class System:
    """The components of one mode, connected in one process."""

    scenario: Scenario
    mode: str
    placement: Placement
    ledger: Ledger
    timeline: Timeline
    queue: AsyncStalenessQueue
    engines: list[LocalEngine]
    rollouter: Rollouter
    param_sync: ParamSync
    trainer: Trainer
    train_backend: TrainBackend
    replay: Optional[ReplayStage] = None
    faults: FaultLog = field(default_factory=FaultLog)
    plan: FaultPlan = field(default_factory=lambda: FaultPlan((), set()))
    run_dir: Optional[Path] = None  # checkpoints and the queue's journal

    def result(self, end_s: float, wall_s: float = 0.0, evaluations: Optional[list] = None) -> RunResult:
        """What the run leaves for its report, read off the components once it ended."""
        t, be, ps = self.trainer, self.train_backend, self.param_sync
        return RunResult(
            scenario=self.scenario,
            mode=self.mode,
            placement=self.placement,
            ledger=self.ledger,
            timeline=self.timeline,
            engines=[
                EngineCounters.of(e, sup.restarts, self.rollouter.resume_counts(i))
                for i, (e, sup) in enumerate(zip(self.engines, self.rollouter.engines))
            ],
            trainer=TrainerCounters(t.step, t.version, t.wait_s, t.step_info, be.compute_s, be.flops, be.peak_flops),
            sync=SyncCounters(ps.pause_s, ps.drain_s, ps.transfer_s),
            queue_counters=self.queue.counters(),
            replay_counters=self.replay.counters() if self.replay else None,
            in_flight=in_flight(self),
            faults=self.faults,
            end_s=end_s,
            wall_s=wall_s,
            evaluations=list(evaluations or []),
        )


def queue_capacity(sc: Scenario, mode: str) -> int:
    # Admission keeps admitted-but-untrained samples under (max_staleness + 2) windows, so
    # a queue this large never blocks a producer while the trainer waits on a sync drain.
    max_staleness, _ = effective_staleness(sc, mode)
    return (max_staleness + 2) * sc.window // sc.workload.group_size + sc.warm_up_groups + 1


def trained_bound(sc: Scenario, mode: str) -> int:
    """The staleness no trained sample exceeds: the queue's bound, plus a replay ring's."""
    max_staleness, _ = effective_staleness(sc, mode)
    rp = sc.replay
    if not rp.enabled:
        return max_staleness
    return staleness_bound(max_staleness, rp.capacity_groups, sc.fresh_groups_per_step, sc.trainer.sync_every)


def durable(sc: Scenario) -> bool:
    """Whether the queue keeps a journal and delivered groups until acknowledged: with
    checkpoints, or when a fault kills the queue or the trainer."""
    return bool(sc.checkpoint.every) or any(f.kind == "kill" and f.target != "rollout_worker" for f in sc.faults)


def make_queue(sc: Scenario, mode: str, run_dir: Optional[Path]) -> AsyncStalenessQueue:
    max_staleness, _ = effective_staleness(sc, mode)
    keep = durable(sc)
    journal = QueueJournal(Path(run_dir) / mode / "queue.journal") if keep and run_dir is not None else None
    return AsyncStalenessQueue(
        capacity=queue_capacity(sc, mode), max_staleness=max_staleness, journal=journal, durable=keep
    )


def connect_rollout(
    sc: Scenario, mode: str, workers: Workers, ledger: Ledger, queue: AsyncStalenessQueue,
    faults: Optional[FaultLog] = None,
) -> Rollouter:
    """The producer side: the Rollouter admitting groups to the engines (each behind its
    timeouts) and feeding the queue."""
    place = Placement.of(sc, mode)
    t, r = sc.timeouts, sc.recovery
    engines = [SupervisedEngine(e, t.generate_s, t.control_s, t.restart_s, r.max_restarts) for e in workers.engines]
    max_staleness, lead = effective_staleness(sc, mode)
    n = sc.workload.group_size
    max_concurrency = sc.rollout.max_concurrency or max(n, place.engines * sc.rollout.max_num_seqs)
    return Rollouter(
        engines=engines,
        queue=queue,
        ledger=ledger,
        group_size=n,
        prompt_tokens=sc.workload.prompt_tokens,
        max_response_len=sc.workload.max_response_len,
        max_concurrency=max_concurrency,
        window=sc.window,
        lead=lead,
        max_staleness=max_staleness,
        plan_samples=(sc.trainer.steps * sc.fresh_groups_per_step + sc.warm_up_groups) * n,
        head_start=sc.warm_up_groups * n,
        prompts=workers.prompts,
        reward=workers.reward,
        faults=faults,
        stop_timeout_s=t.control_s,
    )


def connect_trainer(
    sc: Scenario,
    mode: str,
    workers: Workers,
    ledger: Ledger,
    queue: BatchSource,
    rollouter: RolloutControl,
    timeline: Timeline,
    on_step: Optional[ProgressFn] = None,
) -> tuple[Trainer, ParamSync, Optional[ReplayStage]]:
    """The consumer side: (replay ring,) Trainer, and the ParamSync it triggers.

    ``queue`` and ``rollouter`` are the objects themselves in one process, or proxies with
    the same awaitable methods when the two sides live in different Ray actors.
    """
    place = Placement.of(sc, mode)
    rp = sc.replay
    replay = None
    if rp.enabled:
        spread = workers.spread

        def priority(g: Group) -> float:
            # Real rewards when the engines made some; else the workload's modelled spread.
            rewards = [s.reward for s in g.samples if s.reward is not None]
            if rewards:
                return float(np.std(rewards))
            return spread(g.prompt_id) if spread is not None else 0.0

        replay = ReplayStage(
            queue=queue,
            ledger=ledger,
            capacity=rp.capacity_groups,
            groups_per_step=sc.groups_per_step,
            fresh_per_step=sc.fresh_groups_per_step,
            warm_up=sc.warm_up_groups,
            prioritized=rp.prioritized,
            alpha=rp.alpha,
            beta=rp.beta,
            seed=sc.seed,
            priority=priority,
        )
    param_sync = ParamSync(
        rollouter=rollouter,
        transfer=workers.transfer,
        mode=PAUSE[mode],
        timeline=timeline,
        on_synced=on_step,
    )
    trainer = Trainer(
        source=queue if replay is None else replay,
        ledger=ledger,
        backend=workers.backend,
        param_sync=param_sync,
        groups_per_step=sc.groups_per_step,
        sync_every=sc.trainer.sync_every,
        steps=sc.trainer.steps,
        timeline=timeline,
        pull_window=place.colocated,
        on_step=on_step,
    )
    return trainer, param_sync, replay


def connect_components(
    sc: Scenario,
    mode: str,
    workers: Workers,
    timeline: Timeline,
    on_step: Optional[ProgressFn] = None,
    run_dir: Optional[Path] = None,
) -> System:
    """Build one mode's system in one process (sim or local runtime). Must be called inside
    the loop that will run it. ``run_dir`` holds the queue's journal."""
    ledger = Ledger(trained_bound(sc, mode), reuse=sc.replay.enabled)
    faults = FaultLog()
    queue = make_queue(sc, mode, run_dir)
    rollouter = connect_rollout(sc, mode, workers, ledger, queue, faults)
    trainer, param_sync, replay = connect_trainer(sc, mode, workers, ledger, QueueBatches(queue), rollouter, timeline, on_step)
    return System(
        sc, mode, Placement.of(sc, mode), ledger, timeline, queue, workers.engines,
        rollouter, param_sync, trainer, workers.backend, replay,
        faults=faults, plan=FaultPlan(sc.faults, set()), run_dir=run_dir,
    )


async def end_rollout(rollouter: Rollouter, queue: AsyncStalenessQueue, ledger: Ledger) -> None:
    """End of run, producer side: whatever is still generating or queued is beyond the plan."""
    left = await rollouter.stop()
    ledger.dropped_groups(left + queue.drain(), "run_end")


def release_unused(trainer: Trainer, replay: Optional[ReplayStage], ledger: Ledger) -> None:
    """End of run, consumer side: what the trainer pulled and never trained. With replay, what
    it holds was drawn from the ring, which still counts it: the ring's never-trained groups."""
    unused = replay.drain() if replay else trainer.holding.groups
    ledger.dropped_groups(unused, "run_end")
    trainer.holding = Batch()


def producer_in_flight(rollouter: Rollouter, queue: AsyncStalenessQueue, group_size: int) -> int:
    """Samples being generated, waiting to be generated again, or queued."""
    return rollouter.in_flight() + len(queue) * group_size


def consumer_in_flight(trainer: Trainer, replay: Optional[ReplayStage]) -> int:
    """Samples the trainer pulled (or the replay ring holds) and never trained."""
    unused = replay.untrained() if replay else trainer.holding.groups
    return sum(g.size for g in unused)


def in_flight(system: System) -> int:
    """Samples observed in the components right now (not derived from the ledger)."""
    return (
        producer_in_flight(system.rollouter, system.queue, system.scenario.workload.group_size)
        + consumer_in_flight(system.trainer, system.replay)
    )
