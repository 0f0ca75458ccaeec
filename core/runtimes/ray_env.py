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
hands it again the chunks that checkpoint does not cover).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import ray
import torch

from core.api import PauseMode, RunStopped
from core.env.evaluation import episode_returns
from core.env.held_time import HeldTime
from core.env.segment_queue import SegmentQueue, batch_columns
from core.env.sync_loop import EnvCurve
from core.env.transition_replay import TransitionReplay
from core.env.learner_checkpoint import LEARNER_KIND
from core.env.wiring import EVAL_SEED, JOURNAL_KIND, beta_at, learner_threads, make_learner, make_policy, make_sampler, replay_args
from core.model.env_config import EnvScenario
from core.model.faults import FaultLog
from core.model.progress import PolicyEvaluated, ProgressFn, VersionPublished
from core.model.timeline import GENERATE, SEND, SYNC, TRAIN, Timeline
from core.model.owned import discard_owned, keep_owned, make_owned, remove_owned, remove_stale
from core.pipeline.param_sync import ParamSync
from core.pipeline.staleness_queue import QueueClosed
from core.runtimes.object_store_transfer import ObjectStoreTransfer
from core.env import learner_checkpoint
from core.store import checkpoint
from core.store.queue_journal import chunk_key

log = logging.getLogger(__name__)


class PlacementError(ValueError):
    """The cluster cannot hold the run's actors; raised before any starts."""


class SamplerHost:
    """One sampler actor: its environments and policy. Sends chunks to the store; takes the
    newest offered weights between two chunks, skipping versions it never needed."""

    def __init__(self, sc: EnvScenario, seed: int, sampler_id: int) -> None:
        torch.set_num_threads(max(1, int(sc.ray.sampler.num_cpus)))
        self.sc, self.seed = sc, seed
        self.policy = make_policy(sc, seed, sampler_id)
        self.sampler = make_sampler(sc, seed, sampler_id, self.policy)
        self._offer: Optional[tuple[int, list]] = None
        self._offered = asyncio.Event()
        self._running = asyncio.Event()  # cleared while the run is held for an evaluation
        self._running.set()
        self._stop = False
        self.weights_fetched = 0
        self.rows = 0
        self.store_retries = 0
        self.timeline = Timeline()  # on time.time(): comparable across this machine's actors

    def resume(self, seq: int, env_steps: int, incarnation: int) -> None:
        """This actor was restarted: go on at chunk ``seq`` with ``env_steps`` behind it."""
        s = self.sampler
        s.resume(seq, env_steps, seed=self.seed * 7919 + s.sampler_id + 104_729 * incarnation)

    def offer(self, version: int, refs: list) -> None:
        """``refs``: [ObjectRef of the weights], in a list so that Ray hands over the reference and
        the sampler fetches the weights only if it still needs them when its chunk is done."""
        if self._offer is None or version > self._offer[0]:
            self._offer = (version, refs)
            self._offered.set()

    def stop(self) -> None:
        self._stop = True
        self._offered.set()
        self._running.set()

    async def hold(self) -> None:
        """Act no more until ``end_hold``. Answered on the actor's loop, so never mid-chunk: the
        sampler is waiting (on the store, or for weights) and stops before its next chunk."""
        self._running.clear()

    async def end_hold(self) -> None:
        self._running.set()

    async def run(self, store, env_steps: int) -> dict:
        """Collect until ``env_steps`` of this sampler's own, a stop, or the store's close."""
        closed = False
        reserve = self.sc.learner == "ppo"  # PPO's queue admits a chunk before it is acted
        while self.sampler.env_steps < env_steps and not self._stop:
            newest = 0
            try:
                if reserve:
                    newest = await self._served(lambda: store.reserve.remote(self.sampler.sampler_id))
            except QueueClosed:
                closed = True
                break
            await self._take_weights(newest)
            await self._running.wait()
            t0 = time.time()
            chunk = self.sampler.collect()
            t1 = time.time()
            self.timeline.add(ROW_SAMPLER, GENERATE, t0, t1)
            self.rows += len(chunk)
            try:
                # Sent again while the store restarts: if it took the chunk before it died, it says so.
                await self._served(lambda: store.insert_chunk.remote(chunk))
            except QueueClosed:
                closed = True
                break
            finally:
                self.timeline.add(ROW_SAMPLER, SEND, t1, time.time())
        self.sampler.close()
        return {"env_steps": self.sampler.env_steps, "chunks": self.sampler.chunks, "rows": self.rows,
                "spans": self.timeline.spans[ROW_SAMPLER],
                "weights_fetched": self.weights_fetched, "closed": closed}

    async def _served(self, call):
        return await served(call, self.sc.ray.recovery_timeout_s, self._retried)

    def _retried(self) -> None:
        self.store_retries += 1

    async def _take_weights(self, at_least: int = 0) -> None:
        """Take the newest offered weights; first wait for version ``at_least`` to be offered (the
        learner announced it to the queue just before the offer reached this sampler)."""
        while (self._offer[0] if self._offer is not None else -1) < at_least and not self._stop:
            self._offered.clear()
            await self._offered.wait()
        if self._offer is None or self._offer[0] <= self.policy.version:
            return
        version, (ref,) = self._offer
        t0 = time.time()
        try:
            weights = await ref
        except ray.exceptions.ObjectLostError:  # put by a learner that died: its restart offers newer ones
            self._offer = None
            return
        self.policy.set_weights(weights, version)
        self.timeline.add(ROW_SAMPLER, SYNC, t0, time.time())
        self.weights_fetched += 1


