"""Sweeps: the grid and its labels, linked axes, constraints, ranking, refused points, and a small
sweep end to end in worker processes."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from harness.console import sweep_table
from harness.run import main
from harness.scenario import ScenarioError, load
from harness.sweep import Axis, grid, heatmap_cells, load_sweep, parse_constraint, rank

ROOT = Path(__file__).resolve().parent.parent
# The quickstart's cost model on 4 GPUs: a point runs in a fraction of a second.
BASE = """\
name: tiny
modes: [async, partial]
resources: {rollout_gpus: 2, trainer_gpus: 2}
workload: {group_size: 16, max_response_len: 16384}
trainer: {batch_size: 64, sync_every: 2, steps: 8}
staleness: {max_staleness: 2, admission_lead: 0.5}
"""
SWEEP = BASE + """\
sweep:
  axes:
    split:
      - {resources.rollout_gpus: 1, resources.trainer_gpus: 3}
      - {resources.rollout_gpus: 3, resources.trainer_gpus: 1}
    staleness.max_staleness: [1, 2, 3]
  constraints: ["staleness/max <= 1", "gpus <= 4"]
  mode: partial
"""


def write(tmp_path, body, name="s.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_grid_is_every_combination_first_axis_outermost_with_readable_labels(tmp_path):
    sweep = load_sweep(write(tmp_path, SWEEP))
    assert [a.name for a in sweep.axes] == ["split", "staleness.max_staleness"]
    assert sweep.axes[0].labels == ("1:3", "3:1")  # a linked entry without a label: its values
    assert [p.label for p in sweep.points] == [
        f"split={s}__max_staleness={m}" for s in ("1-3", "3-1") for m in (1, 2, 3)
    ]
    p = sweep.points[4]
    assert p.values == {"split": "3:1", "staleness.max_staleness": "2"}
    assert p.settings == {"resources.rollout_gpus": 3, "resources.trainer_gpus": 1, "staleness.max_staleness": 2}
    assert (p.scenario.resources.rollout_gpus, p.scenario.resources.trainer_gpus, p.scenario.staleness.max_staleness) == (3, 1, 2)
    assert p.scenario.trainer.steps == 8  # everything else is the file's
    assert sweep.objective == "throughput/trained_tokens_per_s" and sweep.goal == "max"


def test_linked_axes_take_labels_and_may_set_different_keys(tmp_path):
    body = BASE + """\
sweep:
  axes:
    policy:
      strict: {staleness.max_staleness: 0, staleness.admission_lead: 0}
      loose: {staleness.max_staleness: 3}
  mode: partial
