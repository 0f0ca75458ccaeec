"""The one guard every piece of a user's code runs behind: importing a ``module:function`` a
scenario names (``reward.fn``), calling it, and loading what a user's directory holds (a
tokenizer).

The code runs in a daemon thread of its own and the caller waits at most ``timeout_s`` for it.
Whatever it does (raise, ``sys.exit``, raise ``KeyboardInterrupt``, recurse without end, sleep
for ever) becomes one ``UserCodeError`` line naming the key, the function, what it was doing and
what it did. A call that does not return in time is abandoned: its thread is a daemon, so it
never holds the process open at exit, and the next call gets a fresh thread.
"""

from __future__ import annotations

import importlib
import inspect
import queue
import sys
import threading
from typing import Any, Callable, Optional

MAX_STUCK = 8  # abandoned threads a process keeps before a guard refuses to start another
DID_NOT_RETURN = "did not return within"  # what a call the guard gave up on did


class UserCodeError(Exception):
    """User code failed: ``key`` (the scenario key naming it), ``name`` (module:function, or a
    path), ``doing`` (what it was asked, as the subject of ``did``: "importing it", "scoring
    sample 12 of prompt 3"; empty where ``did`` says it all), ``did`` ("raised ValueError:
    boom"), ``fix``. One line: ``{key} {name}: {doing} {did}; fix: {fix}``."""

    def __init__(self, key: str, name: str, doing: str, did: str, fix: str) -> None:
        self.key, self.name, self.doing, self.did, self.fix = key, name, doing, did, fix
        super().__init__(f"{key} {name}: {self.problem}; fix: {fix}")

    @property
    def problem(self) -> str:
        return f"{self.doing} {self.did}" if self.doing else self.did

    def doing_instead(self, doing: str) -> "UserCodeError":
        """The same failure, told as what the caller knows it was doing (which sample)."""
        return UserCodeError(self.key, self.name, doing, self.did, self.fix)

    @property
    def timed_out(self) -> bool:
        """Whether the guard gave up waiting (rather than the code failing)."""
        return self.did.startswith(DID_NOT_RETURN)

    def plain(self) -> "UserCodeError":
        """This error as itself: Ray raises it wrapped in a class of its own whose message is a
        remote traceback."""
        return self.doing_instead(self.doing)

    def __reduce__(self):  # crosses to the driver from a Ray actor as itself
        return (UserCodeError, (self.key, self.name, self.doing, self.did, self.fix))


def what_it_raised(exc: BaseException) -> str:
    """'raised ValueError: its first line', 'called sys.exit(3)', at most 200 characters."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r:.60})"
    if isinstance(exc, RecursionError):
        return "recursed without end (RecursionError)"
    text = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {text[0][:160]}" if text and text[0] else "")


class _Job:
    __slots__ = ("fn", "args", "kwargs", "value", "error", "done")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt the user's code raised, too
            self.error = exc
        finally:
            self.done.set()


class _Worker:
    """A daemon thread that runs jobs one at a time."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="asyncrl-user-code", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get().run()


_idle: list[_Worker] = []
_lock = threading.Lock()
_stuck = 0


def run_guarded(fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None, *, timeout_s: float,
                key: str, name: str, doing: str, fix: str) -> Any:
    """``fn(*args, **kwargs)`` behind the guard: its value, or ``UserCodeError`` if it raised
    anything or did not return within ``timeout_s``."""
    global _stuck
    with _lock:
        if _stuck >= MAX_STUCK:
            raise UserCodeError(key, name, doing, f"was not started: {_stuck} earlier calls of user code never returned", fix)
        worker = _idle.pop() if _idle else _Worker()
    job = _Job(fn, args, kwargs or {})
    worker.jobs.put(job)
    if not job.done.wait(timeout_s):
        with _lock:
            _stuck += 1  # the worker stays with its job; a later call gets another
        raise UserCodeError(key, name, doing, f"{DID_NOT_RETURN} {timeout_s:g} s", fix)
    with _lock:
        _idle.append(worker)
    if job.error is not None:
        raise UserCodeError(key, name, doing, what_it_raised(job.error), fix) from None
    return job.value


def import_function(key: str, name: str, timeout_s: float, fix: str) -> Callable[..., Any]:
    """The function ``name`` (``module:function``, a dotted attribute path after the colon
    allowed) names, its module imported behind the guard; ``UserCodeError`` (one line) if it
    cannot be had."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise UserCodeError(key, name, "", "is not module:function", fix)

    def load() -> Any:
        # The user's directory is theirs: no __pycache__ left in it, even by an import that is refused.
        writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise _NotFound(repr(exc.name)) from None
            raise
        finally:
            sys.dont_write_bytecode = writes

    try:
        module = run_guarded(load, timeout_s=timeout_s, key=key, name=name, doing=f"importing {module_name}", fix=fix)
    except UserCodeError as exc:
        if exc.did.startswith(f"raised {_NotFound.__name__}"):
            missing = exc.did.partition(": ")[2]
            raise UserCodeError(key, name, "", f"no module {missing} is importable here (sys.path: the working "
                                "directory, PYTHONPATH, installed packages)", fix) from None
        raise
    fn: object = module
    for part in attr.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise UserCodeError(key, name, "", f"{module_name} has no {attr!r}", fix) from None
        except Exception as exc:  # a module's __getattr__ is the user's code too
            raise UserCodeError(key, name, f"looking up {attr!r}", what_it_raised(exc), fix) from None
    if not callable(fn):
        raise UserCodeError(key, name, "", f"is a {type(fn).__name__}, not a function", fix)
    return fn  # type: ignore[return-value]


class _NotFound(Exception):
    """The module itself (not one it imports) is not on sys.path."""


def check_signature(key: str, name: str, fn: Callable[..., Any], example: dict, signature: str, fix: str,
                    is_async: Optional[bool] = False) -> None:
    """``fn`` can be called with the keywords of ``example``, and is (``is_async`` True) or is
    not (False) a coroutine function; None: either. ``UserCodeError`` if not."""
    coroutine = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
    if is_async is False and coroutine:
        raise UserCodeError(key, name, "", f"is an async function, and it is called as a plain {signature}", fix)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise UserCodeError(key, name, "", "has no signature Python can read", fix) from None
    try:
        sig.bind(**example)
    except TypeError as exc:
        raise UserCodeError(key, name, "", f"cannot be called as {signature} ({exc})", fix) from None
