"""PPO's intake: sampler chunks in arrival order, each trained once, on the pipeline's own
``AsyncStalenessQueue`` (``ext.squeue`` underneath, the queue the LLM Rollouter feeds).

The queue's room covers chunks being collected too: a sampler reserves a place before it
starts a chunk, so when the learner is the slower side the samplers wait *before* acting, and
act with the weights the learner published while they waited, instead of acting early with old
weights and waiting to hand the chunk over (AReaL's admission control, per chunk). With one
place and a learner slower than its sampler, every chunk lags one version. The version gate drops a chunk once the learner's
version is more than ``max_staleness`` past the version that acted it: an on-policy learner would
otherwise train on a policy it left long ago. Every chunk is accounted for:

    arrived = trained + dropped (stale on arrival, evicted stale, stale at the learner)
              + refused at close + left queued at the end

As the replay, one class serves in process (sync mode) and as the Ray actor (its calls are
async on one loop).
"""

from __future__ import annotations

import time
import asyncio
from collections import Counter, deque
from typing import Optional

import numpy as np

from core.env.chunk_intake import ChunkIntake
from core.model.transition_wire import TransitionChunk
from core.pipeline.staleness_queue import AsyncStalenessQueue, QueueClosed


class SegmentQueue:
    """Bounded, version-gated FIFO of sampler chunks."""

    def __init__(self, capacity: int, max_staleness: int) -> None:
        self.queue = AsyncStalenessQueue(capacity, max_staleness)
        self.intake = ChunkIntake()
        self.max_staleness = max_staleness
        self.stale_on_arrival = 0
        self.evicted_stale = 0
        self.stale_at_learner = 0
        self.delivered = 0
        self.left_at_end = 0
        # How long each side waited here: a sampler for room, the learner for chunks.
        self.insert_blocked_s = 0.0
        self.sample_blocked_s = 0.0
        self.capacity = capacity
        self._held: Counter[int] = Counter()  # places reserved, per sampler
        self._waiting: deque[asyncio.Future] = deque()
        self._closed = False

    def __len__(self) -> int:
        return len(self.queue)

    async def reserve(self, sampler: int) -> int:
        """Wait for a place for the chunk ``sampler`` is about to collect; ``QueueClosed`` once
        closed. The place is the sampler's until its ``insert_chunk`` (or ``release``). Returns
        the newest version the learner announced: the sampler should act with it, not with an
        older one it holds."""
        t0 = time.perf_counter()
        try:
            while not self._closed and len(self.queue) + sum(self._held.values()) >= self.capacity:
                fut = asyncio.get_running_loop().create_future()
                self._waiting.append(fut)
                await fut
            if self._closed:
                raise QueueClosed("the queue was closed")
            self._held[sampler] += 1
            return self.queue.version
        finally:
            self.insert_blocked_s += time.perf_counter() - t0

    def release(self, sampler: int) -> int:
        """Free the places ``sampler`` held: it died while collecting, and its restart starts
        afresh. Returns how many."""
        n = self._held.pop(sampler, 0)
        if n:
            self._room()
        return n

    def ping(self) -> int:
        return self.intake.chunks

    async def resume_point(self, sampler: int) -> tuple[int, int]:
        """(next chunk seq, env steps taken) of ``sampler``: where a restarted sampler goes on."""
        return await self.intake.resume_point(sampler)

    def _room(self) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)

    async def insert_chunk(self, chunk: TransitionChunk, timeout: Optional[float] = None) -> int:
        """Queue a sampler's chunk once there is room; returns its rows (0 if it was already too
        stale to keep). Once closed, raises ``QueueClosed`` and counts the chunk as refused."""
        if self._held[chunk.sampler]:
            self._held[chunk.sampler] -= 1  # its place becomes the queued chunk's
        if not self.intake.check(chunk):
            self._room()
            return 0
        if not len(chunk):
            raise ValueError(f"sampler {chunk.sampler}: chunk {chunk.seq} has no rows; a segment chunk has one per environment")
        t0 = time.perf_counter()
        with self.intake.taking(chunk.sampler):
            try:
                kept = await self.queue.put(chunk, int(chunk.version[0]), timeout)
            except QueueClosed:
                self.intake.arrived(chunk, refused=True)
                raise
            finally:
                self.insert_blocked_s += time.perf_counter() - t0
            self.intake.arrived(chunk)
        if not kept:
            self.stale_on_arrival += 1
            self._room()
        return len(chunk) if kept else 0

    async def get_batch(self, n: int, timeout: Optional[float] = None) -> list[TransitionChunk]:
        """The ``n`` oldest chunks, once there are that many; ``QueueClosed`` once closed."""
        t0 = time.perf_counter()
        try:
            chunks = await self.queue.get_batch(n, timeout)
        finally:
            self.sample_blocked_s += time.perf_counter() - t0
        self.delivered += len(chunks)
        self._room()
        return chunks

    def set_version(self, version: int) -> int:
        """The learner published ``version``: drop queued chunks now too stale. Returns how many."""
        evicted = len(self.queue.set_version(version))
        self.evicted_stale += evicted
        if evicted:
            self._room()
        return evicted

    def dropped_at_learner(self, chunks: int) -> None:
        """Chunks the learner took but found too stale by the time it got to them."""
        self.stale_at_learner += chunks

    def close(self) -> None:
        """Release the waiting samplers and learner: the run is stopping. Chunks still queued are
        counted as left at the end."""
        self._closed = True
        self.queue.close()
        self.left_at_end += len(self.queue.drain())
        self._room()

    def stats(self) -> dict:
        return {
            "size": len(self.queue),
            "delivered": self.delivered,
            "stale_on_arrival": self.stale_on_arrival,
            "evicted_stale": self.evicted_stale,
            "stale_at_learner": self.stale_at_learner,
            "left_at_end": self.left_at_end,
            "insert_blocked_s": self.insert_blocked_s,
            "sample_blocked_s": self.sample_blocked_s,
            **self.intake.stats(),
        }


def batch_columns(chunks: list[TransitionChunk]) -> dict[str, np.ndarray]:
    """The segments of several chunks as one batch: columns stacked along the segment axis."""
    if len(chunks) == 1:
        return dict(chunks[0].columns)
    return {k: np.concatenate([c.columns[k] for c in chunks]) for k in chunks[0].columns}
