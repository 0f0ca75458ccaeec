"""Run directories: where a run or a sweep writes, claimed only after its input is accepted.

Nothing of the user's is deleted or overwritten:
- ``--out`` that does not exist is created, stamped and written in place, so that its files
  (``metrics.jsonl``, TensorBoard events) can be watched while it runs;
- ``--out`` that holds a finished run (or sweep) asyncrl made is replaced, but only once the new
  one has finished: it is built beside it in a stamped staging directory until then; and only
  if it holds nothing but what its stamp lists as written by asyncrl when it finished;
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

from core.model.owned import (
    LOCK, STAMP, Busy, Hold, LockUnusable, NotOwned, discard_owned, holder, is_owned, make_owned, record_contents, remove_finished,
    remove_stale, stamp, unlisted,
)
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
    _check_replaceable(given, target, kind)
    _writable_parent(given, target)
    return target


def _check_replaceable(given: Path, target: Path, kind: str) -> None:
    """Replacing ``target`` removes only what asyncrl wrote there: an entry its stamp does not
    list (a file the user put there since) refuses it, naming the entry."""
    where = _shown(given, target)
    check_markers(target, "--out")
    try:
        rel, listed = unlisted(target)
    except OSError as exc:
        raise RunDirectoryError(f"--out {where}: cannot be read ({exc.strerror}); fix: pass a new directory") from None
    if rel is None:
        return
    if listed:
        raise RunDirectoryError(
            f"--out {where}: holds {target / rel}, which the earlier {kind} did not write (its {STAMP} lists what it did), "
            f"and replacing that {kind} would delete it; fix: move it out of {target}, or pass a new directory"
        )
    raise RunDirectoryError(
        f"--out {where}: holds {target / rel}, and no list of the files asyncrl wrote there (a {kind} that never finished, "
        f"or one from before asyncrl kept that list), so replacing it could delete a file of yours; "
        f"fix: remove {target} yourself once nothing in it is yours, or pass a new directory"
    )


def check_markers(path: Path, flag: str = "--resume") -> None:
    """The stamp and the lock of ``path``, a run directory to write again, are regular files
    where present: a link there is refused, never followed."""
    other = "start the run again" if flag == "--resume" else "pass a new directory"
    for name in (STAMP, LOCK):
        marker = path / name
        if marker.is_symlink():
            raise RunDirectoryError(f"{flag} {path}: {marker} is a symbolic link, which asyncrl never follows; "
                                    f"fix: remove the link (asyncrl writes that file itself), or {other}")
        if marker.exists() and not marker.is_file():
            raise RunDirectoryError(f"{flag} {path}: {marker} is not a regular file; "
                                    f"fix: remove it (asyncrl writes that file itself), or {other}")


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
        except LockUnusable as exc:
            raise RunDirectoryError(f"--out {out}: {exc}; fix: remove it (asyncrl writes that file itself), or pass another directory") from None

    @classmethod
    def reopen(cls, out: Path, kind: str) -> "RunDirectory":
        """Take ``out``, a run that stopped, to go on writing it; what a killed writer left
        half-written in it is removed."""
        check_markers(out)
        try:
            hold = Hold(out)
        except Busy as exc:
            raise RunDirectoryError(f"--resume {out}: {exc}; fix: wait for it to end") from None
        except LockUnusable as exc:
            raise RunDirectoryError(f"--resume {out}: {exc}; fix: remove it (asyncrl writes that file itself)") from None
        for partial in out.rglob(f".*{PARTIAL}"):
            if partial.is_file() and not partial.is_symlink():
                partial.unlink()
        return cls(out, out, kind, created=False, holds=[hold])

    @property
    def in_place(self) -> bool:
        return self.path == self.out

    def commit(self) -> None:
        """The run finished: its stamp lists what it wrote, and a staged one takes the place of
        the one it replaces, unless a file of the user's appeared in that one while it ran: then
        both stay, the new one beside it under a name of its own."""
        record_contents(self.path)
        if not self.in_place:
            try:
                remove_finished(self.out, self.kind)
            except NotOwned as exc:
                aside = _free_name(self.out)
                self.path.rename(aside)
                log.warning("%s; the new %s is in %s instead", exc, self.kind, aside)
                self.path = aside
                self.release()
                return
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


def _free_name(out: Path) -> Path:
    """``out`` with the first suffix ``-new``, ``-new2``, ... that names nothing yet."""
    n = 1
    while True:
        aside = out.with_name(f"{out.name}-new{n if n > 1 else ''}")
        if not aside.exists() and not aside.is_symlink():
            return aside
        n += 1


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
