"""The slim install (``pip install -e .``, what ``make run`` does): the sim quickstart runs
without torch, transformers, Ray, gymnasium or vLLM, and a scenario that needs one of them is
refused before anything runs, naming the extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRAS_ONLY = ("torch", "transformers", "tokenizers", "safetensors", "ray", "gymnasium", "vllm", "tensorboard")

# Run harness.run as if those packages were not installed: importing one fails, and
# importlib.util.find_spec does not find it.
SLIM = f"""
import importlib.abc, runpy, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
sys.argv = ["harness.run", *sys.argv[1:]]
runpy.run_module("harness.run", run_name="__main__", alter_sys=True)
"""


def slim(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SLIM, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_quickstart_runs_on_the_slim_install(tmp_path):
    out = tmp_path / "run"
    proc = slim("scenarios/quickstart.yaml", "--out", str(out), "--no-plots", "--set", "trainer.steps=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["modes"]) == {"sync", "async", "partial", "inflight"}


def test_what_the_slim_install_cannot_run_is_refused_naming_the_extra(tmp_path):
    cases = [
        ("scenarios/real-cpu-torch.yaml", [], "pip install -e '.[real"),
        ("scenarios/real-cpu-vllm.yaml", [], "vllm"),
        ("scenarios/cartpole-dqn.yaml", [], "gymnasium"),
    ]
    for scenario, sets, fragment in cases:
        out = tmp_path / Path(scenario).stem
        proc = slim(scenario, "--out", str(out), *sets)
        err = " ".join(proc.stderr.split())
        assert proc.returncode == 2, (scenario, proc.stderr[-2000:])
        assert err.startswith("error:") and err.count("error:") == 1 and "Traceback" not in proc.stderr
        assert fragment in err and "not installed" in err
        assert not out.exists()
