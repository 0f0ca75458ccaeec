"""``python -m harness.run`` on an env scenario: reports, summary, figures, and bad input refused."""

from __future__ import annotations

import json

import pytest

from harness.run import main

QUICK = [
    "--set", "env.env_steps=3000", "--set", "env.eval_every=1500", "--set", "env.eval_episodes=5",
    "--set", "dqn.hidden=[32, 32]", "--set", "replay.samples_per_insert=2", "--set", "replay.min_size_to_sample=512",
]


def test_an_env_scenario_runs_sync_and_writes_its_reports(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--set", "modes=[sync]", "--set", "seeds=[0, 1]", *QUICK])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [0, 1] and set(summary["modes"]) == {"sync"}
    for seed in (0, 1):
        rep = json.loads((out / f"seed-{seed}" / "sync" / "report.json").read_text())
        m = rep["metrics"]
        assert m["env_steps"] >= 3000 and m["updates"] > 0 and m["samples_per_insert"] > 0
        assert rep["series"]["eval_env_steps"] == sorted(rep["series"]["eval_env_steps"])
    assert summary["modes"]["sync"]["env_steps_per_s"]["n"] == 2
    assert (out / "return_vs_time.png").is_file() and (out / "return_vs_env_steps.png").is_file()
    printed = capsys.readouterr().out
    assert "time to a mean evaluation return of 475" in printed


def test_uniform_replay_and_one_step_rows_run_too(tmp_path):
    out = tmp_path / "run"
    rc = main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--no-plots", "--set", "modes=[sync]",
               "--set", "replay.prioritized=false", "--set", "env.n_step=1", *QUICK])
    assert rc == 0
    m = json.loads((out / "seed-0" / "sync" / "report.json").read_text())["metrics"]
    assert m["updates"] > 0


def test_an_env_scenario_runs_async_on_ray(tmp_path, ray_session):
    out = tmp_path / "run"
    rc = main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--no-plots", "--set", "modes=[async]",
               "--set", "ray.sampler.num_cpus=0.5", "--set", "ray.learner.num_cpus=0.5", "--set", "dqn.batches_per_call=2", "--set", "dqn.publish_every=16", *QUICK])
    assert rc == 0
    m = json.loads((out / "seed-0" / "async" / "report.json").read_text())["metrics"]
    assert m["env_steps"] >= 3000 and m["updates"] > 0 and m["versions"] >= 1


def test_a_ppo_scenario_runs_sync_and_its_ledger_balances(tmp_path):
    out = tmp_path / "run"
    rc = main(["scenarios/cartpole-ppo.yaml", "--out", str(out), "--no-plots", "--set", "modes=[sync]",
               "--set", "env.env_steps=2048", "--set", "env.eval_every=1024", "--set", "env.eval_episodes=5", "--set", "ppo.epochs=2"])
    assert rc == 0
    m = json.loads((out / "seed-0" / "sync" / "report.json").read_text())["metrics"]
    assert m["chunks_produced"] == m["chunks_trained"] == 8 and m["chunks_lost"] == 0 and m["chunks_dropped_stale"] == 0
    assert m["samples_per_insert"] == pytest.approx(2.0) and m["policy_lag_mean"] == 0.0


@pytest.mark.parametrize("extra, needle", [
    (["--set", "dqn.lr=-1"], "dqn.lr = -1: input should be greater than 0"),
    (["--set", "env.sampler=2"], "env.sampler = 2: unknown key; fix: remove it; did you mean 'samplers'?"),
    (["--set", "replay.error_buffer=1"], "replay.error_buffer = 1"),
    (["--stop-at-step", "3"], "--stop-at-step: not supported for an env scenario yet"),
    (["--set", "faults=[{target: replay, at_env_steps: 100}]"], "faults.0.target = 'replay': a store (replay or queue) that is not journaled"),
    (["--set", "faults=[{sampler: 1, at_env_steps: 100}]"], "faults.0.sampler = 1: there are 1 samplers"),
    (["--set", "modes=[sync]", "--set", "faults=[{at_env_steps: 100}]"], "faults are injected into async runs"),
    (["--set", "env.id=Nope-v0"], "env.id = 'Nope-v0': Environment `Nope` doesn't exist."),
    (["--set", "env.id=Pendulum-v1"], "env.id = 'Pendulum-v1': DQN needs discrete actions; fix: use learner: ppo"),
])
def test_bad_env_input_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    assert main(["scenarios/cartpole-dqn.yaml", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert needle in " ".join(err.split()) and not out.exists()


def test_a_run_the_cluster_cannot_place_is_refused(tmp_path, capsys, ray_session):
    out = tmp_path / "run"
    assert main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--set", "modes=[async]", "--set", "env.samplers=5"]) == 2
    assert "env.samplers = 5" in " ".join(capsys.readouterr().err.split())
    assert not out.exists()
