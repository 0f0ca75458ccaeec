"""The env pipeline in sync mode: one thread alternates between the sampler and the learner.

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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from core.api import RunStopped
from core.env import learner_checkpoint
from core.env.evaluation import episode_returns
from core.env.held_time import HeldTime
from core.env.sampler import Policy
from core.env.segment_queue import SegmentQueue, batch_columns
from core.env.transition_replay import TransitionReplay
from core.env.learner_checkpoint import LEARNER_KIND
from core.env.wiring import (
    EVAL_SEED, JOURNAL_KIND, SAMPLER_SEED, beta_at, learner_threads, make_learner, make_policy, make_queue, make_replay, make_sampler,
)
from core.model.env_config import EnvScenario
from core.model.owned import keep_owned, remove_owned
from core.model.progress import PolicyEvaluated, ProgressFn, VersionPublished
from core.model.timeline import GENERATE, SEND, SYNC, TRAIN, Timeline
from core.store import checkpoint
from core.store.queue_journal import chunk_key

log = logging.getLogger(__name__)


@dataclass
class EnvCurve:
    """What a run learned, against env steps and wall-clock seconds, and what it cost."""

    env_steps: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    """When each evaluated policy existed: seconds of training before it, evaluations left out (sync
    mode stops its clock while it evaluates; async mode holds its actors, or with ``env.hold_for_eval``
    false evaluates beside training, timed when it took the newest weights)."""
    eval_return: list[float] = field(default_factory=list)
    updates: int = 0
    versions: int = 0
    """Weight versions published to the samplers."""
    policy_lag: list[float] = field(default_factory=list)
    """Per update: the learner's version minus the mean version of its minibatch's rows (a replay
    keeps rows of many versions, so this is the age of what the learner trains on)."""
    train_s: float = 0.0
    """Seconds the run trained (sync mode: without its evaluations)."""
    episodes: int = 0
    learner: dict = field(default_factory=dict)
    """Where the learner's time went: ``update_s`` in its own updates; in async mode also
    ``sample_wait_s``, waiting for a sample from the replay actor."""
    replay: dict = field(default_factory=dict)
    """The store's counters at the end: the DQN replay's (rows in, sampled, evicted unsampled,
    blocked time per side) or the PPO queue's (chunks delivered, dropped stale, left at the end)."""
    produced_chunks: int = 0
    """Chunks the samplers sent: each must be in the store's counts (the ledger's identity)."""
    trained_chunks: int = 0
    """PPO: chunks trained (each once)."""
    dropped_at_learner: int = 0
    """PPO: chunks the learner took and found too stale to train (async mode)."""
    evaluations_lost: int = 0
    """Async mode: evaluations whose weights died with a learner before they were read (the
    learner restarted; its next evaluation runs as usual)."""
    faults: dict = field(default_factory=dict)
    """Async mode with faults: ``faults/*`` figures (injected, recovered, recovery times) and the records."""
    spans: dict = field(default_factory=dict)
    """Who did what when, on the training clock: ``(kind, start, end)`` per actor (sync mode: its
    one loop), ``core/model/timeline.py``'s kinds. Not checkpointed: a resumed run's start at its resume."""

    def first_reaching(self, target: float) -> Optional[int]:
        """Index of the first evaluation at or above ``target``."""
        return next((i for i, r in enumerate(self.eval_return) if r >= target), None)


