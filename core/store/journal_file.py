"""An append-only file of length-framed records: what every write-ahead journal in asyncrl
writes (the LLM queue's, the env replay's).

Appends are flushed, not fsynced: a journal survives the death of its writer's process, not of
the machine. Reading it back stops before a torn last record (a write the crash cut short).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

FRAME = struct.Struct("<Q")


class JournalFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self.records = 0

    def append(self, data: bytes) -> None:
        self._f.write(FRAME.pack(len(data)) + data)
        self._f.flush()
        self.records += 1

    def reopen(self) -> None:
        """Append again after the file was replaced whole (``write_atomic``)."""
        self._f.close()
        self._f = open(self.path, "ab")

    def close(self) -> None:
        self._f.close()

    def read(self) -> Iterator[tuple[int, memoryview]]:
        """(byte offset, body) of every whole record, in order."""
        self._f.flush()
        data = memoryview(self.path.read_bytes())
        at, n = 0, len(data)
        while n - at >= FRAME.size:
            (length,) = FRAME.unpack_from(data, at)
            if length > n - at - FRAME.size:
                break
            yield at, data[at + FRAME.size : at + FRAME.size + length]
            at += FRAME.size + length