class SamplerFleet:
    """ParamSync's rollout side for the samplers. A sampler is never paused: it acts on the
    weights it holds and takes the newest at its next chunk, so a sync is one put and one
    offer per sampler, and the learner does not wait for any sampler."""

    def __init__(self, samplers: list) -> None:
        self.samplers = samplers

    async def pause(self, mode: PauseMode) -> None:
        pass

    async def update_weights(self, version: int, weights: list) -> None:
        for s in self.samplers:
            s.offer.remote(version, weights)

    async def resume(self) -> None:
        pass


class LearnerHost:
    """The learner actor. DQN: samples ``dqn.batches_per_call`` batches per call, updates on each,
    sends their priorities back in one call, and publishes weights every ``dqn.publish_every``
    updates. PPO: takes ``ppo.chunks_per_batch`` chunks per call, trains on them, publishes
    weights after each batch, and acknowledges the chunks to the queue once its state covers
    them (at its checkpoint, or at once if it keeps none)."""

    def __init__(self, sc: EnvScenario, seed: int, checkpoints: Optional[str] = None, stop_at: Optional[int] = None) -> None:
        """``checkpoints``: where to keep them (and restore from, if any are there); ``stop_at``:
        stop after this version, checkpointed, as a crash would stop the run (``--stop-at-step``),
        unless it restored a version at or past it."""
        torch.set_num_threads(learner_threads(sc))
        self.sc = sc
        self.learner = make_learner(sc, seed)
        self.version = 0
        self.updates = 0
        self.policy_lag: list[float] = []
        # Where the learner's time goes: its own updates (publishing included), against waiting
        # for a sample (held back by the rate limit, or by the replay actor's answer).
        self.update_s = self.sample_wait_s = 0.0
        self.holds = HeldTime()  # on perf_counter: held seconds count as neither
        self._running = asyncio.Event()  # cleared while the run is held for an evaluation
        self._running.set()
        self.transfer = ObjectStoreTransfer(self.learner, ray.put)
        self.param_sync = ParamSync(rollouter=SamplerFleet([]), transfer=self.transfer, mode="wait")
        self.trained_chunks = 0
        self.stale_at_learner = 0  # PPO: chunks taken and found too stale to train
        self.env_steps = 0  # PPO: env steps of every chunk taken, the anneal schedule's clock
        self._taken: list[int] = []  # PPO: keys of chunks taken since the last acknowledgement
        self._covered: list[int] = []  # PPO: those of the checkpoint this actor restarted from
        self.figures: list[dict] = []
        self.told: list[VersionPublished] = []  # since the driver last asked; env steps are the driver's to fill in
        self.timeline = Timeline()
        self.store_retries = 0
        self.priority_updates_lost = 0  # sent to a replay that died before it applied them
        self.checkpoints = Path(checkpoints) if checkpoints else None
        self.restored_from: Optional[int] = None
        self.stop_at = stop_at
        self.stopped = False
        if self.checkpoints is not None:
            self._restore()
        if stop_at is not None and self.version >= stop_at:
            self.stop_at = None  # a resumed run already past it goes on to its end

    # Counts a checkpoint keeps, beside the learner's own state.
    _KEPT = ("updates", "update_s", "sample_wait_s", "store_retries", "priority_updates_lost", "trained_chunks",
             "stale_at_learner", "env_steps")

    def _checkpoint(self, last: bool = False) -> None:
        """Taken before the version's weights go out, so that a restart's next version (see
        ``learner_checkpoint``) is one the dead learner never published."""
        kept = {"policy_lag": np.asarray(self.policy_lag, np.float64), "taken": np.asarray(self._taken, np.int64)}
        kept.update({f"figure.{k}": np.asarray([f[k] for f in self.figures], np.float64) for k in FIGURES})
        learner_checkpoint.save(self.checkpoints, self.version, self.learner, {k: getattr(self, k) for k in self._KEPT}, kept,
                                last=last)

    def _restore(self) -> bool:
        """This actor was restarted, or the run resumed: the learner as its latest checkpoint
        left it. False if there is none."""
        got = learner_checkpoint.load(self.checkpoints, self.learner, self.sc.checkpoint.every)
        if got is None:
            return False
        self.version, st, arrays = got
        for k in self._KEPT:
            setattr(self, k, st[k])
        self.policy_lag = arrays["policy_lag"].tolist()
        self._covered = arrays["taken"].tolist()
        self._taken = list(self._covered)  # acknowledged again with the next batch's: a no-op if the queue had them
        figs = [arrays[f"figure.{k}"].tolist() for k in FIGURES]
        self.figures = [dict(zip(FIGURES, row)) for row in zip(*figs)]
        self.restored_from = st["version"]
        # At once under the new number: another death before the next checkpoint must not come
        # back to the old one and number again versions this actor publishes.
        self._checkpoint()
        log.info("learner restored from version %d (%d updates); goes on as version %d", st["version"], self.updates, self.version)
        return True

    def restart_point(self) -> tuple[int, list[int]]:
        """(the version this restarted actor goes on at, the chunks its checkpoint had taken since
        the acknowledgement before it): PPO's queue is told both (the dead one may not have acknowledged)."""
        return self.version, self._covered

    def _retried(self) -> None:
        self.store_retries += 1

    async def hold(self) -> None:
        """Learn no more until ``end_hold``: answered on the actor's loop, so between two updates."""
        self.holds.hold(time.perf_counter())
        self._running.clear()

    async def end_hold(self) -> None:
        self.holds.end(time.perf_counter())
        self._running.set()

    def _versioned(self) -> bool:
        """A new version exists: checkpoint it if due, before its weights go out. True if the run
        stops here (``stop_at``)."""
        every = self.sc.checkpoint.every if self.checkpoints is not None else 0
        self.stopped = self.stop_at is not None and self.version >= self.stop_at
        if self.stopped:
            self._checkpoint(last=True)
        elif every and self.version % every == 0:
            self._checkpoint()
        return self.stopped

    async def publish(self, samplers: Optional[list] = None) -> int:
        """Put the weights in the object store once and offer that reference to every sampler
        (``samplers``: the fleet, given once by the driver)."""
        if samplers is not None:
            self.param_sync.rollouter = SamplerFleet(samplers)
        await self.param_sync.sync(self.version)
        return self.version

    def latest(self) -> tuple[int, list]:
        """(version, [ObjectRef]) of the newest published weights."""
        return self.transfer.latest

    def progress(self) -> list[VersionPublished]:
        """The versions published since the last call, on ``time.time()``."""
        told, self.told = self.told, []
        return told

    def _tell(self, figures: Optional[dict] = None) -> None:
        self.told.append(VersionPublished(self.version, time.time(), 0, self.updates, figures or {}))

    async def run(self, store) -> dict:
        """Learn until the store closes."""
        if self.sc.learner == "ppo":
            await self._run_ppo(store)
        else:
            await self._run_dqn(store)
        out = {"updates": self.updates, "versions": self.version, "policy_lag": self.policy_lag,
               "update_s": self.update_s, "sample_wait_s": self.sample_wait_s, "trained_chunks": self.trained_chunks,
               "stale_at_learner": self.stale_at_learner,
               "store_retries": self.store_retries, "priority_updates_lost": self.priority_updates_lost,
               "publish_s": sum(self.param_sync.pause_s), "put_s": self.transfer.put_s, "weight_bytes": self.transfer.bytes,
               "restored_from": self.restored_from, "stopped": self.stopped, "spans": self.timeline.spans[ROW_LEARNER]}
        if self.figures:
            out["figures"] = {k: float(np.mean([f[k] for f in self.figures])) for k in self.figures[0]}
        return out

    async def _run_ppo(self, queue) -> None:
        """Unlike DQN's, the next batch is not asked for ahead: taking chunks frees their places,
        and a sampler should take the weights published just before (one version of lag, not
        two). A chunk that has grown too stale by the time the learner reaches it is dropped
        (and counted here)."""
        p = self.sc.ppo
        every = self.sc.checkpoint.every if self.checkpoints is not None else 0
        patience = self.sc.ray.recovery_timeout_s
        clock = time.perf_counter
        while True:
            t0 = clock()
            try:
                chunks = await queue.get_batch.remote(p.chunks_per_batch)
            except QueueClosed:
                break
            except ray.exceptions.RayActorError:
                # The queue died, perhaps with chunks handed out whose answer died with it: once it
                # is back, it hands out again every chunk not acknowledged that this learner lacks.
                try:
                    await served(lambda: queue.rejoin.remote([], self._taken), patience, self._retried)
                except QueueClosed:
                    break
                self.sample_wait_s += self.holds.running(t0, clock())
                continue
            t1 = clock()
            self.sample_wait_s += self.holds.running(t0, t1)
            if self.sc.durable_store():
                self._taken.extend(chunk_key(c) for c in chunks)
            self.env_steps += sum(c.env_steps for c in chunks)
            fresh = [c for c in chunks if self.version - int(c.version[0]) <= p.max_staleness]
            self.stale_at_learner += len(chunks) - len(fresh)
            if fresh:
                await self._running.wait()
                w0 = time.time()
                figs = self.learner.learn(batch_columns(fresh), self.env_steps)
                w1 = time.time()
                self.timeline.add(ROW_LEARNER, TRAIN, w0, w1)
                self.policy_lag.extend(float(self.version - int(c.version[0])) for c in fresh)
                self.updates += figs["updates"]
                self.trained_chunks += len(fresh)
                self.figures.append({k: figs[k] for k in FIGURES})
                self.version += 1
                if self._versioned():
                    break
                # The queue first: it refuses a chunk acted by a version newer than its own.
                await served(lambda: queue.set_version.remote(self.version), patience, self._retried)
                await self.publish()
                self._tell(figs)
                self.timeline.add(ROW_LEARNER, SYNC, w1, time.time())
            if self.sc.durable_store() and (not every or (fresh and self.version % every == 0)):
                # Awaited, and again while the queue restarts: a lost acknowledgement would have a
                # restarted queue hand these chunks out a second time.
                await served(lambda: queue.ack.remote(self._taken), patience, self._retried)
                self._taken = []
            self.update_s += self.holds.running(t1, clock())

    async def _run_dqn(self, replay) -> None:
        """Learn until the replay closes. The next sample call is in flight while the learner
        updates on the current one, and priorities go back without waiting for an answer (the
        next call's answer checks the previous one's), so a learner the rate limit does not hold
        back never waits on the replay's round trip. The price, as in Ape-X: a batch is drawn
        before the previous batch's priorities are in."""
        d = self.sc.dqn
        k, b = d.batches_per_call, d.batch_size
        env_steps_per_update = b / self.sc.replay.samples_per_insert
        clock = time.perf_counter
        beta = lambda: beta_at(self.sc, int(self.updates * env_steps_per_update))  # noqa: E731
        patience = self.sc.ray.recovery_timeout_s
        draw = lambda: replay.sample.remote(k * b, beta())  # noqa: E731
        incoming = draw()
        sent = None
        while True:
            t0 = clock()
            try:
                try:
                    rows, slots, weights = await incoming
                except ray.exceptions.RayActorError:  # the replay died: draw again once it is back
                    rows, slots, weights = await served(draw, patience, self._retried)
            except QueueClosed:
                break
            incoming = draw()
            if sent is not None:
                try:
                    await sent  # answered long ago; raises here if the replay refused the priorities
                except ray.exceptions.RayActorError:
                    self.priority_updates_lost += 1
            t1 = clock()
            self.sample_wait_s += self.holds.running(t0, t1)
            prio = np.empty(k * b, np.float64)
            for j in range(k):
                part = slice(j * b, (j + 1) * b)
                await self._running.wait()  # publishing awaits: a hold may come between two updates
                w0 = time.time()
                prio[part], _ = self.learner.update({c: v[part] for c, v in rows.items()}, weights[part])
                w1 = time.time()
                self.timeline.add(ROW_LEARNER, TRAIN, w0, w1)
                self.policy_lag.append(self.version - float(np.mean(rows["version"][part])))
                self.updates += 1
                if self.updates % d.publish_every == 0:
                    self.version += 1
                    if self._versioned():
                        return
                    await self.publish()
                    self._tell()
                    self.timeline.add(ROW_LEARNER, SYNC, w1, time.time())
            self.update_s += self.holds.running(t1, clock())
            sent = replay.update_priorities.remote(slots, prio)
        if sent is not None:
            try:
                await sent
            except ray.exceptions.RayActorError:
                self.priority_updates_lost += 1


