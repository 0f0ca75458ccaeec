"""A learner's checkpoints, in either mode: the learner's own state (networks, optimizer,
generator: safetensors files) and whatever its holder counts (the sync loop's curve, the
learner actor's figures), through ``core/store/checkpoint.py``.

Version numbers: a learner that comes back from a checkpoint numbers its next weights past
any its dead self could have published since (``every`` versions on), unless the checkpoint
was the last thing it did (a run stopped on purpose), so no version number is ever published
twice with two sets of weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np

from core.env.dqn import DQNLearner
from core.env.ppo import PPOLearner
from core.store import checkpoint

Learner = Union[DQNLearner, PPOLearner]
LEARNER_KIND = "learner-checkpoints"  # the stamp of a directory of them


def save(root: Path, version: int, learner: Learner, state: dict, arrays: dict[str, np.ndarray], *, last: bool = False) -> None:
    """``last``: nothing is published after it (the run stops here)."""
    counters, tensors = learner.state()
    snap = checkpoint.Snapshot(
        state={"version": version, "learner": counters, "stems": list(tensors), "last": last, **state}, arrays=arrays,
    )
    checkpoint.save(root, version, snap, tensors=tensors)


def load(root: Path, learner: Learner, every: int) -> Optional[tuple[int, dict, dict[str, np.ndarray]]]:
    """Restore ``learner`` from the latest checkpoint under ``root``: (the version it goes on
    at, the holder's state, its arrays); None if there is none."""
    path = checkpoint.latest(root)
    if path is None:
        return None
    snap = checkpoint.load(path)
    st = snap.state
    learner.load_state(st["learner"], {k: checkpoint.load_tensors(path, k) for k in st["stems"]})
    return st["version"] + (0 if st["last"] else every), st, snap.arrays


def check(root: Union[str, Path]) -> None:
    """Read the latest checkpoint under ``root`` whole (``CheckpointError`` if it cannot be
    used), as a resume does before anything runs."""
    path = checkpoint.latest(Path(root))
    if path is None:
        return
    st = checkpoint.load(path).state
    stems = st.get("stems")
    if not isinstance(stems, list) or not {"version", "learner", "last"} <= set(st):
        raise checkpoint.CheckpointError(str(path), "not an env learner's checkpoint", "start the run again")
    # The learner's chunk ledger: the sync loop keeps it in its curve, the async learner beside it.
    curve = st.get("curve")
    ledger = curve.get("chunks") if isinstance(curve, dict) else st.get("chunks")
    if not isinstance(ledger, dict):
        raise checkpoint.CheckpointError(str(path), "holds no ledger of the chunks trained (written before asyncrl counted them "
                                         "in one)", "start the run again")
    for k in stems:
        checkpoint.load_tensors(path, k)
