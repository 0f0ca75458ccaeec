"""Reading a file the user names, whole: only a regular file and only up to a size, so that a
FIFO, a device or a huge file given by mistake is refused at once instead of blocking the
open or the read forever, or filling memory."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class UnreadableFile(Exception):
    """A file that cannot be read whole: what is wrong and how to fix it."""

    def __init__(self, path: Path, problem: str, fix: str) -> None:
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"{path}: {problem}; fix: {fix}")


def read_regular(path: str | Path, max_bytes: int, fix: str, *, follow_links: bool = True) -> bytes:
    """The bytes of ``path``; ``UnreadableFile`` if it is missing, not a regular file, not
    readable or larger than ``max_bytes``. ``fix`` is what to do about a missing or wrong file.
    ``follow_links=False``: a symbolic link at ``path`` is refused, never followed (a file
    asyncrl wrote itself is never one, so a link there points somewhere it should not read)."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    if not follow_links:
        flags |= os.O_NOFOLLOW
    try:
        # Non-blocking: opening a FIFO for reading would otherwise wait for a writer; the
        # descriptor's own stat then decides, so nothing can be swapped in between.
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise UnreadableFile(path, "no such file", fix) from None
    except PermissionError:
        raise UnreadableFile(path, "cannot be read (permission denied)", f"make it readable (chmod u+r), or {fix}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise UnreadableFile(path, "is a symbolic link, which asyncrl does not follow here", fix) from None
        if exc.errno == errno.ENOTDIR:
            raise UnreadableFile(path, "no such file (a part of the path is not a directory)", fix) from None
        raise UnreadableFile(path, f"cannot be opened ({exc.strerror})", fix) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise UnreadableFile(path, "is a directory, not a file", fix)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(path, "is not a regular file (a FIFO, socket or device)", fix)
        if st.st_size > max_bytes:
            raise UnreadableFile(path, f"is {st.st_size:,} bytes, more than the {max_bytes:,} such a file may have", fix)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read()  # sized by the stat above (read(n) would allocate n bytes first)
        except OSError as exc:
            raise UnreadableFile(path, f"cannot be read ({exc.strerror})", fix) from None
    if len(data) > max_bytes:  # it grew since the stat
        raise UnreadableFile(path, f"is more than the {max_bytes:,} bytes such a file may have", fix)
    return data
