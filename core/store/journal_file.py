"""An append-only file of length-framed records: what every write-ahead journal in asyncrl
writes (the LLM queue's, the tool calls', the env replay's).

Appends are flushed, not fsynced: a journal survives the death of its writer's process, not of
the machine. Reading it back stops before a torn last record (a write the crash cut short).
A journal is the run's own file: it is never opened through a symbolic link (a resumed run
would append to whatever the link names), and never unless it is a regular file (a FIFO would
block the open or the read).
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from typing import BinaryIO, Iterator

FRAME = struct.Struct("<Q")
_NOT_LINKS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path, append: bool) -> BinaryIO:
    """``path`` opened to append (created if missing) or to read, never through a link and only
    if it is a regular file; ``OSError`` otherwise (ELOOP for a link)."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT if append else os.O_RDONLY) | _NOT_LINKS
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab" if append else "rb")
    except BaseException:
        os.close(fd)
        raise


def frames(f: BinaryIO, size: int) -> Iterator[tuple[int, memoryview]]:
    """(byte offset, body) of every whole record of the ``size`` bytes of ``f``, in order,
    read one record at a time: a first bad record is seen without reading the rest."""
    at = 0
    while size - at >= FRAME.size:
        head = f.read(FRAME.size)
        if len(head) < FRAME.size:
            return  # the file shrank while it was read
        (length,) = FRAME.unpack(head)
        if length > size - at - FRAME.size:
            return  # torn: the write a crash cut short
        body = f.read(length)
        if len(body) < length:
            return  # the file shrank while it was read
        yield at, memoryview(body)
        at += FRAME.size + length


class JournalFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open_regular(self.path, append=True)
        self.records = 0

    def append(self, data: bytes) -> None:
        self._f.write(FRAME.pack(len(data)) + data)
        self._f.flush()
        self.records += 1

    def reopen(self) -> None:
        """Append again after the file was replaced whole (``write_atomic``)."""
        self._f.close()
        self._f = open_regular(self.path, append=True)

    def close(self) -> None:
        self._f.close()

    def read(self) -> Iterator[tuple[int, memoryview]]:
        """(byte offset, body) of every whole record, in order."""
        self._f.flush()
        with open_regular(self.path, append=False) as f:
            yield from frames(f, os.fstat(f.fileno()).st_size)
