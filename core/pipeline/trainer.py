"""The Trainer: pulls whole groups from the queue, trains, and triggers a weight sync every
``sync_every`` steps. What one step costs is its backend's business (simulated or real)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional

from core.api import Batch, BatchSource, TrainBackend
from core.model.ledger import Ledger
from core.model.progress import StepTrained
from core.model.sample import Group
from core.model.timeline import TRAIN, Timeline
from core.pipeline.param_sync import ParamSync


class Trainer:
    """Consumer of the queue (or of the replay stage in front of it).

    ``pull_window`` makes it wait for a whole sync window before its first step of each
    version: the colocated sync baseline, where the same GPUs generate, then train.
    """

    def __init__(
        self,
        *,
        source: BatchSource,
        ledger: Ledger,
        backend: TrainBackend,
        param_sync: ParamSync,
        groups_per_step: int,
        sync_every: int,
        steps: int,
        timeline: Optional[Timeline] = None,
        pull_window: bool = False,
        on_step: Optional[Callable[[StepTrained], None]] = None,
    ) -> None:
        self.source = source
        self.ledger = ledger
        self.backend = backend
        self.param_sync = param_sync
        self.groups_per_step = groups_per_step
        self.sync_every = sync_every
        self.steps = steps
        self.timeline = timeline
        self.pull_window = pull_window
        self.on_step = on_step
        self.version = 0
        self.step = 0
        self.holding = Batch()  # pulled, not yet trained
        self.wait_s = 0.0
        # What the backend said of each step, with when it ended and the trainings so far.
        self.step_info: list[dict] = []

    def state(self) -> dict:
        """What a checkpoint keeps of the trainer (its holding goes in as groups)."""
        return {"step": self.step, "version": self.version, "wait_s": self.wait_s, "step_info": self.step_info}

    def restore(self, state: dict, holding: list[Group], wait_s: bool = True) -> None:
        """Back to ``state``; ``wait_s=False`` keeps the time waited so far (a restarted
        trainer's waits happened, a resumed run's counter is the checkpoint's)."""
        self.step, self.version, self.step_info = state["step"], state["version"], state["step_info"]
        if wait_s:
            self.wait_s = state["wait_s"]
        self.holding = Batch(list(holding))

    def _trained(self, batch: Batch, now: float, info: dict) -> StepTrained:
        led = self.ledger
        return StepTrained(
            step=self.step, version=self.version, at_s=now,
            samples=sum(g.size for g in batch.groups),
            staleness_sum=sum((self.version - g.version) * g.size for g in batch.groups),
            trainings=led.trainings, trained=led.trained, tokens=led.prompt_tokens + led.response_tokens,
            staleness_total=led.staleness_sum, staleness_max=led.staleness_max, figures=info,
        )

    async def run(self, before: Optional[Callable[[], Awaitable[None]]] = None) -> None:
        """Train until ``steps``; ``before`` runs first (a resumed trainer finishes its sync)."""
        loop = asyncio.get_running_loop()
        if before is not None:
            await before()
        while self.step < self.steps:
            if not self.holding:
                steps_left = min(self.sync_every - self.step % self.sync_every, self.steps - self.step)
                k = self.groups_per_step * (steps_left if self.pull_window else 1)
                t0 = loop.time()
                self.holding = await self.source.get_batch(k)
                self.wait_s += loop.time() - t0
            batch = self.holding.head(self.groups_per_step)
            t0 = loop.time()
            info = await self.backend.train_step(batch, self.version)
            now = loop.time()
            self.holding = self.holding.tail(self.groups_per_step)
            self.ledger.trained_groups(batch.groups, self.version, now)
            self.step_info.append({"end_s": now, "trainings": self.ledger.trainings, **info})
            if self.timeline is not None:
                self.timeline.add("trainer", TRAIN, t0, now)
            self.step += 1
            self.ledger.step_done(now)
            if self.on_step is not None:
                self.on_step(self._trained(batch, now, info))
            if self.step % self.sync_every == 0 and self.step < self.steps:
                self.version += 1
                await self.param_sync.sync(self.version)
