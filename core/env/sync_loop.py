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
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from core.env.evaluation import episode_returns
from core.env.sampler import Policy
from core.env.segment_queue import SegmentQueue, batch_columns
from core.env.transition_replay import TransitionReplay
from core.env.wiring import (
    EVAL_SEED, beta_at, learner_threads, make_learner, make_policy, make_queue, make_replay, make_sampler,
)
from core.model.env_config import EnvScenario

log = logging.getLogger(__name__)


@dataclass
class EnvCurve:
    """What a run learned, against env steps and wall-clock seconds, and what it cost."""

    env_steps: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    """When each evaluated policy existed: seconds of training before it (sync mode stops its clock
    while it evaluates; async mode evaluates beside training, timed when it took the newest weights)."""
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

    def first_reaching(self, target: float) -> Optional[int]:
        """Index of the first evaluation at or above ``target``."""
        return next((i for i, r in enumerate(self.eval_return) if r >= target), None)


def greedy_return(sc: EnvScenario, seed: int) -> Callable[[Policy], float]:
    """Mean return of ``env.eval_episodes`` episodes, acting greedily."""
    return lambda policy: float(episode_returns(policy.greedy, sc.env.id, sc.env.eval_episodes, seed * 7919 + EVAL_SEED).mean())


async def run_sync(
    sc: EnvScenario, seed: int, *, evaluate: Optional[Callable[[Policy], float]] = None,
    stop_at_target: bool = True,
) -> EnvCurve:
    """Train for ``env.env_steps`` (or until an evaluation reaches ``env.target_return``, with
    ``stop_at_target``). Evaluations run every ``env.eval_every`` env steps and at the end."""
    evaluate = evaluate or greedy_return(sc, seed)
    torch.set_num_threads(learner_threads(sc))
    policy = make_policy(sc, seed, 0)
    sampler = make_sampler(sc, seed, 0, policy)
    store = make_queue(sc) if sc.learner == "ppo" else make_replay(sc, seed)
    learner = make_learner(sc, seed)
    policy.set_weights(learner.weights(), 0)
    curve = EnvCurve()
    t0 = time.perf_counter()
    next_eval = sc.env.eval_every
    eval_s = 0.0  # evaluations are measurement, not training: the clock stops while they run
    update_s = 0.0

    def publish() -> None:
        curve.versions += 1
        policy.set_weights(learner.weights(), curve.versions)

    async def learn_dqn(replay: TransitionReplay) -> None:
        nonlocal update_s
        batch = sc.dqn.batch_size
        while replay.limiter.can_sample(batch):
            rows, slots, weights = await replay.sample(batch, beta_at(sc, sampler.env_steps))
            u0 = time.perf_counter()
            prio, _ = learner.update(rows, weights)
            update_s += time.perf_counter() - u0
            replay.update_priorities(slots, prio)
            curve.policy_lag.append(curve.versions - float(np.mean(rows["version"])))
            curve.updates += 1
            if curve.updates % sc.dqn.publish_every == 0:
                publish()

    async def learn_ppo(queue: SegmentQueue) -> None:
        nonlocal update_s
        k = sc.ppo.chunks_per_batch
        while len(queue) >= k:
            chunks = await queue.get_batch(k)
            u0 = time.perf_counter()
            figs = learner.learn(batch_columns(chunks), sampler.env_steps)
            update_s += time.perf_counter() - u0
            curve.policy_lag.append(curve.versions - float(np.mean([c.version[0] for c in chunks])))
            curve.updates += figs["updates"]
            curve.trained_chunks += k
            publish()
            queue.set_version(curve.versions)

    def record() -> bool:
        nonlocal eval_s
        start = time.perf_counter()
        score = evaluate(policy)
        curve.env_steps.append(sampler.env_steps)
        curve.wall_s.append(start - t0 - eval_s)
        eval_s += time.perf_counter() - start
        curve.eval_return.append(score)
        log.info("env steps %d: evaluation return %.1f (%d updates)", sampler.env_steps, score, curve.updates)
        return stop_at_target and score >= sc.env.target_return

    try:
        while sampler.env_steps < sc.env.env_steps:
            chunk = sampler.collect()
            curve.episodes += len(chunk.episode_returns)
            await store.insert_chunk(chunk)
            await (learn_ppo(store) if isinstance(store, SegmentQueue) else learn_dqn(store))
            if sampler.env_steps >= next_eval:
                next_eval += sc.env.eval_every
                if record():
                    return curve
        if not curve.env_steps or curve.env_steps[-1] != sampler.env_steps:
            record()  # the final policy, unless the last evaluation already saw it
        return curve
    finally:
        curve.train_s = time.perf_counter() - t0 - eval_s
        curve.learner = {"update_s": update_s}
        if isinstance(store, SegmentQueue):
            store.close()  # counts what is still queued as left at the end
        curve.replay = store.stats()
        curve.produced_chunks = sampler.chunks
        sampler.close()