"""
    sweep = load_sweep(write(tmp_path, body))
    strict, loose = (p.scenario.staleness for p in sweep.points)
    assert [p.label for p in sweep.points] == ["policy=strict", "policy=loose"]
    assert (strict.max_staleness, strict.admission_lead) == (0, 0)
    assert (loose.max_staleness, loose.admission_lead) == (3, 0.5)


def test_grid_of_three_axes():
    axes = (Axis("a", ("1", "2"), ({"a": 1}, {"a": 2})), Axis("b", ("x",), ({"b": "x"},)), Axis("c", ("3", "4"), ({"c": 3}, {"c": 4})))
    assert [s for _, s in grid(axes)] == [
        {"a": 1, "b": "x", "c": 3}, {"a": 1, "b": "x", "c": 4}, {"a": 2, "b": "x", "c": 3}, {"a": 2, "b": "x", "c": 4},
    ]


@pytest.mark.parametrize("text,key,op,bound", [
    ("staleness/max <= 2", "staleness/max", "<=", 2.0),
    ("gpus<=128", "gpus", "<=", 128.0),
    ("  samples/length_bias >= 0.95 ", "samples/length_bias", ">=", 0.95),
    ("bound/efficiency > 1e-1", "bound/efficiency", ">", 0.1),
    ("staleness/max != -1", "staleness/max", "!=", -1.0),
])
def test_constraints_parse(text, key, op, bound):
    c = parse_constraint(text)
    assert (c.key, c.op, c.bound) == (key, op, bound)
    assert c.holds(bound) == (op in ("<=", ">=", "=="))


@pytest.mark.parametrize("text", [
    "staleness/max <= two", "staleness/max =< 2", "staleness/max", "<= 2", "staleness/max <= 2 and gpus <= 4",
    "__import__('os').system('true') <= 1", "rollout_gpus <= 4", 3,
])
def test_bad_constraints_are_refused(text):
    with pytest.raises(ScenarioError, match="fix:"):
        parse_constraint(text)


BAD = [
    # (sweep section, fragments of the one error line)
    ("  axes: {staleness.max_stalenes: [1, 2]}\n  mode: partial\n",
     ["sweep.axes.staleness.max_stalenes", "unknown key", "did you mean 'max_staleness'"]),
    ("  axes: {staleness.max_staleness: [1, -1]}\n  mode: partial\n",
     ["sweep.axes.staleness.max_staleness", "staleness.max_staleness = -1", ">= 0"]),
    ("  axes: {trainer.steps: [4, 4]}\n  mode: partial\n", ["sweep.axes.trainer.steps", "listed twice"]),
    ("  axes: {trainer.steps: [4]}\n  constraints: ['staleness/max <= two']\n  mode: partial\n",
     ["sweep.constraints[0]", "'staleness/max <= two'", "KEY OP NUMBER"]),
    ("  axes: {trainer.steps: [4]}\n  constraints: ['staleness/maxx <= 2']\n  mode: partial\n",
     ["sweep.constraints[0]", "staleness/maxx is not a report metric", "did you mean 'staleness/max'"]),
    ("  axes: {trainer.steps: [4]}\n  objective: bound/limited_by\n  mode: partial\n",
     ["sweep.objective", "bound/limited_by is not a number"]),
    ("  axes: {trainer.steps: [4]}\n", ["sweep.mode", "is required"]),
    ("  axes: {trainer.steps: [4]}\n  mode: sync\n", ["sweep.mode = 'sync'", "not one of the modes"]),
    ("  axes: {trainer.steps: [4]}\n  mode: partial\n  worker: 2\n", ["sweep.worker", "did you mean 'workers'"]),
    ("  axes: {trainer.steps: [4]}\n  mode: partial\n  heatmap: [nope]\n", ["sweep.heatmap", "axis names"]),
    ("  axes: {pair: [{trainer.steps: 4}, 5]}\n  mode: partial\n", ["sweep.axes.pair", "not a mapping"]),
    ("  axes: {staleness.max_staleness: [0]}\n  mode: partial\n", ["every one of the 1 points is refused", "admission_lead"]),
    ("  axes: {a: [{trainer.steps: 4}], b: [{trainer.steps: 5}]}\n  mode: partial\n", ["sweep.axes.b", "sets trainer.steps", "axis 'a'"]),
]


@pytest.mark.parametrize("section,expected", BAD)
def test_a_bad_sweep_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, section, expected):
    path = write(tmp_path, BASE + "sweep:\n" + section)
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert err.startswith("error:") and err.count("error:") == 1 and not captured.out
    for fragment in expected:
        assert fragment in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["s.yaml"]


def test_the_command_line_gives_the_same_one_line(tmp_path):
    path = write(tmp_path, BASE + "sweep:\n" + BAD[0][0])
    proc = subprocess.run([sys.executable, "-m", "harness.run", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert " ".join(proc.stderr.split()).count("error:") == 1 and "did you mean 'max_staleness'" in proc.stderr


def test_set_on_an_axis_key_is_refused_and_sweep_keys_can_be_set(tmp_path):
    path = write(tmp_path, SWEEP)
    with pytest.raises(ScenarioError, match=r"staleness.max_staleness is set by sweep axis"):
        load_sweep(path, ["staleness.max_staleness=1"])
    sweep = load_sweep(path, ["sweep.workers=1", "trainer.steps=4", "sweep.goal=min"])
    assert sweep.workers == 1 and sweep.goal == "min"
    assert all(p.scenario.trainer.steps == 4 for p in sweep.points)


def known(thr, tokens, stale, eff=0.9):
    m = {"throughput/trained_samples_per_s": thr, "throughput/trained_tokens_per_s": tokens, "staleness/max": stale, "bound/efficiency": eff}
    return {"modes": {"async": m, "partial": m}, "cpu_s": 1.0}


def test_best_is_the_top_objective_among_points_that_meet_the_constraints(tmp_path):
    sweep = load_sweep(write(tmp_path, SWEEP))  # constraints: staleness/max <= 1, gpus <= 4
    results = {
        0: known(10, 1000, 1),
        1: known(30, 9000, 2),  # the highest objective, but too stale
        2: known(20, 5000, 1),  # the best that meets the constraints
        3: known(50, 4000, 0),  # most samples/s: the objective is tokens/s
        4: {"error": "RuntimeError: boom"},
        5: known(20, 5000, 1),  # ties with point 2: the first in grid order wins
    }
    rows, best = rank(sweep, results)
    assert best["label"] == sweep.points[2].label
    assert [r["status"] for r in rows] == ["ok", "violates", "ok", "ok", "failed", "ok"]
    assert rows[1]["reason"] == "staleness/max <= 1"
    assert rows[4]["reason"] == "RuntimeError: boom"
    assert rows[2]["metrics"]["gpus"] == 4
    low = load_sweep(sweep.path, ["sweep.goal=min", "sweep.objective=throughput/trained_samples_per_s"])
    assert rank(low, results)[1]["label"] == sweep.points[0].label
    none_fit = {i: known(1, 1, 3) for i in range(6)}
    rows, best = rank(sweep, none_fit)
    assert best is None and {r["status"] for r in rows} == {"violates"}


def test_gpus_constraint_counts_the_ranked_modes_placement(tmp_path):
    body = SWEEP.replace("gpus <= 4", "gpus <= 5").replace("rollout_gpus: 3, resources.trainer_gpus: 1", "rollout_gpus: 4, resources.trainer_gpus: 2")
    sweep = load_sweep(write(tmp_path, body))
    rows, best = rank(sweep, {i: known(1, 100 + i, 0) for i in range(6)})
    assert [r["metrics"]["gpus"] for r in rows] == [4, 4, 4, 6, 6, 6]
    assert [r["status"] for r in rows] == ["ok"] * 3 + ["violates"] * 3
    assert best["label"] == sweep.points[2].label


def test_a_point_its_combination_refuses_shows_as_refused(tmp_path):
    body = BASE + """\
