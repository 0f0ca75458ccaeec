"""The trainer actor (``TrainerHost``): the Trainer, its ParamSync and the torch GRPO backend
(rank 0 of several with ``ray.trainer_ranks``), the trained half of the ledger, the weight
transport to the engines, and the trainer's side of each whole checkpoint. It reaches the
rollout actor through ``core.runtimes.ray_rollout_host``'s proxies."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from core.api import RunStopped
from core.model.config import Scenario
from core.model.progress import Progress
from core.model.run_plan import RunPlan
from core.model.result import SyncCounters, TrainerCounters
from core.model.timeline import Timeline
from core.pipeline.wiring import Workers, connect_trainer, consumer_in_flight, make_ledger, release_unused
from core.real.hf_model import model_dtype
from core.real.workers import make_backend
from core.runtimes.broadcast_transfer import BroadcastTransfer
from core.runtimes.object_store_transfer import ObjectStoreTransfer
from core.runtimes.ray_actor import ActorIdentity, ray_module, timed
from core.runtimes.ray_cluster import node_scenario
from core.runtimes.ray_rollout_host import QueueProxy, RolloutProxy
from core.runtimes.run_checkpoint import checkpoint_dir, load_backend, restart_trainer_side, save_trainer_side
from core.runtimes.run_state import TrainerSide
from core.runtimes.trainer_ranks import RankedBackend
from core.sim.workload import Workload
from core.store.checkpoint import latest, load


class TrainerHost(ActorIdentity):
    """The Trainer, its ParamSync and the torch GRPO backend, with the trained half of the ledger.
    With ``peers`` (``ray.trainer_ranks`` > 1) it is rank 0 of a data-parallel trainer, the
    others ``TrainerRankHost`` actors (core/runtimes/trainer_ranks.py)."""

    def __init__(
        self, plan: RunPlan, rollout: Any, threads: int, run_dir: str, peers: tuple = (),
        stop_at_step: Optional[int] = None, shipped: tuple = (),
    ) -> None:
        sc = plan.scenario
        self.plan, self.sc, self.mode, self.run_dir = plan, sc, plan.mode, run_dir
        self.rollout = rollout
        self.stop_at_step = stop_at_step
        self.zero = 0.0  # this clock at run time 0 (checkpoints hold run times)
        self.resynced_at: Optional[float] = None
        here = node_scenario(sc, shipped)  # the model where this node has it; ``sc`` stays the run's identity
        self.backend = make_backend(here, threads)
        if peers:
            self.backend = RankedBackend(self.backend, list(peers))
        self.transfer = _transfer(here, self.backend)
        self.timeline = Timeline()
        self.ledger = make_ledger(plan)
        self.trainer = None
        self.end_s = 0.0
        self.told: list[Progress] = []  # steps and syncs since the driver last asked, on this actor's clock

    async def connect(self, rollout_offset: float) -> None:
        """Wire the trainer side; ``rollout_offset`` is the rollout actor's clock minus ours.
        With ranks, a new process group of them first (the others are fresh processes)."""
        sc, mode = self.sc, self.mode
        if isinstance(self.backend, RankedBackend):
            await self.backend.form_group(sc.timeouts.restart_s)
        workers = Workers([], self.backend, self.transfer, spread=Workload.of(sc).reward_spread)
        self.trainer, self.param_sync, self.replay = connect_trainer(
            self.plan, workers, self.ledger, QueueProxy(self.rollout, rollout_offset),
            RolloutProxy(self.rollout, sc.timeouts.control_s, sc.timeouts.generate_s), self.timeline,
            on_step=self._stepped, on_synced=self.told.append, checkpoint=self._checkpoint if sc.checkpoint.every else None,
        )
        self.side = TrainerSide(self.trainer, self.param_sync, self.backend, self.ledger, self.timeline)
        if sc.checkpoint.every and latest(checkpoint_dir(self.run_dir, mode)) is None:
            # what a trainer dying before its first sync goes back to
            save_trainer_side(sc, mode, self.run_dir, self.side, 0, at_start=True, zero=self.zero)

    async def _checkpoint(self, version: int, t0: float, t1: float) -> None:
        """The trainer's side first, then the rollout side makes it whole (and acknowledges)."""
        sc, z = self.sc, self.zero
        path = await asyncio.to_thread(save_trainer_side, sc, self.mode, self.run_dir, self.side, version, zero=z)
        if path is not None:
            await timed(self.rollout.checkpoint.remote(path.name, version, t0 - z, t1 - z), sc.timeouts.control_s, "rollouter", "checkpoint")

    def _stepped(self, event: Progress) -> None:
        self.told.append(event)
        if self.stop_at_step is not None and event.step >= self.stop_at_step:
            raise RunStopped(f"stopped after step {event.step}")

    def set_zero(self, zero: float) -> None:
        self.zero = zero

    async def restore_run(self, path: str) -> None:
        """A resumed run: back to the trainer side of whole checkpoint ``path``."""
        snap = await asyncio.to_thread(load, path)
        self.side.restore(snap.state, snap.groups, self.zero, ledger_fields=self.ledger.TRAINED_FIELDS)
        await asyncio.to_thread(load_backend, self.backend, path)

    async def restore(self) -> None:
        """A restarted trainer: back to the latest checkpoint; the queue hands back what the
        dead one was given since."""
        await asyncio.to_thread(restart_trainer_side, self.side, self.run_dir, self.mode, self.zero)
        await timed(self.rollout.redeliver.remote(self.ledger.trained_mask()), self.sc.timeouts.control_s, "rollouter", "redeliver")

    async def run(self, resync: bool = False, resume: Optional[tuple[int, float, float]] = None) -> None:
        """Train to the end; ``resync``: first move the engines to this trainer's weights;
        ``resume``: first finish the sync (version, t0, t1 in run time) a checkpoint was taken in."""
        loop = asyncio.get_running_loop()

        async def first() -> None:
            await self.param_sync.sync(self.trainer.version, checkpoint=False)
            self.resynced_at = loop.time()

        async def finish() -> None:
            version, t0, t1 = resume
            await self.param_sync.finish(version, t0 + self.zero, t1 + self.zero)

        await self.trainer.run(first if resync else finish if resume is not None else None)
        self.end_s = loop.time()

    def progress(self) -> tuple[int, int, Optional[float], list[Progress]]:
        """(step, version, when a restarted trainer resynced, what happened since the last call)."""
        t = self.trainer
        told, self.told[:] = list(self.told), []
        return t.step, t.version, self.resynced_at, told

    async def catch_up(self, version: int) -> Optional[list]:
        """A copy of the weights for an engine back from a restart (``RolloutHost.weights_from``),
        in the object store; None while this trainer is behind ``version`` (restored from an
        older checkpoint). Weights trained past ``version`` and not yet synced go as ``version``:
        that engine's tokens then count as staler than they are, never as fresher."""
        if self.trainer is None or self.trainer.version < version:
            return None
        weights = await asyncio.to_thread(self.backend.weights)
        return [ray_module().put(weights)]

    def latest_weights(self) -> tuple[int, list]:
        return self.transfer.latest

    def finish(self) -> dict:
        """End of run: what the trainer holds untrained is dropped; the trainer half of the run."""
        t, be, ps = self.trainer, self.backend, self.param_sync
        release_unused(t, self.replay, self.ledger)
        return {
            "ledger": self.ledger,
            "timeline": self.timeline,
            "end_s": self.end_s,
            "trainer": TrainerCounters(t.step, t.version, t.wait_s, t.step_info, be.compute_s, be.flops, be.peak_flops),
            "sync": SyncCounters(ps.pause_s, ps.drain_s, ps.transfer_s, ps.bytes),
            "replay_counters": self.replay.counters() if self.replay else None,
            "in_flight": consumer_in_flight(t, self.replay),
        }


def _transfer(sc: Scenario, backend: Any) -> Any:
    """The scenario's weight transport. A broadcast group is served from this process, on a
    free port of this node: a restarted trainer serves a new one, and the engines join it."""
    ray = ray_module()
    if sc.sync.transport == "object_store":
        return ObjectStoreTransfer(backend, ray.put)
    return BroadcastTransfer(
        backend, ray.util.get_node_ip_address(), bucket_bytes=int(sc.sync.bucket_mb * 2**20),
        dtype=model_dtype(sc.real_model_path, sc.engine.dtype), device=backend.device,
        timeout_s=sc.timeouts.control_s, put=ray.put, publish_every=sc.eval.every,
    )
