"""Waiting, in a test, for a condition that an engine's own loop makes true."""

import asyncio


async def wait_for(cond, timeout: float = 10.0, every: float = 0.001) -> None:
    """Poll ``cond`` every ``every`` seconds; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(every)
