"""The env pipeline in async mode on Ray (seeds 001 and 003): sampler actors, the store actor
and the learner actor, all at once.

    SamplerActor x env.samplers ── TransitionChunk (one codec record) ──► StoreActor
         ▲   (envs + policy forward on CPU)                               dqn: TransitionReplay + RateLimiter
         │                                                                ppo: SegmentQueue (version gate)
         │  ObjectRef of the weights: one ray.put per version,                │ dqn: batches_per_call minibatches
         └─ offered to every sampler, fetched at its next chunk ◄── LearnerActor ◄┘ ppo: chunks_per_batch chunks

    driver: polls the store's env steps, launches evaluations as remote tasks on the newest
            weights and collects them with ray.wait(..., timeout=...); stops the run at the
            target return or the env-step budget.

Each part is built by ``core/env/wiring.py``, as in sync mode. DQN's rate limiter holds samples
per insert whichever side is faster; PPO's bounded queue holds the samplers back when the
learner is slower. Either store reports how long each side waited.
Evaluations reserve no CPU. With ``env.hold_for_eval`` (the default) the driver holds the
samplers and the learner while one runs, and every time the run reports leaves the held seconds
out, as sync mode stops its clock; without it they run beside training and slow it where they
share its cores.

Actors that die come back (docs/env.md, Faults): a sampler at its next chunk, a journaled replay
or queue from its journal, a checkpointed learner from its latest checkpoint (PPO's queue then
hands it again the chunks that checkpoint does not cover). The driver counts their restarts
against ``ray.max_restarts`` (``supervision.RestartBudget``).

This file is the driver; the actors are in ``ray_env_hosts.py``, the files the run keeps in
``ray_env_state.py``.
"""


from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import ray

from core.api import RunStopped
from core.env.chunk_intake import run_ledger
from core.env.curve import EnvCurve
from core.env.held_time import HeldTime
from core.env.learner_checkpoint import LEARNER_KIND
from core.env.segment_queue import SegmentQueue
from core.env.transition_replay import TransitionReplay
from core.env.wiring import JOURNAL_KIND, replay_args
from core.model.env_config import EnvScenario
from core.model.faults import FaultLog
from core.model.progress import PolicyEvaluated, ProgressFn
from core.runtimes.ray_actor import StoreLost, served_now
from core.runtimes.ray_env_hosts import LearnerHost, SamplerHost, evaluate_weights
from core.runtimes.ray_env_state import RESUMED_INCARNATION, DriverState, RunFiles
from core.runtimes.supervision import RestartBudget

log = logging.getLogger(__name__)


class PlacementError(ValueError):
    """The cluster cannot hold the run's actors; raised before any starts."""


