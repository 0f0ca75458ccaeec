"""The sim's cost model against published mixture-of-experts and long-context figures, predicted
with the project's defaults and the datasheets' peaks: nothing here is fitted to the figure it is
compared with. Sources, quotes and setups: docs/results/2026-12-05-moe-published-checks.md.

    python -m bench.moe_published
"""

from __future__ import annotations

from core.model.config import Scenario
from core.sim.costs import DecodeCost, TrainCost

# config.json figures (Qwen3 model cards and configs; the check's file lists the sources).
QWEN3_30B_A3B = {
    "name": "Qwen3-30B-A3B", "params_b": 30.53, "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128,
    "vocab": 151936, "experts": 128, "experts_per_token": 8, "expert_params_b": 3 * 2048 * 768 * 48 / 1e9,
}
QWEN3_235B_A22B = {
    "name": "Qwen3-235B-A22B", "params_b": 235.09, "layers": 94, "hidden": 4096, "heads": 64, "kv_heads": 4, "head_dim": 128,
    "vocab": 151936, "experts": 128, "experts_per_token": 8, "expert_params_b": 3 * 4096 * 1536 * 94 / 1e9,
}
# Datasheet peaks (dense): H100 SXM 3.35 TB/s, 989 BF16 / 1,979 FP8 TFLOP/s; A100 80 GB SXM 2.04 TB/s,
# 312 BF16; H20 4.0 TB/s, 148 BF16 / 296 FP8 (the project's default GPU).
H100 = {"name": "H100", "hbm_gb_s": 3350.0, "bf16_tflops": 989.0, "fp8_tflops": 1979.0, "memory_gb": 80.0}
A100 = {"name": "A100", "hbm_gb_s": 2039.0, "bf16_tflops": 312.0, "memory_gb": 80.0}
H20 = {"name": "H20", "hbm_gb_s": 4000.0, "bf16_tflops": 148.0, "fp8_tflops": 296.0, "memory_gb": 96.0}


def scenario(model: dict, gpu: dict, gpus_per_engine: int = 1, **engine) -> Scenario:
    return Scenario.model_validate({
        "model": model, "gpu": gpu, "engine": {"kind": "sim", **engine}, "workload": {"max_response_len": 8192},
        "resources": {"rollout_gpus": 8, "trainer_gpus": 8, "gpus_per_engine": gpus_per_engine},
    })


def predictions() -> list[tuple[str, float, float, str]]:
    """(what, predicted, published, unit) for every check."""
    out = []
    # A1: vLLM, 1 x H100, bf16, 10 concurrent requests, 2,048 in / 1,024 out: mean TPOT 13.18 ms.
    a1 = DecodeCost(scenario(QWEN3_30B_A3B, H100), 1)
    out.append(("A1 Qwen3-30B-A3B decode step, H100, 10 sequences at 2,560 context", a1.step_s(10, 10 * 2560.0) * 1e3, 13.18, "ms"))
    # A2: 1 x A100, one stream, 128 and 8,192 tokens in: TPOT 9.6 and 10.6 ms.
    a2 = DecodeCost(scenario(QWEN3_30B_A3B, A100), 1)
    out.append(("A2 Qwen3-30B-A3B decode step, A100, 1 sequence at 192 context", a2.step_s(1, 192.0) * 1e3, 9.6, "ms"))
    out.append(("A2 Qwen3-30B-A3B decode step, A100, 1 sequence at 8,256 context", a2.step_s(1, 8256.0) * 1e3, 10.6, "ms"))
    # B1: Megatron-Bridge (25.09, DGX-H100), model TFLOP/s per GPU over tokens/s per GPU at 4,096 tokens.
    for model, published in ((QWEN3_30B_A3B, 241e12 / 10494), (QWEN3_235B_A22B, 178e12 / 1204)):
        train = TrainCost(scenario(model, H100, gpus_per_engine=8), 8)
        per_token = train.model_flops(4096.0, 4096.0**2) / 4096.0
        out.append((f"B1 {model['name']} training FLOPs per token at 4,096", per_token / 1e9, published / 1e9, "GFLOP"))
    # C1: SGLang, Qwen3-235B-A22B-FP8 on H20, one request. PP1 TP4 at 128K: ~55.5 s.
    c1 = DecodeCost(scenario(QWEN3_235B_A22B, H20, gpus_per_engine=4, dtype="fp8"), 4)
    out.append(("C1 Qwen3-235B-A22B-FP8 prefill of 128K, 4 x H20 (TP4)", c1.prefill_s(0, 131072), 55.5, "s"))
    # PP8 TP4: 10.54 / 32.68 / 114.33 / 420.91 s at 128K, 256K, 512K, 1M; the ratios need no efficiency.
    published = {131072: 10.54, 262144: 32.68, 524288: 114.33, 1048576: 420.91}
    lengths = sorted(published)
    for short, long in zip(lengths, lengths[1:]):
        ratio = c1.prefill_s(0, long) / c1.prefill_s(0, short)
        out.append((f"C1 prefill time {long // 1024}K over {short // 1024}K", ratio, published[long] / published[short], "x"))
    return out


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="The sim's cost model against published figures (predicted, not fitted)")
    for col in ("check", "predicted", "published", "error"):
        table.add_column(col, justify="left" if col == "check" else "right")
    for what, predicted, published, unit in predictions():
        table.add_row(what, f"{predicted:.3g} {unit}", f"{published:.3g} {unit}", f"{100 * (predicted / published - 1):+.0f} %")
    Console().print(table)


if __name__ == "__main__":
    main()
