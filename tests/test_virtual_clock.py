import asyncio
import time

import pytest

from core.sim import virtual_clock
from core.sim.virtual_clock import SimulationStalled


def test_sleeps_run_in_virtual_time_and_order():
    order = []

    async def sleeper(name, dt):
        await asyncio.sleep(dt)
        order.append((name, asyncio.get_running_loop().time()))

    async def main():
        await asyncio.gather(sleeper("b", 3600.0), sleeper("a", 1.5), sleeper("c", 86400.0 * 3))

    t0 = time.perf_counter()
    virtual_clock.run(main())
    assert time.perf_counter() - t0 < 1.0
    assert order == [("a", 1.5), ("b", 3600.0), ("c", 259200.0)]


def test_wait_for_times_out_on_the_virtual_clock():
    async def main():
        fut = asyncio.get_running_loop().create_future()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 10.0)
        return asyncio.get_running_loop().time()

    assert virtual_clock.run(main()) == pytest.approx(10.0)


def test_a_deadlock_is_reported_not_hung():
    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationStalled, match="no task is ready"):
        virtual_clock.run(main())
