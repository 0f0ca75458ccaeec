"""bench/gpu_check.py, `make gpu-check`: what runs without a GPU. Here that is the one line and
exit 2 (nothing built or written), bad input, and the check's own logic through --cpu-smoke: the
same code on CPU with the tiny model, fsdp2 and bfloat16 where core has them. The GPU run
itself is docs/gpu.md's business."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.gpu_check import NO_GPU, SyncWatch, _bit_equal, _digests
from core.model.config import MODES
from core.model.progress import WeightsSynced

ROOT = Path(__file__).resolve().parent.parent
NO_GPU_LINE = NO_GPU.format(why="torch sees no CUDA device")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")


def _check(*argv: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]


@no_gpu
def test_no_gpu_one_line_exit_2_nothing_written(tmp_path):
    out = tmp_path / "out"
    scratch = tmp_path / "tmp"  # where the default output directory would be made
    scratch.mkdir()
    for argv in ([], ["--out", str(out)]):
        proc = _check(*argv, env={**os.environ, "TMPDIR": str(scratch)})
        assert proc.returncode == 2
        assert _lines(proc) == [NO_GPU_LINE]
        assert not out.exists()
        assert not any(scratch.iterdir())


@no_gpu
def test_make_gpu_check_without_gpu(tmp_path):
    """The wheels' install and the extensions' build stay quiet: the check's line is what shows."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"GPU_LOG={tmp_path / 'setup.log'}",
                           f"GPU_SITE={tmp_path / 'site'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    lines = _lines(proc)
    assert lines[0] == NO_GPU_LINE
    # make's own word on the failed recipe ("make[2]: ***" where make test runs the suite)
    assert all(re.match(r"make(\[\d+\])?: \*\*\*", x) for x in lines[1:]), lines
    assert "Traceback" not in proc.stdout + proc.stderr


def test_bad_input_is_one_line(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("mine")
    for argv, words in (
        (["--cpu-smoke", "--out", str(full)], "is not empty"),
        (["--cpu-smoke", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o")], "no config.json"),
        (["--steps", "1"], "--steps"),
        (["--bogus"], "--bogus"),
    ):
        proc = _check(*argv)
        assert proc.returncode == 2, argv
        lines = _lines(proc)
        assert len(lines) == 1 and lines[0].startswith("gpu_check: ") and words in lines[0], (argv, lines)
    assert [p.name for p in full.iterdir()] == ["keep"]
    assert not (tmp_path / "o").exists()


def test_cpu_smoke_compares_every_sync(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    proc = _check("--cpu-smoke", "--model", str(tiny_model_dir), "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: PASS" in proc.stdout
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["passed"] and rep["failures"] == [] and rep["smoke"]
    assert list(rep["modes"]) == list(MODES)
    assert rep["learn"]["set"] == {"sharding": "fsdp2", "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    for mode, row in rep["modes"].items():
        m, p = row["measured"], row["predicted"]
        assert row["failures"] == [], mode
        assert len(row["syncs"]) == m["sync/count"] >= 1, mode
        for s in row["syncs"]:
            assert s["equal"] and s["changed_since_previous"], (mode, s)
            assert s["engines"] and all(e["mismatched"] == 0 and e["digest"] == s["trainer_digest"] for e in s["engines"])
            assert all(e["dtype"] == "bfloat16" for e in s["engines"])
        assert len(row["syncs"][0]["engines"]) == (2 if mode == "sync" else 1)  # sync colocates both devices' engines
        for key in ("throughput/trained_samples_per_s", "throughput/trained_tokens_per_s", "util/mfu", "mfu_of_bf16_peak"):
            assert m[key] > 0, (mode, key)
        for key in ("sync/pause_mean_s", "sync/transfer_mean_s"):
            assert m[key] >= 0 and p[key] > 0, (mode, key)
        assert p["throughput/trained_tokens_per_s"] > 0 and p["util/gpu_source"] == "modeled"
        assert m["samples/lost"] == 0
    assert rep["nvml"]["available"] is False and rep["nvml"]["why"]
    assert rep["sim"]["set"]["gpu.bf16_tflops"] == 989.0 and "trainer.mfu" in rep["sim"]["assumed"]
    assert not (out / "model").exists()  # --model: nothing was built


# ---- the comparison itself, on stand-ins of the trainer and an engine ----------------------------


def _workers(n_engines: int = 1):
    """The trainer's float32 master weights, and engines holding them cast to bfloat16 as a sync leaves them."""
    torch.manual_seed(0)
    master = {"a.weight": torch.randn(8, 4), "b.bias": torch.randn(5)}
    backend = SimpleNamespace(weights_as=lambda dtype: {n: t.to(getattr(torch, dtype)) for n, t in master.items()})
    engines = []
    for i in range(n_engines):
        held = {n: t.to(torch.bfloat16) for n, t in master.items()}
        model = SimpleNamespace(held=held, named_parameters=(lambda h: lambda: list(h.items()))(held))
        engines.append(SimpleNamespace(name=f"engine{i:03d}", dtype="bfloat16", model=model))
    return master, SimpleNamespace(backend=backend, engines=engines)


def _watch(workers) -> SyncWatch:
    w = SyncWatch()
    w.workers = workers
    return w


def test_equal_weights_pass_and_unchanged_ones_are_told():
    master, workers = _workers(2)
    w = _watch(workers)
    w.on_step(WeightsSynced(1, 1.0, 0.1, 0.0, 0.1))
    w.on_step(WeightsSynced(2, 2.0, 0.1, 0.0, 0.1))
    assert [s["equal"] for s in w.syncs] == [True, True]
    assert [s["changed_since_previous"] for s in w.syncs] == [True, False]
    assert w.failures == [] and len(w.syncs[0]["engines"]) == 2


def test_one_changed_element_is_a_mismatch():
    master, workers = _workers(2)
    with torch.no_grad():
        workers.engines[1].model.held["a.weight"][3, 1] += 0.5
    w = _watch(workers)
    w.on_step(WeightsSynced(1, 1.0, 0.1, 0.0, 0.1))
    s = w.syncs[0]
    assert not s["equal"]
    good, bad = s["engines"]
    assert good["mismatched"] == 0 and good["digest"] == s["trainer_digest"]
    assert bad["mismatched"] == 1 and bad["mismatched_names"] == ["a.weight"] and bad["max_abs_diff"]["a.weight"] > 0


def test_a_missing_tensor_is_a_mismatch():
    master, workers = _workers()
    master["c.extra"] = torch.ones(3)
    w = _watch(workers)
    w.on_step(WeightsSynced(1, 1.0, 0.1, 0.0, 0.1))
    assert not w.syncs[0]["equal"] and w.syncs[0]["engines"][0]["mismatched_names"] == ["c.extra"]


def test_comparison_is_of_bits_and_digests_see_swaps():
    assert not _bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, different bits
    assert _bit_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    x = torch.arange(6, dtype=torch.bfloat16)
    swapped = x.clone()
    swapped[[1, 4]] = swapped[[4, 1]]
    a, b = _digests({"x": x})["x"], _digests({"x": swapped})["x"]
    assert a[0] == b[0] and a[1] != b[1]  # the plain sum misses a swap, the weighted one does not
