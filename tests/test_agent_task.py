"""The arithmetic task (core/real/task.py): its reward, the tiny model's arithmetic vocabulary,
and the warm start that makes the tool findable (core/real/warm_start.py)."""

from __future__ import annotations

import pytest

from core.agent.tool_call import CALCULATOR_HEAD, CALCULATOR_TAIL, parse_calls
from core.real.task import CALLED_RIGHT, ArithmeticPrompts, arithmetic_score

CALL = "<tool_call>" + CALCULATOR_HEAD + "37*48" + CALCULATOR_TAIL + "</tool_call>"


@pytest.mark.parametrize("response, finished, want", [
    (CALL + "<tool_response>1776</tool_response>1776", True, 1.0),
    (CALL + "<tool_response>1776</tool_response>1776", False, CALLED_RIGHT),  # ran into the cap
    (CALL + "<tool_response>1776</tool_response>1770", True, CALLED_RIGHT),
    (CALL + "<tool_response>1776</tool_response>", True, CALLED_RIGHT),
    ("1776", True, 1.0),  # right without the tool: right (the model cannot, in practice)
    ("<tool_call>{bad</tool_call><tool_response>error: not a tool call</tool_response>1776", True, 1.0),
    ("<tool_call>{bad</tool_call><tool_response>error: not a tool call</tool_response>17", True, 0.0),
    ("", True, 0.0),
])
def test_the_arithmetic_reward(response, finished, want):
    assert arithmetic_score("37*48=", response, "1776", finished) == want


def test_prompts_are_products_of_their_digits_and_held_out_apart():
    p = ArithmeticPrompts(0, 2)
    for i in range(50):
        text, answer = p.text(i), p.answer(i)
        a, b = text.rstrip("=").split("*")
        assert len(a) == len(b) == 2 and int(a) * int(b) == int(answer)
    assert [p.text(i) for i in range(5)] != [p.text(i, held_out=True) for i in range(5)]


@pytest.fixture(scope="module")
def arithmetic_dirs(tmp_path_factory):
    from core.model.config import TinyModelSpec
    from core.real.tiny_model import ensure

    root = tmp_path_factory.mktemp("arith")
    cold = ensure(root / "cold", TinyModelSpec(vocabulary="arithmetic"))
    warm = ensure(root / "warm", TinyModelSpec(vocabulary="arithmetic", warm_start_steps=60))
    return cold, warm


def test_the_vocabulary_writes_a_call_back_as_it_was(arithmetic_dirs):
    from core.model.model_dir import load_tokenizer

    tok = load_tokenizer(arithmetic_dirs[0], plain=True)
    text = "<bos>37*48=" + CALL + "<tool_response>1776</tool_response>1776<eos>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(tok.encode("</tool_call>", add_special_tokens=False)) == 1
    assert len(tok.encode(CALCULATOR_HEAD, add_special_tokens=False)) == 1


def _calls_made(model_dir, n=64) -> int:
    """Responses of the model (sampled, temperature 1) to n prompts that hold a well-formed call
    of the calculator with the prompt's expression."""
    import torch

    from core.model.model_dir import load_tokenizer
    from core.real.hf_model import load_model

    tok = load_tokenizer(model_dir, plain=True)
    model = load_model(model_dir).eval()
    torch.manual_seed(0)
    prompts = ArithmeticPrompts(1, 2)
    good = 0
    for i in range(n):
        text = prompts.text(i)
        ids = torch.tensor([tok.encode("<bos>" + text, add_special_tokens=False)])
        out = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
        turn = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
        calls = parse_calls(turn.split("</tool_call>")[0] + "</tool_call>", 0, 0)
        good += any(getattr(c, "arguments", {}).get("expression") == text.rstrip("=") for c in calls)
    return good


def test_the_warm_start_makes_the_tool_findable_not_solved(arithmetic_dirs):
    cold, warm = arithmetic_dirs
    assert _calls_made(cold) == 0
    made = _calls_made(warm)
    assert 0 < made < 64, made  # RL has something to find, and something left to raise


def test_the_agent_scenario_runs_its_task_with_the_calculator(arithmetic_model_dir):
    """scenarios/real-cpu-agent.yaml, shortened: the warm-started model calls the calculator
    right in some episodes from the first step (rewards above 0), every sample accounted for,
    and the console says so."""
    from core.runtimes.dispatch import run_mode
    from harness.console import agent_lines
    from harness.metrics import collect
    from harness.scenario import load

    sc = load("scenarios/real-cpu-agent.yaml", [f"tiny_model.path={arithmetic_model_dir}", "trainer.steps=3", "modes=[partial]"])
    m = collect(run_mode(sc, "partial"))
    assert m["samples/lost"] == 0 and m["samples/trained"] == 3 * 64
    assert m["agent/tool_calls"] > 0 and m["agent/reward_positive_first"] > 0
    assert m["agent/tool_calls_executed"] > 0
    said = "\n".join(agent_lines({"modes": {"partial": m}}))
    assert "GPU time idle while waiting on tools: partial" in said
    assert f"partial {100 * m['agent/reward_positive_first']:.0f} -> " in said
