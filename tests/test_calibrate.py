"""Calibration (harness/calibrate.py) and empirical lengths (workload.lengths).

The fit is checked on spans generated from a known cost model: it recovers the
coefficients, and a sim run of the calibrated scenario matches the run they came from.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from core.model.config import ConfigError, Placement, Scenario, with_changes
from core.runtimes.dispatch import run_mode
from core.model.run_plan import RunPlan
from core.runtimes.sim import run_sim
from core.sim.costs import DecodeCost, TrainCost
from core.sim.workload import Workload
from harness import calibrate
from harness.calibrate import fit_spans, main, nnls
from harness.metrics import collect
from harness.scenario import load
from harness.spans import SCHEMA, calibration_spans

ROOT = Path(__file__).resolve().parent.parent

KNOWN = {
    "decode_overhead_s": 0.004, "decode_per_seq_s": 0.0003, "decode_kv_s_per_token": 2e-6,
    "prefill_s_per_token": 5e-5, "train_overhead_s": 0.05, "train_s_per_token": 2e-4,
    "train_s_per_token_sq": 1e-7, "train_devices": 2, "transfer_s": 0.03,
}


def truth() -> Scenario:
    """A small sim scenario whose costs are the known coefficients."""
    return Scenario.model_validate({
        "name": "truth", "seed": 3, "modes": ["sync", "async", "partial"],
        "resources": {"rollout_gpus": 1, "trainer_gpus": 1},
        "workload": {"group_size": 8, "prompt_tokens": 40, "response_median": 30, "response_sigma": 0.6,
                     "prompt_share": 0.4, "max_response_len": 128},
        "rollout": {"max_num_seqs": 64},
        "trainer": {"batch_size": 64, "sync_every": 1, "steps": 30},
        "staleness": {"max_staleness": 1},
        "calibrated": KNOWN,
    })


def synthetic_spans(sc: Scenario, noise: float = 0.0, seed: int = 0) -> dict:
    """The spans a real sync run of ``sc`` would record if its costs were exactly ``sc``'s."""
    rng = np.random.default_rng(seed)
    place = Placement.of(sc, "sync")
    dc, tc = DecodeCost(sc, 1), TrainCost(sc, place.trainer_gpus)
    jitter = lambda x: x * (1.0 + noise * rng.standard_normal())  # noqa: E731
    b = rng.integers(1, 65, 400)
    c = b * rng.integers(40, 170, 400)
    decode = [[int(x), int(y), jitter(dc.step_s(int(x), float(y)))] for x, y in zip(b, c)]
    prefill = [[int(n), jitter(dc.prefill_s(0, int(n)))] for n in rng.integers(40, 400, 50)]
    lens = Workload(sc.workload, sc.seed).sample_lengths(240).ravel()
    train = []
    for i in range(30):
        seqs = sc.workload.prompt_tokens + lens[i * 64:(i + 1) * 64]
        tok, sq = int(seqs.sum()), int((seqs**2).sum())
        train.append([tok, sq, jitter(tc.step_s(tok, sq)), 2])
    return {
        "schema": SCHEMA, "mode": "sync", "scenario": sc.model_dump(mode="json"),
        "placement": {"colocated": True, "engines": place.engines, "gpus_per_engine": 1, "trainer_gpus": place.trainer_gpus},
        "engines": {"engine000": {"decode": decode, "prefill": prefill}},
        "train": train, "transfer_s": [KNOWN["transfer_s"]] * 29, "drain_s": [0.0] * 29,
        "response_lens": [int(x) for x in lens[:30 * 64]], "prompt_lens": [sc.workload.prompt_tokens] * (30 * 64),
        "end_s": 1.0,
    }


