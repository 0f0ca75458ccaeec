"""The sim runtime: every component in one process, on a virtual clock, with engines and
trainer on modelled costs. A run is exactly reproducible from its scenario and seed."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Optional

from core.model.result import RunResult
from core.model.run_plan import RunPlan
from core.model.timeline import Timeline
from core.pipeline.wiring import ProgressFn, Workers
from core.runtimes.inproc import InProcRun, connect_inproc, drive
from core.runtimes.run_checkpoint import restore_latest
from core.sim import virtual_clock
from core.sim.agent_episodes import SimEpisodes
from core.sim.backend import SimTrainBackend, SimWeightTransfer
from core.sim.costs import DecodeCost, TrainCost, TransferCost
from core.sim.engine import SimEngine
from core.sim.workload import ModelledReward, Workload


def sim_workers(plan: RunPlan, timeline: Timeline) -> Workers:
    """The sim runtime's workers: engines and trainer on modelled costs."""
    sc, mode, place = plan.scenario, plan.mode, plan.placement
    agent = sc.episodes
    workload = Workload.of(sc, agent)
    decode = DecodeCost(sc, place.gpus_per_engine, colocated=place.colocated)
    keep_kv = agent is not None and not agent.release_kv_during_tools
    engines = [
        SimEngine(f"engine{i:03d}", decode, workload, sc.rollout.max_num_seqs, timeline, sc.recovery.engine_restart_s,
                  turns=agent is not None, keep_kv=keep_kv)
        for i in range(place.engines)
    ]
    backend = SimTrainBackend(TrainCost(sc, place.trainer_gpus, mode in sc.trainer.recompute_logprobs, colocated=place.colocated))
    transfer = SimWeightTransfer(TransferCost(sc, colocated=place.colocated))
    # A filter judges groups by their rewards: the workload's modelled ones, at no cost in time.
    reward = ModelledReward(workload) if sc.filter is not None else None
    return Workers(engines, backend, transfer, reward=reward, spread=workload.reward_spread,
                   agent=SimEpisodes(workload) if agent is not None else None)


def connect_sim(
    plan: RunPlan, on_step: Optional[ProgressFn] = None, run_dir: Optional[Path] = None, stop_at_step: Optional[int] = None,
) -> InProcRun:
    """One mode's system on simulated workers; call it inside the virtual clock's loop."""
    timeline = Timeline()
    return connect_inproc(plan, sim_workers(plan, timeline), timeline, on_step, run_dir, stop_at_step)


def run_sim(
    plan: RunPlan,
    on_step: Optional[ProgressFn] = None,
    run_dir: Optional[Path] = None,
    resume: bool = False,
    stop_at_step: Optional[int] = None,
) -> RunResult:
    """Run one mode on the virtual clock. ``run_dir`` keeps the checkpoints (a temporary
    directory when None); ``resume`` starts from the latest one."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-run-") as tmp:
        where = Path(run_dir) if run_dir is not None else Path(tmp)

        async def main() -> RunResult:
            run = connect_sim(plan, on_step, where, stop_at_step)
            end_s = await drive(run, restore_latest(run.system) if resume else None)
            return run.system.result(end_s)

        t0 = time.perf_counter()
        # A run allocates a few objects per simulated sample, nearly all freed at once by their
        # counts: the cycle collector's default pace (every 700 allocations) spent a sixth of
        # the CPU rescanning them.
        thresholds = gc.get_threshold()
        gc.set_threshold(50_000, 20, 100)
        try:
            result = virtual_clock.run(main())
        finally:
            gc.set_threshold(*thresholds)
        result.wall_s = time.perf_counter() - t0
        return result
