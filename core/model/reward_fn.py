"""The user's reward function, named in ``reward.fn`` as ``module:function``.

It is called once per response, with keywords, where the built-in reward is computed (in the
Rollouter's process, in the engine actors, or in the Ray Serve replicas with ``reward.serve``):

    fn(prompt=str, response=str, answer=str | None, finished=bool) -> float

``prompt`` is the prompt's text; ``response`` the response's text up to (not including) its
end-of-sequence token, special tokens as text; ``answer`` the prompt file's answer (None on
the built-in letters task); ``finished`` False when the response ran into
``workload.max_response_len`` instead of ending. Every process that scores imports the
module by name (so nothing is pickled): it must be importable there, from the working
directory (``python -m harness.run`` puts it on ``sys.path``), ``PYTHONPATH`` or an installed
package.

Importing it and every call run behind the guard of core/model/user_code.py, within
``reward.timeout_s``: whatever it does becomes one ``UserCodeError`` line.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Optional

from core.model.user_code import UserCodeError, check_signature, import_function, run_guarded

KEY = "reward.fn"
# The reward of a response whose scoring failed under ``reward.on_error: skip``: its group is
# dropped (a user's NaN is refused as an error, so it cannot stand for anything else).
REWARD_FAILED = math.nan
ARGS = {"prompt": "", "response": "", "answer": None, "finished": True}
SIGNATURE = "fn(prompt, response, answer, finished) -> float"
LOAD_FIX = f"name an importable module:function defined as {SIGNATURE}"
CALL_FIX = ("make it return a finite float for every response, within reward.timeout_s; or set reward.on_error to skip "
            "to drop a group whose scoring fails")


def load_reward_fn(name: str, timeout_s: float) -> Callable[..., float]:
    """Import ``module:function`` (within ``timeout_s``) and check that it can be called as the
    reward is; ``UserCodeError`` (one line) if not."""
    fn = import_function(KEY, name, timeout_s, LOAD_FIX)
    check_signature(KEY, name, fn, ARGS, SIGNATURE, LOAD_FIX)
    return fn


class GuardedReward:
    """A user's reward function, each call behind the guard and its value checked to be a
    finite number."""

    def __init__(self, fn: Callable[..., float], name: str, timeout_s: float) -> None:
        self.fn = fn
        self.name = name
        self.timeout_s = timeout_s

    def __call__(self, prompt: str, response: str, answer: Optional[str], finished: bool) -> float:
        """The reward; ``UserCodeError`` if the function failed (the caller says which sample)."""
        doing = "scoring a response"
        r, value = run_guarded(_scored, (self.fn, {"prompt": prompt, "response": response, "answer": answer, "finished": finished}),
                               timeout_s=self.timeout_s, key=KEY, name=self.name, doing=doing, fix=CALL_FIX)
        if value is None:
            raise UserCodeError(KEY, self.name, doing, f"returned {_shown(r)}, not a number", CALL_FIX)
        if not math.isfinite(value):
            raise UserCodeError(KEY, self.name, doing, f"returned {_shown(r)}, not a finite number", CALL_FIX)
        return value


def reward_failed(value: Optional[float]) -> bool:
    """``value`` is ``REWARD_FAILED``."""
    return value is not None and math.isnan(value)


def _scored(fn: Callable[..., float], kwargs: dict) -> tuple[object, Optional[float]]:
    """(what ``fn`` returned, it as a float, or None if it is no number): converted inside the
    guard, since a number type of the user's converts itself."""
    r = fn(**kwargs)
    if not isinstance(r, numbers.Real):
        return r, None
    try:
        return r, float(r)
    except (OverflowError, ValueError, TypeError):
        return r, math.nan


def _shown(value: object) -> str:
    """A returned value in a few characters, without calling its own ``__repr__`` (user code)."""
    for kind in (bool, int, float, str, bytes):
        if type(value) is kind:
            text = kind.__repr__(value) if kind is not int or value.bit_length() < 200 else f"an int of {value.bit_length()} bits"
            return text if len(text) <= 60 else text[:57] + "..."
    return "None" if value is None else f"a {type(value).__name__}"
