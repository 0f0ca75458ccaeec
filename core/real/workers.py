"""The real workers: engines, the torch trainer, and how weights move between them in one process.

The local runtime (core/runtimes/local.py) builds them in its process; the ray runtime
(core/runtimes/ray_engine_host.py, ray_trainer_host.py) builds the same classes inside actors. Which device a role uses, and how many threads, follow from
the placement: on a machine without a GPU a device is one CPU core.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import numpy as np

from core.model.config import Scenario
from core.model.timeline import Timeline
from core.real.device import device
from core.real.engine_vllm import VllmEngine

# The environment of every process of a real run. No model hub is reachable (or wanted):
# everything loads from the local model directory.
REAL_RUNTIME_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_env() -> None:
    """Set the real runtimes' environment defaults in this process (before torch, transformers
    or vLLM are imported)."""
    import os

    for k, v in REAL_RUNTIME_ENV.items():
        os.environ.setdefault(k, v)


def make_engine(sc: Scenario, name: str, threads: int, timeline: Optional[Timeline], seed: int):
    """One rollout engine of the scenario's kind (not started)."""
    common = dict(
        max_num_seqs=sc.rollout.max_num_seqs,
        temperature=sc.engine.temperature,
        seed=seed,
        threads=threads,
        timeline=timeline,
        device=device(),
        dtype=sc.engine.dtype,
    )
    if sc.engine.kind == "torch":
        from core.real.engine_torch import TorchEngine  # imports torch: only a real run pays for it

        return TorchEngine(name, sc.real_model_path, lora=sc.trainer.lora, **common)
    if sc.engine.kind == "vllm":
        return VllmEngine(
            name,
            sc.real_model_path,
            max_model_len=sc.real_max_positions,
            kv_cache_gb=sc.engine.vllm_kv_cache_gb,
            gpu_memory_utilization=sc.engine.vllm_gpu_memory_utilization,
            **common,
        )
    raise ValueError(f"engine.kind {sc.engine.kind!r} has no real engine")


def make_backend(sc: Scenario, threads: int):
    """The torch GRPO trainer, with its device's peak FLOP/s (in the dtype it computes in)
    measured for ``util/mfu``. An fsdp2 trainer of one rank is sharded here, in a group of its
    own; ranks that form a group together shard when they join it."""
    from core.real.grpo import TorchTrainBackend, peak_flops  # imports torch: only a real run pays for it
    from core.real.rank_group import RankGroup

    dev = device()
    backend = TorchTrainBackend(
        sc.real_model_path, sc.learn, threads=threads, device=dev, seed=sc.seed, temperature=sc.engine.temperature,
        lora=sc.trainer.lora,
    )
    if sc.learn.sharding == "fsdp2" and sc.ray.trainer_ranks == 1:
        backend.join(RankGroup.alone(dev, sc.timeouts.restart_s))
    backend.peak_flops = peak_flops(threads, dev, sc.learn.param_dtype)
    return backend


class LocalWeightTransfer:
    """In one process the engines load a copy of the trainer's weights in their own dtype, cast
    as a broadcast casts them: no transfer but the copy (with ``trainer.lora``, of the adapter's
    tensors alone). ``bytes``: the latest sync's, as a broadcast would move them."""

    def __init__(self, backend: Any, dtype: str) -> None:
        self.backend = backend
        self.dtype = dtype
        self.latest: Optional[tuple[int, dict]] = None
        self.bytes = 0

    async def send(self, version: int) -> dict:
        weights = await asyncio.to_thread(self.backend.weights_as, self.dtype)
        self.bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.latest = (version, weights)
        return weights
