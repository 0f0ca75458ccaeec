"""The hot paths' performance targets, as ratios from one benchmark run.

    python bench/targets.py               # runs `pytest --benchmark-only` (at the root) first
    python bench/targets.py RUN.json      # a run saved with --benchmark-json

Every ratio compares two implementations measured side by side in the same run, on the same
data, by their minimum time (the least disturbed by other work on a shared machine). The
table says which targets a run met; it never fails a build, since speed is not behaviour.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    op: str
    group: str
    impl: str  # ours
    baseline: str
    # "speedup": baseline time / ours >= goal; "time": ours / baseline <= goal;
    # "bandwidth": baseline time / ours >= goal, i.e. our share of the baseline's bandwidth
    kind: str
    goal: float


TARGETS = [
    Target("replay add, batch 256", "add 256", "ext", "numpy", "speedup", 1.0),
    Target("replay add, batch 256", "add 256", "ext", "cpprb", "speedup", 2.5),
    Target("replay add, batch 1", "add 1", "ext", "numpy", "speedup", 5.0),
    Target("uniform sample 256", "sample 256 uniform", "ext", "numpy", "time", 0.6),
    Target("prioritized sample 256", "sample 256 prioritized", "ext", "cpprb", "time", 0.2),
    Target("priority update 256, slots from sample()", "update priorities 256 (sampled slots)", "ext", "cpprb", "time", 0.3),
    Target("priority update 256, random slots", "update priorities 256 (random slots)", "ext", "cpprb", "time", 0.3),
    Target("priority update 256, fixed slots", "update priorities 256 (fixed slots)", "ext", "cpprb", "time", 0.3),
    Target("codec round trip, 2048 tokens", "round trip, 2048 tokens", "2048-ext", "2048-memcpy", "time", 2.0),
    Target("codec round trip, 2048 tokens", "round trip, 2048 tokens", "2048-ext", "2048-pickle5", "speedup", 15.0),
    Target("codec round trip, 32768 tokens", "round trip, 32768 tokens", "32768-ext", "32768-memcpy", "bandwidth", 0.5),
    Target("queue put + get (256 puts, get_batch)", "put256+get256", "ext", "asyncio.Queue", "speedup", 3.5),
    Target("queue put + get, asyncio tasks", "async put+get 4096 by 256", "ext", "asyncio.Queue", "speedup", 3.5),
    Target("torch engine decode, rows of one length", "decode 16 steps, 64 x 128", "64 x 128-asyncrl", "64 x 128-transformers", "speedup", 1.2),
    Target("torch engine decode, rows of two lengths", "decode 16 steps, 32 x 16 + 32 x 128",
           "32 x 16 + 32 x 128-asyncrl", "32 x 16 + 32 x 128-transformers", "speedup", 1.5),
]


# Absolute targets, for what has no second implementation to race: simulated samples per
# CPU-second of a whole sim run (bench/bench_sim_speed.py), from a benchmark's extra_info.
# The simulator before the speed-up (5db1ec3) measured on the benchmark's own case (this file,
# 200 steps, warm, best of 2) on this 2-core VM, quiet (load average 0.3-1.3), each run
# alternating with the tree after it, on 2026-11-30: 59,410, 56,514, 60,377 (one pass), 56,715,
# 54,146, 57,532, 56,820, 53,511, 56,983 (the next); BEFORE_128 is the median of the nine
# (docs/results/2026-11-30-sim-speed.md). The goal is twice that. (An earlier 34,600 was the
# same code on the VM shared with four other agents.) Those runs were alone in their process,
# where its CPU is the simulator thread's; the rate now counts that thread's CPU alone
# (bench_sim_speed.py says why).
BEFORE_128 = 56_820
RATE_TARGETS = [
    ("sim samples per CPU-second, longtail-128gpu", "longtail-128gpu", 2 * BEFORE_128),
]
# 1,024 GPUs (512 engines) may cost at most this much more CPU per sample than 128 (64 engines).
SCALE_TARGET = ("sim CPU per sample, 1,024 / 128 GPUs", "longtail-1024gpu", "longtail-128gpu", 1.3)


def _rates(run: dict) -> dict[str, float]:
    return {b["param"]: b["extra_info"]["samples_per_cpu_s"] for b in run["benchmarks"]
            if "samples_per_cpu_s" in b.get("extra_info", {})}


def rate_rows(run: dict) -> list[tuple[str, str, str, str, str]]:
    rates = _rates(run)
    out = []
    for op, case, goal in RATE_TARGETS:
        r = rates.get(case)
        out.append((op, "-", "-", "not measured", "") if r is None else
                   (op, f"{r:,.0f}/s", f"before {BEFORE_128:,}/s", f"{r / BEFORE_128:.2f}x",
                    f">= {goal:,}/s {'met' if r >= goal else 'MISSED'}"))
    op, big, small, goal = SCALE_TARGET
    if big in rates and small in rates:
        ratio = rates[small] / rates[big]
        out.append((op, f"{rates[big]:,.0f}/s", f"{small} {rates[small]:,.0f}/s", f"{ratio:.2f}x the CPU",
                    f"<= {goal}x {'met' if ratio <= goal else 'MISSED'}"))
    return out


# The first pass over a fresh 1M-row replay buffer (bench/first_fill.py, six fresh processes
# each): at least cpprb's rows per second (medians), and ours steady, its spread (max - min)
# over the median within FILL_SPREAD.
FILL_SPREAD = 0.2


def fill_rows(run: dict) -> list[tuple[str, str, str, str, str]]:
    info = next((b["extra_info"] for b in run["benchmarks"] if "ext_fill_rows_per_s_median" in b.get("extra_info", {})), None)
    if info is None:
        return [("replay first fill, fresh processes", "-", "-", "not measured", "")]
    ours, base, spread = info["ext_fill_rows_per_s_median"], info["cpprb_fill_rows_per_s_median"], info["ext_fill_spread"]
    return [
        ("replay first fill, fresh processes", f"{ours / 1e6:.2f} M rows/s", f"cpprb {base / 1e6:.2f} M rows/s",
         f"{ours / base:.1f}x faster", f">= 1.0x {'met' if ours >= base else 'MISSED'}"),
        ("replay first fill, spread over 6 processes", f"{spread:.1%}", f"cpprb {info['cpprb_fill_spread']:.1%}",
         f"{spread:.1%} (max - min) / median", f"<= {FILL_SPREAD:.0%} {'met' if spread <= FILL_SPREAD else 'MISSED'}"),
        # No target: what the pages cost, which the host decides on this VM kind
        # (bench/page_cost.py). Beside the fill so that a fast fill cannot hide a slow start.
        ("replay constructor + first fill, median", f"{info['ext_to_full_s_median']:.2f} s",
         f"cpprb {info['cpprb_to_full_s_median']:.2f} s",
         f"{info['ext_to_full_s_median'] / info['cpprb_to_full_s_median']:.2f}x the time", "(reported)"),
    ]


def _times(run: dict) -> dict[tuple[str, str], float]:
    return {(b["group"], b["param"]): b["stats"]["min"] for b in run["benchmarks"] if b["param"] is not None}


def rows(run: dict) -> list[tuple[str, str, str, str, str]]:
    """(op, ours, baseline, measured ratio, goal and whether it was met) per target."""
    times = _times(run)
    out = []
    for t in TARGETS:
        ours, base = times.get((t.group, t.impl)), times.get((t.group, t.baseline))
        if ours is None or base is None:
            out.append((t.op, "-", "-", "not measured", ""))
            continue
        if t.kind == "time":
            ratio, met, text, goal = ours / base, ours / base <= t.goal, f"{ours / base:.2f}x the time", f"<= {t.goal}x"
        elif t.kind == "bandwidth":
            ratio = base / ours
            met, text, goal = ratio >= t.goal, f"{ratio:.0%} of its bandwidth", f">= {t.goal:.0%}"
        else:
            ratio = base / ours
            met, text, goal = ratio >= t.goal, f"{ratio:.1f}x faster", f">= {t.goal}x"
        out.append((t.op, f"{ours * 1e6:.2f} µs", f"{t.baseline.split('-')[-1]} {base * 1e6:.2f} µs", text,
                    f"{goal} {'met' if met else 'MISSED'}"))
    return out


def markdown(run: dict) -> str:
    lines = ["| op | asyncrl (ext) | baseline | measured | target |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(run) + fill_rows(run) + rate_rows(run)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv:
        run = json.loads(Path(argv[0]).read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run.json"
            cmd = [sys.executable, "-m", "pytest", "--benchmark-only", "-q", f"--benchmark-json={path}"]
            if subprocess.call(cmd, cwd=ROOT) != 0:  # from the root, pytest collects bench/ only
                return 1
            run = json.loads(path.read_text())
    machine = run.get("machine_info", {})
    print(f"{machine.get('cpu', {}).get('brand_raw', 'unknown CPU')}, {run.get('datetime', '')}")
    print(markdown(run))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
