"""Running one connected system in this process (the sim and local runtimes): ``drive``
starts the Rollouter and the supervised Trainer, fires the scenario's faults, checkpoints
at syncs, and ends the run so that every sample is accounted for."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Optional

from core.api import RunStopped
from core.model.faults import WorkerLost, worker_key
from core.model.progress import StepTrained
from core.pipeline.wiring import System, end_rollout, release_unused
from core.runtimes.run_checkpoint import due, restore_trainer, save_run
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
        fired = [system.plan.faults[i] for i in sorted(system.plan.fired)]
        ends = set()
        for rec in system.faults.records:
            if rec.kind == "slow" and rec.recovered_s is None:
                for f in fired:
                    if f.kind == "slow" and worker_key(f.worker) == rec.target and rec.at_s + f.duration_s >= now:
                        ends.add((rec.at_s + f.duration_s, f))
        for at, f in sorted(ends, key=lambda e: e[0]):
            self.end_slowdown(f.worker, at)


async def drive(system: System, resume: Optional[SyncPoint] = None, stop_at_step: Optional[int] = None) -> float:
    """Run until the trainer has done its steps; blocks on nothing but the component tasks.
    ``resume``: the sync a restored checkpoint was taken in, finished first. Returns when
    the run ended, on the loop's clock."""
    loop = asyncio.get_running_loop()
    targets = InProcTargets(system)
    injector = FaultInjector(system.plan, lambda i, f: strike(f, targets, system.faults, loop.time()))
    _watch_steps(system, injector, stop_at_step)
    checkpoints = system.run_dir is not None and bool(system.scenario.checkpoint.every)
    if checkpoints:
        async def checkpoint(version: int, t0: float, t1: float) -> None:
            save_run(system, version, t0, t1)

        system.param_sync.checkpoint = checkpoint
        system.param_sync.checkpoint_captures_rollout = lambda version: due(system.scenario, version)
        if resume is None and system.trainer.step == 0:
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


def _watch_steps(system: System, injector: FaultInjector, stop_at_step: Optional[int]) -> None:
    """Faults due after a step fire from the trainer's step callback; so does a planned stop."""
    user = system.trainer.on_step

    def on_step(event: StepTrained) -> None:
        if user is not None:
            user(event)
        injector.on_step(event.step)
        if stop_at_step is not None and event.step >= stop_at_step:
            raise RunStopped(f"stopped after step {event.step}")

    system.trainer.on_step = on_step


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
