"""The tools an agent loop calls, and the record of what each call returned.

``ToolBox.answer`` runs a turn's calls concurrently and off the rollout's event loop: a plain
function in a guarded daemon thread (core/model/user_code.py), an ``async`` one on the box's
own event loop thread; each within its tool's ``timeout_s``. Whatever a call does (raise, hang,
return something that is not text or is too long, be malformed, name no tool, pass arguments
the function does not take) ends as an error response the model reads, counted by kind in
``counts``; the episode and the run go on.

Every result is recorded under its call's id before it is handed back. A call whose id is in
the record is answered from it and never made again: not after a partial-rollout abort, a
sync, a worker restart or a resume (``state``/``restore`` carry the record in a checkpoint, and
the ``ToolJournal`` the results recorded after it).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional

from core.agent.calculator import calculate
from core.agent.lookup import Lookup
from core.agent.tool_call import MalformedCall, Parsed
from core.model.config import ToolSpec
from core.model.tool_spec import check_tool_fn
from core.model.user_code import UserCodeError, run_guarded, what_it_raised
from core.store.tool_journal import ToolJournal

MAX_OUTPUT_CHARS = 4096
CALL_ID = "call_id"  # the parameter through which a tool is given the call's id, never the model


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: ``content`` is what the model reads; ``error`` the kind of failure
    (one of ``core.store.tool_journal.ERROR_KINDS``) or None."""

    id: str
    name: str
    content: str
    error: Optional[str] = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Tool:
    """A function the model may call by ``name``, with the keyword arguments it gives. A
    function with a ``call_id`` parameter is also given the call's id (``CALL_ID``), the same
    every time the episode reaches that call: an idempotency key for a tool with effects
    outside the run (a sandbox it creates, a row it writes)."""

    name: str
    fn: Callable[..., Any]
    timeout_s: float

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


