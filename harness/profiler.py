"""``--profile``: py-spy records the driver and every process that does the work.

One ``py-spy record`` per process (the driver, each Ray actor; ``--subprocesses`` takes in
what they start, such as vLLM's engine core), each writing a flame graph SVG into the mode's
``profile/`` directory when the run ends.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

ATTACH_S = 10.0  # the longest the harness waits for py-spy to begin sampling a process


class ProfileError(RuntimeError):
    """py-spy is missing or cannot attach."""


def py_spy() -> str:
    """The py-spy executable; ``ProfileError`` (one line) if there is none."""
    exe = shutil.which("py-spy") or str(Path(os.sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        raise ProfileError("--profile: py-spy not found; fix: install the project (make run) or pip install py-spy")
    return exe


class Profiler:
    def __init__(self, out: Path, rate: int = 100) -> None:
        self.exe = py_spy()
        self.out = out
        self.rate = rate
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.pids: set[int] = set()

    def __enter__(self) -> "Profiler":
        """Record this process, the driver, from the start: on the sim runtime and in an env
        run's sync mode it does all the work, and no runtime reports it."""
        self.attach([("driver", os.getpid())])
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def attach(self, processes: list[tuple[str, int]]) -> None:
        """Start recording each ``(name, pid)`` not recorded yet (a runtime may name the driver,
        which the harness records from the start)."""
        self.out.mkdir(parents=True, exist_ok=True)
        for name, pid in processes:
            if pid in self.pids:
                continue
            self.pids.add(pid)
            svg = self.out / f"{name}.svg"
            cmd = [self.exe, "record", "--pid", str(pid), "--rate", str(self.rate), "--subprocesses",
                   "--format", "flamegraph", "--output", str(svg), "--nonblocking"]
            log.info("profiling %s (pid %d) into %s", name, pid, svg)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            self.procs.append((name, proc))
            # Sampling starts a moment later; a run shorter than that (the sim's) would go unrecorded.
            if not select.select([proc.stdout], [], [], ATTACH_S)[0]:
                log.warning("py-spy has not begun sampling %s (pid %d) after %.0f s; going on", name, pid, ATTACH_S)
            else:
                proc.stdout.readline()

    def stop(self) -> list[Path]:
        """Stop every recorder (SIGINT makes py-spy write its SVG); the flame graphs written."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        written = []
        for name, proc in self.procs:
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            svg = self.out / f"{name}.svg"
            if svg.is_file():
                written.append(svg)
            else:
                log.warning("py-spy wrote no flame graph for %s: %s", name, (err or b"").decode(errors="replace").strip()[-300:])
        self.procs = []
        return written
