"""The tools an agent loop calls (core/agent): the call format and its parser, the built-in
calculator and lookup, users' tools checked before a run, and the tool box that answers every
call, whatever the tool does, and never makes a recorded call twice."""

from __future__ import annotations

import asyncio
import json
import math
import operator
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from core.agent.calculator import CalculatorError, calculate, render
from core.agent.lookup import Lookup
from core.agent.tool_call import MalformedCall, ToolCall, parse_calls, response_text
from core.agent.tools import ToolBox, Tool, build_tools
from core.model.config import ConfigError
from core.model.lookup_file import LookupFileError
from core.model.config import ToolSpec

# -- the call format ---------------------------------------------------------------------------


def test_a_turn_with_calls_parses_each_in_order_with_its_id():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call> and '
            '<tool_call>{"name": "lookup", "arguments": {"query": "paris"}}</tool_call>')
    calls = parse_calls(text, episode=5, turn=2)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "12*7"}), ("lookup", {"query": "paris"})]
    assert [c.id.rsplit(":", 1)[0] for c in calls] == ["5:2:0", "5:2:1"]
    # The same call at the same place has the same id; another call there has another.
    assert parse_calls(text, 5, 2) == calls
    other = parse_calls(text.replace("12*7", "12*8"), 5, 2)
    assert other[0].id != calls[0].id and other[1].id == calls[1].id
    assert parse_calls("no call here", 0, 0) == []
    assert response_text("84") == "<tool_response>84</tool_response>"


