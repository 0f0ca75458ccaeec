"""What an env run reports, whichever runtime ran it: ``EnvCurve`` (its evaluations, its
counters and its chunks' ledger), and the curve as a checkpoint holds it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np

from core.env.chunk_intake import STALE_AT_LEARNER
from core.model.ledger import Ledger


@dataclass
class EnvCurve:
    """What a run learned, against env steps and wall-clock seconds, and what it cost."""

    env_steps: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    """When each evaluated policy existed: seconds of training before it, evaluations left out (sync
    mode stops its clock while it evaluates; async mode holds its actors, or with ``env.hold_for_eval``
    false evaluates beside training, timed when it took the newest weights)."""
    eval_return: list[float] = field(default_factory=list)
    updates: int = 0
    versions: int = 0
    """Weight versions published to the samplers."""
    policy_lag: list[float] = field(default_factory=list)
    """Per update: the learner's version minus the mean version of its minibatch's rows (a replay
    keeps rows of many versions, so this is the age of what the learner trains on)."""
    train_s: float = 0.0
    """Seconds the run trained (sync mode: without its evaluations)."""
    episodes: int = 0
    learner: dict = field(default_factory=dict)
    """Where the learner's time went: ``update_s`` in its own updates; in async mode also
    ``sample_wait_s``, waiting for a sample from the replay actor."""
    replay: dict = field(default_factory=dict)
    """The store's counters at the end: the DQN replay's (rows in, sampled, evicted unsampled,
    blocked time per side) or the PPO queue's (chunks delivered, dropped stale, left at the end)."""
    chunks: Ledger = field(default_factory=lambda: Ledger(0))
    """The chunks' ledger (core/env/chunk_intake.py): while the run goes, the learner's part
    (trained, dropped at the learner); at the end, the run's (``run_ledger``)."""
    chunks_in_flight: int = 0
    """Chunks the store held when the run stopped: with the ledger's, every chunk is counted."""
    evaluations_lost: int = 0
    """Async mode: evaluations whose weights died with a learner before they were read (the
    learner restarted; its next evaluation runs as usual)."""
    faults: dict = field(default_factory=dict)
    """Async mode with faults: ``faults/*`` figures (injected, recovered, recovery times) and the records."""
    spans: dict = field(default_factory=dict)
    """Who did what when, on the training clock: ``(kind, start, end)`` per actor (sync mode: its
    one loop), ``core/model/timeline.py``'s kinds. Not checkpointed: a resumed run's start at its resume."""

    @property
    def produced_chunks(self) -> int:
        """Chunks the samplers sent."""
        return self.chunks.produced

    @property
    def trained_chunks(self) -> int:
        """PPO: chunks trained (each once)."""
        return self.chunks.trained

    @property
    def dropped_at_learner(self) -> int:
        """PPO: chunks the learner took and found too stale to train (async mode)."""
        return self.chunks.dropped[STALE_AT_LEARNER]

    def first_reaching(self, target: float) -> Optional[int]:
        """Index of the first evaluation at or above ``target``."""
        return next((i for i, r in enumerate(self.eval_return) if r >= target), None)


def curve_state(curve: EnvCurve) -> tuple[dict, dict[str, np.ndarray]]:
    """A curve as a checkpoint holds it: its lists as arrays, its ledger as its counts, the rest as they are."""
    scalars, arrays = {}, {}
    for f in fields(curve):
        if f.name == "spans":
            continue
        v = getattr(curve, f.name)
        if isinstance(v, list):
            arrays[f"curve.{f.name}"] = np.asarray(v, np.float64)
        elif isinstance(v, Ledger):
            scalars[f.name] = v.state()
        else:
            scalars[f.name] = v
    return scalars, arrays


def curve_from_state(scalars: dict, arrays: dict[str, np.ndarray]) -> EnvCurve:
    lists = {f.name: arrays[f"curve.{f.name}"].tolist() for f in fields(EnvCurve) if f"curve.{f.name}" in arrays}
    lists["env_steps"] = [int(x) for x in lists.get("env_steps", [])]
    chunks = Ledger(0)
    chunks.restore(scalars["chunks"])
    return EnvCurve(**{**scalars, "chunks": chunks}, **lists)
