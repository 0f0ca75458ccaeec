"""Where the env pipeline's parts are built from a scenario: the one place, for every mode.

    dqn:  EnvSampler (envs + EpsilonGreedy, NStepRows) ── TransitionChunk ──► TransitionReplay (RateLimiter)
                ▲                                                               │ minibatch, IS weights
                └──────────── weights, one version per publish_every ◄── DQNLearner ◄┘ priorities back

    ppo:  EnvSampler (envs + StochasticPolicy, SegmentRows) ── TransitionChunk ──► SegmentQueue (version gate)
                ▲                                                                   │ chunks_per_batch chunks
                └──────────── weights, one version per batch ◄──────────── PPOLearner ◄┘ (V-trace, PPO epochs)

Sync mode runs these parts in one thread (``core/env/sync_loop.py``); async mode puts each in
its own Ray actor (``core/runtimes/ray_env.py``), built by the same functions here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import gymnasium as gym
import numpy as np

from core.env.dqn import DQNLearner, EpsilonGreedy
from core.env.ppo import ActorCritic, PPOLearner, StochasticPolicy
from core.env.rate_limiter import RateLimiter
from core.env.sampler import EnvSampler, NStepRows, SegmentRows
from core.env.segment_queue import SegmentQueue
from core.env.transition_replay import TransitionReplay
from core.model.env_config import EnvScenario

# Seeds of the parts of one run, apart so that no two draw the same random stream.
SAMPLER_SEED, EVAL_SEED = 1_000, 7_000
JOURNAL_KIND = "replay-journal"  # the stamp of a store's journal directory


@dataclass(frozen=True)
class EnvSpace:
    """What the networks need of an environment: its observation size and its actions."""

    obs_dim: int
    actions: int
    """Discrete: how many actions; continuous: the action vector's size."""
    discrete: bool


def env_space(sc: EnvScenario) -> EnvSpace:
    """The scenario's environment's spaces, refused here if its learner cannot act in them."""
    space = _spaces(sc.env.id)
    if sc.learner == "dqn" and not space.discrete:
        raise ValueError(f"env.id = {sc.env.id!r}: DQN needs discrete actions; fix: use learner: ppo for continuous ones")
    return space


@functools.lru_cache(maxsize=None)
def _spaces(env_id: str) -> EnvSpace:
    # Once per process: the policy, the learner and the replay's columns all ask, and each
    # answer would otherwise build and close an environment.
    env = gym.make(env_id)
    try:
        obs, act = env.observation_space, env.action_space
        if len(obs.shape) != 1:
            raise ValueError(f"env.id = {env_id!r}: the networks need a vector observation, got {obs}; fix: a vector-observation env")
        if isinstance(act, gym.spaces.Discrete):
            return EnvSpace(int(obs.shape[0]), int(act.n), True)
        if isinstance(act, gym.spaces.Box) and len(act.shape) == 1:
            return EnvSpace(int(obs.shape[0]), int(act.shape[0]), False)
        raise ValueError(f"env.id = {env_id!r}: needs discrete actions or a vector of continuous ones, got {act}; fix: another env")
    finally:
        env.close()


def make_policy(sc: EnvScenario, seed: int, sampler_id: int) -> Union[EpsilonGreedy, StochasticPolicy]:
    """A sampler's policy (weights follow from the learner); ``sampler_id`` seeds its exploration."""
    space = env_space(sc)
    policy_seed = seed * 7919 + SAMPLER_SEED + sampler_id
    if sc.learner == "ppo":
        p = sc.ppo
        return StochasticPolicy(ActorCritic(space.obs_dim, space.actions, space.discrete, p.hidden, p.log_std_init), policy_seed)
    d = sc.dqn
    return EpsilonGreedy(
        space.obs_dim, space.actions, d.hidden, eps_start=d.eps_start, eps_end=d.eps_end,
        eps_decay_steps=d.eps_decay_steps, seed=policy_seed,
    )


def make_sampler(sc: EnvScenario, seed: int, sampler_id: int, policy: Union[EpsilonGreedy, StochasticPolicy]) -> EnvSampler:
    e = sc.env
    rows = SegmentRows() if sc.learner == "ppo" else NStepRows(e.envs_per_sampler, (env_space(sc).obs_dim,), e.n_step, e.gamma)
    return EnvSampler(
        sampler_id=sampler_id, env_id=e.id, num_envs=e.envs_per_sampler, seed=seed * 7919 + sampler_id,
        policy=policy, rows=rows, send_every=e.send_every,
    )


def make_learner(sc: EnvScenario, seed: int) -> Union[DQNLearner, PPOLearner]:
    space = env_space(sc)
    if sc.learner == "ppo":
        return PPOLearner(space.obs_dim, space.actions, space.discrete, sc.ppo, gamma=sc.env.gamma,
                          total_env_steps=sc.env.env_steps, seed=seed)
    d = sc.dqn
    return DQNLearner(space.obs_dim, space.actions, d.hidden, lr=d.lr, target_every=d.target_every, grad_clip=d.grad_clip, seed=seed)


def make_queue(sc: EnvScenario, journal_dir: Optional[Path] = None) -> SegmentQueue:
    """PPO's intake: chunks in arrival order, each trained once, too-stale ones dropped;
    journaled in ``journal_dir`` (and rebuilt from it, if it holds a journal)."""
    return SegmentQueue(sc.ppo.queue_chunks, sc.ppo.max_staleness, journal_dir)


def replay_spec(sc: EnvScenario) -> dict[str, tuple]:
    """The replay's columns: a sampler chunk's rows and their versions."""
    obs_dim = env_space(sc).obs_dim
    return {
        "obs": ((obs_dim,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
        "next_obs": ((obs_dim,), np.float32), "discount": ((), np.float32), "logp": ((), np.float32),
        "version": ((), np.int64),
    }


def replay_args(sc: EnvScenario, seed: int, journal_dir: Optional[Path] = None) -> tuple[tuple, dict]:
    """The arguments of the scenario's ``TransitionReplay``: built here, constructed in process or
    in the replay actor; journaled in ``journal_dir`` (and rebuilt from it, if it holds a journal)."""
    r = sc.replay
    limiter = RateLimiter(r.samples_per_insert, r.min_size_to_sample, sc.error_buffer(), sc.max_chunk_rows(), sc.max_sample_rows())
    journal = str(Path(journal_dir) / "replay.journal") if journal_dir is not None else None
    return (r.capacity, replay_spec(sc)), {"limiter": limiter, "prioritized": r.prioritized, "alpha": r.alpha, "seed": seed,
                                           "journal": journal}


def make_replay(sc: EnvScenario, seed: int, journal_dir: Optional[Path] = None) -> TransitionReplay:
    args, kwargs = replay_args(sc, seed, journal_dir)
    return TransitionReplay(*args, **kwargs)


def learner_threads(sc: EnvScenario) -> int:
    """Torch threads of the learner, in either mode: what its actor reserves (``ray.learner.num_cpus``),
    at least one. Sync mode takes the same, so the two learners compute alike."""
    return max(1, int(sc.ray.learner.num_cpus))


def beta_at(sc: EnvScenario, env_steps: int) -> float:
    """PER's importance exponent: from ``replay.beta_start`` to 1 over the run's env steps."""
    b0 = sc.replay.beta_start
    return b0 + (1.0 - b0) * min(1.0, env_steps / sc.env.env_steps)
