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


def launch_s(sc: Scenario) -> float:
    """Seconds a decode step without CUDA graphs (``rollout.enforce_eager: true``, vLLM's
    enforce_eager) spends on host launches that the GPU's work does not hide: per layer
    ``rollout.eager_layer_s``, plus ``rollout.eager_moe_layer_s`` for a mixture-of-experts layer.
    Added to the step, as it was measured: eager minus graph latency at the same batch
    (core/model/measurements.py). 0 with graphs, whose replay is one launch inside
    ``rollout.decode_overhead_s``."""
    r, m = sc.rollout, sc.model
    if not r.enforce_eager:
        return 0.0
    return m.layers * (r.eager_layer_s + (r.eager_moe_layer_s if m.experts > 1 else 0.0))


class DecodeCost:
    """Time of one continuous-batching decode step of one engine.

    step(B, C) = overhead + launch + max(weights(B) / bw, B * 2P / flops) + allreduce(B) + C * kv_bytes / bw,
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
        self.launch_s = launch_s(sc)
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
            self.experts_s = self.launch_s = 0.0
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
        """The part of a step that does not grow with context, eager launches (``launch_s``) included."""
        read = self.weights_s if not self.experts_s else self.read_s(running)  # no call for a dense model: per event
        return (self.overhead_s + self.launch_s + max(read, running * self.per_seq_compute_s)
                + self.allreduce_fixed_s + running * self.allreduce_per_seq_s)

    def base_s_many(self, running: np.ndarray) -> np.ndarray:
        """``base_s`` of many (possibly fractional) running counts at once."""
        read = self.weights_s + self.experts_s * (1.0 - self._miss**running) if self.experts_s else self.weights_s
        return (self.overhead_s + self.launch_s + np.maximum(read, running * self.per_seq_compute_s)
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
    fixed part: ``trainer.step_overhead_s`` and the data-parallel collectives.

    Forward + backward is 3 forwards; recomputing log-probs first adds one more, a reference
    policy's forward (``trainer.reference``) one more, and activation recompute (gradient
    checkpointing) one more in the backward. ``colocated``: the trainer shares its GPUs with the
    engines and runs at ``trainer.colocated_mfu`` if set.

    Without ``trainer.micro_batch_tokens`` the collectives are priced once per optimizer step and
    not overlapped (``dp_comm_s``), at one MFU whatever the tokens per GPU. With it, each GPU runs
    its share of an optimizer step's tokens in micro-batches of at most that many tokens (fewer
    where memory caps them, ``micro_batch_cap``); a micro-batch of x tokens reaches
    ``mfu * x / (x + x_half)`` (``trainer.micro_batch_half_tokens``), and a
    sharded trainer gathers the weights and reduce-scatters the gradients once per micro-batch,
    overlapped with its compute, so a micro-batch costs the longer of the two
    (``MicroBatches``), and the optimizer update is priced (``optimizer_s``)."""

    def __init__(self, sc: Scenario, gpus: int, recompute_logprobs: bool = False, colocated: bool = False) -> None:
        m, t = sc.model, sc.trainer
        self.params = active_params(m)
        # What the algorithm needs (model FLOPs), and what the GPUs run (activation recompute too).
        self.forwards = (1.0 if recompute_logprobs else 0.0) + (1.0 if t.reference else 0.0)  # forward-only passes
        self.model_passes = 3.0 + self.forwards
        self.passes = self.model_passes + (1.0 if t.activation_recompute else 0.0)
        self._attn = 2.0 * self.passes * m.layers * attention_width(m)
        self.peak_flops = gpus * sc.gpu.bf16_tflops * 1e12
        mfu = t.colocated_mfu if colocated and t.colocated_mfu is not None else t.mfu
        self.flops = self.peak_flops * mfu
        self.overhead_s = t.step_overhead_s
        self.micro = MicroBatches(sc, gpus, colocated) if t.micro_batch_tokens is not None else None
        self.comm_s = 0.0 if self.micro is not None else dp_comm_s(sc, gpus, recompute_logprobs)
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
        alltoall = tokens * self.alltoall_s_per_token
        if self.micro is None:
            return self.fixed_s + self.sample_flops(tokens, tokens_sq) / self.flops + alltoall
        flops_s = self.sample_flops(tokens, tokens_sq) / self.flops
        forward_share = self.forwards / self.passes
        return self.fixed_s + alltoall + self.micro.seconds(tokens, flops_s * (1.0 - forward_share), flops_s * forward_share, self.forwards)