class _ToolLoop:
    """An event loop in a daemon thread of its own, for ``async`` tools: one that blocks never
    blocks the rollout's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="asyncrl-tools", daemon=True).start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class ToolBox:
    """The tools of a run, and the record of every call made."""

    def __init__(self, tools: list[Tool], max_output_chars: int = MAX_OUTPUT_CHARS,
                 delay: Optional[Callable[[str], float]] = None, journal: Optional[ToolJournal] = None) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be distinct: {names}")
        self.tools = {t.name: t for t in tools}
        self.max_output_chars = max_output_chars
        self.record: dict[str, ToolResult] = {}
        self.counts: Counter = Counter()  # calls, executed, replayed, joined (asked again while running), error/<kind>
        self.seconds = 0.0  # wall time of the calls executed
        self._loop: Optional[_ToolLoop] = None
        self._running: dict[str, asyncio.Future] = {}  # calls under way, by id
        # Seconds a call takes beyond its tool's own time (agent.tool_delay_s), by call id.
        self.delay = delay
        self.journal = journal  # with checkpoints: every result, written ahead
        if journal is not None:
            # A journal that holds results is a resumed run's (a run directory with checkpoints
            # is resumed, never written afresh): one that starts over from no rollout state (its
            # checkpoint was taken before any) answers from them; ``restore`` narrows them to a
            # checkpoint's.
            self.record = {r["id"]: ToolResult(**r) for r in journal.since(0)}

    async def answer(self, calls: list[Parsed]) -> list[ToolResult]:
        """Each call's result, in the order of ``calls``."""
        return list(await asyncio.gather(*(self._one(c) for c in calls)))

    def start(self, calls: list[Parsed]) -> None:
        """Start the calls not yet made or under way, without waiting for them (an episode cut
        by a sync: they run through it, and it asks for them again after)."""
        for c in calls:
            if c.id not in self.record and c.id not in self._running:
                self._running[c.id] = asyncio.ensure_future(self._made(c))

    def under_way(self) -> list[str]:
        """The ids of the calls running now: not yet recorded."""
        return sorted(self._running)

    async def settle(self) -> None:
        """Wait for every call under way to be recorded."""
        while self._running:
            # wait, not gather: a waiter cancelled (a second Ctrl-C) leaves the calls running
            # and under way, not cancelled and forgotten.
            await asyncio.wait(list(self._running.values()))

    async def _one(self, call: Parsed) -> ToolResult:
        self.counts["calls"] += 1
        done = self.record.get(call.id)
        if done is not None:
            self.counts["replayed"] += 1
            return done
        running = self._running.get(call.id)
        if running is None:
            # Its own task: a caller cancelled (its episode's engine was lost, a sync cut it,
            # the run stopped) does not cancel the call, whose result is still recorded, and a
            # caller that asks again while it runs waits for it instead of making it twice.
            running = self._running[call.id] = asyncio.ensure_future(self._made(call))
        else:
            self.counts["joined"] += 1
        return await asyncio.shield(running)

    async def _made(self, call: Parsed) -> ToolResult:
        t0 = time.monotonic()
        try:
            if self.delay is not None:
                await asyncio.sleep(self.delay(call.id))
            result = replace(await self._run(call), seconds=time.monotonic() - t0)
        finally:
            self._running.pop(call.id, None)
        self.seconds += result.seconds
        if result.error is not None:
            self.counts[f"error/{result.error}"] += 1
        if self.journal is not None:
            self.journal.recorded(asdict(result))
        self.record[call.id] = result
        return result

    async def _run(self, call: Parsed) -> ToolResult:
        if isinstance(call, MalformedCall):
            return _error(call.id, "", "malformed", f"not a tool call: {call.reason}")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return _error(call.id, call.name, "unknown_tool", f"no tool named {call.name!r} (tools: {known})")
        if CALL_ID in call.arguments:
            return _error(call.id, call.name, "bad_arguments", f"bad arguments: {CALL_ID} is given by the run, not the call")
        signature = inspect.signature(tool.fn)
        args = {**call.arguments, CALL_ID: call.id} if CALL_ID in signature.parameters else call.arguments
        try:
            signature.bind(**args)
        except TypeError as exc:
            return _error(call.id, call.name, "bad_arguments", f"bad arguments: {exc}")
        self.counts["executed"] += 1
        try:
            value = await (self._run_async(tool, args) if tool.is_async else self._run_sync(tool, args))
        except asyncio.TimeoutError:
            return _error(call.id, call.name, "timeout", f"no answer within {tool.timeout_s:g} s")
        except UserCodeError as exc:
            if exc.timed_out:
                return _error(call.id, call.name, "timeout", f"no answer within {tool.timeout_s:g} s")
            return _error(call.id, call.name, "raised", exc.did.removeprefix("raised "))
        text = _as_text(value)
        if text is None:
            return _error(call.id, call.name, "not_text", f"returned {_type_name(value)}, not text")
        value = text
        if len(value) > self.max_output_chars:
            return _error(call.id, call.name, "too_long", f"returned {len(value)} characters, more than {self.max_output_chars}")
        return ToolResult(call.id, call.name, value)

    async def _run_sync(self, tool: Tool, args: dict) -> Any:
        # The guard's daemon thread holds a call that never returns; this thread returns at the timeout.
        return await asyncio.to_thread(
            run_guarded, tool.fn, (), args, timeout_s=tool.timeout_s, key="tools", name=tool.name,
            doing="answering a call", fix="",
        )

    async def _run_async(self, tool: Tool, args: dict) -> Any:
        if self._loop is None:
            self._loop = _ToolLoop()
        future = asyncio.run_coroutine_threadsafe(_raising_as_itself(tool, args), self._loop.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), tool.timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            raise

    def calls_of(self, episode: int) -> int:
        """Calls of ``episode`` in the record."""
        head = f"{episode}:"
        return sum(1 for cid in self.record if cid.startswith(head))

    def forget(self, episodes: set[int]) -> None:
        """Drop the records of episodes that are over: what they answered is in their samples."""
        if episodes and self.record:
            self.record = {cid: r for cid, r in self.record.items() if int(cid.split(":", 1)[0]) not in episodes}

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self.journal is not None:
            self.journal.close()

    def state(self) -> dict:
        """The record and the counts, for a checkpoint; and how far the journal had got."""
        return {"record": [asdict(r) for r in self.record.values()], "counts": dict(self.counts), "seconds": self.seconds,
                "journal_records": self.journal.records if self.journal is not None else 0,
                "journal_digest": self.journal.digest if self.journal is not None else None}

    def restore(self, state: dict) -> None:
        """The checkpoint's record, and every result the journal holds from after it: the run
        goes back to the checkpoint, and a call made since is not made again."""
        self.record = {r["id"]: ToolResult(**r) for r in state["record"]}
        self.counts = Counter(state["counts"])
        self.seconds = state["seconds"]
        if self.journal is not None:
            for r in self.journal.since(state.get("journal_records", 0)):
                self.record.setdefault(r["id"], ToolResult(**r))


async def _raising_as_itself(tool: Tool, args: dict) -> Any:
    """An async tool's call, whatever it raises told as a sync one's is (by the guard)."""
    try:
        return await tool.fn(**args)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # a user's tool: whatever it raised becomes its error response
        raise UserCodeError("tools", tool.name, "answering a call", what_it_raised(exc), "") from None


def _error(cid: str, name: str, kind: str, reason: str) -> ToolResult:
    return ToolResult(cid, name, f"error: {_SURROGATE.sub(chr(0xFFFD), reason)}", kind)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _as_text(value: Any) -> Optional[str]:
    """What a tool returned as plain text the tokenizer takes: a ``str`` subclass copied to a
    ``str`` (whatever its methods do), each lone surrogate (``surrogateescape``'s bytes of a
    subprocess's output) replaced by U+FFFD; None for anything else."""
    try:
        if not isinstance(value, str):
            return None
        return _SURROGATE.sub("\ufffd", str.__str__(value))
    except Exception:  # a value that only claims to be a str (its __class__)
        return None


def _type_name(value: Any) -> str:
    try:
        return str(type(value).__name__)[:60]
    except Exception:
        return "an object"


def build_tools(specs: tuple[ToolSpec, ...] | list[ToolSpec]) -> list[Tool]:
    """The tools ``specs`` (``ToolSpec``, checked) name: built-ins made, users' functions imported."""
    tools = []
    for spec in specs:
        if spec.fn is not None:
            fn = check_tool_fn(spec.fn, spec.timeout_s)
        elif spec.name == "calculator":
            fn = calculate  # calculate(expression)
        else:
            fn = Lookup(spec.data)  # a table, called as lookup(query)
        tools.append(Tool(spec.name, fn, spec.timeout_s))
    return tools
