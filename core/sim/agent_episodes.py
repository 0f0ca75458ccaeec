"""Agent episodes on the virtual clock: the simulator's ``EpisodeLoop``.

An episode follows its ``EpisodePlan`` (core/sim/workload.py): the engine decodes a model turn
to its planned end; the turn's tool call takes its drawn latency (a sleep on the virtual
clock: the engine meanwhile decodes whatever else it holds, or idles); the answer's tokens go
onto the sample as an observation, to be prefilled with the next turn. An engine that keeps
KV (``agent.release_kv_during_tools: false``) holds the episode's context while the tool runs,
and the next turn prefills only the answer; one that releases it prefills the whole context
again. As in the real loop, where an episode stands is read off its sample (answers so far);
a sync that aborts stops an episode at its turn boundary, or at once if it waits on a tool;
the call goes on through the sync (its end time is kept, ``_calls``) and the resumed episode
waits only for what is left of it: a call in flight at a sync is used, not made again.
"""

from __future__ import annotations

import asyncio

from core.agent.loop import CUT, EpisodeLoop, until_cut
from core.api import Engine
from core.model.sample import Group, Sample
from core.sim.workload import Workload

# A turn that ends in a tool call: the simulated engine's stand-in for the stop token.
CALLS = frozenset({-1})


class SimEpisodes(EpisodeLoop):
    """Simulated agent episodes, planned by the workload."""

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.workload = workload
        self._calls: dict[tuple[int, int], float] = {}  # (episode, turn) -> when its call ends

    async def _episode(self, group: Group, s: Sample, engine: Engine, max_response_len: int, cut: asyncio.Event) -> bool:
        plan = self.workload.episode(group.prompt_id, s.index)
        one = Group(group.prompt_id, [s], group.version, group.admitted_at)
        last = len(plan.turn_ends) - 1
        loop = asyncio.get_running_loop()
        while not s.finished:
            k = len(s.observations)  # calls answered so far: the turn under way
            end = plan.turn_ends[k]
            if s.n_response < end:
                if cut.is_set():
                    return False
                if not await engine.generate(one, end, CALLS if k < last else frozenset()):
                    return False
                self.turns += 1
                if k == last:
                    self._end(s, plan.reason)
                    continue
                s.finished = False  # a turn ended, not the episode
            t0 = loop.time()
            key = (s.uid, k)
            ends = self._calls.get(key)
            if ends is None:
                wait = plan.tool_s[k]
                self._calls[key] = t0 + wait
            else:  # begun before a sync cut the episode: what is left of it
                wait = max(0.0, ends - t0)
            if cut.is_set() or await until_cut(asyncio.sleep(wait, True), cut) is CUT:
                return False
            del self._calls[key]
            self._tools_ran(engine, t0, loop.time(), (plan.tool_s[k],))
            s.add_observation(plan.answers[k], s.version_spans[-1][0] if s.version_spans else 0)
        return True

    def forget(self, groups) -> None:
        if self._calls:
            uids = {s.uid for g in groups for s in g.samples}
            self._calls = {key: t for key, t in self._calls.items() if key[0] not in uids}

    def state(self) -> dict:
        return {**super().state(), "calls": [[u, k, t] for (u, k), t in self._calls.items()]}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self._calls = {(u, k): t for u, k, t in state.get("calls", [])}
