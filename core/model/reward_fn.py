"""The user's reward function, named in ``reward.fn`` as ``module:function``.

It is called once per response, with keywords, where the built-in reward is computed (in the
Rollouter's process, or in the Ray Serve replicas with ``reward.serve``):

    fn(prompt=str, response=str, answer=str | None, finished=bool) -> float

``prompt`` is the prompt's text; ``response`` the response's text up to (not including) its
end-of-sequence token, special tokens as text; ``answer`` the prompt file's answer (None on
the built-in letters task); ``finished`` False when the response ran into
``workload.max_response_len`` instead of ending. Every process that scores imports the
module by name (so nothing is pickled): it must be importable there, from the working
directory (``python -m harness.run`` puts it on ``sys.path``), ``PYTHONPATH`` or an installed
package.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

ARGS = {"prompt": "", "response": "", "answer": None, "finished": True}
SIGNATURE = "fn(prompt, response, answer, finished) -> float"


class RewardFnError(ValueError):
    """The function cannot be imported, is not a function, or cannot take the reward's arguments."""


def load_reward_fn(name: str) -> Callable[..., float]:
    """Import ``module:function`` (a dotted attribute path after the colon is allowed) and
    check that it can be called as the reward is; ``RewardFnError`` (one line) if not."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise RewardFnError("is not module:function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise RewardFnError(f"no module {exc.name!r} is importable here (sys.path: the working directory, PYTHONPATH, installed packages)") from None
        raise RewardFnError(f"importing {module_name} failed: {_line(exc)}") from None
    except Exception as exc:  # the user's module ran and failed: say how, in one line
        raise RewardFnError(f"importing {module_name} failed: {_line(exc)}") from None
    fn: object = module
    for part in attr.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise RewardFnError(f"{module_name} has no {attr!r}") from None
    if not callable(fn):
        raise RewardFnError(f"is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise RewardFnError("is an async function; the reward is called as a plain one")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise RewardFnError("has no signature Python can read") from None
    try:
        sig.bind(**ARGS)
    except TypeError as exc:
        raise RewardFnError(f"cannot be called as {SIGNATURE} ({exc})") from None
    return fn  # type: ignore[return-value]


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]
