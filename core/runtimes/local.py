"""The local runtime: every component in this process, on the real clock, with real engines
(torch or vLLM) and the torch GRPO trainer. A device of the scenario's resources is a GPU
when torch sees one, else one CPU core."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from core.api import Interrupted
from core.model.result import RunResult
from core.model.run_plan import RunPlan
from core.model.timeline import Timeline
from core.pipeline.wiring import ProgressFn, Workers
from core.real.evaluation import Evaluations
from core.real.reward import TaskPrompts, TaskReward, make_task
from core.real.hf_model import ensure_model_dir, model_dtype
from core.real.workers import LocalWeightTransfer, apply_env, make_backend, make_engine
from core.runtimes.agent import make_agent
from core.runtimes.inproc import connect_inproc, drive
from core.runtimes.run_checkpoint import restore_latest
from core.sim.workload import Workload

ProcessesFn = Callable[[list[tuple[str, int]]], None]


def local_workers(plan: RunPlan, timeline: Timeline, run_dir: Optional[Path] = None) -> Workers:
    """Engines, trainer and reward in this process, each with the threads its devices give."""
    sc, place = plan.scenario, plan.placement
    apply_env()
    ensure_model_dir(sc)  # the tiny model is built on first use
    engines = [
        make_engine(sc, f"engine{i:03d}", place.gpus_per_engine, timeline, seed=sc.seed * 1000 + i)
        for i in range(place.engines)
    ]
    backend = make_backend(sc, place.trainer_gpus)
    task = make_task(sc)
    return Workers(
        engines, backend, LocalWeightTransfer(backend, model_dtype(sc.real_model_path, sc.engine.dtype)), TaskPrompts(task), TaskReward(task),
        spread=Workload.of(sc).reward_spread, agent=make_agent(plan, task, run_dir),
    )


class RealClockLoop(asyncio.SelectorEventLoop):
    """The ordinary event loop with ``time()`` counted from its creation, so a real run's
    times start at 0 like a simulated one's."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        super().__init__()

    def time(self) -> float:
        return time.monotonic() - self._t0

    def zero(self) -> None:
        """Start the clock again at 0 (once set-up is done). Only call it with no timer pending."""
        self._t0 = time.monotonic()

    def set_time(self, t: float) -> None:
        """Go on from ``t`` (a resumed run continues at its checkpoint's time)."""
        self._t0 = time.monotonic() - t


def run_local(
    plan: RunPlan,
    on_step: Optional[ProgressFn] = None,
    on_processes: Optional[ProcessesFn] = None,
    run_dir: Optional[Path] = None,
    resume: bool = False,
    stop_at_step: Optional[int] = None,
) -> RunResult:
    """Run one mode in this process on the real clock, with real engines and trainer.
    ``run_dir`` keeps checkpoints; ``resume`` starts from the latest one there."""

    presses: list[float] = []  # Ctrl-C, once set-up is done
    unjournaled: list[str] = []

    async def main() -> Optional[RunResult]:
        loop = asyncio.get_running_loop()
        timeline = Timeline()
        workers = local_workers(plan, timeline, run_dir)
        await asyncio.gather(*(e.start() for e in workers.engines))
        if on_processes is not None:
            on_processes([("driver", os.getpid())])
        run = connect_inproc(plan, workers, timeline, on_step, run_dir, stop_at_step)
        evals = Evaluations(plan.scenario)
        loop.zero()
        point = restore_latest(run.system) if resume else None
        watch = loop.create_task(_watch_versions(workers.transfer, evals))
        try:
            with _StopOnCtrlC(asyncio.current_task(), presses):
                end_s = await drive(run, point)
        except asyncio.CancelledError:
            if not presses:
                raise
            # Ctrl-C: drive stopped rollout, and the rollouter waited for the tool calls under
            # way and journaled them, unless a second Ctrl-C cut that wait short.
            if workers.agent is not None:
                unjournaled.extend(workers.agent.under_way())
            return None
        finally:
            watch.cancel()
        await evals.finish_local()
        return run.system.result(end_s, evaluations=evals.results)

    loop = RealClockLoop()
    t0 = time.perf_counter()
    try:
        asyncio.set_event_loop(loop)
        result = loop.run_until_complete(main())
    finally:
        _close(loop, wait=len(presses) < 2)
    if result is None:
        raise Interrupted(unjournaled if len(presses) > 1 else ())
    result.wall_s = time.perf_counter() - t0
    return result


class _StopOnCtrlC:
    """While the run goes (set-up done), Ctrl-C cancels ``task``: the run stops as at its end,
    without a KeyboardInterrupt raised wherever the loop happened to be. Each press is appended
    to ``presses``; a second cancels the first's wait. Only in the main thread, and only where
    Ctrl-C is Python's (a SIGINT the shell ignores stays ignored)."""

    def __init__(self, task: asyncio.Task, presses: list[float]) -> None:
        self.task, self.presses = task, presses
        self.on = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def __enter__(self) -> list[float]:
        if self.on:
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._pressed)
        return self.presses

    def _pressed(self) -> None:
        self.presses.append(time.monotonic())
        self.task.cancel()

    def __exit__(self, *exc) -> None:
        if self.on:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)  # back to KeyboardInterrupt


def _close(loop: asyncio.AbstractEventLoop, wait: bool) -> None:
    """Close ``loop`` as ``asyncio.run`` does: every task still there cancelled and finished first,
    so that none is collected later against a closed loop (each would print "Event loop is
    closed"). ``wait``: also for the executor's threads (tool calls past their timeout)."""
    try:
        tasks = asyncio.all_tasks(loop)
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        if wait:
            loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def _watch_versions(transfer: LocalWeightTransfer, evals: Evaluations) -> None:
    """Start an evaluation when a due version's weights are out; never waits on one."""
    while True:
        version, weights = transfer.latest or (0, None)  # version 0: the model directory's weights
        evals.launch_local(weights, version, asyncio.get_running_loop().time())
        await asyncio.sleep(0.05)
