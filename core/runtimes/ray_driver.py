"""The ray runtime's driver: every component a Ray actor, reached through a proxy with the same
awaitable methods it has in one process (the seeds' proxy-wrapper pattern).

    driver (run_ray) ── asyncio.wait ──► RolloutHost: Rollouter + staleness queue + ledger(produced, dropped)
                                         │ EngineProxy ──► EngineHost × engines (torch or vLLM)
                                         │ ServeReward ──► Serve deployment "reward" (reward.serve)
                                     TrainerHost: Trainer + ParamSync + torch GRPO + ledger(trained)
                                         │ QueueProxy / RolloutProxy ──► RolloutHost
                                         └ ray.put(weights) once per version ─► every EngineHost gets the ObjectRef

The actors are ``core.runtimes.ray_engine_host``'s, ``ray_rollout_host``'s (with the proxies the
trainer reaches it through) and ``ray_trainer_host``'s; ``ray_run_actors`` places, wires and
restarts them, ``ray_fault_targets`` is what the driver's faults do to them. This module holds
``run_ray`` and the driver's watch loop (``_Watch``).

The wiring inside each actor is ``core.pipeline.wiring``'s (``connect_rollout`` / ``connect_trainer``),
so the classes that run are the ones the sim and local runtimes run. Groups cross actors as
codec bytes (their pickle is ``core.model.group_wire``'s codec record), and only their
metadata crosses the rollout actor: an engine actor puts a group's tokens in the object store
(owned by the rollout actor), scores them unless Serve does (from the reference), and the
trainer resolves the reference. An interrupted group's partial tokens stay in its engine,
which takes them back when the group resumes there; another engine fetches them by reference. A placement group pins one
bundle per rollout engine and one for the trainer; ``sync`` colocates the trainer with the
engines on their bundles, as the sim's colocated baseline does.

Faults fire and the trainer is supervised through ``core.runtimes.supervision``, as in one
process. At a due sync both actors write their side of one whole checkpoint, which a resumed
run (``resume``) puts back into fresh actors (``core.runtimes.ray_checkpoint``). So does a run
whose rollout actor died: the queue and the producer's ledger went with it, so the whole run
goes back to that checkpoint (``recovery.max_restarts`` times at most), and run time goes on. Each process has its own monotonic clock: the driver measures every actor's offset
once (the midpoint of a round trip) and moves their timestamps onto its own, zero at the
start, in the ``RunResult`` it returns.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from core.api import RunStopped
from core.model.config import Placement, Scenario
from core.model.run_plan import RunPlan
from core.model.faults import CallTimeout, FaultLog, FaultPlan, RestartsExhausted
from core.model.ledger import Ledger
from core.model.result import RunResult
from core.model.timeline import Timeline
from core.pipeline.wiring import ProgressFn
from core.real.evaluation import Evaluations
from core.real.hf_model import ensure_model_dir
from core.runtimes.local import ProcessesFn
from core.runtimes.ray_actor import died, ray_module, timed
from core.runtimes.ray_checkpoint import RayResume, discard_after, load_ray_run
from core.runtimes.ray_fault_targets import DriverTargets, node_recoveries
from core.runtimes.ray_run_actors import Launch, RunActors, restart_trainer
from core.runtimes.ray_start import cluster
from core.runtimes.run_checkpoint import checkpoint_dir
from core.runtimes.supervision import FaultInjector, strike, supervise_trainer

log = logging.getLogger(__name__)


def run_ray(
    plan: RunPlan,
    on_step: Optional[ProgressFn] = None,
    on_processes: Optional[ProcessesFn] = None,
    run_dir=None,
    resume: bool = False,
    stop_at_step: Optional[int] = None,
) -> RunResult:
    """Run one mode with every component in its own Ray actor; the driver only watches, and
    injects the scenario's faults. ``run_dir`` keeps the checkpoints (it must be on storage
    every node sees); a temporary directory when None. ``resume``: start from the latest
    whole checkpoint there (core/runtimes/ray_checkpoint.py), or from the start if there is
    none; ``stop_at_step``: stop after that trainer step, as a crash would (``RunStopped``)."""
    sc, mode = plan.scenario, plan.mode
    with tempfile.TemporaryDirectory(prefix="asyncrl-ray-") as tmp:
        where = os.path.abspath(run_dir if run_dir is not None else tmp)
        point = None
        if resume:
            point = load_ray_run(where, sc, mode)
            discard_after(checkpoint_dir(where, mode), point.path if point is not None else None)
        carried = _Carried()
        while True:
            try:
                return _run_ray(plan, on_step, on_processes, where, point, stop_at_step, carried)
            except _RolloutLost as exc:
                # The queue, the Rollouter and the producer's ledger died with the actor: the
                # groups made since the last whole checkpoint are gone, so the trainer goes back too.
                carried.restarts += 1
                if carried.restarts > sc.recovery.max_restarts:
                    raise RestartsExhausted(
                        f"the rollout actor: died {carried.restarts} times, more than recovery.max_restarts = {sc.recovery.max_restarts}"
                    ) from None
                point = load_ray_run(where, sc, mode)
                discard_after(checkpoint_dir(where, mode), point.path if point is not None else None)
                log.warning("%s; the run goes back to %s", exc, point.path.name if point is not None else "its start")


class _RolloutLost(RuntimeError):
    """The rollout actor died mid-run (``run_ray`` brings the run back to its last whole checkpoint)."""


@dataclass
class _Carried:
    """What a run keeps across its rollout actor's deaths: when it started, its clock's zero,
    which faults fired and the driver's fault records (those since the checkpoint it goes back
    to are not in it)."""

    restarts: int = 0
    started: Optional[float] = None
    t0: Optional[float] = None
    fired: set = field(default_factory=set)
    records: list = field(default_factory=list)


def _run_ray(
    plan: RunPlan, on_step, on_processes, run_dir: str, point: Optional[RayResume] = None, stop_at_step: Optional[int] = None,
    carried: Optional[_Carried] = None,
) -> RunResult:
    ensure_model_dir(plan.scenario)  # the tiny model is built on first use
    plan = replace(plan, scenario=plan.scenario.with_absolute_paths())  # actors may run elsewhere than this working directory
    sc = plan.scenario
    with cluster(sc.ray.address, sc.ray.num_cpus, sc.reward.serve):  # started here unless already connected (the harness starts one per run)
        launch = Launch(plan)
        try:
            run = launch.start(run_dir, stop_at_step, on_processes)
            return asyncio.run(_watch(sc, plan.mode, plan.placement, run, on_step, point, carried or _Carried()))
        finally:
            launch.release()


async def _watch(
    sc: Scenario, mode: str, place: Placement, run: RunActors, on_step: Optional[ProgressFn], point: Optional[RayResume],
    carried: _Carried,
) -> RunResult:
    """The driver's loop: it blocks on nothing, and every poll_s reports progress, launches
    evaluations and fires the faults due. The trainer is supervised as in one process.
    ``point``: a whole checkpoint that both sides go back to first; run time goes on from it,
    or, for a run brought back after its rollout actor died (``carried``), from now."""
    watch = _Watch(sc, mode, place, run, on_step, point, carried)
    watch.begin()
    await watch.until_trained()
    return await watch.collect()


class _Watch:
    """One attempt's watch, in its phases: ``begin`` (run time zero on every clock, back to the
    checkpoint), ``until_trained`` (the loop), ``collect`` (both halves of the run, onto the
    driver's clock). What the loop's callbacks share (the fault plan and log, the clock's zero)
    is kept here."""

    def __init__(
        self, sc: Scenario, mode: str, place: Placement, run: RunActors, on_step: Optional[ProgressFn], point: Optional[RayResume],
        carried: _Carried,
    ) -> None:
        self.sc, self.mode, self.place, self.run, self.on_step, self.point, self.carried = sc, mode, place, run, on_step, point, carried
        self.ray, self.died = ray_module(), died()
        self.control_s = sc.timeouts.control_s
        self.rollout = run.rollout
        self.evals = Evaluations(sc)
        self.evals.warm_up()
        self.plan = FaultPlan(sc.faults, set())
        self.faults = FaultLog()  # the trainer's; the rollout actor keeps its workers'
        self.lost_nodes: dict[str, list[str]] = {}  # a node fault's record -> the records of what ran there
        self.step = 0

    def begin(self) -> None:
        """Run time zero on both sides' clocks; both back to ``point``; the faults that fired
        before it (or before the rollout actor died) kept fired, and recorded."""
        ray, run, point, carried, plan, faults = self.ray, self.run, self.point, self.carried, self.plan, self.faults
        if carried.t0 is None:
            carried.started = time.monotonic()
            carried.t0 = carried.started - (point.clock if point is not None else 0.0)
        self.started = carried.started
        t0 = self.t0 = run.t0 = carried.t0
        ray.get([self.rollout.set_zero.remote(t0 + run.off_rollout), run.trainer.set_zero.remote(t0 + run.off_trainer)], timeout=self.control_s)
        if point is not None:
            ray.get(self.rollout.restore_run.remote(str(point.path)), timeout=self.sc.timeouts.restart_s)
            ray.get(run.trainer.restore_run.remote(str(point.path)), timeout=self.sc.timeouts.restart_s)
            plan.fired.update(point.fired)
            faults.records[:] = FaultLog.from_state(point.driver_faults).records
        # Back after the rollout actor died: what fired since the checkpoint stays fired, and recorded.
        plan.fired.update(carried.fired)
        have = {(r.kind, r.target, r.at_s) for r in faults.records}
        faults.records.extend(r for r in FaultLog.from_state(carried.records).records if (r.kind, r.target, r.at_s) not in have)
        self._share()

    def _share(self) -> None:
        """The driver's faults go into the rollout side of the next checkpoint, and survive its actor."""
        self.carried.fired, self.carried.records = set(self.plan.fired), self.faults.state()
        self.rollout.driver_faults.remote(sorted(self.plan.fired), self.faults.state())

    def _fire(self, i: int, f) -> None:
        t0 = self.t0
        if f.target in ("trainer", "queue", "node"):
            strike(f, DriverTargets(self.run, self.sc, self.faults, self.lost_nodes, time.monotonic() - t0), self.faults, time.monotonic() - t0)
        else:
            self.ray.get(self.rollout.inject.remote(i), timeout=self.control_s)
        self._share()

    async def _rollout_lost(self) -> bool:
        try:
            await timed(self.rollout.pid.remote(), self.control_s, "rollouter", "pid")
            return False
        except self.died:
            return True
        except CallTimeout:
            return False

    async def _train(self, resync: bool) -> None:
        # A resumed run finishes the sync its checkpoint was taken in; a restarted trainer resyncs.
        point = self.point
        try:
            await self.run.trainer.run.remote(resync, None if resync or point is None else point.sync)
        except self.died as exc:
            # The trainer's call into a dead rollout actor: its error, not its death.
            if isinstance(exc, self.ray.exceptions.RayTaskError) and await self._rollout_lost():
                raise _RolloutLost("the rollout actor died") from None
            raise

    async def _restart(self) -> None:
        run = self.run
        run.restarting = True  # a trainer being wired answers no progress, and no fault strikes it
        try:
            run.trainer_pid, run.off_trainer = await asyncio.to_thread(restart_trainer, run, self.sc)
        finally:
            run.restarting = False

    def _tell(self, told: list) -> None:
        if self.on_step is not None:
            for event in told:
                self.on_step(replace(event, at_s=event.at_s - self.run.off_trainer - self.t0))

    async def until_trained(self) -> None:
        """Rollout and the supervised trainer run until the trainer finishes; a failure of
        either ends both (the rollout actor's death is ``_RolloutLost``)."""
        self.injector = FaultInjector(self.plan, self._fire)
        rolling = self.rolling = asyncio.ensure_future(_await(self.rollout.run.remote()))
        training = self.training = asyncio.ensure_future(supervise_trainer(self._train, self._restart, self.sc.recovery.max_restarts, self.died))
        try:
            await self._poll_until_trained()
        except BaseException as exc:
            lost = isinstance(exc, self.died) and await self._rollout_lost()  # a call into it from here
            if isinstance(exc, (RunStopped, asyncio.CancelledError)):  # stopped, or Ctrl-C (asyncio.run cancels this)
                await self._halt_rollout()
            for task in (rolling, training):
                task.cancel()
            await asyncio.gather(rolling, training, return_exceptions=True)
            if lost:
                raise _RolloutLost("the rollout actor died") from None
            if isinstance(exc, RunStopped):  # raised in the trainer actor: its own message, not Ray's traceback
                raise RunStopped(str(getattr(exc, "cause", exc))) from None
            raise

    async def _halt_rollout(self) -> None:
        """A stopped or interrupted run's rollout stops as a run's end does (tool calls under way
        are waited for and journaled: the resumed run does not make them again); the rest is left
        as a crash leaves it."""
        try:
            await asyncio.wait_for(_await(self.rollout.halt.remote()), self.sc.timeouts.control_s)
        except Exception as exc:  # a rollout that cannot stop is torn down as it is
            log.warning("the stopped run's rollout did not stop cleanly: %s", exc)

    async def _poll_until_trained(self) -> None:
        rolling, training = self.rolling, self.training
        while True:
            done, _ = await asyncio.wait({rolling, training}, timeout=self.sc.ray.poll_s, return_when=asyncio.FIRST_COMPLETED)
            if training in done:
                training.result()
                break
            if rolling in done:
                if await self._rollout_lost():
                    raise _RolloutLost("the rollout actor died")
                rolling.result()
                raise RuntimeError("the rollouter stopped before the trainer finished")
            if self.run.restarting:
                continue
            await self._poll()
            self.injector.poll(self.step, time.monotonic() - self.t0)

    async def _poll(self) -> None:
        """The trainer's progress since the last poll: told, the recoveries it shows recorded,
        the evaluations due launched. A trainer being restarted is skipped."""
        run, faults, t0 = self.run, self.faults, self.t0
        try:
            self.step, version, resynced, told = await timed(run.trainer.progress.remote(), self.control_s, "trainer", "progress")
            if resynced is not None and any(r.target == "trainer" and r.recovered_s is None for r in faults.records):
                faults.recovered("trainer", resynced - run.off_trainer - t0)
                self._share()
            self._tell(told)
            if told and any(r.target == "queue" and r.recovered_s is None for r in faults.records):
                faults.recovered("queue", told[0].at_s - run.off_trainer - t0, ("kill",))  # training again
                self._share()
            self.evals.poll(run.trainer, version, time.monotonic() - t0)
        except self.died:
            pass  # the trainer is being restarted

    async def collect(self) -> RunResult:
        """The trainer finished: the steps since the last poll told, both sides stopped and their
        halves of the run taken."""
        ray, run, control_s = self.ray, self.run, self.control_s
        self._tell(ray.get(run.trainer.progress.remote(), timeout=control_s)[3])  # the steps since the last poll
        trained = ray.get(run.trainer.finish.remote(), timeout=control_s)
        run.note_nodes(control_s)
        rolled = ray.get(self.rollout.stop.remote(), timeout=self.sc.timeouts.generate_s)
        self.evals.finish(time.monotonic() - self.t0)
        await timed(self.rolling, control_s, "rollouter", "run")  # a rollouter that failed after the trainer finished fails the run
        wall_s = time.monotonic() - self.started
        return self._result(rolled, trained, wall_s)

    def _result(self, rolled: dict, trained: dict, wall_s: float) -> RunResult:
        """The two halves of the run as one ``RunResult``, everything on the driver's clock, zero at the start."""
        run, faults, t0 = self.run, self.faults, self.t0
        dt_r, dt_t = -run.off_rollout - t0, -run.off_trainer - t0
        ledger: Ledger = rolled["ledger"]
        ledger.shift_times(dt_r)
        trained["ledger"].shift_times(dt_t)
        ledger.merge(trained["ledger"])
        timeline = Timeline()
        for part, dt in ((rolled["timeline"], dt_r), (trained["timeline"], dt_t)):
            for w, rows in part.spans.items():
                timeline.spans[w].extend([[k, a + dt, b + dt] for k, a, b in rows])
        tc = trained["trainer"]
        for info in tc.step_info:
            info["end_s"] += dt_t
        for rec in FaultLog.from_state(rolled["faults"]).records:
            rec.at_s += dt_r
            rec.recovered_s = None if rec.recovered_s is None else rec.recovered_s + dt_r
            faults.records.append(rec)
        faults.records.sort(key=lambda r: r.at_s)
        node_recoveries(faults, self.lost_nodes)
        agent = rolled["agent"]
        if agent is not None:  # onto this clock, as the rollout actor's spans
            agent["tool_spans"] = {w: [[a + dt_r, b + dt_r] for a, b in rows] for w, rows in agent["tool_spans"].items()}
        return RunResult(
            scenario=self.sc,
            mode=self.mode,
            placement=self.place,
            ledger=ledger,
            timeline=timeline,
            engines=rolled["engines"],
            trainer=tc,
            sync=trained["sync"],
            queue_counters=rolled["queue_counters"],
            replay_counters=trained["replay_counters"],
            in_flight=rolled["in_flight"] + trained["in_flight"],
            faults=faults,
            end_s=trained["end_s"] + dt_t,
            wall_s=wall_s,
            evaluations=self.evals.results,
            clock_offsets_s={"rollouter": run.off_rollout, "trainer": run.off_trainer, **run.off_engines},
            nodes=run.nodes,
            agent=agent,
        )


async def _await(ref: Any) -> Any:
    return await ref