def greedy_return(sc: EnvScenario, seed: int) -> Callable[[Policy], float]:
    """Mean return of ``env.eval_episodes`` episodes, acting greedily."""
    return lambda policy: float(episode_returns(policy.greedy, sc.env.id, sc.env.eval_episodes, seed * 7919 + EVAL_SEED).mean())


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
    evaluate = evaluate or greedy_return(sc, seed)
    torch.set_num_threads(learner_threads(sc))
    every = sc.checkpoint.every if run_dir is not None else 0
    ppo = sc.learner == "ppo"
    ckpt_dir = Path(run_dir) / "checkpoints" if every else None
    store_dir = Path(run_dir) / "store" if every else None
    if every and checkpoint.latest(ckpt_dir) is None:
        remove_owned(store_dir, JOURNAL_KIND)  # stopped before its first checkpoint, if at all: start again
    if every:
        keep_owned(ckpt_dir, LEARNER_KIND)
        keep_owned(store_dir, JOURNAL_KIND)
    policy = make_policy(sc, seed, 0)
    sampler = make_sampler(sc, seed, 0, policy)
    store = make_queue(sc, store_dir) if ppo else make_replay(sc, seed, store_dir)
    learner = make_learner(sc, seed)
    curve = EnvCurve()
    next_eval = sc.env.eval_every
    update_s = 0.0
    resumes = 0
    taken: list[int] = []  # PPO: keys of chunks taken since the last checkpoint
    restored = learner_checkpoint.load(ckpt_dir, learner, every) if every else None
    if restored is not None:
        version, st, arrays = restored
        curve = curve_from_state(st["curve"], arrays)
        curve.versions = version
        next_eval, update_s, resumes = st["next_eval"], st["update_s"], st["resumes"] + 1
        seq, env_steps = await store.resume_point(0)
        sampler.resume(seq, env_steps, seed=seed * 7919 + SAMPLER_SEED + RESUMED_SEED * resumes)
        if ppo:
            store.rejoin(arrays["taken"].tolist(), [])
            store.set_version(version)
        log.info("resumed from version %d at %d env steps", st["version"], env_steps)
        if stop_at_version is not None and version >= stop_at_version:
            stop_at_version = None  # already past it: go on to the end
    policy.set_weights(learner.weights(), curve.versions)
    t0 = time.perf_counter() - curve.train_s
    held = HeldTime()  # evaluations are measurement, not training: the clock stops while they run
    timeline = Timeline()
    clock = lambda: held.running(t0, time.perf_counter())  # noqa: E731  the training clock

    def spent(kind: str, since: float) -> float:
        now = clock()
        timeline.add(ROW, kind, since, now)
        return now - since

    def publish(figures: Optional[dict] = None) -> None:
        curve.versions += 1
        stop = stop_at_version is not None and curve.versions >= stop_at_version
        if stop or (every and curve.versions % every == 0):
            curve.train_s = clock()
            curve.learner = {"update_s": update_s}
            scalars, arrays = curve_state(curve)
            arrays["taken"] = np.asarray(taken, np.int64)
            learner_checkpoint.save(ckpt_dir, curve.versions, learner, {
                "curve": scalars, "next_eval": next_eval, "update_s": update_s, "resumes": resumes}, arrays, last=stop)
            if ppo:
                store.ack(taken)
                taken.clear()
        if on_progress is not None:
            on_progress(VersionPublished(curve.versions, clock(), sampler.env_steps, curve.updates, figures or {}))
        if stop:
            raise RunStopped(f"stopped after learner version {curve.versions}")
        policy.set_weights(learner.weights(), curve.versions)

    async def learn_dqn(replay: TransitionReplay) -> None:
        nonlocal update_s
        batch = sc.dqn.batch_size
        while replay.limiter.can_sample(batch):
            rows, slots, weights = await replay.sample(batch, beta_at(sc, sampler.env_steps))
            u0 = clock()
            prio, _ = learner.update(rows, weights)
            update_s += spent(TRAIN, u0)
            replay.update_priorities(slots, prio)
            curve.policy_lag.append(curve.versions - float(np.mean(rows["version"])))
            curve.updates += 1
            if curve.updates % sc.dqn.publish_every == 0:
                p0 = clock()
                publish()
                spent(SYNC, p0)

    async def learn_ppo(queue: SegmentQueue) -> None:
        nonlocal update_s
        k = sc.ppo.chunks_per_batch
        while len(queue) >= k:
            chunks = await queue.get_batch(k)
            taken.extend(chunk_key(c) for c in chunks)
            u0 = clock()
            figs = learner.learn(batch_columns(chunks), sampler.env_steps)
            update_s += spent(TRAIN, u0)
            curve.policy_lag.append(curve.versions - float(np.mean([c.version[0] for c in chunks])))
            curve.updates += figs["updates"]
            curve.trained_chunks += k
            p0 = clock()
            queue.set_version(curve.versions + 1)  # first: the queue refuses a chunk newer than its version
            publish(figs)
            spent(SYNC, p0)

    def record() -> bool:
        curve.wall_s.append(clock())
        held.hold(time.perf_counter())
        score = evaluate(policy)
        held.end(time.perf_counter())
        curve.env_steps.append(sampler.env_steps)
        curve.eval_return.append(score)
        log.info("env steps %d: evaluation return %.1f (%d updates)", sampler.env_steps, score, curve.updates)
        if on_progress is not None:
            on_progress(PolicyEvaluated(curve.versions, curve.wall_s[-1], sampler.env_steps, score))
        return stop_at_target and score >= sc.env.target_return

    learn = learn_ppo if ppo else learn_dqn
    try:
        if restored is not None:
            # A stop can come mid-learning: what the store still owes the learner comes first, or
            # a rate limit that waits for those samples would hold the next insert for ever.
            await learn(store)
        while sampler.env_steps < sc.env.env_steps:
            c0 = clock()
            chunk = sampler.collect()
            c1 = c0 + spent(GENERATE, c0)
            curve.episodes += len(chunk.episode_returns)
            await store.insert_chunk(chunk)
            spent(SEND, c1)
            await learn(store)
            if sampler.env_steps >= next_eval:
                next_eval += sc.env.eval_every
                if record():
                    break
        else:
            if not curve.env_steps or curve.env_steps[-1] != sampler.env_steps:
                record()  # the final policy, unless the last evaluation already saw it
    finally:
        sampler.close()  # on a stop or a crash the store stays as it is, for the resume
    curve.train_s = clock()
    curve.learner = {"update_s": update_s, "resumes": resumes}
    curve.spans = {ROW: timeline.spans[ROW]}
    if ppo:
        store.close()  # counts what is still queued as left at the end
    curve.replay = store.stats()
    curve.produced_chunks = sampler.chunks
    if every:  # the journal is the size of everything taken; the last checkpoint stays
        remove_owned(store_dir, JOURNAL_KIND)
    return curve


# Sampler seeds after a resume: far from those the run started with.
RESUMED_SEED = 104_729
ROW = "sync loop"  # the timeline's one row: sampler and learner take turns on it


def curve_state(curve: EnvCurve) -> tuple[dict, dict[str, np.ndarray]]:
    """A curve as a checkpoint holds it: its lists as arrays, the rest as they are."""
    scalars, arrays = {}, {}
    for f in fields(curve):
        if f.name == "spans":
            continue
        v = getattr(curve, f.name)
        if isinstance(v, list):
            arrays[f"curve.{f.name}"] = np.asarray(v, np.float64)
        else:
            scalars[f.name] = v
    return scalars, arrays


def curve_from_state(scalars: dict, arrays: dict[str, np.ndarray]) -> EnvCurve:
    lists = {f.name: arrays[f"curve.{f.name}"].tolist() for f in fields(EnvCurve) if f"curve.{f.name}" in arrays}
    lists["env_steps"] = [int(x) for x in lists.get("env_steps", [])]
    return EnvCurve(**scalars, **lists)
