"""The env pipeline's async mode on Ray: sampler actors, the replay actor and the learner actor."""

from __future__ import annotations

import time

import pytest
import ray

from core.env.segment_queue import SegmentQueue
from core.model.config import with_changes
from core.model.env_config import EnvScenario
from core.runtimes.ray_env import LearnerHost, SamplerHost, run_async

# The env pipeline's actors on Ray are the subject: `make test`'s pure-Python pass skips them.
pytestmark = pytest.mark.runtime

# Small and quick: what is checked here is the actors' traffic and accounting. Learning to 475
# is the sync test's and the dated results' (docs/results).
QUICK = {
    "env.env_steps": 6_000, "env.samplers": 2, "env.eval_every": 3_000, "env.eval_episodes": 10,
    "dqn.hidden": [64, 64], "dqn.publish_every": 32, "dqn.batches_per_call": 4,
    "replay.samples_per_insert": 4.0, "replay.min_size_to_sample": 500,
    "ray.sampler.num_cpus": 0.5,
}


def test_async_run_accounts_for_every_chunk_and_row(ray_session):
    sc = with_changes(EnvScenario(), QUICK)
    curve = run_async(sc, seed=0, stop_at_target=False)
    st = curve.replay
    # Every chunk the samplers sent arrived once, in order; every row is stored or refused at close.
    assert st["chunks"] == st["sampler_chunks"] > 0
    assert st["env_steps"] == st["sampler_env_steps"] >= 6_000
    assert st["rows_inserted"] + st["rows_refused"] == st["sampler_rows"]
    assert st["rows_sampled"] == st["samples"] == curve.updates * 64
    # The limiter held the ratio within its band: after warm-up, samples owed stay in centre +- band.
    band = sc.error_buffer()
    assert abs(st["inserts"] * 4.0 - st["samples"] - 500 * 4.0) <= band + sc.max_chunk_rows() * 4.0
    # Weights went out as versions, and every sampler took some through the object store.
    assert curve.versions == curve.updates // 32 > 0
    assert all(n >= 1 for n in st["weights_fetched"])
    assert min(curve.policy_lag) >= 0
    # Through ParamSync: one put per version of the whole Q-network (float32), inside the sync's time.
    assert curve.learner["weight_bytes"] == 4 * (4 * 64 + 64 + 64 * 64 + 64 + 64 * 2 + 2)
    assert 0 < curve.learner["put_s"] <= curve.learner["publish_s"]
    # Evaluations ran as remote tasks while training went on, and came back in order.
    assert len(curve.eval_return) >= 2 and curve.env_steps == sorted(curve.env_steps)
    # The timeline: every actor's spans on the training clock, the learner's updates and
    # publishes, each sampler acting, sending and fetching weights.
    assert set(curve.spans) == {"learner", "sampler0", "sampler1"}
    assert {k for k, _, _ in curve.spans["learner"]} == {"train", "sync"}
    assert {k for k, _, _ in curve.spans["sampler0"]} == {"generate", "send", "sync"}
    for spans in curve.spans.values():
        assert all(-1.0 < a < b <= curve.train_s + 5.0 for _, a, b in spans)
        assert all(x[2] <= y[1] for x, y in zip(spans, spans[1:]))  # one actor does one thing at a time


def test_a_run_the_cluster_cannot_place_is_refused_before_it_starts(ray_session):
    have = int(ray_session.cluster_resources()["CPU"])  # the session's test cluster, whatever its nodes
    sc = with_changes(EnvScenario(), {"env.samplers": have})
    with pytest.raises(ValueError, match=rf"env.samplers = {have}: .* reserve {have + 1:g} CPUs and the Ray cluster has {have}"):
        run_async(sc, seed=0)


