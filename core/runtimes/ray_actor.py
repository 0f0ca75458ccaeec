"""What every asyncrl actor is to the driver that placed it, and how a call to one is awaited:
one identity (clock, process, node) for every host class, one clock offset, one timed call,
and one retry while Ray restarts the actor behind a call. Both Ray pipelines (the LLM one in
the ``ray_*_host`` modules, ``ray_run_actors`` and ``ray_driver``, and the env one in ``ray_env``)
use these, and nothing else measures a remote clock or times a remote call."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Awaitable, Callable, Optional

from core.model.faults import CallTimeout
from core.runtimes.ray_cluster import node_id


def ray_module():
    import ray  # imported on use: a sim run never pays for importing Ray

    return ray


def died() -> tuple[type, ...]:
    """What a call raises when its actor is dead or being restarted."""
    ex = ray_module().exceptions
    return ex.RayActorError, ex.ActorUnavailableError


class ActorIdentity:
    """The three calls the driver makes of every actor: its clock (for the offset), its process
    (a restart changes it) and its node (where a node fault strikes)."""

    def now(self) -> float:
        return time.monotonic()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return node_id()


def clock_offset(handle: Any, probes: int = 5) -> float:
    """The actor's clock minus ours: the midpoint of the shortest of a few round trips (the
    first call may wait for the actor to start, so it is only a warm-up)."""
    ray = ray_module()
    ray.get(handle.now.remote())
    best = None
    for _ in range(probes):
        t0 = time.monotonic()
        remote_now = ray.get(handle.now.remote())
        t1 = time.monotonic()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, remote_now - (t0 + t1) / 2)
    return best[1]


async def timed(ref: Awaitable, seconds: float, component: str, call: str) -> Any:
    """Await a remote call; no answer in time is a ``CallTimeout`` naming the component and call."""
    try:
        async with asyncio.timeout(seconds):
            return await ref
    except TimeoutError:
        raise CallTimeout(component, call, seconds, "timeouts.control_s") from None


class StoreLost(RuntimeError):
    """A restarted actor did not answer within ``ray.recovery_timeout_s``."""


async def served(call: Callable[[], Awaitable], patience: float, on_retry: Optional[Callable[[], None]] = None) -> Any:
    """Await ``call()``, called again while the actor behind it restarts, for ``patience`` s. What
    the call raises otherwise (a store's close, a refusal) passes through."""
    errors = ray_module().exceptions.RayActorError
    deadline = time.monotonic() + patience
    while True:
        try:
            return await call()
        except errors:
            if time.monotonic() > deadline:
                raise StoreLost(f"no answer for {patience:g} s from an actor that died; fix: raise ray.recovery_timeout_s "
                                "if it only restarts slowly, or ray.max_restarts if it died again") from None
            if on_retry is not None:
                on_retry()
            await asyncio.sleep(0.05)


def served_now(call: Callable[[], Any], patience: float, what: str) -> Any:
    """``ray.get(call())``, called again while the actor behind it restarts, for ``patience`` s."""
    ray = ray_module()
    deadline = time.monotonic() + patience
    while True:
        try:
            return ray.get(call())
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise StoreLost(f"{what}: no answer for {patience:g} s; fix: raise ray.recovery_timeout_s") from None
            time.sleep(0.05)
