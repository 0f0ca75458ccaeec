"""Cost models of the simulated runtime: decode, prefill, training and weight transfer.

Each is a roofline from the scenario's hardware and model figures, nothing fitted.
"""

from __future__ import annotations

import math

import numpy as np

from core.model.config import LoraSpec, ModelSpec, Scenario, engine_weight_bytes, kv_capacity_tokens


def matmul_params(m: ModelSpec) -> float:
    """Parameters a token is multiplied by: all but an untied input embedding, which is a lookup."""
    embedding = m.vocab * m.hidden if m.vocab is not None and not m.tied_embeddings else 0
    return m.params_b * 1e9 - embedding


def routed_params(m: ModelSpec) -> float:
    """Parameters of every routed expert of a mixture-of-experts model (0 for a dense one)."""
    return m.experts * m.expert_params_b * 1e9


def active_params(m: ModelSpec) -> float:
    """Matmul parameters one token is multiplied by: all but the untied input embedding and the
    routed experts it is not sent to (a dense model's ``matmul_params``)."""
    return matmul_params(m) - routed_params(m) + m.experts_per_token * m.expert_params_b * 1e9


def attention_width(m: ModelSpec) -> int:
    """Query heads x head_dim (``model.heads``), or ``hidden`` where the heads are not given."""
    return m.heads * m.head_dim if m.heads is not None else m.hidden


