"""All wiring in one place: ``connect_components`` builds one mode's system; ``run_mode`` runs it.

One sample's life, file by file: ``rollouter.py`` admits its group and hands it to an
engine (``engine_sim.py``); the finished group goes through ``staleness_queue.py`` (and,
when the scenario enables it, the replay ring of ``replay_stage.py``) to ``trainer.py``;
every ``sync_every`` steps ``param_sync.py`` pauses rollout, moves the weights and bumps
the version; ``ledger.py`` accounts for it at each transition.

Modes:
- ``sync``: colocated baseline. Every GPU generates one sync window, then every GPU trains
  it, then the weights are resharded in place. Staleness is 0 by construction.
- ``async``: rollout and trainer GPUs apart, overlapping; a sync drains in-flight work.
- ``partial``: as async, but a sync aborts in-flight work and resumes it after.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

from core import virtual_clock
from core.config import Scenario
from core.costs import DecodeCost, TrainCost, TransferCost
from core.engine_sim import SimEngine
from core.ledger import Ledger
from core.param_sync import ParamSync, SimWeightTransfer
from core.placement import Placement, effective_staleness
from core.replay_stage import ReplayStage, staleness_bound
from core.rollouter import Rollouter
from core.staleness_queue import AsyncStalenessQueue
from core.timeline import Timeline
from core.trainer import SimTrainBackend, Trainer
from core.workload import Workload

ProgressFn = Callable[[int, float, int], None]


@dataclass
class System:
    """The components of one mode, connected."""

    scenario: Scenario
    mode: str
    placement: Placement
    ledger: Ledger
    timeline: Timeline
    queue: AsyncStalenessQueue
    engines: list[SimEngine]
    rollouter: Rollouter
    param_sync: ParamSync
    trainer: Trainer
    train_backend: SimTrainBackend
    replay: Optional[ReplayStage] = None
    end_s: float = 0.0
    wall_s: float = 0.0


def connect_components(sc: Scenario, mode: str, on_step: Optional[ProgressFn] = None) -> System:
    """Build one mode's system. Must be called inside the loop that will run it."""
    place = Placement.of(sc, mode)
    max_staleness, lead = effective_staleness(sc, mode)
    n = sc.workload.group_size
    window = sc.window
    workload = Workload(sc.workload, sc.seed)
    groups_per_step, fresh_per_step, warm_up = sc.groups_per_step, sc.fresh_groups_per_step, sc.warm_up_groups
    rp = sc.replay
    trained_bound = max_staleness
    if rp.enabled:
        trained_bound = staleness_bound(max_staleness, rp.capacity_groups, fresh_per_step, sc.trainer.sync_every)
    ledger = Ledger(trained_bound, reuse=rp.enabled)
    timeline = Timeline()
    # Admission keeps admitted-but-untrained samples under (max_staleness + 2) windows, so
    # a queue this large never blocks a producer while the trainer waits on a sync drain.
    queue = AsyncStalenessQueue(
        capacity=(max_staleness + 2) * window // n + warm_up + 1, max_staleness=max_staleness
    )
    replay = None
    if rp.enabled:
        replay = ReplayStage(
            queue=queue,
            ledger=ledger,
            capacity=rp.capacity_groups,
            groups_per_step=groups_per_step,
            fresh_per_step=fresh_per_step,
            warm_up=warm_up,
            prioritized=rp.prioritized,
            alpha=rp.alpha,
            beta=rp.beta,
            seed=sc.seed,
            priority=lambda g: workload.reward_spread(g.prompt_id),
        )
    decode = DecodeCost(sc, place.gpus_per_engine)
    engines = [
        SimEngine(f"engine{i:03d}", decode, workload, sc.rollout.max_num_seqs, timeline)
        for i in range(place.engines)
    ]
    max_concurrency = sc.rollout.max_concurrency or max(n, place.engines * sc.rollout.max_num_seqs)
    rollouter = Rollouter(
        engines=engines,
        queue=queue,
        ledger=ledger,
        group_size=n,
        prompt_tokens=sc.workload.prompt_tokens,
        max_response_len=sc.workload.max_response_len,
        max_concurrency=max_concurrency,
        window=window,
        lead=lead,
        max_staleness=max_staleness,
        plan_samples=(sc.trainer.steps * fresh_per_step + warm_up) * n,
        head_start=warm_up * n,
    )
    param_sync = ParamSync(
        rollouter=rollouter,
        queue=queue,
        transfer=SimWeightTransfer(TransferCost(sc, colocated=place.colocated)),
        mode="abort" if mode == "partial" else "wait",
        timeline=timeline,
    )
    backend = SimTrainBackend(TrainCost(sc, place.trainer_gpus, mode in sc.trainer.recompute_logprobs))
    trainer = Trainer(
        source=queue if replay is None else replay,
        ledger=ledger,
        backend=backend,
        param_sync=param_sync,
        groups_per_step=groups_per_step,
        sync_every=sc.trainer.sync_every,
        steps=sc.trainer.steps,
        timeline=timeline,
        pull_window=place.colocated,
        on_step=on_step,
    )
    return System(sc, mode, place, ledger, timeline, queue, engines, rollouter, param_sync, trainer, backend, replay)


async def drive(system: System) -> System:
    """Run until the trainer has done its steps; blocks on nothing but the component tasks."""
    loop = asyncio.get_running_loop()
    rollout = asyncio.create_task(system.rollouter.run(), name="rollouter")
    train = asyncio.create_task(system.trainer.run(), name="trainer")
    done, _ = await asyncio.wait({rollout, train}, return_when=asyncio.FIRST_COMPLETED)
    if rollout in done and train not in done:
        train.cancel()
        await asyncio.gather(train, return_exceptions=True)
        rollout.result()
        raise RuntimeError("the rollouter stopped before the trainer finished")
    train.result()
    system.end_s = loop.time()
    # Whatever is still generating or queued is beyond the plan: account for it.
    left = await system.rollouter.stop()
    await rollout  # a rollouter that failed after the trainer finished still fails the run
    queued = system.queue.drain()
    # With replay, what the trainer holds was drawn from the ring, which still counts it.
    unused = system.replay.drain() if system.replay else system.trainer.holding
    system.ledger.dropped_groups(left + queued + unused, "run_end")
    system.trainer.holding = []
    for e in system.engines:
        e.close(system.end_s)
    return system


def in_flight(system: System) -> int:
    """Samples observed in the components right now (not derived from the ledger)."""
    unused = system.replay.untrained() if system.replay else system.trainer.holding
    return (
        system.rollouter.in_flight()
        + sum(g.size for g in unused)
        + len(system.queue) * system.scenario.workload.group_size
    )


def run_mode(sc: Scenario, mode: str, on_step: Optional[ProgressFn] = None) -> System:
    """Run one mode on the virtual clock."""

    async def main() -> System:
        return await drive(connect_components(sc, mode, on_step))

    t0 = time.perf_counter()
    system = virtual_clock.run(main())
    system.wall_s = time.perf_counter() - t0
    return system

