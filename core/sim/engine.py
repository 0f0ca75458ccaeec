"""The simulated rollout engine: continuous batching, simulated as events, not tokens.

Between two events (a request joins, finishes or is aborted) the running batch B is
fixed and every running request gains one token per decode step. A step costs
``tau(C) = base(B) + k * C`` where C, the context held by the batch, grows by B per
step, so after x steps the elapsed time is ``tau0 * x + (k * B / 2) * x**2``. The next
completion time is solved in closed form, and progress is tracked as a real number of
steps (a fluid approximation of discrete steps; tokens are counted with floor()).

The KV cache holds ``cost.kv_capacity_tokens`` tokens. A waiting request is admitted only
while the batch's context, its own and one more token per running request fit. When the
growing context reaches the capacity (after ``(cap - C) / B`` steps, another event), the most
recently admitted request is preempted as vLLM V1 does in recompute mode: its KV is freed,
it goes back to the front of the waiting queue with the tokens it has, and is prefilled again
over prompt + those tokens when it is readmitted.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import weakref
from collections import deque
from typing import Optional

from core.api import Engine
from core.sim.costs import DecodeCost
from core.model.faults import WorkerLost
from core.model.sample import Group, Sample
from core.model.timeline import GENERATE, Timeline
from core.sim.workload import Workload

_EPS = 1e-9
_heappop = heapq.heappop


class _StepTerms:
    """A decode step's terms per batch size B, for the event path's closed forms: ``base[B]`` is
    ``cost.base_s(B)`` and ``half_kv[B]`` is ``0.5 * kv_s_per_token * B``, the very floats the
    formulas would compute (a step is ``base + C * kv_s_per_token``, as ``DecodeCost.step_s``).
    One per cost model, shared by its engines: a 512-engine run would otherwise fill 512 tables."""

    __slots__ = ("cost", "kv", "base", "half_kv")

    def __init__(self, cost: DecodeCost) -> None:
        self.cost = cost
        self.kv = cost.kv_s_per_token
        self.base: list[float] = []
        self.half_kv: list[float] = []

    def grow(self, b: int) -> None:
        for n in range(len(self.base), b + 1):
            self.base.append(self.cost.base_s(n))
            self.half_kv.append(0.5 * self.kv * n)


_TERMS: "weakref.WeakKeyDictionary[DecodeCost, _StepTerms]" = weakref.WeakKeyDictionary()


def _terms(cost: DecodeCost) -> _StepTerms:
    t = _TERMS.get(cost)
    if t is None:
        t = _TERMS[cost] = _StepTerms(cost)
    return t


class _Waiter:
    """One generate call. Its tokens reach the samples only when the call returns: a worker
    that dies mid-call takes the group's whole generation with it, as a real process does."""

    __slots__ = ("future", "pending", "aborted", "emits")

    def __init__(self, future: asyncio.Future, pending: int) -> None:
        self.future = future
        self.pending = pending
        self.aborted = False
        self.emits: list[tuple[Sample, int, int, bool, float]] = []  # (sample, tokens, version, finished, at)


class _Request:
    __slots__ = ("sample", "waiter", "steps", "join", "ctx", "preempted", "cached", "calls")

    def __init__(self, sample: Sample, waiter: _Waiter, steps: int, ctx: int, cached: int = 0, calls: bool = False) -> None:
        self.sample = sample
        self.waiter = waiter
        self.steps = steps  # tokens this request will generate before it stops
        self.join = 0.0  # engine step count when it joined the batch
        self.ctx = ctx  # context tokens when it joined
        self.preempted = False  # its KV was freed: readmitting it prefills its context again
        self.cached = cached  # context tokens whose KV this engine kept from the episode's last turn
        self.calls = calls  # an agent's turn that ends in a tool call: its KV may be kept for the next


