"""What a tool of a scenario may be (``tools:``, core/model/config.py ``ToolSpec``): a built-in
by name, or a user's function ``module:function``, checked before anything runs (imported, and
callable with the keyword arguments a model passes), as ``reward.fn`` is."""

from __future__ import annotations

import inspect
import re
from core.model.user_code import UserCodeError, import_function

BUILTIN_TOOLS = ("calculator", "lookup")  # core/agent/calculator.py, core/agent/lookup.py
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
FIX_FN = "name an importable module:function whose parameters a call can pass by keyword, e.g. def search(query: str) -> str"


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
