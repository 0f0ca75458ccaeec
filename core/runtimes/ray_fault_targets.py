"""The ray driver's side of a fault (``DriverTargets``): it kills the trainer actor, the rollout
actor that holds the queue, or takes down a node with whatever runs there; a rollout worker's
fault is fired in the rollout actor (``core.runtimes.ray_rollout_host``). And when a lost node
counts as recovered (``node_recoveries``), from the records of what ran on it."""

from __future__ import annotations

import logging

from core.model.config import Scenario
from core.model.faults import FaultLog, worker_key
from core.runtimes.ray_actor import ray_module
from core.runtimes.ray_cluster import kill_node
from core.runtimes.ray_run_actors import RunActors

log = logging.getLogger(__name__)


class DriverTargets:
    """The driver's side of a fault: it kills the trainer actor (Ray restarts it), the rollout
    actor that holds the queue (the run goes back to its last whole checkpoint), or takes a
    node down with whatever runs there."""

    def __init__(self, run: RunActors, sc: Scenario, faults: FaultLog, lost_nodes: dict, now: float) -> None:
        self.run, self.sc, self.faults, self.lost_nodes, self.now = run, sc, faults, lost_nodes, now
        self.trainer, self.rollout = run.trainer, run.rollout

    def kill_trainer(self) -> None:
        ray_module().kill(self.trainer, no_restart=False)

    def kill_node(self, of: str, worker: int) -> None:
        """Take down the node that runs ``of`` (rollout worker ``worker``, or the trainer): its
        engines are told lost to the rollout actor (restarted elsewhere when Ray has a place
        for them), the trainer, if there, dies and is supervised back as after its own kill."""
        run, control_s = self.run, self.sc.timeouts.control_s
        where = run.note_nodes(control_s)
        name = "trainer" if of == "trainer" else f"engine{worker:03d}"
        node = where.get(name)
        if node is None:
            raise RuntimeError(f"{name} is being restarted: its node is not known; fix: fire the node fault at another step")
        if node == where["rollouter"]:
            raise RuntimeError(
                f"the node of {name} ({node}) is the driver's, where the rollout actor lives: losing it ends the run; "
                "fix: ray.placement_strategy STRICT_SPREAD, or a head node without CPUs for the bundles"
            )
        lost = [i for i in range(len(run.engines)) if where.get(f"engine{i:03d}") == node]
        trainer_lost = any(where.get(n) == node for n, _ in run.named() if n.startswith("trainer"))
        target = f"node_of_{worker_key(worker) if of == 'rollout_worker' else of}"
        self.lost_nodes[target] = [worker_key(i) for i in lost] + (["trainer"] if trainer_lost else [])
        log.warning("taking node %s down: %s", node, ", ".join(self.lost_nodes[target]) or "nothing of this run")
        if trainer_lost:
            self.faults.injected("kill", "trainer", self.now)
        if lost:
            ray_module().get(run.rollout.node_lost.remote(lost), timeout=control_s)
        kill_node(node)

    def kill_queue(self) -> None:
        ray_module().kill(self.rollout, no_restart=True)

    def kill_worker(self, worker: int) -> None:
        raise ValueError("a rollout worker's fault is fired in the rollout actor")

    def slow_worker(self, worker: int, factor: float, duration_s: float) -> None:
        raise ValueError("a rollout worker's fault is fired in the rollout actor")

    def hang_worker(self, worker: int, call: str) -> None:
        raise ValueError("a rollout worker's fault is fired in the rollout actor")


def node_recoveries(faults: FaultLog, lost_nodes: dict[str, list[str]]) -> None:
    """A lost node is recovered when everything that ran on it is: its record closes with the
    last of theirs (the first record of each after the node's), or stays open with any of them."""
    for rec in faults.records:
        parts = lost_nodes.get(rec.target)
        if parts is None or rec.recovered_s is not None:
            continue
        ends = []
        for part in parts:
            # An engine's record is the rollout actor's, taken just after the node's on its clock
            # and moved onto the driver's (an offset good to a round trip): a second's slack.
            after = [r for r in faults.records if r.target == part and r.kind == "kill" and r.at_s >= rec.at_s - 1.0]
            ends.append(after[0].recovered_s if after else None)
        if all(e is not None for e in ends):
            rec.recovered_s = max([rec.at_s, *ends])
