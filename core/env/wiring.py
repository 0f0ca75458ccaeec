"""Where the env pipeline's parts are built from a scenario: the one place, for every mode.

    EnvSampler (gymnasium envs + EpsilonGreedy) ── TransitionChunk ──► TransitionReplay (RateLimiter)
          ▲                                                               │ minibatch, IS weights
          └──────────── weights, one version per publish_every ◄── DQNLearner ◄┘ priorities back

Sync mode runs these parts in one thread (``core/env/sync_loop.py``); async mode puts each in
its own Ray actor (``core/runtimes/ray_env.py``), built by the same functions here.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np

from core.env.dqn import DQNLearner, EpsilonGreedy
from core.env.rate_limiter import RateLimiter
from core.env.sampler import EnvSampler
from core.env.transition_replay import TransitionReplay
from core.model.env_config import EnvScenario

# Seeds of the parts of one run, apart so that no two draw the same random stream.
SAMPLER_SEED, EVAL_SEED = 1_000, 7_000


def env_shape(sc: EnvScenario) -> tuple[int, int]:
    """(observation size, number of actions) of the scenario's environment."""
    return _spaces(sc.env.id)


@functools.lru_cache(maxsize=None)
def _spaces(env_id: str) -> tuple[int, int]:
    # Once per process: the policy, the learner and the replay's columns all ask, and each
    # answer would otherwise build and close an environment.
    env = gym.make(env_id)
    try:
        obs, act = env.observation_space, env.action_space
        if not isinstance(act, gym.spaces.Discrete) or len(obs.shape) != 1:
            raise ValueError(f"env.id {env_id!r}: DQN needs a vector observation and discrete actions, got {obs} and {act}")
        return int(obs.shape[0]), int(act.n)
    finally:
        env.close()


def make_policy(sc: EnvScenario, seed: int, sampler_id: int) -> EpsilonGreedy:
    obs_dim, n_actions = env_shape(sc)
    d = sc.dqn
    return EpsilonGreedy(
        obs_dim, n_actions, d.hidden, eps_start=d.eps_start, eps_end=d.eps_end,
        eps_decay_steps=d.eps_decay_steps, seed=seed * 7919 + SAMPLER_SEED + sampler_id,
    )


def make_sampler(sc: EnvScenario, seed: int, sampler_id: int, policy: EpsilonGreedy) -> EnvSampler:
    e = sc.env
    return EnvSampler(
        sampler_id=sampler_id, env_id=e.id, num_envs=e.envs_per_sampler, seed=seed * 7919 + sampler_id,
        policy=policy, n_step=e.n_step, gamma=e.gamma, send_every=e.send_every,
    )


def make_learner(sc: EnvScenario, seed: int) -> DQNLearner:
    obs_dim, n_actions = env_shape(sc)
    d = sc.dqn
    return DQNLearner(obs_dim, n_actions, d.hidden, lr=d.lr, target_every=d.target_every, grad_clip=d.grad_clip, seed=seed)


def replay_spec(sc: EnvScenario) -> dict[str, tuple]:
    """The replay's columns: a sampler chunk's rows and their versions."""
    obs_dim, _ = env_shape(sc)
    return {
        "obs": ((obs_dim,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
        "next_obs": ((obs_dim,), np.float32), "discount": ((), np.float32), "logp": ((), np.float32),
        "version": ((), np.int64),
    }


def replay_args(sc: EnvScenario, seed: int) -> tuple[tuple, dict]:
    """The arguments of the scenario's ``TransitionReplay``: built here, constructed in process or
    in the replay actor."""
    r = sc.replay
    limiter = RateLimiter(r.samples_per_insert, r.min_size_to_sample, sc.error_buffer(), sc.max_chunk_rows(), sc.max_sample_rows())
    return (r.capacity, replay_spec(sc)), {"limiter": limiter, "prioritized": r.prioritized, "alpha": r.alpha, "seed": seed}


def make_replay(sc: EnvScenario, seed: int) -> TransitionReplay:
    args, kwargs = replay_args(sc, seed)
    return TransitionReplay(*args, **kwargs)


def learner_threads(sc: EnvScenario) -> int:
    """Torch threads of the learner, in either mode: what its actor reserves (``ray.learner.num_cpus``),
    at least one. Sync mode takes the same, so the two learners compute alike."""
    return max(1, int(sc.ray.learner.num_cpus))


def beta_at(sc: EnvScenario, env_steps: int) -> float:
    """PER's importance exponent: from ``replay.beta_start`` to 1 over the run's env steps."""
    b0 = sc.replay.beta_start
    return b0 + (1.0 - b0) * min(1.0, env_steps / sc.env.env_steps)
