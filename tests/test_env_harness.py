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
    # Where the loop's time went, over a few versions: acting, sending, learning, publishing.
    rep = json.loads((out / "seed-0" / "sync" / "report.json").read_text())
    lo, hi = rep["timeline"]["window_s"]
    assert 0 <= lo < hi and {k for k, _, _ in rep["timeline"]["spans"]["sync loop"]} >= {"generate", "send", "train"}
    assert (out / "seed-0" / "sync" / "timeline.png").is_file()
    printed = capsys.readouterr().out
    assert "time to a mean evaluation return of 475" in printed


def test_uniform_replay_and_one_step_rows_run_too(tmp_path):
    out = tmp_path / "run"
    rc = main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--no-plots", "--set", "modes=[sync]",
               "--set", "replay.prioritized=false", "--set", "env.n_step=1", *QUICK])
    assert rc == 0
    m = json.loads((out / "seed-0" / "sync" / "report.json").read_text())["metrics"]
    assert m["updates"] > 0


@pytest.mark.runtime
def test_an_env_scenario_runs_async_on_ray_and_profiles_every_actor(tmp_path, ray_session, capsys):
    out = tmp_path / "run"
    rc = main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--no-plots", "--profile", "--set", "modes=[async]",
               "--set", "ray.sampler.num_cpus=0.5", "--set", "ray.learner.num_cpus=0.5", "--set", "dqn.batches_per_call=2", "--set", "dqn.publish_every=16", *QUICK])
    assert rc == 0
    m = json.loads((out / "seed-0" / "async" / "report.json").read_text())["metrics"]
    assert m["env_steps"] >= 3000 and m["updates"] > 0 and m["versions"] >= 1
    svgs = sorted(p.name for p in (out / "seed-0" / "async" / "profile").glob("*.svg"))
    assert svgs == ["driver.svg", "learner.svg", "replay.svg", "sampler-0.svg"]
    assert "seed-0/async/profile/learner.svg" in " ".join(capsys.readouterr().out.split())


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
    (["--stop-at-step", "3"], "--stop-at-step 3: the run keeps no checkpoints to resume from; fix: --set checkpoint.every=10"),
    (["--stop-at-step", "0", "--set", "checkpoint.every=2"], "--stop-at-step 0: counts learner versions, from 1"),
    (["--set", "runtime=sim", "--set", "checkpoint.every=2"], "checkpoint.every = 2: the sim runtime learns nothing to checkpoint"),
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


@pytest.mark.runtime
def test_a_run_the_cluster_cannot_place_is_refused(tmp_path, capsys, ray_session):
    out = tmp_path / "run"
    too_many = int(ray_session.cluster_resources()["CPU"]) + 1  # the session's test cluster, whatever its nodes
    assert main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--set", "modes=[async]", "--set", f"env.samplers={too_many}"]) == 2
    assert f"env.samplers = {too_many}" in " ".join(capsys.readouterr().err.split())
    assert not out.exists()


PPO_QUICK = ["--no-plots", "--set", "env.env_steps=4096", "--set", "env.eval_every=2048", "--set", "env.eval_episodes=5",
             "--set", "ppo.epochs=2", "--set", "ray.sampler.num_cpus=0.5", "--set", "env.samplers=2", "--set", "seeds=[0]"]


@pytest.mark.runtime
@pytest.mark.parametrize("learner", ["ppo", "dqn"])
def test_an_env_run_stopped_at_a_version_resumes_and_accounts_for_every_chunk(tmp_path, capsys, ray_session, learner):
    """The async run stops at learner version 4, as a crash would, and --resume goes on from its
    checkpoint, journal and driver state (the sync run after it then runs whole): each finishes its
    env steps with every chunk counted, its curve goes on, and what a finished run no longer needs
    (the store's journal) is gone, its checkpoints kept. Sync mode's resume: tests/test_env_ppo.py."""
    out = tmp_path / "run"
    extra = PPO_QUICK if learner == "ppo" else [*QUICK, "--no-plots", "--set", "ray.sampler.num_cpus=0.5",
                                                  "--set", "dqn.batches_per_call=2", "--set", "dqn.publish_every=16"]
    rc = main([f"scenarios/cartpole-{learner}.yaml", "--out", str(out), "--set", "checkpoint.every=2", "--stop-at-step", "4",
               "--set", "env.target_return=10000", "--set", "modes=[async, sync]", *extra])
    assert rc == 0 and "Go on with: python -m harness.run --resume" in " ".join(capsys.readouterr().out.split())
    assert not (out / "summary.json").exists() and (out / "seed-0" / "async" / "driver.ckpt").is_file()
    # A new run on it is refused: it holds a run that has not finished.
    assert main([f"scenarios/cartpole-{learner}.yaml", "--out", str(out)]) == 2
    assert "holds a run that has not finished; fix: --resume" in " ".join(capsys.readouterr().err.split())

    assert main(["--resume", str(out)]) == 0
    for mode in ("sync", "async"):
        rep = json.loads((out / "seed-0" / mode / "report.json").read_text())
        m = rep["metrics"]
        assert m["chunks_lost"] == 0 and m["env_steps"] >= 3000 and m["versions"] >= 4
        assert rep["series"]["eval_env_steps"] == sorted(rep["series"]["eval_env_steps"])
        assert not (out / "seed-0" / mode / "store").exists() and any((out / "seed-0" / mode / "checkpoints").glob("step-*"))
    resumed = json.loads((out / "seed-0" / "async" / "report.json").read_text())
    assert resumed["metrics"]["learner"]["resumes"] == 1 and not (out / "seed-0" / "async" / "driver.ckpt").exists()
    assert resumed["metrics"]["learner"]["restored_from"] == 4
    assert (out / "summary.json").is_file()
    assert main(["--resume", str(out)]) == 2 and "this run finished" in capsys.readouterr().err


def test_a_resume_refuses_a_checkpoint_it_cannot_use_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["scenarios/cartpole-ppo.yaml", "--out", str(out), "--set", "modes=[sync]", "--set", "checkpoint.every=2",
                 "--stop-at-step", "2", *PPO_QUICK]) == 0
    state = next((out / "seed-0" / "sync" / "checkpoints").glob("step-*")) / "state.ckpt"
    state.write_bytes(state.read_bytes()[:-7])
    capsys.readouterr()
    assert main(["--resume", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "state.ckpt" in err and "truncated" in err
