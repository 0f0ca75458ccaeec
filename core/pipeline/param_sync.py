"""ParamSync: pause rollout, transfer weights, bump the version, resume.

Pausing drains generations in flight (async), aborts them (partial) or freezes them in the
engines (inflight), which then take the new weights between two decode steps.

Pause time (rollout stopped, drain included) and transfer time are recorded apart, so a
report shows whether a sync costs bandwidth or waiting for the longest response. Transfer time
is the weights' whole way: the trainer's send and every engine's load (for a collective
transfer the two run at once; for an object store, the put then the engines' loads).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from core.api import CollectiveTransfer, PauseMode, RolloutControl, WeightTransfer
from core.model.faults import CollectiveBroken
from core.model.progress import WeightsSynced
from core.model.timeline import SYNC, Timeline

log = logging.getLogger(__name__)

# Tries of one collective sync: each broken one has lost a member, and the next forms a new group without it.
COLLECTIVE_TRIES = 3


class ParamSync:
    def __init__(
        self,
        *,
        rollouter: RolloutControl,
        transfer: WeightTransfer | CollectiveTransfer,
        mode: PauseMode,
        timeline: Optional[Timeline] = None,
        on_synced: Optional[Callable[[WeightsSynced], None]] = None,
        checkpoint: Optional[Callable[[int, float, float], Awaitable[None]]] = None,
        checkpoint_due: Callable[[int], bool] = lambda version: False,
    ) -> None:
        self.rollouter = rollouter
        self.transfer = transfer
        self.mode = mode
        self.timeline = timeline
        self.on_synced = on_synced
        self.pause_s: list[float] = []
        self.drain_s: list[float] = []
        self.transfer_s: list[float] = []
        self.bytes: list[int] = []  # per sync, where the transfer counts what it moved (real ones)
        # Called while rollout is paused, before the weights leave: a checkpoint there holds
        # no generation in flight, and weights never run ahead of the latest checkpoint.
        self.checkpoint = checkpoint
        # Whether a checkpoint is due at a version: it captures the rollout side too (whole, in
        # one process or both actors on ray), which must then hold no generation in flight.
        self.checkpoint_due = checkpoint_due

    def state(self) -> dict:
        """What a checkpoint keeps: the time of every sync so far."""
        return {"pause_s": list(self.pause_s), "drain_s": list(self.drain_s), "transfer_s": list(self.transfer_s), "bytes": list(self.bytes)}

    def restore(self, state: dict) -> None:
        self.pause_s, self.drain_s, self.transfer_s = list(state["pause_s"]), list(state["drain_s"]), list(state["transfer_s"])
        self.bytes = list(state.get("bytes", ()))  # checkpoints from before bytes were counted have none

    async def sync(self, version: int, checkpoint: bool = True) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        mode = self.mode
        take = checkpoint and self.checkpoint is not None
        if mode == "keep" and take and self.checkpoint_due(version):
            # A checkpoint holds no generation in flight: this sync interrupts them, as partial
            # rollout does, and they resume from the checkpoint's cancel queue.
            mode = "abort"
        await self.rollouter.pause(mode)
        t1 = loop.time()
        if take:
            await self.checkpoint(version, t0, t1)
        await self.finish(version, t0, t1)

    async def finish(self, version: int, t0: float, t1: float) -> None:
        """The rest of a sync once rollout is paused: move the weights, resume."""
        loop = asyncio.get_running_loop()
        if isinstance(self.transfer, CollectiveTransfer):
            await self._together(version)
        else:
            weights = await self.transfer.send(version)
            await self.rollouter.update_weights(version, weights)
        t2 = loop.time()
        await self.rollouter.resume()
        t3 = loop.time()
        self.drain_s.append(t1 - t0)
        self.transfer_s.append(t2 - t1)
        self.pause_s.append(t3 - t0)
        if self.transfer.bytes is not None:
            self.bytes.append(int(self.transfer.bytes))
        if self.timeline is not None:
            self.timeline.add("trainer", SYNC, t0, t3)  # the trainer waits from the request on
            self.timeline.add("rollout", SYNC, t1, t3)  # engines stop once drained or aborted
        if self.on_synced is not None:
            self.on_synced(WeightsSynced(version, t3, t3 - t0, t1 - t0, t2 - t1))

    async def _together(self, version: int) -> None:
        """A collective transfer: the trainer sends while the engines receive, so the two run
        at once; it ends when every engine has loaded (or the rollout side took no part). A
        member that dies or hangs mid-way breaks it for all (``CollectiveBroken``): the rollout
        side marks it lost, and the sync goes again, in a new group, to those still up."""
        for attempt in range(1, COLLECTIVE_TRIES + 1):
            ticket = self.transfer.ticket(version)
            receiving = asyncio.ensure_future(self.rollouter.update_weights(version, ticket))
            try:
                await self.transfer.send(ticket, receiving)
                await receiving
                return
            except CollectiveBroken as exc:
                await asyncio.gather(receiving, return_exceptions=True)  # every member's answer is in
                if attempt == COLLECTIVE_TRIES:
                    raise
                log.warning("%s; sync to version %d sent again (try %d of %d)", exc, version, attempt + 1, COLLECTIVE_TRIES)
            except BaseException:
                receiving.cancel()
                await asyncio.gather(receiving, return_exceptions=True)
                raise