def test_async_ppo_trains_each_chunk_once_within_its_staleness_and_accounts_for_the_rest(ray_session):
    """With a sampler killed mid-run: its restart resumes at its next chunk, and frees the place
    in the queue it held while it was collecting the chunk that died with it."""
    sc = with_changes(EnvScenario(), {
        "learner": "ppo", "env.env_steps": 4_000, "env.samplers": 2, "env.eval_every": 2_000, "env.eval_episodes": 10,
        "ppo.epochs": 2, "ppo.queue_chunks": 2, "ray.sampler.num_cpus": 0.5,
        "faults": [{"target": "sampler", "sampler": 1, "at_env_steps": 1_000}],
    })
    curve = run_async(sc, seed=0, stop_at_target=False)
    st = curve.replay
    assert st["sampler_restarts"] == [0, 1] and curve.faults["faults/recovered"] == 1
    dropped = st["stale_on_arrival"] + st["evicted_stale"] + curve.dropped_at_learner
    # The ledger: every chunk a sampler sent arrived, and was trained once, dropped as stale,
    # refused at close or left queued at the end.
    assert curve.produced_chunks == st["chunks"] == st["sampler_chunks"] > 0
    assert curve.trained_chunks + dropped + st["chunks_refused"] + st["left_at_end"] == st["chunks"]
    assert curve.trained_chunks == curve.versions > 0 and st["delivered"] == curve.trained_chunks + curve.dropped_at_learner
    led = curve.chunks  # the same, on the run's Ledger: produced = trained + dropped + in flight
    assert led.produced == led.trained + led.dropped_total + curve.chunks_in_flight and curve.chunks_in_flight == st["left_at_end"]
    # Each trained chunk lagged the learner by at most ppo.max_staleness versions.
    assert len(curve.policy_lag) == curve.trained_chunks and 0 <= min(curve.policy_lag) and max(curve.policy_lag) <= 1
    assert curve.updates == curve.trained_chunks * 2 and all(n >= 1 for n in st["weights_fetched"])
    # V-trace's figures came back from the learner.
    assert 0.5 < curve.learner["rho_mean"] < 2.0 and 0.0 <= curve.learner["rho_truncated"] <= 1.0


def test_killing_a_sampler_and_the_replay_mid_run_loses_no_chunk(ray_session):
    """A sampler actor and the (journaled) replay actor are killed; Ray restarts both. The run
    finishes, and every chunk the samplers produced is in the replay's count, taken once."""
    sc = with_changes(EnvScenario(), {
        **QUICK, "replay.durable": True,
        "faults": [{"target": "sampler", "sampler": 0, "at_env_steps": 1_500}, {"target": "replay", "at_env_steps": 3_500}],
    })
    curve = run_async(sc, seed=0, stop_at_target=False)
    st = curve.replay
    assert curve.faults["faults/injected"] == curve.faults["faults/recovered"] == 2
    assert st["sampler_restarts"] == [1, 0] and st["restored_chunks"] > 0
    # The ledger: what the samplers produced (by their chunk numbers, across the restart) is what
    # the replay took, no chunk missing (that raises) or taken twice (a resend is counted apart).
    assert curve.produced_chunks == st["chunks"] == st["sampler_chunks"]
    assert curve.chunks.produced == curve.chunks.dropped_total + curve.chunks_in_flight  # DQN: stored, or refused at the close
    assert st["env_steps"] >= 6_000 and curve.updates > 0
    assert st["rows_inserted"] == st["inserts"] and st["rows_sampled"] == st["samples"]


def test_killing_the_learner_mid_run_goes_on_from_its_checkpoint(ray_session):
    """The learner actor is killed; Ray restarts it from its latest checkpoint. It offers its
    weights under a version past any the dead one published, and learns on from the replay,
    which kept every row: the run finishes with every chunk counted."""
    sc = with_changes(EnvScenario(), {
        **QUICK, "checkpoint.every": 2, "faults": [{"target": "learner", "at_env_steps": 3_500}],
    })
    curve = run_async(sc, seed=0, stop_at_target=False)
    st, ler = curve.replay, curve.learner
    assert curve.faults["faults/injected"] == curve.faults["faults/recovered"] == 1 and ler["restarts"] == 1
    # Restored from a checkpoint (every 2 versions), then numbered past what the dead one could publish.
    assert ler["restored_from"] >= 2 and ler["restored_from"] % 2 == 0
    assert curve.versions >= ler["restored_from"] + 2
    # Nothing the samplers produced is missing; batches drawn for the dead learner were never trained.
    assert curve.produced_chunks == st["chunks"] == st["sampler_chunks"] > 0
    assert st["env_steps"] >= 6_000 and st["samples"] >= curve.updates * 64 > 0
    assert all(n >= 1 for n in st["weights_fetched"]) and min(curve.policy_lag) >= 0



