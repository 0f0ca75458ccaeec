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

(the learner counts what it trained and what it found too stale; the queue the rest).

Durable (a journal directory, async mode): the queue journals its contents (the pipeline's
``QueueJournal``, chunks for groups) and every arrival, and keeps the chunks it handed to the
learner until the learner acknowledges them (after its checkpoint, or at once if it keeps
none). A queue actor that dies comes back with the same chunks and counts; a learner that dies
gets the chunks its checkpoint does not cover again, first.

As the replay, one class serves in process (sync mode) and as the Ray actor (its calls are
async on one loop).
"""

from __future__ import annotations

import time
import asyncio
from collections import Counter, deque
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

from core.env.chunk_intake import ChunkIntake
from core.env.held_time import HeldTime
from core.model.transition_wire import TransitionChunk
from core.pipeline.staleness_queue import AsyncStalenessQueue, QueueClosed
from core.store.arrival_journal import Arrival, ArrivalJournal
from core.store.queue_journal import CHUNKS, QueueJournal


class SegmentQueue:
    """Bounded, version-gated FIFO of sampler chunks."""

    def __init__(self, capacity: int, max_staleness: int, journal_dir: Union[str, Path, None] = None) -> None:
        """``journal_dir``: where to journal (and, if it holds a journal already, to rebuild
        from: this is a restart)."""
        journal = QueueJournal(Path(journal_dir) / "queue.journal", CHUNKS) if journal_dir is not None else None
        self.queue = AsyncStalenessQueue(capacity, max_staleness, journal=journal)
        self.arrivals = ArrivalJournal(Path(journal_dir) / "arrivals.journal") if journal_dir is not None else None
        self.intake = ChunkIntake()
        self.max_staleness = max_staleness
        self.left_at_end = 0
        self.redelivered = 0
        # How long each side waited here: a sampler for room, the learner for chunks.
        self.insert_blocked_s = 0.0
        self.sample_blocked_s = 0.0
        self.holds = HeldTime()  # a wait's seconds in a hold for an evaluation are not blocked ones
        self.capacity = capacity
        self._held: Counter[int] = Counter()  # places reserved, per sampler
        self._waiting: deque[asyncio.Future] = deque()
        self._closed = False
        if journal is not None and journal.path.stat().st_size:
            self._restore()

    def _restore(self) -> None:
        """Rebuild from the journals: what was queued or handed out and not acknowledged, and
        every arrival's counts."""
        self.queue.recover()
        for a in self.arrivals.read():
            self.intake.note(a.sampler, a.seq, a.env_steps, a.rows, a.episode_returns, a.refused)
            self.insert_blocked_s, self.sample_blocked_s = a.insert_blocked_s, a.sample_blocked_s

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
            self.insert_blocked_s += self.holds.running(t0, time.perf_counter())

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
                kept = await self.queue.put(chunk, CHUNKS.version(chunk), timeout)
            except QueueClosed:
                self._arrived(chunk, refused=True)
                raise
            finally:
                self.insert_blocked_s += self.holds.running(t0, time.perf_counter())
            self._arrived(chunk)
        if not kept:
            self._room()
        return len(chunk) if kept else 0

    def _arrived(self, chunk: TransitionChunk, refused: bool = False) -> None:
        self.intake.arrived(chunk, refused)
        if self.arrivals is not None:
            self.arrivals.arrived(Arrival(chunk.sampler, chunk.seq, chunk.env_steps, len(chunk), chunk.episode_returns,
                                          refused, self.insert_blocked_s, self.sample_blocked_s))

    async def get_batch(self, n: int, timeout: Optional[float] = None) -> list[TransitionChunk]:
        """The ``n`` oldest chunks, once there are that many; ``QueueClosed`` once closed."""
        t0 = time.perf_counter()
        try:
            chunks = await self.queue.get_batch(n, timeout)
        finally:
            self.sample_blocked_s += self.holds.running(t0, time.perf_counter())
        self._room()
        return chunks

    def hold(self) -> None:
        """The run is held for an evaluation (``env.hold_for_eval``), until ``end_hold``."""
        self.holds.hold(time.perf_counter())

    def end_hold(self) -> None:
        self.holds.end(time.perf_counter())

    def set_version(self, version: int) -> int:
        """The learner published ``version``: drop queued chunks now too stale. Returns how many."""
        evicted = len(self.queue.set_version(version))
        if evicted:
            self._room()
        return evicted

    def ack(self, keys: Iterable[int]) -> None:
        """The learner's state covers the chunks of ``keys`` (``CHUNKS.key``): forget them."""
        self.queue.ack(list(keys))

    def rejoin(self, covered: Iterable[int], held: Iterable[int]) -> int:
        """The learner came back (from its checkpoint, whose chunks are ``covered``), or this
        queue did while the learner ``held`` the chunks it took since its last acknowledgement.
        Every other chunk handed out and not acknowledged is delivered again, first. Returns how many."""
        self.queue.drop_consumer()
        self.queue.ack(list(covered))
        n = self.queue.redeliver(keep=list(held))
        self.redelivered += n
        return n

    def close(self) -> None:
        """Release the waiting samplers and learner: the run is stopping. Chunks still queued are
        counted as left at the end."""
        self._closed = True
        self.queue.close()
        self.left_at_end += len(self.queue.drain())
        self._room()

    def polled(self) -> dict:
        """``stats()`` and the ``instance`` of the process that answers (a driver's poll)."""
        return {**self.stats(), "instance": self.intake.instance}

    def stats(self) -> dict:
        c = self.queue.counters()  # journaled: they survive a restart
        return {
            "size": len(self.queue),
            "delivered": c["got"] - self.left_at_end,  # first deliveries: the drain at close counts as taken
            "redelivered": self.redelivered,
            "stale_on_arrival": c["stale_on_put"],
            "evicted_stale": c["evicted"],
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
