"""The env sampler's n-step rows, its chunks on the wire, and episode evaluation."""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np
import pytest

from core.env.evaluation import episode_returns
from core.env.sampler import EnvSampler, NStepRows, SegmentRows
from core.model.transition_wire import TransitionChunk, from_bytes, to_record
from ext import codec


class Countdown(gym.Env):
    """obs [t, episode]; reward t + 1 at step t; terminates after ``length`` steps."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int = 5) -> None:
        self.length = length
        self.t = 0
        self.episode = -1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.episode += 1
        return np.array([0, self.episode], np.float32), {}

    def step(self, action):
        r = float(self.t + 1)
        self.t += 1
        return np.array([self.t, self.episode], np.float32), r, self.t >= self.length, False, {}


gym.register("asyncrl-test/Countdown-terminates-v0", entry_point=Countdown, kwargs={"length": 5}, max_episode_steps=100)
gym.register("asyncrl-test/Countdown-truncated-v0", entry_point=Countdown, kwargs={"length": 100}, max_episode_steps=4)


def nstep_sampler(*, sampler_id, env_id, num_envs, seed, policy, n_step, gamma, send_every) -> EnvSampler:
    rows = NStepRows(num_envs, (2,) if "Countdown" in env_id else (4,), n_step, gamma)
    return EnvSampler(sampler_id=sampler_id, env_id=env_id, num_envs=num_envs, seed=seed, policy=policy, rows=rows, send_every=send_every)


class Fixed:
    """Always action 1, log-prob -0.5; its version is set by the test."""

    version = 0

    def act(self, obs, env_steps):
        return np.ones(len(obs), np.int64), np.full(len(obs), -0.5, np.float32)

    def set_weights(self, weights, version):
        self.version = version


def expected_rows(m: int, terminated: bool, n: int, g: float, episode: int) -> list[tuple]:
    """(t, episode, n-step return, next t, discount) of every step of one episode of m steps."""
    out = []
    for t in range(m):
        k = min(n, m - t)
        ret = sum(g**j * (t + j + 1) for j in range(k))
        ends = t + k == m
        out.append((t, episode, ret, t + k, 0.0 if (ends and terminated) else g**k))
    return out


@pytest.mark.parametrize("env_id, m, terminated", [
    ("asyncrl-test/Countdown-terminates-v0", 5, True),
    ("asyncrl-test/Countdown-truncated-v0", 4, False),
])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_n_step_rows_match_a_brute_force_across_chunks(env_id, m, terminated, n):
    g = 0.9
    pol = Fixed()
    s = nstep_sampler(sampler_id=3, env_id=env_id, num_envs=2, seed=0, policy=pol, n_step=n, gamma=g, send_every=3)
    chunks = []
    for k in range(8):  # 24 steps per env: rows cross chunk boundaries for every n
        pol.version = k
        chunks.append(s.collect())
    assert [c.seq for c in chunks] == list(range(8)) and {c.sampler for c in chunks} == {3}
    assert sum(c.env_steps for c in chunks) == 2 * 24
    got = []
    for c in chunks:
        col = c.columns
        for i in range(len(c)):
            got.append((int(col["obs"][i, 0]), int(col["obs"][i, 1]), float(col["reward"][i]),
                        int(col["next_obs"][i, 0]), float(col["discount"][i])))
            assert col["action"][i] == 1 and col["logp"][i] == pytest.approx(-0.5)
        # A row's version is that of the weights that acted, which is never newer than the chunk's.
        assert (c.version <= c.seq).all()
    episodes, left = divmod(24, m)  # per env
    want = []
    for ep in range(episodes):
        want += expected_rows(m, terminated, n, g, ep) * 2  # two envs, same episodes
    # The unfinished episode: its rows whose n steps are all taken are out, the rest still wait.
    want += [r for r in expected_rows(m, terminated, n, g, episodes) if r[0] + n <= left] * 2
    key = lambda r: (r[1], r[0])
    got_sorted = sorted(got, key=key)
    want_sorted = sorted(want, key=key)
    assert len(got_sorted) == len(want_sorted)
    for a, b in zip(got_sorted, want_sorted):
        assert a[:2] == b[:2] and a[3] == b[3]
        assert a[2] == pytest.approx(b[2], rel=1e-6) and a[4] == pytest.approx(b[4], rel=1e-6)
    returns = np.concatenate([c.episode_returns for c in chunks])
    lengths = np.concatenate([c.episode_lengths for c in chunks])
    assert len(returns) == 2 * episodes
    assert (lengths == m).all() and (returns == sum(range(1, m + 1))).all()


def test_bad_sampler_arguments_are_refused():
    with pytest.raises(ValueError, match="n_step=0"):
        nstep_sampler(sampler_id=0, env_id="CartPole-v1", num_envs=1, seed=0, policy=Fixed(), n_step=0, gamma=0.9, send_every=1)
    with pytest.raises(ValueError, match="gamma=1.5"):
        nstep_sampler(sampler_id=0, env_id="CartPole-v1", num_envs=1, seed=0, policy=Fixed(), n_step=1, gamma=1.5, send_every=1)
    with pytest.raises(ValueError, match="send_every=0"):
        EnvSampler(sampler_id=0, env_id="CartPole-v1", num_envs=1, seed=0, policy=Fixed(), rows=SegmentRows(), send_every=0)


@pytest.mark.parametrize("env_id, m, terminated", [
    ("asyncrl-test/Countdown-terminates-v0", 5, True),
    ("asyncrl-test/Countdown-truncated-v0", 4, False),
])
def test_segment_rows_keep_every_step_in_order_with_the_true_next_observation(env_id, m, terminated):
    pol = Fixed()
    s = EnvSampler(sampler_id=2, env_id=env_id, num_envs=3, seed=0, policy=pol, rows=SegmentRows(), send_every=7)
    for k in range(3):
        pol.version = k
        c = s.collect()
        col = c.columns
        assert len(c) == 3 and (c.version == k).all() and c.env_steps == 21
        assert col["obs"].shape == (3, 7, 2) and col["next_obs"].shape == (3, 7, 2) and col["reward"].shape == (3, 7)
        for t in range(7):
            step = 7 * k + t  # env steps so far, per env; every env runs the same episodes
            t_in_ep = step % m
            assert (col["obs"][:, t, 0] == t_in_ep).all() and (col["reward"][:, t] == t_in_ep + 1).all()
            # The observation after the step: the final one at an episode's end, not the reset's.
            assert (col["next_obs"][:, t, 0] == t_in_ep + 1).all()
            ended = t_in_ep + 1 == m
            assert (col["ended"][:, t] == float(ended)).all()
            assert (col["terminated"][:, t] == float(ended and terminated)).all()
        assert (col["logp"] == np.float32(-0.5)).all() and (col["action"] == 1).all()


def chunk() -> TransitionChunk:
    s = nstep_sampler(sampler_id=1, env_id="CartPole-v1", num_envs=3, seed=4, policy=Fixed(), n_step=3, gamma=0.99, send_every=40)
    return s.collect()


def test_a_chunk_crosses_processes_as_one_codec_record():
    c = chunk()
    assert len(c) > 0 and len(c.episode_returns) > 0  # always pushing right ends CartPole episodes
    back = pickle.loads(pickle.dumps(c, protocol=5))
    assert isinstance(back, TransitionChunk)
    assert (back.sampler, back.seq, back.env_steps) == (c.sampler, c.seq, c.env_steps)
    for k, v in c.columns.items():
        assert back.columns[k].dtype == v.dtype and np.array_equal(back.columns[k], v)
    assert np.array_equal(back.version, c.version) and np.array_equal(back.episode_returns, c.episode_returns)
    # What travels is the codec's bytes, so a group record is refused as a chunk.
    rec = to_record(c)
    assert rec.meta["kind"] == "asyncrl.transitions/1"
    other = codec.Sample({"x": np.zeros(1)}, {"kind": "asyncrl.group/1"})
    with pytest.raises(codec.CodecError, match="not a transition chunk"):
        from_bytes(codec.encode(other))


def test_a_malformed_chunk_is_refused():
    with pytest.raises(ValueError, match="every column needs 2 rows"):
        TransitionChunk(sampler=0, seq=0, columns={"obs": np.zeros((3, 4))}, version=np.zeros(2, np.int64), env_steps=2)
    with pytest.raises(ValueError, match="'version'"):
        TransitionChunk(sampler=0, seq=0, columns={"version": np.zeros(2)}, version=np.zeros(2, np.int64), env_steps=2)


def test_evaluation_plays_exactly_one_episode_per_environment():
    right = lambda obs: np.ones(len(obs), np.int64)
    r = episode_returns(right, "CartPole-v1", 7, seed=0)
    assert r.shape == (7,) and (r >= 1).all() and (r < 100).all()
    # Truncation ends an episode too: every episode of the truncated countdown scores 1+2+3+4.
    assert (episode_returns(right, "asyncrl-test/Countdown-truncated-v0", 3, seed=0) == 10).all()
    with pytest.raises(ValueError, match="episodes=0"):
        episode_returns(right, "CartPole-v1", 0, seed=0)
