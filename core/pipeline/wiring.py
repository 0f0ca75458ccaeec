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
from typing import Awaitable, Callable, Optional

import numpy as np

from core.api import AgentLoop, Batch, BatchSource, CollectiveTransfer, Engine, LocalEngine, PromptSource, RewardFn, RolloutControl, TrainBackend, WeightTransfer
from core.model.config import Placement, Scenario
from core.model.faults import FaultLog, FaultPlan
from core.model.ledger import Ledger
from core.model.progress import ProgressFn, WeightsSynced
from core.model.result import EngineCounters, RunResult, SyncCounters, TrainerCounters
from core.model.sample import Group
from core.model.timeline import Timeline
from core.pipeline.group_filter import GroupFilter
from core.pipeline.param_sync import ParamSync
from core.model.run_plan import RunPlan
from core.pipeline.replay_stage import ReplayStage
from core.pipeline.rollouter import Rollouter
from core.pipeline.staleness_queue import AsyncStalenessQueue, QueueBatches
from core.pipeline.supervised_engine import SupervisedEngine
from core.pipeline.trainer import Trainer
from core.store.queue_journal import QueueJournal

# ParamSync's checkpoint at a due sync, rollout paused: (version, t0 the sync began, t1 rollout stopped).
CheckpointFn = Callable[[int, float, float], Awaitable[None]]


@dataclass
class Workers:
    """What does the work, which is all that differs between runtimes: engines (simulated,
    in process, or proxies to Ray actors), the train backend, how weights move, and, for
    real engines, where prompts and rewards come from."""

    engines: list[Engine]
    backend: Optional[TrainBackend]
    transfer: Optional[WeightTransfer | CollectiveTransfer]
    prompts: Optional[PromptSource] = None
    reward: Optional[RewardFn] = None
    # A prompt's modelled reward spread: the replay priority of a group whose samples carry no reward.
    spread: Optional[Callable[[int], float]] = None
    # What the Rollouter runs each group through: None, one completion per sample.
    agent: Optional[AgentLoop] = None


@dataclass
class System:
    """The components of one mode, connected in one process."""

    plan: RunPlan
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
    fault_plan: FaultPlan = field(default_factory=lambda: FaultPlan((), set()))
    run_dir: Optional[Path] = None  # checkpoints and the queue's journal

    @property
    def scenario(self) -> Scenario:
        return self.plan.scenario

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def placement(self) -> Placement:
        return self.plan.placement

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
            sync=SyncCounters(ps.pause_s, ps.drain_s, ps.transfer_s, ps.bytes),
            queue_counters=self.queue.counters(),
            replay_counters=self.replay.counters() if self.replay else None,
            in_flight=in_flight(self),
            faults=self.faults,
            end_s=end_s,
            wall_s=wall_s,
            evaluations=list(evaluations or []),
            agent=self.rollouter.agent.state() if self.rollouter.agent is not None else None,
        )


def make_ledger(plan: RunPlan) -> Ledger:
    """The run's ledger (or one side's, on ray), checking the plan's bound on every trained sample."""
    return Ledger(plan.trained_bound, reuse=plan.scenario.replay.enabled)


def durable(sc: Scenario) -> bool:
    """Whether the queue keeps a journal and delivered groups until acknowledged: with
    checkpoints, or when a fault kills the queue or the trainer."""
    return bool(sc.checkpoint.every) or any(f.kind == "kill" and f.target != "rollout_worker" for f in sc.faults)


def make_queue(plan: RunPlan, run_dir: Optional[Path]) -> AsyncStalenessQueue:
    sc = plan.scenario
    keep = durable(sc)
    journal = QueueJournal(Path(run_dir) / plan.mode / "queue.journal") if keep and run_dir is not None else None
    return AsyncStalenessQueue(capacity=plan.queue_capacity, max_staleness=plan.max_staleness, journal=journal, durable=keep)


