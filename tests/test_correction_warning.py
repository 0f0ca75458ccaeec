"""A real run that trains stale samples with no importance correction (learn.correction: bypass)
says so in one warning line before it starts; every other case says nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.console import correction_lines
from harness.scenario import load_variants

ROOT = Path(__file__).resolve().parent.parent
REAL = str(ROOT / "scenarios" / "real-cpu-torch.yaml")


def _lines(path: str, *overrides: str) -> list[str]:
    return [line for v in load_variants(path, list(overrides)) for line in correction_lines(v.scenario)]


def test_bypass_on_stale_modes_warns_once_naming_them():
    lines = _lines(REAL, "learn.correction=bypass")
    assert len(lines) == 1
    assert lines[0].startswith("warning: async, partial, inflight train samples up to 1 version(s) old")
    assert "fix:" in lines[0]


def test_a_correction_sync_alone_no_staleness_or_the_sim_say_nothing():
    assert _lines(REAL) == []  # the default, decoupled
    for c in ("tis", "icepop", "seq_tis", "seq_mis", "m2po"):
        assert _lines(REAL, f"learn.correction={c}") == []
    assert _lines(REAL, "learn.correction=bypass", "modes=[sync]") == []
    assert _lines(REAL, "learn.correction=bypass", "staleness.max_staleness=0", "staleness.admission_lead=0") == []
    assert _lines(str(ROOT / "scenarios" / "quickstart.yaml"), "learn.correction=bypass") == []


def test_the_run_prints_it_before_anything_else(tmp_path):
    # An --out the user owns is refused before the run starts: the warning came first.
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file")
    r = subprocess.run([sys.executable, "-m", "harness.run", REAL, "--set", "learn.correction=bypass", "--out", str(mine)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.index("warning: async, partial, inflight") < r.stderr.index("error:")
    assert mine.read_text() == "a user's file"
