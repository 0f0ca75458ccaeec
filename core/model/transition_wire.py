"""A chunk of environment transitions, and how it crosses a process boundary: one ``ext.codec``
record, never a pickle of objects (as ``group_wire`` does for LLM groups).

A sampler sends what its environments produced over ``send_every`` vector steps as one chunk:
named columns of one row per transition (what the columns are is the learner's schema), the
policy version each row was acted by, and the episodes that ended in the chunk. The ledger
counts chunks and rows; the replay stores the rows.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ext import codec

KIND = "asyncrl.transitions/1"
# Column names the record itself uses; a schema may not take them.
_RESERVED = ("version", "episode_returns", "episode_lengths")


@dataclass(eq=False)
class TransitionChunk:
    """Rows of transitions from one sampler, in the order its environments produced them."""

    sampler: int
    seq: int
    """The sampler's count of chunks before this one: (sampler, seq) names a chunk in the ledger."""
    columns: Mapping[str, np.ndarray]
    version: np.ndarray
    """int64 per row: the policy version that chose the row's action."""
    env_steps: int
    """Environment steps the chunk covers (rows can lag them: an n-step row waits for n steps)."""
    episode_returns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    episode_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self) -> None:
        n = len(self.version)
        bad = [k for k in self.columns if k in _RESERVED]
        if bad:
            raise ValueError(f"column names {bad} are the record's own; rename them")
        ragged = {k: len(v) for k, v in self.columns.items() if len(v) != n}
        if ragged:
            raise ValueError(f"every column needs {n} rows (one per version): {ragged}")
        if len(self.episode_returns) != len(self.episode_lengths):
            raise ValueError("episode_returns and episode_lengths differ in length")

    def __len__(self) -> int:
        return len(self.version)

    def __reduce_ex__(self, protocol: int):
        return (from_bytes, (pickle.PickleBuffer(codec.encode(to_record(self))) if protocol >= 5 else codec.encode(to_record(self)),))


def to_record(chunk: TransitionChunk) -> codec.Sample:
    arrays = {f"col.{k}": np.ascontiguousarray(v) for k, v in chunk.columns.items()}
    arrays["version"] = np.asarray(chunk.version, dtype=np.int64)
    arrays["episode_returns"] = np.asarray(chunk.episode_returns, dtype=np.float64)
    arrays["episode_lengths"] = np.asarray(chunk.episode_lengths, dtype=np.int64)
    meta = {"kind": KIND, "sampler": int(chunk.sampler), "seq": int(chunk.seq), "env_steps": int(chunk.env_steps)}
    return codec.Sample(arrays, meta)


def from_record(rec: codec.Sample) -> TransitionChunk:
    if rec.meta.get("kind") != KIND:
        raise codec.CodecError(f"not a transition chunk: kind {rec.meta.get('kind')!r}")
    cols = {k[4:]: np.asarray(v) for k, v in rec.arrays.items() if k.startswith("col.")}
    return TransitionChunk(
        sampler=int(rec["sampler"]),
        seq=int(rec["seq"]),
        columns=cols,
        version=np.asarray(rec["version"]),
        env_steps=int(rec["env_steps"]),
        episode_returns=np.asarray(rec["episode_returns"]),
        episode_lengths=np.asarray(rec["episode_lengths"]),
    )


def from_bytes(data) -> TransitionChunk:
    return from_record(codec.decode(data))
