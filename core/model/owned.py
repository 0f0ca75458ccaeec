"""Directories asyncrl creates are stamped, and only a stamped directory is ever removed: the
one gate every removal in asyncrl goes through (the only ``shutil.rmtree`` in the code).

A stamp is a file, ``STAMP``, that asyncrl writes into a directory the moment it creates it,
naming what the directory is for (``kind``: a run, a sweep, a checkpoint, ...). A user's
directory does not have it, whatever else it holds (a ``summary.json`` of the user's own, say),
so asking to remove it is refused. The stamp also names the process that made it (host and
pid), so a staging directory that a killed process left behind can be told from one that a
live process is still filling (``remove_stale``).

What asyncrl creates is readable as the user's umask says: ``tempfile`` makes directories 0700
and files 0600 whatever the umask, so those are given the umask's modes (``umask_mode``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

STAMP = ".asyncrl-owned"
LOCK = ".asyncrl-lock"
_OWNER = "asyncrl"


class NotOwned(RuntimeError):
    """A directory asyncrl would replace does not carry asyncrl's stamp: it is the user's."""


class Busy(RuntimeError):
    """Another live process is writing the directory."""


def _pid_in(fd: int) -> str:
    """The pid a ``Hold`` wrote into its lock file."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


class Hold:
    """An exclusive hold on a directory for as long as this process writes it, so a second run
    or resume of it fails at once. The kernel drops the hold when the process ends, however it
    ends: a killed run leaves nothing to clean up."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _pid_in(self._fd)
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise Busy(f"another asyncrl process (pid {holder}) is writing {self.path}") from None
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def holder(path: Path) -> str | None:
    """The pid of the live process holding ``path`` (a ``Hold``), or None; writes nothing."""
    try:
        fd = os.open(Path(path) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # no lock file: nobody has held it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return _pid_in(fd)
    finally:
        os.close(fd)  # closing drops a hold this call took
    return None


def _read_umask() -> int:
    try:  # Linux 4.7+: read without setting it, which os.umask cannot do
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(full: int) -> int:
    """The mode a new file (``full`` 0o666) or directory (0o777) gets under the user's umask."""
    return full & ~_read_umask()


def stamp(path: Path, kind: str) -> None:
    """Mark ``path``, a directory asyncrl has just created, as asyncrl's ``kind``, made by this
    process."""
    mark = {"owner": _OWNER, "kind": kind, "id": uuid.uuid4().hex, "host": socket.gethostname(),
            "pid": os.getpid(), "created": time.time()}
    (Path(path) / STAMP).write_text(json.dumps(mark) + "\n")


def make_owned(parent: Path, prefix: str, kind: str) -> Path:
    """A new, stamped directory under ``parent`` (named ``prefix`` + random letters)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, umask_mode(0o777))
    stamp(path, kind)
    return path


def keep_owned(path: Path, kind: str) -> Path:
    """``path``, a directory of a fixed name inside one asyncrl owns: created and stamped as
    ``kind`` unless it is already there (a run that resumes finds its own)."""
    path = Path(path)
    if not path.exists():
        path.mkdir()
        stamp(path, kind)
    return path


def _mark(path: Path) -> dict | None:
    """The stamp's contents, or None if ``path`` has no stamp asyncrl wrote."""
    mark = Path(path) / STAMP
    try:
        if not mark.is_file():  # not a FIFO or a directory of that name
            return None
        with mark.open("rb") as f:
            data = json.loads(f.read(1024))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("owner") == _OWNER else None


def is_owned(path: Path, kind: str) -> bool:
    """``path`` is a directory asyncrl created as ``kind`` (its stamp says so)."""
    data = _mark(path)
    return data is not None and data.get("kind") == kind


def _maker_gone(data: dict) -> bool:
    """The process that stamped the directory has ended (it was on this host). A pid reused
    by another process reads as alive, so the doubt leaves the directory where it is."""
    pid = data.get("pid")
    if data.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False


def remove_stale(parent: Path, kinds: tuple[str, ...]) -> list[Path]:
    """Remove the staging directories (``.name.*``, stamped as one of ``kinds``) that killed
    processes left in ``parent``; the ones removed. Only these: a live process's staging
    directory, a finished directory and anything unstamped are left alone."""
    removed = []
    try:
        entries = [p for p in Path(parent).iterdir() if p.name.startswith(".") and not p.is_symlink() and p.is_dir()]
    except OSError:
        return removed
    for path in entries:
        data = _mark(path)
        if data is None or data.get("kind") not in kinds or not _maker_gone(data):
            continue
        try:
            remove_owned(path, data["kind"])
        except (NotOwned, OSError) as exc:
            log.warning("could not remove %s, left by a process that ended: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.warning("removed %d staging director%s left by killed runs: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(str(p) for p in removed))
    return removed


def remove_owned(path: Path, kind: str) -> None:
    """Remove ``path`` if asyncrl created it as ``kind``; leave a missing path alone; refuse
    anything else."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not is_owned(path, kind):
        raise NotOwned(f"{path}: not a {kind} directory asyncrl created (no {STAMP} stamp of that kind); refusing to remove it")
    shutil.rmtree(path)


def discard_owned(path: Path, kind: str) -> None:
    """Clean up after a failure: remove ``path`` if asyncrl created it as ``kind``, else leave
    it; never raises, so the failure being handled is the one reported."""
    try:
        remove_owned(path, kind)
    except (NotOwned, OSError):
        pass
