"""Cost models of the simulated runtime: decode, prefill, training and weight transfer.

Each is a roofline from the scenario's hardware and model figures, nothing fitted.
"""

from __future__ import annotations

from core.model.config import Scenario


class DecodeCost:
    """Time of one continuous-batching decode step of one engine.

    step(B, C) = overhead + max(weights / bw, B * 2P / flops) + C * kv_bytes / bw,
    with B running sequences holding C context tokens in all: the weights are read once
    per step, every running sequence's KV cache is read once per step.
    """

    def __init__(self, sc: Scenario, gpus: int) -> None:
        m, g, r = sc.model, sc.gpu, sc.rollout
        bw = g.hbm_gb_s * 1e9 * g.hbm_efficiency * gpus
        flops = g.bf16_tflops * 1e12 * gpus
        self.params = m.params_b * 1e9
        self.overhead_s = r.decode_overhead_s
        self.weights_s = self.params * m.dtype_bytes / bw
        self.per_seq_compute_s = 2.0 * self.params / (flops * r.decode_mfu)
        self.kv_bytes_per_token = 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes
        self.kv_s_per_token = self.kv_bytes_per_token / bw
        self._attn = 2.0 * m.layers * m.hidden
        self._prefill_flops = flops * r.prefill_mfu

    def base_s(self, running: int) -> float:
        """The part of a step that does not grow with context."""
        return self.overhead_s + max(self.weights_s, running * self.per_seq_compute_s)

    def step_s(self, running: int, context_tokens: float) -> float:
        return self.base_s(running) + context_tokens * self.kv_s_per_token

    def prefill_s(self, start: int, end: int) -> float:
        """Prefill of context positions [start, end): dense FLOPs plus causal attention."""
        new = end - start
        if new <= 0:
            return 0.0
        return (2.0 * self.params * new + self._attn * (end * end - start * start)) / self._prefill_flops


class TrainCost:
    """Time of one trainer step: forward + backward FLOPs over the batch at a stated MFU.

    Forward + backward is 3 forwards; recomputing log-probs first adds one more.
    """

    def __init__(self, sc: Scenario, gpus: int, recompute_logprobs: bool = False) -> None:
        m, t = sc.model, sc.trainer
        self.params = m.params_b * 1e9
        self.passes = 4.0 if recompute_logprobs else 3.0
        self._attn = 2.0 * self.passes * m.layers * m.hidden
        self.flops = gpus * sc.gpu.bf16_tflops * 1e12 * t.mfu
        self.overhead_s = t.step_overhead_s

    def sample_flops(self, tokens: float, tokens_sq: float) -> float:
        """FLOPs of training on sequences with sum of lengths ``tokens`` and sum of squares ``tokens_sq``."""
        return 2.0 * self.passes * self.params * tokens + self._attn * tokens_sq

    def step_s(self, tokens: float, tokens_sq: float) -> float:
        return self.overhead_s + self.sample_flops(tokens, tokens_sq) / self.flops


class TransferCost:
    """Weight transfer: latency + bytes / bandwidth; a broadcast costs one pass however many receive."""

    def __init__(self, sc: Scenario, colocated: bool) -> None:
        s = sc.sync
        self.bytes = sc.model.params_b * 1e9 * sc.model.dtype_bytes
        self.latency_s = s.latency_s + (s.colocated_switch_s if colocated else 0.0)
        self.bandwidth = (s.colocated_bandwidth_gb_s if colocated else s.bandwidth_gb_s) * 1e9

    def seconds(self) -> float:
        return self.latency_s + self.bytes / self.bandwidth
