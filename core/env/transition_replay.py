"""The replay of the env pipeline: transitions in ``ext.replay``, paced by a ``RateLimiter``.

Samplers insert batches of transitions; learners sample minibatches, uniformly or by priority,
and send back new priorities. Each call is async and runs on one event loop, so the same class
is the in-process replay and, wrapped by ``ray.remote``, the replay actor (Ray runs an async
actor's calls on one loop, which is what ``ReplayBuffer`` needs: it is not thread-safe).

With a journal (``replay.durable``) every chunk it takes is written ahead of its answer, and
a replay actor restarted after a crash rebuilds its rows and counts from it
(``core/store/transition_journal.py`` says what a restart cannot keep). A sampler that sends a
chunk again because it never heard back finds it already taken, and is told so.

It also keeps what a ledger needs of it: rows inserted, rows sampled (with repeats), and rows
overwritten before they were ever sampled. The last are rows the samplers paid for and nobody
learned from, the replay's waste. Chunks from samplers (``insert_chunk``) are counted per
sampler in order, so a chunk lost or sent twice on the way is an error, not a silent gap, and
rows refused because the run was stopping are counted apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np

from core.env.chunk_intake import ChunkAccountingError, ChunkIntake
from core.env.rate_limiter import LimiterClosed, RateLimiter
from core.model.transition_wire import TransitionChunk
from core.store.transition_journal import ReplayJournalState, TransitionJournal
from ext.replay import ReplayBuffer

__all__ = ["ChunkAccountingError", "TransitionReplay"]


class TransitionReplay:
    """A ring of transitions with a sample-to-insert rate limit."""

    def __init__(
        self,
        capacity: int,
        spec: Mapping[str, tuple],
        *,
        limiter: RateLimiter,
        prioritized: bool,
        alpha: float,
        seed: int,
        journal: Union[str, Path, None] = None,
    ) -> None:
        """``journal``: a file to write ahead to, and to rebuild from if it has records (a restart)."""
        if limiter.min_size_to_sample < limiter.max_sample:
            raise ValueError(
                f"min_size_to_sample={limiter.min_size_to_sample} is fewer rows than one sample of max_sample="
                f"{limiter.max_sample} needs; use min_size_to_sample >= {limiter.max_sample}"
            )
        if limiter.min_size_to_sample > capacity:
            raise ValueError(
                f"min_size_to_sample={limiter.min_size_to_sample} is more rows than the capacity {capacity} holds; "
                f"sampling would wait forever"
            )
        self.buffer = ReplayBuffer(capacity, spec, prioritized=prioritized, alpha=alpha, seed=seed)
        self.limiter = limiter
        self._sampled = np.zeros(capacity, dtype=np.int64)  # draws of each slot's current row
        self._filled = np.zeros(capacity, dtype=bool)
        self.rows_inserted = 0
        self.rows_sampled = 0
        self.rows_evicted_unsampled = 0
        self.intake = ChunkIntake()
        self.restored_chunks = 0
        self.journal: Optional[TransitionJournal] = None
        if journal is not None:
            j = TransitionJournal(Path(journal))
            self._restore(j.read())
            self.journal = j

    def _restore(self, st: ReplayJournalState) -> None:
        for chunk, refused in st.chunks:
            if not refused and len(chunk):
                slots = self.buffer.add({**chunk.columns, "version": chunk.version})
                self._filled[slots] = True
                self._sampled[slots] = 1  # unknown: counted as drawn (see the journal's docstring)
                self.rows_inserted += len(chunk)
            self.intake.arrived(chunk, refused=refused)
        self.rows_sampled = st.rows_sampled
        self.rows_evicted_unsampled = st.rows_evicted_unsampled
        self.limiter.restore(self.rows_inserted, self.rows_sampled)
        self.restored_chunks = len(st.chunks)

    def __len__(self) -> int:
        return len(self.buffer)

    async def insert(self, batch: Mapping[str, np.ndarray], timeout: Optional[float] = None) -> np.ndarray:
        """Store the rows of ``batch`` once the limiter lets them in; returns their slots."""
        rows = _rows(batch)
        await self.limiter.wait_insert(rows, timeout)
        slots = self.buffer.add(batch)  # a malformed batch raises here, before the limiter counts it
        # A slot written twice in one batch (rows > capacity) loses its first row unsampled too.
        for s in slots:
            if self._filled[s] and self._sampled[s] == 0:
                self.rows_evicted_unsampled += 1
            self._filled[s] = True
            self._sampled[s] = 0
        self.rows_inserted += rows
        self.limiter.inserted(rows)
        return slots

    async def insert_chunk(self, chunk: TransitionChunk, timeout: Optional[float] = None) -> int:
        """Store a sampler's chunk: its rows, with the version of each as a column. Returns the rows
        stored, 0 for a chunk it already took (sent again after a crash). Once the replay is closed,
        raises ``LimiterClosed`` and counts the rows as refused; after a timeout nothing is
        counted, and the sampler may send the same chunk again."""
        if not self.intake.check(chunk):
            return 0
        with self.intake.taking(chunk.sampler):
            try:
                if len(chunk):
                    await self.insert({**chunk.columns, "version": chunk.version}, timeout)
            except LimiterClosed:
                self.intake.arrived(chunk, refused=True)
                self._journal_chunk(chunk, refused=True)
                raise
            self.intake.arrived(chunk)
            self._journal_chunk(chunk, refused=False)
        return len(chunk)

    def _journal_chunk(self, chunk: TransitionChunk, refused: bool) -> None:
        if self.journal is not None:
            self.journal.stored(chunk, refused=refused, rows_evicted_unsampled=self.rows_evicted_unsampled)

    async def sample(
        self, n: int, beta: float, timeout: Optional[float] = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``n`` rows once the limiter lets them out: (batch, slots, importance weights)."""
        await self.limiter.wait_sample(n, timeout)
        batch, slots, weights = self.buffer.sample(n, beta)
        np.add.at(self._sampled, slots, 1)
        self.rows_sampled += n
        self.limiter.sampled(n)
        if self.journal is not None:
            self.journal.sampled(self.rows_sampled)
        return batch, slots, weights

    def update_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """New priorities of sampled slots; a uniform replay has none, and takes them as nothing,
        so a learner need not know which kind it draws from."""
        if self.buffer.prioritized:
            self.buffer.update_priorities(slots, priorities)

    def hold(self) -> None:
        """The run is held for an evaluation: waits from now to ``end_hold`` are not blocked time."""
        self.limiter.hold()

    def end_hold(self) -> None:
        self.limiter.end_hold()

    def close(self) -> None:
        """Release the waiting samplers and learners: the run is stopping."""
        self.limiter.close()

    def ping(self) -> int:
        """Chunks taken so far, restored ones included: an answer means the replay serves."""
        return self.intake.chunks

    async def resume_point(self, sampler: int) -> tuple[int, int]:
        """(next chunk seq, env steps taken) of ``sampler``: where a restarted sampler goes on."""
        return await self.intake.resume_point(sampler)

    def polled(self) -> dict:
        """``stats()`` and the ``instance`` of the process that answers (a driver's poll)."""
        return {**self.stats(), "instance": self.intake.instance}

    def stats(self) -> dict:
        return {
            "size": len(self.buffer),
            "rows_inserted": self.rows_inserted,
            "rows_sampled": self.rows_sampled,
            "rows_evicted_unsampled": self.rows_evicted_unsampled,
            "restored_chunks": self.restored_chunks,
            **self.intake.stats(),
            **self.limiter.stats(),
        }


def _rows(batch: Mapping[str, np.ndarray]) -> int:
    if not batch:
        raise ValueError("an insert needs at least one field")
    lens = {k: len(v) for k, v in batch.items()}
    n = next(iter(lens.values()))
    if any(v != n for v in lens.values()):
        raise ValueError(f"fields of one insert must have the same number of rows: {lens}")
    return n
