"""The Rollouter: feeds GRPO groups to engines under a concurrency limit and a staleness budget.

Finished groups go to the queue at once (streaming, no batch barrier). ``pause("wait")``
drains in-flight generations; ``pause("abort")`` interrupts them and keeps their partial
responses in a cancel queue that is served first after ``resume``.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Any, Literal, Optional, Protocol

import numpy as np

from core.ledger import Ledger
from core.sample import Group, Sample
from core.staleness_queue import AsyncStalenessQueue

PauseMode = Literal["wait", "abort"]


class Engine(Protocol):
    """What the Rollouter drives: the simulated engine, a torch model, vLLM, or a proxy to
    any of them in a Ray actor. Every method is awaitable so that a proxy has the same API."""

    name: str

    async def generate(self, group: Group, max_response_len: int) -> bool:
        """Generate the group's unfinished responses in place; False if aborted first."""

    async def abort_all(self) -> int:
        """Interrupt every request in flight (partial tokens stay on their samples)."""

    async def update_weights(self, version: int, weights: Any) -> None:
        """Load ``weights`` (None: the engine models weights, nothing to load) as ``version``."""

    async def clear_cache(self) -> None: ...


class PromptSource(Protocol):
    def tokens(self, prompt_id: int) -> np.ndarray:
        """The prompt's token ids."""


class RewardFn(Protocol):
    async def score(self, group: Group) -> list[float]:
        """One reward per sample of a finished group."""


class Rollouter:
    """Producer of finished groups.

    Admission control (DESIGN.md, data flow step 1): a new group of n is admitted only if
    n <= min(max_concurrency - running, floor((version + 1 + lead) * window) - admitted),
    where ``admitted`` counts samples admitted and not dropped. The trainer consumes
    ``window`` samples per version, so rollout never runs more than ``lead`` windows ahead.
    """

    def __init__(
        self,
        *,
        engines: list[Engine],
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
    ) -> None:
        self.engines = engines
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
        # Samples the trainer takes once, beyond its windows (a replay ring filling up).
        self.head_start = head_start
        # Real engines need prompt tokens and finished groups a reward; the sim engine neither.
        self.prompts = prompts
        self.reward = reward
        self.version = 0
        self.running = 0  # samples being generated
        self._holding = 0  # samples of the groups being generated, finished members included
        self.admitted = 0  # samples admitted and not dropped: what the staleness budget counts
        self.cancel_queue: deque[Group] = deque()
        self._next_prompt = 0
        self._active: set[asyncio.Task] = set()
        self._assigned = [0] * len(engines)  # samples routed to each engine and not yet back
        self._paused = False
        self._stopped = False
        self._wake = asyncio.Event()

    # -- admission ----------------------------------------------------------------------------
    def budget(self) -> int:
        """Samples the staleness budget still admits at the current version."""
        limit = math.floor((self.version + 1 + self.lead) * self.window + 1e-9) + self.head_start
        return min(limit, self.plan_samples) - self.admitted

    def _next_group(self) -> Optional[Group]:
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
        samples = [
            Sample(uid=pid * n + i, prompt_id=pid, index=i, n_prompt=n_prompt, prompt_tokens=tokens, admitted_at=now)
            for i in range(n)
        ]
        g = Group(prompt_id=pid, samples=samples, version=self.version, admitted_at=now)
        self.admitted += n
        self.ledger.admitted(g)
        return g

    def _drop(self, groups: list[Group], reason: str) -> None:
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
            group = None if self._paused else self._next_group()
            if group is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Least-loaded routing on our own count: a task just created has not reached its engine yet.
            i = min(range(len(self._assigned)), key=self._assigned.__getitem__)
            k = len(group.unfinished())
            self._assigned[i] += k
            self.running += k
            self._holding += group.size
            task = asyncio.create_task(self._generate(group, i, k))
            self._active.add(task)
            task.add_done_callback(self._active.discard)

    async def _generate(self, group: Group, i: int, k: int) -> None:
        try:
            completed = await self.engines[i].generate(group, self.max_response_len)
        finally:
            self.running -= k
            self._assigned[i] -= k
            self._holding -= group.size
            self._wake.set()
        if completed:
            if self.reward is not None:
                for s, value in zip(group.samples, await self.reward.score(group)):
                    s.reward = value
            group.finished_at = asyncio.get_running_loop().time()
            if not await self.queue.put(group, group.version):
                self._drop([group], "stale_on_arrival")
        else:
            group.aborts += 1
            for s in group.samples:
                if not s.finished:
                    s.interrupts += 1
            self.cancel_queue.append(group)

    # -- control ------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> None:
        """Stop admitting; ``wait`` drains in-flight work, ``abort`` interrupts it."""
        self._paused = True
        if mode == "abort":
            await self._abort_all()
        if self._active:
            await asyncio.wait(list(self._active))
        await asyncio.gather(*(e.clear_cache() for e in self.engines))

    async def _abort_all(self) -> None:
        # One engine after the other: a simulated engine aborts without suspending, so no
        # completion due at this instant slips in between (a remote one is one short RPC).
        for e in self.engines:
            await e.abort_all()

    async def update_weights(self, version: int, weights: Any = None) -> None:
        """Every engine loads ``weights`` (concurrently), then the queue's version gate moves:
        groups it evicts free their staleness budget."""
        await asyncio.gather(*(e.update_weights(version, weights) for e in self.engines))
        self.version = version
        self.dropped_from_queue(self.queue.set_version(version), "stale")

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def stop(self) -> list[Group]:
        """End of run: interrupt everything and hand back every group not yet queued."""
        self._stopped = True
        self._paused = True
        await self._abort_all()
        if self._active:
            await asyncio.wait(list(self._active))
        self._wake.set()
        left = list(self.cancel_queue)
        self.cancel_queue.clear()
        return left

    def in_flight(self) -> int:
        """Samples held here: generating or interrupted."""
        return self._holding + sum(g.size for g in self.cancel_queue)