class MicroBatches:
    """A data-parallel trainer's micro-batches at a fixed global batch (``TrainCost``).

    Per optimizer step each of the g GPUs trains T = tokens / (steps * g) tokens in
    n = ceil(T / cap) micro-batches of x = T / n. A micro-batch of x tokens runs its GEMMs at
    x / (x + x_half) of the large-batch MFU (llm-foundry's FSDP table,
    ``trainer.micro_batch_half_tokens``). With sharded weights (``trainer.weights_sharded``) it
    gathers them for its forward and backward and reduce-scatters its gradients
    (``P * (2 * dtype + grad_bytes) * (g - 1) / g`` bytes per GPU over NVLink within a node,
    ``gpu.interconnect_gb_s`` beyond), overlapped: a micro-batch costs max(compute, collectives),
    and forward-only passes (log-prob recompute, the reference) run in micro-batches of their
    own, one gather each. Replicated weights reduce the gradients and gather the update once per
    optimizer step (``P * (dtype + grad_bytes) * (g - 1) / g``), hidden behind the last
    micro-batch only. The optimizer update reads and writes Adam's state once per optimizer step
    (``optimizer_s``).

    So a fixed global batch on more GPUs gives each fewer tokens: smaller micro-batches, lower MFU,
    and the same bytes per micro-batch on the network, which stop hiding behind compute."""

    def __init__(self, sc: Scenario, gpus: int, colocated: bool) -> None:
        m, t, g = sc.model, sc.trainer, sc.gpu
        self.gpus = gpus
        self.cap = max(1.0, min(float(t.micro_batch_tokens), micro_batch_cap(sc, gpus, colocated)))
        self.steps = t.batch_size // (t.minibatch_size or t.batch_size)
        self.half = t.micro_batch_half_tokens
        params = m.params_b * 1e9
        share = (gpus - 1) / gpus if gpus > 1 and g.interconnect_gb_s is not None else 0.0
        link = (g.nvlink_gb_s if gpus <= g.gpus_per_node else (g.interconnect_gb_s or g.nvlink_gb_s)) * 1e9
        self.sharded = t.weights_sharded
        # Sharded: per micro-batch, two gathers and a reduce-scatter; replicated: per optimizer
        # step, the gradients reduced and the updated weights gathered (forward-only passes: nothing).
        self.train_comm_s = share * params * ((2 if self.sharded else 1) * m.dtype_bytes + t.grad_reduce_bytes) / link
        self.forward_comm_s = share * params * m.dtype_bytes / link if self.sharded else 0.0
        self.optimizer_s = optimizer_s(sc, gpus)

    def efficiency(self, x: float) -> float:
        """The share of the large-batch MFU a micro-batch of ``x`` tokens per GPU reaches."""
        return x / (x + self.half)

    def seconds(self, tokens: float, train_s: float, forward_s: float, forwards: float) -> float:
        """A step of ``tokens`` whose training passes take ``train_s`` and forward-only passes
        ``forward_s`` at the large-batch MFU, all GPUs busy."""
        per_gpu = tokens / (self.steps * self.gpus)
        n = max(1, math.ceil(per_gpu / self.cap - 1e-9))
        x = per_gpu / n
        eff = self.efficiency(x) if x > 0 else 1.0
        micro = self.steps * n
        compute = train_s / eff / micro  # one micro-batch's
        if self.sharded:
            total = micro * max(compute, self.train_comm_s)
        else:  # the step's reduction hides behind its last micro-batch only
            total = micro * compute + self.steps * max(0.0, self.train_comm_s - compute)
        total += self.steps * self.optimizer_s
        if forwards:
            n_fwd = max(1, math.ceil(tokens / self.gpus / self.cap - 1e-9))
            x_fwd = tokens / self.gpus / n_fwd
            eff_fwd = self.efficiency(x_fwd) if x_fwd > 0 else 1.0
            total += forwards * n_fwd * max(forward_s / forwards / eff_fwd / n_fwd, self.forward_comm_s)
        return total


# Adam in mixed precision, per parameter and optimizer step: it reads the fp32 master weight, the
# gradient and both moments (16 bytes) and writes the master weight, both moments and the bf16
# copy (14 bytes) (ZeRO paper's 16 bytes of model state, read and rewritten).
ADAM_BYTES_PER_PARAM = 30.0


