"""The error band of a prediction: which inputs are uncertain, by how much, and what that does to
each mode's speedup.

Every uncertain input is a dotted scenario key with a range: a factor on the scenario's own value
(``RELATIVE``), or the range of its measurement (``core.model.measurements``). ``band.ranges``
in a scenario replaces or adds ranges. A band draws ``band.points`` scenarios over a Latin
hypercube of the ranges (log-uniform: every range is of positive figures, and a factor of 2 up
weighs as much as one down), runs each, and reports per mode the 10th, 50th and 90th percentile
of its speedup over sync and the input whose rank correlation with the speedup is strongest:
the one to measure first. Calibrated inputs (``harness.calibrate``) replace the roofline terms
they measured, so those ranges give way to the fit's own error, and a measured length
distribution (``workload.lengths``) to none: a short real run narrows the band.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.model.config import Scenario
from core.model.measurements import COLLECTIVE_CALL, EAGER_LAYER, EAGER_MOE_LAYER, HOST_COPY_GB_S, KV_REBUILD, MICRO_BATCH_HALF_TOKENS, PER_TENSOR, SYNC_LATENCY

# (low, high) factors on the scenario's value, and why.
RELATIVE: dict[str, tuple[float, float, str]] = {
    "workload.response_median": (0.25, 2.5, "rarely published, the largest unknown: mean responses of math RL runs of "
                                 "1.5-8B models span ~500 to ~5,000 tokens (NeMo RL PR 2416: Qwen2.5-7B ~800; NeMo RL's "
                                 "performance summary: Llama-3.1-8B ~1,000 with the prompt; DeepScaleR-1.5B 3,500-5,500)"),
    "workload.response_sigma": (0.8, 1.2, "the tail's weight, rarely published"),
    "rollout.decode_overhead_s": (0.5, 2.0, "a graph step's host cost: 1-3 ms (SGLang #5593's 2 ms bubble; xLLM's 2.72 ms step)"),
    "rollout.decode_mfu": (0.6, 1.4, "decode GEMM efficiency once compute-bound, assumed"),
    "gpu.hbm_efficiency": (0.85, 1.1, "a decode step's share of peak HBM bandwidth"),
    "trainer.mfu": (0.75, 1.3, "large-batch training MFU: 29-46 % in llm-foundry's 7B H100 rows, 33-39 % in torchtitan's, "
                    "50-52 % on A100s, whose lower peak is easier to reach"),
    "trainer.step_overhead_s": (0.5, 2.0, "a step's fixed host cost, assumed"),
    "sync.bandwidth_gb_s": (0.35, 1.0, "an RDMA NIC's share in a weight sync: 8.25 of 50 GB/s in verl's checkpoint-engine benchmark"),
    "gpu.interconnect_gb_s": (0.5, 1.0, "the trainer's collectives' share of the NIC, up to line rate"),
}
# Ranges of measured figures, as measured (core/model/measurements.py).
MEASURED: dict[str, tuple[float, float, str]] = {
    "rollout.eager_layer_s": (EAGER_LAYER.low, EAGER_LAYER.high, "EAGER_LAYER"),
    "rollout.eager_moe_layer_s": (EAGER_MOE_LAYER.low, EAGER_MOE_LAYER.high, "EAGER_MOE_LAYER"),
    "sync.per_tensor_s": (PER_TENSOR.low, PER_TENSOR.high, "PER_TENSOR"),
    "sync.bucket_overhead_s": (COLLECTIVE_CALL.low, COLLECTIVE_CALL.high, "COLLECTIVE_CALL"),
    "sync.offload_gb_s": (HOST_COPY_GB_S.low, HOST_COPY_GB_S.high, "HOST_COPY_GB_S"),
    "sync.kv_rebuild_s": (KV_REBUILD.low, KV_REBUILD.high, "KV_REBUILD"),
    "sync.latency_s": (SYNC_LATENCY.low, SYNC_LATENCY.high, "SYNC_LATENCY"),
    "trainer.micro_batch_half_tokens": (MICRO_BATCH_HALF_TOKENS.low, MICRO_BATCH_HALF_TOKENS.high, "MICRO_BATCH_HALF_TOKENS"),
}
# Calibrated coefficients (harness.calibrate) scaled together, by the fit's relative error.
CALIBRATED: dict[str, tuple[tuple[str, ...], str]] = {
    "calibrated.decode": (("decode_overhead_s", "decode_per_seq_s", "decode_kv_s_per_token", "prefill_s_per_token"), "decode_error"),
    "calibrated.train": (("train_overhead_s", "train_s_per_token", "train_s_per_token_sq"), "train_error"),
    "calibrated.transfer": (("transfer_s",), "transfer_error"),
}
# What a calibration replaces: the roofline inputs of the terms it measured.
_REPLACED_BY_CALIBRATION = frozenset({
    "rollout.decode_overhead_s", "rollout.decode_mfu", "gpu.hbm_efficiency", "rollout.eager_layer_s", "rollout.eager_moe_layer_s",
    "trainer.mfu", "trainer.step_overhead_s", "trainer.micro_batch_half_tokens", "gpu.interconnect_gb_s",
    "sync.bandwidth_gb_s", "sync.latency_s", "sync.per_tensor_s", "sync.bucket_overhead_s", "sync.offload_gb_s", "sync.kv_rebuild_s",
})
PERCENTILES = (10, 50, 90)


@dataclass(frozen=True)
class Knob:
    """One uncertain input: a dotted key (or a calibrated group) drawn from [low, high]."""

    key: str
    low: float
    high: float
    why: str


def _value(sc: Scenario, key: str):
    obj = sc
    for part in key.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def knobs(sc: Scenario) -> list[Knob]:
    """The scenario's uncertain inputs, each with the range the band draws from: those that can
    change its figures (an eager launch term only without CUDA graphs, a MoE term only for a
    mixture of experts, lengths only without a measured length file...)."""
    out: dict[str, Knob] = {}
    eager = sc.rollout.enforce_eager
    for key, (lo, hi, why) in RELATIVE.items():
        v = _value(sc, key)
        if v is None or isinstance(v, bool) or v <= 0:
            continue
        if key.startswith("workload.response_") and sc.workload.lengths is not None:
            continue  # measured lengths: nothing to draw
        high = v * hi
        if key in ("rollout.decode_mfu", "gpu.hbm_efficiency"):
            high = min(high, 1.0)
        out[key] = Knob(key, v * lo, high, why)
    for key, (lo, hi, why) in MEASURED.items():
        if key.startswith("rollout.eager") and not eager:
            continue
        if key == "rollout.eager_moe_layer_s" and sc.model.experts == 1:
            continue
        if key == "trainer.micro_batch_half_tokens" and sc.trainer.micro_batch_tokens is None:
            continue
        if key in ("sync.offload_gb_s", "sync.kv_rebuild_s") and sc.sync.colocated_switch_s is not None:
            continue
        out[key] = Knob(key, lo, hi, f"measured: core/model/measurements.py {why}")
    if sc.calibrated is not None:
        for key in _REPLACED_BY_CALIBRATION:
            out.pop(key, None)
        for key, (_, error_key) in CALIBRATED.items():
            err = getattr(sc.calibrated, error_key)
            if err > 0:
                out[key] = Knob(key, max(0.05, 1.0 - 2.0 * err), 1.0 + 2.0 * err, f"the fit's relative error {err:.1%}, twice")
    for key, (lo, hi) in sc.band.ranges.items():
        out[key] = Knob(key, lo, hi, "band.ranges")
    return sorted(out.values(), key=lambda k: k.key)


def latin_hypercube(points: int, dims: int, seed: int) -> np.ndarray:
    """``points`` x ``dims`` draws in [0, 1): each dimension's points one per stratum of width
    1 / points, the strata shuffled independently per dimension."""
    rng = np.random.default_rng([seed, 52])
    u = (np.arange(points)[:, None] + rng.random((points, dims))) / points
    for d in range(dims):
        u[:, d] = u[rng.permutation(points), d]
    return u


def draws(sc: Scenario) -> tuple[list[Knob], np.ndarray]:
    """The band's knobs and its ``band.points`` x knobs values, log-uniform over each range."""
    ks = knobs(sc)
    u = latin_hypercube(sc.band.points, len(ks), sc.seed)
    lo = np.log([k.low for k in ks]) if ks else np.zeros(0)
    hi = np.log([k.high for k in ks]) if ks else np.zeros(0)
    return ks, np.exp(lo + u * (hi - lo))


