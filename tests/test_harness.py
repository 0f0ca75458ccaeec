"""The harness end to end: validation errors, run directories, reports, determinism."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.model.owned import LOCK, STAMP, NotOwned, discard_owned, is_owned, remove_owned, stamp
from core.real.tiny_model import build
from harness.metrics import WALL_CLOCK_KEYS
from harness.run import main
from harness.scenario import ScenarioError, load, load_variants
from harness.sweep import has_sweep, load_sweep

ROOT = Path(__file__).resolve().parent.parent
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
SMALL = ["trainer.steps=12", "trainer.batch_size=64", "resources.rollout_gpus=2", "resources.trainer_gpus=2"]
REQUIRED = [
    "throughput/trained_samples_per_s", "throughput/trained_tokens_per_s", "throughput/generated_tokens_per_s",
    "latency/sample_e2e_p50_s", "latency/sample_e2e_p99_s", "latency/step_mean_s",
    "sync/pause_mean_s", "sync/transfer_mean_s",
    "util/rollout_busy", "util/trainer_busy", "util/gpu", "util/gpu_source",
    "staleness/mean", "staleness/token_mean", "staleness/max", "partial/ratio",
    "samples/produced", "samples/trained", "samples/dropped", "samples/in_flight", "samples/lost",
    "bound/trained_samples_per_s", "bound/trained_tokens_per_s", "bound/planned_trained_tokens_per_s",
    "bound/efficiency", "samples/length_bias", "tokens/wasted", "tokens/wasted_share", "sim/wall_s",
]


def sets(*items):
    return [a for item in items for a in ("--set", item)]


def test_run_writes_reports_summary_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), *sets(*SMALL)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["modes"]) == {"sync", "async", "partial", "inflight"}
    assert summary["modes"]["sync"]["speedup_vs_sync"] == pytest.approx(1.0)
    for mode in ("sync", "async", "partial", "inflight"):
        rep = json.loads((out / mode / "report.json").read_text())
        assert rep["schema"] == "asyncrl.report/1"
        assert rep["mode"] == mode and rep["seed"] == 0
        assert rep["scenario"]["trainer"]["steps"] == 12
        for key in ("machine", "packages", "git"):
            assert key in rep
        expected = "ref" if os.environ.get("ASYNCRL_PUREPYTHON") == "1" else "ext"
        assert rep["backend"] == dict.fromkeys(("squeue", "replay", "codec"), expected)
        missing = [k for k in REQUIRED if k not in rep["metrics"]]
        assert not missing
        assert rep["metrics"]["util/gpu_source"] == "modeled"
        assert (out / mode / "timeline.png").stat().st_size > 10_000
    assert "vs sync" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging directory left behind"


def test_same_scenario_and_seed_give_identical_metrics(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert main([QUICK, "--out", str(out), "--no-plots", *sets(*SMALL, "modes=[async,partial]")]) == 0
    for mode in ("async", "partial"):
        ma = json.loads((a / mode / "report.json").read_text())["metrics"]
        mb = json.loads((b / mode / "report.json").read_text())["metrics"]
        for key in WALL_CLOCK_KEYS:
            ma.pop(key), mb.pop(key)
        assert json.dumps(ma, sort_keys=True) == json.dumps(mb, sort_keys=True)


def test_a_different_seed_changes_the_workload(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    main([QUICK, "--out", str(a), "--no-plots", *sets(*SMALL, "modes=[async]")])
    main([QUICK, "--out", str(b), "--no-plots", *sets(*SMALL, "modes=[async]", "seed=1")])
    ta = json.loads((a / "async" / "report.json").read_text())["metrics"]["tokens/generated"]
    tb = json.loads((b / "async" / "report.json").read_text())["metrics"]["tokens/generated"]
    assert ta != tb


BAD = [
    # (file body or None for the quickstart file, --set items, expected fragments)
    (None, ["trainer.bach_size=32"], ["--set trainer.bach_size=32", "trainer.bach_size", "unknown key", "did you mean 'batch_size'"]),
    (None, ["trainer.steps=0"], ["trainer.steps = 0", ">= 1"]),
    (None, ["trainer.steps=lots"], ["trainer.steps = 'lots'", "integer"]),
    (None, ["trainer.batch_size=30"], ["trainer.batch_size = 30", "whole groups", "multiple of workload.group_size = 16"]),
    (None, ["modes=[sync,turbo]"], ["modes.1", "'turbo'", "one of"]),
    (None, ["staleness.admission_lead=5"], ["staleness.admission_lead = 5", "max_staleness"]),
    (None, ["trainer"], ["expected dotted.key=value"]),
    (None, ["workload.group_size.x=1"], ["'group_size' is not a section"]),
    ("trainer:\n  steps: [1\n", [], ["not valid YAML", "line"]),
    ("- a\n- b\n", [], ["top level is a list"]),
    ("trainer:\n  sync_every: -1\n", [], ["trainer.sync_every = -1", ">= 1"]),
    ("resources:\n  rollout_gpus: 3\n  gpus_per_engine: 2\n", [], ["resources.rollout_gpus = 3", "multiple of 2"]),
    ("gpu:\n  hbm_gb_s: 0\n", [], ["gpu.hbm_gb_s = 0", "> 0"]),
]


@pytest.mark.parametrize("body,overrides,expected", BAD)
def test_bad_input_gives_one_clear_error_and_exit_2(tmp_path, body, overrides, expected):
    path = QUICK
    if body is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(body)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", str(path), "--out", str(out), *sets(*overrides)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ASYNCRL_PUREPYTHON": os.environ.get("ASYNCRL_PUREPYTHON", "1")},
    )
    assert proc.returncode == 2
    err = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert err.startswith("error:") and err.count("error:") == 1
    for fragment in expected:
        assert fragment in err
    assert not out.exists()
    assert not any(tmp_path.glob(".run.*"))


def test_out_never_replaces_a_directory_that_is_not_a_run(tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    assert main([QUICK, "--out", str(keep), "--no-plots", *sets(*SMALL)]) == 2
    assert (keep / "notes.txt").read_text() == "precious"
    (keep / "summary.json").write_text("{}")  # the user's own file of that name makes it no run of ours
    assert main([QUICK, "--out", str(keep), "--no-plots", *sets(*SMALL)]) == 2
    assert sorted(p.name for p in keep.iterdir()) == ["notes.txt", "summary.json"]
    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", *sets(*SMALL, "modes=[async]")]) == 0
    assert main([QUICK, "--out", str(run), "--no-plots", *sets(*SMALL, "modes=[partial]")]) == 0
    assert sorted(p.name for p in run.iterdir()) == [LOCK, STAMP, "partial", "summary.json"]


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ScenarioError, match=r"nope\.yaml: no such file"):
        load(tmp_path / "nope.yaml")


def test_every_shipped_scenario_validates():
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        scenarios = [p.scenario for p in load_sweep(path).points] if has_sweep(path) else [v.scenario for v in load_variants(path)]
        for sc in scenarios:
            assert sc is None or sc.name == path.stem, f"{path.name}: name should match the file"
        header = path.read_text().splitlines()[0]
        assert header.startswith("#"), f"{path.name} must open with a comment saying what it models"


def test_variants_run_side_by_side_with_published_figures(tmp_path, capsys):
    body = (ROOT / "scenarios" / "verl-table.yaml").read_text()
    path = tmp_path / "verl-table.yaml"
    path.write_text(body)
    out = tmp_path / "run"
    assert main([str(path), "--out", str(out), "--no-plots", *sets("trainer.steps=8", "trainer.batch_size=256")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["variants"]) == ["16-16", "32-32", "64-64"]
    assert summary["variants"]["64-64"]["published"]["speedup_vs_sync"] == 2.35
    for label in summary["variants"]:
        rep = json.loads((out / label / "partial" / "report.json").read_text())
        assert rep["scenario"]["trainer"]["steps"] == 8
    assert "predicted vs published" in capsys.readouterr().out


def test_a_bad_variant_names_the_variant(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text("variants:\n  a:\n    set: {trainer.steps: 0}\n")
    with pytest.raises(ScenarioError, match=r"v.yaml: variants.a.set: trainer.steps = 0"):
        load_variants(path)


def test_a_directory_without_asyncrl_s_stamp_is_never_removed(tmp_path):
    mine = tmp_path / "user"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    with pytest.raises(NotOwned):
        remove_owned(mine, "run")
    with pytest.raises(NotOwned):
        build(mine)  # a model path that already holds the user's files
    assert (mine / "thesis.tex").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "the build's staging directory is gone"
    (mine / "summary.json").write_text("{}")  # a file of the name asyncrl writes is no stamp
    with pytest.raises(NotOwned):
        remove_owned(mine, "run")
    (mine / STAMP).write_text("asyncrl")  # nor is a stamp file asyncrl did not write
    with pytest.raises(NotOwned):
        remove_owned(mine, "run")
    stamp(mine, "sweep")  # a stamp of another kind
    with pytest.raises(NotOwned):
        remove_owned(mine, "run")
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(NotOwned):
        remove_owned(link, "sweep")  # a link is never followed into a removal
    assert (mine / "thesis.tex").is_file()
    discard_owned(mine, "run")  # cleanup after a failure leaves what it does not own, silently
    assert (mine / "thesis.tex").is_file()
    assert is_owned(mine, "sweep") and not is_owned(mine, "run")
    remove_owned(mine, "sweep")
    assert not mine.exists()
    remove_owned(mine, "sweep")  # already gone: nothing to do


def test_only_the_ownership_gate_removes_directories():
    roots = [Path(__file__).resolve().parent.parent / d for d in ("core", "harness")]
    calls = [(p, n) for r in roots for p in r.rglob("*.py") for n, line in enumerate(p.read_text().splitlines(), 1)
             if "rmtree(" in line and not line.lstrip().startswith("#")]
    assert [p.name for p, _ in calls] == ["owned.py"], calls


def test_a_run_that_exhausts_its_restarts_ends_in_one_error_line(tmp_path, capsys):
    # Calls that always run past their timeout: only running shows it, so no exit 2 up front,
    # but the end is one line with the fix, not a traceback, and nothing half-written is left.
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), "--no-plots", *sets(*SMALL, "modes=[async]", "timeouts.generate_s=30")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = " ".join(err.strip().split("error:")[-1].split())
    assert err.count("error:") == 1 and "more than recovery.max_restarts" in last and "fix: raise timeouts.generate_s" in last
    assert not out.exists()
