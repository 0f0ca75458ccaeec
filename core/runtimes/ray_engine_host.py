"""A rollout engine in its own actor (``EngineHost``: torch or vLLM, scoring the groups it
finishes unless Ray Serve does), and ``EngineProxy``, the engine protocol the rollout actor
drives it through. A group's metadata crosses between them; its tokens stay in the object
store, referenced, and an interrupted group's partial tokens stay in the engine that made them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from core.api import Engine
from core.model.config import Scenario
from core.model.faults import WorkerLost
from core.model.group_wire import attach_tokens, encode_tokens
from core.model.sample import Group
from core.model.timeline import Timeline
from core.real.reward import make_task
from core.real.workers import make_engine
from core.runtimes.ray_actor import ActorIdentity, died, ray_module
from core.runtimes.ray_cluster import node_scenario

log = logging.getLogger(__name__)


# How long the run's end waits for an engine worker Ray is restarting, to read its counters.
CLOSE_WAIT_S = 120.0


class EngineHost(ActorIdentity):
    """A rollout engine in its own actor (torch or vLLM)."""

    def __init__(self, sc: Scenario, name: str, threads: int, seed: int, shipped: tuple = ()) -> None:
        sc = node_scenario(sc, shipped)  # the model where this node has it
        self.timeline = Timeline()
        self.engine = make_engine(sc, name, threads, self.timeline, seed)
        self._slow: Optional[tuple[float, float, float]] = None  # (factor, from, until)
        self._hang: Optional[str] = None
        # Finished groups are scored here, where their tokens are, unless a Serve deployment scores them.
        self._task = None if sc.reward.serve else make_task(sc)
        # Interrupted groups by prompt id, their partial tokens kept for their resume here.
        self._held: dict[int, Group] = {}
        self.resumed_held = self.resumed_fetched = 0  # resumes from tokens kept here, or fetched by reference

    async def start(self) -> None:
        await self.engine.start()

    async def generate(self, group: Group, max_response_len: int, payload: list,
                       stop_ids: frozenset[int] = frozenset()) -> tuple[tuple[bool, Group], bytes]:
        """Generate ``group`` (its metadata; ``payload``: [a reference to its partial tokens] or
        []); returns ((completed, its metadata), its tokens record) as two results
        (``num_returns=2``): the caller awaits the first and passes the second on by reference,
        so the tokens are never decoded on the way; the trainer resolves it."""
        await self._enter("generate")
        await self._take_tokens(group, payload)
        t0 = asyncio.get_running_loop().time()
        completed = await self.engine.generate(group, max_response_len, stop_ids)
        if stop_ids:
            # An agent's turn: the loop, in the rollout actor, holds the episode's tokens (sent
            # back with every turn) and scores the episode once it ends.
            return (completed, group.without_tokens()), encode_tokens(group)
        if completed and self._slow is not None:
            # A slowed worker: what overlapped the interval took ``factor`` times as long.
            factor, lo, hi = self._slow
            overlap = min(asyncio.get_running_loop().time(), hi) - max(t0, lo)
            if overlap > 0:
                await asyncio.sleep((factor - 1.0) * overlap)
        if completed:
            self._held.pop(group.prompt_id, None)
            if self._task is not None:
                for s in group.samples:
                    s.reward = self._task.reward(group.prompt_id, s.response_tokens, sample=s.uid)
        else:
            self._held[group.prompt_id] = group
        return (completed, group.without_tokens()), encode_tokens(group)

    async def _take_tokens(self, group: Group, payload: list) -> None:
        """Give a resumed group its partial tokens: those kept here (no transfer), else fetched;
        an agent's episode brings its own (a tool's answers joined them in the rollout actor)."""
        if not any(s.n_response for s in group.samples):
            return
        if all(len(s.response_tokens) == s.n_response for s in group.samples):
            return
        held = self._held.pop(group.prompt_id, None)
        if held is not None and all(h.n_response == s.n_response for h, s in zip(held.samples, group.samples)):
            for h, s in zip(held.samples, group.samples):
                s.response_tokens, s.logprobs = h.response_tokens, h.logprobs
            self.resumed_held += 1
            return
        if not payload:
            raise ValueError(f"prompt {group.prompt_id}: {sum(s.n_response for s in group.samples)} tokens generated, none held here or referenced")
        attach_tokens(group, await payload[0])
        self.resumed_fetched += 1

    async def abort_all(self) -> int:
        await self._enter("abort_all")
        return await self.engine.abort_all()

    async def update_weights(self, version: int, weights: Any) -> None:
        await self._enter("update_weights")
        await self.engine.update_weights(version, weights)

    async def freeze(self) -> None:
        await self._enter("freeze")
        await self.engine.freeze()

    async def thaw(self) -> None:
        await self._enter("thaw")
        await self.engine.thaw()

    # faults (core/runtimes/supervision.py): injected by the rollout actor
    def slow(self, factor: float, duration_s: float) -> None:
        now = asyncio.get_running_loop().time()
        self._slow = (factor, now, now + duration_s)

    def hang(self, call: str) -> None:
        self._hang = call

    async def _enter(self, call: str) -> None:
        if self._hang == call:
            self._hang = None
            await asyncio.get_running_loop().create_future()  # never answers: the caller's timeout ends it

    async def clear_cache(self) -> None:
        await self.engine.clear_cache()

    def counters(self) -> dict:
        """What a whole checkpoint keeps of this engine (taken while rollout is paused)."""
        return {"meter": self.engine.state(), "resumed_held": self.resumed_held, "resumed_fetched": self.resumed_fetched,
                "spans": dict(self.timeline.spans)}

    def restore_counters(self, st: dict) -> None:
        """A resumed run's engine goes on counting from its checkpoint (spans on this clock)."""
        self.engine.restore(st["meter"])
        self.resumed_held, self.resumed_fetched = st["resumed_held"], st["resumed_fetched"]
        for w, rows in st["spans"].items():
            self.timeline.spans[w][:0] = rows

    async def close(self) -> dict:
        e = self.engine
        await e.close(asyncio.get_running_loop().time())
        return {
            "busy_s": e.busy_s,
            "seq_s": e.seq_s,
            "tokens_generated": e.tokens_generated,
            "prefill_tokens": e.prefill_tokens,
            "spans": dict(self.timeline.spans),
            "step_spans": e.step_spans(),
            "resumed_held": self.resumed_held,
            "resumed_fetched": self.resumed_fetched,
        }


