"""All wiring in one place: ``connect_components`` builds one mode's system; ``run_mode`` runs it.

One sample's life, file by file: ``rollouter.py`` admits its group and hands it to an
engine (``engine_sim.py``); the finished group goes through ``staleness_queue.py`` (and,
when the scenario enables it, the replay ring of ``replay_stage.py``) to ``trainer.py``;
every ``sync_every`` steps ``param_sync.py`` pauses rollout, moves the weights and bumps
the version; ``ledger.py`` accounts for it at each transition.

Modes:
- ``sync``: colocated baseline. Every GPU generates one sync window, then every GPU trains
  it, then the weights are resharded in place. Staleness is 0 by construction.
- ``async``: rollout and trainer GPUs apart, overlapping; a sync drains in-flight work.
- ``partial``: as async, but a sync aborts in-flight work and resumes it after.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from core import virtual_clock
from core.config import Scenario
from core.costs import DecodeCost, TrainCost, TransferCost
from core.engine_sim import SimEngine
from core.faults import FaultInjector, FaultLog, FaultPlan, RestartsExhausted, SupervisedEngine, WorkerLost, worker_key
from core.ledger import Ledger
from core.param_sync import ParamSync, SimWeightTransfer, WeightTransfer
from core.placement import Placement, effective_staleness
from core.queue_journal import QueueJournal
from core.replay_stage import ReplayStage, staleness_bound
from core.rollouter import Engine, PromptSource, RewardFn, Rollouter
from core.sample import Group
from core.staleness_queue import AsyncStalenessQueue
from core.timeline import Timeline
from core.trainer import BatchSource, SimTrainBackend, TrainBackend, Trainer
from core.workload import Workload

ProgressFn = Callable[[int, float, int], None]


@dataclass
class System:
    """The components of one mode, connected."""

    scenario: Scenario
    mode: str
    placement: Placement
    ledger: Ledger
    timeline: Timeline
    queue: AsyncStalenessQueue
    engines: list
    rollouter: Rollouter
    param_sync: ParamSync
    trainer: Trainer
    train_backend: TrainBackend
    replay: Optional[ReplayStage] = None
    end_s: float = 0.0
    wall_s: float = 0.0
    evaluations: list = field(default_factory=list)  # held-out scores per version (real runtimes)
    faults: FaultLog = field(default_factory=FaultLog)
    plan: FaultPlan = field(default_factory=lambda: FaultPlan((), set()))
    run_dir: Optional[Path] = None  # checkpoints and the queue's journal
    trainer_task: Optional[asyncio.Task] = None
    trainer_killed: bool = False


@dataclass
class Workers:
    """What does the work, which is all that differs between runtimes: engines (simulated,
    in process, or proxies to Ray actors), the train backend, how weights move, and, for
    real engines, where prompts and rewards come from."""

    engines: list[Engine]
    backend: TrainBackend
    transfer: WeightTransfer
    prompts: Optional[PromptSource] = None
    reward: Optional[RewardFn] = None


def sim_workers(sc: Scenario, mode: str, timeline: Timeline) -> Workers:
    """The sim runtime's workers: engines and trainer on modelled costs."""
    place = Placement.of(sc, mode)
    workload = Workload(sc.workload, sc.seed)
    decode = DecodeCost(sc, place.gpus_per_engine)
    engines = [
        SimEngine(f"engine{i:03d}", decode, workload, sc.rollout.max_num_seqs, timeline)
        for i in range(place.engines)
    ]
    for e in engines:
        e.restart_s = sc.recovery.engine_restart_s
    backend = SimTrainBackend(TrainCost(sc, place.trainer_gpus, mode in sc.trainer.recompute_logprobs))
    return Workers(engines, backend, SimWeightTransfer(TransferCost(sc, colocated=place.colocated)))


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
    rollouter: Rollouter,
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
        workload = Workload(sc.workload, sc.seed)

        def priority(g: Group) -> float:
            # Real rewards when the engines made some; else the workload's modelled spread.
            rewards = [s.reward for s in g.samples if s.reward is not None]
            return float(np.std(rewards)) if rewards else workload.reward_spread(g.prompt_id)

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
        mode="abort" if mode == "partial" else "wait",
        timeline=timeline,
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
    on_step: Optional[ProgressFn] = None,
    workers: Optional[Workers] = None,
    timeline: Optional[Timeline] = None,
    run_dir: Optional[Path] = None,
) -> System:
    """Build one mode's system in one process (sim or local runtime). Must be called inside
    the loop that will run it. ``workers`` defaults to the sim runtime's; ``run_dir`` holds
    checkpoints and the queue's journal."""
    timeline = timeline or Timeline()
    workers = workers or sim_workers(sc, mode, timeline)
    ledger = Ledger(trained_bound(sc, mode), reuse=sc.replay.enabled)
    faults = FaultLog()
    queue = make_queue(sc, mode, run_dir)
    rollouter = connect_rollout(sc, mode, workers, ledger, queue, faults)
    trainer, param_sync, replay = connect_trainer(sc, mode, workers, ledger, queue, rollouter, timeline, on_step)
    system = System(
        sc, mode, Placement.of(sc, mode), ledger, timeline, queue, workers.engines,
        rollouter, param_sync, trainer, workers.backend, replay,
        faults=faults, plan=FaultPlan(sc.faults, set()), run_dir=run_dir,
    )
    if run_dir is not None and sc.checkpoint.every:
        from core.run_checkpoint import save_run

        async def checkpoint(version: int, t0: float, t1: float) -> None:
            save_run(system, version, t0, t1)

        param_sync.checkpoint = checkpoint
    return system