def test_nnls_recovers_coefficients_and_keeps_them_non_negative():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(200), rng.uniform(1, 64, 200), rng.uniform(100, 9000, 200)])
    fit = nnls(X, X @ np.array([0.01, 0.002, 3e-6]), ("1", "b", "c"))
    assert fit.coef == pytest.approx((0.01, 0.002, 3e-6), rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    # A term the data pulls negative is dropped, not kept negative.
    y = 0.5 - 0.001 * X[:, 1]
    assert min(nnls(X, y, ("1", "b", "c")).coef) >= 0.0


def test_fit_recovers_the_cost_model_from_synthetic_spans():
    cal = fit_spans(synthetic_spans(truth()))
    assert cal.decode["1"] == pytest.approx(KNOWN["decode_overhead_s"], rel=1e-6)
    assert cal.decode["running"] == pytest.approx(KNOWN["decode_per_seq_s"], rel=1e-6)
    assert cal.decode["context"] == pytest.approx(KNOWN["decode_kv_s_per_token"], rel=1e-6)
    assert cal.prefill["tokens"] == pytest.approx(KNOWN["prefill_s_per_token"], rel=1e-6)
    assert cal.train["1"] == pytest.approx(KNOWN["train_overhead_s"], rel=1e-4)
    assert cal.train["tokens"] == pytest.approx(KNOWN["train_s_per_token"], rel=1e-3)
    assert cal.train["tokens_sq"] == pytest.approx(KNOWN["train_s_per_token_sq"], rel=1e-2)
    assert cal.transfer_s == pytest.approx(KNOWN["transfer_s"])
    assert cal.train_devices == 2
    # 5 % noise per step: the coefficients that carry the time stay within a few percent.
    noisy = fit_spans(synthetic_spans(truth(), noise=0.05, seed=1))
    assert noisy.decode["running"] == pytest.approx(KNOWN["decode_per_seq_s"], rel=0.1)
    assert noisy.decode["context"] == pytest.approx(KNOWN["decode_kv_s_per_token"], rel=0.1)
    # The fits' errors go with the coefficients, for the band to draw within (docs/band.md):
    # none on exact spans, about the noise on noisy ones.
    exact, rough = cal.calibrated("x", {}), noisy.calibrated("x", {})
    assert exact["decode_error"] == pytest.approx(0, abs=1e-6) and exact["train_error"] == pytest.approx(0, abs=1e-3)
    assert 0.01 < rough["decode_error"] < 0.1 and 0.01 < rough["train_error"] < 0.1


def test_round_trip_sim_spans_calibrate_sim(tmp_path, monkeypatch):
    """sim -> spans -> calibrate -> sim: the calibrated scenario (fitted costs, the run's
    lengths as an empirical file) predicts every mode of the original within 3 %."""
    monkeypatch.chdir(tmp_path)
    sc = truth()
    run = tmp_path / "run"
    (run / "sync").mkdir(parents=True)
    (run / "sync" / "spans.json").write_text(json.dumps(synthetic_spans(sc)))
    assert main([str(run), "-o", "cal.yaml"]) == 0
    written = yaml.safe_load(Path("cal.yaml").read_text())
    assert written["runtime"] == "sim" and written["workload"]["lengths"] == "cal.lengths.json"
    cal_sc = Scenario.model_validate(written)
    for mode in ("sync", "async", "partial"):
        a, b = collect(run_sim(RunPlan.of(sc, mode))), collect(run_sim(RunPlan.of(cal_sc, mode)))
        for key in ("throughput/trained_samples_per_s", "throughput/trained_tokens_per_s"):
            assert b[key] == pytest.approx(a[key], rel=0.03), (mode, key)


def test_calibrated_train_cost_scales_by_the_measured_speedup():
    sc = truth()
    at_2 = KNOWN["train_overhead_s"] + 1000 * KNOWN["train_s_per_token"]
    assert TrainCost(sc, 2).step_s(1000, 0) == pytest.approx(at_2)
    assert TrainCost(sc, 1).step_s(1000, 0) == pytest.approx(2 * at_2)  # 2 devices -> 1: twice as long
    measured = with_changes(sc, {"calibrated.train_speedup": {1: 0.8}})
    assert TrainCost(measured, 1).step_s(1000, 0) == pytest.approx(at_2 / 0.8)


# -- empirical lengths --------------------------------------------------------------------------

def test_empirical_lengths_follow_the_file_and_keep_the_group_correlation(tmp_path):
    f = tmp_path / "lens.json"
    f.write_text(json.dumps([10, 20, 30, 40, 100]))
    sc = Scenario.model_validate({"workload": {"group_size": 8, "lengths": str(f), "prompt_share": 0.9}})
    x = Workload(sc.workload, 0).sample_lengths(4000)
    values, counts = np.unique(x, return_counts=True)
    assert list(values) == [10, 20, 30, 40, 100]
    assert np.allclose(counts / counts.sum(), 0.2, atol=0.02)
    # prompt_share 0.9: a group's responses are mostly alike; 0: independent.
    indep = Scenario.model_validate({"workload": {"group_size": 8, "lengths": str(f), "prompt_share": 0.0}})
    y = Workload(indep.workload, 0).sample_lengths(4000)
    assert x.std(axis=1).mean() < 0.5 * y.std(axis=1).mean()
    # Same seed, same lengths: every mode sees one workload.
    assert np.array_equal(x, Workload(sc.workload, 0).sample_lengths(4000))


@pytest.mark.parametrize("content", [{"12": 3, "40": 1}, {"edges": [1, 10, 100], "counts": [3, 1]}])
def test_histogram_files(tmp_path, content):
    f = tmp_path / "h.yaml"
    f.write_text(yaml.safe_dump(content))
    sc = Scenario.model_validate({"workload": {"group_size": 4, "lengths": str(f), "max_response_len": 1000}})
    x = Workload(sc.workload, 0).sample_lengths(2000)
    if "edges" in content:
        assert x.min() >= 1 and x.max() <= 100
        assert np.mean(x <= 10) == pytest.approx(0.75, abs=0.03)  # rounding moves [9.5, 10) to 10
    else:
        assert set(np.unique(x)) == {12, 40}
        assert np.mean(x == 12) == pytest.approx(0.75, abs=0.03)


def test_no_lengths_file_leaves_the_lognormal_as_it_was():
    sc = Scenario()
    assert sc.workload.lengths is None
    x = Workload(sc.workload, 0).sample_lengths(100)
    s = sc.workload
    rng = np.random.default_rng([0, 0])
    zp, zr = rng.standard_normal((1024, 1)), rng.standard_normal((1024, s.group_size))
    z = np.sqrt(s.prompt_share) * zp + np.sqrt(1 - s.prompt_share) * zr
    want = np.clip(np.rint(s.response_median * np.exp(s.response_sigma * z)), 1, s.max_response_len)[:100]
    assert np.array_equal(x, want)


@pytest.mark.parametrize("content", ["", "[]", "[-3, 4]", "{a: b}", "{edges: [1, 2], counts: [1, 2]}", "[0, 0]", ": :"])
def test_bad_lengths_file_is_one_config_error(tmp_path, content):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    with pytest.raises(Exception) as info:
        Scenario.model_validate({"workload": {"lengths": str(f)}})
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, ConfigError) and cause.key == "workload.lengths"


