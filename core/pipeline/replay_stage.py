"""The optional replay stage: a ring of groups (``ext.replay``) between the queue and the trainer.

Off-policy reuse, as in the seeds' sampler -> replay -> trainer architecture: each trainer
step takes ``fresh_per_step`` new groups from the staleness queue into the ring and trains
on ``groups_per_step`` groups drawn from it, uniformly or by priority. A prioritized draw
gives a new group the running maximum priority, so it is likely seen soon; once drawn, its
priority becomes the group's learning signal (``priority(group)``, the spread of its
rewards: a group all right or all wrong has no GRPO advantage).

The ring holds the groups' prompt and version columns; the Group objects sit in a list
beside it, at the same slot, and every draw checks that the two agree. A group overwritten
before it was ever trained is dropped (``replay_overwritten``); reuse is counted by the
Ledger (``trainings`` vs ``trained``).

A group lives in the ring until ``capacity`` newer ones arrive, i.e. for at most
``ceil(capacity / fresh_per_step)`` steps, so the staleness it can be trained at is
bounded: ``core.model.run_plan.staleness_bound`` adds those steps' versions to the queue's ``max_staleness``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from core.api import Batch, BatchSource
from core.model.config import MAX_PRIORITY, MIN_PRIORITY
from core.model.ledger import OVERWRITTEN, Ledger
from core.model.sample import Group
from ext.replay import ReplayBuffer

SPEC = {"prompt_id": ((), np.int64), "version": ((), np.int64)}


class ReplayStage:
    """Feeds the trainer from a replay ring; has the queue's ``get_batch`` so the Trainer
    does not know which one it pulls from."""

    def __init__(
        self,
        *,
        queue: BatchSource,
        ledger: Ledger,
        capacity: int,
        groups_per_step: int,
        fresh_per_step: int,
        warm_up: int,
        prioritized: bool,
        alpha: float,
        beta: float,
        seed: int,
        priority: Callable[[Group], float],
    ) -> None:
        if capacity < groups_per_step:
            raise ValueError(f"capacity {capacity} cannot hold one batch of {groups_per_step} groups")
        self.queue = queue
        self.ledger = ledger
        self.groups_per_step = groups_per_step
        self.fresh_per_step = fresh_per_step
        self.warm_up = warm_up  # fresh groups the first step takes on top, to fill one batch
        self.beta = beta
        self.priority = priority
        self.buffer = ReplayBuffer(capacity, SPEC, prioritized=prioritized, alpha=alpha, seed=seed)
        self._groups: list[Optional[Group]] = [None] * capacity
        # Drawn for the batch being trained: overwriting one of these in the ring loses nothing.
        self._pending: dict[int, Group] = {}
        self.added = 0
        self.overwritten_untrained = 0
        self.weights_sum = 0.0
        self.drawn = 0

    def __len__(self) -> int:
        return len(self.buffer)

    async def get_batch(self, k: int) -> Batch:
        """``k`` groups (a whole number of steps) to train, fresh groups added step by step
        first, each with its importance weight (1 for a uniform draw)."""
        steps = k // self.groups_per_step
        if steps * self.groups_per_step != k:
            raise ValueError(f"get_batch({k}): replay serves whole steps of {self.groups_per_step} groups")
        self._pending.clear()  # the trainer asks again only once it trained all it held
        warm_up = self.warm_up if self.added == 0 else 0
        fresh = (await self.queue.get_batch(self.fresh_per_step * steps + warm_up)).groups
        out: list[Group] = []
        weights: list[np.ndarray] = []
        start = 0
        for step in range(steps):
            end = start + self.fresh_per_step + (warm_up if step == 0 else 0)
            self._add(fresh[start:end])
            start = end
            groups, w = self._draw()
            out += groups
            weights.append(w)
        return Batch(out, np.concatenate(weights) if weights else None)

    def untrained(self) -> list[Group]:
        """Never-trained groups in the ring or drawn for training (in-flight counts, the run's end)."""
        seen = {id(g): g for g in self._groups if g is not None and not _was_trained(g)}
        seen.update((k, g) for k, g in self._pending.items() if not _was_trained(g))
        return list(seen.values())

    def drain(self) -> list[Group]:
        """Take the never-trained groups out (end of run), so they are counted once."""
        out = self.untrained()
        self._groups = [g if g is None or _was_trained(g) else None for g in self._groups]
        self._pending.clear()
        return out

    def _add(self, groups: list[Group]) -> None:
        if not groups:
            return
        slots = self.buffer.add(
            {
                "prompt_id": np.fromiter((g.prompt_id for g in groups), np.int64, len(groups)),
                "version": np.fromiter((g.version for g in groups), np.int64, len(groups)),
            }
        )
        lost = []
        for slot, g in zip(slots.tolist(), groups):
            old = self._groups[slot]
            if old is not None and not _was_trained(old) and id(old) not in self._pending:
                lost.append(old)
            self._groups[slot] = g
        if lost:
            self.overwritten_untrained += len(lost)
            self.ledger.dropped_groups(lost, OVERWRITTEN)
        self.added += len(groups)

    def _draw(self) -> tuple[list[Group], np.ndarray]:
        batch, slots, weights = self.buffer.sample(self.groups_per_step, self.beta)
        groups = [self._groups[i] for i in slots.tolist()]
        # The ring's columns and the group list are two records of one slot: if they ever
        # disagree, the wrong groups would be trained without a trace.
        if batch["prompt_id"].tolist() != [g.prompt_id for g in groups]:
            raise RuntimeError(f"replay ring slots {slots.tolist()} hold other groups than its columns say")
        for g in groups:
            self._pending[id(g)] = g
        if self.buffer.prioritized:
            ps = np.fromiter((self.priority(g) for g in groups), np.float64, len(groups))
            self.buffer.update_priorities(slots, np.clip(ps, MIN_PRIORITY, MAX_PRIORITY))
        self.weights_sum += float(np.sum(weights))
        self.drawn += len(groups)
        return groups, np.asarray(weights, dtype=np.float64)

    def counters(self) -> dict[str, float]:
        return {
            "added_groups": self.added,
            "drawn_groups": self.drawn,
            "overwritten_untrained_groups": self.overwritten_untrained,
            "weight_mean": self.weights_sum / self.drawn if self.drawn else 0.0,
        }


def _was_trained(g: Group) -> bool:
    return not math.isnan(g.samples[0].trained_at)
