"""The on-policy learner: V-trace targets against their definition, PPO learning CartPole in sync
mode, the segment queue's accounting and admission, and its configuration's refusals."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from core.api import RunStopped
from core.env.chunk_intake import ChunkAccountingError
from core.env.ppo import vtrace
from core.env.segment_queue import SegmentQueue
from core.runtimes.local_env import run_sync
from core.env.wiring import env_space, make_learner, make_policy, make_sampler
from core.model.config import with_changes
from core.model.env_config import EnvScenario
from core.model.transition_wire import TransitionChunk
from core.pipeline.staleness_queue import QueueClosed
from core.store.queue_journal import chunk_key


def vtrace_by_definition(v, nv, r, disc, ends, rho, c):
    """v_s = V(x_s) + sum_{t >= s} (prod_{s <= i < t} g_i c_i) rho_t delta_t, the sum stopping at the
    first episode end at or after s and at the segment's end (Espeholt et al. 2018, eq. 1)."""
    n, T = v.shape
    out = np.zeros_like(v)
    for k in range(n):
        for s in range(T):
            acc, w = 0.0, 1.0
            for t in range(s, T):
                acc += w * rho[k, t] * (r[k, t] + disc[k, t] * nv[k, t] - v[k, t])
                if ends[k, t]:
                    break
                w *= disc[k, t] * c[k, t]
            out[k, s] = v[k, s] + acc
    return out


def test_vtrace_matches_its_definition_on_random_segments_with_episode_ends():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n, T = rng.integers(1, 4), rng.integers(1, 9)
        v, nv, r = (rng.normal(size=(n, T)) for _ in range(3))
        term = rng.random((n, T)) < 0.15
        ends = term | (rng.random((n, T)) < 0.15)
        disc = 0.97 * (~term)
        ratio = np.exp(rng.normal(scale=0.5, size=(n, T)))
        rho, c = np.minimum(1.0, ratio), 0.9 * np.minimum(1.0, ratio)
        got = vtrace(*(torch.tensor(x, dtype=torch.float64) for x in (v, nv, r, disc, ends.astype(float), rho, c)))
        assert np.allclose(got.numpy(), vtrace_by_definition(v, nv, r, disc, ends, rho, c), atol=1e-10)


def test_on_policy_vtrace_is_gae_lambda():
    """With no lag every ratio is 1, and v_t - V(x_t) is GAE(lambda)'s advantage (what
    stable-baselines3 computes)."""
    rng = np.random.default_rng(1)
    T, lam, g = 12, 0.8, 0.98
    v, nv, r = (rng.normal(size=(1, T)) for _ in range(3))
    nv[0, :-1] = v[0, 1:]  # one episode: each step's next state is the next step's state
    gae, acc = np.zeros(T), 0.0
    for t in range(T - 1, -1, -1):
        acc = r[0, t] + g * nv[0, t] - v[0, t] + g * lam * acc
        gae[t] = acc
    ones = np.ones((1, T))
    got = vtrace(*(torch.tensor(x) for x in (v, nv, r, g * ones, 0 * ones, ones, lam * ones)))
    assert np.allclose(got.numpy()[0] - v[0], gae)


def ppo(**changes) -> EnvScenario:
    base = {"learner": "ppo", "env.gamma": 0.98, "env.env_steps": 100_000}
    return with_changes(EnvScenario(), {**base, **changes})


def test_sync_ppo_learns_cartpole_to_475():
    """rl-zoo's tuned CartPole PPO, seed 0: a mean greedy return of at least 475 over 100
    episodes within 30,000 env steps (10,240 when this test was written)."""
    curve = asyncio.run(run_sync(ppo(**{"env.env_steps": 30_000}), seed=0))
    assert curve.eval_return[-1] >= 475.0, curve.eval_return
    # Sync mode: each chunk is trained once, by the version that acted it; nothing dropped.
    st = curve.replay
    assert curve.trained_chunks == curve.produced_chunks == st["chunks"] == st["delivered"] == curve.versions
    assert set(curve.policy_lag) == {0.0}
    assert curve.updates == curve.versions * 20  # 20 epochs of one 256-row minibatch


