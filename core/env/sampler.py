"""The sampler of the env pipeline: gymnasium vector environments stepped by the policy on CPU.

Each ``collect`` steps every environment ``send_every`` times and returns one
``TransitionChunk``. What a row of the chunk is depends on the learner:

- ``NStepRows`` (DQN): one row per step, n-step returns as an Ape-X style learner trains on.
  The sums are made here, beside the environments, because only here are a row's next n
  rewards known without another round trip:

      reward   = r_t + g r_{t+1} + ... + g^(k-1) r_{t+k-1}      k = n, or fewer if the episode ended
      next_obs = the observation after those k steps
      discount = g^k, or 0 if the episode terminated (nothing to bootstrap from)

  Rows still waiting for their n steps at the end of a chunk go out with a later one, so the
  chunk's ``env_steps`` and its rows differ by at most n - 1 per environment.
- ``SegmentRows`` (PPO): one row per environment, its ``send_every`` steps in order, as an
  on-policy learner computes returns along them.

A time-limit truncation is not a termination: its rows bootstrap from the final observation,
which gymnasium's same-step autoreset hands over in ``info["final_obs"]``.

Every row carries the version of the weights that chose its actions (a sampler takes new
weights only between chunks, so one version per chunk) and the behaviour policy's
log-probability of each action, for the learner's off-policy correction.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Protocol

import gymnasium as gym
import numpy as np

from core.model.transition_wire import TransitionChunk


class Policy(Protocol):
    """What a sampler acts with; its weights arrive from the learner."""

    version: int

    def act(self, obs: np.ndarray, env_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """(actions, behaviour log-probs) for a batch of observations; ``env_steps`` so far, for
        schedules such as epsilon's."""

    def set_weights(self, weights: dict[str, np.ndarray], version: int) -> None: ...


