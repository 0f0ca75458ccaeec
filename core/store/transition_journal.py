"""The env replay's write-ahead journal: every chunk it took, as the chunk's own codec record,
and the running count of rows sampled. A replay actor that dies and is restarted reads it back
and holds the same rows again, with the same counts, so no chunk a sampler produced is lost.

What it does not keep: priorities (restored rows start at the replay's maximum, as new rows do)
and which slots were drawn (restored rows count as drawn, so the replay's waste figure,
rows overwritten before any draw, can only be under-reported after a restart, never inflated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.model.transition_wire import TransitionChunk, from_record, to_record
from core.store.checkpoint import CheckpointError
from core.store.journal_file import JournalFile
from ext import codec

SAMPLED_KIND = "asyncrl.replay-sampled/1"


@dataclass
class ReplayJournalState:
    """What a replayed journal says the replay took, in order."""

    chunks: list[tuple[TransitionChunk, bool]] = field(default_factory=list)
    """(chunk, refused at close) in arrival order."""
    rows_sampled: int = 0
    rows_evicted_unsampled: int = 0


class TransitionJournal:
    def __init__(self, path: Path) -> None:
        self.file = JournalFile(path)

    def stored(self, chunk: TransitionChunk, *, refused: bool, rows_evicted_unsampled: int) -> None:
        """Written once the chunk's rows are in the replay (or it was refused at close)."""
        rec = to_record(chunk)
        meta = {**rec.meta, "refused": int(refused), "rows_evicted_unsampled": int(rows_evicted_unsampled)}
        self.file.append(codec.encode(codec.Sample(rec.arrays, meta)))

    def sampled(self, rows_sampled: int) -> None:
        self.file.append(codec.encode(codec.Sample({}, {"kind": SAMPLED_KIND, "rows_sampled": int(rows_sampled)})))

    def read(self) -> ReplayJournalState:
        st = ReplayJournalState()
        for at, body in self.file.read():
            try:
                rec = codec.decode(body)
                if rec.meta.get("kind") == SAMPLED_KIND:
                    st.rows_sampled = int(rec["rows_sampled"])
                    continue
                st.chunks.append((from_record(rec), bool(rec["refused"])))
                st.rows_evicted_unsampled = int(rec["rows_evicted_unsampled"])
            except (codec.CodecError, KeyError) as exc:
                raise CheckpointError(str(self.file.path), f"replay journal record unreadable ({exc})", "start the run again", at) from None
        return st

    def close(self) -> None:
        self.file.close()
