"""Removing a directory only when asyncrl wrote it: the one gate every replacement of a run,
sweep or model directory goes through."""

from __future__ import annotations

import shutil
from pathlib import Path


class NotOwned(RuntimeError):
    """A directory asyncrl would replace does not carry asyncrl's stamp: it is the user's."""


def remove_owned(path: Path, stamps: tuple[str, ...]) -> None:
    """Remove ``path`` if it holds one of ``stamps`` (files asyncrl writes into its own
    directories); leave a missing path alone; refuse anything else."""
    if not path.exists():
        return
    if not path.is_dir() or not any((path / s).is_file() for s in stamps):
        raise NotOwned(f"{path}: not written by asyncrl (none of {', '.join(stamps)} in it); refusing to remove it")
    shutil.rmtree(path)
