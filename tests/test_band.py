"""The error band (core/sim/band.py, harness/band.py, ``--band``): what it draws, from which ranges,
what it reports, and what it refuses before anything runs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.model.config import Scenario, with_changes
from core.sim import band
from harness import band as harness_band

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"resources": {"rollout_gpus": 2, "trainer_gpus": 2}, "workload": {"group_size": 4, "max_response_len": 2000},
         "trainer": {"batch_size": 16, "steps": 6, "sync_every": 2}, "modes": ["sync", "async"], "band": {"points": 4}}


def test_a_latin_hypercube_puts_one_point_in_each_stratum_of_every_input():
    u = band.latin_hypercube(16, 5, seed=3)
    assert u.shape == (16, 5)
    for d in range(5):
        assert sorted(np.floor(u[:, d] * 16).astype(int)) == list(range(16))
    assert np.array_equal(u, band.latin_hypercube(16, 5, seed=3))
    assert not np.array_equal(u, band.latin_hypercube(16, 5, seed=4))


def test_draws_stay_in_their_ranges_and_whole_numbers_stay_whole():
    sc = Scenario()
    ks, values = band.draws(sc)
    assert values.shape == (sc.band.points, len(ks))
    for i, k in enumerate(ks):
        assert np.all((values[:, i] >= k.low * (1 - 1e-12)) & (values[:, i] <= k.high * (1 + 1e-12))), k.key
    change = band.changes(sc, ks, values[0])
    assert isinstance(change["workload.response_median"], int)
    with_changes(sc, change)  # every point is a scenario the checks take


def test_the_inputs_are_those_that_can_move_the_figures():
    keys = lambda sc: {k.key for k in band.knobs(sc)}  # noqa: E731
    plain = keys(Scenario())
    assert "rollout.eager_layer_s" not in plain and "trainer.micro_batch_half_tokens" not in plain
    eager = keys(with_changes(Scenario(), {"rollout.enforce_eager": True, "trainer.micro_batch_tokens": 8192}))
    assert {"rollout.eager_layer_s", "trainer.micro_batch_half_tokens"} <= eager
    assert "rollout.eager_moe_layer_s" not in eager  # a dense model
    # a scenario's own ranges replace or add
    mine = with_changes(Scenario(), {"band.ranges": {"trainer.mfu": [0.2, 0.3], "rollout.max_num_seqs": [128, 512]}})
    by = {k.key: k for k in band.knobs(mine)}
    assert (by["trainer.mfu"].low, by["trainer.mfu"].high) == (0.2, 0.3)
    assert "rollout.max_num_seqs" in by


def test_a_calibration_replaces_the_roofline_inputs_by_its_own_error():
    cal = {"decode_overhead_s": 0.01, "decode_per_seq_s": 1e-4, "decode_kv_s_per_token": 1e-8, "prefill_s_per_token": 1e-5,
           "train_overhead_s": 0.1, "train_s_per_token": 1e-5, "train_s_per_token_sq": 0.0, "train_devices": 1, "transfer_s": 0.2,
           "decode_error": 0.05, "train_error": 0.1, "transfer_error": 0.0}
    sc = with_changes(Scenario(), {"calibrated": cal})
    by = {k.key: k for k in band.knobs(sc)}
    assert "trainer.mfu" not in by and "rollout.decode_overhead_s" not in by and "sync.bandwidth_gb_s" not in by
    assert (by["calibrated.decode"].low, by["calibrated.decode"].high) == pytest.approx((0.9, 1.1))
    assert (by["calibrated.train"].low, by["calibrated.train"].high) == pytest.approx((0.8, 1.2))
    assert "calibrated.transfer" not in by  # no spread measured: nothing to draw
    ks, values = band.draws(sc)
    i = [k.key for k in ks].index("calibrated.train")
    change = band.changes(sc, ks, values[0])
    assert change["calibrated.train_s_per_token"] == pytest.approx(1e-5 * values[0, i])


def test_a_measured_length_file_leaves_the_lengths_out(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([100, 200, 300, 400]))
    sc = with_changes(Scenario(), {"workload.lengths": str(lengths)})
    assert not {"workload.response_median", "workload.response_sigma"} & {k.key for k in band.knobs(sc)}


def test_the_summary_names_the_input_that_moves_the_speedup_most():
    ks = [band.Knob("a", 1, 2, ""), band.Knob("b", 1, 2, "")]
    rng = np.random.default_rng(0)
    values = rng.random((32, 2)) + 1
    speed = 3 - values[:, 1] + 0.01 * values[:, 0]
    out = band.summarize(ks, values, speed)
    assert out["measure_first"] == "b" and out["measure_first_rank_corr"] < -0.9
    assert out["p10"] <= out["p50"] <= out["p90"]
    assert band.inside(out, out["p50"]) and not band.inside(out, out["p90"] + 1)
    failed = band.summarize(ks, values, np.full(32, np.nan))
    assert failed == {"points": 0}


@pytest.mark.parametrize("ranges, fix", [
    ({"trainer.nope": [1, 2]}, "names no key"),
    ({"trainer.recompute_logprobs": [1, 2]}, "not a number field"),
    ({"trainer.mfu": [0.5, 0.1]}, "not a range"),
    ({"trainer.mfu": [0, 0.1]}, "not a range"),
])
def test_a_bad_range_is_refused_by_its_key(ranges, fix):
    with pytest.raises(ValueError, match=fix):  # pydantic wraps the ConfigError
        with_changes(Scenario(), {"band.ranges": ranges})


def test_band_run_writes_intervals_into_the_summary_reports_and_picture(tmp_path):
    sc = Scenario.model_validate(SMALL)
    drawn = harness_band.compute(sc, workers=1)
    assert drawn["points"] == 4 and drawn["failed"] == 0
    b = drawn["modes"]["async"]
    assert b["points"] == 4 and b["p10"] <= b["p90"] and b["samples"]["p10"] <= b["samples"]["p90"]
    # the same draws give the same band
    assert harness_band.compute(sc, workers=1)["modes"] == drawn["modes"]


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "harness.run", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_the_cli_draws_the_band_and_writes_it_everywhere(tmp_path):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(json.dumps({**SMALL, "name": "small"}))
    out = tmp_path / "run"
    r = _run(str(scenario), "--band", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "band: 4 draws" in r.stdout and "measure first" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    lo, mid, hi = summary["modes"]["async"]["speedup_band"]
    assert lo <= mid <= hi
    assert summary["band"]["inputs"]
    assert "band" in json.loads((out / "async" / "report.json").read_text())
    assert (out / "summary.png").stat().st_size > 10_000


@pytest.mark.parametrize("change, words", [
    ({"modes": ["async", "partial"]}, "list sync and at least one other mode"),
    ({"seeds": [0, 1]}, "draw the band for one seed"),
])
def test_the_cli_refuses_a_band_it_cannot_draw_before_anything_runs(tmp_path, change, words):
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(json.dumps({**SMALL, "name": "bad", **change}))
    out = tmp_path / "run"
    r = _run(str(scenario), "--band", "--out", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "fix:" in lines[0]
    assert not out.exists()
