"""The sampler of the env pipeline: gymnasium vector environments stepped by the policy on CPU.

Each ``collect`` steps every environment ``send_every`` times and returns one
``TransitionChunk`` of n-step rows, the form an Ape-X style learner trains on. The n-step sums
are made here, beside the environments, because only here are a row's next n rewards known
without another round trip:

    reward   = r_t + g r_{t+1} + ... + g^(k-1) r_{t+k-1}      k = n, or fewer if the episode ended
    next_obs = the observation after those k steps
    discount = g^k, or 0 if the episode terminated (nothing to bootstrap from)

A time-limit truncation is not a termination: its rows bootstrap from the final observation,
which gymnasium's same-step autoreset hands over in ``info["final_obs"]``. Rows still waiting
for their n steps at the end of a chunk go out with a later one, so the chunk's ``env_steps``
and its rows differ by at most n - 1 per environment.

Every row carries the version of the weights that chose its action and the behaviour policy's
log-probability of that action, for the learner's off-policy correction.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

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
        n_step: int,
        gamma: float,
        send_every: int,
    ) -> None:
        if n_step < 1 or send_every < 1 or num_envs < 1:
            raise ValueError(f"n_step={n_step}, send_every={send_every}, num_envs={num_envs}: each must be >= 1")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma={gamma}: must be in [0, 1]")
        self.sampler_id = sampler_id
        self.envs = gym.make_vec(
            env_id, num_envs=num_envs, vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
        self.envs.action_space.seed(seed)
        self.obs, _ = self.envs.reset(seed=seed)
        self.policy = policy
        self.n_step = n_step
        self.gamma = gamma
        self.send_every = send_every
        self.num_envs = num_envs
        self.env_steps = 0
        self.chunks = 0
        # Per environment, the steps whose n-step row is not complete yet:
        # (obs, action, reward, logp, version).
        self._pending: list[deque] = [deque() for _ in range(num_envs)]
        self._ep_return = np.zeros(num_envs, np.float64)
        self._ep_len = np.zeros(num_envs, np.int64)

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return tuple(self.envs.single_observation_space.shape)

    def collect(self) -> TransitionChunk:
        rows: list[tuple] = []
        ep_returns: list[float] = []
        ep_lengths: list[int] = []
        steps0 = self.env_steps
        for _ in range(self.send_every):
            actions, logp = self.policy.act(self.obs, self.env_steps)
            version = self.policy.version
            nxt, rew, term, trunc, info = self.envs.step(actions)
            self.env_steps += self.num_envs
            self._ep_return += rew
            self._ep_len += 1
            for i in range(self.num_envs):
                q = self._pending[i]
                q.append((self.obs[i], int(actions[i]), float(rew[i]), float(logp[i]), version))
                if term[i] or trunc[i]:
                    final = np.asarray(info["final_obs"][i], dtype=np.float32)
                    self._flush(q, final, bool(term[i]), rows)
                    ep_returns.append(float(self._ep_return[i]))
                    ep_lengths.append(int(self._ep_len[i]))
                    self._ep_return[i] = 0.0
                    self._ep_len[i] = 0
                elif len(q) == self.n_step:
                    rows.append(self._row(q, 0, nxt[i], self.gamma ** self.n_step))
                    q.popleft()
            self.obs = nxt
        chunk = self._chunk(rows, self.env_steps - steps0, ep_returns, ep_lengths)
        self.chunks += 1
        return chunk

    def close(self) -> None:
        self.envs.close()

    # ---- internals ----------------------------------------------------------------------

    def _row(self, q: deque, j: int, next_obs: np.ndarray, discount: float) -> tuple:
        obs, action, _, logp, version = q[j]
        ret = 0.0
        for k in range(j, len(q)):
            ret += self.gamma ** (k - j) * q[k][2]
        return obs, action, ret, next_obs, discount, logp, version

    def _flush(self, q: deque, final: np.ndarray, terminated: bool, rows: list) -> None:
        m = len(q)
        for j in range(m):
            rows.append(self._row(q, j, final, 0.0 if terminated else self.gamma ** (m - j)))
        q.clear()

    def _chunk(self, rows: list[tuple], env_steps: int, ep_returns: list, ep_lengths: list) -> TransitionChunk:
        n = len(rows)
        shape = self.obs_shape
        cols = {
            "obs": np.array([r[0] for r in rows], dtype=np.float32).reshape((n, *shape)),
            "action": np.array([r[1] for r in rows], dtype=np.int64),
            "reward": np.array([r[2] for r in rows], dtype=np.float32),
            "next_obs": np.array([r[3] for r in rows], dtype=np.float32).reshape((n, *shape)),
            "discount": np.array([r[4] for r in rows], dtype=np.float32),
            "logp": np.array([r[5] for r in rows], dtype=np.float32),
        }
        return TransitionChunk(
            sampler=self.sampler_id,
            seq=self.chunks,
            columns=cols,
            version=np.array([r[6] for r in rows], dtype=np.int64),
            env_steps=env_steps,
            episode_returns=np.array(ep_returns, dtype=np.float64),
            episode_lengths=np.array(ep_lengths, dtype=np.int64),
        )