def optimizer_s(sc: Scenario, gpus: int) -> float:
    """Seconds of one optimizer update on each GPU: Adam's bytes for its parameters at HBM speed,
    1 / gpus of them where the state is sharded (``trainer.optimizer_sharded``), all of them else."""
    g = sc.gpu
    shards = gpus if sc.trainer.optimizer_sharded else 1
    return sc.model.params_b * 1e9 / shards * ADAM_BYTES_PER_PARAM / (g.hbm_gb_s * 1e9 * g.hbm_efficiency)


# Training bytes per token per layer of 16-bit activations without recompute, attention by a fused
# kernel (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
# s*b*h*(34 + 5*a*s/h), the second term gone with flash attention).
ACTIVATION_BYTES_PER_HIDDEN = 34.0


def micro_batch_cap(sc: Scenario, gpus: int, colocated: bool) -> float:
    """Tokens one trainer GPU can hold in a micro-batch: its memory less the trainer's model state
    (16 bytes a parameter, ZeRO; sharded over the GPUs as ``trainer.optimizer_sharded`` says) and,
    colocated, what the engines keep (``sync.engine_sleeps``), over the activations of a token:
    34 x hidden bytes a layer (Korthikanti et al.), or with activation recompute 2 x hidden a layer
    kept plus one layer's 34 x hidden, and the fp32 logits of a token (vocab x 4) that log-probs need."""
    m, t, g, r = sc.model, sc.trainer, sc.gpu, sc.rollout
    params = m.params_b * 1e9
    state = params * 16.0 / (gpus if t.optimizer_sharded else 1)
    kept = 0.0
    if colocated:
        kept = (r.activation_reserve_gb if sc.sync.engine_sleeps else g.memory_gb * r.gpu_memory_utilization) * 1e9
    h = m.hidden * m.dtype_bytes / 2.0
    per_token = (2.0 * h * m.layers + ACTIVATION_BYTES_PER_HIDDEN * h) if t.activation_recompute else ACTIVATION_BYTES_PER_HIDDEN * h * m.layers
    per_token += 4.0 * (m.vocab or 0)
    return (g.memory_gb * 1e9 - state - kept) / per_token


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


def model_tensors(sc: Scenario) -> int:
    """Named tensors a sync moves: ``model.tensors``, else counted from the architecture in Qwen's
    layout (12 a dense layer; 9 + 3 x experts a MoE layer; plus embeddings, final norm and head);
    with ``trainer.lora`` the adapter's A and B of each targeted matrix of each layer."""
    m, lora = sc.model, sc.trainer.lora
    if lora is not None:
        return m.layers * len(lora.targets) * 2
    if m.tensors is not None:
        return m.tensors
    per_layer = 9 + 3 * m.experts if m.experts > 1 else 12
    return m.layers * per_layer + 3


def fits_one_node(sc: Scenario) -> bool:
    """Whether the trainer and the engines of a separated placement share one node's NVLink."""
    r = sc.resources
    return r.rollout_gpus + r.trainer_gpus <= sc.gpu.gpus_per_node


