"""The device seam: which device a real worker computes on and which collective backend its
process groups use. Everything else in core/ asks here; nothing else names an accelerator or
a collective library, so the CPU path that CI runs and the GPU path users deploy are the same
code apart from this module.

    device        "cuda" when torch sees a GPU, else "cpu"
    collectives   NCCL on a GPU, gloo on CPU (trainer ranks, FSDP2's mesh, the weight broadcast)

torch is imported on use: the slim install (the sim runtime) imports core without it.
"""

from __future__ import annotations

import datetime
from typing import Any

CPU = "cpu"


def device() -> str:
    """Where a real worker of this process computes: the GPU when torch sees one."""
    import torch

    return "cuda" if torch.cuda.is_available() else CPU


def is_accelerator(dev: str) -> bool:
    """A device whose kernels run asynchronously to the host (timings need ``synchronize``)."""
    return dev != CPU


def collective_backend(dev: str) -> str:
    """The torch.distributed backend of a process group whose tensors live on ``dev``."""
    return CPU_BACKEND if dev == CPU else "nccl"


CPU_BACKEND = "gloo"


def synchronize(dev: str) -> None:
    """Wait for the device's queued kernels (a no-op on CPU): a wall-clock timing ends here."""
    if is_accelerator(dev):
        import torch

        torch.cuda.synchronize()


def process_group(store: Any, rank: int, world: int, dev: str, timeout_s: float) -> Any:
    """A process group of ``world`` ranks on ``store`` (a prefix of one), outside
    torch.distributed's default group: vLLM initializes that one for itself in an engine's
    process. Each GPU rank binds its own device."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if dev == CPU:
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def join_default_group(address: str | None, rank: int, world: int, dev: str, timeout_s: float) -> str:
    """Make this process rank ``rank`` of torch.distributed's default group of ``world`` ranks,
    served by rank 0 at ``address`` (host:port); a one-rank group needs no address (an
    in-memory store). Any group the process was in before is left first. The backend's name."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    backend = collective_backend(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if address is None:
        if world != 1:
            raise ValueError(f"a group of {world} ranks needs rank 0's address")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world, timeout=timeout)
    return backend


def mesh(dev: str, world: int) -> Any:
    """A one-dimensional device mesh over the default group's ``world`` ranks (FSDP2's)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dev, (world,))


def cpu_flags() -> set[str]:
    """The processor's feature flags (Linux /proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_runs_bf16(flags: set[str]) -> bool:
    """vLLM's CPU backend has bfloat16 kernels for AVX-512 machines only (avx512_bf16 and AMX
    speed them up where present); elsewhere it is refused rather than left to fail in vLLM."""
    return "avx512f" in flags
