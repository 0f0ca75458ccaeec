"""The first fill of a fresh replay buffer, each in a fresh process: ours against cpprb's.

    python bench/first_fill.py [--processes 6] [--json OUT.json]

A fresh process makes a 1,000,000-row buffer of bench_replay's fields (about 500 MiB) and adds
rows in batches of 256 until it is full: the first pass over memory no row has touched. Each
process times its constructor and its fill apart, since the two implementations pay for the
pages in different places:

* cpprb's constructor writes its arrays, one page fault at a time (its fill then finds the
  pages present);
* ours asks the kernel for all of them at once (``MADV_POPULATE_WRITE``), on the transparent
  huge pages numpy marks arrays of 4 MiB and up for, so the fill finds them present too.

On this machine kind (a Firecracker VM) a page the guest has not touched before also costs a
fault in the host, which makes whatever pays for fresh pages swing from process to process.
The implementations run alternately, ``--processes`` of each, in turns that change which
goes first. Reported: rows per second of the
fill (median, min, max, and the spread (max - min) / median), the constructor's seconds beside
it, and the time to a full buffer (constructor + fill).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPACITY, BATCH = 1_000_000, 256


def _child(impl: str) -> dict:
    import numpy as np

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import bench_replay as br

    chunk = br._rows(np.random.default_rng(1), BATCH)
    t0 = time.perf_counter()
    if impl == "ext":
        from ext._replay import ReplayBuffer

        buf = ReplayBuffer(CAPACITY, br.SPEC, prioritized=False, seed=0)
        add = buf.add
    else:
        import cpprb

        buf = cpprb.ReplayBuffer(CAPACITY, br.CPPRB_ENV)

        def add(batch, _add=buf.add):
            _add(**batch)

    t1 = time.perf_counter()
    for _ in range(CAPACITY // BATCH):
        add(chunk)
    t2 = time.perf_counter()
    rows = (CAPACITY // BATCH) * BATCH
    return {"impl": impl, "ctor_s": t1 - t0, "fill_s": t2 - t1, "rows": rows, "rows_per_s": rows / (t2 - t1)}


def alternating(script: str, kinds: tuple[str, str], processes: int, args: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """``processes`` fresh processes of ``script --child KIND *args`` per kind, each printing one
    JSON object; the objects by kind, in the order they ran."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    a, b = kinds
    for k in range(processes):
        # whoever goes first after a process frees its memory may find pages the host took
        # back: the order alternates, so neither kind is always first
        for kind in ((a, b) if k % 2 == 0 else (b, a)):
            out = subprocess.run([sys.executable, script, "--child", kind, *args], env=env, check=True,
                                 capture_output=True, text=True).stdout
            runs[kind].append(json.loads(out))
    return runs


def run(processes: int = 6) -> dict:
    """``processes`` fresh processes per implementation, alternating; their figures and a
    summary per implementation."""
    runs = alternating(__file__, ("ext", "cpprb"), processes)
    summary = {}
    for impl, rs in runs.items():
        rates = [r["rows_per_s"] for r in rs]
        med = statistics.median(rates)
        summary[impl] = {
            "rows_per_s_median": med, "rows_per_s_min": min(rates), "rows_per_s_max": max(rates),
            "spread": (max(rates) - min(rates)) / med,
            "ctor_s": [r["ctor_s"] for r in rs], "fill_s": [r["fill_s"] for r in rs],
            "to_full_s_median": statistics.median(r["ctor_s"] + r["fill_s"] for r in rs),
        }
    return {"processes": processes, "capacity": CAPACITY, "batch": BATCH, "runs": runs, "summary": summary}


def table(result: dict) -> str:
    lines = ["| impl | fill rows/s median | min | max | spread | constructor s (each process) | ctor + fill s median |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for impl, s in result["summary"].items():
        ctor = ", ".join(f"{c:.2f}" for c in s["ctor_s"])
        lines.append(f"| {impl} | {s['rows_per_s_median'] / 1e6:.2f} M | {s['rows_per_s_min'] / 1e6:.2f} M | "
                     f"{s['rows_per_s_max'] / 1e6:.2f} M | {s['spread']:.1%} | {ctor} | {s['to_full_s_median']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=["ext", "cpprb"], help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=6)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child)))
        return 0
    if a.processes < 1:
        p.error(f"--processes {a.processes}: at least 1")
    result = run(a.processes)
    print(table(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
