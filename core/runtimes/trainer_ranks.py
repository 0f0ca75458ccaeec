"""The ray runtime's data-parallel trainer (``ray.trainer_ranks`` > 1): rank 0 is the
``TrainerHost`` (core/runtimes/ray_trainer_host.py), which drives the Trainer, ParamSync and
checkpoints and is the weight-sync source; ranks 1..N-1 are ``TrainerRankHost`` actors that
hold a backend and do what rank 0 asks, in the same torch process group (core/real/rank_group.py).

    TrainerHost ── RankedBackend.train_step(batch) ──► shards per rank (whole groups)
        │ learn_part(own shards)   ◄── collectives ──►  TrainerRankHost.learn(shards) × N-1

Every collective is entered by every rank: a step, a restore (rank 0 loads the checkpoint's
tensors, the others receive them by broadcast; sharded, each reads its own shards) and,
sharded, a weight export (one tensor gathered at a time) and a checkpoint. A rank 0
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
        """Sharded: take part in rank 0's weight gather (the full tensors stay on rank 0)."""
        await asyncio.to_thread(self.backend.weights)

    async def export(self) -> None:
        """Sharded: take part in rank 0's weight sync, one tensor gathered at a time."""
        await asyncio.to_thread(self._export)

    def _export(self) -> None:
        with self.backend.lock:
            self.backend.export().finish()

    async def save_shards(self, into: str) -> None:
        await asyncio.to_thread(self.backend.save_shards, into)

    async def load_shards(self, path: str) -> None:
        await asyncio.to_thread(self.backend.load_shards, path)


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

    def export(self):
        """Rank 0's tensors for a weight sync; sharded, the other ranks gather each with it as
        it is read (``finish`` ends their part). Called under ``lock``, in a worker thread."""
        own = self.backend.export()
        if not self.backend.sharded:
            return own
        return _PeersGathering(own, [p.export.remote() for p in self.peers])

    def state_dict(self):
        return self.backend.state_dict()  # whole replicas: rank 0's is everyone's; sharded: none

    def load(self, tensors) -> None:
        """Rank 0 loads ``tensors``; the others receive them (called in a worker thread)."""
        self._with_peers("load", lambda: self.backend.load(tensors))

    def save_shards(self, into) -> None:
        self._with_peers("save_shards", lambda: self.backend.save_shards(into), str(into))

    def load_shards(self, path) -> None:
        self._with_peers("load_shards", lambda: self.backend.load_shards(path), str(path))

    def _with_peers(self, call: str, own, *args):
        refs = [getattr(p, call).remote(*args) for p in self.peers]
        out = own()
        ray_module().get(refs)
        return out


class _PeersGathering:
    """Rank 0's ``GatheredParameters`` while the other ranks gather with it: ``finish`` ends
    rank 0's part, then waits for theirs."""

    def __init__(self, own, refs: list) -> None:
        self.own, self.refs = own, refs

    def __getitem__(self, name: str):
        return self.own[name]

    def __iter__(self):
        return iter(self.own)

    def finish(self) -> None:
        self.own.finish()
        ray_module().get(self.refs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
