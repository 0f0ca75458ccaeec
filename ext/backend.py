"""Picks the compiled or the pure-Python implementation of each hot path.

``ASYNCRL_PUREPYTHON=1`` selects the references everywhere; ``ASYNCRL_PUREPYTHON=0``
demands the compiled modules and fails loudly without them; unset prefers compiled
and falls back to the references with one warning.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)

ENV_VAR = "ASYNCRL_PUREPYTHON"
_warned = False


def requested() -> str:
    """'pure', 'compiled' or 'auto', from the environment."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value == "1":
        return "pure"
    if value == "0":
        return "compiled"
    if value:
        raise RuntimeError(f"{ENV_VAR}={value!r} is not understood; use 1 (pure Python), 0 (compiled) or leave it unset")
    return "auto"


def load(name: str) -> ModuleType:
    """The module implementing hot path ``name`` (``ext._<name>`` or ``ext._<name>_ref``)."""
    global _warned
    mode = requested()
    if mode == "pure":
        return importlib.import_module(f"ext._{name}_ref")
    try:
        return importlib.import_module(f"ext._{name}")
    except ImportError as exc:
        if mode == "compiled":
            raise RuntimeError(
                f"{ENV_VAR}=0 asks for the compiled ext._{name}, which cannot be imported ({exc}); "
                "build it with `pip install -e .` (or `make build`)"
            ) from exc
        if not _warned:
            log.warning("compiled hot paths are not built (%s); using the pure-Python references", exc)
            _warned = True
        return importlib.import_module(f"ext._{name}_ref")


def name_of(module: ModuleType) -> str:
    """'ref' for a pure-Python reference, 'ext' for a compiled module."""
    return "ref" if module.__name__.endswith("_ref") else "ext"
