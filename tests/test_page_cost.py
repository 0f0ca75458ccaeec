"""bench/page_cost.py, the evidence for where a fresh replay buffer's pages cost: it runs, each
kind in its own fresh processes, and prints one row per kind with a figure per process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "page_cost.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")
def test_page_cost_prints_both_kinds_for_every_process():
    out = subprocess.run([sys.executable, str(SCRIPT), "--processes", "2", "--mib", "8"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()[2:]}
    assert set(rows) == {"huge", "small"}
    for line in rows.values():
        pay, write = line.split("|")[2:4]
        assert len(pay.split(",")) == 2 and len(write.split(",")) == 2
        assert all(float(x) >= 0 for x in pay.split(",") + write.split(","))


def test_page_cost_refuses_a_size_it_cannot_mark():
    r = subprocess.run([sys.executable, str(SCRIPT), "--mib", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--mib at least 4" in r.stderr