class SimEngine(Engine):
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
        restart_s: float = 0.0,
        turns: bool = False,
        keep_kv: bool = False,
    ) -> None:
        self.name = name
        # Agent episodes (core/sim/agent_episodes.py): the caller's cap is where a turn ends, and
        # an engine that keeps KV holds an episode's context while its tool runs.
        self.turns = turns
        self.keep_kv = keep_kv
        self._kept: dict[int, int] = {}  # sample uid -> context tokens whose KV is held between turns
        self.kv_released = 0  # kept contexts freed under cache pressure, to be prefilled again
        self.cost = cost
        self.workload = workload
        self.max_num_seqs = max_num_seqs
        self.timeline = timeline
        self.version = 0
        self.tokens_generated = 0
        self.prefill_tokens = 0
        self.busy_s = 0.0
        self.seq_s = 0.0  # integral of the running batch size over time
        self.preemptions = 0  # requests evicted from a full KV cache
        self.recomputed_tokens = 0  # context prefilled again when they came back
        self._cap = cost.kv_capacity_tokens
        self._terms = _terms(cost)
        self._timer_cap = False  # the pending timer is the KV cache filling up, not a completion
        self._heap: list[tuple[float, int, _Request]] = []
        self._waiting: deque[_Request] = deque()
        self._seq = 0
        self._S = 0.0  # decode steps since start (real-valued)
        self._t = 0.0  # time at which _S holds; may lie ahead of now during a prefill stall
        self._C = 0.0  # context tokens held by the running batch at _S
        self._busy_since: Optional[float] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_key = 0.0
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # where the timer is set, and its call_at
        self._call_at = None
        self._light = False  # the loop has light timers (the virtual clock's)
        self._spent = None  # this engine's light timer once it has run
        # faults (core/runtimes/supervision.py): a slowdown factor, a call that will hang, death until a time
        self.slowdown = 1.0
        self.hang_next: Optional[str] = None
        self.down_until: Optional[float] = None
        self.restart_s = restart_s  # how long a crashed worker takes to come back
        self._hung: list[asyncio.Future] = []
        self._frozen_at: Optional[float] = None  # frozen between decode steps since (inflight sync)

    # -- protocol ---------------------------------------------------------------------------
    async def generate(self, group: Group, max_response_len: int, stop_ids: frozenset[int] = frozenset()) -> bool:
        """Generate every unfinished response of ``group``; False if aborted first.

        Tokens are appended to the samples in place, tagged with this engine's version. There
        are no token ids: a response's length is drawn from the workload; with ``turns`` (agent
        episodes) a request ends at ``max_response_len``, and ``stop_ids`` given means the turn
        ends there in a tool call (its KV kept for the next turn when ``keep_kv``).
        """
        # Only a fault set on this worker makes _enter do anything: spare the coroutine otherwise.
        if not self.answers_now():
            await self._enter("generate")
        todo = group.unfinished()
        if not todo:
            return True
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), len(todo))
        reqs = []
        if self.turns:
            calls = bool(stop_ids) and self.keep_kv
            for s in todo:
                want = max_response_len - s.n_response
                if want <= 0:
                    waiter.emits.append((s, 0, self.version, True, s.finished_at))
                    waiter.pending -= 1
                    continue
                reqs.append(_Request(s, waiter, want, s.n_prompt + s.n_response, self._unkeep(s.uid), calls))
        else:
            lengths = self.workload.response_lengths(group.prompt_id).tolist()
            for s in todo:
                want = min(lengths[s.index], max_response_len) - s.n_response
                if want <= 0:  # cut at the budget earlier, or resumed at the cap
                    waiter.emits.append((s, 0, self.version, True, s.finished_at))
                    waiter.pending -= 1
                    continue
                reqs.append(_Request(s, waiter, want, s.n_prompt + s.n_response))
        if not reqs:
            _apply(waiter.emits)
            return True
        self._advance(loop.time())
        self._waiting.extend(reqs)
        if self._frozen_at is None:  # a frozen engine admits them when it thaws
            self._admit(loop.time())
            self._reschedule(loop)
        return await waiter.future

    async def abort_all(self) -> int:
        """Interrupt every request; partial tokens stay on their samples. Returns how many."""
        if not self.answers_now():
            await self._enter("abort_all")
        return self._stop_all(aborted=True)

    def _stop_all(self, aborted: bool) -> int:
        """End every request: aborted (tokens kept) or lost with a dead worker (tokens gone)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._advance(now)
        n = len(self._heap) + len(self._waiting)
        for _, _, req in self._heap:
            done = self._tokens_so_far(req)
            self._emit(req, done)
            self._release(req.waiter, aborted=aborted, lost=not aborted)
        for req in self._waiting:
            self._release(req.waiter, aborted=aborted, lost=not aborted)
        self._heap.clear()
        self._waiting.clear()
        self._C = 0.0
        self._t = max(self._t, now)
        self._idle(now)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return n

    def answers_now(self) -> bool:
        """No fault set: every control call returns without waiting (core.api.Engine)."""
        return self.down_until is None and self.hang_next is None

    async def update_weights(self, version: int, weights=None) -> None:
        if not self.answers_now():
            await self._enter("update_weights")
        if (self._heap or self._waiting) and self._frozen_at is None:
            raise RuntimeError(f"{self.name}: update_weights with requests in flight; pause the rollout first, or freeze it (inflight)")
        self.version = version

    async def freeze(self) -> None:
        """Stop between decode steps with every request and its KV kept: the tokens each has
        so far are handed over under the current version, and the clock of the batch stops."""
        if not self.answers_now():
            await self._enter("freeze")
        if self._frozen_at is not None:
            return
        now = asyncio.get_running_loop().time()
        self._advance(now)
        for _, _, req in self._heap:
            done = self._tokens_so_far(req)
            if done > 0:
                self._emit(req, done)
                # The request goes on from here with those tokens as context: its completion
                # step (join + steps) and its share of the batch's context stay the same.
                req.join += done
                req.steps -= done
                req.ctx += done
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._idle(now)
        self._frozen_at = now

    async def thaw(self) -> None:
        """Decode on from the kept KV, on whatever version was loaded meanwhile."""
        if not self.answers_now():
            await self._enter("thaw")
        if self._frozen_at is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        # Nothing decoded while frozen: a prefill stall under way resumes where it stood.
        self._t += now - self._frozen_at
        self._frozen_at = None
        if self._heap:
            self._busy_since = now
        if self._waiting:
            self._admit(now)
        self._reschedule(loop)

    async def clear_cache(self) -> None:
        """KV blocks of finished and aborted requests are already free in this model; kept
        contexts of agent episodes are freed (their next turns prefill them again)."""
        if not self.answers_now():
            await self._enter("clear_cache")
        if self._kept:
            loop = asyncio.get_running_loop()
            self._advance(loop.time())
            self._cap += sum(self._kept.values())
            self._kept.clear()
            self._reschedule(loop)

    # -- KV held between an agent's turns ---------------------------------------------------------
    def _keep(self, uid: int, tokens: int) -> None:
        self._kept[uid] = tokens
        self._cap -= tokens

    def _unkeep(self, uid: int) -> int:
        """The kept context of ``uid``'s episode, handed to its next turn (0 if none)."""
        tokens = self._kept.pop(uid, 0)
        self._cap += tokens
        return tokens

    def _release_kept(self, need: float) -> bool:
        """Free kept contexts, oldest first, until ``need`` tokens are free or none is left;
        True if any was freed. Their episodes' next turns prefill their whole context again."""
        freed = False
        while self._kept and need > 0:
            uid = next(iter(self._kept))
            tokens = self._kept.pop(uid)
            self._cap += tokens
            need -= tokens
            self.kv_released += 1
            freed = True
        return freed

    # -- faults -----------------------------------------------------------------------------
    async def _enter(self, call: str) -> None:
        """A dead worker answers nothing; a hung call never returns."""
        if self.down_until is not None:
            raise WorkerLost(self.name, call, "the worker is dead")
        if self.hang_next == call:
            self.hang_next = None
            fut = asyncio.get_running_loop().create_future()
            self._hung.append(fut)
            try:
                await fut  # until a crash fails it, or the caller's timeout cancels it
            except asyncio.CancelledError:
                # The caller gave up (its timeout, or its own death): the worker is still
                # stuck, and its next such call hangs too, until a restart (crash) clears it.
                if self.down_until is None:
                    self.hang_next = call
                raise

    def crash(self, restart_s: float) -> int:
        """The worker's process dies: every request fails and its tokens are lost; it is back
        ``restart_s`` later. Returns the requests lost."""
        now = asyncio.get_running_loop().time()
        n = self._stop_all(aborted=False)
        for fut in self._hung:
            if not fut.done():
                fut.set_exception(WorkerLost(self.name, "call", "the worker died"))
        self._hung.clear()
        self.hang_next = None
        self.down_until = now + restart_s
        self._frozen_at = None  # the process that comes back is not frozen
        return n

    async def recover(self) -> None:
        """Kill a hung worker, then wait out its restart (its weights are the caller's to load)."""
        if self.down_until is None:
            self.crash(self.restart_s)
        await asyncio.sleep(max(0.0, self.down_until - asyncio.get_running_loop().time()))
        self.down_until = None
        self.version = -1  # nothing loaded yet

    def set_slowdown(self, factor: float) -> None:
        """Every step and prefill from now on takes ``factor`` times as long."""
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        self.slowdown = factor
        self._reschedule(loop)

    # -- event model ------------------------------------------------------------------------
    def _steps_in(self, dt: float) -> float:
        """Decode steps completed in ``dt`` seconds from the anchor."""
        b = len(self._heap)
        tau0 = self.cost.step_s(b, self._C) * self.slowdown
        a = 0.5 * self.cost.kv_s_per_token * b * self.slowdown
        return 2.0 * dt / (tau0 + math.sqrt(tau0 * tau0 + 4.0 * a * dt))

    def _advance(self, now: float, to_steps: Optional[float] = None) -> None:
        """Move the anchor to ``now`` (or exactly to step ``to_steps``, reached at ``now``)."""
        dt = now - self._t
        if dt <= 0 or self._frozen_at is not None:
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
        waiting, heap, most = self._waiting, self._heap, self.max_num_seqs
        if not waiting or len(heap) >= most:
            return
        stall = 0.0
        # A prompt is prefilled once for the requests admitted together (prefix caching); an
        # agent's episodes arrive one call each, and share the prompt of those running.
        prompt_done: set[int] = {r.sample.prompt_id for _, _, r in heap} if self.turns else set()
        prefill_s = self.cost.prefill_s
        slowdown = self.slowdown
        cap = self._cap
        S, C, seq = self._S, self._C, self._seq  # in locals: once per request admitted
        while waiting and len(heap) < most:
            req = waiting[0]
            ctx = req.ctx
            # Its context, and the next token of every running request and of its own.
            if C + ctx + len(heap) + 1 > cap and (heap or self._kept):
                if not self._release_kept(C + ctx + len(heap) + 1 - cap):
                    break  # (alone, a request always fits: the scenario check saw to it)
                cap = self._cap
                continue
            waiting.popleft()
            s = req.sample
            # The group's prompt is prefilled once (prefix caching); resumed tokens are recomputed,
            # but for an episode's context that this engine kept while its tool ran.
            start = s.n_prompt if s.prompt_id in prompt_done else 0
            if req.cached:
                start = max(start, min(req.cached, ctx))
                req.cached = 0
            prompt_done.add(s.prompt_id)
            stall += prefill_s(start, ctx) * slowdown
            self.prefill_tokens += ctx - start
            if req.preempted:
                req.preempted = False
                self.recomputed_tokens += ctx - start
            req.join = S
            if s.started_at != s.started_at:  # NaN: first time in a batch
                s.started_at = now
            C += ctx
            seq += 1
            heapq.heappush(heap, (S + req.steps, seq, req))
        self._C, self._seq = C, seq
        if self._busy_since is None:
            self._busy_since = now
        self._t = max(self._t, now) + stall

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._heap and self._frozen_at is None:
            self._schedule(loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer of the next event, with no timer pending and the batch not empty."""
        heap = self._heap
        key = heap[0][0]
        S = self._S
        C = self._C
        # The cache fills up before the next completion: C + B * x = cap. (One request alone
        # always fits: the scenario check refuses an engine that cannot hold one sequence.)
        b = len(heap)
        full = S + (self._cap - C) / b if b > 1 else math.inf
        self._timer_cap = full < key
        if self._timer_cap:
            key = full
        self._timer_key = key
        terms = self._terms
        if b >= len(terms.base):
            terms.grow(b)
        # Seconds to step key - S: step_s(b, C) * x + 0.5 * kv * b * x**2, in the order it was always computed.
        x = key - S
        when = self._t + ((terms.base[b] + C * terms.kv) * x + terms.half_kv[b] * x * x) * self.slowdown
        if loop is not self._loop:
            self._loop = loop
            self._spent = None
            # The virtual clock's light timer when there is one (tests may drive an engine on another loop).
            self._light = hasattr(loop, "rearm_light")
            self._call_at = loop.call_at_light if self._light else loop.call_at
        if self._spent is not None:  # the light timer that just ran, set again
            self._timer = self._loop.rearm_light(self._spent, when)
            self._spent = None
        else:
            self._timer = self._call_at(when, self._on_finish)

    def _on_finish(self) -> None:
        # The hottest path of a simulation (one call per completion): _advance, _emit and
        # _release are spelled out here.
        loop = self._loop  # the one its timer was set on
        if self._light:
            self._spent = self._timer  # free to be set again
        self._timer = None
        now = loop.time()
        heap = self._heap
        if now > self._t:  # _advance(now, to_steps=self._timer_key)
            b = len(heap)
            if b:
                x = self._timer_key - self._S
                self._S += x
                self._C += b * x
                self.seq_s += b * (now - self._t)
            self._t = now
        if self._timer_cap:
            self._preempt()
        limit = self._S + _EPS
        version = self.version
        while heap and heap[0][0] <= limit:
            req = _heappop(heap)[2]
            n = req.steps
            self._C -= req.ctx + n
            if req.calls:  # an agent's turn ended in a call: its context stays for the next turn
                self._keep(req.sample.uid, req.ctx + n)
            if n > 0:
                self.tokens_generated += n
            waiter = req.waiter
            waiter.emits.append((req.sample, n, version, True, now))
            waiter.pending -= 1
            if waiter.pending == 0 and not waiter.future.done():
                _apply(waiter.emits)
                waiter.future.set_result(not waiter.aborted)
        if not heap:
            self._C = 0.0
        if self._waiting:
            self._admit(now)
        if heap:
            self._schedule(loop)
        else:
            self._idle(now)

    def _preempt(self) -> None:
        """Free the KV of the most recently admitted request and queue it first to come back
        with the tokens it has (vLLM V1's recompute preemption). A context kept for an agent's
        next turn goes first: it only costs that turn a prefill."""
        if self._release_kept(1):
            return
        heap = self._heap
        j = max(range(len(heap)), key=lambda i: heap[i][1])
        _, _, req = heap[j]
        heap[j] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        held = self._S - req.join
        done = self._tokens_so_far(req)
        self._C -= req.ctx + held
        self._emit(req, done)
        req.steps -= done
        req.ctx += done
        req.preempted = True
        self.preemptions += 1
        self._waiting.appendleft(req)

    def _tokens_so_far(self, req: _Request) -> int:
        """Whole tokens a running request has decoded since it joined (the anchor is at now)."""
        return min(req.steps, int(math.floor(self._S - req.join + _EPS)))

    def _emit(self, req: _Request, n: int, finished_at: Optional[float] = None) -> None:
        self.tokens_generated += max(n, 0)
        done = finished_at is not None
        req.waiter.emits.append((req.sample, n, self.version, done, finished_at if done else req.sample.finished_at))

    def _release(self, waiter: _Waiter, aborted: bool, lost: bool = False) -> None:
        waiter.aborted |= aborted
        waiter.pending -= 1
        if waiter.future.done():
            return
        if lost:
            waiter.future.set_exception(WorkerLost(self.name, "generate", "the worker died mid-generation"))
        elif waiter.pending == 0:
            _apply(waiter.emits)
            waiter.future.set_result(not waiter.aborted)

    def _idle(self, now: float) -> None:
        if self._busy_since is not None:
            self.busy_s += now - self._busy_since
            if self.timeline is not None:
                self.timeline.add(self.name, GENERATE, self._busy_since, now)
            self._busy_since = None

    def state(self) -> dict:
        """What a checkpoint keeps of an idle engine (taken while rollout is paused)."""
        if self._heap or self._waiting or self._busy_since is not None:
            raise RuntimeError(f"{self.name}: state of a busy engine; pause the rollout first")
        return {
            "version": self.version, "tokens_generated": self.tokens_generated, "prefill_tokens": self.prefill_tokens,
            "busy_s": self.busy_s, "seq_s": self.seq_s, "S": self._S, "t": self._t, "C": self._C, "seq": self._seq,
            "slowdown": self.slowdown, "hang_next": self.hang_next, "down_until": self.down_until,
            "preemptions": self.preemptions, "recomputed_tokens": self.recomputed_tokens,
            "kept": [[u, n] for u, n in self._kept.items()], "kv_released": self.kv_released,
        }

    def restore(self, st: dict) -> None:
        self.version, self.tokens_generated, self.prefill_tokens = st["version"], st["tokens_generated"], st["prefill_tokens"]
        self.busy_s, self.seq_s, self._S, self._t, self._C, self._seq = st["busy_s"], st["seq_s"], st["S"], st["t"], st["C"], st["seq"]
        self.slowdown, self.hang_next, self.down_until = st["slowdown"], st["hang_next"], st["down_until"]
        self.preemptions, self.recomputed_tokens = st.get("preemptions", 0), st.get("recomputed_tokens", 0)
        for uid, n in st.get("kept", []):
            self._keep(uid, n)
        self.kv_released = st.get("kv_released", 0)

    async def close(self, now: float) -> None:
        """Close the open busy span at the end of a run."""
        self._advance(now)
        self._idle(now)


def _apply(emits: list[tuple[Sample, int, int, bool, float]]) -> None:
    """Hand a returning call's tokens to its samples, in the order they were generated."""
    for sample, n, version, done, finished_at in emits:
        sample.add_tokens(n, version)
        if done:
            sample.finished = True
            sample.finished_at = finished_at
