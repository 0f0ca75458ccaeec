"""Where sampler chunks arrive, whichever store takes them (the DQN replay or the PPO queue):
each sampler's chunks in order, and the counts a ledger of the run needs.

The run's chunks go on the pipeline's ``Ledger``, as an LLM run's samples do (``run_ledger``):

    produced (the samplers' chunks) = trained (PPO's learner) + dropped (by reason) + in flight

where in flight is what the store held when the run stopped (PPO: left queued at the close;
DQN: in the replay, whose rows are drawn, never trained as chunks). A chunk in no count is lost.

A chunk is named by (sampler, seq). One that arrives ahead of its turn means one before it was
lost: an error here, never a silent gap in the accounting. One that arrives again (its sampler
never heard back, from a store that crashed after taking it) is counted as resent and not
taken twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Iterator

from core.model.env_config import EnvScenario
from core.model.ledger import Ledger
from core.model.transition_wire import TransitionChunk

# Why a chunk was dropped, as the run's ledger names it.
STALE_ON_ARRIVAL = "stale_on_arrival"  # PPO's queue: too stale when it arrived
EVICTED_STALE = "evicted_stale"  # PPO's queue: grew too stale while queued
STALE_AT_LEARNER = "stale_at_learner"  # PPO's learner: too stale when it took the chunk
STALE = (STALE_ON_ARRIVAL, EVICTED_STALE, STALE_AT_LEARNER)
REFUSED = "refused_at_close"  # either store: arrived while the run was stopping


class ChunkAccountingError(RuntimeError):
    """A sampler's chunk arrived out of order: one before it was lost, or it came twice."""


class ChunkIntake:
    """Counts of what arrived: chunks, their env steps and finished episodes, and the rows of
    chunks refused because the run was stopping (produced, never stored)."""

    def __init__(self) -> None:
        # Names the process that serves: a store Ray restarted answers with a new one, which a
        # driver may see without a failed call in between (calls wait out a restart).
        self.instance = uuid.uuid4().hex
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


def chunk_ledger(sc: EnvScenario) -> Ledger:
    """An empty ledger of chunks; its bound is PPO's version gate (a DQN learner trains none)."""
    return Ledger(sc.ppo.max_staleness if sc.learner == "ppo" else 0)


def run_ledger(sc: EnvScenario, produced: int, learner: Ledger, store: dict) -> tuple[Ledger, int]:
    """(the run's ledger of chunks, chunks in flight at the end): the samplers' ``produced``, the
    learner's own ledger (trained, dropped at the learner) and the store's ``stats()`` (dropped,
    and what it held when the run stopped)."""
    led = chunk_ledger(sc)
    led.merge(learner)
    led.admitted_n(produced)
    led.dropped_n(store["chunks_refused"], REFUSED)
    if sc.learner == "ppo":
        led.dropped_n(store["stale_on_arrival"], STALE_ON_ARRIVAL)
        led.dropped_n(store["evicted_stale"], EVICTED_STALE)
        return led, store["left_at_end"]
    return led, store["chunks"] - store["chunks_refused"]
