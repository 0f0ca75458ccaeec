"""Agent loops: what drives one group's episodes on an engine, turn by turn.

Without ``agent:`` or ``tools:`` there is no loop: the Rollouter calls the engine once per group,
the one-turn episode.

``ToolLoop`` runs each sample of a group as an episode of its own, concurrently with its
siblings: the engine generates a model turn, which ends at <eos>, at the length cap, or at
``</tool_call>`` (a stop token: the engine keeps it as the turn's last token); the loop parses
the turn's calls, the ``ToolBox`` answers them (off the event loop, each within its timeout,
recorded under its id), and the answers go onto the sample as an observation (logprob 0, loss
mask 0) before the next turn. An episode ends with a reason (``END_REASONS``), never an
exception.

Where an episode stands is read off its sample alone: finished, or its last token a
``</tool_call>`` the model sampled (calls to answer), or neither (a turn to generate). A group
aborted for a sync, cancelled, checkpointed or handed to another engine therefore resumes
where it was; a call answered before the interruption is answered from the record, not run
again. A sync that aborts (``cut`` set) stops an episode at its turn boundary, and one that
waits on its tools at once: the calls go on through the sync, recorded as they end, and the
episode resumed after it takes their answers from the record (or waits for those still
running). The engine and the sync never wait on a tool.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from core.agent.tool_call import CLOSE, OPEN, MalformedCall, Parsed, call_id, parse_calls, response_text
from core.agent.tools import ToolBox, ToolResult
from core.api import AgentLoop, Engine
from core.model.sample import Group, Sample

# Why an episode ended: the model stopped (<eos>); it reached the response cap; a call would
# have taken it past max_turns, max_tool_calls or the context of max_episode_tokens.
END_REASONS = ("eos", "max_response_len", "max_turns", "max_tool_calls", "max_episode_tokens")
CUT = object()  # what ``until_cut`` returns when the cut came first


async def until_cut(aw: Awaitable[Any], cut: asyncio.Event) -> Any:
    """What ``aw`` returns, or ``CUT`` (``aw`` cancelled) if ``cut`` is set first."""
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(cut.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else CUT


@dataclass(frozen=True)
class TurnCodec:
    """The text side of turns on the run's tokenizer: the stop token that ends a turn with calls,
    and how calls are read and answers written back."""

    call_end_id: int  # the id of ``</tool_call>``, one token
    eos_ids: frozenset[int]
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]

    def observation(self, results: Sequence[ToolResult]) -> list[int]:
        """The answers to a turn's calls as the model reads them, in the order of the calls."""
        return list(self.encode("".join(response_text(r.content) for r in results)))


@dataclass(frozen=True)
class Limits:
    """Per-episode limits (``agent.*``)."""

    max_turns: int
    max_tool_calls: int
    max_episode_tokens: int


class EpisodeLoop(AgentLoop):
    """Runs each unfinished sample of a group as an episode of its own (``_episode``), all at
    once, and counts how episodes ended, their turns, and their tools' calls and time. The
    intervals in which a tool ran for an episode of an engine are kept per engine (merged), so
    that the report can say how long that engine stood idle waiting on tools."""

    def __init__(self) -> None:
        self.ended: Counter = Counter()  # episodes by END_REASONS
        self.turns = 0  # model turns generated to their end, over all episodes
        self.tool_calls = 0
        self.tool_s = 0.0  # each call's own time, summed over calls (calls overlap)
        self.tool_spans: dict[str, list[list[float]]] = {}  # engine name -> disjoint [start, end], in order

    async def run(self, group: Group, engine: Engine, max_response_len: int, cut: asyncio.Event) -> bool:
        todo = group.unfinished()
        if not todo:
            return True
        tasks = [asyncio.ensure_future(self._episode(group, s, engine, max_response_len, cut)) for s in todo]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            # One episode's engine was lost (or this task cancelled): none of its siblings may go
            # on writing to samples that the Rollouter now retries or hands back.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return all(results)

    async def _episode(self, group: Group, s: Sample, engine: Engine, max_response_len: int, cut: asyncio.Event) -> bool:
        raise NotImplementedError

    async def settle(self) -> None:
        pass

    def under_way(self) -> list[str]:
        return []

    def _end(self, s: Sample, reason: str) -> None:
        s.finished = True
        self.ended[reason] += 1

    def _tools_ran(self, engine: Engine, start: float, end: float, seconds: Sequence[float]) -> None:
        """An episode of ``engine`` waited from ``start`` to ``end`` (now) on calls that took
        ``seconds`` each (from when each began: one begun before a sync cut the episode ran
        through the sync)."""
        self.tool_calls += len(seconds)
        self.tool_s += sum(seconds)
        spans = self.tool_spans.setdefault(engine.name, [])
        # ``end`` is now, at or after every end kept: the union only grows at its tail.
        while spans and spans[-1][1] >= start:
            start = min(start, spans.pop()[0])
        spans.append([start, end])

    def forget(self, groups: Sequence[Group]) -> None:
        pass

    def counters(self) -> dict:
        """Episodes by how they ended, model turns, tool calls and their summed seconds."""
        out = {f"ended/{k}": self.ended[k] for k in END_REASONS}
        out.update({"turns": self.turns, "tool_calls": self.tool_calls, "tool_s": self.tool_s})
        return out

    def state(self) -> dict:
        return {"ended": dict(self.ended), "turns": self.turns, "tool_calls": self.tool_calls, "tool_s": self.tool_s,
                "tool_spans": self.tool_spans}

    def restore(self, state: dict) -> None:
        self.ended = Counter(state["ended"])
        self.turns, self.tool_calls, self.tool_s = state["turns"], state["tool_calls"], state["tool_s"]
        self.tool_spans = {k: [list(x) for x in v] for k, v in state["tool_spans"].items()}


