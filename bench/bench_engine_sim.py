"""The simulated engine's event model against stepping every decode step.

Both compute the finish time of every response of one engine's batch (64 responses with
lognormal lengths, one group per prompt). ``events`` is ``core.sim.engine.SimEngine`` on the
virtual clock: it jumps from completion to completion with the closed-form step-time
integral. ``token steps`` advances one decode step at a time, the way a token-level
simulator would. The ratio is what lets a 1,000-step, 128-GPU scenario run in seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.sim import virtual_clock
from core.model.config import Scenario
from core.sim.costs import DecodeCost
from core.sim.engine import SimEngine
from core.model.sample import Group, Sample
from tests.engine_reference import stepped_finish_times

N_GROUPS, GROUP = 4, 16
PROMPT = 512


class Lengths:
    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = np.clip(np.rint(1200 * np.exp(rng.standard_normal((N_GROUPS, GROUP)))), 1, 16384).astype(int)

    def response_lengths(self, prompt_id: int) -> np.ndarray:
        return self.lengths[prompt_id]


def run_events(cost: DecodeCost, wl: Lengths) -> list[float]:
    async def main():
        import asyncio

        e = SimEngine("e", cost, wl, max_num_seqs=256)
        groups = [Group(p, [Sample(p * GROUP + i, p, i, PROMPT) for i in range(GROUP)], 0, 0.0) for p in range(N_GROUPS)]
        await asyncio.gather(*(e.generate(g, 16384) for g in groups))
        return [s.finished_at for g in groups for s in g.samples]

    return virtual_clock.run(main())


def run_token_steps(cost: DecodeCost, wl: Lengths) -> list[float]:
    return stepped_finish_times(cost, PROMPT, wl.lengths.ravel(), N_GROUPS * cost.prefill_s(0, PROMPT))


@pytest.mark.parametrize("impl", ["events", "token steps"])
def test_one_engine_batch(benchmark, impl):
    cost = DecodeCost(Scenario(), 1)
    wl = Lengths(0)
    fn = run_events if impl == "events" else run_token_steps
    finish = benchmark(fn, cost, wl)
    # Same physics: within 0.5 % of each other on every response.
    np.testing.assert_allclose(sorted(finish), sorted(run_token_steps(cost, wl)), rtol=5e-3)
