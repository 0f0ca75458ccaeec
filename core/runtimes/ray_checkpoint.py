"""A ray run's whole checkpoint: the trainer's side and the rollout side, in one directory.

The trainer actor writes ``step-NNNNNN/`` at a due sync, while rollout is paused
(``save_trainer_side``: step, version, learning curve, trained counts, weights, optimizer,
sync times and spans); then the rollout actor adds ``rollout.ckpt`` to it: the queued groups,
the interrupted ones with their partial tokens, those waiting to be generated again, the
Rollouter's and queue's counters, the producer's ledger, each engine's counters and spans,
and the fault log (the driver's too, and which faults fired). Tokens that lived in the object
store by reference are resolved and written in: a resumed run has a new object store.

A checkpoint is whole only once ``rollout.ckpt`` is in it; older checkpoints are pruned
only after that, so a crash between the two writes leaves the previous whole one to resume.
A trainer restarted mid-run still takes the latest checkpoint, whole or not (its own side).

Every time in a checkpoint is run time: seconds since the run started, on the driver's
clock. Each actor knows its own clock's reading at run time 0 (its ``zero``), so a resumed
run's actors, on new clocks, go on from where the stopped run was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from core.model.config import Scenario
from core.model.faults import FaultRecord
from core.runtimes.run_checkpoint import FORMAT, checkpoint_dir, scenario_digest
from core.model.owned import is_owned, remove_owned
from core.store.checkpoint import SHARDS_DIR, CheckpointError, Snapshot, checkpoints, decode, encode, load, prune, read_file, write_atomic

log = logging.getLogger(__name__)

ROLLOUT_FILE = "rollout.ckpt"


def is_whole(path: Path) -> bool:
    return (Path(path) / ROLLOUT_FILE).is_file()


def latest_whole(root: Path) -> Optional[Path]:
    """The newest checkpoint that holds both sides (a newer trainer-only one is skipped)."""
    for path in reversed(checkpoints(root)):
        if is_whole(path):
            return path
        log.info("%s holds the trainer's side only: not resumed", path)
    return None


def save_rollout_side(path: Path, snap: Snapshot, keep: int) -> None:
    """Complete the trainer's checkpoint ``path`` with the rollout side, then prune: the
    newest ``keep`` checkpoints stay, this whole one among them."""
    write_atomic(Path(path) / ROLLOUT_FILE, encode(snap))
    prune(Path(path).parent, keep)


def discard_after(root: Path, path: Optional[Path]) -> None:
    """A resumed run forgets the checkpoints written after the one it resumes (or all, when
    it starts again): a trainer restarted later must not go to a future that never was."""
    for p in checkpoints(root):
        if (path is None or p.name > Path(path).name) and is_owned(p, "checkpoint"):
            log.info("%s: written after the checkpoint resumed; removed", p)
            remove_owned(p, "checkpoint")


@dataclass
class RayResume:
    """What the driver needs of a whole checkpoint to resume from it."""

    path: Path
    clock: float  # run time when it was taken
    sync: Optional[tuple[int, float, float]]  # (version, t0, t1) of the sync to finish, in run time
    fired: list[int]  # faults that fired before it
    driver_faults: list[dict]  # the driver's fault records (the trainer's), in run time


def _fail(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(str(path), problem, "delete this checkpoint to resume from the one before it, or start the run again")


def load_ray_run(run_dir: Path, sc: Scenario, mode: str) -> Optional[RayResume]:
    """The latest whole checkpoint of ``mode`` in ``run_dir``, both sides read and checked
    against this run; None if there is none."""
    sc = sc.with_absolute_paths()  # the actors' scenario, which the checkpoint's digest is of
    path = latest_whole(checkpoint_dir(run_dir, mode))
    if path is None:
        return None
    trainer = load(path)
    rollout = decode(read_file(path / ROLLOUT_FILE), str(path / ROLLOUT_FILE))
    for side, snap in (("trainer", trainer), ("rollout", rollout)):
        st = snap.state
        if st.get("format") != FORMAT or st.get("side") != side:
            raise _fail(path, f"the {side} side holds {st.get('format')!r} side {st.get('side')!r}, not a ray run's {side} side")
        if st.get("scenario") != scenario_digest(sc) or st.get("mode") != mode:
            raise CheckpointError(
                str(path), f"was taken of scenario {st.get('scenario_name')!r} mode {st.get('mode')!r}, not of this run's "
                f"{sc.name!r} mode {mode!r}", "resume the run directory this checkpoint belongs to",
            )
    ts, rs = trainer.state, rollout.state
    sync_t, sync_r = ts.get("sync"), rs.get("sync")
    if (sync_t is None) != (sync_r is None) or (sync_t is not None and sync_t.get("version") != sync_r.get("version")):
        raise _fail(path, f"its sides were taken at different syncs ({sync_t} and {sync_r})")
    if not isinstance(ts.get("trainer"), dict) or ts["trainer"].get("step") is None:
        raise _fail(path, "the trainer side holds no trainer state")
    wanted = [SHARDS_DIR] if sc.learn.sharding == "fsdp2" else ["weights.safetensors", "optimizer.safetensors"]
    for name in wanted:
        if not (path / name).exists():
            raise _fail(path, f"{name} is missing")
    clock = rs.get("clock")
    if not isinstance(clock, (int, float)) or clock < 0:
        raise _fail(path, f"clock = {clock!r} is not a time >= 0")
    f = rs.get("faults", {})
    fired = [i for i in f.get("fired", []) if isinstance(i, int) and 0 <= i < len(sc.faults)]
    try:
        driver = [vars(FaultRecord(**r)) for r in f.get("driver", [])]
    except TypeError:
        raise _fail(path, "faults.driver holds something other than fault records") from None
    point = None if sync_r is None else (int(sync_r["version"]), float(sync_r["t0"]), float(sync_r["t1"]))
    return RayResume(path, float(clock), point, fired, driver)


def load_rollout_side(path: Path) -> Snapshot:
    return decode(read_file(Path(path) / ROLLOUT_FILE), str(Path(path) / ROLLOUT_FILE))