def test_a_continuous_action_policy_samples_trains_and_clips_into_the_env():
    sc = ppo(**{"env.id": "Pendulum-v1", "env.envs_per_sampler": 2, "env.send_every": 64, "ppo.minibatch": 64,
                "ppo.epochs": 2})
    space = env_space(sc)
    assert (space.obs_dim, space.actions, space.discrete) == (3, 1, False)
    policy = make_policy(sc, 0, 0)
    learner = make_learner(sc, 0)
    policy.set_weights(learner.weights(), 0)
    sampler = make_sampler(sc, 0, 0, policy)
    chunk = sampler.collect()
    a = chunk.columns["action"]
    assert a.shape == (2, 64, 1) and a.dtype == np.float32
    figs = learner.learn(dict(chunk.columns), 128)
    assert figs["updates"] == 4 and np.isfinite([figs["policy_loss"], figs["value_loss"], figs["entropy"]]).all()
    # On-policy the ratio to the behaviour policy is 1: the logp the sampler sent is the learner's.
    assert figs["rho_mean"] == pytest.approx(1.0, abs=1e-5)
    sampler.close()


def _acted_segment(sc: EnvScenario, behind: float):
    """A chunk acted by the learner's own policy, its behaviour log-probabilities lowered by
    ``behind`` (as if an older policy had acted it), and a fresh learner for it."""
    learner = make_learner(sc, 0)
    policy = make_policy(sc, 0, 0)
    policy.set_weights(learner.weights(), 0)
    sampler = make_sampler(sc, 0, 0, policy)
    cols = dict(sampler.collect().columns)
    sampler.close()
    cols["logp"] = np.asarray(cols["logp"]) - behind
    return learner, cols


@pytest.mark.parametrize("correction", ["clip", "vtrace"])
def test_the_lag_correction_takes_the_ratio_to_the_policy_it_names(correction):
    """``clip`` takes PPO's ratio to the behaviour policy mu, ``vtrace`` to the learner's policy at
    the batch's start. Rows whose mu is half as likely as that policy are all outside the clip
    range under ``clip``, and none is at the first step under ``vtrace``."""
    sc = ppo(**{"ppo.lag_correction": correction, "ppo.epochs": 1})
    learner, cols = _acted_segment(sc, behind=np.log(2.0))
    figs = learner.learn(cols, 0)
    assert figs["rho_mean"] == pytest.approx(2.0, rel=1e-4)  # pi_prox / mu, reported under either
    assert figs["clip_frac"] == (1.0 if correction == "clip" else 0.0)


def test_with_no_lag_both_corrections_train_alike():
    learned = []
    for correction in ("clip", "vtrace"):
        learner, cols = _acted_segment(ppo(**{"ppo.lag_correction": correction, "ppo.epochs": 3}), behind=0.0)
        learner.learn(cols, 0)
        learned.append(learner.weights())
    for k in learned[0]:
        np.testing.assert_allclose(learned[0][k], learned[1][k], atol=1e-5)


def chunk(sampler: int, seq: int, version: int, envs: int = 2) -> TransitionChunk:
    cols = {"obs": np.zeros((envs, 3, 4), np.float32)}
    return TransitionChunk(sampler=sampler, seq=seq, columns=cols, version=np.full(envs, version, np.int64), env_steps=3 * envs)


def test_the_segment_queue_accounts_for_every_chunk_and_gates_by_version():
    async def go():
        q = SegmentQueue(capacity=3, max_staleness=1)
        for s in range(3):
            await q.insert_chunk(chunk(0, s, version=0))
        with pytest.raises(ChunkAccountingError, match="chunk 5 arrived where chunk 3 was due"):
            await q.insert_chunk(chunk(0, 5, version=0))
        assert [c.seq for c in await q.get_batch(1)] == [0]
        assert q.set_version(2) == 2  # version-0 chunks are now two versions old: dropped
        assert await q.insert_chunk(chunk(1, 0, version=0)) == 0  # stale on arrival, not stored
        await q.insert_chunk(chunk(1, 1, version=2))
        q.close()
        with pytest.raises(QueueClosed):
            await q.insert_chunk(chunk(1, 2, version=2))
        st = q.stats()
        assert st["chunks"] == 6 and st["delivered"] == 1 and st["evicted_stale"] == 2
        assert st["stale_on_arrival"] == 1 and st["left_at_end"] == 1 and st["chunks_refused"] == 1
        assert st["delivered"] + st["evicted_stale"] + st["stale_on_arrival"] + st["left_at_end"] + st["chunks_refused"] == st["chunks"]

    asyncio.run(go())


