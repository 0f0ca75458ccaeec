"""The simulated rollout engine: continuous batching, simulated as events, not tokens.

Between two events (a request joins, finishes or is aborted) the running batch B is
fixed and every running request gains one token per decode step. A step costs
``tau(C) = base(B) + k * C`` where C, the context held by the batch, grows by B per
step, so after x steps the elapsed time is ``tau0 * x + (k * B / 2) * x**2``. The next
completion time is solved in closed form, and progress is tracked as a real number of
steps (a fluid approximation of discrete steps; tokens are counted with floor()).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque
from typing import Optional

from core.costs import DecodeCost
from core.sample import Group, Sample
from core.timeline import GENERATE, Timeline
from core.workload import Workload

_EPS = 1e-9


class _Waiter:
    __slots__ = ("future", "pending", "aborted")

    def __init__(self, future: asyncio.Future, pending: int) -> None:
        self.future = future
        self.pending = pending
        self.aborted = False


class _Request:
    __slots__ = ("sample", "waiter", "steps", "join", "ctx")

    def __init__(self, sample: Sample, waiter: _Waiter, steps: int, ctx: int) -> None:
        self.sample = sample
        self.waiter = waiter
        self.steps = steps  # tokens this request will generate before it stops
        self.join = 0.0  # engine step count when it joined the batch
        self.ctx = ctx  # context tokens when it joined


class SimEngine:
    """One rollout engine (a tensor-parallel replica) on the virtual clock.

    Implements the engine protocol: ``generate``, ``abort_all``, ``update_weights``,
    ``clear_cache``.
    """

    def __init__(
        self,
        name: str,
        cost: DecodeCost,
        workload: Workload,
        max_num_seqs: int,
        timeline: Optional[Timeline] = None,
    ) -> None:
        self.name = name
        self.cost = cost
        self.workload = workload
        self.max_num_seqs = max_num_seqs
        self.timeline = timeline
        self.version = 0
        self.tokens_generated = 0
        self.prefill_tokens = 0
        self.busy_s = 0.0
        self.seq_s = 0.0  # integral of the running batch size over time
        self._heap: list[tuple[float, int, _Request]] = []
        self._waiting: deque[_Request] = deque()
        self._seq = 0
        self._S = 0.0  # decode steps since start (real-valued)
        self._t = 0.0  # time at which _S holds; may lie ahead of now during a prefill stall
        self._C = 0.0  # context tokens held by the running batch at _S
        self._busy_since: Optional[float] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_key = 0.0

    # -- protocol ---------------------------------------------------------------------------
    async def generate(self, group: Group, max_response_len: int) -> bool:
        """Generate every unfinished response of ``group``; False if aborted first.

        Tokens are appended to the samples in place, tagged with this engine's version.
        """
        todo = group.unfinished()
        if not todo:
            return True
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), len(todo))
        lengths = self.workload.response_lengths(group.prompt_id)
        reqs = []
        for s in todo:
            want = min(int(lengths[s.index]), max_response_len) - s.n_response
            if want <= 0:  # cut at the budget earlier, or resumed at the cap
                s.finished = True
                waiter.pending -= 1
                continue
            reqs.append(_Request(s, waiter, want, s.n_prompt + s.n_response))
        if not reqs:
            return True
        self._advance(loop.time())
        self._waiting.extend(reqs)
        self._admit(loop.time())
        self._reschedule(loop)
        return await waiter.future

    async def abort_all(self) -> int:
        """Interrupt every request; partial tokens stay on their samples. Returns how many."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._advance(now)
        n = len(self._heap) + len(self._waiting)
        for _, _, req in self._heap:
            done = min(req.steps, int(math.floor(self._S - req.join + _EPS)))
            self._emit(req.sample, done)
            self._release(req.waiter, aborted=True)
        for req in self._waiting:
            self._release(req.waiter, aborted=True)
        self._heap.clear()
        self._waiting.clear()
        self._C = 0.0
        self._t = max(self._t, now)
        self._idle(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return n

    async def update_weights(self, version: int, weights=None) -> None:
        if self._heap or self._waiting:
            raise RuntimeError(f"{self.name}: update_weights with requests in flight; pause the rollout first")
        self.version = version

    async def clear_cache(self) -> None:
        """KV blocks of finished and aborted requests are already free in this model."""

    # -- event model ------------------------------------------------------------------------
    def _steps_in(self, dt: float) -> float:
        """Decode steps completed in ``dt`` seconds from the anchor."""
        b = len(self._heap)
        tau0 = self.cost.step_s(b, self._C)
        a = 0.5 * self.cost.kv_s_per_token * b
        return 2.0 * dt / (tau0 + math.sqrt(tau0 * tau0 + 4.0 * a * dt))

    def _time_for(self, x: float) -> float:
        b = len(self._heap)
        return self.cost.step_s(b, self._C) * x + 0.5 * self.cost.kv_s_per_token * b * x * x

    def _advance(self, now: float, to_steps: Optional[float] = None) -> None:
        """Move the anchor to ``now`` (or exactly to step ``to_steps``, reached at ``now``)."""
        dt = now - self._t
        if dt <= 0:
            return
        b = len(self._heap)
        if b:
            x = (to_steps - self._S) if to_steps is not None else self._steps_in(dt)
            self._S += x
            self._C += b * x
            self.seq_s += b * dt
        self._t = now

    def _admit(self, now: float) -> None:
        """Move waiting requests into the batch; their prefill stalls the engine."""
        if not self._waiting or len(self._heap) >= self.max_num_seqs:
            return
        stall = 0.0
        prompt_done: set[int] = set()
        cost = self.cost
        while self._waiting and len(self._heap) < self.max_num_seqs:
            req = self._waiting.popleft()
            s = req.sample
            # The group's prompt is prefilled once (prefix caching); resumed tokens are recomputed.
            start = s.n_prompt if s.prompt_id in prompt_done else 0
            prompt_done.add(s.prompt_id)
            stall += cost.prefill_s(start, req.ctx)
            self.prefill_tokens += req.ctx - start
            req.join = self._S
            if s.started_at != s.started_at:  # NaN: first time in a batch
                s.started_at = now
            self._C += req.ctx
            self._seq += 1
            heapq.heappush(self._heap, (self._S + req.steps, self._seq, req))
        if self._busy_since is None:
            self._busy_since = now
        self._t = max(self._t, now) + stall

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._heap:
            return
        key = self._heap[0][0]
        self._timer_key = key
        self._timer = loop.call_at(self._t + self._time_for(key - self._S), self._on_finish)

    def _on_finish(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = None
        now = loop.time()
        key = self._timer_key
        if now > self._t:
            self._advance(now, to_steps=key)
        heap = self._heap
        while heap and heap[0][0] <= self._S + _EPS:
            _, _, req = heapq.heappop(heap)
            self._C -= req.ctx + req.steps
            self._emit(req.sample, req.steps)
            req.sample.finished = True
            req.sample.finished_at = now
            self._release(req.waiter, aborted=False)
        if not heap:
            self._C = 0.0
        self._admit(now)
        if not heap:
            self._idle(now)
        self._reschedule(loop)

    def _emit(self, sample: Sample, n: int) -> None:
        if n > 0:
            sample.add_tokens(n, self.version)
            self.tokens_generated += n

    def _release(self, waiter: _Waiter, aborted: bool) -> None:
        waiter.aborted |= aborted
        waiter.pending -= 1
        if waiter.pending == 0 and not waiter.future.done():
            waiter.future.set_result(not waiter.aborted)

    def _idle(self, now: float) -> None:
        if self._busy_since is not None:
            self.busy_s += now - self._busy_since
            if self.timeline is not None:
                self.timeline.add(self.name, GENERATE, self._busy_since, now)
            self._busy_since = None

    async def close(self, now: float) -> None:
        """Close the open busy span at the end of a run."""
        self._advance(now)
        self._idle(now)
