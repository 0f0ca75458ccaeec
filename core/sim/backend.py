"""The sim runtime's trainer and weight transfer: modelled costs, waited out on the virtual clock."""

from __future__ import annotations

import asyncio

import numpy as np

from core.api import Batch, TrainBackend
from core.sim.costs import TrainCost, TransferCost


class SimTrainBackend(TrainBackend):
    """Waits out the modelled time of a step. Its cost depends on tokens alone, so a
    batch's importance weights change nothing here; nothing to checkpoint but counters."""

    tensor_files: tuple[str, ...] = ()
    sharded = False

    def __init__(self, cost: TrainCost) -> None:
        self.cost = cost
        self.compute_s = 0.0
        self.flops = 0.0  # model FLOPs of the steps trained (cost.model_flops)
        self.peak_flops = cost.peak_flops

    async def train_step(self, batch: Batch, version: int) -> dict:
        tokens = 0
        tokens_sq = 0
        for g in batch.groups:
            for s in g.samples:
                t = s.n_prompt + s.n_response
                tokens += t
                tokens_sq += t * t
        dt = self.cost.step_s(tokens, tokens_sq)
        self.compute_s += dt
        self.flops += self.cost.model_flops(tokens, tokens_sq)
        await asyncio.sleep(dt)
        return {"tokens": tokens}

    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        return {}

    def load(self, tensors: dict[str, dict[str, np.ndarray]]) -> None:
        if tensors:
            raise ValueError(f"the simulated trainer has no tensors, got {sorted(tensors)}")


class SimWeightTransfer:
    """Waits out the modelled transfer time; nothing to load."""

    bytes = None  # priced (TransferCost), not moved

    def __init__(self, cost: TransferCost) -> None:
        self.cost = cost

    async def send(self, version: int) -> None:
        await asyncio.sleep(self.cost.seconds())