class Rows(Protocol):
    """Turns the steps of a chunk into its rows."""

    def step(self, obs: np.ndarray, actions: np.ndarray, rew: np.ndarray, term: np.ndarray, trunc: np.ndarray,
             next_obs: np.ndarray, logp: np.ndarray, version: int) -> None:
        """One vector step; ``next_obs`` is each env's observation after it (the final one where an
        episode ended); ``version`` the policy's that acted."""

    def take(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows completed since the last take, as columns, and each row's version."""


class NStepRows:
    """n-step rows, one per step, in the order their n steps completed."""

    def __init__(self, num_envs: int, obs_shape: tuple[int, ...], n_step: int, gamma: float) -> None:
        if n_step < 1:
            raise ValueError(f"n_step={n_step}: must be >= 1")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma={gamma}: must be in [0, 1]")
        self.n_step, self.gamma, self.obs_shape = n_step, gamma, obs_shape
        # Per environment, the steps whose n-step row is not complete yet: (obs, action, reward, logp, version).
        self._pending: list[deque] = [deque() for _ in range(num_envs)]
        self._rows: list[tuple] = []

    def step(self, obs, actions, rew, term, trunc, next_obs, logp, version) -> None:
        for i, q in enumerate(self._pending):
            q.append((obs[i], actions[i], float(rew[i]), float(logp[i]), version))
            if term[i] or trunc[i]:
                m = len(q)
                for j in range(m):
                    self._rows.append(self._row(q, j, next_obs[i], 0.0 if term[i] else self.gamma ** (m - j)))
                q.clear()
            elif len(q) == self.n_step:
                self._rows.append(self._row(q, 0, next_obs[i], self.gamma ** self.n_step))
                q.popleft()

    def _row(self, q: deque, j: int, next_obs: np.ndarray, discount: float) -> tuple:
        obs, action, _, logp, version = q[j]
        ret = 0.0
        for k in range(j, len(q)):
            ret += self.gamma ** (k - j) * q[k][2]
        return obs, action, ret, next_obs, discount, logp, version

    def take(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        rows, self._rows = self._rows, []
        n, shape = len(rows), self.obs_shape
        return {
            "obs": np.array([r[0] for r in rows], dtype=np.float32).reshape((n, *shape)),
            "action": np.array([r[1] for r in rows], dtype=np.int64),
            "reward": np.array([r[2] for r in rows], dtype=np.float32),
            "next_obs": np.array([r[3] for r in rows], dtype=np.float32).reshape((n, *shape)),
            "discount": np.array([r[4] for r in rows], dtype=np.float32),
            "logp": np.array([r[5] for r in rows], dtype=np.float32),
        }, np.array([r[6] for r in rows], dtype=np.int64)


class SegmentRows:
    """One row per environment: its steps of the chunk, shaped (envs, steps, ...)."""

    def __init__(self) -> None:
        self._steps: list[tuple] = []
        self._version = 0

    def step(self, obs, actions, rew, term, trunc, next_obs, logp, version) -> None:
        self._steps.append((obs, actions, rew, term, np.logical_or(term, trunc), next_obs, logp))
        self._version = version  # one per chunk: a sampler takes weights only between chunks

    def take(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        steps, self._steps = self._steps, []
        col = lambda k, dt: np.ascontiguousarray(np.stack([s[k] for s in steps], axis=1), dtype=dt)  # noqa: E731
        return {
            "obs": col(0, np.float32), "action": np.ascontiguousarray(np.stack([s[1] for s in steps], axis=1)),
            "reward": col(2, np.float32), "terminated": col(3, np.float32), "ended": col(4, np.float32),
            "next_obs": col(5, np.float32), "logp": col(6, np.float32),
        }, np.full(len(steps[0][0]) if steps else 0, self._version, dtype=np.int64)


class EnvSampler:
    """``num_envs`` copies of one gymnasium environment, stepped together."""

    def __init__(
        self,
        *,
        sampler_id: int,
        env_id: str,
        num_envs: int,
        seed: int,
        policy: Policy,
        rows: Rows,
        send_every: int,
    ) -> None:
        if send_every < 1 or num_envs < 1:
            raise ValueError(f"send_every={send_every}, num_envs={num_envs}: each must be >= 1")
        self.sampler_id = sampler_id
        self.envs = gym.make_vec(
            env_id, num_envs=num_envs, vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
        self.envs.action_space.seed(seed)
        space = self.envs.single_action_space
        # Continuous actions are stored as the policy drew them (their log-prob is of that
        # value) and clipped only on their way into the environment.
        self._bounds: Optional[tuple[np.ndarray, np.ndarray]] = (
            (space.low, space.high) if isinstance(space, gym.spaces.Box) else None
        )
        self.obs, _ = self.envs.reset(seed=seed)
        self.policy = policy
        self.rows = rows
        self.send_every = send_every
        self.num_envs = num_envs
        self.env_steps = 0
        self.chunks = 0
        self._ep_return = np.zeros(num_envs, np.float64)
        self._ep_len = np.zeros(num_envs, np.int64)

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return tuple(self.envs.single_observation_space.shape)

    def collect(self) -> TransitionChunk:
        ep_returns: list[float] = []
        ep_lengths: list[int] = []
        steps0 = self.env_steps
        version = self.policy.version
        for _ in range(self.send_every):
            actions, logp = self.policy.act(self.obs, self.env_steps)
            to_env = actions if self._bounds is None else np.clip(actions, *self._bounds)
            nxt, rew, term, trunc, info = self.envs.step(to_env)
            self.env_steps += self.num_envs
            self._ep_return += rew
            self._ep_len += 1
            done = np.logical_or(term, trunc)
            after = nxt
            if done.any():
                after = nxt.copy()
                for i in np.flatnonzero(done):
                    after[i] = info["final_obs"][i]
                    ep_returns.append(float(self._ep_return[i]))
                    ep_lengths.append(int(self._ep_len[i]))
                    self._ep_return[i] = 0.0
                    self._ep_len[i] = 0
            self.rows.step(self.obs, actions, rew, term, trunc, after, logp, version)
            self.obs = nxt
        cols, versions = self.rows.take()
        chunk = TransitionChunk(
            sampler=self.sampler_id,
            seq=self.chunks,
            columns=cols,
            version=versions,
            env_steps=self.env_steps - steps0,
            episode_returns=np.array(ep_returns, dtype=np.float64),
            episode_lengths=np.array(ep_lengths, dtype=np.int64),
        )
        self.chunks += 1
        return chunk

    def resume(self, seq: int, env_steps: int, seed: int) -> None:
        """Go on as a restarted sampler: its next chunk is ``seq``, ``env_steps`` are behind it
        (schedules such as epsilon's continue from there), and its environments start new
        episodes from ``seed`` (the episodes it was in died with its process)."""
        self.chunks, self.env_steps = seq, env_steps
        self.obs, _ = self.envs.reset(seed=seed)
        self.envs.action_space.seed(seed)
        self._ep_return[:] = 0.0
        self._ep_len[:] = 0

    def close(self) -> None:
        self.envs.close()