ROW_SAMPLER, ROW_LEARNER = "sampler", "learner"  # an actor's own row; the driver names the samplers'
FIGURES = ("rho_mean", "rho_truncated", "clip_frac", "approx_kl")  # PPO's, per batch, averaged over the run


def evaluate_weights(sc: EnvScenario, seed: int, weights: dict[str, np.ndarray], episodes: int, part: int) -> np.ndarray:
    """Returns of ``episodes`` greedy episodes of the given weights: one evaluation task."""
    torch.set_num_threads(1)
    policy = make_policy(sc, seed, 0)
    policy.set_weights(weights, 0)
    return episode_returns(policy.greedy, sc.env.id, episodes, seed * 7919 + EVAL_SEED + 101 * part)


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
    e = sc.env
    check_fits(sc)
    keep = workdir is not None and bool(sc.checkpoint.every)
    scratch: list[tuple[Path, str]] = []  # directories removed at the end, whatever happens

    def place(name: str, kind: str) -> Path:
        if not keep:
            root = Path(workdir or tempfile.gettempdir())
            remove_stale(root, (kind,))  # what killed runs left there
            d = make_owned(root, f".asyncrl-{name}-", kind)
            scratch.append((d, kind))
            return d
        return keep_owned(Path(workdir) / name, kind)

    learner_dir = place("checkpoints", LEARNER_KIND) if sc.checkpoint.every else None
    driver_file = Path(workdir) / DRIVER_FILE if keep else None
    resumed = None
    if keep and checkpoint.latest(learner_dir) is not None:
        resumed = read_driver(driver_file)
    elif keep:  # stopped before its first checkpoint, if at all: start this run again
        remove_owned(Path(workdir) / "store", JOURNAL_KIND)
        driver_file.unlink(missing_ok=True)
    journal_dir = place("store", JOURNAL_KIND) if sc.durable_store() else None
    store_options = {"num_cpus": sc.ray.replay.num_cpus, "max_concurrency": sc.ray.replay.max_concurrency}
    if journal_dir is not None:  # only a journaled store is restarted: one without would come back empty
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
    actors = [store, learner, *samplers]
    if on_processes is not None:
        pids = ray.get([a.__ray_call__.remote(_actor_pid) for a in actors])
        on_processes(list(zip(["replay" if sc.learner == "dqn" else "queue", "learner", *(f"sampler-{i}" for i in range(len(samplers)))], pids)))
    d = resumed or DriverState()
    curve = EnvCurve(env_steps=d.eval_env_steps, wall_s=d.eval_wall_s, eval_return=d.eval_return,
                     evaluations_lost=d.evaluations_lost)
    faults = FaultLog.from_state(d.fault_records)
    fired, restarts, learner_restarts = set(d.fired), d.restarts or [0] * e.samplers, d.learner_restarts
    patience = sc.ray.recovery_timeout_s
    ppo = sc.learner == "ppo"
    finished = False
    try:
        if resumed is not None:
            # Every part from where it stopped: the store from its journal, the learner from its
            # checkpoint (PPO's queue hands it again what that does not cover), each sampler at the
            # chunk after the last the store took, its environments in new episodes.
            if ppo:
                _rejoin_queue(learner, store, patience)
            for i, s in enumerate(samplers):
                _resume_sampler(i, RESUMED_INCARNATION * d.resumes + restarts[i] + 1, s, store, patience, ppo)
            log.info("resumed at %.1f s of training, learner version %s", d.elapsed_s, ray.get(learner.restart_point.remote())[0])
        ray.get(learner.publish.remote(samplers))  # the first version reaches every sampler before it acts
        # One clock for the driver and the actors' spans (time.time(): comparable across this
        # machine's processes); seconds held for evaluations are left out of every time reported.
        t0 = time.time() - d.elapsed_s
        held = HeldTime()
        elapsed = lambda: held.running(t0, time.time())  # noqa: E731  the training clock
        per_sampler = -(-e.env_steps // e.samplers)
        runs = [s.run.remote(store, per_sampler) for s in samplers]
        learning = learner.run.remote(store)
        evals: dict[Any, tuple[int, float, int]] = {}  # task group -> (env steps, wall s when the weights were taken, version)
        pending: dict[int, list] = {}
        next_eval = d.next_eval or e.eval_every
        steps = 0
        store_down_since: Optional[float] = None

        def tell_versions(steps: int) -> None:
            if on_progress is None:
                return
            try:
                told = ray.get(learner.progress.remote(), timeout=patience)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return  # restarting: what it published since the last poll died with it
            for v in told:
                on_progress(replace(v, at_s=held.running(t0, v.at_s), env_steps=steps))

        def save_driver() -> None:
            if driver_file is not None:
                write_driver(driver_file, DriverState(
                    elapsed_s=elapsed(), next_eval=next_eval, fired=sorted(fired), fault_records=faults.state(),
                    restarts=restarts, learner_restarts=learner_restarts, resumes=d.resumes + (resumed is not None),
                    evaluations_lost=curve.evaluations_lost + len(pending),  # what is in flight dies with a stop
                    eval_env_steps=curve.env_steps, eval_wall_s=curve.wall_s, eval_return=curve.eval_return,
                ))

        while True:
            ray.wait(runs, num_returns=len(runs), timeout=poll_s)
            save_driver()
            if ray.wait([learning], timeout=0)[0]:
                if learner_dir is not None and _died(learning):
                    learner_restarts += 1
                    learning = _restart_learner(learner, samplers, store, patience, ppo)
                    faults.recovered("learner", elapsed())
                elif (stopped := ray.get(learning))["stopped"]:
                    save_driver()
                    raise RunStopped(f"stopped after learner version {stopped['versions']}")
                else:
                    # The learner ended while samplers still ran: only an error does that, and the
                    # samplers would wait on the rate limit for ever. Raise it now.
                    raise RuntimeError("the learner stopped before the samplers did")
            for i, ref in enumerate(runs):
                if ray.wait([ref], timeout=0)[0] and _died(ref):
                    restarts[i] += 1
                    runs[i] = _restart_sampler(i, restarts[i], samplers[i], store, learner, per_sampler, patience, ppo)
                    faults.recovered(f"sampler{i}", elapsed())
            done = ray.wait(runs, num_returns=len(runs), timeout=0)[0]
            try:
                steps = ray.get(store.stats.remote())["env_steps"]
                if store_down_since is not None:
                    faults.recovered("replay", elapsed())
                    store_down_since = None
            except ray.exceptions.RayActorError:
                now = time.perf_counter()
                store_down_since = store_down_since or now
                if now - store_down_since > patience:
                    raise StoreLost(f"the replay actor has not answered for {patience:g} s after it died; fix: raise "
                                    "ray.recovery_timeout_s if it only restarts slowly, or ray.max_restarts if it died again") from None
                continue
            tell_versions(steps)
            killed = False
            for k, f in enumerate(sc.faults):
                if k not in fired and steps >= f.at_env_steps:
                    fired.add(k)
                    target = f"sampler{f.sampler}" if f.target == "sampler" else f.target
                    faults.injected(f.kind, target, elapsed())
                    actor = {"sampler": samplers[f.sampler], "replay": store, "learner": learner}[f.target]
                    ray.kill(actor, no_restart=False)
                    killed = True
            if killed:
                continue  # the next poll sees the death first: a hold now could wait out the restart unseen
            if steps >= next_eval or len(done) == len(runs):
                if e.hold_for_eval:
                    _tell(actors, "hold", patience)
                    held.hold(time.time())
                try:
                    version, refs = ray.get(learner.latest.remote())
                except ray.exceptions.RayActorError:
                    refs = []  # the learner is restarting: evaluate at a later poll
                if refs:
                    (ref,) = refs
                    next_eval = (steps // e.eval_every + 1) * e.eval_every
                    key = len(evals)
                    evals[key] = (steps, elapsed(), version)
                    share = -(-e.eval_episodes // eval_tasks)
                    pending[key] = [
                        _evaluate.remote(sc, seed, ref, min(share, e.eval_episodes - i * share), i)
                        for i in range(eval_tasks) if e.eval_episodes - i * share > 0
                    ]
                if e.hold_for_eval:
                    _collect(pending, evals, curve, e.target_return, wait=True, on_progress=on_progress)
                    held.end(time.time())
                    _tell(actors, "end_hold", patience)
                if not refs:
                    continue
            reached = _collect(pending, evals, curve, e.target_return, wait=False, on_progress=on_progress) and stop_at_target
            if reached or len(done) == len(runs):
                break
        for s in samplers:
            s.stop.remote()
        _served(lambda: store.close.remote(), patience, "replay.close")  # releases a sampler or the learner waiting on the store
        sampled = [_sampler_result(i, ref, samplers[i], restarts, store, learner, patience, ppo) for i, ref in enumerate(runs)]
        learned = ray.get(learning)
        tell_versions(steps)  # those since the last poll
        curve.train_s = elapsed()
        _collect(pending, evals, curve, e.target_return, wait=True, on_progress=on_progress)
        curve.updates, curve.versions, curve.policy_lag = learned["updates"], learned["versions"], learned["policy_lag"]
        curve.learner = {k: learned[k] for k in (
            "update_s", "sample_wait_s", "store_retries", "priority_updates_lost", "publish_s", "put_s", "weight_bytes",
            "restored_from")}
        curve.learner.update(learned.get("figures", {}))
        curve.learner["restarts"] = learner_restarts
        curve.spans = {name: _training_spans(spans, held, t0) for name, spans in (
            ("learner", learned["spans"]), *((f"sampler{i}", r["spans"]) for i, r in enumerate(sampled)))}
        curve.trained_chunks = learned["trained_chunks"]
        curve.dropped_at_learner = learned["stale_at_learner"]
        curve.produced_chunks = sum(r["chunks"] for r in sampled)
        curve.replay = _served(lambda: store.stats.remote(), patience, "replay.stats")
        curve.replay["sampler_chunks"] = sum(r["chunks"] for r in sampled)
        curve.replay["sampler_env_steps"] = sum(r["env_steps"] for r in sampled)
        curve.replay["sampler_rows"] = sum(r["rows"] for r in sampled)
        curve.replay["weights_fetched"] = [r["weights_fetched"] for r in sampled]
        curve.replay["sampler_restarts"] = restarts
        curve.episodes = curve.replay["episodes"]
        curve.faults = {**faults.metrics(), "records": faults.state()}
        curve.learner["resumes"] = d.resumes + (resumed is not None)
        finished = True
        return curve
    finally:
        for a in actors:
            ray.kill(a)
        for path, kind in scratch:
            discard_owned(path, kind)
        if keep and finished:  # the journal is the size of everything taken; the last checkpoint stays
            remove_owned(Path(workdir) / "store", JOURNAL_KIND)
            driver_file.unlink(missing_ok=True)


DRIVER_FILE = "driver.ckpt"
# Sampler seeds after a resume: far from those of in-run restarts, so no two incarnations share one.
RESUMED_INCARNATION = 1_000


@dataclass
class DriverState:
    """What the driver of an async run must carry over a resume: its clock, its evaluations so
    far and its fault bookkeeping (the parts carry their own in journals and checkpoints)."""

    elapsed_s: float = 0.0
    next_eval: int = 0
    fired: list[int] = field(default_factory=list)
    fault_records: list[dict] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)
    learner_restarts: int = 0
    resumes: int = 0
    evaluations_lost: int = 0
    eval_env_steps: list[int] = field(default_factory=list)
    eval_wall_s: list[float] = field(default_factory=list)
    eval_return: list[float] = field(default_factory=list)


_SERIES = ("eval_env_steps", "eval_wall_s", "eval_return")


def write_driver(path: Path, d: DriverState) -> None:
    state = {k: v for k, v in asdict(d).items() if k not in _SERIES}
    arrays = {k: np.asarray(getattr(d, k), np.float64) for k in _SERIES}
    checkpoint.write_atomic(path, checkpoint.encode(checkpoint.Snapshot(state=state, arrays=arrays)))


def check_resume(workdir: Path) -> None:
    """Read what a run in ``workdir`` would resume from (the learner's latest checkpoint, the
    driver's state), so that a resume refuses one it cannot use before anything runs."""
    learner_checkpoint.check(Path(workdir) / "checkpoints")
    read_driver(Path(workdir) / DRIVER_FILE)


def read_driver(path: Path) -> DriverState:
    """The driver's state (``CheckpointError`` if unreadable); a fresh one if the run stopped
    before it first wrote one."""
    if not path.exists():
        return DriverState()
    snap = checkpoint.decode(checkpoint.read_file(path), str(path))
    try:
        return DriverState(
            **snap.state, eval_env_steps=[int(x) for x in snap.arrays["eval_env_steps"]],
            eval_wall_s=snap.arrays["eval_wall_s"].tolist(), eval_return=snap.arrays["eval_return"].tolist(),
        )
    except (TypeError, KeyError) as exc:
        raise checkpoint.CheckpointError(str(path), f"not an env driver's state ({exc})", "start the run again") from None


class StoreLost(RuntimeError):
    """A restarted actor did not answer within ``ray.recovery_timeout_s``."""


def _died(ref) -> bool:
    """A finished sampler run that raised because its actor died (not one that returned)."""
    try:
        ray.get(ref)
        return False
    except ray.exceptions.RayActorError:
        return True


async def served(call, patience: float, on_retry=None):
    """Await ``call()``, called again while the actor behind it restarts, for ``patience`` s. What
    the call raises otherwise (a store's close, a refusal) passes through."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return await call()
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise StoreLost(f"no answer for {patience:g} s from an actor that died; fix: raise ray.recovery_timeout_s "
                                "if it only restarts slowly, or ray.max_restarts if it died again") from None
            if on_retry is not None:
                on_retry()
            await asyncio.sleep(0.05)


def _served(call, patience: float, what: str):
    """``ray.get(call())``, called again while the actor behind it restarts, for ``patience`` s."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return ray.get(call())
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise StoreLost(f"{what}: no answer for {patience:g} s; fix: raise ray.recovery_timeout_s") from None
            time.sleep(0.05)


def _restart_sampler(i: int, incarnation: int, sampler, store, learner, per_sampler: int, patience: float, places: bool):
    """A sampler actor died and Ray restarts it: it goes on at the chunk after the last one the
    store took (once any it sent before dying is in), with the newest weights; its run again."""
    seq, env_steps = _resume_sampler(i, incarnation, sampler, store, patience, places)
    version, refs = _served(lambda: learner.latest.remote(), patience, "learner.latest")
    if refs:  # none from a learner that has just restarted: it offers its own once it has published
        sampler.offer.remote(version, refs)
    log.info("sampler %d restarted (incarnation %d): resumes at chunk %d, %d env steps", i, incarnation, seq, env_steps)
    return sampler.run.remote(store, per_sampler)


def _resume_sampler(i: int, incarnation: int, sampler, store, patience: float, places: bool) -> tuple[int, int]:
    """Set sampler ``i`` (a new process) at the chunk after the last one the store took, its
    environments in new episodes seeded by ``incarnation``; returns (that chunk, env steps)."""
    seq, env_steps = _served(lambda: store.resume_point.remote(i), patience, "store.resume_point")
    if places:  # PPO's queue: the places the dead sampler reserved are free again
        _served(lambda: store.release.remote(i), patience, "store.release")
    _served(lambda: sampler.resume.remote(seq, env_steps, incarnation), patience, f"sampler{i}.resume")
    return seq, env_steps


def _rejoin_queue(learner, store, patience: float) -> None:
    """PPO: a learner back from its checkpoint. The queue hands out again, first, every chunk that
    checkpoint does not cover, and takes the learner's version before any sampler acts with it."""
    version, covered = _served(lambda: learner.restart_point.remote(), patience, "learner.restart_point")
    again = _served(lambda: store.rejoin.remote(covered, []), patience, "queue.rejoin")
    _served(lambda: store.set_version.remote(version), patience, "queue.set_version")
    log.info("learner at version %d: the queue hands it %d chunks again", version, again)


def _restart_learner(learner, samplers: list, store, patience: float, ppo: bool):
    """The learner actor died and Ray restarts it from its latest checkpoint: it offers its weights
    to every sampler, then learns again from the store (the replay kept every row)."""
    if ppo:
        _rejoin_queue(learner, store, patience)
    version = _served(lambda: learner.publish.remote(samplers), patience, "learner.publish")
    log.info("learner restarted: goes on at version %d", version)
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


def _sampler_result(i, ref, sampler, restarts, store, learner, patience, ppo) -> dict:
    """A sampler's final counts; one that died after the driver's last look is restarted once
    more to report where the store left it (the run is over, so it collects nothing)."""
    while _died(ref):
        restarts[i] += 1
        ref = _restart_sampler(i, restarts[i], sampler, store, learner, 0, patience, ppo)
    return ray.get(ref)


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
