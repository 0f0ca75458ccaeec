"""The env pipeline in sync mode: one thread alternates between the sampler and the learner.

Each turn the sampler collects one chunk and the replay takes its rows. The learner then
updates as long as the replay's rate limiter lets it sample, so samples per insert hold
exactly as they would between actors, and nothing waits. Every ``publish_every`` updates the
learner's weights go to the policy as a new version.

This is the baseline an async run is measured against, and with fixed seeds it is
deterministic: the same seeds give the same curve, on either backend of ``ext.replay``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from core.env.dqn import DQNLearner, EpsilonGreedy
from core.env.sampler import EnvSampler
from core.env.transition_replay import TransitionReplay

log = logging.getLogger(__name__)


@dataclass
class EnvCurve:
    """What a run learned, against env steps and wall-clock seconds."""

    env_steps: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    eval_return: list[float] = field(default_factory=list)
    updates: int = 0
    versions: int = 0
    policy_lag: list[float] = field(default_factory=list)
    """Per update: the learner's version minus the mean version of its minibatch's rows (a replay
    keeps rows of many versions, so this is the age of what the learner trains on)."""


async def run_sync(
    *,
    sampler: EnvSampler,
    policy: EpsilonGreedy,
    replay: TransitionReplay,
    learner: DQNLearner,
    env_steps: int,
    batch_size: int,
    beta_start: float,
    publish_every: int,
    eval_every: int,
    evaluate: Callable[[EpsilonGreedy], float],
    stop_at_return: Optional[float] = None,
) -> EnvCurve:
    """Train until ``env_steps`` (or an evaluation reaches ``stop_at_return``). ``evaluate(policy)``
    is called every ``eval_every`` env steps and at the end, with the policy's current weights."""
    curve = EnvCurve()
    t0 = time.perf_counter()
    next_eval = eval_every

    def record() -> float:
        score = float(evaluate(policy))
        curve.env_steps.append(sampler.env_steps)
        curve.wall_s.append(time.perf_counter() - t0)
        curve.eval_return.append(score)
        log.info("env steps %d: evaluation return %.1f (%d updates)", sampler.env_steps, score, curve.updates)
        return score

    while sampler.env_steps < env_steps:
        chunk = sampler.collect()
        if len(chunk):
            await replay.insert({**chunk.columns, "version": chunk.version})
        while replay.limiter.can_sample(batch_size):
            beta = beta_start + (1.0 - beta_start) * min(1.0, sampler.env_steps / env_steps)
            batch, slots, weights = await replay.sample(batch_size, beta)
            prio, _ = learner.update(batch, weights)
            replay.update_priorities(slots, prio)
            curve.policy_lag.append(curve.versions - float(np.mean(batch["version"])))
            curve.updates += 1
            if curve.updates % publish_every == 0:
                curve.versions += 1
                policy.set_weights(learner.weights(), curve.versions)
        if sampler.env_steps >= next_eval:
            next_eval += eval_every
            if record() >= (stop_at_return if stop_at_return is not None else np.inf):
                return curve
    record()
    return curve
