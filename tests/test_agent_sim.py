"""Agent episodes on the simulator (core/sim/agent_episodes.py): turns and tool calls on the
virtual clock, KV held or released while tools run, the report's tool figures, and the modes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from core.model.config import Scenario, with_changes
from core.model.sample import Group, Sample
from core.runtimes.dispatch import run_mode
from core.sim import virtual_clock
from core.sim.agent_episodes import CALLS
from core.sim.costs import DecodeCost
from core.sim.engine import SimEngine
from core.sim.workload import Workload
from harness.metrics import WALL_CLOCK_KEYS, collect
from harness.scenario import load

MODES = ("sync", "async", "partial", "inflight")
SMALL = ["trainer.steps=24", "trainer.batch_size=128", "workload.max_response_len=8192"]
WALL = WALL_CLOCK_KEYS


@pytest.fixture(scope="module")
def agent_tools() -> Scenario:
    return load("scenarios/agent-tools.yaml", SMALL)


@pytest.fixture(scope="module")
def runs(agent_tools):
    return {m: collect(run_mode(agent_tools, m)) for m in MODES}


def test_every_mode_finishes_every_episode_within_the_bound(agent_tools, runs):
    a = agent_tools.episodes
    for mode, m in runs.items():
        assert m["samples/lost"] == 0, mode
        assert m["bound/efficiency"] <= 1.02, mode
        episodes = m["agent/episodes"]
        assert episodes >= m["samples/trained"]
        assert a.min_turns <= m["agent/turns_per_episode"] <= a.max_turns
        # Every turn but an episode's last calls the tool once (none ends at a limit here but the cap).
        assert m["agent/tool_calls"] == pytest.approx(m["agent/turns_per_episode"] * episodes - episodes, abs=episodes * 0.01)
        assert 0 < m["tokens/masked_observation"] < m["tokens/trained_response"]
        assert m["agent/tool_s"] >= 0.2 * m["agent/tool_calls"]  # tool_delay_s.low
        assert 0 <= m["gpu_time/waiting_on_tools"] <= m["gpu_time/idle"] + 1e-9
    assert runs["sync"]["gpu_time/waiting_on_tools"] > 0
    # Async's sync waits for every episode in flight, tools and all; partial stops them at their
    # next turn boundary.
    assert runs["partial"]["sync/pause_mean_s"] < runs["async"]["sync/pause_mean_s"] / 3
    assert runs["partial"]["partial/interrupts"] > 0


def test_a_one_turn_episode_is_the_completion(agent_tools):
    """One turn and no tool: the figures of the same scenario without agent episodes (prefix
    sharing between a group's episodes, which arrive one call each, is the only difference and
    shows in partial mode only, where resumed groups meet full batches)."""
    plain = load("scenarios/quickstart.yaml", SMALL)
    one = with_changes(plain, {"agent": {"min_turns": 1, "max_turns": 1}})
    for mode in MODES:
        a, b = collect(run_mode(plain, mode)), collect(run_mode(one, mode))
        if mode == "partial":
            assert b["throughput/trained_tokens_per_s"] == pytest.approx(a["throughput/trained_tokens_per_s"], rel=0.01)
            continue
        differ = [k for k in a if k not in WALL and a[k] != b.get(k)]
        assert not differ, f"{mode}: {differ[:6]}"
        assert b["agent/tool_calls"] == 0 and b["agent/turns_per_episode"] == 1.0


def test_releasing_kv_during_tools_prefills_each_context_again(agent_tools):
    keep = collect(run_mode(agent_tools, "async"))
    release = collect(run_mode(with_changes(agent_tools, {"agent.release_kv_during_tools": True}), "async"))
    # Held: a turn prefills the tool's answer; released: the whole context, prompt to answer.
    assert release["tokens/prefill"] > 3 * keep["tokens/prefill"]
    assert keep["tokens/trained_response"] == release["tokens/trained_response"]


def test_the_episode_plan_is_the_workload_split_into_turns(agent_tools):
    w = Workload(agent_tools.workload, 0, agent_tools.episodes)
    a = agent_tools.episodes
    for pid in range(20):
        lengths = w.response_lengths(pid)
        for i in range(agent_tools.workload.group_size):
            p = w.episode(pid, i)
            turns = len(p.turn_ends)
            assert len(p.answers) == len(p.tool_s) == turns - 1
            model_tokens = p.turn_ends[-1] - sum(p.answers)
            if p.reason == "eos":
                assert a.min_turns <= turns <= a.max_turns or turns == lengths[i]
                assert model_tokens == lengths[i]
            assert all(0.2 <= t <= 30.0 for t in p.tool_s)
            assert p == w.episode(pid, i), "deterministic"


def _engine(cap: int, keep: bool):
    cost = DecodeCost(Scenario(), 1)
    cost.kv_capacity_tokens = cap
    return SimEngine("e", cost, None, max_num_seqs=64, turns=True, keep_kv=keep)


@pytest.mark.parametrize("prompts", [[1_800], [800, 800]], ids=["to_admit", "to_decode"])
def test_a_kept_context_holds_cache_room_until_pressure_frees_it(prompts):
    """A turn that ends in a call keeps its context on the engine; the next turn prefills only
    what came after. When a new request needs the room, to be admitted or to decode on, the
    kept context goes first (its next turn then prefills it all again), before any running
    request is preempted."""

    async def main():
        e = _engine(cap=2_000, keep=True)
        a = Group(0, [Sample(0, 0, 0, 100)], 0, 0.0)
        assert await e.generate(a, 500, CALLS)
        kept = dict(e._kept)
        a.samples[0].finished = False
        a.samples[0].add_observation(50, 0)
        before = e.prefill_tokens
        assert await e.generate(a, 700)
        second_prefill = e.prefill_tokens - before
        # Another turn kept, then a big request that needs the room.
        b = Group(1, [Sample(1, 1, 0, 100)], 0, 0.0)
        assert await e.generate(b, 200, CALLS)
        c = Group(2, [Sample(2 + i, 2, i, p) for i, p in enumerate(prompts)], 0, 0.0)
        assert await e.generate(c, 100)
        return kept, second_prefill, e

    kept, second_prefill, e = virtual_clock.run(main())
    assert kept == {0: 600}
    assert second_prefill == 50  # the answer alone
    assert e.kv_released == 1 and e._kept == {} and e.preemptions == 0


def test_a_released_context_is_prefilled_whole():
    async def main():
        e = _engine(cap=100_000, keep=False)
        a = Group(0, [Sample(0, 0, 0, 100)], 0, 0.0)
        assert await e.generate(a, 500, CALLS)
        a.samples[0].finished = False
        a.samples[0].add_observation(50, 0)
        before = e.prefill_tokens
        assert await e.generate(a, 700)
        return e.prefill_tokens - before, e

    prefilled, e = virtual_clock.run(main())
    assert prefilled == 100 + 500 + 50 and not e._kept


def test_clear_cache_frees_kept_contexts():
    async def main():
        e = _engine(cap=100_000, keep=True)
        g = Group(0, [Sample(i, 0, i, 100) for i in range(4)], 0, 0.0)
        assert await e.generate(g, 300, CALLS)
        held = sum(e._kept.values())
        await e.clear_cache()
        return held, e

    held, e = virtual_clock.run(main())
    assert held == 4 * 400 and not e._kept and e._cap == e.cost.kv_capacity_tokens


def test_an_agent_without_tools_is_refused_off_the_sim_and_tools_are_refused_on_it():
    from core.model.config import ConfigError

    with pytest.raises(ValueError, match=r"tools = \['calculator'\]: the sim runtime models tool calls"):
        Scenario(tools=[{"name": "calculator"}])
    assert Scenario(agent={"min_turns": 2}).episodes.min_turns == 2
    with pytest.raises(ValueError, match="agent.min_turns"):
        Scenario(agent={"min_turns": 9, "max_turns": 8})
    assert issubclass(ConfigError, ValueError)
    assert np.isfinite(Scenario(agent={}).episodes.tool_delay_s.median)


def test_idle_on_tools_is_tool_time_no_busy_span_covers():
    from harness.metrics import _uncovered

    busy = [(0.0, 2.0), (3.0, 4.0), (6.0, 9.0)]
    assert _uncovered([[1.0, 5.0]], busy) == pytest.approx(2.0)  # 2-3 and 4-5
    assert _uncovered([[0.5, 1.5], [2.5, 3.5], [9.5, 10.0]], busy) == pytest.approx(0.5 + 0.5)
    assert _uncovered([[4.0, 6.0]], busy) == pytest.approx(2.0)
    assert _uncovered([], busy) == 0.0 and _uncovered([[0.0, 1.0]], []) == 1.0
    rng = np.random.default_rng(0)
    for _ in range(50):  # against a fine grid
        edges = np.sort(rng.uniform(0, 10, 8))
        b = [(edges[i], edges[i + 1]) for i in range(0, 8, 2)]
        cuts = np.sort(rng.uniform(0, 10, 6))
        t = [[cuts[i], cuts[i + 1]] for i in range(0, 6, 2)]
        grid = np.linspace(0, 10, 100_001)[:-1] + 5e-5
        inside = lambda sp: np.any([(grid >= a) & (grid < c) for a, c in sp], axis=0)
        want = np.sum(inside(t) & ~inside(b)) * 1e-4
        assert _uncovered(t, b) == pytest.approx(want, abs=2e-3)


@pytest.mark.parametrize("mode", ["sync", "partial"])
def test_a_tool_delay_of_a_billion_seconds_is_simulated_time_not_a_hang(agent_tools, mode):
    """The largest delay the config accepts: the run ends, in simulated time. Past ~4.5e6 s one
    ulp of the clock exceeds its resolution, where the loop once spun on a timer never due."""
    sc = with_changes(agent_tools, {"trainer.steps": 3, "agent.tool_delay_s": {"median": 1e9}})
    m = collect(run_mode(sc, mode))
    assert m["samples/trained"] == 3 * sc.trainer.batch_size
    assert m["agent/tool_s"] == pytest.approx(1e9 * m["agent/tool_calls"], rel=1e-6)


def test_a_timer_past_the_clocks_resolution_comes_due():
    async def late() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3e9)
        await asyncio.sleep(1e-3)  # below one ulp of the clock at 3e9 s
        return loop.time()

    assert virtual_clock.run(late()) == pytest.approx(3e9, rel=1e-12)
