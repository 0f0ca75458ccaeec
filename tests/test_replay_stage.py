"""The optional replay stage: reuse, accounting, the staleness bound it states, prioritized draws."""

import math
from collections import Counter

import pytest

from core.model.config import Scenario, with_changes
from core.runtimes.dispatch import run_mode
from harness.metrics import WALL_CLOCK_KEYS, collect
from core.model.run_plan import staleness_bound
from core.sim.workload import Workload

BASE = {
    "resources": {"rollout_gpus": 2, "trainer_gpus": 2},
    "workload": {"group_size": 4, "response_median": 400, "response_sigma": 0.8, "max_response_len": 4000},
    "trainer": {"batch_size": 32, "sync_every": 2, "steps": 60},
    "staleness": {"max_staleness": 1},
    "replay": {"enabled": True, "capacity_groups": 24, "reuse": 2.0},
}


def scenario(**replay) -> Scenario:
    sc = Scenario.model_validate(BASE)
    return with_changes(sc, {f"replay.{k}": v for k, v in replay.items()})


@pytest.mark.parametrize("mode", ["sync", "async", "partial"])
def test_the_bound_is_reached_in_colocated_sync(mode):
    """A group added in a window's last step lives ceil((L - 1) / sync_every) versions more."""
    m = collect(run_mode(scenario(), mode))
    assert m["staleness/bound"] == BASE["staleness"]["max_staleness"] * (mode != "sync") + 3
    if mode == "sync":
        assert m["staleness/max"] == m["staleness/bound"]


@pytest.mark.parametrize("mode", ["sync", "async", "partial"])
def test_reuse_trains_each_fresh_sample_about_reuse_times(mode):
    sc = scenario()
    m = collect(run_mode(sc, mode))
    assert m["samples/lost"] == 0 and m["samples/in_flight"] == 0
    assert m["samples/trainings"] == 60 * 32
    # 8 groups a step, 4 of them fresh (ceil(8 / 2)); the first step fills the ring with 8.
    assert m["replay/added_groups"] == 4 * 60 + 4
    assert m["replay/drawn_groups"] == 8 * 60
    fresh = m["replay/added_groups"] * 4
    assert m["samples/trained"] + m["samples/dropped_replay_overwritten"] + m["samples/dropped_run_end"] >= fresh
    assert 1.5 < m["samples/trainings"] / m["samples/trained"] < 3.0
    assert m["staleness/max"] <= m["staleness/bound"]


def test_without_replay_nothing_is_reused_and_no_replay_metrics_appear():
    sc = scenario(enabled=False)
    m = collect(run_mode(sc, "async"))
    assert m["samples/trained"] == m["samples/trainings"] == 60 * 32
    assert not [k for k in m if k.startswith("replay/")]
    assert m["staleness/bound"] == 1


def test_reuse_halves_what_rollout_must_produce():
    plain = collect(run_mode(scenario(enabled=False), "async"))
    reused = collect(run_mode(scenario(reuse=2.0), "async"))
    assert reused["samples/produced"] < 0.6 * plain["samples/produced"]


def test_the_staleness_bound_is_what_a_group_can_live_in_the_ring():
    # 24 groups, 4 fresh a step: a group is overwritten 6 steps after it arrived, so it is
    # trained 5 steps later at most, which is ceil(5 / 2) = 3 versions at sync_every 2.
    assert staleness_bound(1, 24, 4, 2) == 1 + 3
    assert staleness_bound(2, 4, 4, 1) == 2  # one step in the ring: no reuse across versions
    assert staleness_bound(0, 25, 4, 3) == 0 + 2  # 7 steps: 6 steps later is 2 versions at most


def test_a_ring_that_outlives_versions_trains_staler_samples_than_the_queue_allows():
    m = collect(run_mode(scenario(capacity_groups=64, reuse=4.0), "async"))
    assert m["staleness/bound"] > 1
    assert 1 < m["staleness/max"] <= m["staleness/bound"]


def test_prioritized_draws_favour_groups_with_a_learning_signal():
    sc = scenario(prioritized=True, alpha=1.0, capacity_groups=64, reuse=4.0)
    system = run_mode(sc, "async")
    work = Workload(sc.workload, sc.seed)
    draws = Counter(pid for pid, _, _ in system.ledger.trained_log)
    flat = [draws[p] for p in draws if work.reward_spread(p) == 0.0]
    signal = [draws[p] for p in draws if work.reward_spread(p) >= 0.4]
    assert flat and signal
    # Every new group is drawn once at the maximum priority; after that a group without signal
    # keeps only the floor priority, so it is drawn again far less often.
    assert sum(signal) / len(signal) > 1.5 * sum(flat) / len(flat)


def test_uniform_replay_ignores_the_signal():
    sc = scenario(prioritized=False, capacity_groups=64, reuse=4.0)
    system = run_mode(sc, "async")
    work = Workload(sc.workload, sc.seed)
    draws = Counter(pid for pid, _, _ in system.ledger.trained_log)
    flat = [draws[p] for p in draws if work.reward_spread(p) == 0.0]
    signal = [draws[p] for p in draws if work.reward_spread(p) >= 0.4]
    assert math.isclose(sum(signal) / len(signal), sum(flat) / len(flat), rel_tol=0.35)


def test_replay_runs_are_reproducible():
    sc = scenario(prioritized=True)
    a, b = ({k: v for k, v in collect(run_mode(sc, "partial")).items() if k not in WALL_CLOCK_KEYS} for _ in range(2))
    assert a == b


def test_a_ring_smaller_than_a_batch_is_refused_with_the_key():
    with pytest.raises(ValueError) as err:  # pydantic wraps the ConfigError
        scenario(capacity_groups=7)
    assert "replay.capacity_groups = 7" in str(err.value) and "at least" in str(err.value)
