"""The tool-call format (docs/agents.md): what a model turn emits and the loop parses, and what
the loop writes back into the context.

A call is a JSON object between tags, as Qwen2.5 and Hermes-style chat templates emit it::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>

and each call's result goes back, in the order of the calls, as::

    <tool_response>84</tool_response>

A turn may make several calls. What cannot be read as a call (a tag left open, JSON that does
not parse, no ``name``, ``arguments`` that are not an object) is a ``MalformedCall``: the loop
answers it with an error response and the episode goes on.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Union

from core.model.bounded_parse import loads_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
MAX_CALL_CHARS = 8192  # a call's JSON: longer is malformed, not parsed
# The calculator's call around its expression, as json.dumps writes it: the arithmetic
# vocabulary of the tiny model has each as one token.
CALCULATOR_HEAD, CALCULATOR_TAIL = json.dumps({"name": "calculator", "arguments": {"expression": "\0"}}).split("\\u0000")
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call a model made: ``id`` names it for good (episode, turn, index and what it says),
    so that its result, once recorded, is never asked for again."""

    id: str
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    """Text between the call tags that is not a call, and why."""

    id: str
    text: str
    reason: str


Parsed = Union[ToolCall, MalformedCall]


def call_id(episode: int, turn: int, index: int, text: str) -> str:
    """The id of the ``index``-th call of turn ``turn`` of episode ``episode``, whose text is
    ``text``. The text's digest is part of it: a run rolled back to a checkpoint generates the
    turn again, and a call that comes out different is another call, not the one recorded."""
    digest = hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    return f"{episode}:{turn}:{index}:{digest}"


def parse_calls(text: str, episode: int, turn: int) -> list[Parsed]:
    """Every call in a model turn's ``text``, in order."""
    out: list[Parsed] = []
    for index, m in enumerate(_CALL.finditer(text)):
        body, closed = m.group(1), bool(m.group(2))
        cid = call_id(episode, turn, index, m.group(0))
        out.append(_call(cid, body) if closed else MalformedCall(cid, body[:200], f"{OPEN} without {CLOSE}"))
    return out


def _call(cid: str, body: str) -> Parsed:
    if len(body) > MAX_CALL_CHARS:
        return MalformedCall(cid, body[:200], f"a call longer than {MAX_CALL_CHARS} characters")
    try:
        obj = loads_json(body)
    except ValueError as exc:  # not JSON, or nested deeper than a call's arguments need
        return MalformedCall(cid, body[:200], f"not JSON ({str(exc).splitlines()[0][:80]})")
    if not isinstance(obj, dict):
        return MalformedCall(cid, body[:200], "not a JSON object")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return MalformedCall(cid, body[:200], 'no "name"')
    if not isinstance(args, dict):
        return MalformedCall(cid, body[:200], '"arguments" is not an object')
    return ToolCall(cid, name, args)


def response_text(content: str) -> str:
    """One call's result as the model reads it."""
    return f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"