def check_fits(sc: EnvScenario, local_cpus: Optional[float] = None) -> None:
    """Refuse, before any actor starts, a run whose actors cannot all be placed: Ray would keep
    the extra ones pending and the run would never end. ``local_cpus``: the CPUs of the local
    instance the run is about to start, so that it is refused before ``ray.init`` (which logs
    a line of its own); None, or Ray already connected (the run then joins that instance): ask
    the cluster."""
    r = sc.ray
    need = sc.env.samplers * r.sampler.num_cpus + r.learner.num_cpus + r.replay.num_cpus
    if ray.is_initialized():
        local_cpus = None
    have = ray.cluster_resources().get("CPU", 0.0) if local_cpus is None else local_cpus
    if need > have:
        where = (f"the Ray cluster has {have:g}" if local_cpus is None
                 else f"the local Ray instance would have {have:g} (ray.num_cpus, else this machine's cores)")
        room = have - r.learner.num_cpus - r.replay.num_cpus
        most = int(room // r.sampler.num_cpus) if r.sampler.num_cpus > 0 else 0
        fix = (f"use at most {most} sampler{'s' if most > 1 else ''}, or a smaller ray.sampler.num_cpus" if most >= 1
               else "lower ray.learner.num_cpus and ray.replay.num_cpus, or give Ray more CPUs (ray.num_cpus)")
        raise PlacementError(
            f"env.samplers = {sc.env.samplers}: the samplers, learner and replay reserve {need:g} CPUs and {where}; fix: {fix}"
        )


_evaluate = ray.remote(num_cpus=0)(evaluate_weights)


def _actor_pid(_actor) -> int:
    """Run inside an actor (``__ray_call__``): its process."""
    return os.getpid()


def run_async(
    sc: EnvScenario, seed: int, *, stop_at_target: bool = True, eval_tasks: int = 2, poll_s: float = 0.2,
    workdir: Optional[Path] = None, stop_at_version: Optional[int] = None, on_progress: Optional[ProgressFn] = None,
    on_processes: Optional[Callable[[list[tuple[str, int]]], None]] = None,
) -> EnvCurve:
    """One async run on the Ray instance this process is connected to.

    ``workdir``: this run's own directory (one mode, one seed). With ``checkpoint.every`` the
    store's journal, the learner's checkpoints and the driver's state are kept there, and a run
    that finds a checkpoint there goes on from it (``--resume``). Otherwise a journaled store
    or a checkpointed learner uses a directory asyncrl creates and removes (under ``workdir``,
    or the system's temporary directory). ``stop_at_version``: stop once the learner has
    checkpointed that version, as a crash would (``RunStopped``). ``on_progress`` is told every
    version the learner published (at the driver's next poll, with the env steps it saw then) and
    every evaluation. ``on_processes([(name, pid)])`` is told the actors' processes once they
    exist (for a profiler)."""
    check_fits(sc)
    files = RunFiles(workdir, keep=workdir is not None and bool(sc.checkpoint.every))
    learner_dir = files.place("checkpoints", LEARNER_KIND) if sc.checkpoint.every else None
    resumed = files.resumed(learner_dir)
    journal_dir = files.place("store", JOURNAL_KIND) if sc.durable_store() else None
    store, learner, samplers = _start_actors(sc, seed, learner_dir, journal_dir, stop_at_version)
    actors = [store, learner, *samplers]
    if on_processes is not None:
        pids = ray.get([a.__ray_call__.remote(_actor_pid) for a in actors])
        names = ["replay" if sc.learner == "dqn" else "queue", "learner", *(f"sampler-{i}" for i in range(len(samplers)))]
        on_processes(list(zip(names, pids)))
    finished = False
    try:
        driver = AsyncDriver(sc, seed, (store, learner, samplers), resumed, files, learner_dir is not None, on_progress)
        curve = driver.run(stop_at_target, eval_tasks, poll_s)
        finished = True
        return curve
    finally:
        for a in actors:
            ray.kill(a)
        files.close(finished)


def _start_actors(sc: EnvScenario, seed: int, learner_dir: Optional[Path], journal_dir: Optional[Path],
                  stop_at_version: Optional[int]) -> tuple[Any, Any, list]:
    """(store, learner, samplers): the actors, placed; Ray restarts each that dies up to
    ``ray.max_restarts`` times, a store only if journaled and a learner only if checkpointed (one
    without would come back empty)."""
    e = sc.env
    store_options = {"num_cpus": sc.ray.replay.num_cpus, "max_concurrency": sc.ray.replay.max_concurrency}
    if journal_dir is not None:
        store_options["max_restarts"] = sc.ray.max_restarts
    if sc.learner == "ppo":
        store = ray.remote(SegmentQueue).options(**store_options).remote(
            sc.ppo.queue_chunks, sc.ppo.max_staleness, str(journal_dir) if journal_dir is not None else None)
    else:
        args, kwargs = replay_args(sc, seed, journal_dir)
        store = ray.remote(TransitionReplay).options(**store_options).remote(*args, **kwargs)
    samplers = [
        ray.remote(SamplerHost).options(
            num_cpus=sc.ray.sampler.num_cpus, max_concurrency=sc.ray.sampler.max_concurrency, max_restarts=sc.ray.max_restarts,
        ).remote(sc, seed, i) for i in range(e.samplers)
    ]
    learner = ray.remote(LearnerHost).options(
        num_cpus=sc.ray.learner.num_cpus, max_concurrency=sc.ray.learner.max_concurrency,
        max_restarts=sc.ray.max_restarts if learner_dir is not None else 0,
    ).remote(sc, seed, str(learner_dir) if learner_dir is not None else None, stop_at_version)
    return store, learner, samplers


class AsyncDriver:
    """The driver of one async run: it polls the actors, restarts those that died (counted
    against ``ray.max_restarts``), fires the scenario's faults, launches and collects the
    evaluations, holds the run while one runs, and saves its own state for a resume."""

    def __init__(self, sc: EnvScenario, seed: int, actors: tuple[Any, Any, list], resumed: Optional[DriverState],
                 files: RunFiles, learner_restarts: bool, on_progress: Optional[ProgressFn]) -> None:
        """``learner_restarts``: a learner that dies comes back (it keeps checkpoints)."""
        e = sc.env
        self.sc, self.seed, self.files, self.on_progress = sc, seed, files, on_progress
        self.store, self.learner, self.samplers = actors
        self.learner_restarts = learner_restarts
        self.resumed = resumed is not None
        self.d = d = resumed or DriverState()
        self.curve = EnvCurve(env_steps=d.eval_env_steps, wall_s=d.eval_wall_s, eval_return=d.eval_return,
                              evaluations_lost=d.evaluations_lost)
        self.faults = FaultLog.from_state(d.fault_records)
        self.fired = set(d.fired)
        before = {f"sampler{i}": n for i, n in enumerate(d.restarts or [0] * e.samplers)}
        self.budget = RestartBudget(sc.ray.max_restarts, "ray.max_restarts", {**before, "learner": d.learner_restarts})
        self.patience = sc.ray.recovery_timeout_s
        self.ppo = sc.learner == "ppo"
        # One clock for the driver and the actors' spans (time.time(): comparable across this
        # machine's processes), started once every actor has the first version; seconds held for
        # evaluations are left out of every time reported.
        self.held = HeldTime()
        self.t0 = 0.0
        self.per_sampler = -(-e.env_steps // e.samplers)
        self.runs: list = []
        self.learning = None
        self.evals: dict[Any, tuple[int, float, int]] = {}  # task group -> (env steps, wall s when the weights were taken, version)
        self.pending: dict[int, list] = {}
        self.next_eval = d.next_eval or e.eval_every
        self.steps = 0
        self.store_down_since: Optional[float] = None
        self.store_instance: Optional[str] = None

    def elapsed(self) -> float:
        """The training clock."""
        return self.held.running(self.t0, time.time())

    def sampler_restarts(self) -> list[int]:
        return [self.budget.counts[f"sampler{i}"] for i in range(len(self.samplers))]

    def start(self) -> None:
        """Every part from where it stopped, on a resume: the store from its journal, the learner
        from its checkpoint (PPO's queue hands it again what that does not cover), each sampler at
        the chunk after the last the store took, its environments in new episodes. Then the first
        version reaches every sampler before it acts, and every actor runs."""
        store, learner, d = self.store, self.learner, self.d
        if self.resumed:
            if self.ppo:
                _rejoin_queue(learner, store, self.patience)
            for i, s in enumerate(self.samplers):
                incarnation = RESUMED_INCARNATION * d.resumes + self.budget.counts[f"sampler{i}"] + 1
                _resume_sampler(i, incarnation, s, store, self.patience, self.ppo)
            log.info("resumed at %.1f s of training, learner version %s", d.elapsed_s, ray.get(learner.restart_point.remote())[0])
        ray.get(learner.publish.remote(self.samplers))
        self.t0 = time.time() - d.elapsed_s
        self.runs = [s.run.remote(store, self.per_sampler) for s in self.samplers]
        self.learning = learner.run.remote(store)

    def run(self, stop_at_target: bool, eval_tasks: int, poll_s: float) -> EnvCurve:
        """Poll until every sampler is done or an evaluation reached the target; then the curve."""
        self.start()
        while True:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=poll_s)
            self.save()
            self.poll_learner()
            self.poll_samplers()
            done = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)[0]
            if not self.poll_store():
                continue
            self.tell_versions()
            if self.fire_faults():
                continue  # the next poll sees the death first: a hold now could wait out the restart unseen
            if (self.steps >= self.next_eval or len(done) == len(self.runs)) and not self.evaluate(eval_tasks):
                continue
            reached = self.collect(wait=False) and stop_at_target
            if reached or len(done) == len(self.runs):
                break
        return self.finish()

    def save(self) -> None:
        if self.files.driver_file is None:
            return
        curve = self.curve
        self.files.save(DriverState(
            elapsed_s=self.elapsed(), next_eval=self.next_eval, fired=sorted(self.fired), fault_records=self.faults.state(),
            restarts=self.sampler_restarts(), learner_restarts=self.budget.counts["learner"],
            resumes=self.d.resumes + self.resumed,
            evaluations_lost=curve.evaluations_lost + len(self.pending),  # what is in flight dies with a stop
            eval_env_steps=curve.env_steps, eval_wall_s=curve.wall_s, eval_return=curve.eval_return,
        ))

    def poll_learner(self) -> None:
        """A learner that died comes back from its checkpoint; one that stopped at
        ``stop_at_version`` stops the run (``RunStopped``)."""
        if not ray.wait([self.learning], timeout=0)[0]:
            return
        if self.learner_restarts and _died(self.learning):
            self.budget.spend("learner")
            self.learning = _restart_learner(self.learner, self.samplers, self.store, self.patience, self.ppo, self.budget)
            self.faults.recovered("learner", self.elapsed())
        elif (stopped := ray.get(self.learning))["stopped"]:
            self.save()
            raise RunStopped(f"stopped after learner version {stopped['versions']}")
        else:
            # The learner ended while samplers still ran: only an error does that, and the
            # samplers would wait on the rate limit for ever. Raise it now.
            raise RuntimeError("the learner stopped before the samplers did")

    def poll_samplers(self) -> None:
        """A sampler that died comes back at its next chunk."""
        for i, ref in enumerate(self.runs):
            if ray.wait([ref], timeout=0)[0] and _died(ref):
                self.runs[i] = self._restart_sampler(i, self.per_sampler)
                self.faults.recovered(f"sampler{i}", self.elapsed())

    def _restart_sampler(self, i: int, per_sampler: int):
        incarnation = self.budget.spend(f"sampler{i}")
        return _restart_sampler(i, incarnation, self.samplers[i], self.store, self.learner, per_sampler, self.patience, self.ppo,
                                self.budget)

    def poll_store(self) -> bool:
        """The env steps the store took; False while it does not answer (Ray restarts it, for at
        most ``ray.recovery_timeout_s``). An answer from a new instance is a restart, whether or
        not a call failed in between."""
        try:
            stats = ray.get(self.store.polled.remote())
        except ray.exceptions.RayActorError:
            now = time.perf_counter()
            self.store_down_since = self.store_down_since or now
            if now - self.store_down_since > self.patience:
                raise StoreLost(f"the replay actor has not answered for {self.patience:g} s after it died; fix: raise "
                                "ray.recovery_timeout_s if it only restarts slowly, or ray.max_restarts if it died again") from None
            return False
        self.steps = stats["env_steps"]
        restarted = self.store_instance is not None and stats["instance"] != self.store_instance
        self.store_instance = stats["instance"]
        if self.store_down_since is not None or restarted:
            down = "" if self.store_down_since is None else f" after {time.perf_counter() - self.store_down_since:.1f} s"
            self.budget.spend("replay")
            self.budget.restarted("replay", f"answers again{down}")
            self.faults.recovered("replay", self.elapsed())
            self.store_down_since = None
        return True

    def tell_versions(self) -> None:
        """``on_progress`` is told the versions the learner published since the last poll."""
        if self.on_progress is None:
            return
        try:
            told = ray.get(self.learner.progress.remote(), timeout=self.patience)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return  # restarting: what it published since the last poll died with it
        for v in told:
            self.on_progress(replace(v, at_s=self.held.running(self.t0, v.at_s), env_steps=self.steps))

    def fire_faults(self) -> bool:
        """Kill the actors whose faults are due (Ray restarts them); True if any was."""
        killed = False
        for k, f in enumerate(self.sc.faults):
            if k not in self.fired and self.steps >= f.at_env_steps:
                self.fired.add(k)
                target = f"sampler{f.sampler}" if f.target == "sampler" else f.target
                self.faults.injected(f.kind, target, self.elapsed())
                actor = {"sampler": self.samplers[f.sampler], "replay": self.store, "learner": self.learner}[f.target]
                ray.kill(actor, no_restart=False)
                killed = True
        return killed

    def evaluate(self, eval_tasks: int) -> bool:
        """Launch an evaluation of the newest weights as remote tasks (held, with
        ``env.hold_for_eval``, until it is in); False if the learner is restarting (a later poll
        evaluates)."""
        e, actors = self.sc.env, [self.store, self.learner, *self.samplers]
        if e.hold_for_eval:
            _tell(actors, "hold", self.patience)
            self.held.hold(time.time())
        try:
            version, refs = ray.get(self.learner.latest.remote())
        except ray.exceptions.RayActorError:
            refs = []
        if refs:
            (ref,) = refs
            self.next_eval = (self.steps // e.eval_every + 1) * e.eval_every
            key = len(self.evals)
            self.evals[key] = (self.steps, self.elapsed(), version)
            share = -(-e.eval_episodes // eval_tasks)
            self.pending[key] = [
                _evaluate.remote(self.sc, self.seed, ref, min(share, e.eval_episodes - i * share), i)
                for i in range(eval_tasks) if e.eval_episodes - i * share > 0
            ]
        if e.hold_for_eval:
            self.collect(wait=True)
            self.held.end(time.time())
            _tell(actors, "end_hold", self.patience)
        return bool(refs)

    def collect(self, wait: bool) -> bool:
        return _collect(self.pending, self.evals, self.curve, self.sc.env.target_return, wait=wait, on_progress=self.on_progress)

    def finish(self) -> EnvCurve:
        """Stop every actor, and gather what each counted into the curve."""
        store, patience = self.store, self.patience
        for s in self.samplers:
            s.stop.remote()
        served_now(lambda: store.close.remote(), patience, "replay.close")  # releases a sampler or the learner waiting on the store
        sampled = [self._sampler_result(i, ref) for i, ref in enumerate(self.runs)]
        learned = ray.get(self.learning)
        self.tell_versions()  # those since the last poll
        curve = self.curve
        curve.train_s = self.elapsed()
        self.collect(wait=True)
        curve.updates, curve.versions, curve.policy_lag = learned["updates"], learned["versions"], learned["policy_lag"]
        curve.learner = {k: learned[k] for k in (
            "update_s", "sample_wait_s", "store_retries", "priority_updates_lost", "publish_s", "put_s", "weight_bytes",
            "restored_from")}
        curve.learner.update(learned.get("figures", {}))
        curve.learner["restarts"] = self.budget.counts["learner"]
        curve.spans = {name: _training_spans(spans, self.held, self.t0) for name, spans in (
            ("learner", learned["spans"]), *((f"sampler{i}", r["spans"]) for i, r in enumerate(sampled)))}
        curve.replay = served_now(lambda: store.stats.remote(), patience, "replay.stats")
        curve.replay["sampler_chunks"] = sum(r["chunks"] for r in sampled)
        curve.replay["sampler_env_steps"] = sum(r["env_steps"] for r in sampled)
        curve.replay["sampler_rows"] = sum(r["rows"] for r in sampled)
        curve.replay["weights_fetched"] = [r["weights_fetched"] for r in sampled]
        curve.replay["sampler_restarts"] = self.sampler_restarts()
        curve.chunks, curve.chunks_in_flight = run_ledger(self.sc, curve.replay["sampler_chunks"], learned["chunks"], curve.replay)
        curve.episodes = curve.replay["episodes"]
        curve.faults = {**self.faults.metrics(), "records": self.faults.state()}
        curve.learner["resumes"] = self.d.resumes + self.resumed
        return curve

    def _sampler_result(self, i: int, ref) -> dict:
        """A sampler's final counts; one that died after the driver's last look is restarted once
        more to report where the store left it (the run is over, so it collects nothing)."""
        while _died(ref):
            ref = self._restart_sampler(i, 0)
        return ray.get(ref)


def _died(ref) -> bool:
    """A finished actor run that raised because its actor died (not one that returned)."""
    try:
        ray.get(ref)
        return False
    except ray.exceptions.RayActorError:
        return True


def _restart_sampler(i: int, incarnation: int, sampler, store, learner, per_sampler: int, patience: float, places: bool,
                     budget: RestartBudget):
    """A sampler actor died and Ray restarts it: it goes on at the chunk after the last one the
    store took (once any it sent before dying is in), with the newest weights; its run again."""
    seq, env_steps = _resume_sampler(i, incarnation, sampler, store, patience, places)
    version, refs = served_now(lambda: learner.latest.remote(), patience, "learner.latest")
    if refs:  # none from a learner that has just restarted: it offers its own once it has published
        sampler.offer.remote(version, refs)
    budget.restarted(f"sampler{i}", f"incarnation {incarnation}, resumes at chunk {seq}, {env_steps} env steps")
    return sampler.run.remote(store, per_sampler)


def _resume_sampler(i: int, incarnation: int, sampler, store, patience: float, places: bool) -> tuple[int, int]:
    """Set sampler ``i`` (a new process) at the chunk after the last one the store took, its
    environments in new episodes seeded by ``incarnation``; returns (that chunk, env steps)."""
    seq, env_steps = served_now(lambda: store.resume_point.remote(i), patience, "store.resume_point")
    if places:  # PPO's queue: the places the dead sampler reserved are free again
        served_now(lambda: store.release.remote(i), patience, "store.release")
    served_now(lambda: sampler.resume.remote(seq, env_steps, incarnation), patience, f"sampler{i}.resume")
    return seq, env_steps


def _rejoin_queue(learner, store, patience: float) -> None:
    """PPO: a learner back from its checkpoint. The queue hands out again, first, every chunk that
    checkpoint does not cover, and takes the learner's version before any sampler acts with it."""
    version, covered = served_now(lambda: learner.restart_point.remote(), patience, "learner.restart_point")
    again = served_now(lambda: store.rejoin.remote(covered, []), patience, "queue.rejoin")
    served_now(lambda: store.set_version.remote(version), patience, "queue.set_version")
    log.info("learner at version %d: the queue hands it %d chunks again", version, again)


def _restart_learner(learner, samplers: list, store, patience: float, ppo: bool, budget: RestartBudget):
    """The learner actor died and Ray restarts it from its latest checkpoint: it offers its weights
    to every sampler, then learns again from the store (the replay kept every row)."""
    if ppo:
        _rejoin_queue(learner, store, patience)
    version = served_now(lambda: learner.publish.remote(samplers), patience, "learner.publish")
    budget.restarted("learner", f"goes on at version {version}")
    return learner.run.remote(store)


def _training_spans(spans: list, held: HeldTime, t0: float) -> list:
    """Spans on the training clock: held seconds left out, and a span held throughout gone."""
    out = [[k, held.running(t0, a), held.running(t0, b)] for k, a, b in spans]
    return [s for s in out if s[2] > s[1]]


def _tell(actors: list, method: str, patience: float) -> None:
    """Call ``method`` on every actor and wait for the answers. One that is dead or restarting is
    passed over: it comes back unheld, and a hold is only ever a measurement's."""
    refs = [getattr(a, method).remote() for a in actors]
    for ref in refs:
        try:
            ray.get(ref, timeout=patience)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            log.warning("%s: an actor did not answer (dead or restarting); it runs on unheld", method)


def _collect(pending: dict, evals: dict, curve: EnvCurve, target: float, wait: bool, on_progress: Optional[ProgressFn] = None) -> bool:
    """Move finished evaluations into the curve, in launch order (``on_progress`` told each); True
    once one reached ``target``."""
    for key in sorted(pending):
        refs = pending[key]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=None if wait else 0)
        if len(done) < len(refs):
            if not wait:
                break  # keep the curve in order: a later evaluation waits for an earlier one
        try:
            returns = np.concatenate(ray.get(refs))
        except ray.exceptions.ObjectLostError:  # its weights died with the learner that put them
            log.warning("evaluation %d lost: the learner that published its weights died", key)
            curve.evaluations_lost += 1
            del pending[key]
            continue
        steps, wall, version = evals[key]
        curve.env_steps.append(steps)
        curve.wall_s.append(wall)
        curve.eval_return.append(float(returns.mean()))
        log.info("env steps %d: evaluation return %.1f", steps, returns.mean())
        if on_progress is not None:
            on_progress(PolicyEvaluated(version, wall, steps, float(returns.mean())))
        del pending[key]
    return any(r >= target for r in curve.eval_return)
