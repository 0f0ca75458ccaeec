"""How many times each inserted row may be sampled: a sample-to-insert ratio, held within a band.

An off-policy learner and its samplers run at whatever speed their hardware gives them. Left
alone, a fast learner replays the same rows over and over (overfitting to old data), and a
fast sampler fills the buffer with rows that are overwritten before anyone learns from them.
Reverb's answer, written here from its description: fix the ratio of sampled rows to inserted
rows and block whichever side runs ahead.

With ``inserts`` and ``samples`` counted in rows since the start, the limiter keeps

    lag = inserts * samples_per_insert - samples

(the samples the inserted rows are still owed) within ``centre ± error_buffer``, where
``centre = min_size_to_sample * samples_per_insert``: an insert that would push ``lag`` above the
band waits for samples, a sample that would push it below waits for inserts. Before
``min_size_to_sample`` rows were inserted, inserts never wait and samples always do.

A request of k rows moves ``lag`` by ``k * samples_per_insert`` (insert) or ``k`` (sample).
If the band were narrower than one insert plus one sample, there would be values of ``lag``
from which neither side may move, and both would wait forever; the constructor refuses such a
band, given the largest requests the two sides will make.

The limiter is asyncio, for one event loop: the replay's own (a Ray async actor runs every call
on one loop), or the sim's virtual-clock loop. It reports how long each side waited, on its loop's
clock, which is the figure a user needs to see which side to scale.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Optional

from core.env.held_time import HeldTime
from core.pipeline.staleness_queue import QueueClosed


class LimiterClosed(QueueClosed):
    """The limiter was closed while a request waited, or before it was made. A kind of
    ``QueueClosed``: a sampler stops on either intake's close alike."""


