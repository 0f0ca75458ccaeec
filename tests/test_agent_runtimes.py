"""Agent episodes on the real runtimes: the tiny model with tool tokens, the torch engine, the
torch trainer. The untrained model ends turns at ``</tool_call>`` now and then without a
well-formed call: each such turn is answered with an error observation, so every episode
exercises the loop (turns, answers masked out of the loss, syncs landing while calls run)."""

from __future__ import annotations

from collections import Counter

import pytest

from core.agent.tools import ToolBox
from core.model.config import Scenario, with_changes
from core.pipeline.rollouter import Rollouter
from core.runtimes.dispatch import run_mode
from harness.metrics import collect

AGENT = {
    "runtime": "local",
    "engine.kind": "torch",
    "resources.rollout_gpus": 1,
    "resources.trainer_gpus": 1,
    "workload.group_size": 4,
    "workload.max_response_len": 96,
    "trainer.batch_size": 8,
    "trainer.sync_every": 1,
    "trainer.steps": 4,
    "eval.every": 0,
    "tiny_model.tool_tokens": True,
    "tools": [{"name": "calculator"}],
    "agent": {"max_turns": 4, "tool_delay_s": {"median": 0.3}},
}


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory):
    from core.model.config import TinyModelSpec
    from core.real.tiny_model import ensure

    return ensure(tmp_path_factory.mktemp("tiny-agent") / "tiny-qwen2-tools", TinyModelSpec(tool_tokens=True))


def scenario(model_dir, **changes) -> Scenario:
    return with_changes(Scenario(), {**AGENT, "tiny_model.path": str(model_dir), **changes})


@pytest.mark.parametrize("mode", ["partial", "inflight"])
def test_syncs_land_while_calls_run_and_each_call_is_made_once(agent_model_dir, mode, monkeypatch):
    made: Counter = Counter()
    in_flight_at_sync = []
    run = ToolBox._run

    async def counted(self, call):
        made[call.id] += 1
        return await run(self, call)

    pause = Rollouter.pause

    async def watched(self, mode_):
        in_flight_at_sync.append(len(self.agent.box._running))
        await pause(self, mode_)

    monkeypatch.setattr(ToolBox, "_run", counted)
    monkeypatch.setattr(Rollouter, "pause", watched)
    system = run_mode(scenario(agent_model_dir, modes=[mode]), mode)
    m = collect(system)
    assert m["samples/lost"] == 0 and m["samples/trained"] == 4 * 8
    assert made and max(made.values()) == 1, "a call id was made twice"
    assert m["agent/tool_calls"] >= len(made)
    assert any(in_flight_at_sync), "some sync landed while a call ran"
    assert 0 < m["tokens/masked_observation"] < m["tokens/trained_response"]
    assert m["agent/tool_s"] >= 0.3 * m["agent/tool_calls"] * 0.9
    # The trainer's mask: every step trained fewer tokens than it was given.
    infos = system.trainer.step_info
    assert sum(i.get("observation_tokens", 0) for i in infos) == m["tokens/masked_observation"]


def test_a_scenario_with_tools_needs_a_tokenizer_with_tool_tokens(agent_model_dir):
    with pytest.raises(ValueError, match="tiny_model.tool_tokens"):
        scenario(agent_model_dir, **{"tiny_model.tool_tokens": False})


@pytest.mark.runtime
def test_ray_runs_agent_episodes_with_their_tokens_in_the_rollout_actor(ray_session, agent_model_dir):
    """On Ray the loop and its tools run in the rollout actor: each turn's tokens come back
    there, the answers join them, and the episode is scored there once it ends."""
    sc = scenario(agent_model_dir, runtime="ray", modes=["partial"], **{"trainer.steps": 3})
    m = collect(run_mode(sc, "partial"))
    assert m["samples/lost"] == 0 and m["samples/trained"] == 3 * 8
    assert m["agent/tool_calls"] > 0 and m["agent/episodes"] >= 24
    assert 0 < m["tokens/masked_observation"] < m["tokens/trained_response"]
    assert m["learn/final_reward"] is not None
