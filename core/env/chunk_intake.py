"""Where sampler chunks arrive, whichever store takes them (the DQN replay or the PPO queue):
each sampler's chunks in order, and the counts a ledger of the run needs.

A chunk is named by (sampler, seq). One that arrives out of order means one before it was lost
or it came twice on the way; either is an error here, never a silent gap in the accounting.
"""

from __future__ import annotations

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
        self.episode_returns: list[float] = []
        self._next_seq: dict[int, int] = {}

    def check(self, chunk: TransitionChunk) -> None:
        """Raise ``ChunkAccountingError`` unless ``chunk`` is its sampler's next."""
        want = self._next_seq.get(chunk.sampler, 0)
        if chunk.seq != want:
            raise ChunkAccountingError(f"sampler {chunk.sampler}: chunk {chunk.seq} arrived where chunk {want} was due")

    def arrived(self, chunk: TransitionChunk, refused: bool = False) -> None:
        self._next_seq[chunk.sampler] = chunk.seq + 1
        self.chunks += 1
        self.env_steps += chunk.env_steps
        self.episode_returns.extend(float(x) for x in chunk.episode_returns)
        if refused:
            self.rows_refused += len(chunk)
            self.chunks_refused += 1

    def stats(self) -> dict:
        return {
            "chunks": self.chunks,
            "chunks_refused": self.chunks_refused,
            "rows_refused": self.rows_refused,
            "env_steps": self.env_steps,
            "episodes": len(self.episode_returns),
        }