async def end_rollout(rollouter: Rollouter, queue: AsyncStalenessQueue, ledger: Ledger) -> None:
    """End of run, producer side: whatever is still generating or queued is beyond the plan."""
    left = await rollouter.stop()
    ledger.dropped_groups(left + queue.drain(), "run_end")


def release_unused(trainer: Trainer, replay: Optional[ReplayStage], ledger: Ledger) -> None:
    """End of run, consumer side: what the trainer pulled and never trained. With replay, what
    it holds was drawn from the ring, which still counts it: the ring's never-trained groups."""
    unused = replay.drain() if replay else trainer.holding
    ledger.dropped_groups(unused, "run_end")
    trainer.holding = []


class RunStopped(Exception):
    """The run was stopped on purpose after a step (``stop_at_step``), as a crash would stop
    it; its checkpoints are left for ``--resume``."""


async def drive(system: System, resume: Optional[tuple[int, float, float]] = None, stop_at_step: Optional[int] = None) -> System:
    """Run until the trainer has done its steps; blocks on nothing but the component tasks.
    ``resume``: the sync a restored checkpoint was taken in, finished first."""
    loop = asyncio.get_running_loop()
    injector = FaultInjector(system.plan, system.faults, lambda f, rec: strike(system, f, rec))
    _watch_steps(system, injector, stop_at_step)
    if resume is None and system.trainer.step == 0 and system.param_sync.checkpoint is not None:
        from core.run_checkpoint import save_run

        save_run(system, 0, 0.0, 0.0, at_start=True)
    injector.arm()
    _resume_slowdowns(system)
    rollout = asyncio.create_task(system.rollouter.run(), name="rollouter")
    train = asyncio.create_task(_supervise_trainer(system, resume), name="trainer-supervisor")
    try:
        done, _ = await asyncio.wait({rollout, train}, return_when=asyncio.FIRST_COMPLETED)
        if rollout in done and train not in done:
            train.cancel()
            await asyncio.gather(train, return_exceptions=True)
            rollout.result()
            raise RuntimeError("the rollouter stopped before the trainer finished")
        train.result()
    except BaseException:
        # A failed or stopped run: generation is interrupted, engines closed, nothing left pending.
        train.cancel()
        await asyncio.gather(train, return_exceptions=True)
        with contextlib.suppress(Exception):
            await system.rollouter.stop()
            for e in system.engines:
                await e.close(loop.time())
        rollout.cancel()
        await asyncio.gather(rollout, return_exceptions=True)
        raise
    finally:
        injector.disarm()
    system.end_s = loop.time()
    system.queue.ack()  # the run is over: what was trained stays trained
    await end_rollout(system.rollouter, system.queue, system.ledger)
    await rollout  # a rollouter that failed after the trainer finished still fails the run
    release_unused(system.trainer, system.replay, system.ledger)
    for e in system.engines:
        await e.close(system.end_s)
    if system.queue.journal is not None:
        system.queue.journal.close()
    return system


def _watch_steps(system: System, injector: FaultInjector, stop_at_step: Optional[int]) -> None:
    """Faults due after a step fire from the trainer's step callback; so does a planned stop."""
    user = system.trainer.on_step

    def on_step(step: int, now: float, trainings: int) -> None:
        if user is not None:
            user(step, now, trainings)
        injector.on_step(step)
        if stop_at_step is not None and step >= stop_at_step:
            raise RunStopped(f"stopped after step {step}")

    system.trainer.on_step = on_step