def changes(sc: Scenario, ks: list[Knob], row: np.ndarray) -> dict:
    """The ``with_changes`` of one point: each knob's value; a calibrated group scales its
    coefficients by the drawn factor. Whole numbers stay whole."""
    out: dict = {}
    for k, v in zip(ks, row):
        if k.key in CALIBRATED:
            for name in CALIBRATED[k.key][0]:
                out[f"calibrated.{name}"] = getattr(sc.calibrated, name) * float(v)
            continue
        current = _value(sc, k.key)
        out[k.key] = int(round(v)) if isinstance(current, int) and not isinstance(current, bool) else float(v)
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    return r


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Rank correlation of two samples (0 where either does not vary)."""
    rx, ry = _ranks(np.asarray(x, float)), _ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def summarize(ks: list[Knob], values: np.ndarray, speedups: np.ndarray) -> dict:
    """One mode's band from its speedup at each point (NaN where a point failed): percentiles,
    and the knob that moves it most, by the absolute rank correlation."""
    ok = np.isfinite(speedups)
    s = speedups[ok]
    if not len(s):
        return {"points": 0}
    lo, mid, hi = (float(np.percentile(s, p)) for p in PERCENTILES)
    corr = [(abs(spearman(values[ok, i], s)), spearman(values[ok, i], s), k) for i, k in enumerate(ks)]
    best = max(corr, key=lambda c: c[0]) if corr else None
    out = {"points": int(ok.sum()), "p10": lo, "p50": mid, "p90": hi}
    if best is not None and best[0] > 0:
        out["measure_first"] = best[2].key
        out["measure_first_rank_corr"] = best[1]
        out["measure_first_range"] = [best[2].low, best[2].high]
    return out


def inside(band: dict, value: float) -> bool:
    """Whether ``value`` lies in the band's 10th-90th percentile interval."""
    return "p10" in band and band["p10"] <= value <= band["p90"] and math.isfinite(value)
