"""The pure helpers of the env bench scripts (bench/env_throughput.py, bench/profile_env_learner.py,
bench/env_sim_check.py): which configurations run, the ratio to a baseline, which category a py-spy
stack is charged to, and the sim set beside real rows. The scripts themselves take minutes and are not run here."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from core.runtimes.local_env import run_sync
from harness.scenario import load

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def throughput():
    return _load("env_throughput")


@pytest.fixture(scope="module")
def profile():
    return _load("profile_env_learner")


def test_configs_cover_both_sweeps_once_with_a_baseline_each(throughput):
    cs = throughput.configs()
    assert len(cs) == len(set(cs))
    for regime in throughput.REGIMES:
        mine = [c for c in cs if c.regime == regime and not c.variant]
        assert mine[0].is_baseline() and sum(c.is_baseline() for c in mine) == 1
        assert {c.send_every for c in mine if c.samplers == 1} == set(throughput.SEND_EVERY)
        assert {c.samplers for c in mine if c.send_every == 10} == set(throughput.SAMPLERS)
    changes = throughput.scenario_changes(cs[0], 1000)
    assert changes["env.eval_every"] > changes["env.env_steps"]


def test_ratios_are_against_the_same_repeats_baseline(throughput):
    def row(rep, se, rate, base=False):
        return {"regime": "sampler-bound", "repeat": rep, "send_every": se, "samplers": 1, "variant": "",
                "baseline": base, "env_steps_per_s": rate}

    got = throughput.ratios([row(0, 10, 100.0, True), row(0, 1, 50.0), row(1, 10, 200.0, True), row(1, 1, 50.0)])
    one = got[("sampler-bound", 1, 1, "")]
    assert one["ratio_min"] == pytest.approx(0.25) and one["ratio_max"] == pytest.approx(0.5)
    assert one["ratio"] == pytest.approx(0.375) and one["mean"] == pytest.approx(50.0)


def _line_of(path: str, text: str) -> int:
    lines = (ROOT / path).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line)


def test_stacks_are_charged_to_what_they_ran(profile):
    loop = ["<module> (bench/profile_env_learner.py:1)", "run_sync (core/runtimes/local_env.py:90)"]
    # The pure-Python replay: its own frames.
    ref = loop + ["TransitionReplay.sample (core/env/transition_replay.py:1)", "ReplayBuffer.sample (ext/_replay_ref.py:400)",
                  "sum (numpy/_core/fromnumeric.py:1)"]
    assert profile.categorize(ref) == profile.REPLAY_SAMPLE
    # The compiled replay makes no frame: the line that calls the buffer says which method.
    line = _line_of("core/env/transition_replay.py", "self.buffer.update_priorities(")
    assert profile.categorize(loop + [f"TransitionReplay.update_priorities (core/env/transition_replay.py:{line})"]) == profile.REPLAY_PRIO
    back = _line_of("core/env/dqn.py", "self.online.backward_into(")
    assert profile.categorize(loop + [f"DQNLearner.update (core/env/dqn.py:{back})", "QNetwork.backward_into (core/env/dqn.py:1)"]) \
        == "learner: backward"
    adam = _line_of("core/env/dqn.py", "adam_step(self.opt)")
    assert profile.categorize(loop + [f"DQNLearner.update (core/env/dqn.py:{adam})", "adam (torch/optim/adam.py:1)"]) \
        == "learner: Adam step"
    assert profile.categorize(loop + ["EnvSampler.collect (core/env/sampler.py:1)", "EpsilonGreedy.act (core/env/dqn.py:1)",
                                      "Linear.forward (torch/nn/modules/linear.py:1)"]) == "policy (sampler's forward)"
    # Ray's blocked threads are waiting, not busy; Ray's work under the actor's method is Ray's.
    assert profile.categorize(["<module> (ray/_private/workers/default_worker.py:323)",
                               "Worker.main_loop (ray/_private/worker.py:1069)"]) == profile.WAITING
    assert profile.categorize(["Thread._bootstrap (threading.py:1002)", "Thread.run (threading.py:982)"]) == profile.WAITING
    assert profile.categorize(["Thread.run (threading.py:982)", "LearnerHost.run (core/runtimes/ray_env.py:140)",
                               "ObjectRef.__await__ (ray/_raylet.pyx:1)"]) == "ray / asyncio / serialization"
    assert profile.categorize(["<module> (x.py:1)", "_find_and_load (<frozen importlib._bootstrap>:1176)"]) == profile.STARTUP


def test_shares_leave_out_startup_waiting_and_frames_outside_the_loop(profile):
    stacks = [([], 5), (["main (a.py:1)"], 7), (["run_sync (core/runtimes/local_env.py:1)", "f (gymnasium/core.py:1)"], 3),
              (["run_sync (core/runtimes/local_env.py:1)", "Thread.run (threading.py:982)"], 2)]
    counts, total, left_out, waiting = profile.shares(stacks, keep="run_sync")
    assert counts == {"gymnasium": 3} and total == 3 and left_out == 12 and waiting == 2


def test_sim_check_sets_each_plain_configuration_beside_its_simulation(tmp_path, capsys):
    check = _load("env_sim_check")
    rows = [{"regime": "sampler-bound", "send_every": 10, "samplers": 1, "variant": v, "env_steps": 2_000,
             "env_steps_per_s": 1_000.0, "updates_per_s": 5.0} for v in ("", "fetch")]
    (tmp_path / "rows.json").write_text(json.dumps({"meta": {"commit": "abc", "cpus": 2}, "rows": rows}))
    assert check.main([str(tmp_path / "rows.json"), "--set", "sim.env_step_s=1e-3"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| sampler-bound")]
    assert len(table) == 1  # the fetch variant changes the sampler, which the sim does not model
    sim = float(table[0].split("|")[5].replace(",", ""))
    assert 0 < sim <= 1_000  # 8 envs at 1 ms a step: one sampler cannot pass 1,000 env steps/s
    with pytest.raises(SystemExit) as bad:
        check.main([str(tmp_path / "rows.json"), "--set", "dqn.lr=1e-3"])
    assert bad.value.code == 2


def test_costs_fitted_on_a_baseline_make_the_sim_reproduce_it():
    check = _load("env_sim_check")
    # 1,000 vector steps of 8 envs at 0.4 ms, 100 chunks of 80 rows at 1 ms each way: 16,000 env steps/s.
    sampler = {"env_steps": 8_000, "sampler_collect_s": 0.4, "sampler_insert_s": 0.1, "chunks": 100}
    learner = {"learner_update_s": 0.3, "updates": 100}
    real = {("sampler-bound", 10, 1): [sampler], ("learner-bound", 10, 1): [learner]}
    costs = check.fitted(real, {"sim.replay_call_s": 1e-4})
    assert costs["sim.learner_update_s"] == pytest.approx(3e-3) and costs["sim.replay_call_s"] == 1e-4
    sim = check.simulated(check.Config("sampler-bound", 10, 1), 8_000, 0, costs, cores=2)
    assert sim["env_steps_per_s"] == pytest.approx(16_000, rel=0.05)


def test_the_lag_bench_at_lag_0_is_sync_mode():
    """bench/ppo_lag_sim.py's loop with no lag reaches 475 at the same env step as sync mode's:
    what it measures at a lag is the lag alone."""
    lag_sim = _load("ppo_lag_sim")
    curve = asyncio.run(run_sync(load(ROOT / "scenarios" / "cartpole-ppo.yaml"), seed=0))
    hit = curve.env_steps[curve.first_reaching(475.0)]
    assert lag_sim.env_steps_to_target("clip", 0, 0) == hit
