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
    # Calls answered to their episodes; those the run's end cut off were made, not answered.
    assert 0 < m["agent/tool_calls"] <= len(made)
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


# -- exactly once across a worker kill and a resume, with calls the model makes well --------------
# The warm-started arithmetic model writes well-formed calculator calls in about a quarter of
# its samples; the calculator here is a user's function that appends each call id it executes to
# a file (``call_log``), which no process of the run keeps. A stopped run resumes from the
# checkpoint of the sync before the stop: the turns generated since come again, and a call that
# comes out as it was is answered from the tool journal, not made again.
COUNTING = [{"name": "calculator", "fn": "tests.agent_tools_user:calculator_counting_calls", "timeout_s": 5}]


def arithmetic(model_dir, **changes) -> Scenario:
    from harness.scenario import load

    return with_changes(load("scenarios/real-cpu-agent.yaml"), {
        "tiny_model.path": str(model_dir), "tools": COUNTING, "trainer.steps": 4, "trainer.batch_size": 16,
        "checkpoint.every": 1, "agent.tool_delay_s": {"median": 0.3}, **changes,
    })


def executions(call_log) -> Counter:
    return Counter(line.split()[0] for line in call_log.read_text().splitlines())


def assert_each_call_made_once(call_log, system) -> None:
    made = executions(call_log)
    assert made, "the model made no well-formed call"
    twice = {cid: n for cid, n in made.items() if n > 1}
    assert not twice, f"calls executed more than once: {twice}; the log: {call_log.read_text()}"
    m = collect(system)
    assert m["samples/lost"] == 0 and system.trainer.step == system.scenario.trainer.steps


@pytest.mark.parametrize("mode", ["partial", "inflight"])
def test_a_resumed_run_makes_no_call_twice(arithmetic_model_dir, call_log, mode, tmp_path):
    from core.api import RunStopped

    sc = arithmetic(arithmetic_model_dir, modes=[mode])
    with pytest.raises(RunStopped):
        run_mode(sc, mode, run_dir=tmp_path, stop_at_step=2)
    before = executions(call_log)
    system = run_mode(sc, mode, run_dir=tmp_path, resume=True)
    assert_each_call_made_once(call_log, system)
    # Calls made after the checkpoint it resumed from came again, and the journal answered them.
    replayed = collect(system)["agent/tool_calls_replayed"]
    assert before and replayed > 0


@pytest.mark.runtime
@pytest.mark.parametrize("mode", ["partial", "inflight"])
def test_ray_makes_no_call_twice_across_a_worker_kill_and_a_resume(ray_session, arithmetic_model_dir, call_log, tmp_path, mode):
    """The loop and its tool box live in the rollout actor: an engine actor killed mid-episode
    takes none of the record with it, and the resumed run's rollout actor reads the journal."""
    from core.api import RunStopped

    sc = arithmetic(arithmetic_model_dir, runtime="ray", modes=[mode], **{
        "ray.poll_s": 0.1, "faults": [{"kind": "kill", "target": "rollout_worker", "at_step": 1}],
    })
    with pytest.raises(RunStopped):
        run_mode(sc, mode, run_dir=tmp_path, stop_at_step=3)
    system = run_mode(sc, mode, run_dir=tmp_path, resume=True)
    assert_each_call_made_once(call_log, system)
    assert any(f.kind == "kill" for f in system.faults.records)


# -- Ctrl-C on an agent run, then --resume: each call id executed once -----------------------------
SLOW = '[{name: calculator, fn: "tests.agent_tools_user:calculator_counting_slowly", timeout_s: 5}]'


def _interrupted_agent_run(model_dir, run, call_log, mode: str, presses: int):
    """``python -m harness.run`` of the arithmetic agent in a process group of its own; Ctrl-C to
    the group (``presses`` times, 0.3 s apart) as soon as a call starts after the first
    checkpoint: the call (1.5 s) is under way. Returns (the process, seconds from the last press
    to its exit)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sets = ["trainer.steps=6", "trainer.batch_size=16", "checkpoint.every=1", f"modes=[{mode}]", f"tools={SLOW}",
            f"tiny_model.path={model_dir}"]
    argv = [sys.executable, "-m", "harness.run", "scenarios/real-cpu-agent.yaml", "--out", str(run), "--no-plots",
            *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not list(run.glob(f"{mode}/checkpoints/step-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = len(call_log.read_text().splitlines())
        while len(call_log.read_text().splitlines()) <= seen and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it was interrupted: {proc.communicate()}"
        for i in range(presses):
            if i:
                time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, err, took


@pytest.mark.parametrize("mode", ["sync", "partial"])
def test_ctrl_c_waits_for_the_calls_under_way_and_the_resume_makes_none_twice(arithmetic_model_dir, call_log, tmp_path, mode):
    """The first Ctrl-C stops admitting, lets the calls under way finish and journals them: one
    line, exit 130, and --resume makes no call a second time."""
    from harness.run import main

    run = tmp_path / "run"
    code, err, _ = _interrupted_agent_run(arithmetic_model_dir, run, call_log, mode, presses=1)
    assert code == 130, err[-3000:]
    assert err == f"interrupted; its checkpoints are kept in {run}. Go on with: python -m harness.run --resume {run}\n", err[-3000:]
    assert main(["--resume", str(run), "--no-plots"]) == 0
    made = executions(call_log)
    twice = {cid: n for cid, n in made.items() if n > 1}
    assert made and not twice, f"calls executed more than once across Ctrl-C and --resume: {twice}"


def test_a_second_ctrl_c_exits_at_once_and_names_the_calls_left_running(arithmetic_model_dir, call_log, tmp_path):
    code, err, took = _interrupted_agent_run(arithmetic_model_dir, tmp_path / "run", call_log, "partial", presses=2)
    assert code == 130 and err.count("\n") == 1, err[-3000:]
    assert "stopped at once: tool calls " in err and "may run again on resume" in err, err
    assert took < 3, f"{took:.1f} s after the second Ctrl-C"  # not waiting for the calls queued behind it