class TransferCost:
    """Weight transfer at a sync.

    Colocated: latency + the switch between trainer and engine memory (``switch_s``: offload,
    reload, the KV cache released and rebuilt) + the in-node reshard at
    ``sync.colocated_bandwidth_gb_s`` + each tensor's host cost (``sync.per_tensor_s``).

    Separated, ``sync.transport: broadcast`` (core/real/weight_broadcast.py), by topology: over
    NVLink where trainer and engines share a node (``fits_one_node``), else the RDMA wire at
    ``sync.bandwidth_gb_s`` per NIC. Three stages run pipelined bucket by bucket (per tensor when
    not ``sync.bucketed``), so the slowest sets the pace and the others add one bucket's worth:
    the senders gather full tensors from the trainer's shards ((g - 1) / g of the bytes over the
    trainer's links, split over ``sync.senders``), the wire (one sender broadcasts every byte to
    every receiver; several senders each send a share, and each receiver takes only its
    tensor-parallel shard), and the receivers' load into their parameters at the device's copy
    rate. Host costs add: each tensor's ``sync.per_tensor_s`` and each collective call's
    ``sync.bucket_overhead_s`` (one a bucket, or one a tensor unbucketed), split over the senders:

        latency + tensors * per_tensor + calls * call + max(gather, wire, load) + one bucket's fill

    ``object_store``: float32 copies put once and resolved, written and reloaded by every engine
    at once, at ``sync.object_store_gb_s`` of float32 bytes (measured on this code).

    The bytes are the synced numbers (``synced_params``) at the dtype: every parameter, or with
    ``trainer.lora`` only the adapter's, ``adapter_params`` (the engines merge it into base
    weights they already hold; the merge itself is not priced). A colocated switch still moves
    the trainer's state and the engine's weights aside and back: those do not shrink.
    FP8 rollout (``engine.dtype: fp8``) receives the model's dtype and quantizes after
    (``quantize_s``), once per sync, added to the latency."""

    def __init__(self, sc: Scenario, colocated: bool) -> None:
        s, m, g, r = sc.sync, sc.model, sc.gpu, sc.resources
        params = synced_params(sc)
        self.bytes = params * m.dtype_bytes
        self.tensors = model_tensors(sc)
        self.switch_s = colocated_switch_s(sc) if colocated else 0.0
        self.latency_s = s.latency_s + self.switch_s + quantize_s(sc)
        self.pipeline_s = 0.0  # host costs, bucket overheads and the pipeline's fill, besides bytes / bandwidth
        if colocated:
            self.bandwidth = s.colocated_bandwidth_gb_s * 1e9
            self.pipeline_s = self.tensors * s.per_tensor_s
        elif s.transport == "object_store":
            self.bytes = params * 4.0
            self.bandwidth = s.object_store_gb_s * 1e9
        else:
            senders = max(1, min(s.senders, r.trainer_gpus))
            one_node = fits_one_node(sc)
            wire = (g.nvlink_gb_s if one_node else s.bandwidth_gb_s) * 1e9
            shard = r.gpus_per_engine if senders > 1 else 1  # a receiver takes its shard, or all
            wire_s = max(self.bytes / shard, self.bytes / senders) / wire
            trainer_link = (g.nvlink_gb_s if r.trainer_gpus <= g.gpus_per_node else (g.interconnect_gb_s or s.bandwidth_gb_s)) * 1e9
            gather_s = (r.trainer_gpus - 1) / r.trainer_gpus * self.bytes / senders / trainer_link
            load_s = self.bytes / shard / (g.hbm_gb_s * g.hbm_efficiency * 1e9 / 2.0)  # an in-place copy reads and writes
            stage_s = max(wire_s, gather_s, load_s)
            bucket = min(s.bucket_mb * 2**20, self.bytes) if s.bucketed else self.bytes / self.tensors
            calls = math.ceil(self.bytes / bucket) if s.bucketed else self.tensors
            fill_s = (wire_s + gather_s + load_s - stage_s) * bucket / self.bytes
            self.bandwidth = self.bytes / stage_s if stage_s > 0 else float("inf")
            self.pipeline_s = (self.tensors * s.per_tensor_s + calls * s.bucket_overhead_s) / senders + fill_s
        if sc.calibrated is not None:  # measured (harness/calibrate.py): the whole pause, whatever the bytes
            self.switch_s, self.latency_s, self.pipeline_s, self.bandwidth = 0.0, sc.calibrated.transfer_s, 0.0, float("inf")

    def seconds(self) -> float:
        return self.latency_s + self.pipeline_s + self.bytes / self.bandwidth


def colocated_switch_s(sc: Scenario) -> float:
    """Seconds per sync that colocated GPUs spend switching between trainer and engines:
    ``sync.colocated_switch_s`` if given, else each GPU's share of the trainer state (sharded over
    every GPU), of the reference weights (``trainer.reference``) and, where engines sleep
    (``sync.engine_sleeps``), of its engine's weights, out to the host and back at
    ``sync.offload_gb_s``, plus the engine's KV cache released and rebuilt (``sync.kv_rebuild_s``)."""
    s, r, m = sc.sync, sc.resources, sc.model
    if s.colocated_switch_s is not None:
        return s.colocated_switch_s
    params = m.params_b * 1e9
    gpus = r.rollout_gpus + r.trainer_gpus
    per_gpu = params * s.trainer_state_bytes_per_param / gpus
    if sc.trainer.reference:
        per_gpu += params * m.dtype_bytes / gpus
    rebuild = 0.0
    if s.engine_sleeps:
        per_gpu += params * m.dtype_bytes / r.gpus_per_engine
        rebuild = s.kv_rebuild_s
    return 2.0 * per_gpu / (s.offload_gb_s * 1e9) + rebuild