sweep:
  axes:
    staleness.max_staleness: [0, 1]
    staleness.admission_lead: [0, 0.5]
  mode: partial
"""
    sweep = load_sweep(write(tmp_path, body))
    refused = [p for p in sweep.points if p.refused]
    assert [p.values for p in refused] == [{"staleness.max_staleness": "0", "staleness.admission_lead": "0.5"}]
    assert "staleness.admission_lead = 0.5" in refused[0].refused and "fix:" in refused[0].refused
    rows, best = rank(sweep, {p.index: known(1, 10 * p.index, 0) for p in sweep.points if not p.refused})
    assert rows[1]["status"] == "refused" and best["label"] == sweep.points[3].label
    table = sweep_table("t", "partial", [(a.name, a.short) for a in sweep.axes], rows, sweep.objective, best)
    cells = [str(c) for col in table.columns for c in col._cells]
    assert any(c.startswith("refused: staleness.admission_lead") for c in cells)


def test_refused_point_in_a_run_sweep_and_out_dir_rules(tmp_path, capsys):
    body = BASE + """\
sweep:
  axes:
    staleness.max_staleness: [0, 1]
  mode: partial
  workers: 1
"""
    path = write(tmp_path, body)
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--no-plots", "--set", "trainer.steps=2"]) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert [p["status"] for p in doc["points"]] == ["refused", "ok"]
    assert doc["best"]["label"] == "max_staleness=1"
    assert not (out / "points" / "max_staleness=0").exists()
    assert (out / "points" / "max_staleness=1" / "partial" / "report.json").is_file()
    assert "refused: staleness.admission_lead" in " ".join(capsys.readouterr().out.split())
    # A finished sweep is replaced; anything else is the user's.
    assert main([str(path), "--out", str(out), "--no-plots", "--set", "trainer.steps=2"]) == 0
    other = tmp_path / "mine"
    other.mkdir()
    assert main([str(path), "--out", str(other), "--no-plots"]) == 2
    assert list(other.iterdir()) == []
    assert main([str(path), "--out", str(tmp_path / "x"), "--stop-at-step", "1"]) == 2


def test_a_small_sweep_runs_in_parallel_end_to_end(tmp_path, capsys):
    body = SWEEP.replace("staleness.max_staleness: [1, 2, 3]", "staleness.max_staleness: [1, 3]") + "  workers: 2\n"
    path = write(tmp_path, body)
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out)]) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["schema"] == "asyncrl.sweep/1" and doc["workers"] == 2
    assert len(doc["points"]) == 4 and doc["modes_run"] == ["async", "partial"]
    for p in doc["points"]:
        for mode in ("async", "partial"):
            rep = json.loads((out / "points" / p["label"] / mode / "report.json").read_text())
            assert rep["mode"] == mode and rep["scenario"]["trainer"]["steps"] == 8
        rep = json.loads((out / "points" / p["label"] / "partial" / "report.json").read_text())
        assert p["metrics"]["throughput/trained_tokens_per_s"] == rep["metrics"]["throughput/trained_tokens_per_s"]
        assert p["metrics"]["staleness/max"] == rep["metrics"]["staleness/max"]
        assert not list((out / "points" / p["label"]).rglob("*.png"))
        assert p["cpu_s"] > 0
    feasible = [p for p in doc["points"] if p["status"] == "ok"]
    assert feasible and all(p["metrics"]["staleness/max"] <= 1 for p in feasible)
    top = max(p["metrics"]["throughput/trained_tokens_per_s"] for p in feasible)
    assert doc["best"]["metrics"]["throughput/trained_tokens_per_s"] == top
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = load(out / "best.yaml")  # the best setting, runnable on its own
    assert best.resources.rollout_gpus == doc["best"]["settings"]["resources.rollout_gpus"]
    text = " ".join(capsys.readouterr().out.split())
    assert "best under staleness/max <= 1, gpus <= 4" in text and doc["best"]["label"] in text
    assert yaml.safe_load((out / "best.yaml").read_text())["staleness"]["max_staleness"] == int(doc["best"]["values"]["staleness.max_staleness"])


def test_the_shipped_sweep_is_5x5_at_128_gpus():
    sweep = load_sweep(ROOT / "scenarios" / "sweep-split-staleness.yaml")
    assert [len(a.labels) for a in sweep.axes] == [5, 5]
    assert all(p.scenario is not None for p in sweep.points)
    assert {p.scenario.resources.rollout_gpus + p.scenario.resources.trainer_gpus for p in sweep.points} == {128}
    assert {p.scenario.trainer.steps for p in sweep.points} == {400}


def test_heatmap_cells_show_the_best_over_other_axes_and_grey_what_is_out(tmp_path):
    body = BASE + """\
