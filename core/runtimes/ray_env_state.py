"""What an async env run keeps on disk beside its actors (``core/runtimes/ray_env.py``): the
directories of the learner's checkpoints and the store's journal (kept in the run's own
directory, or created and removed by asyncrl), and the driver's own state for a resume."""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from core.env import learner_checkpoint
from core.env.wiring import JOURNAL_KIND
from core.model.owned import discard_owned, keep_owned, make_owned, remove_owned, remove_stale
from core.store import checkpoint

DRIVER_FILE = "driver.ckpt"
# Sampler seeds after a resume: far from those of in-run restarts, so no two incarnations share one.
RESUMED_INCARNATION = 1_000


@dataclass
class DriverState:
    """What the driver of an async run must carry over a resume: its clock, its evaluations so
    far and its fault bookkeeping (the parts carry their own in journals and checkpoints)."""

    elapsed_s: float = 0.0
    next_eval: int = 0
    fired: list[int] = field(default_factory=list)
    fault_records: list[dict] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)
    learner_restarts: int = 0
    resumes: int = 0
    evaluations_lost: int = 0
    eval_env_steps: list[int] = field(default_factory=list)
    eval_wall_s: list[float] = field(default_factory=list)
    eval_return: list[float] = field(default_factory=list)


_SERIES = ("eval_env_steps", "eval_wall_s", "eval_return")


def write_driver(path: Path, d: DriverState) -> None:
    state = {k: v for k, v in asdict(d).items() if k not in _SERIES}
    arrays = {k: np.asarray(getattr(d, k), np.float64) for k in _SERIES}
    checkpoint.write_atomic(path, checkpoint.encode(checkpoint.Snapshot(state=state, arrays=arrays)))


def check_resume(workdir: Path) -> None:
    """Read what a run in ``workdir`` would resume from (the learner's latest checkpoint, the
    driver's state), so that a resume refuses one it cannot use before anything runs."""
    learner_checkpoint.check(Path(workdir) / "checkpoints")
    read_driver(Path(workdir) / DRIVER_FILE)


def read_driver(path: Path) -> DriverState:
    """The driver's state (``CheckpointError`` if unreadable); a fresh one if the run stopped
    before it first wrote one."""
    if not path.exists():
        return DriverState()
    snap = checkpoint.decode(checkpoint.read_file(path), str(path))
    try:
        return DriverState(
            **snap.state, eval_env_steps=[int(x) for x in snap.arrays["eval_env_steps"]],
            eval_wall_s=snap.arrays["eval_wall_s"].tolist(), eval_return=snap.arrays["eval_return"].tolist(),
        )
    except (TypeError, KeyError) as exc:
        raise checkpoint.CheckpointError(str(path), f"not an env driver's state ({exc})", "start the run again") from None


class RunFiles:
    """The directories of one async run. ``keep`` (a ``workdir`` and ``checkpoint.every``): in
    ``workdir``, where a resume finds them; otherwise directories asyncrl creates (under
    ``workdir``, or the system's temporary directory) and removes at the end, whatever happens."""

    def __init__(self, workdir: Optional[Path], keep: bool) -> None:
        self.workdir, self.keep = workdir, keep
        self.driver_file = Path(workdir) / DRIVER_FILE if keep else None
        self.scratch: list[tuple[Path, str]] = []  # removed at the end, whatever happens

    def place(self, name: str, kind: str) -> Path:
        if not self.keep:
            root = Path(self.workdir or tempfile.gettempdir())
            remove_stale(root, (kind,))  # what killed runs left there
            d = make_owned(root, f".asyncrl-{name}-", kind)
            self.scratch.append((d, kind))
            return d
        return keep_owned(Path(self.workdir) / name, kind)

    def resumed(self, learner_dir: Optional[Path]) -> Optional[DriverState]:
        """The driver's state to go on from, once the learner has a checkpoint in ``learner_dir``;
        None to start afresh (what a run stopped before its first checkpoint left is removed)."""
        if self.keep and checkpoint.latest(learner_dir) is not None:
            return read_driver(self.driver_file)
        if self.keep:
            remove_owned(Path(self.workdir) / "store", JOURNAL_KIND)
            self.driver_file.unlink(missing_ok=True)
        return None

    def save(self, d: DriverState) -> None:
        if self.driver_file is not None:
            write_driver(self.driver_file, d)

    def close(self, finished: bool) -> None:
        for path, kind in self.scratch:
            discard_owned(path, kind)
        if self.keep and finished:  # the journal is the size of everything taken; the last checkpoint stays
            remove_owned(Path(self.workdir) / "store", JOURNAL_KIND)
            self.driver_file.unlink(missing_ok=True)
