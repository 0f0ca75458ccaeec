"""The queue's write-ahead journal: every change to the queue's contents, as codec records.

A put appends the item's record; a take, an eviction, an acknowledgement or a
redelivery appends the ids it moved, with the queue's version and counters after
it. Replaying the file rebuilds what the queue held: queued items in order, items
delivered to the consumer and not yet acknowledged, and items to deliver again. When
the consumer acknowledges (after its checkpoint), the file is rewritten as a snapshot of
the contents, atomically, so it never grows beyond a few sync windows.

The items are the LLM pipeline's groups (``GROUPS``) or the env pipeline's sampler chunks
(``CHUNKS``); a ``QueueWire`` says how one is written, read, named and versioned.

Appends are flushed, not fsynced: the journal survives the death of the queue's
process, not of the machine (a checkpoint, fsynced, is what survives that).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from core.store.checkpoint import CheckpointError, write_atomic
from core.store.journal_file import FRAME, JournalFile
from core.model import group_wire, transition_wire
from core.model.transition_wire import TransitionChunk
from ext import codec

OP_KIND = "asyncrl.queue_op/1"
COUNTERS = ("put", "got", "evicted", "stale_on_put", "rejected_full")


@dataclass(frozen=True)
class QueueWire:
    """How a queue's items cross into the journal and back."""

    to_record: Callable[[Any], codec.Sample]
    from_record: Callable[[codec.Sample], Any]
    key: Callable[[Any], int]
    """The item's id: unique over the run."""
    version: Callable[[Any], int]
    """The policy version that produced it: what the queue's gate compares."""


GROUPS = QueueWire(group_wire.to_record, group_wire.from_record, lambda g: g.prompt_id, lambda g: g.version)


def chunk_key(c: TransitionChunk) -> int:
    """(sampler, seq) as one id: a sampler's chunks stay below 2**32."""
    return (c.sampler << 32) | c.seq


# A chunk's rows were all acted by one version: a sampler takes weights between chunks only.
CHUNKS = QueueWire(transition_wire.to_record, transition_wire.from_record, chunk_key, lambda c: int(c.version[0]))


class JournalState:
    """What a replayed journal says the queue held."""

    def __init__(self) -> None:
        self.queued: OrderedDict[int, Any] = OrderedDict()
        self.unacked: OrderedDict[int, Any] = OrderedDict()
        self.redeliver: list = []
        self.version = 0
        self.counters = {k: 0 for k in COUNTERS}


class QueueJournal:
    def __init__(self, path: Path, wire: QueueWire = GROUPS) -> None:
        self.file = JournalFile(path)
        self.path = self.file.path
        self.wire = wire

    @property
    def records(self) -> int:
        return self.file.records

    def _append(self, data: bytes) -> None:
        self.file.append(data)

    def put(self, item: Any) -> None:
        self._append(codec.encode(self.wire.to_record(item)))

    def op(self, op: str, items: Iterable, version: int, counters: dict) -> None:
        """``op``: got, removed, acked or redelivered; ``counters``: the queue's, after it."""
        self._append(self._op(op, items, version, counters))

    def _op(self, op: str, items: Iterable, version: int, counters: dict) -> bytes:
        ids = np.fromiter((self.wire.key(g) for g in items), np.int64)
        meta = {"kind": OP_KIND, "op": op, "version": int(version), **{f"c_{k}": int(counters[k]) for k in COUNTERS}}
        return codec.encode(codec.Sample(arrays={"ids": ids}, meta=meta))

    def rewrite(self, queued: list, redeliver: list, version: int, counters: dict, unacked: list = ()) -> None:
        """Replace the file by a snapshot of the contents (atomically), then append to it.
        ``unacked``: items delivered that the consumer has not acknowledged yet."""
        parts = [codec.encode(self.wire.to_record(g)) for g in [*queued, *redeliver, *unacked]]
        ops = []
        if redeliver:
            ops.append(("got", redeliver))
            ops.append(("redelivered", []))
        if unacked:
            ops.append(("got", unacked))
        ops.append(("base", []))
        parts += [self._op(op, gs, version, counters) for op, gs in ops]
        write_atomic(self.path, b"".join(FRAME.pack(len(p)) + p for p in parts))
        self.file.reopen()
        self.file.records = len(parts)

    def close(self) -> None:
        self.file.close()

    def replay(self) -> JournalState:
        """Read the file back; a torn last record (a write the crash cut short) is ignored."""
        st = JournalState()
        for at, body in self.file.read():
            try:
                rec = codec.decode(body)
                if "op" in rec.meta:
                    _apply(st, rec, self.wire.key)
                else:
                    g = self.wire.from_record(rec)
                    st.queued[self.wire.key(g)] = g
                    st.counters["put"] += 1  # an op record after it carries the counts whole
            except (codec.CodecError, KeyError) as exc:
                raise CheckpointError(str(self.path), f"journal record unreadable ({exc})", "start the run again", at) from None
        return st


def _apply(st: JournalState, rec: codec.Sample, key: Callable[[Any], int]) -> None:
    op = rec["op"]
    ids = [int(i) for i in rec["ids"]]
    if op == "got":
        redeliver = {key(g): g for g in st.redeliver}
        for pid in ids:
            g = redeliver.pop(pid, None) or st.queued.pop(pid)
            st.unacked[pid] = g
        st.redeliver = [g for g in st.redeliver if key(g) in redeliver]
    elif op == "removed":
        for pid in ids:
            if st.queued.pop(pid, None) is None:
                st.redeliver = [g for g in st.redeliver if key(g) != pid]
    elif op == "acked":
        st.unacked.clear()
    elif op == "redelivered":
        st.redeliver = list(st.unacked.values()) + st.redeliver
        st.unacked.clear()
    elif op not in ("base", "stale"):
        raise KeyError(f"unknown op {op!r}")
    st.version = int(rec["version"])
    st.counters = {k: int(rec[f"c_{k}"]) for k in COUNTERS}
