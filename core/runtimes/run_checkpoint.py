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
import base64
import binascii
import dataclasses
import hashlib
import logging
import math
from pathlib import Path
from typing import Optional

from core.api import TrainBackend
from core.model.config import Placement, Scenario, shown
from core.model.faults import FaultLog, FaultRecord
from core.model.ledger import Ledger
from core.pipeline.wiring import System
from core.runtimes.run_state import RolloutSide, TrainerSide
from core.store.checkpoint import CORRUPT_FIX, SHARDS_DIR, STATE_FILE, CheckpointError, Snapshot, latest, load, load_tensors, save

log = logging.getLogger(__name__)

FORMAT = "asyncrl.run/1"


def scenario_digest(sc: Scenario) -> str:
    """Identifies a scenario: a checkpoint resumes only the run it was taken of."""
    return hashlib.sha256(sc.model_dump_json().encode()).hexdigest()[:16]


def checkpoint_dir(run_dir: Path, mode: str) -> Path:
    return Path(run_dir) / mode / "checkpoints"


def header(sc: Scenario, mode: str, sync: Optional[dict], side: Optional[str] = None) -> dict:
    """What every checkpoint file says of itself: its format, the run it was taken of, the
    sync it was taken in (None: at the start), and ``side`` (a ray run's trainer or rollout)."""
    head = {"format": FORMAT, "scenario": scenario_digest(sc), "scenario_name": sc.name, "mode": mode, "sync": sync}
    if side is not None:
        head["side"] = side
    return head


def trainer_side(system: System) -> TrainerSide:
    return TrainerSide(system.trainer, system.param_sync, system.train_backend, system.ledger, system.timeline)


def rollout_side(system: System) -> RolloutSide:
    return RolloutSide(system.rollouter, system.queue, system.ledger)


def capture(system: System, version: int, t0: float, t1: float, at_start: bool = False) -> Snapshot:
    """The run's state inside the sync to ``version``, after the pause (t0: the sync began,
    t1: rollout stopped), or ``at_start``, before anything ran: both sides of the one system."""
    trained, holding = trainer_side(system).state()
    rollout = rollout_side(system)
    state = {
        **header(system.scenario, system.mode, None if at_start else {"version": version, "t0": t0, "t1": t1}),
        **trained,
        **rollout.state(asyncio.get_running_loop().time()),
        "engines": [e.state() for e in system.engines],
        "faults": {"fired": sorted(system.fault_plan.fired), "records": system.faults.state()},
    }
    snap = Snapshot(state=state)
    snap.groups.update(rollout.groups())
    snap.groups.update(holding)
    return snap


def save_run(system: System, version: int, t0: float, t1: float, at_start: bool = False) -> Optional[Path]:
    """Checkpoint the run if ``version`` is due and nothing is mid-recovery; then the queue
    forgets what the trainer has trained (acknowledged). ``at_start``: the checkpoint a
    trainer killed before its first sync goes back to."""
    sc = system.scenario
    if system.run_dir is None or not (at_start or sc.checkpoint.due(version)):
        return None
    ro = system.rollouter
    if ro.recovering() or system.queue.is_down():
        log.info("checkpoint at version %d skipped: a component is being restarted", version)
        return None
    snap = capture(system, version, t0, t1, at_start)
    path = save(checkpoint_dir(system.run_dir, system.mode), system.trainer.step, snap, keep=sc.checkpoint.keep,
                **backend_tensors(system.train_backend))
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


# What ``restore`` reads of each engine's state: a simulated engine's model state, or a real
# engine's counters (core/sim/engine.py and core/real/engine_meter.py write them).
_ENGINE_KEYS = {
    "sim": ("version", "tokens_generated", "prefill_tokens", "busy_s", "seq_s", "S", "t", "C", "seq", "slowdown", "hang_next", "down_until"),
    "real": ("tokens_generated", "prefill_tokens", "busy_s", "seq_s"),
}
_FAULT_RECORD = {f.name for f in dataclasses.fields(FaultRecord)}


class _Unfit(ValueError):
    """A part of a checkpoint's state that ``restore`` could not take."""


