"""Directories asyncrl creates are stamped, and only a stamped directory is ever removed: the
one gate every removal in asyncrl goes through (the only ``shutil.rmtree`` in the code).

A stamp is a file, ``STAMP``, that asyncrl writes into a directory the moment it creates it,
naming what the directory is for (``kind``: a run, a sweep, a checkpoint, ...). A user's
directory does not have it, whatever else it holds (a ``summary.json`` of the user's own, say),
so asking to remove it is refused. The stamp also names the process that made it (host and
pid), so a staging directory that a killed process left behind can be told from one that a
live process is still filling (``remove_stale``). When a run (or sweep) finishes, its stamp is
rewritten to list every file and directory in it (``record_contents``): replacing it later
removes only those, and anything else found there stops the replacement (``unlisted``,
``remove_finished``).

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
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

from core.model.bounded_parse import loads_json
from core.model.regular_file import UnreadableFile, read_regular

log = logging.getLogger(__name__)

STAMP = ".asyncrl-owned"
LOCK = ".asyncrl-lock"
_OWNER = "asyncrl"
# A stamp lists a finished run's files: a few thousand names, far below this.
MAX_STAMP_BYTES = 64 << 20


class NotOwned(RuntimeError):
    """A directory asyncrl would replace does not carry asyncrl's stamp: it is the user's."""


class Busy(RuntimeError):
    """Another live process is writing the directory."""


class LockUnusable(RuntimeError):
    """The lock file cannot be opened as one (a symbolic link, a directory, unwritable)."""


def _pid_in(fd: int) -> str:
    """The pid a ``Hold`` wrote into its lock file."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


class Hold:
    """An exclusive hold on a directory for as long as this process writes it, so a second run
    or resume of it fails at once. The kernel drops the hold when the process ends, however it
    ends: a killed run leaves nothing to clean up."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        lock = self.path / LOCK
        try:
            self._fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as exc:
            what = "is a symbolic link, which asyncrl never follows" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
            raise LockUnusable(f"{lock} {what}") from None
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):  # a FIFO or device of that name
            os.close(self._fd)
            raise LockUnusable(f"{lock} is not a regular file")
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


def _is_marker(name: str) -> bool:
    """A name asyncrl keeps at the top of a directory it owns, not part of what it holds."""
    return name in (STAMP, LOCK) or (name.startswith(f".{STAMP}.") and name.endswith(".partial"))


def contents(path: Path) -> dict[str, str]:
    """Every entry under ``path`` (its relative path: "file", "dir", "link" or "other"), the
    stamp and lock at its top left out. Links are not followed."""
    root = Path(path)
    out: dict[str, str] = {}
    todo = [root]
    while todo:
        here = todo.pop()
        try:
            with os.scandir(here) as it:
                entries = list(it)
        except OSError:
            if here == root:
                raise
            out[os.path.relpath(here, root)] = "unreadable"  # what it holds is unknown: never listed
            continue
        for e in entries:
            if here == root and _is_marker(e.name):
                continue
            if e.is_symlink():
                kind = "link"
            elif e.is_dir(follow_symlinks=False):
                kind = "dir"
                todo.append(Path(e.path))
            elif e.is_file(follow_symlinks=False):
                kind = "file"
            else:
                kind = "other"
            out[os.path.relpath(e.path, root)] = kind
    return out


def record_contents(path: Path) -> None:
    """``path`` is finished: its stamp is rewritten (whole, by rename) to list what it holds
    now, all of it written by asyncrl, so that a later replacement removes only that. A
    directory without asyncrl's stamp is left unstamped (never to be removed)."""
    path = Path(path)
    data = _mark(path)
    if data is None:
        log.warning("%s: has no asyncrl stamp, so what it holds is not recorded; it will never be replaced", path)
        return
    data["contents"] = dict(sorted(contents(path).items()))
    data["finished"] = time.time()
    fd, tmp = tempfile.mkstemp(prefix=f".{STAMP}.", suffix=".partial", dir=path)
    try:
        os.fchmod(fd, umask_mode(0o666))
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / STAMP)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def unlisted(path: Path) -> tuple[Optional[str], bool]:
    """(the first entry under ``path`` that its stamp does not list as asyncrl's, by relative
    path, or None; whether the stamp lists anything). Without a list (a run that never
    finished, or one from before stamps listed their contents) every entry but a directory
    counts, as nothing tells asyncrl's files from the user's."""
    data = _mark(path) or {}
    listed = data.get("contents")
    listed = listed if isinstance(listed, dict) else None
    for rel, kind in sorted(contents(path).items()):
        if listed is None:
            if kind != "dir":
                return rel, False
        elif listed.get(rel) != kind:
            return rel, True
    return None, listed is not None


def remove_finished(path: Path, kind: str) -> None:
    """Remove ``path``, a finished ``kind`` directory asyncrl created, to replace it; refuse
    (``NotOwned``, naming the entry) if it holds anything its stamp does not list."""
    if Path(path).is_dir() and not Path(path).is_symlink():
        rel, _ = unlisted(path)
        if rel is not None:
            raise NotOwned(f"{Path(path) / rel}: not written by asyncrl; refusing to remove {path}")
    remove_owned(path, kind)


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
    try:
        # Never a link (whatever it points at is not a stamp asyncrl wrote here), a FIFO or a
        # directory of that name; nesting bounded, as any JSON asyncrl reads.
        data = loads_json(read_regular(Path(path) / STAMP, MAX_STAMP_BYTES, "", follow_links=False))
    except (UnreadableFile, ValueError):
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