def test_killing_ppos_queue_and_learner_mid_run_trains_every_chunk_once(ray_session):
    """PPO's journaled queue and its checkpointed learner are killed; Ray restarts both. The queue
    comes back with its chunks and counts; the learner from its checkpoint, and the queue hands
    it again, first, the chunks the dead one took after that checkpoint. The run finishes with
    every chunk trained once or dropped for a counted reason."""
    sc = with_changes(EnvScenario(), {
        "learner": "ppo", "env.env_steps": 8_000, "env.samplers": 2, "env.eval_every": 4_000, "env.eval_episodes": 10,
        "ppo.epochs": 2, "ppo.queue_chunks": 2, "ppo.max_staleness": 4, "ray.sampler.num_cpus": 0.5,
        "replay.durable": True, "checkpoint.every": 2,
        "faults": [{"target": "replay", "at_env_steps": 2_500}, {"target": "learner", "at_env_steps": 5_000}],
    })
    curve = run_async(sc, seed=0, stop_at_target=False)
    st, ler = curve.replay, curve.learner
    assert curve.faults["faults/injected"] == curve.faults["faults/recovered"] == 2 and ler["restarts"] == 1
    assert ler["restored_from"] >= 2 and ler["restored_from"] % 2 == 0 and curve.versions >= ler["restored_from"] + 2
    assert curve.produced_chunks == st["chunks"] == st["sampler_chunks"] > 0 and st["env_steps"] >= 8_000
    dropped = st["stale_on_arrival"] + st["evicted_stale"] + curve.dropped_at_learner
    assert curve.trained_chunks + dropped + st["chunks_refused"] + st["left_at_end"] == st["chunks"]
    assert len(curve.policy_lag) == curve.trained_chunks and 0 <= min(curve.policy_lag) and max(curve.policy_lag) <= 4


def test_a_held_run_neither_acts_nor_learns_until_the_hold_ends(ray_session):
    """What ``env.hold_for_eval`` relies on: a hold is answered between two chunks and two
    updates, and once a chunk acted before it has landed, nothing is acted or learned until it ends."""
    sc = with_changes(EnvScenario(), {**QUICK, "learner": "ppo", "env.samplers": 1, "ppo.epochs": 2})
    store = ray.remote(SegmentQueue).remote(1, 1, None)
    sampler = ray.remote(SamplerHost).options(num_cpus=0.5).remote(sc, 0, 0)
    learner = ray.remote(LearnerHost).options(num_cpus=0.5).remote(sc, 0)
    actors = [store, learner, sampler]
    try:
        ray.get(learner.publish.remote([sampler]))
        run, learning = sampler.run.remote(store, 10**9), learner.run.remote(store)

        def progress():
            return ray.get(store.stats.remote())["env_steps"], ray.get(learner.latest.remote())[0]

        def grows(since):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = progress()
                if now[0] > since[0] and now[1] > since[1]:
                    return now
                time.sleep(0.05)
            raise AssertionError(f"no progress from {since}")

        grows((0, 0))
        ray.get([a.hold.remote() for a in actors])
        time.sleep(0.3)  # a chunk acted before the hold may still land in the store
        held = progress()
        time.sleep(0.5)
        assert progress() == held
        ray.get([a.end_hold.remote() for a in actors])
        grows(held)
        ray.get(sampler.stop.remote())
        ray.get(store.close.remote())
        sampled, learned = ray.get([run, learning])
        assert sampled["chunks"] >= learned["trained_chunks"] >= 2
    finally:
        for a in actors:
            ray.kill(a)
