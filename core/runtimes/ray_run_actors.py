"""The run's actors as the ray driver places and sees them. ``Launch`` is one attempt at a run
on the cluster: one placement group (a bundle per rollout engine, then one per trainer rank),
every actor created before any is waited for, then wired to each other with each one's clock
offset measured; its ``release`` kills them and frees what they held. ``RunActors`` is what
the driver knows of them while it watches (handles, offsets, pids, nodes), and
``restart_trainer`` brings a killed trainer, and its other ranks, back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from core.model.config import Placement, Scenario
from core.model.run_plan import RunPlan
from core.real.reward import deploy_reward
from core.runtimes.local import ProcessesFn
from core.runtimes.ray_actor import clock_offset, died, ray_module
from core.runtimes.ray_cluster import node_id, on_node, pack_model
from core.runtimes.ray_engine_host import EngineHost
from core.runtimes.ray_rollout_host import RolloutHost
from core.runtimes.ray_trainer_host import TrainerHost
from core.runtimes.trainer_ranks import TrainerRankHost


@dataclass
class RunActors:
    """The run's actors as the driver sees them, with each one's clock offset to the driver's."""

    rollout: Any
    trainer: Any
    off_rollout: float
    off_trainer: float
    trainer_pid: int
    off_engines: dict
    peers: list  # trainer ranks 1..N-1
    peer_pids: list
    restarting: bool = False
    t0: float = 0.0  # the driver's clock at run time 0
    engines: list = field(default_factory=list)  # engine actors, in worker order
    nodes: dict = field(default_factory=dict)  # component -> node ids it has run on, in order

    def named(self) -> list[tuple[str, Any]]:
        return ([(f"engine{i:03d}", h) for i, h in enumerate(self.engines)] + [("rollouter", self.rollout), ("trainer", self.trainer)]
                + [(f"trainer_rank{r + 1}", p) for r, p in enumerate(self.peers)])

    def note_nodes(self, timeout_s: float) -> dict[str, str]:
        """Where each component runs now (asked of the actors themselves), added to ``nodes``."""
        ray, now = ray_module(), {}
        for name, h in self.named():
            try:
                now[name] = ray.get(h.node.remote(), timeout=timeout_s)
            except died():  # being restarted: where it comes back is seen next time
                continue
        for name, node in now.items():
            seen = self.nodes.setdefault(name, [])
            if not seen or seen[-1] != node:
                seen.append(node)
        return now