class EngineProxy(Engine):
    """The engine protocol, forwarded to an ``EngineHost`` actor."""

    def __init__(self, name: str, handle: Any, offset: float, pid: int = 0, tokens_here: bool = False) -> None:
        self.name = name
        # Agent episodes: each turn's tokens come back to this process, where the loop reads the
        # model's calls and appends the tools' answers, and go out with the next turn.
        self.tokens_here = tokens_here
        self.handle = handle
        self.offset = offset  # actor clock minus this process's clock
        self.pid = pid  # of the actor's current process: a restart changes it
        self.dead = False  # a call saw the actor die (Ray restarts it)
        self.busy_s = self.seq_s = 0.0
        self.tokens_generated = self.prefill_tokens = 0
        self.resumed_held = self.resumed_fetched = 0
        self.spans: dict = {}

    async def _remote(self, call: str, *args: Any) -> Any:
        """A call to the actor; its death (or a restart in progress) is ``WorkerLost``."""
        return await self._answer(getattr(self.handle, call).remote(*args), call)

    async def _answer(self, ref: Any, call: str) -> Any:
        try:
            return await ref
        except died() as exc:
            self.dead = True
            raise WorkerLost(self.name, call, f"the actor died ({type(exc).__name__})") from None

    async def generate(self, group: Group, max_response_len: int, stop_ids: frozenset[int] = frozenset()) -> bool:
        """The group's metadata goes, and comes back with its tokens record as a second result
        that this process never resolves: it holds the reference (and owns it, so the tokens
        outlive the engine's process) for the trainer, or another engine, to resolve. A resumed
        group's reference goes in a list, so Ray hands it over unresolved."""
        payload = [group.payload] if group.payload is not None else []
        group.payload = None  # not pickled along with the metadata a second time
        try:
            head, tokens = self.handle.generate.options(num_returns=2).remote(group, max_response_len, payload, stop_ids)
            completed, done = await self._answer(head, "generate")
        except BaseException:
            group.payload = payload[0] if payload else None  # what it had: its tokens are still there
            raise
        done.shift_times(-self.offset)
        group.take_generation(done)
        if self.tokens_here:
            attach_tokens(group, await self._answer(tokens, "generate"))
            return completed
        group.payload = tokens
        if completed:
            for mine, theirs in zip(group.samples, done.samples):
                mine.reward = theirs.reward  # scored in the engine's process (EngineReward)
        return completed

    async def abort_all(self) -> int:
        return await self._remote("abort_all")

    async def update_weights(self, version: int, weights: Any) -> None:
        # ``weights`` is [ObjectRef]: passed bare, Ray resolves it in the engine's process,
        # from the object store, without a copy through this one. A broadcast ticket goes as
        # it is: the engine joins the trainer's group and receives.
        if isinstance(weights, list):
            weights = weights[0] if weights else None
        await self._remote("update_weights", version, weights)

    async def clear_cache(self) -> None:
        await self._remote("clear_cache")

    async def freeze(self) -> None:
        await self._remote("freeze")

    async def thaw(self) -> None:
        await self._remote("thaw")

    def kill(self) -> None:
        """End the actor's process; Ray starts a new one (``max_restarts``)."""
        self.dead = True
        ray_module().kill(self.handle, no_restart=False)

    async def recover(self) -> None:
        """Kill a hung actor, wait for Ray to bring a new process up, start its engine."""
        if not self.dead:
            self.kill()
        while True:
            try:
                pid = await self.handle.pid.remote()
            except died():
                pid = None
            if pid is not None and pid != self.pid:
                break
            await asyncio.sleep(0.2)
        self.pid, self.dead = pid, False
        await self._remote("start")

    async def close(self, now: float, wait_s: float = CLOSE_WAIT_S) -> None:
        """The engine's counters and spans, at the run's end. A worker killed near the end may
        still be coming back (Ray restarts it): its new process is asked again, until ``wait_s``."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                stats = await self.handle.close.remote()
                break
            except died():
                if asyncio.get_running_loop().time() >= deadline:
                    log.warning("%s did not come back within %.0f s of the run's end: its counters are left out", self.name, wait_s)
                    return
                await asyncio.sleep(0.2)
        self.spans = {w: [[k, a - self.offset, b - self.offset] for k, a, b in rows] for w, rows in stats.pop("spans").items()}
        for k, v in stats.items():
            setattr(self, k, v)
