"""The live figures of a run: metrics.jsonl while it goes, the loggers fed the same (TensorBoard
read back with its own reader; W&B offline and MLflow's file store where installed), and every
worker's spans as a Chrome trace."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import threading
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from core.model.config import Placement, Scenario
from core.model.progress import StepTrained, WeightsSynced
from harness import run as harness_run
from harness.console import ModeProgress
from harness.live_metrics import METRICS_FILE, as_line, plotted
from harness.run import main

ROOT = Path(__file__).resolve().parent.parent
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
MODES = ("sync", "async", "partial", "inflight")


def sets(*items: str) -> list[str]:
    return [a for kv in items for a in ("--set", kv)]


def lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines()]


def steps_of(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["event"] == "step"]


def scalars(mode_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(mode_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_quickstart_streams_its_steps_while_it_runs_and_tensorboard_reads_them_back(tmp_path, monkeypatch):
    """Held at a trainer step of its first mode (the progress display blocks there), the run has
    written no summary yet, and its metrics.jsonl already holds every earlier step. Once it ends,
    TensorBoard's reader finds those steps with the same values."""
    out = tmp_path / "run"
    hold_at = 6
    reached, released = threading.Event(), threading.Event()
    seen: dict = {}

    class HeldProgress(ModeProgress):
        def on_step(self, event) -> None:
            super().on_step(event)
            if isinstance(event, StepTrained) and event.step == hold_at and not reached.is_set():
                reached.set()
                if not released.wait(60):
                    raise RuntimeError("the reader never released the run")

    def read_while_held() -> None:
        try:
            if not reached.wait(120):
                return
            found = sorted(out.glob(f"*/{METRICS_FILE}"))  # a new run is written into --out as it goes
            seen["files"] = found
            seen["lines"] = lines(found[0]) if found else []
            seen["summaries"] = sorted(tmp_path.rglob("summary.json"))
        finally:
            released.set()

    monkeypatch.setattr(harness_run, "ModeProgress", HeldProgress)
    reader = threading.Thread(target=read_while_held)
    reader.start()
    try:
        rc = main([QUICK, "--out", str(out), "--no-plots", *sets("trainer.steps=12", "modes=[sync, async]")])
    finally:
        released.set()
        reader.join()
    assert rc == 0
    assert seen["files"] and seen["files"][0].parent.name == "sync", seen["files"]
    assert seen["summaries"] == []  # the run had not finished
    live = seen["lines"]
    assert [r["step"] for r in steps_of(live)] == list(range(1, hold_at))
    assert [r["version"] for r in live if r["event"] == "sync"] == [1]  # sync_every 4: after step 4

    assert (out / "summary.json").is_file()
    final = lines(out / "sync" / METRICS_FILE)
    assert final[: len(live)] == live  # appended, never rewritten
    for mode in ("sync", "async"):
        rows = steps_of(lines(out / mode / METRICS_FILE))
        assert [r["step"] for r in rows] == list(range(1, 13))
        for tag in ("samples/trainings", "tokens/trained", "staleness/mean", "train/tokens"):
            got = scalars(out / mode, tag)
            assert [s for s, _ in got] == [r["step"] for r in rows]
            assert [v for _, v in got] == pytest.approx([r[tag] for r in rows], rel=1e-6)  # event files hold float32
        syncs = [r for r in lines(out / mode / METRICS_FILE) if r["event"] == "sync"]
        assert [s for s, _ in scalars(out / mode, "sync/pause_s")] == [r["version"] for r in syncs] == [1, 2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    """Every mode of a small quickstart, with a worker killed and brought back."""
    out = tmp_path_factory.mktemp("quick") / "run"
    fault = "faults=[{kind: kill, worker: 1, at_step: 3}]"
    assert main([QUICK, "--out", str(out), "--no-plots", *sets("trainer.steps=12", fault)]) == 0
    return out


@pytest.mark.parametrize("mode", MODES)
def test_the_stream_ends_at_the_figures_report_json_gives(quick_run, mode):
    rows = lines(quick_run / mode / METRICS_FILE)
    m = json.loads((quick_run / mode / "report.json").read_text())["metrics"]
    steps = steps_of(rows)
    last = steps[-1]
    assert [r["step"] for r in steps] == list(range(1, m["trainer/steps"] + 1))
    assert last["samples/trainings"] == sum(r["step/samples"] for r in steps) == m["samples/trainings"]
    assert last["samples/trained"] == m["samples/trained"]
    assert last["staleness/mean"] == pytest.approx(m["staleness/mean"])
    assert last["staleness/max"] == m["staleness/max"]
    assert last["tokens/trained"] == sum(r["train/tokens"] for r in steps)
    assert last["tokens/trained"] / m["sim/duration_s"] == pytest.approx(m["throughput/trained_tokens_per_s"])
    assert last["time_s"] <= m["sim/duration_s"]
    assert [r["time_s"] for r in rows] == sorted(r["time_s"] for r in rows)  # in the order they happened
    syncs = [r for r in rows if r["event"] == "sync"]
    assert len(syncs) == m["sync/count"]
    assert sum(r["sync/pause_s"] for r in syncs) / len(syncs) == pytest.approx(m["sync/pause_mean_s"])
    assert all(r["version"] <= last["version"] + 1 for r in syncs)


@pytest.mark.parametrize("mode", MODES)
def test_trace_json_is_a_chrome_trace_with_a_named_track_per_worker(quick_run, mode):
    trace = json.loads((quick_run / mode / "trace.json").read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid", "args"} <= e.keys(), e
        assert e["ts"] >= 0
    meta = [e for e in events if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert {e["pid"] for e in events} <= processes.keys()  # every process named
    assert {(e["pid"], e["tid"]) for e in spans} <= threads.keys()  # every track named
    assert len(set(threads.values())) == len(threads)  # one track per worker
    workers = {name for (pid, _), name in threads.items() if processes[pid] == "rollout" and name.startswith("engine")}
    report = json.loads((quick_run / mode / "report.json").read_text())
    assert len(workers) == Placement.of(Scenario(**report["scenario"]), mode).engines
    assert "trainer" in threads.values()
    assert {e["name"] for e in spans} >= {"generate", "train", "sync"}
    end_us = report["metrics"]["sim/duration_s"] * 1e6
    assert max(e["ts"] + e["dur"] for e in spans) <= end_us * (1 + 1e-9)
    faults = [e for e in events if e.get("cat") == "fault"]
    assert [(e["name"], e["ph"]) for e in faults] == [("kill rollout_worker1", "X")]  # struck and recovered: a span
    counters = [e for e in events if e["ph"] == "C"]
    assert [e["args"]["value"] for e in counters][-1] == report["metrics"]["samples/trainings"]


def test_a_resumed_run_streams_what_the_run_that_never_stopped_streams(tmp_path):
    """Stopped after step 6 (its checkpoint is at the sync after step 4; its last line cut short)
    and resumed: metrics.jsonl is cut back to the checkpoint and goes on, and TensorBoard's files
    hold each step once."""
    small = sets("trainer.steps=12", "checkpoint.every=1", "modes=[async]")
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    assert main([QUICK, "--out", str(stopped), "--no-plots", "--stop-at-step", "6", *small]) == 0
    assert [r["step"] for r in steps_of(lines(stopped / "async" / METRICS_FILE))] == [1, 2, 3, 4, 5, 6]
    with (stopped / "async" / METRICS_FILE).open("a") as f:
        f.write('{"event": "step", "st')  # a line a kill cut short
    assert main(["--resume", str(stopped), "--no-plots"]) == 0
    assert main([QUICK, "--out", str(whole), "--no-plots", *small]) == 0
    a, b = (lines(d / "async" / METRICS_FILE) for d in (stopped, whole))
    for row in a + b:
        row.pop("unix_s")
    assert a == b
    assert scalars(stopped / "async", "samples/trainings") == scalars(whole / "async", "samples/trainings")
    assert len(list((stopped / "async").glob("events.out.tfevents.*"))) == 1


def test_an_env_run_streams_each_version_and_evaluation(tmp_path):
    out = tmp_path / "run"
    quick = sets("modes=[sync]", "env.env_steps=3000", "env.eval_every=1500", "env.eval_episodes=5", "dqn.hidden=[32, 32]",
                 "replay.samples_per_insert=2", "replay.min_size_to_sample=512", "dqn.publish_every=16")
    assert main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--no-plots", *quick]) == 0
    where = out / "seed-0" / "sync"
    rows = lines(where / METRICS_FILE)
    rep = json.loads((where / "report.json").read_text())
    published = [r for r in rows if r["event"] == "publish"]
    assert [r["version"] for r in published] == list(range(1, rep["metrics"]["versions"] + 1)) and len(published) >= 2
    assert [r["learner/updates"] for r in published] == [16 * r["version"] for r in published]
    evals = [r for r in rows if r["event"] == "eval"]
    assert [r["env/steps"] for r in evals] == rep["series"]["eval_env_steps"]
    assert [r["eval/return"] for r in evals] == rep["series"]["eval_return"]
    assert [s for s, _ in scalars(where, "eval/return")] == [r["env/steps"] for r in evals]
    trace = json.loads((where / "trace.json").read_text())
    threads = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert threads == ["sync loop"]
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"generate", "send", "train", "sync"}


def test_an_env_sim_run_streams_each_version(tmp_path):
    out = tmp_path / "run"
    assert main(["scenarios/cartpole-dqn.yaml", "--out", str(out), "--no-plots", *sets("runtime=sim", "env.env_steps=5000")]) == 0
    for mode in ("sync", "async"):
        where = out / "seed-0" / mode
        rep = json.loads((where / "report.json").read_text())
        published = [r for r in lines(where / METRICS_FILE) if r["event"] == "publish"]
        assert [r["version"] for r in published] == list(range(1, rep["metrics"]["versions"] + 1))
        assert [r["time_s"] for r in published] == sorted(r["time_s"] for r in published)
        assert not (where / "trace.json").exists()  # the sim keeps no spans


def test_a_logger_listed_but_not_installed_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), *sets("report.loggers=[tensorboard, wandb]")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err == "error: report.loggers = ['tensorboard', 'wandb']: wandb is not installed; fix: pip install wandb, or drop wandb from report.loggers"
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_line_holds_numbers_only_and_json_has_no_nan():
    ev = StepTrained(step=3, version=1, at_s=2.5, samples=4, staleness_sum=4, trainings=12, trained=12, tokens=100,
                     staleness_total=6, staleness_max=1, figures={"loss": math.nan, "response_lens": [1, 2], "updates": 2})
    line = as_line(ev)
    assert line["train/loss"] is None and "train/response_lens" not in line and line["train/updates"] == 2
    assert line["staleness/mean"] == 0.5 and line["step/staleness_mean"] == 1.0
    json.dumps(line, allow_nan=False)
    axis, x, tags = plotted(line)
    assert (axis, x) == ("step", 3) and "train/loss" not in tags and tags["step/version"] == 1.0 and "step" not in tags
    axis, x, tags = plotted(as_line(WeightsSynced(version=2, at_s=3.0, pause_s=1.0, drain_s=0.5, transfer_s=0.25)))
    assert (axis, x) == ("version", 2) and tags == {"sync/time_s": 3.0, "sync/pause_s": 1.0, "sync/drain_s": 0.5,
                                                   "sync/transfer_s": 0.25}


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run: its .wandb file is a LevelDB log (32 KiB blocks,
    a 7-byte header per chunk) after a 7-byte W&B header, each record a wandb Record protobuf."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    data = run_file.read_bytes()
    block, pos, buf, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a whole record, or its last chunk
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_gets_each_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), "--no-plots", *sets("trainer.steps=8", "modes=[async]", "report.loggers=[wandb]")]) == 0
    assert not list((out / "async").glob("events.out.tfevents.*"))  # tensorboard not listed
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    rows = lines(out / "async" / METRICS_FILE)
    steps = [h for h in history if "axis/step" in h]
    assert [h["axis/step"] for h in steps] == [r["step"] for r in steps_of(rows)]
    assert [h["samples/trainings"] for h in steps] == [r["samples/trainings"] for r in steps_of(rows)]
    syncs = [h for h in history if "axis/version" in h]
    assert [h["sync/pause_s"] for h in syncs] == [r["sync/pause_s"] for r in rows if r["event"] == "sync"]