class Launch:
    """One attempt at a run: its placement group, its actors (each kept as it is created, so
    that ``release`` kills what a failed start made) and the Serve deployment it started."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan, self.sc, self.mode, self.place = plan, plan.scenario, plan.mode, plan.placement
        self.actors: list = []  # every actor made, in the order made
        self.pg = None
        self.serve_started = False
        self.engines: list = []  # (name, handle), in worker order
        self.rollout = self.trainer = None
        self.peers: list = []  # trainer ranks 1..N-1
        self.starting: list = []  # the engines' start calls

    def start(self, run_dir: str, stop_at_step: Optional[int], on_processes: Optional[ProcessesFn]) -> RunActors:
        """Place and create every actor, wait for them, wire them to each other."""
        self._create(self._reserve(), run_dir, stop_at_step)
        return self._connect(on_processes)

    def _reserve(self) -> Callable[[int, Any], dict]:
        """The placement group, ready; what pins an actor of a role to one of its bundles."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        sc, place, ray = self.sc, self.place, ray_module()
        bundles = _bundles(sc, place)
        self.pg = pg = placement_group([_clean(b) for b in bundles], strategy=sc.ray.placement_strategy)
        ray.get(pg.ready(), timeout=sc.timeouts.control_s)
        share = 0.5 if place.colocated else 1.0  # colocated: engine and trainer split a bundle

        def pinned(i: int, role) -> dict:
            return {
                "num_cpus": role.num_cpus * share,
                "num_gpus": role.num_gpus * share,
                "max_concurrency": role.max_concurrency,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            }

        return pinned

    def _create(self, pinned: Callable[[int, Any], dict], run_dir: str, stop_at_step: Optional[int]) -> None:
        """Every actor, none waited for; the engines asked to start."""
        sc, place, ray, actors = self.sc, self.place, ray_module(), self.actors
        restarts = {"max_restarts": sc.recovery.max_restarts}  # Ray brings a killed worker back
        # The model, for the nodes that do not see its path (each keeps one copy): passed in a
        # tuple, so an actor resolves it only if it needs it.
        shipped = (ray.put(pack_model(sc.real_model_path)),) if sc.ray.ship_model else ()
        engine_cls = ray.remote(EngineHost)
        engines = []
        for i in range(place.engines):
            name = f"engine{i:03d}"
            h = engine_cls.options(**pinned(i, sc.ray.rollout), **restarts).remote(sc, name, place.gpus_per_engine, sc.seed * 1000 + i, shipped)
            engines.append((name, h))
            actors.append(h)
        self.starting = [h.start.remote() for _, h in engines]
        c = sc.ray.controller
        # The rollout actor holds the queue and the producer's ledger: when it dies, run_ray
        # brings the whole run back. It stays on the driver's node, which a run cannot lose and go on.
        rollout = ray.remote(RolloutHost).options(
            num_cpus=c.num_cpus, num_gpus=c.num_gpus, max_concurrency=c.max_concurrency, scheduling_strategy=on_node(node_id()),
        ).remote(self.plan, run_dir)
        actors.append(rollout)
        # Every actor is created before any is waited for: the trainer loads its model while
        # the engines start (created once they were up, a run waited for the two in turn).
        ranks = sc.ray.trainer_ranks
        threads = max(1, place.trainer_gpus // ranks)  # each rank its share of the trainer's devices
        peers = [
            ray.remote(TrainerRankHost).options(**pinned(_trainer_bundle(place, r), sc.ray.trainer), **restarts).remote(sc, r, threads, shipped)
            for r in range(1, ranks)
        ]
        actors.extend(peers)
        trainer = ray.remote(TrainerHost).options(**pinned(_trainer_bundle(place, 0), sc.ray.trainer), **restarts).remote(
            self.plan, rollout, threads, run_dir, tuple(peers), stop_at_step, shipped
        )
        actors.append(trainer)
        self.engines, self.rollout, self.peers, self.trainer = engines, rollout, peers, trainer

    def _connect(self, on_processes: Optional[ProcessesFn]) -> RunActors:
        """Wait for the engines, measure every clock, wire the rollout actor to the engines and
        the trainer to the rollout actor; the run's actors as the driver watches them."""
        sc, ray = self.sc, ray_module()
        engines, rollout, peers, trainer = self.engines, self.rollout, self.peers, self.trainer
        control_s = sc.timeouts.control_s
        ray.get(self.starting, timeout=sc.timeouts.restart_s)
        off_engines = [clock_offset(h) for _, h in engines]
        engine_pids = ray.get([h.pid.remote() for _, h in engines], timeout=control_s)
        reward_handle = None
        if sc.reward.serve:
            reward_handle = deploy_reward(sc)
            self.serve_started = True
        off_rollout = clock_offset(rollout)
        ray.get(rollout.connect.remote(
            [(name, h, off - off_rollout, pid) for (name, h), off, pid in zip(engines, off_engines, engine_pids)], reward_handle,
        ), timeout=control_s)
        # Every actor here shares the host's monotonic clock unless the cluster spans nodes,
        # and then the offsets matter.
        off_trainer = clock_offset(trainer)
        ray.get(trainer.connect.remote(off_rollout - off_trainer), timeout=sc.timeouts.restart_s)
        trainer_pid = ray.get(trainer.pid.remote(), timeout=control_s)
        ray.get(rollout.weights_from.remote(trainer), timeout=control_s)
        peer_pids = ray.get([p.pid.remote() for p in peers], timeout=control_s)
        if on_processes is not None:
            pids = ray.get([rollout.pid.remote()], timeout=control_s)
            names = [n for n, _ in engines] + ["rollouter", "trainer"] + [f"trainer_rank{r}" for r in range(1, sc.ray.trainer_ranks)]
            on_processes(list(zip(names, engine_pids + pids + [trainer_pid] + peer_pids)))
        run = RunActors(
            rollout, trainer, off_rollout, off_trainer, trainer_pid, {n: off for (n, _), off in zip(engines, off_engines)}, peers, peer_pids,
            engines=[h for _, h in engines],
        )
        run.note_nodes(control_s)
        return run

    def release(self) -> None:
        """Kill every actor of the attempt, free its bundles, delete the Serve deployment it made."""
        from ray.util.placement_group import remove_placement_group

        ray = ray_module()
        for a in self.actors:
            ray.kill(a)
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self.serve_started:
            from ray import serve

            serve.delete("asyncrl-reward")


def _bundles(sc: Scenario, place: Placement) -> list[dict]:
    """One bundle per rollout engine, then one per trainer rank (none colocated: the ranks
    share the engines' bundles), in one placement group that keeps them together."""
    r, t = sc.ray.rollout, sc.ray.trainer
    rollout = [{"CPU": r.num_cpus, "GPU": r.num_gpus} for _ in range(place.engines)]
    if place.colocated:
        return rollout
    return rollout + [{"CPU": t.num_cpus, "GPU": t.num_gpus} for _ in range(sc.ray.trainer_ranks)]


def _trainer_bundle(place: Placement, rank: int) -> int:
    """The bundle of trainer rank ``rank``: its own after the engines', or, colocated, an engine's."""
    return rank % place.engines if place.colocated else place.engines + rank


def _clean(bundle: dict) -> dict:
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}


def _back(name: str, handle: Any, old_pid: int, sc: Scenario, deadline: float) -> int:
    """Wait for the new process of an actor Ray restarts; its pid."""
    ray = ray_module()
    while True:
        try:
            pid = ray.get(handle.pid.remote(), timeout=sc.timeouts.control_s)
            if pid != old_pid:
                return pid
        except (*died(), ray.exceptions.GetTimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{name}: not back within {sc.timeouts.restart_s:g} s of its death; "
                "fix: raise timeouts.restart_s or recovery.max_restarts"
            )
        time.sleep(0.2)


def restart_trainer(run: RunActors, sc: Scenario) -> tuple[int, float]:
    """Wait for Ray's new trainer process, wire it, and restore it from its checkpoint. Its
    other ranks were in the dead one's process group, maybe blocked in a collective with it:
    they are restarted too, and join the new rank 0's group as fresh processes."""
    ray = ray_module()
    deadline = time.monotonic() + sc.timeouts.restart_s
    for peer in run.peers:
        ray.kill(peer, no_restart=False)
    run.peer_pids = [_back(f"trainer rank {r + 1}", p, old, sc, deadline) for r, (p, old) in enumerate(zip(run.peers, run.peer_pids))]
    trainer, off_rollout = run.trainer, run.off_rollout
    pid = _back("trainer", trainer, run.trainer_pid, sc, deadline)
    off = clock_offset(trainer)
    ray.get(trainer.set_zero.remote(run.t0 + off), timeout=sc.timeouts.control_s)
    ray.get(trainer.connect.remote(off_rollout - off), timeout=sc.timeouts.restart_s)
    ray.get(trainer.restore.remote(), timeout=sc.timeouts.restart_s)
    return pid, off
