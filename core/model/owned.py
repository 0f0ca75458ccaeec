"""Directories asyncrl creates are stamped, and only a stamped directory is ever removed: the
one gate every removal in asyncrl goes through (the only ``shutil.rmtree`` in the code).

A stamp is a file, ``STAMP``, that asyncrl writes into a directory the moment it creates it,
naming what the directory is for (``kind``: a run, a sweep, a checkpoint, ...). A user's
directory does not have it, whatever else it holds (a ``summary.json`` of the user's own, say),
so asking to remove it is refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

STAMP = ".asyncrl-owned"
_OWNER = "asyncrl"


class NotOwned(RuntimeError):
    """A directory asyncrl would replace does not carry asyncrl's stamp: it is the user's."""


def stamp(path: Path, kind: str) -> None:
    """Mark ``path``, a directory asyncrl has just created, as asyncrl's ``kind``."""
    (Path(path) / STAMP).write_text(json.dumps({"owner": _OWNER, "kind": kind}) + "\n")


def make_owned(parent: Path, prefix: str, kind: str) -> Path:
    """A new, stamped directory under ``parent`` (named ``prefix`` + random letters)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
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


def is_owned(path: Path, kind: str) -> bool:
    """``path`` is a directory asyncrl created as ``kind`` (its stamp says so)."""
    mark = Path(path) / STAMP
    try:
        if not mark.is_file():  # not a FIFO or a directory of that name
            return False
        with mark.open("rb") as f:
            data = json.loads(f.read(256))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("owner") == _OWNER and data.get("kind") == kind


def replaceable(path: Path, kind: str, finished: str) -> bool:
    """``path`` is missing, or is a directory (not a link) asyncrl created as ``kind`` whose
    ``finished`` file says it is complete: what a new run or sweep may take the place of."""
    path = Path(path)
    if path.is_symlink():
        return False
    return not path.exists() or (is_owned(path, kind) and (path / finished).is_file())


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
