"""``make fuzz``: run every fuzz target under every backend for a bounded number of inputs.

    .venv/bin/python -m fuzz.run [--runs N] [--max-time S] [--jobs J] [--targets ...] [--backends ...]

Each (target, backend) pair gets fresh seeds (valid encodings from fuzz/common.py, written at
run time), an empty working corpus, and one libFuzzer run bounded by ``-runs=N`` and
``-max_total_time=S``, whichever comes first. Logs go to ``FUZZ_DIR/logs``, crashing inputs to
``FUZZ_DIR/crashes/<target>-<backend>/`` (libFuzzer stops at the first). One summary line per
run: inputs tried (libFuzzer's "Done N runs"), crashes, wall time, execs/s. The exit status is
nonzero if any run crashed, failed or did not finish.

Backends: ``ext`` is the compiled Cython decoder (ASYNCRL_PUREPYTHON=0), not coverage
instrumented; ``ref`` the pure-Python reference (ASYNCRL_PUREPYTHON=1), instrumented.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fuzz import common

TARGETS = ("fuzz_codec", "fuzz_checkpoint")
BACKENDS = {"ext": "0", "ref": "1"}
MAX_LEN = 8192  # above every seed (the largest is ~7 KB); bigger inputs only slow the checksum
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    target: str
    backend: str
    rc: int
    runs: int | None
    crashes: int
    wall_s: float
    execs_per_s: int | None
    seed: str | None
    log: Path
    stopped: str
    finished: bool

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.crashes == 0 and self.finished

    def line(self) -> str:
        runs = "?" if self.runs is None else f"{self.runs:,}"
        # libFuzzer's figure, whole runs per second: 0 for a run shorter than a second
        rate = f"{self.execs_per_s:,}" if self.execs_per_s else "n/a"
        status = "ok" if self.ok else f"FAILED (exit {self.rc}; log {self.log})"
        return (
            f"{self.target:<16} {self.backend:<4} inputs {runs:>11}  crashes {self.crashes}  "
            f"wall {self.wall_s:8.1f} s  {rate:>7} execs/s  seed {self.seed}  {self.stopped}  {status}"
        )


def _start(target: str, backend: str, args, base: Path):
    name = f"{target}-{backend}"
    seeds, corpus = base / "seeds" / target, base / "corpus" / name
    crashes, logs = base / "crashes" / name, base / "logs"
    for d in (corpus, crashes):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    shutil.rmtree(seeds, ignore_errors=True)
    common.write_seeds(target, seeds)
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    cmd = [
        sys.executable, "-m", f"fuzz.{target}", str(corpus), str(seeds),
        f"-runs={args.runs}", f"-max_total_time={args.max_time}", f"-max_len={MAX_LEN}",
        f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_mb}", f"-artifact_prefix={crashes}/",
        "-print_final_stats=1", f"-seed={args.seed}",
    ]
    env = {**os.environ, "ASYNCRL_PUREPYTHON": BACKENDS[backend], "PYTHONPATH": str(ROOT)}
    f = open(log, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, f, time.monotonic(), (target, backend, log, crashes)


def _result(proc, f, t0, info, max_time: int) -> Result:
    target, backend, log, crashes = info
    wall = time.monotonic() - t0
    f.close()
    text = log.read_text(errors="replace")
    done = re.findall(r"Done (\d+) runs in (\d+) second", text)
    execs = re.findall(r"stat::average_exec_per_sec:\s*(\d+)", text)
    seed = re.search(r"INFO: Seed: (\d+)", text)
    found = sorted(p for p in crashes.iterdir() if p.is_file())
    units = re.findall(r"stat::number_of_executed_units:\s*(\d+)", text)
    # "Done N runs" when it finished; the final stats' count when it stopped at a crash
    runs = int(done[-1][0]) if done else int(units[-1]) if units else None
    stopped = "(time bound reached)" if done and int(done[-1][1]) >= max_time else ""
    return Result(
        target, backend, proc.returncode, runs, len(found), wall,
        int(execs[-1]) if execs else None, seed.group(1) if seed else None, log, stopped, bool(done),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1_000_000, help="inputs per target and backend")
    p.add_argument("--max-time", type=int, default=3600, help="seconds per target and backend, at most")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--seed", type=int, default=1, help="libFuzzer's -seed (0: a random one)")
    p.add_argument("--timeout", type=int, default=10, help="seconds for one input before it counts as a hang")
    p.add_argument("--rss-mb", type=int, default=4096, help="memory limit of one run")
    p.add_argument("--dir", type=Path, default=ROOT / ".fuzz", help="seeds, corpora, crashes and logs")
    args = p.parse_args(argv)

    common.load()  # the seeds need core/ext; this process decodes nothing
    pending = [(t, b) for t in args.targets for b in args.backends]
    running, results = [], []
    print(f"fuzz: {len(pending)} runs of at most {args.runs:,} inputs / {args.max_time} s each, {args.jobs} at a time", flush=True)
    while pending or running:
        while pending and len(running) < max(1, args.jobs):
            running.append(_start(*pending.pop(0), args, args.dir))
        time.sleep(0.5)
        for r in [r for r in running if r[0].poll() is not None]:
            running.remove(r)
            res = _result(*r, args.max_time)
            results.append(res)
            print(res.line(), flush=True)
            if not res.ok:
                tail = res.log.read_text(errors="replace").splitlines()[-40:]
                print("\n".join("    " + line for line in tail), flush=True)
    total = sum(r.runs or 0 for r in results)
    crashes = sum(r.crashes for r in results)
    bad = [r for r in results if not r.ok]
    print(f"fuzz: {total:,} inputs in all, crashes: {crashes}" + (f", {len(bad)} run(s) FAILED" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