sweep:
  axes:
    staleness.max_staleness: [0, 1]
    trainer.sync_every: [1, 2]
    seed: [0, 1]
  constraints: ["staleness/max <= 0"]
  mode: partial
  heatmap: [staleness.max_staleness, seed]
"""
    sweep = load_sweep(write(tmp_path, body))  # max_staleness 0 with lead 0.5: refused
    assert [p.refused is not None for p in sweep.points] == [True] * 4 + [False] * 4
    results = {p.index: known(1, 100 + p.index, 0 if p.index != 7 else 1) for p in sweep.points if not p.refused}
    rows, best = rank(sweep, results)
    cells, best_at = heatmap_cells(sweep, rows, best)
    assert cells[0] == [(None, "refused"), (None, "refused")]
    # seed 0: points 4 (sync_every 1) and 6 (sync_every 2) -> 106; seed 1: 7 violates, so 5 -> 105
    assert cells[1] == [(106, ""), (105, "")]
    assert best["label"] == sweep.points[6].label and best_at == (1, 0)
    none_ok = {i: known(1, 100 + i, 1) for i in results}
    rows, best = rank(sweep, none_ok)
    cells, best_at = heatmap_cells(sweep, rows, best)
    assert cells[1] == [(106, "violates"), (107, "violates")] and best_at is None


def test_a_point_whose_weights_and_kv_cache_do_not_fit_is_refused_not_the_sweep(tmp_path):
    body = BASE + """\
sweep:
  axes:
    gpu.memory_gb: [16, 96]   # a 7.6 B-parameter model in bf16 is 15 GB of weights
  mode: partial
"""
    sweep = load_sweep(write(tmp_path, body))
    small, large = sweep.points
    assert small.scenario is None and "KV for" in small.refused and "fix:" in small.refused
    assert large.refused is None and large.scenario.gpu.memory_gb == 96
