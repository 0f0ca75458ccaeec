"""The env pipeline's sim runtime (core/sim/env_pipeline.py, core/runtimes/sim_env.py): deterministic,
paced by the real rate limiter, and its figures where closed forms say they must be."""

from __future__ import annotations

import asyncio
import json

import pytest

from core.model.env_config import EnvScenario
from core.runtimes.sim_env import make_limiter, run_env_sim, sim_sizes
from core.sim import virtual_clock
from core.sim.env_pipeline import EnvPipelineSim
from harness import env_run
from harness.env_run import metrics
from harness.run import main

# Sizes given, so that no test makes a gymnasium environment unless it means to.
SIZES = {"row_bytes": 60, "param_bytes": 270_344}


def scenario(env: dict | None = None, sim: dict | None = None, **top) -> EnvScenario:
    return EnvScenario.model_validate({
        "kind": "env", "runtime": "sim", "env": {"env_steps": 20_000, **(env or {})},
        "sim": {**SIZES, **(sim or {})}, **top,
    })


def figures(sc: EnvScenario, mode: str, seed: int = 0) -> dict:
    return metrics(sc, run_env_sim(sc, mode, seed))


def test_same_scenario_and_seed_give_identical_figures_and_a_seed_moves_the_jitter():
    sc = scenario({"samplers": 6}, {"machines": 3, "nic_gbit_s": 0.05, "jitter": 0.2})
    for mode in ("sync", "async"):
        assert figures(sc, mode) == figures(sc, mode)
    assert figures(sc, "async", 1) != figures(sc, "async", 0)


def test_async_overlaps_what_sync_adds_up():
    # Per env step: 0.1 ms of stepping, and 8 / 64 updates of 0.8 ms = 0.1 ms of learning.
    sc = scenario({"envs_per_sampler": 1, "send_every": 16},
                  {"env_step_s": 1e-4, "forward_s": 0.0, "forward_env_s": 0.0, "learner_update_s": 8e-4,
                   "rpc_latency_s": 0.0, "replay_call_s": 0.0, "replay_insert_row_s": 0.0,
                   "replay_sample_row_s": 0.0, "jitter": 0.0},
                  replay={"samples_per_insert": 8})
    sync, async_ = figures(sc, "sync"), figures(sc, "async")
    assert sync["env_steps_per_s"] == pytest.approx(1 / 2e-4, rel=0.05)
    assert async_["env_steps_per_s"] > 1.6 * sync["env_steps_per_s"]


@pytest.mark.parametrize("update_s, env_step_s", [(1e-5, 1e-3), (5e-3, 3e-5)])  # sampler-bound, then learner-bound
def test_the_limiter_holds_samples_per_insert_in_its_band(update_s, env_step_s):
    sc = scenario({"samplers": 4}, {"learner_update_s": update_s, "env_step_s": env_step_s, "machines": 2, "rpc_latency_s": 1e-4})
    limiter = make_limiter(sc)
    res = virtual_clock.run(EnvPipelineSim(sc, "async", 0, limiter, 60, 1000).run())
    centre = sc.replay.min_size_to_sample * sc.replay.samples_per_insert
    assert abs(limiter.lag - centre) <= sc.error_buffer()
    call = sc.max_sample_rows()  # the call being learned on, and the next, already drawn
    assert res.updates * sc.dqn.batch_size <= limiter.samples <= res.updates * sc.dqn.batch_size + 2 * call
    side = "insert" if update_s > 1e-3 else "sample"
    assert limiter.blocked_s[side] > 0.2 * res.train_s  # virtual seconds: the slower side holds the other back


def test_a_link_bound_run_moves_rows_at_the_link_s_bandwidth():
    # Machine 1's four samplers share one 10 Mbit/s link; machine 0's send without one. Weights
    # of 100 bytes: a version's pull barely holds the link.
    sc = scenario({"samplers": 8, "env_steps": 40_000},
                  {"machines": 2, "nic_gbit_s": 0.01, "env_step_s": 1e-6, "learner_update_s": 1e-5, "rpc_latency_s": 1e-4,
                   "param_bytes": 100},
                  replay={"samples_per_insert": 1, "error_buffer": 1e6})  # a band so wide the limiter never holds a sampler
    m = figures(sc, "async")
    remote_rows = 4 * 20 * 256  # 5,000 env steps each, in whole chunks of 8 envs x 32 steps
    assert m["train_s"] == pytest.approx(remote_rows * 60 * 8 / 0.01e9, rel=0.03)
    assert m["sim"]["link_busy"]["machine1"]["out"] > 0.97
    assert m["sim"]["bytes_sent"] == remote_rows * 60


