"""A tool an agent may call, as a scenario names it: a built-in by name, or a user's function
``module:function``, checked before anything runs (imported, and callable with the keyword
arguments a model passes), as ``reward.fn`` is."""

from __future__ import annotations

import inspect
import re
from typing import Optional

from pydantic import Field, model_validator

from core.model.config import ConfigError, _Frozen
from core.model.lookup_file import LookupFileError, read_lookup
from core.model.user_code import UserCodeError, import_function

BUILTIN_TOOLS = ("calculator", "lookup")  # core/agent/calculator.py, core/agent/lookup.py
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
FIX_FN = "name an importable module:function whose parameters a call can pass by keyword, e.g. def search(query: str) -> str"


class ToolSpec(_Frozen):
    """One tool. The model calls it as ``{"name": name, "arguments": {...}}`` (docs/agents.md)."""

    name: str
    """What the model calls it by: letters, digits and _, not starting with a digit."""
    fn: Optional[str] = None
    """Your function, ``module:function``, sync or ``async``, called with the call's arguments as
    keywords and returning text. None: the built-in tool ``name`` (calculator, lookup)."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Longest one call may take; a call that does not return in time is answered with an error
    and the episode goes on. 10 s: above a sandboxed code run, below a stalled connection's."""
    data: Optional[str] = None
    """The built-in ``lookup``'s table: a JSONL file of ``{"key": ..., "value": ...}`` lines."""

    @model_validator(mode="after")
    def _checked(self) -> "ToolSpec":
        if not NAME.fullmatch(self.name):
            raise ConfigError("tools.name", self.name, "not a tool name", "use letters, digits and _, not starting with a digit")
        if self.fn is None:
            if self.name not in BUILTIN_TOOLS:
                raise ConfigError("tools.name", self.name, "no built-in tool of that name and no fn",
                                  f"name a built-in ({', '.join(BUILTIN_TOOLS)}) or give fn: module:function")
            if self.name == "lookup":
                if self.data is None:
                    raise ConfigError("tools.data", self.data, "the lookup tool needs its table", "give data: a JSONL file of key/value lines")
                try:
                    read_lookup(self.data)
                except LookupFileError as exc:
                    raise ConfigError("tools.data", self.data, exc.problem, exc.fix) from None
        else:
            try:
                check_tool_fn(self.fn, self.timeout_s)
            except UserCodeError as exc:
                raise ConfigError("tools.fn", self.fn, exc.problem, exc.fix) from None
        return self


def check_tool_fn(name: str, timeout_s: float):
    """Import ``module:function`` and check that a call can pass its arguments by keyword; the
    function, or ``UserCodeError`` (one line)."""
    fn = import_function("tools.fn", name, timeout_s, FIX_FN)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise UserCodeError("tools.fn", name, "", "has no signature Python can read", FIX_FN) from None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)]
    if positional:
        raise UserCodeError("tools.fn", name, "", f"takes {', '.join(positional)} by position only; a call passes keywords", FIX_FN)
    return fn
