"""HeldTime against a direct sum over its intervals, on seeded random holds and spans; the
stores leave a hold's seconds out of their blocked time."""

from __future__ import annotations

import asyncio
import random

import pytest

from core.env.held_time import HeldTime
from core.env.rate_limiter import RateLimiter
from core.env.segment_queue import SegmentQueue


def overlap(spans, a, b):
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


@pytest.mark.parametrize("seed", range(5))
def test_held_seconds_are_the_overlap_with_every_hold_an_open_one_up_to_the_query(seed):
    rng = random.Random(seed)
    held, spans, now, since = HeldTime(), [], 0.0, None
    for _ in range(200):
        now += rng.random()
        op = rng.random()
        if op < 0.3:
            held.hold(now)
            since = now if since is None else since  # a second hold while held changes nothing
        elif op < 0.6:
            held.end(now)
            if since is not None:
                spans.append((since, now))
            since = None
        a = rng.uniform(0.0, now)
        b = rng.uniform(a, now)
        known = spans + ([(since, b)] if since is not None else [])
        assert held.held(a, b) == pytest.approx(overlap(known, a, b))
        assert held.running(a, b) == pytest.approx(b - a - overlap(known, a, b))
        assert held.holding == (since is not None)


def test_a_wait_through_a_hold_counts_only_its_seconds_outside_it_in_either_store():
    """A sampler waiting for room (PPO's queue) and one held back by the rate limit (DQN's replay)
    while the run is held for an evaluation: the store reports only the unheld part as blocked."""

    async def main():
        queue = SegmentQueue(capacity=1, max_staleness=1)
        await queue.reserve(0)  # the one place: the next reserve waits
        waiting = asyncio.create_task(queue.reserve(1))
        limiter = RateLimiter(1.0, 1, error_buffer=2.0, max_insert=2, max_sample=2)
        limiter.inserted(2)
        limited = asyncio.create_task(limiter.wait_insert(2))  # owed 2 samples already: waits
        await asyncio.sleep(0.05)
        queue.hold()
        limiter.hold()
        await asyncio.sleep(0.3)
        queue.end_hold()
        limiter.end_hold()
        await asyncio.sleep(0.05)
        queue.release(0)
        limiter.sampled(2)
        await asyncio.gather(waiting, limited)
        return queue.stats()["insert_blocked_s"], limiter.stats()["insert_blocked_s"]

    for blocked in asyncio.run(main()):
        assert 0.09 <= blocked < 0.25  # 0.1 s outside the hold (and the loop's own delays), not 0.4
