import asyncio
import time

import pytest

from core.api import Engine
from core.model.faults import CallTimeout
from core.pipeline.supervised_engine import SupervisedEngine
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


def test_timers_fire_in_time_order_ties_first_scheduled_first_and_cancelled_ones_never():
    fired = []

    async def main():
        loop = asyncio.get_running_loop()
        now = lambda: loop.time()  # noqa: E731
        loop.call_at(5.0, lambda: fired.append(("handle", now())))
        light = loop.call_at_light(2.0, lambda: fired.append(("gone", now())))
        loop.call_at_light(5.0, lambda: fired.append(("light", now())))
        loop.call_at(1.0, lambda: fired.append(("first", now())))
        dead = loop.call_at(3.0, lambda: fired.append(("dead", now())))
        light.cancel()
        dead.cancel()
        with pytest.raises(RuntimeError, match="timers pending"):
            loop.set_time(0.5)
        await asyncio.sleep(10.0)

    virtual_clock.run(main())
    # A cancelled timer neither runs nor stops the clock; equal times run in the order scheduled.
    assert fired == [("first", 1.0), ("handle", 5.0), ("light", 5.0)]


def test_light_timers_run_in_the_iteration_asyncio_would_run_them_and_can_be_set_again():
    fired, ticks = [], []

    async def main():
        loop = asyncio.get_running_loop()

        def first():
            fired.append(("first", loop.time()))
            loop.call_soon(lambda: fired.append(("soon", loop.time())))

        def tick():
            ticks.append(loop.time())
            if len(ticks) < 3:
                loop.rearm_light(timer, loop.time() + 1.0)

        loop.call_at_light(1.0, first)
        # Within the clock's resolution: the same iteration, at the same time, before "soon".
        loop.call_at_light(1.0 + 1e-10, lambda: fired.append(("same iteration", loop.time())))
        timer = loop.call_at_light(2.0, tick)
        gone = loop.call_at_light(3.0, lambda: None)
        gone.cancel()
        await asyncio.sleep(10.0)
        with pytest.raises(RuntimeError, match="has run and was not cancelled"):
            loop.rearm_light(gone, 11.0)

    virtual_clock.run(main())
    assert fired == [("first", 1.0), ("same iteration", 1.0), ("soon", 1.0)]
    assert ticks == [2.0, 3.0, 4.0]


def test_a_supervised_call_times_out_at_its_deadline_and_others_do_not():
    class Slow:
        name = "slow"

        async def generate(self, group, max_response_len, stop_ids=frozenset()):
            await asyncio.sleep(group)
            return True

    async def main():
        loop = asyncio.get_running_loop()
        e = SupervisedEngine(Slow(), generate_s=10.0, control_s=5.0, restart_s=5.0, max_restarts=1)
        results = await asyncio.gather(e.generate(3.0, 0), e.generate(30.0, 0), e.generate(9.0, 0), return_exceptions=True)
        return results, loop.time()

    results, end = virtual_clock.run(main())
    assert results[0] is True and results[2] is True
    assert isinstance(results[1], CallTimeout) and end == 10.0


def test_a_control_call_sets_its_deadline_timer_only_if_it_waits_and_then_times_out_at_its_deadline():
    class Hung(Engine):
        name = "e"

        async def clear_cache(self):
            return None

        async def abort_all(self):
            await asyncio.sleep(60.0)  # hung

    async def main():
        loop = asyncio.get_running_loop()
        e = SupervisedEngine(Hung(), generate_s=10.0, control_s=5.0, restart_s=5.0, max_restarts=1)
        await asyncio.sleep(1.0)
        for _ in range(3):
            await e.clear_cache()
        quiet = [entry for entry in loop._timers if not entry[2].cancelled()]
        with pytest.raises(CallTimeout):
            await e.abort_all()
        return quiet, loop.time()

    quiet, end = virtual_clock.run(main())
    assert quiet == [] and end == 6.0
