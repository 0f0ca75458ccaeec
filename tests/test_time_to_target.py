"""Time to reward and runs over several seeds: the time-to-target computation on hand-built
trainer steps, the aggregation over seeds, and the harness end to end with ``seeds: [0, 1]``."""

import json
from pathlib import Path

import numpy as np
import pytest

import harness.run
from harness import report
from harness.console import seeds_table, target_table
from harness.metrics import learning_stability, reward_at_samples, version_reward, reward_progress, trailing_rewards
from harness.plots import band
from harness.run import main

ROOT = Path(__file__).resolve().parent.parent
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
SMALL = ["trainer.steps=12", "trainer.batch_size=64", "resources.rollout_gpus=2", "resources.trainer_gpus=2"]


def sets(*items):
    return [a for item in items for a in ("--set", item)]


def steps(rewards, batch=64, tokens=100, dt=10.0):
    """Trainer step_info as the trainer writes it: end time, trainings so far, what the backend said."""
    return [
        {"end_s": dt * (k + 1), "trainings": batch * (k + 1), "reward_mean": r, "tokens": tokens}
        for k, r in enumerate(rewards)
    ]


# -- the computation ------------------------------------------------------------------------------


def test_reached_at_the_first_step_whose_trailing_mean_reaches_the_target():
    m = reward_progress(steps([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), target=0.4, window=3, planned_samples=6 * 64)
    # trailing means over 3: -, -, 0.2, 0.3, 0.4, 0.5: the fifth step (index 4) reaches 0.4.
    assert m["learn/reached_target"] == 1
    assert m["learn/time_to_target_s"] == 50.0
    assert m["learn/samples_to_target"] == 5 * 64
    assert m["learn/tokens_to_target"] == 5 * 100
    assert m["learn/target_reward"] == 0.4 and m["learn/reward_window"] == 3
    assert m["learn/final_reward"] == pytest.approx(0.5)
    assert m["learn/reward_second_half"] == pytest.approx(0.5)  # steps 4-6: 0.4, 0.5, 0.6


def test_the_trailing_window_must_be_full_and_a_spike_is_averaged_away():
    # A high first batch alone does not count: the window of 3 is not full until the third step.
    m = reward_progress(steps([1.0, 0.0, 0.0, 0.0]), target=0.3, window=3, planned_samples=256)
    assert m["learn/time_to_target_s"] == 30.0 and m["learn/samples_to_target"] == 3 * 64
    # One good batch among poor ones: reached with a window of 1, not with 3.
    spike = steps([0.0, 0.0, 0.0, 0.9, 0.0, 0.0])
    assert reward_progress(spike, 0.5, 1, 384)["learn/time_to_target_s"] == 40.0
    assert reward_progress(spike, 0.5, 3, 384)["learn/reached_target"] == 0
    # Fewer steps than the window: never reached, whatever the rewards.
    assert reward_progress(steps([1.0, 1.0]), 0.3, 5, 128)["learn/reached_target"] == 0
    assert trailing_rewards([1.0, 0.0, 0.5, 0.5], 2) == [1.0, 0.5, 0.25, 0.5]


def test_not_reached_is_none_and_flag_0_never_a_number():
    m = reward_progress(steps([0.1, 0.1, 0.2, 0.2]), target=0.3, window=2, planned_samples=256)
    assert m["learn/reached_target"] == 0
    assert m["learn/time_to_target_s"] is None
    assert m["learn/samples_to_target"] is None
    assert m["learn/tokens_to_target"] is None
    assert m["learn/final_reward"] == pytest.approx(0.2)


def test_equal_rewards_at_the_target_reach_it_exactly():
    m = reward_progress(steps([0.3] * 5), target=0.3, window=5, planned_samples=320)
    assert m["learn/time_to_target_s"] == 50.0


def test_no_reward_no_keys_and_no_tokens_no_tokens_key():
    assert reward_progress([{"end_s": 1.0, "trainings": 64, "tokens": 10}], 0.3, 5, 64) == {}
    info = [{k: v for k, v in i.items() if k != "tokens"} for i in steps([0.5] * 3)]
    m = reward_progress(info, 0.3, 1, 192)
    assert "learn/tokens_to_target" not in m and m["learn/samples_to_target"] == 64


def test_reward_at_samples_is_on_the_same_grid_whatever_the_speed():
    at = reward_at_samples([64, 128, 192, 256], [0.1, 0.2, 0.3, 0.4], planned=256, points=4)
    assert at == {"trained_samples": [64, 128, 192, 256], "reward": [0.1, 0.2, 0.3, 0.4]}
    # A run that trained half its plan: the later points are its last reward, earlier ones before any step None.
    at = reward_at_samples([100, 128], [0.1, 0.2], planned=256, points=4)
    assert at["reward"] == [None, 0.2, 0.2, 0.2]
    m = reward_progress(steps([0.1] * 10), 0.3, 5, planned_samples=640)
    assert m["learn/reward_at_samples"]["trained_samples"] == [64 * (k + 1) for k in range(10)]


# -- over seeds -----------------------------------------------------------------------------------


def test_length_swing_is_the_spread_of_the_second_half_and_kl_the_mean():
    info = steps([0.1] * 4)
    for i, (kl, lens) in enumerate(zip([0.1, 0.2, 0.3, 0.6], [[50, 50], [10, 10], [30, 50], [40, 80]])):
        info[i]["behaviour_kl"], info[i]["response_lens"] = kl, lens
    m = learning_stability(info)
    assert m["learn/behaviour_kl"] == pytest.approx(0.3)
    # Second half: step means 40 and 60, std 10 around 50.
    assert m["learn/length_swing"] == pytest.approx(0.2)
    assert learning_stability(steps([0.1] * 4)) == {}


def test_version_reward_compares_the_same_policy_versions_whatever_the_lag():
    # Policy version v earns reward v / 10. Sync trains version t-1's responses at step t, async
    # at staleness 2 version t-3's: their batch rewards differ, the versions' rewards do not.
    def run(lag, n=10):
        info = steps([max(0, t - 1 - lag) / 10 for t in range(1, n + 1)])
        for t, i in enumerate(info, start=1):
            v = max(0, t - 1 - lag)
            i["sample_versions"], i["rewards"] = [v, v], [v / 10, v / 10]
        return info
    sync, stale = run(0), run(2)
    assert reward_progress(sync, 1, 1, 640)["learn/reward_second_half"] > reward_progress(stale, 1, 1, 640)["learn/reward_second_half"]
    # Versions 5 .. 10 - 1 - 2 = 7 in both.
    assert version_reward(sync, 10, 2) == version_reward(stale, 10, 2) == {"learn/version_reward_second_half": pytest.approx(0.6)}
    assert version_reward(steps([0.1] * 4), 4, 1) == {}


def test_spread_over_seeds_on_known_numbers():
    s = report.spread({0: 1.0, 1: 2.0, 2: 3.0})
    assert (s["mean"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert s["std"] == pytest.approx(1.0)  # sample standard deviation
    assert s["per_seed"] == {"0": 1.0, "1": 2.0, "2": 3.0}
    s = report.spread({0: 4.0, 1: None})
    assert (s["mean"], s["min"], s["max"], s["std"], s["n"]) == (4.0, 4.0, 4.0, 0.0, 1)
    assert report.spread({0: None, 1: None})["mean"] is None


def _rep(samples_s: float, target_s: float | None, final: float) -> dict:
    metrics = {
        "throughput/trained_samples_per_s": samples_s,
        "throughput/trained_tokens_per_s": 100 * samples_s,
        "learn/target_reward": 0.3,
        "learn/reached_target": int(target_s is not None),
        "learn/time_to_target_s": target_s,
        "learn/samples_to_target": None if target_s is None else 640,
        "learn/final_reward": final,
        "samples/lost": 0,
    }
    return {"metrics": metrics, "series": {}}


def test_ratios_to_sync_are_each_seeds_then_aggregated(tmp_path):
    sc = harness.run.load_variants(QUICK, ["seeds=[0,1]"])[0].scenario
    per_seed = {
        0: report.summary(sc, {"sync": _rep(10.0, 100.0, 0.4), "async": _rep(20.0, 50.0, 0.5)}),
        1: report.summary(sc, {"sync": _rep(20.0, 90.0, 0.3), "async": _rep(30.0, None, 0.2)}),
    }
    assert per_seed[0]["modes"]["async"]["speedup_to_target_vs_sync"] == 2.0
    assert per_seed[1]["modes"]["async"]["speedup_to_target_vs_sync"] is None
    summ = report.seeds_summary(sc, per_seed)
    assert summ["seeds"] == [0, 1]
    o = summ["over_seeds"]["async"]
    # 2.0 and 1.5 for the two seeds: 1.75, not the ratio of the means (25 / 15).
    assert o["speedup_vs_sync"]["per_seed"] == {"0": 2.0, "1": 1.5}
    assert o["speedup_vs_sync"]["mean"] == pytest.approx(1.75)
    assert o["speedup_to_target_vs_sync"]["n"] == 1 and o["speedup_to_target_vs_sync"]["mean"] == 2.0
    assert o["learn/time_to_target_s"] == {"per_seed": {"0": 50.0, "1": None}, "n": 1, "mean": 50.0, "min": 50.0, "max": 50.0, "std": 0.0}
    assert o["learn/reached_target"]["mean"] == 0.5
    assert o["learn/final_reward"]["mean"] == pytest.approx(0.35)
    assert o["throughput/trained_samples_per_s"]["std"] == pytest.approx(np.std([20.0, 30.0], ddof=1))
    # The modes section keeps a one-seed summary's shape: means, a value every seed shares as it is.
    assert summ["modes"]["async"]["throughput/trained_samples_per_s"] == 25.0
    assert summ["modes"]["async"]["samples/lost"] == 0
    assert summ["modes"]["sync"]["speedup_vs_sync"] == 1.0
    assert target_table("t", summ) is not None and seeds_table("t", summ) is not None
    assert seeds_table("t", per_seed[0]) is None


def test_band_is_on_the_grid_every_seed_covers():
    a = {"time_s": [0.0, 10.0], "reward": [0.0, 1.0]}
    b = {"time_s": [2.0, 8.0], "reward": [0.2, 0.2]}
    grid, mean, lo, hi = band([a, b], "time_s", points=4)
    assert grid[0] == 2.0 and grid[-1] == 8.0
    assert mean[0] == pytest.approx(0.2) and lo[-1] == pytest.approx(0.2) and hi[-1] == pytest.approx(0.8)


# -- end to end -----------------------------------------------------------------------------------


def test_seeds_run_every_mode_per_seed_and_summarize(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), "--no-plots", *sets(*SMALL, "modes=[sync,async]", "seeds=[0,1]")]) == 0
    for s in (0, 1):
        for mode in ("sync", "async"):
            rep = json.loads((out / f"seed-{s}" / mode / "report.json").read_text())
            assert rep["seed"] == s and rep["mode"] == mode
            assert "learn/time_to_target_s" not in rep["metrics"]  # the sim has no reward: absent, not zero
        assert json.loads((out / f"seed-{s}" / "summary.json").read_text())["seed"] == s
    assert not (out / "sync").exists()
    summ = json.loads((out / "summary.json").read_text())
    assert summ["seeds"] == [0, 1] and set(summ["modes"]) == set(summ["over_seeds"]) == {"sync", "async"}
    o = summ["over_seeds"]["async"]
    assert set(o) == {"throughput/trained_samples_per_s", "throughput/trained_tokens_per_s", "speedup_vs_sync", "speedup_vs_sync_tokens"}
    for stats in o.values():
        assert set(stats) == {"per_seed", "n", "mean", "min", "max", "std"} and set(stats["per_seed"]) == {"0", "1"}
    a0, a1 = (json.loads((out / f"seed-{s}" / "async" / "report.json").read_text())["metrics"] for s in (0, 1))
    assert a0["tokens/generated"] != a1["tokens/generated"], "each seed ran its own workload"
    assert "over seeds 0, 1" in capsys.readouterr().out


def test_one_seed_in_seeds_keeps_the_one_seed_layout(tmp_path):
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), "--no-plots", *sets(*SMALL, "modes=[async]", "seeds=[3]")]) == 0
    assert json.loads((out / "async" / "report.json").read_text())["seed"] == 3
    summ = json.loads((out / "summary.json").read_text())
    assert summ["seed"] == 3 and "over_seeds" not in summ
    assert not list(out.glob("seed-*"))