@pytest.mark.parametrize(("text", "reason"), [
    ('<tool_call>{"name": "calculator"', "without </tool_call>"),
    ("<tool_call>not json</tool_call>", "not JSON"),
    ('<tool_call>["calculator"]</tool_call>', "not a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "calculator", "arguments": "12*7"}</tool_call>', '"arguments" is not an object'),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "longer than"),
])
def test_a_malformed_call_is_kept_with_its_reason(text, reason):
    (call,) = parse_calls(text, 0, 0)
    assert isinstance(call, MalformedCall) and reason in call.reason and call.id.startswith("0:0:0:")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_the_parser_never_raises(text):
    for call in parse_calls(text, 1, 1):
        assert isinstance(call, (ToolCall, MalformedCall))


# -- the calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(("expr", "value"), [
    ("12*7", "84"), ("0.1 + 0.2", "0.3"), ("-2 ** 2", "-4"), ("2 ** -1", "0.5"), ("2 ** 3 ** 2", "512"),
    ("7 // 2", "3"), ("-7 // 2", "-4"), ("-7 % 3", "2"), ("7 % -3", "-2"), ("(1 + 2) * (3 - 4) / 5", "-0.6"),
    ("1/3", "0.333333333333"), ("2/3", "0.666666666667"), ("1e3 + .5", "1000.5"), ("--3", "3"), (" 42 ", "42"),
])
def test_the_calculator_computes_exactly_with_pythons_precedence(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize(("expr", "reason"), [
    ("1/0", "division by zero"), ("1 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "only whole powers"), ("10 ** 10 ** 10", "larger than"), ("9 ** 2000", "larger than"),
    ("(" * 100 + "1" + ")" * 100, "nested deeper"), ("-" * 100 + "1", "nested deeper"),
    ("__import__('os')", "unexpected"), ("1 +", "ends too soon"), ("(1", "unbalanced"), ("1 2", "unexpected"),
    ("", "empty"), ("1" * 600, "longer than"), ("1e99999", "larger than"),
])
def test_the_calculator_refuses_in_words_and_never_evaluates_python(expr, reason):
    with pytest.raises(CalculatorError, match=reason):
        calculate(expr)


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@st.composite
def _exprs(draw, depth=0):
    """(text, exact value) of a random expression over small integers."""
    if depth > 3 or draw(st.booleans()):
        n = draw(st.integers(0, 999))
        return str(n), Fraction(n)
    op = draw(st.sampled_from(sorted(_OPS) + ["/"]))
    (a, va), (b, vb) = draw(_exprs(depth + 1)), draw(_exprs(depth + 1))
    if op == "/" and vb == 0:
        op = "+"
    value = va / vb if op == "/" else _OPS[op](va, vb)
    return f"({a} {op} {b})", value


@settings(max_examples=300, deadline=None)
@given(_exprs())
def test_the_calculator_agrees_with_exact_arithmetic(case):
    text, value = case
    assert calculate(text) == render(value)
    if value.denominator == 1:
        assert int(calculate(text)) == value
    else:
        assert math.isclose(float(calculate(text)), float(value), rel_tol=1e-9, abs_tol=1e-11)


# -- lookup -------------------------------------------------------------------------------------------


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "capitals.jsonl"
    rows = [{"key": "France", "value": "Paris"}, {"key": "French Guiana", "value": "Cayenne"},
            {"key": "Germany", "value": "Berlin"}, {"key": "france", "value": "not the first"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_lookup_answers_the_key_then_the_keys_that_contain_it(table):
    look = Lookup(table)
    assert look("  FRANCE ") == "Paris"  # case and space ignored; the first of a repeated key
    assert look("fr") == "France: Paris\nFrench Guiana: Cayenne"
    assert look("Spain") == "no entry matches 'Spain'"
    with pytest.raises(ValueError, match="non-empty"):
        look("  ")


@pytest.mark.parametrize(("content", "reason"), [
    ("not json\n", "line 1: not JSON"), ('{"key": "a"}\n', "line 1: not an object"), ('{"key": 1, "value": "x"}\n', "not an object"),
])
def test_a_lookup_table_that_is_not_one_is_refused_naming_the_line(tmp_path, content, reason):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(LookupFileError, match=reason):
        Lookup(path)
    # Checked before the run, with the dotted key: a scenario naming the table fails there.
    with pytest.raises(ValidationError, match=f"tools.data.*{reason}"):
        ToolSpec(name="lookup", data=str(path))


def test_a_lookup_table_that_is_no_regular_file_is_refused_without_waiting(tmp_path):
    import os

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # opened for reading, a FIFO waits for a writer: the reader must not
    for path in (tmp_path / "missing.jsonl", fifo, tmp_path):
        with pytest.raises(LookupFileError):
            Lookup(path)


# -- tool specs, checked before a run -----------------------------------------------------------------


@pytest.mark.parametrize(("spec", "key", "problem"), [
    ({"name": "search"}, "tools.name", "no built-in tool of that name"),
    ({"name": "2fast"}, "tools.name", "not a tool name"),
    ({"name": "lookup"}, "tools.data", "needs its table"),
    ({"name": "lookup", "data": "/nonexistent/table.jsonl"}, "tools.data", "fix:"),
    ({"name": "t", "fn": "tests.no_such_module:f"}, "tools.fn", "no module 'tests.no_such_module'"),
    ({"name": "t", "fn": "tests.agent_tools_user:positional_only"}, "tools.fn", "by position only"),
    ({"name": "t", "fn": "tests.agent_tools_user:NOT_A_FUNCTION"}, "tools.fn", "not a function"),
    ({"name": "calculator", "timeout_s": -1}, "timeout_s", "greater than 0"),
])
def test_a_bad_tool_spec_is_one_error_naming_the_key(spec, key, problem):
    with pytest.raises(ValidationError) as err:
        ToolSpec.model_validate(spec)
    text = str(err.value)
    assert key in text and problem in text, text
    cause = err.value.errors()[0].get("ctx", {}).get("error")
    if key.startswith("tools."):
        assert isinstance(cause, ConfigError) and cause.key == key and "fix:" in str(cause)


# -- the tool box -----------------------------------------------------------------------------------


def _box(*tools: Tool, **kw) -> ToolBox:
    return ToolBox(list(tools), **kw)


def _run(box: ToolBox, text: str, episode: int = 0, turn: int = 0):
    return asyncio.run(box.answer(parse_calls(text, episode, turn)))


def _call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_the_built_in_tools_answer_through_the_box(table):
    box = _box(*build_tools([ToolSpec(name="calculator"), ToolSpec(name="lookup", data=str(table))]))
    results = _run(box, _call("calculator", expression="6*7") + _call("lookup", query="germany") + _call("calculator", expression="1/0"))
    assert [r.content for r in results] == ["42", "Berlin", "error: CalculatorError: division by zero"]
    assert [r.error for r in results] == [None, None, "raised"]
    assert box.counts["executed"] == 3 and box.counts["error/raised"] == 1


def test_every_failure_is_an_error_response_and_a_count(tmp_path):
    from tests import agent_tools_user as user

    box = _box(
        Tool("raises", user.raises, 5.0), Tool("hangs", user.hangs, 0.3), Tool("async_hangs", user.async_hangs, 0.3),
        Tool("nan", user.returns_nan, 5.0), Tool("huge", user.huge, 5.0), Tool("echo", user.echo, 5.0),
        max_output_chars=1000,
    )
    text = (_call("raises") + _call("hangs") + _call("async_hangs") + _call("nan") + _call("huge") + _call("nope")
            + _call("echo", wrong=1) + "<tool_call>{oops</tool_call>" + _call("echo", text="hi"))
    t0 = time.monotonic()
    results = _run(box, text)
    assert time.monotonic() - t0 < 3.0  # concurrent: the two hung calls' timeouts overlap
    assert [r.error for r in results] == ["raised", "timeout", "timeout", "not_text", "too_long", "unknown_tool", "bad_arguments",
                                          "malformed", None]
    assert results[0].content == "error: ValueError: the tool broke"
    assert results[1].content == "error: no answer within 0.3 s"
    assert results[3].content == "error: returned float, not text"
    assert "(tools: async_hangs, echo, hangs, huge, nan, raises)" in results[5].content
    assert results[-1].content == "hi:1"
    assert all(box.counts[f"error/{k}"] == 1 for k in ("raised", "not_text", "too_long", "unknown_tool", "bad_arguments", "malformed"))
    assert box.counts["error/timeout"] == 2
    box.close()


def test_an_async_tool_runs_off_the_callers_loop():
    from tests import agent_tools_user as user

    box = _box(Tool("blocks", user.async_blocks_its_loop, 5.0))

    async def both():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        (r,) = await box.answer(parse_calls(_call("blocks"), 0, 0))
        tick.cancel()
        return r, ticks

    r, ticks = asyncio.run(both())
    assert r.content == "done" and ticks >= 10  # the caller's loop went on while the tool blocked its own
    box.close()
    # What an async tool raises is told as a plain one's is.
    failing = _box(Tool("async_raises", user.async_raises, 5.0))
    (r,) = _run(failing, _call("async_raises"))
    assert (r.error, r.content) == ("raised", "error: RuntimeError: the async tool broke")
    failing.close()


def test_a_recorded_call_is_never_made_again_even_after_a_restore():
    from tests import agent_tools_user as user

    user.COUNTED.clear()
    box = _box(Tool("count", user.counted, 5.0))
    first = _run(box, _call("count", key="a") + _call("count", key="b"), episode=3, turn=1)
    again = _run(box, _call("count", key="a") + _call("count", key="b"), episode=3, turn=1)  # the same turn, resumed
    assert first == again and user.COUNTED == {"a": 1, "b": 1}
    assert box.counts["replayed"] == 2
    # A checkpoint carries the record: a restored box (a restarted worker, a resumed run) answers from it.
    restored = _box(Tool("count", user.counted, 5.0))
    restored.restore(json.loads(json.dumps(box.state())))
    assert _run(restored, _call("count", key="a"), episode=3, turn=1) == first[:1]
    assert user.COUNTED == {"a": 1, "b": 1}
    _run(restored, _call("count", key="a"), episode=3, turn=2)  # another turn: another call
    assert user.COUNTED == {"a": 2, "b": 1}


def test_whatever_a_tool_returns_becomes_text_or_an_error_and_never_ends_the_run():
    """A lone surrogate (a subprocess's bytes under surrogateescape) is replaced, a ``str``
    subclass is copied to a ``str`` whatever its methods do, and a value that only claims to be
    text is an error observation: every answer then encodes to UTF-8, as a tokenizer must."""
    from tests import agent_tools_user as user

    box = _box(Tool("bytes", user.subprocess_bytes, 5.0), Tool("broken", user.broken_str, 5.0),
               Tool("pretends", user.pretends_to_be_text, 5.0), Tool("raises", user.raises_with_a_surrogate, 5.0))
    results = _run(box, _call("bytes") + _call("broken") + _call("pretends") + _call("raises"))
    assert [r.error for r in results] == [None, None, "not_text", "raised"]
    assert results[0].content == "ok \ufffd\ufffd end"
    assert type(results[1].content) is str and results[1].content == "copied"
    assert results[2].content == "error: returned _Pretends, not text"
    assert results[3].content == "error: ValueError: bad byte \ufffd here"
    for r in results:
        r.content.encode("utf-8")  # strict: no surrogate is left
    box.close()