def test_send_every_spreads_the_per_message_cost_over_more_steps():
    c, rpc = 1e-5, 1e-3
    rates = []
    for every in (1, 10, 100):
        sc = scenario({"envs_per_sampler": 1, "send_every": every},
                      {"env_step_s": c, "forward_s": 0.0, "forward_env_s": 0.0, "rpc_latency_s": rpc, "replay_call_s": 0.0,
                       "replay_insert_row_s": 0.0, "replay_sample_row_s": 0.0, "learner_update_s": 1e-6, "jitter": 0.0},
                      replay={"samples_per_insert": 1})
        rates.append(figures(sc, "async")["env_steps_per_s"])
        assert rates[-1] == pytest.approx(every / (every * c + rpc), rel=0.02)
    assert rates[0] < rates[1] < rates[2]


def test_weights_cross_a_link_once_per_machine_and_version():
    sc = scenario({"samplers": 8}, {"machines": 4, "learner_update_s": 1e-3}, dqn={"publish_every": 16})
    s = figures(sc, "async")["sim"]
    assert s["weight_fetches"] > s["weight_pulls"] > 0
    assert s["weight_pulls"] <= 3 * figures(sc, "async")["versions"]


def test_a_pipeline_that_can_never_move_is_an_error_not_a_hang():
    class Shut:
        """A limiter that never lets anything through."""

        async def wait_insert(self, rows):
            await asyncio.Event().wait()

        wait_sample = wait_insert

        def can_sample(self, rows):
            return False

    with pytest.raises(virtual_clock.SimulationStalled, match="stalled"):
        virtual_clock.run(EnvPipelineSim(scenario(), "async", 0, Shut(), 60, 1000).run())


def test_sizes_come_from_the_env_and_the_network_when_not_given():
    sc = EnvScenario(runtime="sim", env={"id": "CartPole-v1"}, dqn={"hidden": [8]})
    # two 4-float observations + int64 action + 3 float32 + int64 version; 4 -> 8 -> 2 float32 weights
    assert sim_sizes(sc) == (8 * 4 + 28, 4 * (4 * 8 + 8 + 8 * 2 + 2))


def test_a_sim_run_through_the_harness_starts_no_ray_and_reports_what_it_can(tmp_path, capsys, monkeypatch):
    def no_cluster(*args):
        raise AssertionError("a sim run started Ray")

    monkeypatch.setattr(env_run, "cluster", no_cluster)
    out = tmp_path / "run"
    assert main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--set", "runtime=sim", "--set", "env.env_steps=5000"]) == 0
    m = json.loads((out / "seed-0" / "async" / "report.json").read_text())["metrics"]
    assert m["time_to_target_s"] is None and m["env_steps"] >= 5000 and 0 <= m["sim"]["replay_busy"] <= 1
    assert m["chunks_produced"] > 0 and m["chunks_lost"] == 0  # every chunk on the ledger, in the replay at the end
    printed = capsys.readouterr().out
    assert "simulated throughput" in printed and not (out / "return_vs_time.png").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--set", "sim.machines=4"], "sim.machines = 4: is more machines than env.samplers = 1"),
    (["--set", "sim.nic_gbits=1"], "sim.nic_gbits = 1: unknown key; fix: remove it; did you mean 'nic_gbit_s'?"),
    (["--set", "sim.nic_gbit_s=0"], "sim.nic_gbit_s = 0: input should be greater than 0"),
    (["--set", "env.id=NoSuchEnv-v0"], "env.id = 'NoSuchEnv-v0': Environment `NoSuchEnv` doesn't exist"),
    (["--set", "learner=ppo"], "learner = 'ppo': the sim runtime models the replay pipeline"),
])
def test_bad_sim_input_is_one_line_and_exit_2(tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    assert main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--set", "runtime=sim", *extra]) == 2
    assert needle in " ".join(capsys.readouterr().err.split()) and not out.exists()
