"""Evaluation of an env policy: whole episodes, acted without exploration.

Each of ``episodes`` environments plays exactly one episode, and the returns of all of them
are reported. Stopping after the first ``episodes`` episodes of fewer environments would
favour the short ones, since they end first.
"""

from __future__ import annotations

from typing import Callable

import gymnasium as gym
import numpy as np

from core.env.sampler import Policy
from core.env.wiring import EVAL_SEED
from core.model.env_config import EnvScenario


def episode_returns(act: Callable[[np.ndarray], np.ndarray], env_id: str, episodes: int, seed: int) -> np.ndarray:
    """The return of one episode in each of ``episodes`` environments; ``act(obs) -> actions``."""
    if episodes < 1:
        raise ValueError(f"episodes={episodes}: must be >= 1")
    envs = gym.make_vec(
        env_id, num_envs=episodes, vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    try:
        obs, _ = envs.reset(seed=seed)
        returns = np.zeros(episodes, np.float64)
        running = np.ones(episodes, bool)
        while running.any():
            obs, rew, term, trunc, _ = envs.step(act(obs))
            returns += np.where(running, rew, 0.0)
            running &= ~(term | trunc)
        return returns
    finally:
        envs.close()


def greedy_return(sc: EnvScenario, seed: int) -> Callable[[Policy], float]:
    """Mean return of ``env.eval_episodes`` episodes, acting greedily."""
    return lambda policy: float(episode_returns(policy.greedy, sc.env.id, sc.env.eval_episodes, seed * 7919 + EVAL_SEED).mean())