def test_mlflow_gets_each_line_in_the_run_s_own_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), "--no-plots", *sets("trainer.steps=8", "modes=[sync, async]", "report.loggers=[mlflow]")]) == 0
    client = mlflow.tracking.MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    exp = client.get_experiment_by_name("quickstart")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"quickstart/sync", "quickstart/async"}
    for mode in ("sync", "async"):
        run = runs[f"quickstart/{mode}"]
        assert run.info.status == "FINISHED"
        rows = steps_of(lines(out / mode / METRICS_FILE))
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "samples/trainings"))
        assert got == [(r["step"], r["samples/trainings"]) for r in rows]


def test_a_logger_that_cannot_start_ends_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """An unreachable tracking server (its requests now time out in CONNECT_TIMEOUT_S, once
    retried), a W&B login that is not there: one line naming the logger, not a traceback."""
    import harness.live_metrics as live
    import harness.run as run

    class Unreachable:
        def __init__(self, *args, **kwargs):
            raise ConnectionError("HTTPConnectionPool(host='10.255.255.1', port=5000): Max retries exceeded\nmore")

    monkeypatch.setattr(run, "check_loggers", lambda loggers: None)  # installed or not, as far as this test goes
    monkeypatch.setattr(live, "MlflowSink", Unreachable)
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), "--no-plots", *sets("trainer.steps=4", "modes=[async]", "report.loggers=[tensorboard, mlflow]")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "report.loggers: mlflow could not start (ConnectionError: HTTPConnectionPool" in err and "fix:" in err
    assert "Traceback" not in err
