"""The env pipeline's local runtime (sync mode): one thread alternates between the sampler and
the learner, the env counterpart of ``core/runtimes/local.py``.

Each turn the sampler collects one chunk and the learner's store takes it.

- DQN: the learner then updates as long as the replay's rate limiter lets it sample, so samples
  per insert hold exactly as they would between actors, and nothing waits. Every
  ``dqn.publish_every`` updates the learner's weights go to the policy as a new version.
- PPO: once the queue holds ``ppo.chunks_per_batch`` chunks the learner trains on them, and its
  weights go to the policy as a new version before the next chunk is collected: every segment
  is acted by the policy that trains on it (stable-baselines3's PPO).

This is the baseline an async run is measured against. With fixed seeds it is deterministic:
the same seeds give the same curve, on either backend of ``ext.replay``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from core.api import RunStopped
from core.env import learner_checkpoint
from core.env.chunk_intake import chunk_ledger, run_ledger
from core.env.curve import EnvCurve, curve_from_state, curve_state
from core.env.evaluation import greedy_return
from core.env.held_time import HeldTime
from core.env.learner_checkpoint import LEARNER_KIND
from core.env.sampler import Policy
from core.env.segment_queue import batch_columns
from core.env.wiring import (
    JOURNAL_KIND, SAMPLER_SEED, beta_at, learner_process, make_learner, make_policy, make_queue, make_replay, make_sampler,
)
from core.model.env_config import EnvScenario
from core.model.owned import keep_owned, remove_owned
from core.model.progress import PolicyEvaluated, ProgressFn, VersionPublished
from core.model.timeline import GENERATE, SEND, SYNC, TRAIN, Timeline
from core.store import checkpoint
from core.store.queue_journal import chunk_key

log = logging.getLogger(__name__)

# Sampler seeds after a resume: far from those the run started with.
RESUMED_SEED = 104_729
ROW = "sync loop"  # the timeline's one row: sampler and learner take turns on it


async def run_sync(
    sc: EnvScenario, seed: int, *, evaluate: Optional[Callable[[Policy], float]] = None,
    stop_at_target: bool = True, run_dir: Optional[Path] = None, stop_at_version: Optional[int] = None,
    on_progress: Optional[ProgressFn] = None,
) -> EnvCurve:
    """Train for ``env.env_steps`` (or until an evaluation reaches ``env.target_return``, with
    ``stop_at_target``). Evaluations run every ``env.eval_every`` env steps and at the end.

    ``run_dir``: with ``checkpoint.every``, the store's journal and the learner's checkpoints
    live there, and a run that finds a checkpoint there goes on from it: the learner and the
    curve as checkpointed, the store as journaled, the sampler at the chunk after the last the
    store took, its environments in new episodes. ``stop_at_version``: stop once that version
    is checkpointed, as a crash would (``RunStopped``), unless the run resumed at or past it.
    ``on_progress`` is told every version published and every evaluation, as they happen."""
    with learner_process(sc):
        loop = SyncLoop(sc, seed, evaluate or greedy_return(sc, seed), stop_at_target, run_dir, stop_at_version, on_progress)
        restored = await loop.restore()
        return await loop.train(restored)


class SyncLoop:
    """One sync run: its sampler, store and learner, the curve it fills, and the training clock
    (which stops while an evaluation runs: evaluations are measurement, not training)."""

    def __init__(self, sc: EnvScenario, seed: int, evaluate: Callable[[Policy], float], stop_at_target: bool,
                 run_dir: Optional[Path], stop_at_version: Optional[int], on_progress: Optional[ProgressFn]) -> None:
        self.sc, self.seed, self.evaluate, self.stop_at_target = sc, seed, evaluate, stop_at_target
        self.stop_at_version, self.on_progress = stop_at_version, on_progress
        self.every = sc.checkpoint.every if run_dir is not None else 0
        self.ppo = sc.learner == "ppo"
        self.ckpt_dir = Path(run_dir) / "checkpoints" if self.every else None
        self.store_dir = Path(run_dir) / "store" if self.every else None
        if self.every and checkpoint.latest(self.ckpt_dir) is None:
            remove_owned(self.store_dir, JOURNAL_KIND)  # stopped before its first checkpoint, if at all: start again
        if self.every:
            keep_owned(self.ckpt_dir, LEARNER_KIND)
            keep_owned(self.store_dir, JOURNAL_KIND)
        self.policy = make_policy(sc, seed, 0)
        self.sampler = make_sampler(sc, seed, 0, self.policy)
        self.store = make_queue(sc, self.store_dir) if self.ppo else make_replay(sc, seed, self.store_dir)
        self.learner = make_learner(sc, seed)
        self.curve = EnvCurve(chunks=chunk_ledger(sc))
        self.next_eval = sc.env.eval_every
        self.update_s = 0.0
        self.resumes = 0
        self.taken: list[int] = []  # PPO: keys of chunks taken since the last checkpoint
        self.held = HeldTime()
        self.timeline = Timeline()
        self.t0 = 0.0

    async def restore(self) -> bool:
        """Go on from the latest checkpoint, if any (True), and start the training clock."""
        restored = learner_checkpoint.load(self.ckpt_dir, self.learner, self.every) if self.every else None
        if restored is not None:
            version, st, arrays = restored
            self.curve = curve_from_state(st["curve"], arrays)
            self.curve.versions = version
            self.next_eval, self.update_s, self.resumes = st["next_eval"], st["update_s"], st["resumes"] + 1
            seq, env_steps = await self.store.resume_point(0)
            self.sampler.resume(seq, env_steps, seed=self.seed * 7919 + SAMPLER_SEED + RESUMED_SEED * self.resumes)
            if self.ppo:
                self.store.rejoin(arrays["taken"].tolist(), [])
                self.store.set_version(version)
            log.info("resumed from version %d at %d env steps", st["version"], env_steps)
            if self.stop_at_version is not None and version >= self.stop_at_version:
                self.stop_at_version = None  # already past it: go on to the end
        self.policy.set_weights(self.learner.weights(), self.curve.versions)
        self.t0 = time.perf_counter() - self.curve.train_s
        return restored is not None

    def clock(self) -> float:
        """The training clock."""
        return self.held.running(self.t0, time.perf_counter())

    def spent(self, kind: str, since: float) -> float:
        now = self.clock()
        self.timeline.add(ROW, kind, since, now)
        return now - since

    def publish(self, figures: Optional[dict] = None) -> None:
        """A new version: checkpointed when due (or at ``stop_at_version``, then stopped), told, and
        the policy's weights."""
        curve = self.curve
        curve.versions += 1
        stop = self.stop_at_version is not None and curve.versions >= self.stop_at_version
        if stop or (self.every and curve.versions % self.every == 0):
            curve.train_s = self.clock()
            curve.learner = {"update_s": self.update_s}
            scalars, arrays = curve_state(curve)
            arrays["taken"] = np.asarray(self.taken, np.int64)
            learner_checkpoint.save(self.ckpt_dir, curve.versions, self.learner, {
                "curve": scalars, "next_eval": self.next_eval, "update_s": self.update_s, "resumes": self.resumes}, arrays, last=stop)
            if self.ppo:
                self.store.ack(self.taken)
                self.taken.clear()
        if self.on_progress is not None:
            self.on_progress(VersionPublished(curve.versions, self.clock(), self.sampler.env_steps, curve.updates, figures or {}))
        if stop:
            raise RunStopped(f"stopped after learner version {curve.versions}")
        self.policy.set_weights(self.learner.weights(), curve.versions)

    async def learn_dqn(self) -> None:
        """Update while the rate limiter lets the learner sample."""
        sc, replay, curve = self.sc, self.store, self.curve
        batch = sc.dqn.batch_size
        while replay.limiter.can_sample(batch):
            rows, slots, weights = await replay.sample(batch, beta_at(sc, self.sampler.env_steps))
            u0 = self.clock()
            prio, _ = self.learner.update(rows, weights)
            self.update_s += self.spent(TRAIN, u0)
            replay.update_priorities(slots, prio)
            curve.policy_lag.append(curve.versions - float(np.mean(rows["version"])))
            curve.updates += 1
            if curve.updates % sc.dqn.publish_every == 0:
                p0 = self.clock()
                self.publish()
                self.spent(SYNC, p0)

    async def learn_ppo(self) -> None:
        """Train on each ``ppo.chunks_per_batch`` chunks the queue holds, and publish after each batch."""
        queue, curve = self.store, self.curve
        k = self.sc.ppo.chunks_per_batch
        while len(queue) >= k:
            chunks = await queue.get_batch(k)
            self.taken.extend(chunk_key(c) for c in chunks)
            u0 = self.clock()
            figs = self.learner.learn(batch_columns(chunks), self.sampler.env_steps)
            self.update_s += self.spent(TRAIN, u0)
            curve.policy_lag.append(curve.versions - float(np.mean([c.version[0] for c in chunks])))
            curve.updates += figs["updates"]
            curve.chunks.trained_n(k)
            p0 = self.clock()
            queue.set_version(curve.versions + 1)  # first: the queue refuses a chunk newer than its version
            self.publish(figs)
            self.spent(SYNC, p0)

    def record(self) -> bool:
        """Evaluate the policy, the clock stopped; True if the run stops here (at its target)."""
        curve, sampler = self.curve, self.sampler
        curve.wall_s.append(self.clock())
        self.held.hold(time.perf_counter())
        score = self.evaluate(self.policy)
        self.held.end(time.perf_counter())
        curve.env_steps.append(sampler.env_steps)
        curve.eval_return.append(score)
        log.info("env steps %d: evaluation return %.1f (%d updates)", sampler.env_steps, score, curve.updates)
        if self.on_progress is not None:
            self.on_progress(PolicyEvaluated(curve.versions, curve.wall_s[-1], sampler.env_steps, score))
        return self.stop_at_target and score >= self.sc.env.target_return

    async def train(self, restored: bool) -> EnvCurve:
        """Sampler and learner in turns to the end (or the target), then the curve."""
        sc, sampler, store, curve = self.sc, self.sampler, self.store, self.curve
        learn = self.learn_ppo if self.ppo else self.learn_dqn
        try:
            if restored:
                # A stop can come mid-learning: what the store still owes the learner comes first, or
                # a rate limit that waits for those samples would hold the next insert for ever.
                await learn()
            while sampler.env_steps < sc.env.env_steps:
                c0 = self.clock()
                chunk = sampler.collect()
                c1 = c0 + self.spent(GENERATE, c0)
                curve.episodes += len(chunk.episode_returns)
                await store.insert_chunk(chunk)
                self.spent(SEND, c1)
                await learn()
                if sampler.env_steps >= self.next_eval:
                    self.next_eval += sc.env.eval_every
                    if self.record():
                        break
            else:
                if not curve.env_steps or curve.env_steps[-1] != sampler.env_steps:
                    self.record()  # the final policy, unless the last evaluation already saw it
        finally:
            sampler.close()  # on a stop or a crash the store stays as it is, for the resume
        return self.finish()

    def finish(self) -> EnvCurve:
        curve = self.curve
        curve.train_s = self.clock()
        curve.learner = {"update_s": self.update_s, "resumes": self.resumes}
        curve.spans = {ROW: self.timeline.spans[ROW]}
        if self.ppo:
            self.store.close()  # counts what is still queued as left at the end
        curve.replay = self.store.stats()
        curve.chunks, curve.chunks_in_flight = run_ledger(self.sc, self.sampler.chunks, curve.chunks, curve.replay)
        if self.every:  # the journal is the size of everything taken; the last checkpoint stays
            remove_owned(self.store_dir, JOURNAL_KIND)
        return self.curve