class RateLimiter:
    """Blocks inserts and samples to hold the sample-to-insert ratio (see the module docstring)."""

    def __init__(
        self,
        samples_per_insert: float,
        min_size_to_sample: int,
        error_buffer: float,
        max_insert: int,
        max_sample: int,
    ) -> None:
        """``max_insert`` and ``max_sample``: the most rows one insert or one sample request will carry."""
        if not (isinstance(samples_per_insert, (int, float)) and math.isfinite(samples_per_insert) and samples_per_insert > 0):
            raise ValueError(f"samples_per_insert={samples_per_insert!r}: must be a finite number > 0")
        for name, v in (("min_size_to_sample", min_size_to_sample), ("max_insert", max_insert), ("max_sample", max_sample)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
        if not (isinstance(error_buffer, (int, float)) and math.isfinite(error_buffer) and error_buffer >= 0):
            raise ValueError(f"error_buffer={error_buffer!r}: must be a finite number >= 0")
        need = max_insert * samples_per_insert + max_sample
        if 2 * error_buffer < need:
            raise ValueError(
                f"error_buffer={error_buffer!r}: a band of ±{error_buffer} cannot hold one insert of {max_insert} rows "
                f"({max_insert * samples_per_insert:g} samples owed) and one sample of {max_sample}, so both sides could "
                f"wait forever; use error_buffer >= {need / 2:g}"
            )
        self.samples_per_insert = float(samples_per_insert)
        self.min_size_to_sample = min_size_to_sample
        self.error_buffer = float(error_buffer)
        self.max_insert = max_insert
        self.max_sample = max_sample
        centre = min_size_to_sample * self.samples_per_insert
        self._low = centre - self.error_buffer
        self._high = centre + self.error_buffer
        self.inserts = 0
        self.samples = 0
        self.blocked_s = {"insert": 0.0, "sample": 0.0}
        self.blocked_calls = {"insert": 0, "sample": 0}
        self.holds = HeldTime()  # on the loop's clock; a wait's held seconds are not blocked ones
        self._closed = False
        # Per side, the waiting requests in order: (rows, future).
        self._waiters: dict[str, deque[tuple[int, asyncio.Future]]] = {"insert": deque(), "sample": deque()}

    @property
    def lag(self) -> float:
        """Samples the inserted rows are still owed: ``inserts * samples_per_insert - samples``."""
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, rows: int) -> bool:
        self._check(rows, self.max_insert, "insert")
        if self.inserts < self.min_size_to_sample:
            return True
        return self.lag + rows * self.samples_per_insert <= self._high

    def can_sample(self, rows: int) -> bool:
        self._check(rows, self.max_sample, "sample")
        return self.inserts >= self.min_size_to_sample and self.lag - rows >= self._low

    async def wait_insert(self, rows: int, timeout: Optional[float] = None) -> None:
        """Return once ``rows`` may be inserted; the caller stores them and then calls ``inserted``
        before it awaits anything else. ``asyncio.TimeoutError`` after ``timeout`` seconds;
        ``LimiterClosed`` once closed."""
        await self._admit("insert", rows, self.can_insert, timeout)

    def inserted(self, rows: int) -> None:
        self._check(rows, self.max_insert, "insert")
        self.inserts += rows
        self._wake()

    async def wait_sample(self, rows: int, timeout: Optional[float] = None) -> None:
        """As ``wait_insert``, for a sample of ``rows``; then ``sampled``."""
        await self._admit("sample", rows, self.can_sample, timeout)

    def sampled(self, rows: int) -> None:
        self._check(rows, self.max_sample, "sample")
        self.samples += rows
        self._wake()

    def restore(self, inserts: int, samples: int) -> None:
        """Take the counts of a replay rebuilt from its journal (a restarted replay actor)."""
        if inserts < 0 or samples < 0:
            raise ValueError(f"inserts={inserts}, samples={samples}: counts cannot be negative")
        self.inserts, self.samples = int(inserts), int(samples)
        self._wake()

    def hold(self) -> None:
        """The run is held for an evaluation: until ``end_hold``, waiting is not counted as blocked."""
        self.holds.hold(asyncio.get_running_loop().time())

    def end_hold(self) -> None:
        self.holds.end(asyncio.get_running_loop().time())

    def close(self) -> None:
        """Release every waiter with ``LimiterClosed``: the run is stopping."""
        self._closed = True
        self._wake()

    def stats(self) -> dict:
        return {
            "inserts": self.inserts,
            "samples": self.samples,
            "samples_per_insert": self.samples / self.inserts if self.inserts else 0.0,
            "insert_blocked_s": self.blocked_s["insert"],
            "sample_blocked_s": self.blocked_s["sample"],
            "insert_blocked_calls": self.blocked_calls["insert"],
            "sample_blocked_calls": self.blocked_calls["sample"],
        }

    # ---- internals ----------------------------------------------------------------------

    def _check(self, rows: int, most: int, side: str) -> None:
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= most:
            raise ValueError(f"{side} of {rows!r} rows: must be an integer in [1, {most}] (the limiter's max_{side})")

    async def _admit(self, side: str, rows: int, allowed, timeout: Optional[float]) -> None:
        if self._closed:
            raise LimiterClosed(f"{side} after close")
        if allowed(rows):
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        t0 = loop.time()  # the loop's clock: virtual seconds on the sim's virtual-clock loop
        self.blocked_calls[side] += 1
        queue = self._waiters[side]
        woken = False
        try:
            while not allowed(rows):
                if self._closed:
                    raise LimiterClosed(f"{side} of {rows} rows: the limiter was closed while it waited")
                fut = loop.create_future()
                # Woken and still refused (another request took the room first): it keeps its place.
                (queue.appendleft if woken else queue.append)((rows, fut))
                left = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait_for(fut, left)
                woken = True
        finally:
            self.blocked_s[side] += self.holds.running(t0, loop.time())
            self._wake()  # admitted or gone: the next in line may go now

    def _wake(self) -> None:
        # Only the first waiter of each side, and only if it may go: 32 samplers can wait at once,
        # and waking every one on every change cost the sim most of its time. Each request
        # admitted or gone wakes the next, so none is left waiting while it could go.
        for side, allowed in (("insert", self.can_insert), ("sample", self.can_sample)):
            queue = self._waiters[side]
            while queue and queue[0][1].done():
                queue.popleft()
            while queue and (self._closed or allowed(queue[0][0])):
                queue.popleft()[1].set_result(None)
                if not self._closed:
                    break
