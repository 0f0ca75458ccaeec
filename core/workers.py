"""The real workers of the local runtime: engines, the torch trainer, weights, prompts, rewards.

``local_workers`` builds them in this process; the ray runtime (core/ray_runtime.py) builds
the same classes inside actors. Which device a role uses, and how many threads, follow from
the placement: on a machine without a GPU a device is one CPU core.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import numpy as np

from core.config import Scenario
from core.driver import Workers
from core.placement import Placement
from core.timeline import Timeline

# The environment of every process of a real run. No model hub is reachable (or wanted):
# everything loads from the local model directory.
REAL_RUNTIME_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_env() -> None:
    """Set the real runtimes' environment defaults in this process (before torch, transformers
    or vLLM are imported)."""
    import os

    for k, v in REAL_RUNTIME_ENV.items():
        os.environ.setdefault(k, v)


def device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_engine(sc: Scenario, name: str, threads: int, timeline: Optional[Timeline], seed: int):
    """One rollout engine of the scenario's kind (not started)."""
    common = dict(
        max_num_seqs=sc.rollout.max_num_seqs,
        temperature=sc.engine.temperature,
        seed=seed,
        threads=threads,
        timeline=timeline,
        device=device(),
    )
    if sc.engine.kind == "torch":
        from core.engine_torch import TorchEngine

        return TorchEngine(name, sc.tiny_model.path, **common)
    if sc.engine.kind == "vllm":
        from core.engine_vllm import VllmEngine

        return VllmEngine(
            name,
            sc.tiny_model.path,
            max_model_len=sc.tiny_model.max_positions,
            kv_cache_gb=sc.engine.vllm_kv_cache_gb,
            gpu_memory_utilization=sc.engine.vllm_gpu_memory_utilization,
            **common,
        )
    raise ValueError(f"engine.kind {sc.engine.kind!r} has no real engine")


def make_backend(sc: Scenario, threads: int):
    """The torch GRPO trainer, with its device's peak FLOP/s measured for ``util/mfu``."""
    from core.grpo import TorchTrainBackend, peak_flops

    dev = device()
    backend = TorchTrainBackend(
        sc.tiny_model.path, sc.learn, threads=threads, device=dev, seed=sc.seed, temperature=sc.engine.temperature
    )
    backend.peak_flops = peak_flops(threads, dev)
    return backend


class LocalWeightTransfer:
    """In one process the engines load a copy of the trainer's weights: no transfer but the copy."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.latest: Optional[tuple[int, dict]] = None

    async def send(self, version: int) -> dict[str, np.ndarray]:
        weights = await asyncio.to_thread(self.backend.weights)
        self.latest = (version, weights)
        return weights


def local_workers(sc: Scenario, mode: str, timeline: Timeline) -> Workers:
    """Engines, trainer and reward in this process, each with the threads its devices give."""
    from core.reward import TaskPrompts, TaskReward, make_task
    from core.tiny_model import ensure

    apply_env()
    ensure(sc.tiny_model.path, sc.tiny_model)
    place = Placement.of(sc, mode)
    engines = [
        make_engine(sc, f"engine{i:03d}", place.gpus_per_engine, timeline, seed=sc.seed * 1000 + i)
        for i in range(place.engines)
    ]
    backend = make_backend(sc, place.trainer_gpus)
    task = make_task(sc)
    return Workers(engines, backend, LocalWeightTransfer(backend), TaskPrompts(task), TaskReward(task))


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


def run_local(sc: Scenario, mode: str, on_step=None, on_processes=None, run_dir=None, resume=False, stop_at_step=None) -> "System":
    """Run one mode in this process on the real clock, with real engines and trainer.
    ``run_dir`` keeps checkpoints; ``resume`` starts from the latest one there."""
    import os

    from core.driver import connect_components, drive, resume_point
    from core.evaluation import Evaluations

    async def main() -> "System":
        loop = asyncio.get_running_loop()
        timeline = Timeline()
        workers = local_workers(sc, mode, timeline)
        await asyncio.gather(*(e.start() for e in workers.engines))
        if on_processes is not None:
            on_processes([("driver", os.getpid())])
        system = connect_components(sc, mode, on_step, workers, timeline, run_dir=run_dir)
        evals = Evaluations(sc)
        loop.zero()
        point = resume_point(system) if resume else None
        watch = loop.create_task(_watch_versions(system, workers.transfer, evals))
        try:
            await drive(system, point, stop_at_step)
        finally:
            watch.cancel()
        await evals.finish_local()
        system.evaluations = evals.results
        return system

    loop = RealClockLoop()
    t0 = time.perf_counter()
    try:
        asyncio.set_event_loop(loop)
        system = loop.run_until_complete(main())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    system.wall_s = time.perf_counter() - t0
    return system


async def _watch_versions(system, transfer: "LocalWeightTransfer", evals) -> None:
    """Start an evaluation when a due version's weights are out; never waits on one."""
    while True:
        version, weights = transfer.latest or (0, None)  # version 0: the model directory's weights
        evals.launch_local(weights, version, asyncio.get_running_loop().time())
        await asyncio.sleep(0.05)