def _real(value: object, what: str) -> float:
    """A time or a total: a finite real, not negative (a NaN clock never reaches its next event:
    the run hung)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _Unfit(f"{what} = {shown(value)} is not a finite number >= 0")
    return float(value)


def _count(value: object, what: str, most: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (most is not None and value > most):
        raise _Unfit(f"{what} = {shown(value)} is not a count" + (f" from 0 to {most}" if most is not None else " >= 0"))
    return value


def _part(parent: dict, key: str, kind: type, what: str) -> object:
    value = parent.get(key)
    if not isinstance(value, kind):
        raise _Unfit(f"{what} is {type(value).__name__}, not the {kind.__name__} a run checkpoint holds")
    return value


def check_contents(snap: Snapshot, sc: Scenario, mode: str) -> None:
    """Every part ``restore`` reads is there and of its type, and every clock and count is
    finite and in range: a resume refuses a checkpoint that cannot fit this run before anything
    runs (``_Unfit`` says which part), instead of failing, or hanging, once it has started."""
    st = snap.state
    clock = _real(st.get("clock"), "clock")
    if st.get("sync") is not None:
        sync = _part(st, "sync", dict, "sync")
        _count(sync.get("version"), "sync.version")
        for k in ("t0", "t1"):
            if _real(sync.get(k), f"sync.{k}") > clock:
                raise _Unfit(f"sync.{k} = {shown(sync[k])} is after the clock, {clock!r}")
    tr = _part(st, "trainer", dict, "trainer")
    _count(tr.get("step"), "trainer.step", sc.trainer.steps)
    _count(tr.get("version"), "trainer.version")
    _real(tr.get("wait_s"), "trainer.wait_s")
    for i, info in enumerate(_part(tr, "step_info", list, "trainer.step_info")):
        _real(info.get("end_s") if isinstance(info, dict) else None, f"trainer.step_info.{i}.end_s")
    ps = _part(st, "param_sync", dict, "param_sync")
    for k in ("pause_s", "drain_s", "transfer_s"):
        _part(ps, k, list, f"param_sync.{k}")
    ledger = _part(st, "ledger", dict, "ledger")
    for k, ref in Ledger(sc.staleness.max_staleness).state().items():  # the types a fresh ledger has
        number = isinstance(ref, (int, float)) and not isinstance(ref, bool)
        v = ledger.get(k)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) if number else isinstance(v, type(ref))):
            raise _Unfit(f"ledger.{k} is {type(v).__name__}, not {type(ref).__name__}")
    try:
        base64.b64decode(ledger["_trained_mask"], validate=True)
    except (binascii.Error, ValueError):
        raise _Unfit("ledger._trained_mask is not base64") from None
    for w, rows in _part(st, "timeline", dict, "timeline").items():
        if not isinstance(rows, list):
            raise _Unfit(f"timeline.{w} is {type(rows).__name__}, not a list of spans")
    ro = _part(st, "rollouter", dict, "rollouter")
    for k in ("version", "admitted", "next_prompt"):
        _count(ro.get(k), f"rollouter.{k}")
    if "filter" in ro:  # absent from checkpoints written before the filter
        for k, v in _part(ro, "filter", dict, "rollouter.filter").items():
            _count(v, f"rollouter.filter.{k}")
    q = _part(st, "queue", dict, "queue")
    _count(q.get("version"), "queue.version")
    for k, v in _part(q, "counters", dict, "queue.counters").items():
        _count(v, f"queue.counters.{k}")
    engines = _part(st, "engines", list, "engines")
    want = Placement.of(sc, mode).engines
    if len(engines) != want:
        raise _Unfit(f"holds {len(engines)} engine states, and this run's {mode} mode has {want} engines")
    keys = _ENGINE_KEYS["sim" if sc.runtime == "sim" else "real"]
    for i, es in enumerate(engines):
        missing = [k for k in keys if not isinstance(es, dict) or k not in es]
        if missing:
            raise _Unfit(f"engines.{i} lacks {', '.join(missing[:3])}")
        for k, v in es.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise _Unfit(f"engines.{i}.{k} = {v!r} is not finite")
    be = _part(st, "backend", dict, "backend")
    for k in ("compute_s", "flops"):
        _real(be.get(k), f"backend.{k}")
    f = _part(st, "faults", dict, "faults")
    for i in _part(f, "fired", list, "faults.fired"):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(sc.faults):
            raise _Unfit(f"faults.fired names fault {shown(i)}, and this run has {len(sc.faults)} faults")
    for i, r in enumerate(_part(f, "records", list, "faults.records")):
        if not isinstance(r, dict) or set(r) != _FAULT_RECORD:
            raise _Unfit(f"faults.records.{i} is not a fault record ({', '.join(sorted(_FAULT_RECORD))})")


def tool_journal_mark(state: Optional[dict], where: str) -> tuple[int, Optional[str]]:
    """How many results the tool journal held when the checkpoint ``state`` (a run's, or a ray
    run's rollout side) was taken, and their digest: what ``core.store.tool_journal.check``
    holds the journal to. (0, None) for no checkpoint, or one of a run without tools."""
    box = (((state or {}).get("rollouter") or {}).get("agent") or {}).get("box") if isinstance(state, dict) else None
    if not box:
        return 0, None
    try:
        if not isinstance(box, dict):
            raise _Unfit("rollouter.agent.box is not a mapping")
        records = _count(box.get("journal_records", 0), "rollouter.agent.box.journal_records")
        digest = box.get("journal_digest")
        if digest is not None and not (isinstance(digest, str) and len(digest) == 32):
            raise _Unfit(f"rollouter.agent.box.journal_digest = {shown(digest)} is not a digest")
    except _Unfit as exc:
        raise CheckpointError(where, f"does not fit this run: {exc}", CORRUPT_FIX) from None
    return records, digest


def load_run(run_dir: Path, sc: Scenario, mode: str) -> Optional[tuple[Path, Snapshot]]:
    """The latest checkpoint of ``mode`` in ``run_dir``, checked against ``sc`` and checked to
    fit it (``check_contents``); None if none."""
    path = latest(checkpoint_dir(run_dir, mode))
    if path is None:
        return None
    snap = load(path)
    _check(snap, sc, mode, str(path))
    try:
        check_contents(snap, sc, mode)
    except _Unfit as exc:
        raise CheckpointError(str(path / STATE_FILE), f"does not fit this run: {exc}", "delete this checkpoint to resume from "
                              "the one before it, or start the run again") from None
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
    trainer_side(system).restore(st, snap.groups, ledger_fields=Ledger.TRAINED_FIELDS)
    # Restored inside a sync: the sync's end resumes it.
    rollout_side(system).restore(st, snap.groups, paused=st["sync"] is not None)
    if len(system.engines) != len(st["engines"]):
        raise ValueError(f"{len(st['engines'])} engine states for {len(system.engines)} engines")
    for e, es in zip(system.engines, st["engines"]):
        e.restore(es)
    load_backend(system.train_backend, path)
    f = st["faults"]
    system.fault_plan.fired.update(f["fired"])
    system.faults.records[:] = FaultLog.from_state(f["records"]).records
    s = st["sync"]
    return None if s is None else (s["version"], s["t0"], s["t1"])


def restore_trainer(system: System) -> None:
    """A restarted trainer takes its own side of the latest checkpoint back; the queue gives
    it again whatever it had been given since."""
    restart_trainer_side(trainer_side(system), system.run_dir, system.mode)
    system.queue.redeliver()


def restart_trainer_side(side: TrainerSide, run_dir: Path, mode: str, zero: float = 0.0) -> None:
    """A restarted trainer: step, version and the learning curve, the ledger's trained counts,
    weights and optimizer, from the latest checkpoint of ``mode`` (whole-run or trainer-side).
    ``zero``: this clock's reading at run time 0 (a ray actor's; checkpoints hold run times)."""
    found = latest(checkpoint_dir(run_dir, mode))
    if found is None:
        raise RuntimeError("the trainer died before its first checkpoint; fix: checkpoint.every: 1")
    side.restart(load(found).state, zero)
    load_backend(side.backend, found)


def backend_tensors(backend: TrainBackend) -> dict:
    """What ``save`` writes of the backend: its tensor files, or a sharded trainer's shards,
    which every rank writes itself."""
    if backend.sharded:
        return {"shards": backend.save_shards}
    return {"tensors": backend.state_dict() or None}


def load_backend(backend: TrainBackend, path: Path) -> None:
    """The backend's tensors (a real one's weights and optimizer, or every rank's shards; the
    sim's has none)."""
    if not backend.sharded:
        backend.load({stem: load_tensors(path, stem) for stem in backend.tensor_files})
        return
    shards = Path(path) / SHARDS_DIR
    if not shards.is_dir():
        raise CheckpointError(str(shards), "is missing: the checkpoint was not taken by a sharded trainer",
                              "resume with the learn.sharding the run was started with")
    try:
        backend.load_shards(shards)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(str(shards), f"could not be read into the sharded trainer ({exc})", CORRUPT_FIX) from None


def save_trainer_side(
    sc: Scenario, mode: str, run_dir: Path, side: TrainerSide, version: int, at_start: bool = False, zero: float = 0.0,
) -> Optional[Path]:
    """The trainer's side alone (the ray runtime, where the rollout side lives in another
    process and adds its own side after: core/runtimes/ray_checkpoint.py, which prunes old
    checkpoints once the new one is whole). Times are stored as run times: ``zero`` is this
    clock's reading at run time 0."""
    if not (at_start or sc.checkpoint.due(version)):
        return None
    state, groups = side.state(zero)
    snap = Snapshot(state={**header(sc, mode, None if at_start else {"version": version}, side="trainer"), **state})
    snap.groups.update(groups)
    return save(checkpoint_dir(run_dir, mode), side.trainer.step, snap, keep=None, **backend_tensors(side.backend))


def restore_latest(system: System) -> Optional[tuple[int, float, float]]:
    """Restore ``system`` from its run directory's latest checkpoint; the sync to finish."""
    found = load_run(system.run_dir, system.scenario, system.mode)
    if found is None:
        return None
    return restore(system, *found)
