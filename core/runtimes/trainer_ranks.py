"""The ray runtime's data-parallel trainer (``ray.trainer_ranks`` > 1): rank 0 is the
``TrainerHost`` (core/runtimes/ray_trainer_host.py), which drives the Trainer, ParamSync and
checkpoints and is the weight-sync source; ranks 1..N-1 are ``TrainerRankHost`` actors that
hold a backend and do what rank 0 asks, in the same torch process group (core/real/rank_group.py).

    TrainerHost ── RankedBackend.train_step(batch) ──► shards per rank (whole groups)
        │ learn_part(own shards)   ◄── all-reduce (gloo / NCCL) ──►  TrainerRankHost.learn(shards) × N-1

Every collective is entered by every rank: a step, a restore (rank 0 loads the checkpoint's
tensors, the others receive them by broadcast) and, sharded on GPU, a weight export. A rank 0
that Ray restarts forms a new group: the driver restarts the other ranks first, and the new
rank 0 restores all of them from its checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from core.api import Batch
from core.model.config import Scenario
from core.real.workers import make_backend
from core.runtimes.ray_actor import ActorIdentity, ray_module
from core.runtimes.ray_cluster import node_scenario

log = logging.getLogger(__name__)


class TrainerRankHost(ActorIdentity):
    """Trainer rank ``rank`` >= 1: a backend taking part in the collectives rank 0 starts."""

    def __init__(self, sc: Scenario, rank: int, threads: int, shipped: tuple = ()) -> None:
        self.sc, self.rank = sc, rank
        self.backend = make_backend(node_scenario(sc, shipped), threads)  # the model where this node has it

    async def join(self, address: str, size: int) -> None:
        await asyncio.to_thread(self.backend.join_group, address, self.rank, size, self.sc.timeouts.restart_s)

    async def learn(self, parts: list[Batch]) -> float:
        """This rank's part of a step; the seconds it took."""
        t0 = time.perf_counter()
        await asyncio.to_thread(self.backend.learn_part, parts)
        return time.perf_counter() - t0

    async def load(self) -> None:
        """Receive rank 0's weights and optimizer state (rank 0 loads them at the same time)."""
        await asyncio.to_thread(self.backend.load, None)

    async def gather_weights(self) -> None:
        """Sharded: take part in rank 0's weight export (the full tensors stay on rank 0)."""
        await asyncio.to_thread(self.backend.weights)

    async def gather_state(self) -> None:
        """Sharded: take part in rank 0's checkpoint."""
        await asyncio.to_thread(self.backend.state_dict)


class RankedBackend:
    """Rank 0's backend as the Trainer and ParamSync see it: the train-backend protocol, each
    call carried out by every rank. Anything else is rank 0's backend's."""

    def __init__(self, backend: Any, peers: list[Any]) -> None:
        self.backend = backend
        self.peers = peers
        self.size = len(peers) + 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def form_group(self, timeout_s: float) -> None:
        """A new process group of all the ranks, rank 0 serving it on a free port of its node."""
        ray = ray_module()
        address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        joined = [p.join.remote(address, self.size) for p in self.peers]
        await asyncio.to_thread(self.backend.join_group, address, 0, self.size, timeout_s)
        await asyncio.gather(*joined)
        log.info("trainer: %d ranks in a process group at %s", self.size, address)

    async def train_step(self, batch: Batch, version: int) -> dict:
        t0 = time.perf_counter()
        parts = self.backend.shards(batch)
        theirs = [p.learn.remote(part) for p, part in zip(self.peers, parts[1:])]
        learned = await asyncio.to_thread(self.backend.learn_part, parts[0])
        await asyncio.gather(*theirs)
        return self.backend.summary(batch, version, learned, time.perf_counter() - t0)

    def weights(self):
        if not self.backend.sharded:
            return self.backend.weights()  # every rank holds the same whole weights
        return self._with_peers("gather_weights", self.backend.weights)

    def state_dict(self):
        if not self.backend.sharded:
            return self.backend.state_dict()
        return self._with_peers("gather_state", self.backend.state_dict)

    def load(self, tensors) -> None:
        """Rank 0 loads ``tensors``; the others receive them (called in a worker thread)."""
        self._with_peers("load", lambda: self.backend.load(tensors))

    def _with_peers(self, call: str, own):
        refs = [getattr(p, call).remote() for p in self.peers]
        out = own()
        ray_module().get(refs)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
