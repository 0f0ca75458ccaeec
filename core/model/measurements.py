"""Component-level measurements the sim's cost terms are fitted to, each with its source.

Only an engine's step latency, a trainer's throughput table or a transfer benchmark may set a
figure here; a published system-level step time or speedup never does: those are what the
simulator is tested on (docs/results/2026-12-07-published-tables.md). Each figure has a range
(``low``, ``high``) that spans its sources; the band (core/sim/band.py) draws from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """A figure, the range its sources span, and where it comes from."""

    value: float
    low: float
    high: float
    source: str


EAGER_LAYER = Measured(
    7.0e-5, 4.5e-5, 1.1e-4,
    "seconds per dense layer that a decode step without CUDA graphs adds: eager minus graph step "
    "latency at batch 1, over the layers: Llama-2-7B in vLLM (PR 1440: 1.2 s vs 1.05 s for 100 "
    "tokens, 32 layers: 47 us), Qwen3-0.6B in xLLM (PR 713: 4.20 vs 2.72 ms, 28 layers: 53 us), "
    "Llama-3.1-8B on H100 (8.4 vs 5.1 ms, 32 layers: 103 us); the value is their geometric mean",
)
EAGER_MOE_LAYER = Measured(
    6.0e-5, 3.0e-5, 1.5e-4,
    "seconds a mixture-of-experts layer adds to EAGER_LAYER without CUDA graphs: vLLM's MoE block "
    "launches the router GEMM, top-k softmax, block alignment, two fused-MoE GEMMs, the activation "
    "and the weighted sum where a dense MLP launches three, so about four more host dispatches of "
    "10-20 us each through PyTorch's eager dispatcher (NVIDIA Nsight guide: ~20 us per PyTorch "
    "launch on V100; 5-10 us for a bare kernel launch from C++)",
)
PER_TENSOR = Measured(
    2.0e-5, 1.0e-5, 5.0e-5,
    "host seconds per tensor at a weight sync, bucketed or not: a name lookup and one copy "
    "dispatched on each side (the PyTorch eager dispatcher's 10-20 us per op, as EAGER_MOE_LAYER)",
)
COLLECTIVE_CALL = Measured(
    1.0e-4, 3.0e-5, 2.0e-4,
    "seconds of one collective call from Python: torch.distributed all_reduce of 0.1-1 MB on one "
    "H100 node took 116-230 us against the bare collective's 10-20 us in NVIDIA's collective tests (IBM pytorch-communication-benchmarks "
    "issue 1); an H20 node's 4-byte all_reduce alone is 12.5 us (DeepEP issue 303)",
)
KV_REBUILD = Measured(
    0.26, 0.1, 0.8,
    "seconds for a sleeping vLLM engine to take its memory back (wake_up at sleep level 1): "
    "Qwen3-0.6B on A100, 0.26 s, where the weights are 1.2 GB and nearly all of it is the KV "
    "cache's allocation (vLLM blog 'Zero-Reload Model Switching with vLLM Sleep Mode', 2025-10-26); "
    "0.1-0.8 s for small models in the same post",
)
MICRO_BATCH_HALF_TOKENS = Measured(
    2456.0, 1200.0, 5000.0,
    "tokens per GPU micro-batch at which a trainer's GEMMs reach half their large-batch "
    "efficiency, MFU(x) = MFU * x / (x + x_half): fitted to llm-foundry's A100 FSDP table for a "
    "13B model (scripts/train/benchmarking/README.md), 43.94 % MFU at 8,192 tokens per "
    "micro-batch against 52.5 % and 51.93 % at 20,480 and 32,768",
)
HOST_COPY_GB_S = Measured(
    25.0, 12.0, 50.0,
    "host-device copy GB/s per GPU with eight GPUs sharing a host: H100 nvbandwidth 35.2 GB/s "
    "host to device and 52.8 device to host (nvbandwidth issue 24); A100 PCIe Gen4 ~25 GB/s "
    "measured (BaM paper); a wrong NUMA node gives a third of that",
)
SYNC_LATENCY = Measured(
    0.05, 0.02, 0.2,
    "seconds of a weight sync that no byte or tensor explains: RPCs to the engines, a barrier, "
    "cache resets. A small model's whole refit in NeMo RL took 0.08 s, 0.05 s of it getting the "
    "IPC handles and 0.02 s updating (PR 1076)",
)
