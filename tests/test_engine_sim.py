"""The simulated engine against a token-by-token reference of continuous batching."""

import asyncio

import numpy as np
import pytest

from core.sim import virtual_clock
from core.model.config import Scenario, with_changes
from core.sim.costs import DecodeCost
from core.sim.engine import SimEngine
from core.model.sample import Group, Sample
from core.sim.workload import Workload
from tests.engine_reference import stepped_finish_times


class FixedLengths:
    """A workload whose group g has the given response lengths."""

    def __init__(self, lengths):
        self.lengths = {g: np.asarray(v) for g, v in lengths.items()}

    def response_lengths(self, prompt_id):
        return self.lengths[prompt_id]


def group(pid, n, prompt=64):
    return Group(pid, [Sample(pid * n + i, pid, i, prompt) for i in range(n)], version=0, admitted_at=0.0)


def test_finish_times_match_token_by_token_reference():
    sc = Scenario()
    cost = DecodeCost(sc, 1)
    lengths = [37, 120, 5, 300, 300, 64, 1, 999]
    wl = FixedLengths({0: lengths})

    async def main():
        e = SimEngine("e", cost, wl, max_num_seqs=64)
        g = group(0, len(lengths))
        assert await e.generate(g, 10_000)
        return g, e

    g, e = virtual_clock.run(main())
    ref = stepped_finish_times(cost, 64, lengths, cost.prefill_s(0, 64))
    got = [s.finished_at for s in g.samples]
    # The engine integrates step time over a real-valued step count: within 0.5 % of stepping.
    np.testing.assert_allclose(got, ref, rtol=5e-3)
    assert [s.n_response for s in g.samples] == lengths
    assert e.tokens_generated == sum(lengths)
    assert all(s.version_spans == [[0, n]] for s, n in zip(g.samples, lengths))


def test_max_num_seqs_queues_the_rest():
    sc = Scenario()
    cost = DecodeCost(sc, 1)
    wl = FixedLengths({0: [100] * 4})

    async def main():
        e = SimEngine("e", cost, wl, max_num_seqs=2)
        g = group(0, 4)
        await e.generate(g, 10_000)
        return sorted(s.finished_at for s in g.samples)

    t = virtual_clock.run(main())
    assert t[0] == pytest.approx(t[1])
    assert t[2] == pytest.approx(t[3])
    assert t[2] > 1.9 * t[0]  # the second pair starts only when the first pair is done


def test_abort_keeps_partial_tokens_and_resume_finishes_at_budget():
    sc = Scenario()
    cost = DecodeCost(sc, 1)
    wl = FixedLengths({0: [50, 5000, 400]})

    async def main():
        loop = asyncio.get_running_loop()
        e = SimEngine("e", cost, wl, max_num_seqs=8)
        g = group(0, 3)
        task = asyncio.create_task(e.generate(g, 1000))
        await asyncio.sleep(1.0)
        assert await e.abort_all() == 2
        assert await task is False
        partial = [s.n_response for s in g.samples]
        await e.update_weights(1)
        t0 = loop.time()
        assert await e.generate(g, 1000) is True
        return g, partial, loop.time() - t0

    g, partial, _ = virtual_clock.run(main())
    assert partial[0] == 50 and 0 < partial[1] < 1000 and 0 < partial[2] < 400
    assert [s.n_response for s in g.samples] == [50, 1000, 400]  # the 5000-token one is cut at the budget
    long = g.samples[1]
    assert long.version_spans == [[0, partial[1]], [1, 1000 - partial[1]]]
    assert list(np.unique(long.token_versions())) == [0, 1]


def test_update_weights_refuses_in_flight_requests():
    sc = Scenario()
    wl = FixedLengths({0: [100]})

    async def main():
        e = SimEngine("e", DecodeCost(sc, 1), wl, max_num_seqs=8)
        task = asyncio.create_task(e.generate(group(0, 1), 1000))
        await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="pause the rollout first"):
            await e.update_weights(1)
        await e.abort_all()
        await task

    virtual_clock.run(main())


def test_workload_lengths_are_deterministic_and_clipped():
    sc = with_changes(Scenario(), {"workload.max_response_len": 3000})
    a, b = Workload(sc.workload, 7), Workload(sc.workload, 7)
    order = [5, 1, 3000, 2]
    first = [a.response_lengths(p).tolist() for p in order]
    second = [b.response_lengths(p).tolist() for p in reversed(order)][::-1]
    assert first == second
    assert max(max(x) for x in first) <= 3000
    assert Workload(sc.workload, 8).response_lengths(5).tolist() != first[0]