def test_bad_lengths_file_exits_2_from_the_cli(tmp_path, capsys):
    from harness.run import main as run_main

    out = tmp_path / "out"
    code = run_main([str(ROOT / "scenarios" / "quickstart.yaml"), "--out", str(out), "--set", f"workload.lengths={tmp_path / 'none.json'}"])
    err = capsys.readouterr().err
    assert code == 2 and "workload.lengths" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


# -- the CLI's bad input ------------------------------------------------------------------------

def _run_dir(tmp_path: Path, spans: dict | str | None) -> Path:
    run = tmp_path / "run"
    (run / "sync").mkdir(parents=True)
    if spans is not None:
        (run / "sync" / "spans.json").write_text(spans if isinstance(spans, str) else json.dumps(spans))
    return run


@pytest.mark.parametrize("case", ["no-dir", "no-spans", "not-json", "wrong-schema", "no-train", "bad-speedup", "bad-factor",
                                  "phases-no-yaml", "phases-not-a-table", "phases-missing-key"])
def test_calibrate_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    spans = synthetic_spans(truth())
    args: list[str]
    if case == "no-dir":
        args = [str(tmp_path / "nowhere")]
    elif case == "no-spans":
        args = [str(_run_dir(tmp_path, None))]
    elif case == "not-json":
        args = [str(_run_dir(tmp_path, "{not json"))]
    elif case == "wrong-schema":
        args = [str(_run_dir(tmp_path, {**spans, "schema": "other/0"}))]
    elif case == "no-train":
        args = [str(_run_dir(tmp_path, {**spans, "train": []}))]
    elif case == "bad-speedup":
        args = [str(_run_dir(tmp_path, spans)), "--train-speedup", "one=fast"]
    elif case == "bad-factor":
        args = [str(_run_dir(tmp_path, spans)), "--separated-decode-speedup", "0"]
    else:
        bad = tmp_path / "phases.yaml"
        bad.write_text({"phases-no-yaml": "a: [unclosed", "phases-not-a-table": "[1, 2]", "phases-missing-key": "fit: x"}[case])
        args = [str(bad)]
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written


def test_published_phase_times_give_cost_changes(capsys):
    assert main([str(ROOT / "scenarios" / "published" / "verl-fully-async-7b.yaml")]) == 0
    assert "rollout.decode_overhead_s" in capsys.readouterr().out


def test_sim_runs_write_no_spans():
    assert calibration_spans(run_sim(RunPlan.of(with_changes(truth(), {"trainer.steps": 2}), "async"))) is None


def test_real_run_writes_spans_that_calibrate(tmp_path, tiny_model_dir, monkeypatch):
    """A short real sync run on the local runtime records every kind of span, and the CLI
    turns them into a scenario that runs on the sim."""
    sc = with_changes(load(ROOT / "scenarios" / "real-cpu-torch.yaml"), {
        "tiny_model.path": str(tiny_model_dir), "trainer.steps": 4, "trainer.batch_size": 32,
        "workload.max_response_len": 48, "eval.every": 0, "modes": ["sync"],
    })
    result = run_mode(sc, "sync")
    spans = calibration_spans(result)
    assert spans is not None
    rows = spans["engines"]["engine000"]
    assert rows["decode"] and rows["prefill"] and len(spans["train"]) == 4
    assert len(spans["response_lens"]) == 4 * sc.trainer.batch_size
    assert all(r[0] >= 1 and r[2] > 0 for r in rows["decode"])
    run = tmp_path / "run"
    (run / "sync").mkdir(parents=True)
    (run / "sync" / "spans.json").write_text(json.dumps(spans))
    monkeypatch.chdir(tmp_path)
    assert main([str(run), "-o", "cal.yaml"]) == 0
    cal_sc = Scenario.model_validate(yaml.safe_load(Path("cal.yaml").read_text()))
    assert collect(run_sim(RunPlan.of(cal_sc, "sync")))["samples/trained"] == 4 * sc.trainer.batch_size


def test_module_is_the_cli():
    assert calibrate.__doc__.startswith("``python -m harness.calibrate")
