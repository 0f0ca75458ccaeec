"""The env pipeline's Ray actors (``core/runtimes/ray_env.py`` places and drives them): a sampler
(``SamplerHost``: its environments and policy) and the learner (``LearnerHost``: DQN or PPO,
its checkpoints, its weights published through ``ParamSync``), and the body of an evaluation task.

Both await the store actor through ``ray_actor.served``: a call is made again while the store
restarts, and the sampler's chunk or the learner's acknowledgement is not lost with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Optional

import numpy as np
import ray
import torch

from core.api import PauseMode
from core.env import learner_checkpoint
from core.env.chunk_intake import STALE_AT_LEARNER, chunk_ledger
from core.env.evaluation import episode_returns
from core.env.held_time import HeldTime
from core.env.segment_queue import batch_columns
from core.env.wiring import EVAL_SEED, beta_at, learner_process, learner_threads, make_learner, make_policy, make_sampler
from core.model.env_config import EnvScenario
from core.model.ledger import Ledger
from core.model.progress import VersionPublished
from core.model.timeline import GENERATE, SEND, SYNC, TRAIN, Timeline
from core.pipeline.param_sync import ParamSync
from core.pipeline.staleness_queue import QueueClosed
from core.runtimes.object_store_transfer import ObjectStoreTransfer
from core.runtimes.ray_actor import served
from core.store.queue_journal import chunk_key

log = logging.getLogger(__name__)


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
        self.fleet = SamplerFleet([])  # its members: given once by the driver (``publish``)
        self.param_sync = ParamSync(rollouter=self.fleet, transfer=self.transfer, mode="wait")
        self.chunks = chunk_ledger(sc)  # PPO: chunks trained, and those taken and found too stale to train
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
    _KEPT = ("updates", "update_s", "sample_wait_s", "store_retries", "priority_updates_lost", "env_steps")

    def _checkpoint(self, last: bool = False) -> None:
        """Taken before the version's weights go out, so that a restart's next version (see
        ``learner_checkpoint``) is one the dead learner never published."""
        kept = {"policy_lag": np.asarray(self.policy_lag, np.float64), "taken": np.asarray(self._taken, np.int64)}
        kept.update({f"figure.{k}": np.asarray([f[k] for f in self.figures], np.float64) for k in FIGURES})
        learner_checkpoint.save(self.checkpoints, self.version, self.learner,
                                {**{k: getattr(self, k) for k in self._KEPT}, "chunks": self.chunks.state()}, kept,
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
        self.chunks = Ledger(0)
        self.chunks.restore(st["chunks"])
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
            self.fleet.samplers = list(samplers)
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
        """Learn until the store closes (on the thread that runs the updates, set up for them)."""
        with learner_process(self.sc):
            if self.sc.learner == "ppo":
                await self._run_ppo(store)
            else:
                await self._run_dqn(store)
        out = {"updates": self.updates, "versions": self.version, "policy_lag": self.policy_lag,
               "update_s": self.update_s, "sample_wait_s": self.sample_wait_s, "chunks": self.chunks,
               "trained_chunks": self.chunks.trained, "stale_at_learner": self.chunks.dropped[STALE_AT_LEARNER],
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
            self.chunks.dropped_n(len(chunks) - len(fresh), STALE_AT_LEARNER)
            if fresh:
                await self._running.wait()
                w0 = time.time()
                figs = self.learner.learn(batch_columns(fresh), self.env_steps)
                w1 = time.time()
                self.timeline.add(ROW_LEARNER, TRAIN, w0, w1)
                self.policy_lag.extend(float(self.version - int(c.version[0])) for c in fresh)
                self.updates += figs["updates"]
                self.chunks.trained_n(len(fresh))
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


