"""Run directories: where a run or a sweep writes, claimed only after its input is accepted.

Nothing of the user's is deleted or overwritten:
- ``--out`` that does not exist is created, stamped and written in place, so that its files
  (``metrics.jsonl``, TensorBoard events) can be watched while it runs;
- ``--out`` that holds a finished run (or sweep) asyncrl made is replaced, but only once the new
  one has finished: it is built beside it in a stamped staging directory until then;
- anything else there is the user's, or a run to resume, and is refused;
- a symlink is followed to where it points, and the rules apply there;
- a run holds its directory while it writes, so a second run or resume of it fails at once;
- staging directories and half-written files that killed runs left are removed first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from core.model.owned import Busy, Hold, discard_owned, holder, is_owned, make_owned, remove_owned, remove_stale, stamp
from core.store.checkpoint import PARTIAL

log = logging.getLogger(__name__)


NAME_MAX = 240  # bytes of one name in --out: file systems take 255, and a staging sibling adds 10


class RunDirectoryError(Exception):
    """``--out`` (or ``--resume``) names a directory a run may not write; one line with the fix."""


def _shown(given: Path, target: Path) -> str:
    return str(given) if Path(os.path.abspath(given)) == target else f"{given} (-> {target})"


def _writable_parent(given: Path, target: Path) -> None:
    """The nearest existing ancestor of ``target`` is a directory this process can create in."""
    up = target.parent
    while not up.exists() and not up.is_symlink():
        up = up.parent
    if not up.is_dir():
        raise RunDirectoryError(f"--out {_shown(given, target)}: {up} is not a directory; fix: pass a path under a directory")
    if not os.access(up, os.W_OK | os.X_OK):
        raise RunDirectoryError(f"--out {_shown(given, target)}: {up} is not writable; fix: pass a directory you can write")


def check(given: Path, kind: str, finished: str, *, in_place: bool = False, resume_file: Optional[str] = None) -> Path:
    """Refuse ``given`` as a new run's directory before anything runs, writing nothing; the
    directory the run will end in (symlinks resolved). ``finished``: the file a complete
    ``kind`` directory holds; ``in_place``: the run is written where it stays (checkpoints to
    resume from), so it cannot be built beside an old one; ``resume_file``: the file an
    unfinished but resumable run holds."""
    long = next((part for part in Path(given).parts if len(os.fsencode(part)) > NAME_MAX), None)
    if long is not None:  # refused here, or mkdir would raise ENAMETOOLONG once the run is under way
        raise RunDirectoryError(f"--out {given}: the name {long[:40]}... is longer than {NAME_MAX} bytes; fix: use a shorter one")
    target = Path(os.path.realpath(given))
    where = _shown(given, target)
    if not target.exists():
        _writable_parent(given, target)
        return target
    if not target.is_dir() or not is_owned(target, kind):
        raise RunDirectoryError(f"--out {where}: exists and is not a {kind} directory asyncrl created; fix: pass a new directory")
    pid = holder(target)
    if pid is not None:
        raise RunDirectoryError(f"--out {where}: another asyncrl process (pid {pid}) is writing it; fix: wait for it to end, or pass another directory")
    if not (target / finished).is_file() and resume_file is not None and (target / resume_file).is_file():
        raise RunDirectoryError(f"--out {where}: holds a run that has not finished; fix: --resume {given}, or pass a new directory")
    if in_place:
        raise RunDirectoryError(
            f"--out {where}: holds an earlier {kind}; a run with checkpoints is written where it stays, so it would "
            "replace that one before it finished; fix: pass a new directory"
        )
    _writable_parent(given, target)
    return target


@dataclass
class RunDirectory:
    """A claimed run directory: ``path`` is where the run writes now, ``out`` where it ends."""

    out: Path
    path: Path
    kind: str
    created: bool  # this run made ``out`` (so a failure that leaves nothing to resume removes it)
    holds: list[Hold] = field(default_factory=list)

    @classmethod
    def claim(cls, out: Path, kind: str) -> "RunDirectory":
        """Take ``out`` (as ``check`` returned it) for a new run."""
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out.parent, (kind,))
        try:
            if not out.exists():
                try:
                    out.mkdir()
                except FileExistsError:
                    raise RunDirectoryError(f"--out {out}: another process created it just now; fix: pass another directory") from None
                stamp(out, kind)
                return cls(out, out, kind, created=True, holds=[Hold(out)])
            old = Hold(out)  # held until it is replaced, so no other run replaces or resumes it meanwhile
            staging = make_owned(out.parent, f".{out.name}.", kind)
            return cls(out, staging, kind, created=False, holds=[old, Hold(staging)])
        except Busy as exc:
            raise RunDirectoryError(f"--out {out}: {exc}; fix: wait for it to end, or pass another directory") from None

    @classmethod
    def reopen(cls, out: Path, kind: str) -> "RunDirectory":
        """Take ``out``, a run that stopped, to go on writing it; what a killed writer left
        half-written in it is removed."""
        try:
            hold = Hold(out)
        except Busy as exc:
            raise RunDirectoryError(f"--resume {out}: {exc}; fix: wait for it to end") from None
        for partial in out.rglob(f".*{PARTIAL}"):
            if partial.is_file() and not partial.is_symlink():
                partial.unlink()
        return cls(out, out, kind, created=False, holds=[hold])

    @property
    def in_place(self) -> bool:
        return self.path == self.out

    def commit(self) -> None:
        """The run finished: a staged one takes the place of the one it replaces."""
        if not self.in_place:
            remove_owned(self.out, self.kind)
            self.path.rename(self.out)
            self.path = self.out
        self.release()

    def abandon(self, keep: bool) -> bool:
        """The run failed or was stopped. What it can be resumed from (``keep``) stays; a staged
        or newly made directory with nothing to resume is removed. Whether the directory stays."""
        if not self.in_place:
            discard_owned(self.path, self.kind)
            kept = False
        elif self.created and not keep:
            discard_owned(self.path, self.kind)
            kept = False
        else:
            kept = True
        self.release()
        return kept

    def release(self) -> None:
        for hold in self.holds:
            hold.release()
        self.holds = []


def listing(root: Path, modes: tuple[str, ...], labels: tuple[str, ...] = ()) -> list[str]:
    """The files under ``root``, a run directory, as the closing line names them: a file that
    every mode (every seed, every variant) has, once, as ``<mode>/report.json``; one that only
    some have, by its own path; a checkpoint directory once."""
    groups: dict[str, set[str]] = {}
    axes: dict[str, set[str]] = {"<mode>": set(), "seed-<s>": set(), "<variant>": set()}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        parts = list(rel.parts)
        if "checkpoints" in parts[:-1]:
            parts = parts[: parts.index("checkpoints") + 1]
            parts[-1] += "/"
        elif parts[-1].startswith("events.out.tfevents."):  # TensorBoard names them by time and host
            parts[-1] = "events.out.tfevents.*"
        general = []
        for part in parts[:-1]:
            axis = "<mode>" if part in modes else "seed-<s>" if _is_seed(part) else "<variant>" if part in labels else None
            if axis is not None:
                axes[axis].add(part)
            general.append(axis or part)
        groups.setdefault("/".join([*general, parts[-1]]), set()).add("/".join(parts))
    names = []
    for general, concrete in groups.items():
        every = 1
        for axis, seen in axes.items():
            every *= len(seen) if axis in general.split("/") else 1
        names += [general] if len(concrete) == every and every > 1 else sorted(concrete)
    return sorted(names)


def _is_seed(part: str) -> bool:
    return part.startswith("seed-") and part[5:].isdigit()