def test_a_sampler_reserves_a_place_before_it_acts_and_close_releases_every_waiter():
    async def go():
        q = SegmentQueue(capacity=1, max_staleness=4)
        assert await q.reserve(0) == 0
        second = asyncio.ensure_future(q.reserve(1))  # the one place is taken
        await asyncio.sleep(0.01)
        assert not second.done()
        await q.insert_chunk(chunk(0, 0, version=0))
        await asyncio.sleep(0.01)
        assert not second.done()  # the place is now the queued chunk's
        assert q.release(0) == 0  # sampler 0 holds none now
        q.set_version(1)
        assert [c.seq for c in await q.get_batch(1)] == [0]
        assert await asyncio.wait_for(second, 1) == 1  # the learner's newest version comes with the place
        getter = asyncio.ensure_future(q.get_batch(1))
        third = asyncio.ensure_future(q.reserve(0))
        await asyncio.sleep(0.01)
        q.close()
        for fut in (getter, third):
            with pytest.raises(QueueClosed):
                await asyncio.wait_for(fut, 1)

    asyncio.run(go())


@pytest.mark.parametrize("changes, key", [
    ({"ppo.minibatch": 512}, "ppo.minibatch = 512: is more rows than one batch holds (256"),
    ({"ppo.chunks_per_batch": 2}, "ppo.queue_chunks = 1: holds fewer chunks than one batch takes"),
    ({"ppo.hidden": []}, "ppo.hidden = []: every layer needs a width"),
])
def test_bad_ppo_settings_name_the_key(changes, key):
    with pytest.raises(ValueError) as e:
        ppo(**changes)
    assert key in str(e.value)


def test_dqn_refuses_continuous_actions():
    with pytest.raises(ValueError, match="DQN needs discrete actions; fix: use learner: ppo"):
        env_space(with_changes(EnvScenario(), {"env.id": "Pendulum-v1"}))


