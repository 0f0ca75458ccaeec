"""JSON and YAML text parsed within bounds: how deep values nest (and, for YAML, how many values
there are once aliases are expanded) is counted before the parser sees the text. Both parsers
recurse once per level, so a file nested thousands deep would end in a RecursionError (a
traceback of thousands of lines) instead of one error naming its line and column.

The JSON count is a linear scan of the brackets outside strings; the YAML one reads the event
stream, which the parser makes in a loop, before the composer, which recurses.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

import yaml

# Far above anything asyncrl reads (a report or a checkpoint's state is under 10 deep), far
# below Python's recursion limit.
MAX_DEPTH = 100

# A JSON string (escapes skipped whole) or a bracket: the scan never looks inside a string.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


class TooNested(ValueError):
    """Text past a bound: where (``line``, ``column``, from 1, and ``mark``, the YAML mark if
    any), what (``problem``) and which bound (``bound``: "depth" or "values")."""

    def __init__(self, line: int, column: int, problem: str, bound: str = "depth", mark: Any = None) -> None:
        self.line, self.column, self.problem, self.bound, self.mark = line, column, problem, bound, mark
        super().__init__(f"line {line}, column {column}: {problem}")


def _line_column(text: str, index: int) -> tuple[int, int]:
    start = text.rfind("\n", 0, index) + 1
    return text.count("\n", 0, index) + 1, index - start + 1


def check_json_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """``TooNested`` at the first bracket that opens a level past ``max_depth``."""
    if text.count("[") + text.count("{") <= max_depth:  # cannot nest deeper than it has brackets
        return
    depth = 0
    for m in _TOKENS.finditer(text):
        c = text[m.start()]
        if c == "[" or c == "{":
            depth += 1
            if depth > max_depth:
                line, column = _line_column(text, m.start())
                raise TooNested(line, column, f"values are nested more than {max_depth} deep")
        elif c == "]" or c == "}":
            depth -= 1


def loads_json(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` of text nested at most ``max_depth`` deep. Raises ``ValueError`` for
    anything else: ``TooNested``, ``json.JSONDecodeError``, or ``UnicodeDecodeError`` for bytes
    that are not UTF-8."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8")
    check_json_depth(text, max_depth)
    return json.loads(text)


def check_yaml_events(text: str, max_depth: int, max_values: Optional[int] = None,
                      loader: type = yaml.SafeLoader) -> None:
    """``TooNested`` at the first collection that opens a level past ``max_depth``, or where the
    values counted with every alias expanded pass ``max_values`` (a 'billion laughs' file is a
    few lines). Invalid YAML raises the parser's own ``yaml.YAMLError``."""
    sizes: dict[str, int] = {}  # values an anchored node expands to
    stack: list[list] = []  # [values so far, anchor] of each open collection
    total = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(stack) >= max_depth:
                m = event.start_mark
                raise TooNested(m.line + 1, m.column + 1, f"values are nested more than {max_depth} deep", "depth", m)
            stack.append([1, event.anchor])
            total += 1
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            n, anchor = stack.pop()
            if anchor is not None:
                sizes[anchor] = n
            if stack:
                stack[-1][0] += n
        elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
            n = sizes.get(event.anchor, 1) if isinstance(event, yaml.AliasEvent) else 1
            if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
                sizes[event.anchor] = 1
            total += n
            if stack:
                stack[-1][0] += n
        if max_values is not None and total > max_values:
            m = event.start_mark
            raise TooNested(m.line + 1, m.column + 1, f"holds more than {max_values:,} values once its aliases (*name) are expanded",
                            "values", m)


def loads_yaml(text: str, max_depth: int = MAX_DEPTH, max_values: Optional[int] = None) -> Any:
    """``yaml.safe_load`` of text within the bounds of ``check_yaml_events``; ``TooNested`` or
    ``yaml.YAMLError``."""
    check_yaml_events(text, max_depth, max_values)
    return yaml.safe_load(text)
