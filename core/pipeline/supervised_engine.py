"""An engine behind timeouts: a hang becomes a loss the Rollouter can recover from."""

from __future__ import annotations

import asyncio
from typing import Any

from core.api import Engine
from core.model.faults import CallTimeout, RestartsExhausted


class SupervisedEngine:
    """An engine behind timeouts. A call that does not answer in time raises ``CallTimeout``
    naming the engine and the call; ``recover`` kills what is left of a lost worker, waits
    for its restart, and counts restarts against ``max_restarts``."""

    def __init__(self, engine: Engine, generate_s: float, control_s: float, restart_s: float, max_restarts: int) -> None:
        self.engine = engine
        self.name = engine.name
        self.generate_s, self.control_s, self.restart_s = generate_s, control_s, restart_s
        self.max_restarts = max_restarts
        self.restarts = 0

    async def _call(self, call: str, coro, seconds: float, key: str):
        try:
            async with asyncio.timeout(seconds):
                return await coro
        except TimeoutError:
            raise CallTimeout(self.name, call, seconds, key) from None

    async def generate(self, group, max_response_len: int) -> bool:
        return await self._call("generate", self.engine.generate(group, max_response_len), self.generate_s, "timeouts.generate_s")

    async def abort_all(self) -> int:
        return await self._call("abort_all", self.engine.abort_all(), self.control_s, "timeouts.control_s")

    async def update_weights(self, version: int, weights: Any) -> None:
        await self._call("update_weights", self.engine.update_weights(version, weights), self.control_s, "timeouts.control_s")

    async def clear_cache(self) -> None:
        await self._call("clear_cache", self.engine.clear_cache(), self.control_s, "timeouts.control_s")

    async def recover(self) -> None:
        """Bring the worker back: killed first if it only hangs, then restarted."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RestartsExhausted(
                f"{self.name}: lost {self.restarts} times, more than recovery.max_restarts = {self.max_restarts}; "
                "fix: raise recovery.max_restarts, or find out why it keeps dying"
            )
        await self._call("restart", self.engine.recover(), self.restart_s, "timeouts.restart_s")