def test_a_durable_queue_comes_back_from_its_journals_and_hands_out_again_what_it_must(tmp_path):
    """Killed (rebuilt from its journals) it holds the same chunks and counts; a learner that comes
    back from its checkpoint gets, first, every chunk that checkpoint does not cover; a learner
    that lived through the queue's death keeps what it holds."""
    async def go(d):
        q = SegmentQueue(capacity=4, max_staleness=3, journal_dir=d)
        for s in range(4):
            await q.insert_chunk(chunk(s % 2, s // 2, version=0))
        first = await q.get_batch(2)
        q.ack([chunk_key(c) for c in first])  # the learner's checkpoint covers them
        second = await q.get_batch(1)
        before = q.stats()
        q = SegmentQueue(capacity=4, max_staleness=3, journal_dir=d)  # the actor died; Ray restarts it
        after = q.stats()
        for k in ("chunks", "env_steps", "episodes", "delivered", "stale_on_arrival", "evicted_stale"):
            assert after[k] == before[k], k
        assert len(q) == 1 and await q.resume_point(1) == (2, 12)
        # The learner lived and holds the chunk it took last: nothing is handed out twice.
        assert q.rejoin([], [chunk_key(c) for c in second]) == 0
        # It dies before its next checkpoint: the chunk comes back, before the one still queued.
        assert q.rejoin([], []) == 1
        again = await q.get_batch(2)
        assert [(c.sampler, c.seq) for c in again] == [(second[0].sampler, second[0].seq), (1, 1)]
        await q.insert_chunk(chunk(0, 2, version=0))
        q.close()
        st = q.stats()
        assert st["redelivered"] == 1 and st["left_at_end"] == 1 and st["chunks"] == 5

    asyncio.run(go(tmp_path))


@pytest.mark.parametrize("seed", range(6))
def test_chunks_are_trained_once_through_any_order_of_checkpoints_and_deaths(seed, tmp_path):
    """Seeded random runs of a learner and a durable queue, either dying at any step: the chunks
    the surviving learner lineage trained hold no chunk twice, and with the queue's counts they
    account for every chunk that arrived."""
    rng = np.random.default_rng(seed)
    K, EVERY = 2, 2  # chunks per batch; versions between the learner's checkpoints

    async def go():
        q = SegmentQueue(capacity=6, max_staleness=2, journal_dir=tmp_path)
        seqs = [0, 0, 0]
        version, taken, trained, stale = 0, [], [], []
        ckpt = (0, [], [], [])  # version, trained, stale, taken since the acknowledgement before it

        def restart_learner():
            nonlocal version, trained, stale, taken, ckpt
            v, tr, stl, covered = ckpt
            # Numbered past any version the dead one published (it checkpoints every EVERY).
            version, trained, stale, taken = v + EVERY, list(tr), list(stl), list(covered)
            ckpt = (version, list(trained), list(stale), list(covered))  # at once, under the new number
            q.rejoin(covered, [])
            q.set_version(version)

        for _ in range(300):
            op = rng.choice(["insert"] * 4 + ["learn"] * 3 + ["learner dies", "queue dies"])
            if op == "insert" and len(q) < q.capacity:
                s = int(rng.integers(3))
                await q.insert_chunk(chunk(s, seqs[s], version=max(0, version - int(rng.integers(3)))))
                seqs[s] += 1
            elif op == "learn" and len(q) >= K:
                fresh = 0
                for c in await q.get_batch(K):
                    taken.append(chunk_key(c))
                    ok = version - int(c.version[0]) <= 2
                    (trained if ok else stale).append(chunk_key(c))
                    fresh += ok
                if fresh:
                    version += 1
                    q.set_version(version)
                    if version % EVERY == 0:
                        ckpt = (version, list(trained), list(stale), list(taken))
                        if rng.random() < 0.2:  # dies between its checkpoint and the acknowledgement
                            restart_learner()
                            continue
                        q.ack(taken)
                        taken = []
            elif op == "learner dies":
                restart_learner()
            elif op == "queue dies":
                q = SegmentQueue(capacity=6, max_staleness=2, journal_dir=tmp_path)
                assert [(await q.resume_point(s))[0] for s in range(3)] == seqs
                q.rejoin([], taken)
        q.close()
        st = q.stats()
        assert len(set(trained)) == len(trained)
        assert st["chunks"] == sum(seqs)
        assert (len(trained) + len(stale) + st["stale_on_arrival"] + st["evicted_stale"] + st["left_at_end"]
                + st["chunks_refused"]) == st["chunks"]

    asyncio.run(go())


@pytest.mark.parametrize("learner", ["ppo", "dqn"])
def test_a_sync_run_stopped_at_a_version_resumes_to_the_same_counts(tmp_path, learner):
    """Stopped at version 5 and resumed, a sync run ends where an uninterrupted one does: the same
    versions, chunks and env steps (PPO: the same updates; DQN: the rate limit's updates to within
    the one batch the stop cut short). Only its environments' episodes start anew."""
    base = {"learner": learner, "checkpoint.every": 2, "env.env_steps": 4096, "env.eval_every": 2048, "env.eval_episodes": 3}
    if learner == "dqn":
        base.update({"replay.min_size_to_sample": 512, "dqn.batches_per_call": 4, "dqn.publish_every": 32,
                     "replay.samples_per_insert": 4.0, "dqn.hidden": [32, 32]})
    sc = with_changes(EnvScenario(), base)
    with pytest.raises(RunStopped, match="stopped after learner version 5"):
        asyncio.run(run_sync(sc, 0, stop_at_target=False, run_dir=tmp_path, stop_at_version=5))
    assert (tmp_path / "store").is_dir()
    # Given the same stop again, a run resumed at it goes on to its end.
    resumed = asyncio.run(run_sync(sc, 0, stop_at_target=False, run_dir=tmp_path, stop_at_version=5))
    whole = asyncio.run(run_sync(sc, 0, stop_at_target=False))
    assert resumed.learner["resumes"] == 1 and not (tmp_path / "store").exists()
    assert resumed.versions == whole.versions and resumed.produced_chunks == whole.produced_chunks
    assert resumed.replay["env_steps"] == whole.replay["env_steps"] and resumed.replay["chunks"] == resumed.produced_chunks
    assert abs(resumed.updates - whole.updates) <= (0 if learner == "ppo" else 1)
    if learner == "ppo":
        assert resumed.trained_chunks == whole.trained_chunks == resumed.produced_chunks
    # The ledger, as an LLM run's: produced = trained + dropped + in flight, across the resume too.
    for c in (resumed, whole):
        assert c.chunks.produced == c.chunks.trained + c.chunks.dropped_total + c.chunks_in_flight > 0
    assert resumed.env_steps == whole.env_steps  # evaluated at the same env steps, the ones before the stop kept