class ToolLoop(EpisodeLoop):
    """Multi-turn episodes with tool calls, on a real engine."""

    def __init__(self, box: ToolBox, codec: TurnCodec, limits: Limits) -> None:
        super().__init__()
        self.box = box
        self.codec = codec
        self.limits = limits
        self.stop_ids = frozenset({codec.call_end_id})

    async def _episode(self, group: Group, s: Sample, engine: Engine, max_response_len: int, cut: asyncio.Event) -> bool:
        one = Group(group.prompt_id, [s], group.version, group.admitted_at)
        context = self.limits.max_episode_tokens - s.n_prompt
        cap, binding = (max_response_len, "max_response_len") if max_response_len <= context else (context, "max_episode_tokens")
        while not s.finished:
            turn_start = self._turn_start(s)
            if turn_start is None:  # a turn to generate
                if cut.is_set():
                    return False
                if not await engine.generate(one, cap, self.stop_ids):
                    return False
                self.turns += 1
                if self._turn_start(s) is None:  # ended at <eos> or the cap: the episode is over
                    tokens = s.response_tokens
                    self._end(s, "eos" if len(tokens) and int(tokens[-1]) in self.codec.eos_ids else binding)
                    continue
                s.finished = False  # a turn ended, not the episode
                continue
            if not await self._answer(s, engine, turn_start, cap, binding, cut):
                return False
        return True

    def _turn_start(self, s: Sample) -> int | None:
        """Where the model's last turn began, if it ended in calls not yet answered; else None."""
        tokens = s.response_tokens
        n = len(tokens)
        if n == 0 or int(tokens[-1]) != self.codec.call_end_id:
            return None
        obs = s.observations
        if obs and obs[-1][0] + obs[-1][1] == n:  # the last token is an answer's, not the model's
            return None
        return obs[-1][0] + obs[-1][1] if obs else 0

    async def _answer(self, s: Sample, engine: Engine, turn_start: int, cap: int, binding: str, cut: asyncio.Event) -> bool:
        """The turn's calls answered onto ``s``, or the episode ended by a limit: True. False: cut
        first (the calls go on)."""
        turn = len(s.observations)  # each answered turn left one observation
        text = self.codec.decode(s.response_tokens[turn_start:].tolist())
        calls: list[Parsed] = parse_calls(text, s.uid, turn)
        if not calls:  # a </tool_call> with no <tool_call>: an error answer, as any malformed call
            calls = [MalformedCall(call_id(s.uid, turn, 0, text), text[-200:], f"{CLOSE} without {OPEN}")]
        lim = self.limits
        if turn + 1 >= lim.max_turns:
            self._end(s, "max_turns")
            return True
        if self.box.calls_of(s.uid) + len(calls) > lim.max_tool_calls:
            self._end(s, "max_tool_calls")
            return True
        if cut.is_set():  # the turn ended as a sync began: its calls run through it
            self.box.start(calls)
            return False
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        results = await until_cut(self.box.answer(calls), cut)
        if results is CUT:
            return False
        self._tools_ran(engine, t0, loop.time(), [r.seconds for r in results])
        tokens = self.codec.observation(results)
        # The context must hold the answers and at least one more model token.
        if s.n_response + len(tokens) >= cap:
            self._end(s, binding)
            return True
        version = s.version_spans[-1][0] if s.version_spans else 0
        s.add_observation(np.asarray(tokens), version)
        return True

    async def settle(self) -> None:
        await self.box.settle()

    def under_way(self) -> list[str]:
        return self.box.under_way()

    def forget(self, groups: Sequence[Group]) -> None:
        self.box.forget({s.uid for g in groups for s in g.samples})

    def counters(self) -> dict:
        """The episodes' counts, and the tool box's: calls executed, replayed, errors by kind."""
        out = super().counters()
        out.update({f"tools/{k}": v for k, v in sorted(self.box.counts.items())})
        return out

    def state(self) -> dict:
        return {**super().state(), "box": self.box.state()}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.box.restore(state["box"])