def connect_rollout(
    plan: RunPlan, workers: Workers, ledger: Ledger, queue: AsyncStalenessQueue, faults: Optional[FaultLog] = None,
    catch_up: Optional[Callable[[int], Awaitable[object]]] = None,
) -> Rollouter:
    """The producer side: the Rollouter admitting groups to the engines (each behind its
    timeouts) and feeding the queue. ``catch_up``: the Rollouter's (a copy of the weights for an
    engine back from a restart, where weights move collectively)."""
    sc, place = plan.scenario, plan.placement
    t, r = sc.timeouts, sc.recovery
    engines = [SupervisedEngine(e, t.generate_s, t.control_s, t.restart_s, r.max_restarts) for e in workers.engines]
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
        lead=plan.lead,
        max_staleness=plan.max_staleness,
        plan_samples=(sc.trainer.steps * sc.fresh_groups_per_step + sc.warm_up_groups) * n,
        head_start=sc.warm_up_groups * n,
        prompts=workers.prompts,
        reward=workers.reward,
        faults=faults,
        stop_timeout_s=t.control_s,
        catch_up=catch_up,
        agent=workers.agent,
        group_filter=GroupFilter(sc.filter, sc.trainer.batch_size) if sc.filter is not None else None,
        pass_floor=plan.pass_floor,
        surplus=plan.surplus,
        resume_surplus=plan.pause in ("abort", "keep"),
    )


def connect_trainer(
    plan: RunPlan,
    workers: Workers,
    ledger: Ledger,
    queue: BatchSource,
    rollouter: RolloutControl,
    timeline: Timeline,
    on_step: Optional[ProgressFn] = None,
    on_synced: Optional[Callable[[WeightsSynced], None]] = None,
    checkpoint: Optional[CheckpointFn] = None,
) -> tuple[Trainer, ParamSync, Optional[ReplayStage]]:
    """The consumer side: (replay ring,) Trainer, and the ParamSync it triggers.

    ``queue`` and ``rollouter`` are the objects themselves in one process, or proxies with
    the same awaitable methods when the two sides live in different Ray actors. ``on_step`` is
    told each step trained, ``on_synced`` each sync; ``checkpoint`` is called at each sync that
    ``checkpoint.every`` makes due, rollout paused.
    """
    sc = plan.scenario
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
        mode=plan.pause,
        timeline=timeline,
        on_synced=on_synced,
        checkpoint=checkpoint,
        checkpoint_due=sc.checkpoint.due,
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
        pull_window=plan.placement.colocated,
        on_step=on_step,
    )
    return trainer, param_sync, replay


def connect_components(
    plan: RunPlan,
    workers: Workers,
    timeline: Timeline,
    on_step: Optional[ProgressFn] = None,
    on_synced: Optional[Callable[[WeightsSynced], None]] = None,
    run_dir: Optional[Path] = None,
    checkpoint: Optional[Callable[["System", int, float, float], None]] = None,
) -> System:
    """Build one mode's system in one process (sim or local runtime). Must be called inside
    the loop that will run it. ``run_dir`` holds the queue's journal; ``checkpoint(system,
    version, t0, t1)`` saves the run at each due sync."""
    sc = plan.scenario
    ledger = make_ledger(plan)
    faults = FaultLog()
    queue = make_queue(plan, run_dir)
    rollouter = connect_rollout(plan, workers, ledger, queue, faults)

    async def saved(version: int, t0: float, t1: float) -> None:
        checkpoint(system, version, t0, t1)  # ``system``: built below, before any sync

    trainer, param_sync, replay = connect_trainer(
        plan, workers, ledger, QueueBatches(queue), rollouter, timeline, on_step, on_synced,
        saved if checkpoint is not None else None,
    )
    system = System(
        plan, ledger, timeline, queue, workers.engines, rollouter, param_sync, trainer, workers.backend, replay,
        faults=faults, fault_plan=FaultPlan(sc.faults, set()), run_dir=run_dir,
    )
    return system


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
