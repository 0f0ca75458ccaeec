"""Simulated samples per CPU-second of a whole sim run (async mode), at 128 and 1,024 GPUs.

The simulator is for sweeps: its cost is CPU per simulated sample. ``longtail-128gpu`` is the
shipped scenario, shortened to 200 trainer steps; ``longtail-1024gpu`` is the same workload on
512 rollout + 512 trainer GPUs (512 engines), 100 steps. Each run's samples per CPU-second
of the thread that runs the simulator (``time.thread_time``: the simulator is one thread, an
asyncio loop, and CPU time is the least disturbed by other work on a shared machine) goes into
the benchmark's ``extra_info``, beside the rate per CPU-second of the whole process. The two
differ by the CPU of threads that are not the simulator's: torch's and OpenBLAS's worker
pools, which earlier benchmarks in the same process (the torch engine's) leave spinning for a
while: right after a torch and a numpy matmul, one run measured 139,200 samples per process
CPU-second and 161,229 per thread CPU-second. That is why the target held when this file ran
alone and missed in ``make test``'s benchmark run. bench/targets.py holds the absolute target, measured against the
simulator before the speed-up on the same machine, and the 1,024/128 per-sample cost ratio,
both from one run of this file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from core.model.run_plan import RunPlan
from core.runtimes.sim import run_sim
from harness.scenario import load

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "longtail-128gpu.yaml"
CASES = {
    "longtail-128gpu": ["trainer.steps=200"],
    "longtail-1024gpu": ["resources.rollout_gpus=512", "resources.trainer_gpus=512", "trainer.steps=100"],
}


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """Imports and first-call costs out of the measured runs."""
    run_sim(RunPlan.of(load(SCENARIO, ["trainer.steps=2"]), "async"))


@pytest.mark.parametrize("case", list(CASES))
def test_sim_samples_per_cpu_second(benchmark, case):
    sc = load(SCENARIO, CASES[case])
    rates = []

    process_rates = []

    def run() -> int:
        t0, p0 = time.thread_time(), time.process_time()
        result = run_sim(RunPlan.of(sc, "async"))
        rates.append(result.ledger.produced / (time.thread_time() - t0))
        process_rates.append(result.ledger.produced / (time.process_time() - p0))
        return result.ledger.produced

    produced = benchmark.pedantic(run, rounds=2, iterations=1)
    assert produced >= sc.trainer.steps * sc.trainer.batch_size
    benchmark.extra_info["samples"] = produced
    benchmark.extra_info["samples_per_cpu_s"] = max(rates)
    benchmark.extra_info["samples_per_process_cpu_s"] = max(process_rates)
