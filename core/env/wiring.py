"""Where the env pipeline's parts are built from a scenario: the one place, for every mode.

    dqn:  EnvSampler (envs + EpsilonGreedy, NStepRows) ── TransitionChunk ──► TransitionReplay (RateLimiter)
                ▲                                                               │ minibatch, IS weights
                └──────────── weights, one version per publish_every ◄── DQNLearner ◄┘ priorities back

    ppo:  EnvSampler (envs + StochasticPolicy, SegmentRows) ── TransitionChunk ──► SegmentQueue (version gate)
                ▲                                                                   │ chunks_per_batch chunks
                └──────────── weights, one version per batch ◄──────────── PPOLearner ◄┘ (V-trace, PPO epochs)

Sync mode runs these parts in one thread (``core/runtimes/local_env.py``); async mode puts each in
its own Ray actor (``core/runtimes/ray_env.py``), built by the same functions here.
"""

from __future__ import annotations

import contextlib

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import gymnasium as gym
import numpy as np
import torch

from core.env.dqn import DQNLearner, EpsilonGreedy
from core.env.ppo import ActorCritic, PPOLearner, StochasticPolicy
from core.env.rate_limiter import RateLimiter
from core.env.sampler import EnvSampler, NStepRows, SegmentRows
from core.env.segment_queue import SegmentQueue
from core.env.transition_replay import TransitionReplay
from core.model.config import ConfigError, shown
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
    obs_itemsize: int = 4
    """Bytes of one observation number as the environment returns it (its Box's dtype)."""
    max_episode_steps: Optional[int] = None
    """The id's time limit (its registered ``max_episode_steps``); None: episodes have none."""


OBS_TAKEN = "a Box of one dimension (a vector of numbers: the networks are MLPs, the replay stores it as a column)"
ACTIONS_TAKEN = "Discrete(n) from 0, or for PPO a Box of one dimension of floats"


def env_space(sc: EnvScenario) -> EnvSpace:
    """The scenario's environment's spaces, refused here if its learner cannot act in them."""
    space = _spaces(sc.env.id)
    if sc.learner == "dqn" and not space.discrete:
        raise ConfigError("env.id", sc.env.id, "DQN needs discrete actions",
                          f"use learner: ppo for continuous ones (its actions are a vector of {space.actions} float{'s' if space.actions > 1 else ''})")
    limit, n = space.max_episode_steps, sc.env.n_step
    if sc.learner == "dqn" and limit is not None and n > limit:
        # Such rows equal those of n_step = limit, while the rate limit's band, sized for a chunk
        # that releases every row still pending, grows with n_step until the learner runs for hours alone.
        raise ConfigError(
            "env.n_step", n, f"the episodes of {shown(sc.env.id)} end by step {limit:,} (its time limit), so every row past "
            f"{limit:,} steps already sums to its episode's end, and the rate limit, sized for chunks of up to "
            f"{sc.max_chunk_rows():,} rows, would let the learner take {int(sc.band_needed() // sc.dqn.batch_size):,} "
            "updates between two chunks", f"use at most {limit:,} (Ape-X uses 3)",
        )
    return space


def describe_space(space: gym.Space) -> str:
    """A space in a few words, never its bounds: what an error line shows of it."""
    kind = type(space).__name__
    if isinstance(space, gym.spaces.Box):
        return f"a Box of shape {space.shape} ({space.dtype})"
    if isinstance(space, gym.spaces.Discrete):
        return f"Discrete({int(space.n)}" + (f", start={int(space.start)})" if int(space.start) else ")")
    if isinstance(space, (gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        return f"a {kind} of shape {tuple(space.shape)}"
    if isinstance(space, gym.spaces.Tuple):
        parts = [type(s).__name__ for s in space.spaces]
        return f"a Tuple of {len(parts)} spaces ({shown(parts)[1:-1]})"
    if isinstance(space, gym.spaces.Dict):
        return f"a Dict of {len(space.spaces)} spaces (keys {shown(list(space.spaces))[1:-1]})"
    return f"a {kind}"


@functools.lru_cache(maxsize=None)
def _spaces(env_id: str) -> EnvSpace:
    # Once per process: the policy, the learner and the replay's columns all ask, and each
    # answer would otherwise build and close an environment.
    env = gym.make(env_id)
    try:
        obs, act = env.observation_space, env.action_space
        limit = env.spec.max_episode_steps if env.spec is not None else None
    finally:
        env.close()
    if not (isinstance(obs, gym.spaces.Box) and len(obs.shape) == 1 and obs.shape[0] >= 1):
        raise ConfigError("env.id", env_id, f"its observation space is {describe_space(obs)}, and the pipeline takes {OBS_TAKEN}",
                          "register an id that wraps the env in gymnasium.wrappers.FlattenObservation, or use a vector-observation env")
    if isinstance(act, gym.spaces.Discrete) and int(act.start) == 0:
        return EnvSpace(int(obs.shape[0]), int(act.n), True, obs.dtype.itemsize, limit)
    if isinstance(act, gym.spaces.Box) and len(act.shape) == 1 and act.shape[0] >= 1 and np.issubdtype(act.dtype, np.floating):
        return EnvSpace(int(obs.shape[0]), int(act.shape[0]), False, obs.dtype.itemsize, limit)
    raise ConfigError("env.id", env_id, f"its action space is {describe_space(act)}, and the samplers act in {ACTIONS_TAKEN}",
                      "register an id that wraps the env to take such actions, or use another env")


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
    return replay_columns(env_space(sc).obs_dim)


def replay_columns(obs_dim: int) -> dict[str, tuple]:
    """``replay_spec`` for an observation of ``obs_dim`` numbers."""
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


@contextlib.contextmanager
def learner_process(sc: EnvScenario) -> Iterator[None]:
    """While a learner runs: ``learner_threads`` torch threads, and denormal floats flushed to
    zero on this thread. Adam's first moment of a weight whose gradient stays zero (a dead ReLU
    unit) decays through the denormal range, where each multiply costs ~100x; on CartPole DQN
    that was 40 % of the 256x256 layer's moments, and Adam's step took 5x its time. Values below
    1.2e-38 change no weight: Adam divides them by at least its eps.

    The flush is the thread's floating-point state, which everything else on it shares (a
    sync run's caller, numpy, hypothesis): it is put back as it was when the block ends. A
    process asyncrl owns for the learner alone (the Ray actor) enters the block for its life."""
    torch.set_num_threads(learner_threads(sc))
    was = _flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if not was:
            torch.set_flush_denormal(False)


def _flushing_denormals() -> bool:
    # torch can set the flag but not read it: a denormal that comes out zero says it is set.
    return float(torch.tensor([1e-40], dtype=torch.float32).mul_(2.0)) == 0.0


def beta_at(sc: EnvScenario, env_steps: int) -> float:
    """PER's importance exponent: from ``replay.beta_start`` to 1 over the run's env steps."""
    b0 = sc.replay.beta_start
    return b0 + (1.0 - b0) * min(1.0, env_steps / sc.env.env_steps)
