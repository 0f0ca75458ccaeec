"""The PPO queue's arrival journal: one small record per sampler chunk that reached the queue
(who sent it, which one, its env steps and finished episodes, whether it was kept), without
its rows: the queue's own journal holds those while they are queued. A restarted queue reads
it back to know each sampler's next chunk and the run's counts.

The seconds each side waited at the queue ride along as running totals, so a restart loses at
most what was waited since the last arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.store.checkpoint import CheckpointError
from core.store.journal_file import JournalFile
from ext import codec

KIND = "asyncrl.chunk-arrival/1"


@dataclass(frozen=True)
class Arrival:
    sampler: int
    seq: int
    env_steps: int
    rows: int
    episode_returns: np.ndarray
    refused: bool
    """Arrived after the run closed the queue: produced, never stored."""
    insert_blocked_s: float
    sample_blocked_s: float


class ArrivalJournal:
    def __init__(self, path: Path) -> None:
        self.file = JournalFile(path)

    def arrived(self, a: Arrival) -> None:
        meta = {"kind": KIND, "sampler": a.sampler, "seq": a.seq, "env_steps": a.env_steps, "rows": a.rows,
                "refused": int(a.refused), "insert_blocked_s": float(a.insert_blocked_s),
                "sample_blocked_s": float(a.sample_blocked_s)}
        self.file.append(codec.encode(codec.Sample({"episode_returns": np.asarray(a.episode_returns, np.float64)}, meta)))

    def read(self) -> list[Arrival]:
        out = []
        for at, body in self.file.read():
            try:
                rec = codec.decode(body)
                if rec.meta.get("kind") != KIND:
                    raise KeyError(f"kind {rec.meta.get('kind')!r}")
                out.append(Arrival(
                    int(rec["sampler"]), int(rec["seq"]), int(rec["env_steps"]), int(rec["rows"]),
                    np.asarray(rec["episode_returns"]), bool(rec["refused"]),
                    float(rec["insert_blocked_s"]), float(rec["sample_blocked_s"]),
                ))
            except (codec.CodecError, KeyError) as exc:
                raise CheckpointError(str(self.file.path), f"arrival record unreadable ({exc})", "start the run again", at) from None
        return out

    def close(self) -> None:
        self.file.close()
