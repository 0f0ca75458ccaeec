"""The Rollouter: feeds GRPO groups to engines under a concurrency limit and a staleness budget.

Finished groups go to the queue at once (streaming, no batch barrier). ``pause("wait")``
drains in-flight generations; ``pause("abort")`` interrupts them and keeps their partial
responses in a cancel queue that is served first after ``resume``; ``pause("keep")`` freezes
them in the engines, which load the new weights under them and decode on after ``resume``.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections import deque
from typing import Any, Awaitable, Callable, Optional

from core.api import AgentLoop, CollectiveTicket, PauseMode, PromptSource, RewardFn
from core.model.faults import CollectiveBroken, FaultLog, RestartsExhausted, WorkerLost, worker_key
from core.model.ledger import Ledger
from core.model.reward_fn import reward_failed
from core.model.sample import Group, Sample
from core.pipeline.group_filter import GroupFilter
from core.pipeline.staleness_queue import AsyncStalenessQueue
from core.pipeline.supervised_engine import SupervisedEngine

log = logging.getLogger(__name__)


class Rollouter:
    """Producer of finished groups.

    Admission control (DESIGN.md, data flow step 1): a new group of n is admitted only if
    n <= min(max_concurrency - running, floor((version + 1 + lead) * window) - admitted),
    where ``admitted`` counts samples admitted and not dropped. The trainer consumes
    ``window`` samples per version, so rollout never runs more than ``lead`` windows ahead.

    With a ``group_filter`` and ``pass_floor`` < 1, a group not yet scored counts at the pass
    rate measured so far (at least ``pass_floor``): the budget holds in expected survivors.
    ``surplus`` samples may run beyond the budget (over-provisioning); once every sample the
    budget admits at this version is done, the rest are cut: resumed after the next version
    bump (``resume_surplus``) or dropped.
    """

    def __init__(
        self,
        *,
        engines: list[SupervisedEngine],
        queue: AsyncStalenessQueue,
        ledger: Ledger,
        group_size: int,
        prompt_tokens: int,
        max_response_len: int,
        max_concurrency: int,
        window: int,
        lead: float,
        max_staleness: int,
        plan_samples: int,
        head_start: int = 0,
        prompts: Optional[PromptSource] = None,
        reward: Optional[RewardFn] = None,
        faults: Optional[FaultLog] = None,
        stop_timeout_s: Optional[float] = None,
        catch_up: Optional[Callable[[int], Awaitable[Any]]] = None,
        agent: Optional[AgentLoop] = None,
        group_filter: Optional[GroupFilter] = None, pass_floor: float = 1.0, surplus: int = 0, resume_surplus: bool = False,
    ) -> None:
        self.engines = engines
        self._beyond_budget(group_filter, pass_floor, surplus, resume_surplus)
        self.agent = agent  # episodes of many turns; None: one completion per sample
        self.queue = queue
        self.ledger = ledger
        self.group_size = group_size
        self.prompt_tokens = prompt_tokens
        self.max_response_len = max_response_len
        self.max_concurrency = max_concurrency
        self.window = window
        self.lead = lead
        self.max_staleness = max_staleness
        self.plan_samples = plan_samples
        self.head_start = head_start  # samples the trainer takes once, beyond its windows (a replay ring filling)
        self.prompts = prompts  # real engines need prompt tokens and finished groups a reward; the sim neither
        self.reward = reward
        self.version = 0
        self.running = 0  # samples being generated
        self._holding = 0  # samples of the groups being generated, finished members included
        self.admitted = 0  # samples admitted and not dropped: what the staleness budget counts
        self.cancel_queue: deque[Group] = deque()
        # Groups whose worker died under them: generated again from what this process holds.
        self.retry_queue: deque[Group] = deque()
        self.faults = faults or FaultLog()
        self.stop_timeout_s = stop_timeout_s  # how long stop() waits on a generation that ignores abort
        self._weights: Any = None  # the latest version's weights, for a worker back from a restart
        self._weights_version = 0  # their version, set before the live engines load them
        self._down: set[int] = set()  # workers lost and not yet back
        # Back from a restart, waiting for the next sync: collective weights (a broadcast) can
        # only be taken together with every other engine, never by one alone.
        self._rejoining: set[int] = set()
        self._restarted = False  # a worker restarted since the last collective sync it took part in: a new group for all
        # ``catch_up(version)``: a copy of the trainer's weights one engine loads alone (the object-store
        # fallback of a collective transfer), or None: it rejoins at the next sync. Without it a
        # lone engine killed would wait for a sync that its batches must make happen.
        self.catch_up = catch_up
        self._recovering: dict[int, asyncio.Task] = {}
        self._failure: Optional[BaseException] = None
        self._next_prompt = 0
        self._active: set[asyncio.Task] = set()
        self._assigned = [0] * len(engines)  # samples routed to each engine and not yet back
        # Interrupted groups by prompt id: (engine, its life) that holds their partial tokens and
        # prefix cache. A restart ends a life: what the engine held died with it.
        self._holders: dict[int, tuple[int, int]] = {}
        self._lives = [0] * len(engines)
        # Per engine: resumed groups routed back to it as their prefix holder, and resumed groups
        # it took because their holder was down or restarted.
        self.sticky_resumes = [0] * len(engines)
        self.moved_resumes = [0] * len(engines)
        # (assigned, index) of every engine, pushed on each change: the least-loaded live engine
        # is the smallest entry that is current, without a scan of all engines per group.
        self._loads = [(0, i) for i in range(len(engines))]
        self._paused = False
        self._cut = asyncio.Event()  # set: episodes stop at a turn boundary or tool call
        self._frozen = False  # engines hold their generations between decode steps (pause "keep")
        self._stopped = False
        self._wake = asyncio.Event()

    def _beyond_budget(self, group_filter: Optional[GroupFilter], pass_floor: float, surplus: int, resume_surplus: bool) -> None:
        """What admission runs past the staleness budget: groups a filter is expected to drop, and
        an over-provisioned surplus (see the class's docstring)."""
        self.filter = group_filter
        self._expect_pass = group_filter is not None and pass_floor < 1.0
        self.surplus = surplus
        self._drop_cut = surplus > 0 and not resume_surplus
        self._cutting = False
        self._cut_task: Optional[asyncio.Task] = None
        self._scoring = 0  # samples of finished groups being scored

    # -- admission ----------------------------------------------------------------------------
    def _limit(self) -> int:
        """Samples the staleness budget lets be admitted and not dropped at this version."""
        return min(math.floor((self.version + 1 + self.lead) * self.window + 1e-9) + self.head_start, self.plan_samples)

    def budget(self) -> int:
        """Samples the staleness budget (and over-provisioning) still admits at the current version."""
        held = self.admitted
        if self._expect_pass:
            held -= int(self.in_flight() * (1.0 - self.filter.pass_rate()))
        return min(self._limit() + self.surplus, self.plan_samples) - held

    def _window_done(self) -> bool:
        """Every sample the budget admits at this version is generated, scored and kept:
        whatever still generates is over-provisioned surplus."""
        return self.admitted - self.in_flight() - self._scoring >= self._limit()

    def _next_group(self) -> Optional[Group]:
        if self.surplus and (self._cutting or self._window_done()):
            return None  # nothing more runs at this version: the surplus waits for the next
        while self.retry_queue:
            g = self.retry_queue[0]
            if not any(s.n_response for s in g.samples):
                g.version = self.version  # nothing generated yet: it starts afresh on this version
            elif self.version - g.version > self.max_staleness:
                self.retry_queue.popleft()
                self._drop([g], "stale_interrupted")
                continue
            if self.running + len(g.unfinished()) > self.max_concurrency:
                return None
            return self.retry_queue.popleft()
        while self.cancel_queue:
            g = self.cancel_queue[0]
            if self.version - g.version > self.max_staleness:
                # Anything it finishes would be evicted: stop spending tokens on it.
                self.cancel_queue.popleft()
                self._drop([g], "stale_interrupted")
                continue
            if self.running + len(g.unfinished()) > self.max_concurrency:
                return None
            self.cancel_queue.popleft()
            g.resumes += 1
            return g
        n = self.group_size
        if min(self.max_concurrency - self.running, self.budget()) < n:
            return None
        pid = self._next_prompt
        self._next_prompt += 1
        now = asyncio.get_running_loop().time()
        tokens = self.prompts.tokens(pid) if self.prompts is not None else None
        n_prompt = self.prompt_tokens if tokens is None else len(tokens)
        # uid, prompt_id, index, n_prompt, prompt_tokens by position: matching five keywords
        # per sample was a twentieth of a simulation's CPU.
        uid = pid * n
        samples = [Sample(uid + i, pid, i, n_prompt, tokens, admitted_at=now) for i in range(n)]
        g = Group(prompt_id=pid, samples=samples, version=self.version, admitted_at=now)
        self.admitted += n
        self.ledger.admitted(g)
        return g

    def _drop(self, groups: list[Group], reason: str) -> None:
        if self.agent is not None:
            self.agent.forget(groups)
        self.admitted -= sum(g.size for g in groups)
        self.ledger.dropped_groups(groups, reason)
        self._wake.set()

    def dropped_from_queue(self, groups: list[Group], reason: str) -> None:
        """Groups the queue evicted free their staleness budget."""
        if groups:
            self._drop(groups, reason)

    # -- main loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while not self._stopped:
            if self._failure is not None:
                raise self._failure
            all_down = len(self._down) == len(self.engines)
            group = None if self._paused or all_down else self._next_group()
            if group is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            i = self._route(group)
            k = len(group.unfinished())
            self._assign(i, k)
            self.running += k
            self._holding += group.size
            task = asyncio.create_task(self._generate(group, i, k))
            self._active.add(task)
            task.add_done_callback(self._generation_ended)

    def _generation_ended(self, task: asyncio.Task) -> None:
        """An error a generation did not expect fails the run: left in its task, nobody would
        see it, and the budget its group held would stall the rollout for good."""
        self._active.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            self._wake.set()

    def _assign(self, i: int, k: int) -> None:
        n = self._assigned[i] = self._assigned[i] + k
        loads = self._loads
        heapq.heappush(loads, (n, i))
        if len(loads) > 8 * len(self.engines) + 64:  # drop the stale entries
            self._loads = [(n, j) for j, n in enumerate(self._assigned)]
            heapq.heapify(self._loads)

    def _route(self, group: Group) -> int:
        """A resumed group goes back to the engine that holds its prefix while that engine is up
        (no prefill, no token transfer); anything else to the least-loaded live engine, on our
        own count: a task just created has not reached its engine yet."""
        held = self._holders.pop(group.prompt_id, None) if self._holders else None
        if held is None:
            return self._least_loaded()
        i, life = held
        if i not in self._down and self._lives[i] == life:
            self.sticky_resumes[i] += 1
            return i
        i = self._least_loaded()
        self.moved_resumes[i] += 1
        return i

    def _least_loaded(self) -> int:
        """The live engine with the fewest samples assigned, the lowest index on a tie."""
        loads, assigned, down = self._loads, self._assigned, self._down
        while True:
            n, i = loads[0]
            if n == assigned[i] and i not in down:
                return i
            heapq.heappop(loads)  # stale, or a lost worker (pushed again when it is back)

    async def _generate(self, group: Group, i: int, k: int) -> None:
        try:
            if self.agent is None:
                completed = await self.engines[i].generate(group, self.max_response_len)
            else:
                completed = await self.agent.run(group, self.engines[i], self.max_response_len, self._cut)
        except WorkerLost as exc:
            # What it generated died with it; what this process holds is generated again.
            self.retry_queue.append(group)
            self.ledger.requeue(group)
            self.worker_lost(i, exc)
            return
        except asyncio.CancelledError:
            # An engine that cancels its own stream on abort must not leak the cancellation:
            # unless this task itself is being cancelled, the generation was interrupted.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                self.retry_queue.append(group)  # still accounted for: stop() hands it back
                raise
            completed = False
        finally:
            self.running -= k
            self._assign(i, -k)
            self._holding -= group.size
            self._wake.set()
        if completed:
            if self.reward is not None and not await self._scored(group):
                return
            group.finished_at = asyncio.get_running_loop().time()
            if self.agent is not None:
                self.agent.forget((group,))
            if not await self.queue.put(group, group.version):
                self._drop([group], "stale_on_arrival")
            elif self.surplus:
                self._cut_if_done()
        else:
            group.aborts += 1
            for s in group.samples:
                if not s.finished:
                    s.interrupts += 1
            if self._drop_cut and not self._stopped:
                self._drop([group], "overprovision_cut")  # sync and async never resume a cut group
                return
            self._holders[group.prompt_id] = (i, self._lives[i])
            self.cancel_queue.append(group)

    async def _scored(self, group: Group) -> bool:
        """Score a finished group; False if it is not to be queued (dropped, or to be scored again)."""
        self._scoring += group.size
        try:
            rewards = await self.reward.score(group)
        except WorkerLost as exc:
            # The scorer failed or hung: the finished group is scored again (an
            # engine returns a finished group at once), never dropped.
            log.warning("%s; the group is scored again", exc)
            self.retry_queue.append(group)
            self.ledger.requeue(group)
            self._wake.set()
            return False
        finally:
            self._scoring -= group.size
        for s, value in zip(group.samples, rewards):
            s.reward = value
        if any(reward_failed(r) for r in rewards):  # reward.on_error: skip
            self._drop([group], "reward_error")
            return False
        reason = self.filter.verdict(rewards) if self.filter is not None else None
        if reason is not None:
            self._drop([group], reason)
            return False
        return True

    # -- over-provisioning --------------------------------------------------------------------
    def _cut_if_done(self) -> None:
        if self._cutting or self._paused or not self.running or not self._window_done():
            return
        self._cutting = True
        self._cut_task = asyncio.create_task(self._cut_surplus(), name="cut-surplus")
        self._cut_task.add_done_callback(self._generation_ended)  # an error in it fails the run

    async def _cut_surplus(self) -> None:
        """The budget's samples are done: abort what still generates (the cancel queue keeps
        it for the next version, or it is dropped). Nothing is admitted until it has ended."""
        try:
            generating = list(self._active)
            self._cut.set()  # agent episodes stop at their next turn boundary
            await self._each_up("abort_all")
            if generating:
                await asyncio.wait(generating)
        finally:
            if not self._paused:
                self._cut.clear()
            self._cutting = False
            self._wake.set()

    # -- lost workers -------------------------------------------------------------------------
    def worker_lost(self, i: int, exc: BaseException) -> None:
        """Worker ``i`` died or stopped answering: route around it until it is back."""
        self._wake.set()
        if i in self._down:
            return
        self._down.add(i)
        self._lives[i] += 1  # the groups it held partial tokens of resume elsewhere
        self._restarted = True
        log.warning("%s; restarting it", exc)
        task = asyncio.create_task(self._recover(i), name=f"recover-{self.engines[i].name}")
        self._recovering[i] = task

    async def _recover(self, i: int) -> None:
        e = self.engines[i]
        try:
            await e.recover()
            while True:  # a sync may move the version while the worker loads
                # A sync under way has set the new weights already: a worker back before it
                # ends is not among the engines it loads, so it loads them itself.
                v = max(self.version, self._weights_version)
                weights = self._weights
                if isinstance(weights, CollectiveTicket):
                    weights = await self.catch_up(v) if self.catch_up is not None else None
                    if weights is None:
                        self._rejoining.add(i)
                        self._recovering.pop(i, None)
                        self._wake.set()
                        return
                await e.update_weights(v, weights)
                if v == max(self.version, self._weights_version):
                    break
        except WorkerLost as exc:
            self._recovering.pop(i, None)
            self._down.discard(i)
            self.worker_lost(i, exc)  # lost again while coming back: another restart
            return
        except RestartsExhausted as exc:
            self._failure = exc
            self._wake.set()
            return
        self._recovering.pop(i, None)
        self._back(i)

    def _back(self, i: int) -> None:
        """Worker ``i`` is up with the current weights: route to it again."""
        self._down.discard(i)
        heapq.heappush(self._loads, (self._assigned[i], i))
        self.faults.recovered(worker_key(i), asyncio.get_running_loop().time())
        self._wake.set()

    async def _each_up(self, call: str, *args: Any) -> None:
        """``call`` on every live engine at once; one that is lost is restarted, not awaited.

        Engines that answer now are called one after the other, without a task each and
        without suspending: at 1,024 GPUs, 512 tasks twice a sync were a tenth of a
        simulation's CPU, and a simulated engine's completion due at this instant cannot slip
        in between. The others (remote: one RPC each) are called all at once, so a sync waits
        one round trip, not one per engine."""
        engines = self.engines
        later = []
        for i in range(len(engines)):
            if i in self._down:
                continue
            if engines[i].answers_now():
                engines[i].call_now(call, *args)
            else:
                later.append(i)
        if not later:
            return
        results = await asyncio.gather(*(getattr(engines[i], call)(*args) for i in later), return_exceptions=True)
        for i, r in zip(later, results):
            if isinstance(r, WorkerLost):
                self.worker_lost(i, r)
            elif isinstance(r, BaseException):
                raise r

    # -- control ------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> None:
        """Stop admitting; ``wait`` drains in-flight work, ``abort`` interrupts it, ``keep``
        freezes it in the engines, KV cache and all, to go on under the next weights."""
        self._paused = True
        if mode == "abort":
            self._cut.set()
        if mode == "keep":
            self._frozen = True
            await self._each_up("freeze")
            return
        if mode == "abort":
            await self._each_up("abort_all")
        if self._active:
            await asyncio.wait(list(self._active))
        await self._each_up("clear_cache")

    async def update_weights(self, version: int, weights: Any = None) -> None:
        """Every live engine loads ``weights`` (concurrently; one being restarted loads them once
        back), then the queue's version gate moves: groups it evicts free their staleness budget.

        Versions never go back: a trainer restored from a checkpoint older than the engines'
        weights (one skipped, or ``checkpoint.every`` > 1) sends versions they have passed;
        they keep the newer weights until it catches up."""
        if version < self.version:
            return
        self._weights, self._weights_version = weights, version
        if isinstance(weights, CollectiveTicket):
            await self._update_together(version, weights)
        else:
            await self._each_up("update_weights", version, weights)
        self.version = version
        self.dropped_from_queue(self.queue.set_version(version), "stale")

    async def _update_together(self, version: int, weights: Any) -> None:
        """A collective load: the live engines and those back from a restart, each told who
        else takes part (a restarted one makes the group form anew)."""
        joining, self._rejoining = self._rejoining, set()
        up = [i for i in range(len(self.engines)) if i not in self._down or i in joining]
        # A worker still coming back takes no part: the group it joins once back forms anew
        # too. (With nobody up the trainer keeps its group, the dead process in it, and the
        # next broadcast on that group waited out timeouts.control_s.)
        regroup, self._restarted = self._restarted, len(up) < len(self.engines)
        weights = weights.addressed([self.engines[i].name for i in up], regroup=regroup)
        results = await asyncio.gather(*(self.engines[i].update_weights(version, weights) for i in up), return_exceptions=True)
        broken: Optional[CollectiveBroken] = None
        for i, r in zip(up, results):
            if isinstance(r, WorkerLost):
                self._down.discard(i)  # a rejoining one was still marked down: lost anew
                self.worker_lost(i, r)
            elif isinstance(r, CollectiveBroken):
                broken = broken or r
                if i in joining:
                    self._rejoining.add(i)  # still without the weights: in the next try
            elif isinstance(r, BaseException):
                raise r
            elif i in joining:
                self._back(i)
        if broken is not None:
            self._restarted = True  # the next try forms a new group
            raise broken

    async def resume(self) -> None:
        self._paused = False
        self._cut.clear()
        if self._frozen:
            self._frozen = False
            await self._each_up("thaw")
        self._wake.set()

    async def stop(self) -> list[Group]:
        """End of run: interrupt everything and hand back every group not yet queued."""
        self._stopped = True
        self._paused = True
        self._cut.set()
        await self._each_up("abort_all")
        if self._active:
            _, hung = await asyncio.wait(list(self._active), timeout=self.stop_timeout_s)
            for task in hung:
                task.cancel()
            await asyncio.gather(*hung, return_exceptions=True)
        if self.agent is not None:
            # Calls still running are waited for: recorded (journaled), none is made again
            # by a run resumed from here.
            try:
                await asyncio.wait_for(self.agent.settle(), self.stop_timeout_s)
            except asyncio.TimeoutError:
                log.warning("tool calls still running after %.0f s at the run's end: a resumed run makes them again", self.stop_timeout_s)
        if self._cut_task is not None:
            await asyncio.gather(self._cut_task, return_exceptions=True)
        for task in list(self._recovering.values()):
            task.cancel()
        await asyncio.gather(*self._recovering.values(), return_exceptions=True)
        self._recovering.clear()
        self._wake.set()
        left = list(self.retry_queue) + list(self.cancel_queue)
        self.retry_queue.clear()
        self.cancel_queue.clear()
        return left

    def resume_counts(self, i: int) -> dict:
        """Engine ``i``'s resumed groups: routed back to it as their prefix holder (sticky),
        or taken from a holder that was down or restarted (moved)."""
        return {"sticky_resumes": self.sticky_resumes[i], "moved_resumes": self.moved_resumes[i]}

    def recovering(self) -> bool:
        """A worker is being restarted (a checkpoint now would not be of a quiet rollout)."""
        return bool(self._down)

    def state(self) -> dict:
        """What a checkpoint keeps besides the groups (taken while paused, nothing running)."""
        return {
            "version": self.version, "admitted": self.admitted, "next_prompt": self._next_prompt,
            "holders": [[pid, i] for pid, (i, _) in self._holders.items()],
            "sticky_resumes": list(self.sticky_resumes), "moved_resumes": list(self.moved_resumes),
            "agent": self.agent.state() if self.agent is not None else {},
            "filter": self.filter.state() if self.filter is not None else {},
        }

    def restore(self, state: dict, interrupted: list[Group], retry: list[Group], paused: bool) -> None:
        self.version, self.admitted, self._next_prompt = state["version"], state["admitted"], state["next_prompt"]
        # The engines' state is restored with this (a sim engine's whole; a real one's counters):
        # interrupted groups are routed as the run that never stopped routes them. Absent from
        # checkpoints written before sticky resume.
        n = len(self.engines)
        self._holders = {pid: (i, self._lives[i]) for pid, i in state.get("holders", []) if 0 <= i < n}
        self.sticky_resumes = list(state.get("sticky_resumes", [0] * n))
        self.moved_resumes = list(state.get("moved_resumes", [0] * n))
        if state.get("agent") and self.agent is not None:  # absent from checkpoints written before agent loops
            self.agent.restore(state["agent"])
        if state.get("filter") and self.filter is not None:  # absent from checkpoints written before the filter
            self.filter.restore(state["filter"])
        self._paused = paused
        self.cancel_queue.extend(interrupted)
        self.retry_queue.extend(retry)

    def in_flight(self) -> int:
        """Samples held here: generating, interrupted, or waiting to be generated again."""
        return self._holding + sum(g.size for g in self.cancel_queue) + sum(g.size for g in self.retry_queue)
