"""``run_mode``: one mode of a scenario on the runtime it names; ``run_env_mode`` the same for an
env scenario (``kind: env``). Nothing in core imports this."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

from core.env.curve import EnvCurve
from core.model.config import Scenario
from core.model.env_config import EnvScenario
from core.model.result import RunResult
from core.model.run_plan import RunPlan
from core.pipeline.wiring import ProgressFn
from core.runtimes.local import ProcessesFn, run_local
from core.runtimes.ray_driver import run_ray
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
    plan = RunPlan.of(sc, mode)
    if sc.runtime == "local":
        return run_local(plan, on_step, on_processes, run_dir=run_dir, resume=resume, stop_at_step=stop_at_step)
    if sc.runtime == "ray":
        return run_ray(plan, on_step, on_processes, run_dir=run_dir, resume=resume, stop_at_step=stop_at_step)
    return run_sim(plan, on_step, run_dir=run_dir, resume=resume, stop_at_step=stop_at_step)


def run_env_mode(
    sc: EnvScenario,
    mode: str,
    seed: int,
    workdir: Path,
    stop_at_version: Optional[int] = None,
    on_progress: Optional[ProgressFn] = None,
    on_processes: Optional[ProcessesFn] = None,
) -> EnvCurve:
    """Run one mode of an env scenario: on the virtual clock (``runtime: sim``), else sync mode in
    this process and async mode on Ray. ``workdir``: the run's own directory (its checkpoints,
    with ``checkpoint.every``); ``stop_at_version`` stops after that learner version;
    ``on_progress`` is told each version published and each evaluation; ``on_processes`` the
    actors' processes (async mode)."""
    # Imported on use: the env runtimes import torch and gymnasium, which the slim install lacks.
    if sc.runtime == "sim":
        from core.runtimes.sim_env import run_env_sim

        return run_env_sim(sc, mode, seed, on_progress)
    if mode == "sync":
        from core.runtimes.local_env import run_sync

        return asyncio.run(run_sync(sc, seed, run_dir=workdir, stop_at_version=stop_at_version, on_progress=on_progress))
    from core.runtimes.ray_env import run_async

    return run_async(sc, seed, workdir=workdir, stop_at_version=stop_at_version, on_progress=on_progress,
                     on_processes=on_processes)
