"""Where sampler chunks arrive, whichever store takes them (the DQN replay or the PPO queue):
each sampler's chunks in order, and the counts a ledger of the run needs.

A chunk is named by (sampler, seq). One that arrives ahead of its turn means one before it was
lost: an error here, never a silent gap in the accounting. One that arrives again (its sampler
never heard back, from a store that crashed after taking it) is counted as resent and not
taken twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from core.model.transition_wire import TransitionChunk


class ChunkAccountingError(RuntimeError):
    """A sampler's chunk arrived out of order: one before it was lost, or it came twice."""


class ChunkIntake:
    """Counts of what arrived: chunks, their env steps and finished episodes, and the rows of
    chunks refused because the run was stopping (produced, never stored)."""

    def __init__(self) -> None:
        self.chunks = 0
        self.env_steps = 0
        self.rows_refused = 0
        self.chunks_refused = 0
        self.chunks_resent = 0
        self.episode_returns: list[float] = []
        self._next_seq: dict[int, int] = {}
        self._steps_of: dict[int, int] = {}
        self._taking: dict[int, asyncio.Event] = {}  # samplers whose chunk is being taken now

    def check(self, chunk: TransitionChunk) -> bool:
        """True if ``chunk`` is its sampler's next; False if it was taken before (counted as
        resent); ``ChunkAccountingError`` if one before it never arrived."""
        want = self._next_seq.get(chunk.sampler, 0)
        if chunk.seq < want:
            self.chunks_resent += 1
            return False
        if chunk.seq != want:
            raise ChunkAccountingError(f"sampler {chunk.sampler}: chunk {chunk.seq} arrived where chunk {want} was due")
        return True

    @contextlib.contextmanager
    def taking(self, sampler: int) -> Iterator[None]:
        """Around a store's handling of one chunk of ``sampler`` (which may wait for room)."""
        done = self._taking[sampler] = asyncio.Event()
        try:
            yield
        finally:
            del self._taking[sampler]
            done.set()

    async def resume_point(self, sampler: int) -> tuple[int, int]:
        """(next seq, env steps taken) of ``sampler``, once a chunk of it still being taken is
        in or refused: a sampler that died after sending it must resume after it, not at it."""
        while sampler in self._taking:
            await self._taking[sampler].wait()
        return self._next_seq.get(sampler, 0), self._steps_of.get(sampler, 0)

    def arrived(self, chunk: TransitionChunk, refused: bool = False) -> None:
        self.note(chunk.sampler, chunk.seq, chunk.env_steps, len(chunk), chunk.episode_returns, refused)

    def note(self, sampler: int, seq: int, env_steps: int, rows: int, episode_returns, refused: bool) -> None:
        """A chunk's arrival, from its counts alone (what a restarted store reads back)."""
        self._next_seq[sampler] = seq + 1
        self.chunks += 1
        self.env_steps += env_steps
        self._steps_of[sampler] = self._steps_of.get(sampler, 0) + env_steps
        self.episode_returns.extend(float(x) for x in episode_returns)
        if refused:
            self.rows_refused += rows
            self.chunks_refused += 1

    def stats(self) -> dict:
        return {
            "chunks": self.chunks,
            "chunks_refused": self.chunks_refused,
            "rows_refused": self.rows_refused,
            "chunks_resent": self.chunks_resent,
            "env_steps": self.env_steps,
            "episodes": len(self.episode_returns),
        }
