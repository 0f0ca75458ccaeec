"""A whole run's checkpoint: every component's state, captured at a weight sync while
rollout is paused, and restored into a freshly connected system.

At that point nothing is generating: ``wait`` drained it, ``abort`` moved it to the
cancel queue with its partial tokens. The checkpoint therefore holds the queued groups,
the interrupted ones (partial generations), those waiting to be generated again after a
worker died, the trainer's counters and (real runtimes) its weights and optimizer, the
ledger, the clock, and which faults have fired. A resumed run finishes the sync the
checkpoint was taken in, then goes on as the original did.

A trainer restarted after a kill takes only its own side back: step, version, the
ledger's trained counts, weights and optimizer. What it was given since is redelivered
by the queue, which kept it unacknowledged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Optional

from core.api import TrainBackend
from core.model.config import Scenario
from core.model.faults import FaultLog
from core.model.ledger import Ledger
from core.pipeline.trainer import Trainer
from core.pipeline.wiring import System
from core.store.checkpoint import CheckpointError, Snapshot, latest, load, load_tensors, save

log = logging.getLogger(__name__)

FORMAT = "asyncrl.run/1"


def scenario_digest(sc: Scenario) -> str:
    """Identifies a scenario: a checkpoint resumes only the run it was taken of."""
    return hashlib.sha256(sc.model_dump_json().encode()).hexdigest()[:16]


def checkpoint_dir(run_dir: Path, mode: str) -> Path:
    return Path(run_dir) / mode / "checkpoints"


def due(sc: Scenario, version: int) -> bool:
    every = sc.checkpoint.every
    return bool(every) and version % every == 0


def capture(system: System, version: int, t0: float, t1: float, at_start: bool = False) -> Snapshot:
    """The run's state inside the sync to ``version``, after the pause (t0: the sync began,
    t1: rollout stopped), or ``at_start``, before anything ran."""
    sc, tr, ro, q = system.scenario, system.trainer, system.rollouter, system.queue
    ps = system.param_sync
    state = {
        "format": FORMAT,
        "scenario": scenario_digest(sc),
        "scenario_name": sc.name,
        "mode": system.mode,
        "clock": asyncio.get_running_loop().time(),
        "sync": None if at_start else {"version": version, "t0": t0, "t1": t1},
        "trainer": tr.state(),
        "param_sync": {"pause_s": ps.pause_s, "drain_s": ps.drain_s, "transfer_s": ps.transfer_s},
        "ledger": system.ledger.state(),
        "timeline": {w: rows for w, rows in system.timeline.spans.items()},
        "rollouter": ro.state(),
        "queue": {"version": q.version, "counters": q.counters()},
        "engines": [e.state() for e in system.engines],
        "backend": {"compute_s": system.train_backend.compute_s, "flops": system.train_backend.flops},
        "faults": {"fired": sorted(system.plan.fired), "records": system.faults.state()},
    }
    snap = Snapshot(state=state)
    snap.groups["queued"] = q.contents()
    snap.groups["interrupted"] = list(ro.cancel_queue)
    snap.groups["retry"] = list(ro.retry_queue)
    snap.groups["holding"] = list(tr.holding.groups)
    return snap


def save_run(system: System, version: int, t0: float, t1: float, at_start: bool = False) -> Optional[Path]:
    """Checkpoint the run if ``version`` is due and nothing is mid-recovery; then the queue
    forgets what the trainer has trained (acknowledged). ``at_start``: the checkpoint a
    trainer killed before its first sync goes back to."""
    sc = system.scenario
    if system.run_dir is None or not (at_start or due(sc, version)):
        return None
    ro = system.rollouter
    if ro.recovering() or system.queue.is_down():
        log.info("checkpoint at version %d skipped: a component is being restarted", version)
        return None
    snap = capture(system, version, t0, t1, at_start)
    tensors = system.train_backend.state_dict() or None
    path = save(checkpoint_dir(system.run_dir, system.mode), system.trainer.step, snap, tensors, keep=sc.checkpoint.keep)
    system.queue.ack()
    return path


def _check(snap: Snapshot, sc: Scenario, mode: str, where: str) -> None:
    st = snap.state
    if st.get("side") == "trainer":
        raise CheckpointError(where, "holds the trainer's side only (a ray run's)", "resume a sim or local run directory")
    if st.get("format") != FORMAT:
        raise CheckpointError(where, f"holds {st.get('format')!r}, not a run checkpoint ({FORMAT})", "pass a run directory that asyncrl wrote")
    if st.get("scenario") != scenario_digest(sc) or st.get("mode") != mode:
        raise CheckpointError(
            where, f"was taken of scenario {st.get('scenario_name')!r} mode {st.get('mode')!r} "
            f"(digest {st.get('scenario')}), not of this run's {sc.name!r} mode {mode!r} (digest {scenario_digest(sc)})",
            "resume the run directory this checkpoint belongs to",
        )


def load_run(run_dir: Path, sc: Scenario, mode: str) -> Optional[tuple[Path, Snapshot]]:
    """The latest checkpoint of ``mode`` in ``run_dir``, checked against ``sc``; None if none."""
    path = latest(checkpoint_dir(run_dir, mode))
    if path is None:
        return None
    snap = load(path)
    _check(snap, sc, mode, str(path))
    if sc.runtime != "sim":
        for stem in ("weights", "optimizer"):
            if not (path / f"{stem}.safetensors").is_file():
                raise CheckpointError(str(path), f"{stem}.safetensors is missing", "resume from a complete checkpoint")
    return path, snap


def restore(system: System, path: Path, snap: Snapshot) -> Optional[tuple[int, float, float]]:
    """Put a fresh system back in the state of ``snap``; returns the sync to finish
    (version, t0, t1), None for the checkpoint taken at the start. Raises ``CheckpointError`` if the state does not fit the system."""
    try:
        return _restore(system, path, snap)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(str(path), f"state does not fit this run ({type(exc).__name__}: {exc})", "start the run again") from None


def _restore(system: System, path: Path, snap: Snapshot) -> Optional[tuple[int, float, float]]:
    st = snap.state
    loop = asyncio.get_running_loop()
    loop.set_time(st["clock"])  # the virtual clock and the local runtime's real one both go on from it
    tr, ro, ps = system.trainer, system.rollouter, system.param_sync
    tr.restore(st["trainer"], snap.groups["holding"])
    p = st["param_sync"]
    ps.pause_s, ps.drain_s, ps.transfer_s = p["pause_s"], p["drain_s"], p["transfer_s"]
    system.ledger.restore(st["ledger"])
    system.timeline.spans.clear()
    for w, rows in st["timeline"].items():
        system.timeline.spans[w] = rows
    r = st["rollouter"]
    # Restored inside a sync: the sync's end resumes it.
    ro.restore(r, snap.groups["interrupted"], snap.groups["retry"], paused=st["sync"] is not None)
    if len(system.engines) != len(st["engines"]):
        raise ValueError(f"{len(st['engines'])} engine states for {len(system.engines)} engines")
    for e, es in zip(system.engines, st["engines"]):
        e.restore(es)
    q = st["queue"]
    system.queue.restore(q["version"], snap.groups["queued"], q["counters"])
    be = system.train_backend
    be.compute_s, be.flops = st["backend"]["compute_s"], st["backend"]["flops"]
    _load_backend(be, path)
    f = st["faults"]
    system.plan.fired.update(f["fired"])
    system.faults.records[:] = FaultLog.from_state(f["records"]).records
    s = st["sync"]
    return None if s is None else (s["version"], s["t0"], s["t1"])


def restore_trainer(system: System) -> None:
    """A restarted trainer takes its own side of the latest checkpoint back; the queue gives
    it again whatever it had been given since."""
    restore_trainer_side(system.trainer, system.ledger, system.train_backend, system.run_dir, system.mode)
    system.queue.redeliver()


def restore_trainer_side(trainer: Trainer, ledger: Ledger, backend: TrainBackend, run_dir: Path, mode: str) -> None:
    """Step, version and the learning curve, the ledger's trained counts, weights and
    optimizer, from the latest checkpoint of ``mode`` (whole-run or trainer-side)."""
    found = latest(checkpoint_dir(run_dir, mode))
    if found is None:
        raise RuntimeError("the trainer died before its first checkpoint; fix: checkpoint.every: 1")
    st = load(found).state
    trainer.restore(st["trainer"], [], wait_s=False)
    ledger.restore(st["ledger"], fields=ledger.TRAINED_FIELDS)
    _load_backend(backend, found)


def _load_backend(backend: TrainBackend, path: Path) -> None:
    """The backend's tensors (a real one's weights and optimizer; the sim's has none)."""
    backend.load({stem: load_tensors(path, stem) for stem in backend.tensor_files})


def save_trainer_side(
    sc: Scenario, mode: str, run_dir: Path, trainer: Trainer, ledger: Ledger, backend: TrainBackend, version: int,
    at_start: bool = False,
) -> Optional[Path]:
    """The trainer's side alone (the ray runtime, where the rollout side lives in another
    process and keeps going while the trainer restarts)."""
    if not (at_start or due(sc, version)):
        return None
    state = {
        "format": FORMAT,
        "side": "trainer",
        "scenario": scenario_digest(sc),
        "scenario_name": sc.name,
        "mode": mode,
        "sync": None if at_start else {"version": version},
        "trainer": trainer.state(),
        "ledger": ledger.state(),
    }
    tensors = backend.state_dict() or None
    return save(checkpoint_dir(run_dir, mode), trainer.step, Snapshot(state=state), tensors, keep=sc.checkpoint.keep)


def restore_latest(system: System) -> Optional[tuple[int, float, float]]:
    """Restore ``system`` from its run directory's latest checkpoint; the sync to finish."""
    found = load_run(system.run_dir, system.scenario, system.mode)
    if found is None:
        return None
    return restore(system, *found)
