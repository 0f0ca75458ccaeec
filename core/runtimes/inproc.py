"""Running one connected system in this process (the sim and local runtimes):
``connect_inproc`` builds it with this runtime's hooks (faults after steps, a planned stop,
checkpoints at syncs), ``drive`` starts the Rollouter and the supervised Trainer, fires the
scenario's faults, and ends the run so that every sample is accounted for."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from core.api import RunStopped
from core.model.faults import WorkerLost, worker_key
from core.model.progress import ProgressFn, StepTrained
from core.model.run_plan import RunPlan
from core.model.timeline import Timeline
from core.pipeline.wiring import System, Workers, connect_components, end_rollout, release_unused
from core.runtimes.run_checkpoint import restore_trainer, save_run
from core.runtimes.supervision import FaultInjector, TrainerDied, strike, supervise_trainer

SyncPoint = tuple[int, float, float]  # (version, t0, t1) of a sync a checkpoint was taken in


class InProcTargets:
    """What faults do to the components of one process."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.trainer_task: Optional[asyncio.Task] = None
        self.trainer_killed = False

    def kill_trainer(self) -> None:
        self.trainer_killed = True
        self.trainer_task.cancel()

    def kill_queue(self) -> None:
        system, loop = self.system, asyncio.get_running_loop()
        system.queue.crash()

        def back() -> None:
            evicted = system.queue.recover()
            system.rollouter.dropped_from_queue(evicted, "stale")
            system.faults.recovered("queue", loop.time())

        loop.call_later(system.scenario.recovery.queue_restart_s, back)

    def kill_worker(self, worker: int) -> None:
        engine = self.system.engines[worker]
        engine.crash(self.system.scenario.recovery.engine_restart_s)
        # Its supervisor sees the process die at once (an idle worker too), and restarts it.
        self.system.rollouter.worker_lost(worker, WorkerLost(engine.name, "process", "killed"))

    def kill_node(self, of: str, worker: int) -> None:
        raise ValueError("a node is a host of a Ray cluster: node faults need the ray runtime")

    def slow_worker(self, worker: int, factor: float, duration_s: float) -> None:
        self.system.engines[worker].set_slowdown(factor)
        self.end_slowdown(worker, asyncio.get_running_loop().time() + duration_s)

    def hang_worker(self, worker: int, call: str) -> None:
        self.system.engines[worker].hang_next = call

    def end_slowdown(self, worker: int, at: float) -> None:
        loop = asyncio.get_running_loop()

        def end() -> None:
            self.system.engines[worker].set_slowdown(1.0)
            self.system.faults.recovered(worker_key(worker), loop.time(), ("slow",))

        loop.call_at(at, end)

    def resume_slowdowns(self) -> None:
        """A resumed run ends the slowdowns under way at its checkpoint when they were due to
        end (their timers are not in the checkpoint; the engines' slowdown is)."""
        system = self.system
        now = asyncio.get_running_loop().time()
        fired = [system.fault_plan.faults[i] for i in sorted(system.fault_plan.fired)]
        ends = set()
        for rec in system.faults.records:
            if rec.kind == "slow" and rec.recovered_s is None:
                for f in fired:
                    if f.kind == "slow" and worker_key(f.worker) == rec.target and rec.at_s + f.duration_s >= now:
                        ends.add((rec.at_s + f.duration_s, f))
        for at, f in sorted(ends, key=lambda e: e[0]):
            self.end_slowdown(f.worker, at)


@dataclass
class InProcRun:
    """One connected system with what this runtime drives it by."""

    system: System
    targets: InProcTargets
    injector: FaultInjector


def connect_inproc(
    plan: RunPlan, workers: Workers, timeline: Timeline, on_step: Optional[ProgressFn] = None,
    run_dir: Optional[Path] = None, stop_at_step: Optional[int] = None,
) -> InProcRun:
    """The system of one mode in this process, its hooks given as it is built: after each
    step the faults due fire and a planned stop stops the run (``stop_at_step``); at each due
    sync the whole run is checkpointed into ``run_dir``."""
    checkpoints = run_dir is not None and bool(plan.scenario.checkpoint.every)

    def stepped(event: StepTrained) -> None:
        if on_step is not None:
            on_step(event)
        injector.on_step(event.step)  # ``injector``: made below, before any step
        if stop_at_step is not None and event.step >= stop_at_step:
            raise RunStopped(f"stopped after step {event.step}")

    system = connect_components(
        plan, workers, timeline, on_step=stepped, on_synced=on_step, run_dir=run_dir,
        checkpoint=save_run if checkpoints else None,
    )
    targets = InProcTargets(system)
    injector = FaultInjector(system.fault_plan, lambda i, f: strike(f, targets, system.faults, asyncio.get_running_loop().time()))
    return InProcRun(system, targets, injector)


async def drive(run: InProcRun, resume: Optional[SyncPoint] = None) -> float:
    """Run until the trainer has done its steps; blocks on nothing but the component tasks.
    ``resume``: the sync a restored checkpoint was taken in, finished first. Returns when
    the run ended, on the loop's clock."""
    loop = asyncio.get_running_loop()
    system, targets, injector = run.system, run.targets, run.injector
    if system.param_sync.checkpoint is not None and resume is None and system.trainer.step == 0:
        save_run(system, 0, 0.0, 0.0, at_start=True)
    injector.arm()
    targets.resume_slowdowns()
    rollout = asyncio.create_task(system.rollouter.run(), name="rollouter")
    train = asyncio.create_task(_supervised_trainer(system, targets, resume), name="trainer-supervisor")
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
    end_s = loop.time()
    system.queue.ack()  # the run is over: what was trained stays trained
    await end_rollout(system.rollouter, system.queue, system.ledger)
    await rollout  # a rollouter that failed after the trainer finished still fails the run
    release_unused(system.trainer, system.replay, system.ledger)
    for e in system.engines:
        await e.close(end_s)
    if system.queue.journal is not None:
        system.queue.journal.close()
    return end_s


async def _supervised_trainer(system: System, targets: InProcTargets, resume: Optional[SyncPoint]) -> None:
    """The trainer as a task that a fault can kill; a killed one restarts from its checkpoint."""
    sc, trainer, ps = system.scenario, system.trainer, system.param_sync
    loop = asyncio.get_running_loop()

    async def resync() -> None:
        await ps.sync(trainer.version, checkpoint=False)
        system.faults.recovered("trainer", loop.time())

    async def run(resynced: bool) -> None:
        if resynced:
            before = resync
        else:
            before = (lambda: ps.finish(*resume)) if resume is not None else None
        targets.trainer_task = asyncio.create_task(trainer.run(before), name="trainer")
        try:
            await targets.trainer_task
        except asyncio.CancelledError:
            if not targets.trainer_killed:
                raise
            targets.trainer_killed = False
            raise TrainerDied("killed") from None

    async def restart() -> None:
        # A new trainer process starts, loads the checkpoint, and syncs the engines to its
        # version before it trains again.
        await asyncio.sleep(sc.recovery.trainer_restart_s)
        restore_trainer(system)

    await supervise_trainer(run, restart, sc.recovery.max_restarts)