async def _supervise_trainer(system: System, resume: Optional[tuple[int, float, float]]) -> None:
    """Run the trainer; if a fault kills it, restart it from its last checkpoint."""
    from core.run_checkpoint import restore_trainer

    sc, trainer, ps = system.scenario, system.trainer, system.param_sync
    before = (lambda: ps.finish(*resume)) if resume is not None else None
    restarts = 0
    while True:
        system.trainer_task = asyncio.create_task(trainer.run(before), name="trainer")
        try:
            await system.trainer_task
            return
        except asyncio.CancelledError:
            if not system.trainer_killed:
                raise
        # The trainer's process died: a new one starts, loads the checkpoint, and syncs the
        # engines to its version before it trains again.
        system.trainer_killed = False
        restarts += 1
        if restarts > sc.recovery.max_restarts:
            raise RestartsExhausted(f"trainer: killed {restarts} times, more than recovery.max_restarts = {sc.recovery.max_restarts}")
        await asyncio.sleep(sc.recovery.trainer_restart_s)
        restore_trainer(system)

        async def resync() -> None:
            await ps.sync(trainer.version, checkpoint=False)
            system.faults.recovered("trainer", asyncio.get_running_loop().time())

        before = resync


def strike(system: System, fault, record) -> None:
    """What each fault does on the sim runtime."""
    sc, loop = system.scenario, asyncio.get_running_loop()
    if fault.target == "trainer":
        system.trainer_killed = True
        system.trainer_task.cancel()
    elif fault.target == "queue":
        system.queue.crash()

        def back() -> None:
            evicted = system.queue.recover()
            system.rollouter.dropped_from_queue(evicted, "stale")
            system.faults.recovered("queue", loop.time())

        loop.call_later(sc.recovery.queue_restart_s, back)
    else:
        engine = system.engines[fault.worker]
        if fault.kind == "kill":
            engine.crash(sc.recovery.engine_restart_s)
            # Its supervisor sees the process die at once (an idle worker too), and restarts it.
            system.rollouter.worker_lost(fault.worker, WorkerLost(engine.name, "process", "killed"))
        elif fault.kind == "slow":
            engine.set_slowdown(fault.factor)
            _end_slowdown(system, fault, loop.time() + fault.duration_s)
        else:
            engine.hang_next = fault.call


def _end_slowdown(system: System, fault, at: float) -> None:
    loop = asyncio.get_running_loop()

    def end() -> None:
        system.engines[fault.worker].set_slowdown(1.0)
        system.faults.recovered(worker_key(fault.worker), loop.time(), ("slow",))

    loop.call_at(at, end)


def _resume_slowdowns(system: System) -> None:
    """A resumed run ends the slowdowns under way at its checkpoint when they were due to end
    (their timers are not in the checkpoint; the engines' slowdown is)."""
    now = asyncio.get_running_loop().time()
    fired = [system.plan.faults[i] for i in sorted(system.plan.fired)]
    ends = set()
    for rec in system.faults.records:
        if rec.kind == "slow" and rec.recovered_s is None:
            for f in fired:
                if f.kind == "slow" and worker_key(f.worker) == rec.target and rec.at_s + f.duration_s >= now:
                    ends.add((rec.at_s + f.duration_s, f))
    for at, f in sorted(ends, key=lambda e: e[0]):
        _end_slowdown(system, f, at)


def in_flight(system: System) -> int:
    """Samples observed in the components right now (not derived from the ledger)."""
    unused = system.replay.untrained() if system.replay else system.trainer.holding
    return (
        system.rollouter.in_flight()
        + sum(g.size for g in unused)
        + len(system.queue) * system.scenario.workload.group_size
    )


def run_mode(
    sc: Scenario,
    mode: str,
    on_step: Optional[ProgressFn] = None,
    on_processes=None,
    run_dir: Optional[Path] = None,
    resume: bool = False,
    stop_at_step: Optional[int] = None,
) -> System:
    """Run one mode on the scenario's runtime. ``on_processes([(name, pid)])`` is told the
    processes that do the work once they exist (for a profiler). ``run_dir`` keeps the
    checkpoints (a temporary directory when None); ``resume`` starts from the latest one."""
    if sc.runtime == "local":
        from core.workers import run_local

        return run_local(sc, mode, on_step, on_processes, run_dir=run_dir, resume=resume, stop_at_step=stop_at_step)
    if sc.runtime == "ray":
        from core.ray_runtime import run_ray

        return run_ray(sc, mode, on_step, on_processes, run_dir=run_dir)

    with tempfile.TemporaryDirectory(prefix="asyncrl-run-") as tmp:
        where = Path(run_dir) if run_dir is not None else Path(tmp)

        async def main() -> System:
            system = connect_components(sc, mode, on_step, run_dir=where)
            return await drive(system, resume_point(system) if resume else None, stop_at_step)

        t0 = time.perf_counter()
        system = virtual_clock.run(main())
        system.wall_s = time.perf_counter() - t0
        return system


def resume_point(system: System) -> Optional[tuple[int, float, float]]:
    """Restore ``system`` from its run directory's latest checkpoint; the sync to finish."""
    from core.run_checkpoint import load_run, restore

    found = load_run(system.run_dir, system.scenario, system.mode)
    if found is None:
        return None
    return restore(system, *found)