def adapter_params(m: ModelSpec, lora: LoraSpec) -> float:
    """Numbers in a LoRA adapter: A (r x in) and B (out x r) per targeted matrix per layer,

        layers * sum over targets of r * (in + out)

    with q_proj, o_proj hidden x hidden (heads x head_dim = hidden, as in Qwen2.5 and Llama),
    k_proj, v_proj hidden -> kv_heads x head_dim, gate_proj, up_proj hidden -> intermediate,
    down_proj intermediate -> hidden."""
    h, kv, i = m.hidden, m.kv_heads * m.head_dim, m.intermediate
    sides = {"q_proj": h + h, "k_proj": h + kv, "v_proj": h + kv, "o_proj": h + h,
             "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    return float(m.layers * sum(lora.rank * sides[t] for t in lora.targets))


def synced_params(sc: Scenario) -> float:
    """What a weight sync moves, in numbers: every parameter, or with ``trainer.lora`` the adapter's."""
    lora = sc.trainer.lora
    return sc.model.params_b * 1e9 if lora is None else adapter_params(sc.model, lora)


def engine_gemm_tflops(sc: Scenario) -> float:
    """The peak an engine's weight GEMMs reach: ``gpu.fp8_tflops`` in FP8 rollout where given, else BF16's."""
    g = sc.gpu
    return g.fp8_tflops if sc.engine.dtype == "fp8" and g.fp8_tflops is not None else g.bf16_tflops


def quantize_s(sc: Scenario) -> float:
    """Seconds an FP8 engine takes at each sync to quantize the weights it received in the model's
    dtype: per weight, one read to find each block's scale, one read and a one-byte write to
    quantize, at the HBM rate of its GPUs (each holds 1 / gpus_per_engine of them). 0 otherwise."""
    if sc.engine.dtype != "fp8":
        return 0.0
    g, m = sc.gpu, sc.model
    moved = m.params_b * 1e9 / sc.resources.gpus_per_engine * (2 * m.dtype_bytes + 1)
    return moved / (g.hbm_gb_s * 1e9 * g.hbm_efficiency)


def allreduce_s(sc: Scenario, gpus: int, tokens: float) -> float:
    """Tensor-parallel collectives of one forward over ``tokens`` tokens on ``gpus`` GPUs: two
    all-reduces per layer (after attention and after the MLP) of tokens x hidden activations, a
    ring moving 2 (g - 1) / g of them per GPU over NVLink, plus each one's fixed latency.

    With ``rollout.expert_parallel`` the MoE layer's all-reduce becomes two all-to-alls
    (``alltoall_bytes``: each token to its k experts' GPUs, and back), each with the same latency."""
    if gpus <= 1:
        return 0.0
    m = sc.model
    link = sc.gpu.nvlink_gb_s * 1e9
    ring_bytes = 2.0 * (gpus - 1) / gpus * tokens * m.hidden * m.dtype_bytes
    latency = sc.rollout.allreduce_latency_s
    if sc.rollout.expert_parallel == 1:
        return 2 * m.layers * (latency + ring_bytes / link)
    return m.layers * (latency + ring_bytes / link) + 2 * m.layers * (latency + alltoall_bytes(sc, gpus, tokens / gpus) / link)


def alltoall_bytes(sc: Scenario, ep: int, tokens_per_gpu: float) -> float:
    """Bytes one GPU sends in one all-to-all of a MoE layer spread over ``ep`` GPUs: each of its
    tokens' hidden state to each of its k experts, of which (ep - 1) / ep live on other GPUs
    (routing taken as uniform)."""
    m = sc.model
    return tokens_per_gpu * m.experts_per_token * m.hidden * m.dtype_bytes * (ep - 1) / ep


class DecodeCost:
    """Time of one continuous-batching decode step of one engine.

    step(B, C) = overhead + max(weights(B) / bw, B * 2P / flops) + allreduce(B) + C * kv_bytes / bw,
    with B running sequences holding C context tokens in all: the weights are read once
    per step, every running sequence's KV cache is read once per step. P counts the matmul
    weights one token is multiplied by (``active_params``); allreduce(B) is the
    tensor-parallel term, 0 on one GPU.

    weights(B): every matmul weight of a dense model. Of a mixture of experts, what is not
    routed plus the experts the step's B tokens touch: each token picks k of E experts per
    layer, so a layer reads E (1 - (1 - k/E)^B) distinct experts in expectation (routing
    taken as uniform; a skewed router touches fewer).
    """

    def __init__(self, sc: Scenario, gpus: int, colocated: bool = False) -> None:
        m, g, r = sc.model, sc.gpu, sc.rollout
        bw = g.hbm_gb_s * 1e9 * g.hbm_efficiency * gpus
        flops = engine_gemm_tflops(sc) * 1e12 * gpus
        self.params = active_params(m)
        self.overhead_s = r.decode_overhead_s
        routed = routed_params(m)
        wb = engine_weight_bytes(sc)  # FP8 rollout reads one byte a weight; KV stays in the model's dtype
        self.weights_s = (matmul_params(m) - routed) * wb / bw  # all of them for a dense model
        self.experts_s = routed * wb / bw  # every routed expert, read if every one is touched
        self._miss = 1.0 - m.experts_per_token / m.experts  # the chance a token skips a given expert
        self.per_seq_compute_s = 2.0 * self.params / (flops * r.decode_mfu)
        # allreduce(B) = fixed + B * per_seq: linear in the batch, one token per sequence.
        self.allreduce_fixed_s = allreduce_s(sc, gpus, 0.0)
        self.allreduce_per_seq_s = allreduce_s(sc, gpus, 1.0) - self.allreduce_fixed_s
        self.kv_bytes_per_token = 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes
        self.kv_s_per_token = self.kv_bytes_per_token / bw
        self._attn = 2.0 * m.layers * attention_width(m)
        self._prefill_flops = flops * r.prefill_mfu
        # Attention's matmuls (scores, values) stay in the model's dtype under FP8 weights.
        self._attn_flops = g.bf16_tflops * 1e12 * gpus * r.prefill_mfu
        # Calibrated (harness/calibrate.py): measured coefficients replace the roofline terms.
        cal = sc.calibrated
        self.prefill_s_per_token: float | None = None
        if cal is not None:
            # Measured in one placement; the other is faster or slower by the probed factor.
            fitted_colocated = cal.decode_placement == "colocated"
            scale = 1.0 if colocated == fitted_colocated else (
                1.0 / cal.separated_decode_speedup if fitted_colocated else cal.separated_decode_speedup)
            self.overhead_s, self.weights_s, self.per_seq_compute_s = cal.decode_overhead_s * scale, 0.0, cal.decode_per_seq_s * scale
            self.experts_s = 0.0
            self.allreduce_fixed_s = self.allreduce_per_seq_s = 0.0
            self.kv_s_per_token = cal.decode_kv_s_per_token * scale
            self.prefill_s_per_token = cal.prefill_s_per_token * scale
        # KV tokens the engine holds (core/sim/engine.py preempts when they run out).
        self.kv_capacity_tokens = kv_capacity_tokens(sc, gpus)

    def read_s(self, running: float) -> float:
        """Seconds to read the weights a step of ``running`` sequences multiplies by."""
        if not self.experts_s:
            return self.weights_s
        return self.weights_s + self.experts_s * (1.0 - self._miss**running)

    def base_s(self, running: int) -> float:
        """The part of a step that does not grow with context."""
        read = self.weights_s if not self.experts_s else self.read_s(running)  # no call for a dense model: per event
        return (self.overhead_s + max(read, running * self.per_seq_compute_s)
                + self.allreduce_fixed_s + running * self.allreduce_per_seq_s)

    def base_s_many(self, running: np.ndarray) -> np.ndarray:
        """``base_s`` of many (possibly fractional) running counts at once."""
        read = self.weights_s + self.experts_s * (1.0 - self._miss**running) if self.experts_s else self.weights_s
        return (self.overhead_s + np.maximum(read, running * self.per_seq_compute_s)
                + self.allreduce_fixed_s + running * self.allreduce_per_seq_s)

    def step_s(self, running: int, context_tokens: float) -> float:
        return self.base_s(running) + context_tokens * self.kv_s_per_token

    def prefill_s(self, start: int, end: int) -> float:
        """Prefill of context positions [start, end): dense FLOPs plus causal attention."""
        new = end - start
        if new <= 0:
            return 0.0
        if self.prefill_s_per_token is not None:  # calibrated
            return new * self.prefill_s_per_token
        if self._attn_flops == self._prefill_flops:
            flops_s = (2.0 * self.params * new + self._attn * (end * end - start * start)) / self._prefill_flops
        else:  # FP8 weight GEMMs beside attention in the model's dtype
            flops_s = 2.0 * self.params * new / self._prefill_flops + self._attn * (end * end - start * start) / self._attn_flops
        return flops_s + self.allreduce_fixed_s + new * self.allreduce_per_seq_s


class TrainCost:
    """Time of one trainer step: forward + backward FLOPs over the batch at a stated MFU, plus a
    fixed part: ``trainer.step_overhead_s`` and the data-parallel collectives (``dp_comm_s``).

    Forward + backward is 3 forwards; recomputing log-probs first adds one more, and
    activation recompute (gradient checkpointing) one more in the backward. ``colocated``: the
    trainer shares its GPUs with the engines and runs at ``trainer.colocated_mfu`` if set.
    """

    def __init__(self, sc: Scenario, gpus: int, recompute_logprobs: bool = False, colocated: bool = False) -> None:
        m, t = sc.model, sc.trainer
        self.params = active_params(m)
        # What the algorithm needs (model FLOPs), and what the GPUs run (activation recompute too).
        self.model_passes = 4.0 if recompute_logprobs else 3.0
        self.passes = self.model_passes + (1.0 if t.activation_recompute else 0.0)
        self._attn = 2.0 * self.passes * m.layers * attention_width(m)
        self.peak_flops = gpus * sc.gpu.bf16_tflops * 1e12
        mfu = t.colocated_mfu if colocated and t.colocated_mfu is not None else t.mfu
        self.flops = self.peak_flops * mfu
        self.overhead_s = t.step_overhead_s
        self.comm_s = dp_comm_s(sc, gpus, recompute_logprobs)
        self.alltoall_s_per_token = ep_alltoall_s(sc, gpus, self.passes)
        self.fixed_s = self.overhead_s + self.comm_s  # per step, whatever it trains
        # Calibrated (harness/calibrate.py): the measured step, overhead included (where it was
        # measured all of it ran on the devices), scaled from the devices it was measured on by
        # the measured (else linear) speed-up.
        self.calibrated = sc.calibrated
        if self.calibrated is not None:
            self.calibrated_scale = 1.0 / self.calibrated.train_speedup.get(gpus, gpus / self.calibrated.train_devices)

    def sample_flops(self, tokens: float, tokens_sq: float) -> float:
        """FLOPs of training on sequences with sum of lengths ``tokens`` and sum of squares ``tokens_sq``."""
        return 2.0 * self.passes * self.params * tokens + self._attn * tokens_sq

    def model_flops(self, tokens: float, tokens_sq: float) -> float:
        """The FLOPs of ``sample_flops`` that the algorithm needs: without activation recompute."""
        return self.sample_flops(tokens, tokens_sq) * self.model_passes / self.passes

    def step_s(self, tokens: float, tokens_sq: float) -> float:
        if self.calibrated is not None:
            cal = self.calibrated
            return (cal.train_overhead_s + cal.train_s_per_token * tokens + cal.train_s_per_token_sq * tokens_sq) * self.calibrated_scale
        return self.fixed_s + self.sample_flops(tokens, tokens_sq) / self.flops + tokens * self.alltoall_s_per_token


def ep_alltoall_s(sc: Scenario, gpus: int, passes: float) -> float:
    """Seconds per trained token of an expert-parallel trainer's all-to-alls (``trainer.expert_parallel``):
    every MoE layer sends each token to its experts' GPUs and back in each forward (passes - 2:
    the training forward, a log-prob forward, a recompute) and backward (one), its tokens spread
    over the ``gpus``; over NVLink within a node, ``gpu.interconnect_gb_s`` beyond, not hidden
    behind compute. 0 without expert parallelism."""
    ep = sc.trainer.expert_parallel
    if ep <= 1:
        return 0.0
    g = sc.gpu
    link = (g.nvlink_gb_s if ep <= g.gpus_per_node else g.interconnect_gb_s) * 1e9
    pairs = passes - 1  # forward + backward is 3 passes and 2 round trips; each extra forward one more
    return pairs * 2 * sc.model.layers * alltoall_bytes(sc, ep, 1.0 / gpus) / link


def dp_comm_s(sc: Scenario, gpus: int, logprob_pass: bool) -> float:
    """Seconds per trainer step of a sharded data-parallel trainer's collectives (FSDP / ZeRO-3):
    each optimizer step gathers the weights for the forward and again for the backward and
    reduce-scatters the gradients; a log-prob recompute gathers them once more. A ring moves
    (g - 1) / g of the bytes per GPU, over NVLink within a node, else ``gpu.interconnect_gb_s``.

    At a fixed global batch these bytes do not shrink with more GPUs while each GPU's compute
    does, so they are priced whole, not hidden behind compute: the upper end of what overlap
    leaves exposed. 0 without ``gpu.interconnect_gb_s`` or on one GPU."""
    g, m, t = sc.gpu, sc.model, sc.trainer
    if g.interconnect_gb_s is None or gpus <= 1:
        return 0.0
    bw = (g.nvlink_gb_s if gpus <= g.gpus_per_node else g.interconnect_gb_s) * 1e9
    params = m.params_b * 1e9
    optimizer_steps = t.batch_size // (t.minibatch_size or t.batch_size)
    moved = optimizer_steps * params * (2 * m.dtype_bytes + t.grad_reduce_bytes)
    if logprob_pass:
        moved += params * m.dtype_bytes
    return (gpus - 1) / gpus * moved / bw


class TransferCost:
    """Weight transfer at a sync; a broadcast costs one pass however many receive.

    Colocated: latency + the switch between trainer and engine memory (``switch_s``) + the
    in-node reshard at ``sync.colocated_bandwidth_gb_s``.

    Separated, ``sync.transport: broadcast`` (core/real/weight_broadcast.py): the weights in the
    model's dtype go out in buckets of ``sync.bucket_mb``; a receiver loads bucket i into its
    parameters while bucket i + 1 is on the wire, so of the two stages (wire at
    ``sync.bandwidth_gb_s``, load at the device's copy rate) the slower one sets the pace and the
    other adds one bucket's worth; each bucket pays ``sync.bucket_overhead_s``:

        latency + n_buckets * overhead + max(wire, load) + bucket / max(bandwidth, load rate)

    ``object_store``: float32 copies put once and resolved, written and reloaded by every engine
    at once, at ``sync.object_store_gb_s`` of float32 bytes (measured on this code).

    The bytes are the synced numbers (``synced_params``) at the dtype: every parameter, or with
    ``trainer.lora`` only the adapter's, ``adapter_params`` (the engines merge it into base
    weights they already hold; the merge itself is not priced). A colocated switch still moves
    the trainer's state and the engine's weights aside and back: those do not shrink.
    FP8 rollout (``engine.dtype: fp8``) receives the model's dtype and quantizes after
    (``quantize_s``), once per sync, added to the latency."""

    def __init__(self, sc: Scenario, colocated: bool) -> None:
        s, m, g = sc.sync, sc.model, sc.gpu
        params = synced_params(sc)
        self.bytes = params * m.dtype_bytes
        self.switch_s = colocated_switch_s(sc) if colocated else 0.0
        self.latency_s = s.latency_s + self.switch_s + quantize_s(sc)
        self.pipeline_s = 0.0  # bucket overheads and the pipeline's fill, besides bytes / bandwidth
        if colocated:
            self.bandwidth = s.colocated_bandwidth_gb_s * 1e9
        elif s.transport == "object_store":
            self.bytes = params * 4.0
            self.bandwidth = s.object_store_gb_s * 1e9
        else:
            wire = s.bandwidth_gb_s * 1e9
            load = g.hbm_gb_s * g.hbm_efficiency * 1e9 / 2.0  # an in-place copy reads and writes
            bucket = min(s.bucket_mb * 2**20, self.bytes)
            buckets = math.ceil(self.bytes / bucket)
            self.bandwidth = min(wire, load)
            self.pipeline_s = buckets * s.bucket_overhead_s + bucket / max(wire, load)
        if sc.calibrated is not None:  # measured (harness/calibrate.py): the whole pause, whatever the bytes
            self.switch_s, self.latency_s, self.pipeline_s, self.bandwidth = 0.0, sc.calibrated.transfer_s, 0.0, float("inf")

    def seconds(self) -> float:
        return self.latency_s + self.pipeline_s + self.bytes / self.bandwidth


def colocated_switch_s(sc: Scenario) -> float:
    """Seconds per sync that colocated GPUs spend moving state aside and back: ``sync.colocated_switch_s``
    if given, else each GPU's share of the trainer state (sharded over every GPU) plus its engine's
    weights (sharded over the engine's GPUs), out to the host and back at ``sync.offload_gb_s``."""
    s, r, m = sc.sync, sc.resources, sc.model
    if s.colocated_switch_s is not None:
        return s.colocated_switch_s
    params = m.params_b * 1e9
    per_gpu = params * s.trainer_state_bytes_per_param / (r.rollout_gpus + r.trainer_gpus)
    per_gpu += params * m.dtype_bytes / r.gpus_per_engine
    return 2.0 * per_gpu / (s.offload_gb_s * 1e9)
