"""``run_mode``: one mode of a scenario on the runtime it names. Nothing in core imports this."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from core.model.config import Scenario
from core.model.result import RunResult
from core.pipeline.wiring import ProgressFn
from core.runtimes.local import ProcessesFn, run_local
from core.runtimes.ray import run_ray
from core.runtimes.sim import run_sim


def run_mode(
    sc: Scenario,
    mode: str,
    on_step: Optional[ProgressFn] = None,
    on_processes: Optional[ProcessesFn] = None,
    run_dir: Optional[Path] = None,
    resume: bool = False,
    stop_at_step: Optional[int] = None,
) -> RunResult:
    """Run one mode on the scenario's runtime. ``on_processes([(name, pid)])`` is told the
    processes that do the work once they exist (for a profiler). ``run_dir`` keeps the
    checkpoints (a temporary directory when None); ``resume`` starts from the latest one (on
    ray, the latest whole one: both sides); ``stop_at_step`` stops after that trainer step."""
    if sc.runtime == "local":
        return run_local(sc, mode, on_step, on_processes, run_dir=run_dir, resume=resume, stop_at_step=stop_at_step)
    if sc.runtime == "ray":
        return run_ray(sc, mode, on_step, on_processes, run_dir=run_dir, resume=resume, stop_at_step=stop_at_step)
    return run_sim(sc, mode, on_step, run_dir=run_dir, resume=resume, stop_at_step=stop_at_step)