def test_several_seeds_with_checkpoints_are_refused(tmp_path):
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), *sets(*SMALL, "seeds=[0,1]", "checkpoint.every=1")]) == 2
    assert not out.exists()


def test_rewards_give_time_to_target_plots_and_table(tmp_path, monkeypatch, capsys):
    """A sim run whose trainer steps are given rewards stands in for a real one (no torch here):
    the learn/ keys, the reward figures beside the modes and the console's table."""
    run_mode = harness.run.run_mode

    def with_rewards(sc, mode, **kw):
        result = run_mode(sc, mode, **kw)
        pace = {"sync": 0.03, "async": 0.05}[mode] * (1 + 0.2 * sc.seed)
        for k, info in enumerate(result.trainer.step_info):
            info["reward_mean"] = min(1.0, pace * (k + 1))
        return result

    monkeypatch.setattr(harness.run, "run_mode", with_rewards)
    out = tmp_path / "run"
    args = [QUICK, "--out", str(out), *sets(*SMALL, "modes=[sync,async]", "seeds=[0,1]", "report.timeline=false", "learn.target_reward=0.3")]
    assert main(args) == 0
    for where in (out, out / "seed-0", out / "seed-1"):
        assert (where / "reward_vs_time.png").stat().st_size > 10_000
        assert (where / "reward_vs_samples.png").stat().st_size > 10_000
    m = json.loads((out / "seed-0" / "async" / "report.json").read_text())["metrics"]
    # async: 0.05 per step, trailing mean over 5 steps reaches 0.3 at step 8 (0.2..0.4).
    assert m["learn/reached_target"] == 1 and m["learn/samples_to_target"] == 8 * 64
    assert m["learn/time_to_target_s"] > 0 and m["learn/tokens_to_target"] > 0
    summ = json.loads((out / "summary.json").read_text())
    o = summ["over_seeds"]["async"]
    for key in ("learn/time_to_target_s", "learn/samples_to_target", "learn/final_reward", "speedup_to_target_vs_sync"):
        assert o[key]["n"] >= 1 and o[key]["mean"] is not None
    assert summ["over_seeds"]["sync"]["speedup_to_target_vs_sync"]["mean"] == pytest.approx(1.0)
    assert "time to reward 0.3" in capsys.readouterr().out
