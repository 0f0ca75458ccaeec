"""The queue's write-ahead journal: every change to the queue's contents, as codec records.

A put appends the group's record; a take, an eviction, an acknowledgement or a
redelivery appends the prompt ids it moved, with the queue's version and counters after
it. Replaying the file rebuilds what the queue held: queued groups in order, groups
delivered to the trainer and not yet acknowledged, and groups to deliver again. When
the trainer acknowledges (after its checkpoint), the file is rewritten as a snapshot of
the contents, atomically, so it never grows beyond a few sync windows.

Appends are flushed, not fsynced: the journal survives the death of the queue's
process, not of the machine (a checkpoint, fsynced, is what survives that).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Iterable

import numpy as np

from core.store.checkpoint import CheckpointError, write_atomic
from core.store.journal_file import FRAME, JournalFile
from core.model.group_wire import from_record, to_record
from core.model.sample import Group
from ext import codec

OP_KIND = "asyncrl.queue_op/1"
COUNTERS = ("put", "got", "evicted", "stale_on_put", "rejected_full")


class JournalState:
    """What a replayed journal says the queue held."""

    def __init__(self) -> None:
        self.queued: OrderedDict[int, Group] = OrderedDict()
        self.unacked: OrderedDict[int, Group] = OrderedDict()
        self.redeliver: list[Group] = []
        self.version = 0
        self.counters = {k: 0 for k in COUNTERS}


class QueueJournal:
    def __init__(self, path: Path) -> None:
        self.file = JournalFile(path)
        self.path = self.file.path

    @property
    def records(self) -> int:
        return self.file.records

    def _append(self, data: bytes) -> None:
        self.file.append(data)

    def put(self, group: Group) -> None:
        self._append(codec.encode(to_record(group)))

    def op(self, op: str, groups: Iterable[Group], version: int, counters: dict) -> None:
        """``op``: got, removed, acked or redelivered; ``counters``: the queue's, after it."""
        ids = np.fromiter((g.prompt_id for g in groups), np.int64)
        meta = {"kind": OP_KIND, "op": op, "version": int(version), **{f"c_{k}": int(counters[k]) for k in COUNTERS}}
        self._append(codec.encode(codec.Sample(arrays={"ids": ids}, meta=meta)))

    def rewrite(self, queued: list[Group], redeliver: list[Group], version: int, counters: dict) -> None:
        """Replace the file by a snapshot of the contents (atomically), then append to it."""
        parts = [codec.encode(to_record(g)) for g in list(queued) + list(redeliver)]
        ops = []
        if redeliver:
            ops.append(("got", redeliver))
            ops.append(("redelivered", []))
        ops.append(("base", []))
        for op, gs in ops:
            ids = np.fromiter((g.prompt_id for g in gs), np.int64)
            meta = {"kind": OP_KIND, "op": op, "version": int(version), **{f"c_{k}": int(counters[k]) for k in COUNTERS}}
            parts.append(codec.encode(codec.Sample(arrays={"ids": ids}, meta=meta)))
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
                    _apply(st, rec)
                else:
                    g = from_record(rec)
                    st.queued[g.prompt_id] = g
                    st.counters["put"] += 1  # an op record after it carries the counts whole
            except (codec.CodecError, KeyError) as exc:
                raise CheckpointError(str(self.path), f"journal record unreadable ({exc})", "start the run again", at) from None
        return st


def _apply(st: JournalState, rec: codec.Sample) -> None:
    op = rec["op"]
    ids = [int(i) for i in rec["ids"]]
    if op == "got":
        redeliver = {g.prompt_id: g for g in st.redeliver}
        for pid in ids:
            g = redeliver.pop(pid, None) or st.queued.pop(pid)
            st.unacked[pid] = g
        st.redeliver = [g for g in st.redeliver if g.prompt_id in redeliver]
    elif op == "removed":
        for pid in ids:
            if st.queued.pop(pid, None) is None:
                st.redeliver = [g for g in st.redeliver if g.prompt_id != pid]
    elif op == "acked":
        st.unacked.clear()
    elif op == "redelivered":
        st.redeliver = list(st.unacked.values()) + st.redeliver
        st.unacked.clear()
    elif op not in ("base", "stale"):
        raise KeyError(f"unknown op {op!r}")
    st.version = int(rec["version"])
    st.counters = {k: int(rec[f"c_{k}"]) for k in COUNTERS}
