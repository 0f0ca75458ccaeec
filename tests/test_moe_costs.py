"""Mixture-of-experts models in the sim's cost model: decode reads the experts a step's tokens
touch, compute and training use the active parameters, a weight sync moves every expert."""

import math

import pytest

from core.model.config import ConfigError, ModelSpec, Scenario, with_changes
from core.runtimes.dispatch import run_mode
from core.sim.costs import DecodeCost, TrainCost, TransferCost, active_params
from harness.metrics import collect

# Qwen3-30B-A3B (config.json: 48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128 experts,
# top 8, moe_intermediate_size 768, vocab 151,936 untied; 30.5 B parameters).
QWEN3_30B_A3B = {
    "name": "Qwen3-30B-A3B", "params_b": 30.53, "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128,
    "vocab": 151936, "experts": 128, "experts_per_token": 8, "expert_params_b": 3 * 2048 * 768 * 48 / 1e9,
}


def scenario(model: dict, **changes) -> Scenario:
    sc = Scenario.model_validate({
        "resources": {"rollout_gpus": 4, "trainer_gpus": 4},
        "workload": {"group_size": 8, "response_median": 600, "max_response_len": 4096},
        "trainer": {"batch_size": 64, "steps": 12, "sync_every": 2},
        "model": model,
    })
    return with_changes(sc, changes)


def test_a_dense_model_described_as_one_expert_gives_the_dense_figures():
    dense = scenario({})
    # Qwen2.5-7B's MLP as one "expert" that every token is routed to.
    one = scenario({"experts": 1, "experts_per_token": 1, "expert_params_b": 3 * 3584 * 18944 * 28 / 1e9})
    d, o = DecodeCost(dense, 1), DecodeCost(one, 1)
    for running in (1, 7, 64, 256):
        assert math.isclose(o.step_s(running, running * 900.0), d.step_s(running, running * 900.0), rel_tol=1e-12)
    assert math.isclose(o.prefill_s(100, 1600), d.prefill_s(100, 1600), rel_tol=1e-12)
    assert math.isclose(TrainCost(one, 8).step_s(5e5, 4e8), TrainCost(dense, 8).step_s(5e5, 4e8), rel_tol=1e-12)
    assert TransferCost(one, False).seconds() == TransferCost(dense, False).seconds()
    for mode in ("sync", "partial"):
        a, b = collect(run_mode(dense, mode)), collect(run_mode(one, mode))
        assert math.isclose(a["throughput/trained_tokens_per_s"], b["throughput/trained_tokens_per_s"], rel_tol=1e-9)
        assert a["samples/trained"] == b["samples/trained"]


def test_a_moe_decode_step_is_the_hand_formula():
    """Qwen3-30B-A3B on one H100 (3.35 TB/s at 80 %, 989 TFLOP/s): a step of B sequences reads
    what is not routed, plus E (1 - (1 - k/E)^B) experts per layer, plus the KV it holds."""
    sc = scenario(QWEN3_30B_A3B, **{"gpu.hbm_gb_s": 3350.0, "gpu.bf16_tflops": 989.0})
    cost = DecodeCost(sc, 1)
    bw = 3350e9 * 0.8
    expert = 3 * 2048 * 768 * 48  # one expert, every layer
    embedding = 151936 * 2048
    dense = 30.53e9 - embedding - 128 * expert
    for b in (1, 10, 64, 256):
        touched = 128 * (1 - (1 - 8 / 128) ** b)
        read = (dense + touched * expert) * 2 / bw
        compute = b * 2 * (dense + 8 * expert) / (989e12 * 0.5)
        kv = b * 2500 * (2 * 48 * 4 * 128 * 2) / bw
        assert math.isclose(cost.step_s(b, b * 2500.0), 0.002 + max(read, compute) + kv, rel_tol=1e-12)
    # Ten sequences touch about 61 of 128 experts: the step reads well under the whole model.
    assert cost.read_s(10) < 0.6 * cost.read_s(10_000)
    assert math.isclose(active_params(sc.model), dense + 8 * expert)


def test_training_and_prefill_multiply_active_parameters_and_the_attention_width():
    sc = scenario(QWEN3_30B_A3B)
    active = active_params(sc.model)
    width = 32 * 128  # twice the hidden size
    train = TrainCost(sc, 8)
    assert math.isclose(train.sample_flops(1000.0, 1e6), 2 * 3 * active * 1000 + 2 * 3 * 48 * width * 1e6, rel_tol=1e-12)
    pre = DecodeCost(sc, 1)
    flops = 2 * active * 1500 + 2 * 48 * width * (1600**2 - 100**2)
    assert math.isclose(pre.prefill_s(100, 1600), flops / (148e12 * 0.5), rel_tol=1e-12)
    # A weight sync moves every expert, not the active ones.
    assert TransferCost(sc, False).bytes == 30.53e9 * 2


@pytest.mark.parametrize("model, key", [
    ({"experts": 8, "experts_per_token": 9}, "model.experts_per_token"),
    ({"experts": 128, "expert_params_b": 0.5}, "model.expert_params_b"),
])
def test_experts_that_cannot_be_are_refused_by_key(model, key):
    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        ModelSpec.model_validate(model)


def test_a_moe_model_directory_gives_its_experts(tmp_path, tiny_model_dir):
    """config.json alone (a model not downloaded): Qwen3-MoE's and DeepSeek's keys. Without
    weights to count, a MoE's parameter count must be given."""
    import json

    qwen = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "num_hidden_layers": 48, "vocab_size": 151936, "tie_word_embeddings": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "torch_dtype": "bfloat16"}
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps(qwen))
    with pytest.raises(ValueError, match=r"model\.params_b = 7\.62: .* has no weights to count.*fix: set model\.params_b"):
        ModelSpec(path=str(tmp_path / "q"))
    m = ModelSpec(path=str(tmp_path / "q"), params_b=30.53)
    assert (m.heads, m.experts, m.experts_per_token) == (32, 128, 8)
    assert math.isclose(m.expert_params_b, QWEN3_30B_A3B["expert_params_b"])
    deepseek = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
                "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                "first_k_dense_replace": 3, "num_hidden_layers": 61, "vocab_size": 129280, "head_dim": 56}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(deepseek))
    d = ModelSpec(path=str(tmp_path / "d"), params_b=671.0)
    assert (d.experts, d.experts_per_token) == (256, 8)
    assert math.isclose(d.expert_params_b, 3 * 7168 * 2048 * 58 / 1e9)  # the first three layers are dense
    # A dense directory gives no experts.
    dense = ModelSpec(path=str(tiny_model_dir))
    assert (dense.experts, dense.expert_params_b) == (1, 0.0)


def test_fp8_rollout_halves_what_an_engine_reads_and_holds_and_quantizes_at_each_sync():
    bf16 = scenario(QWEN3_30B_A3B)
    fp8 = with_changes(bf16, {"engine.dtype": "fp8"})
    b, f = DecodeCost(bf16, 1), DecodeCost(fp8, 1)
    assert f.read_s(10) == pytest.approx(b.read_s(10) / 2) and f.kv_s_per_token == b.kv_s_per_token
    assert f.kv_capacity_tokens > b.kv_capacity_tokens  # the weights take half the memory
    # No gpu.fp8_tflops: the GEMMs run at the BF16 peak, only the bytes halve.
    assert f.per_seq_compute_s == b.per_seq_compute_s and f.prefill_s(0, 2000) == pytest.approx(b.prefill_s(0, 2000))
    # The sync moves the model's dtype and quantizes after: per weight two bf16 reads and a byte written.
    quantize = 30.53e9 * 5 / (4000e9 * 0.8)
    assert TransferCost(fp8, False).bytes == TransferCost(bf16, False).bytes
    assert TransferCost(fp8, False).seconds() == pytest.approx(TransferCost(bf16, False).seconds() + quantize)
    fast = with_changes(fp8, {"gpu.fp8_tflops": 296.0})
    assert DecodeCost(fast, 1).per_seq_compute_s == pytest.approx(b.per_seq_compute_s / 2)
    with pytest.raises(ValueError, match=r"engine\.dtype = 'fp8': FP8 rollout is modelled by the sim"):
        Scenario.model_validate({"runtime": "local", "engine": {"kind": "torch", "dtype": "fp8"}})


def test_training_flops_per_token_are_megatrons_for_qwen3_moe():
    """Megatron-Bridge's model TFLOP/s over its tokens/s (DGX-H100, 4,096 tokens) is the FLOPs per
    token its accounting gives; the trainer's cost model gives the same, with no efficiency in it."""
    from bench.moe_published import predictions

    b1 = [(p, q) for what, p, q, _ in predictions() if what.startswith("B1")]
    assert len(b1) == 2 and all(abs(p / q - 1) < 0.01 for p, q in b1)


def test_a_moe_runs_sync_and_async_times_are_the_hand_formula():
    """One group of 8 responses of exactly 500 tokens a step, on one engine of all the rollout
    GPUs; staleness 0, so async overlaps nothing and both modes are a sum of documented costs:
    per step the group's prompt prefilled once, 500 decode steps of 8 sequences, one trainer
    step, and a weight sync between steps."""
    g = 4  # GPUs per engine; sync colocates 4 + 4 on two engines, the group on one
    sc = scenario(QWEN3_30B_A3B, **{
        "resources": {"rollout_gpus": g, "trainer_gpus": g, "gpus_per_engine": g},
        "workload": {"group_size": 8, "prompt_tokens": 300, "response_median": 500, "response_sigma": 0.0, "max_response_len": 4096},
        "trainer": {"batch_size": 8, "sync_every": 1, "steps": 3, "step_overhead_s": 1.0},
        "staleness": {"max_staleness": 0}, "sync": {"transport": "object_store", "latency_s": 0.5, "colocated_switch_s": 2.0},
    })
    m, gpu = sc.model, sc.gpu
    bw, flops = 4000e9 * 0.8 * g, 148e12 * g
    expert = m.expert_params_b * 1e9
    dense = m.params_b * 1e9 - m.vocab * m.hidden - 128 * expert  # not routed, the input embedding a lookup
    active = dense + 8 * expert
    kv = 2 * 48 * 4 * 128 * 2  # bytes of one token's K and V, every layer
    width = 32 * 128
    ring = 2 * (g - 1) / g * 2048 * 2 / (450e9)  # one sequence's all-reduce bytes over NVLink, per all-reduce

    def step(b: int, ctx: float) -> float:
        touched = 128 * (1 - (1 - 8 / 128) ** b)
        return 0.002 + max((dense + touched * expert) * 2 / bw, b * 2 * active / (flops * 0.5)) \
            + 2 * 48 * (1e-5 + b * ring) + ctx * kv / bw

    prefill = (2 * active * 300 + 2 * 48 * width * 300**2) / (flops * 0.5) + 2 * 48 * (1e-5 + 300 * ring)
    generate = prefill + sum(step(8, 8 * (300 + k)) for k in range(500))
    tokens = 8 * 800
    train_flops = 2 * 3 * active * tokens + 2 * 3 * 48 * width * 8 * 800**2
    for mode, trainer_gpus, transfer in (
        # colocated: latency, switch, in-node reshard, and each of the 18,867 tensors' host cost
        ("sync", 2 * g, 0.5 + 2.0 + m.params_b * 1e9 * 2 / 400e9 + (48 * (9 + 3 * 128) + 3) * sc.sync.per_tensor_s),
        ("async", g, 0.5 + m.params_b * 1e9 * 4 / 0.9e9),  # float32 copies through the object store
    ):
        train = 1.0 + train_flops / (trainer_gpus * 148e12 * 0.4)
        run = run_mode(sc, mode)
        assert math.isclose(run.end_s, 3 * (generate + train) + 2 * transfer, rel_tol=5e-3), mode


def test_expert_parallelism_trades_the_moe_all_reduce_for_two_all_to_alls():
    g = 4
    base = scenario(QWEN3_30B_A3B, **{"resources": {"rollout_gpus": 8, "trainer_gpus": 8, "gpus_per_engine": g}})
    ep = with_changes(base, {"rollout.expert_parallel": g})
    link = 450e9
    ring = 2 * (g - 1) / g * 2048 * 2  # bytes of one token's all-reduce
    a2a = 8 * 2048 * 2 * (g - 1) / g  # one token to its 8 experts, 3 in 4 of them elsewhere
    for b in (1, 16, 128):
        tp, moe = DecodeCost(base, g), DecodeCost(ep, g)
        # Tensor parallel: two all-reduces a layer. Expert parallel: one (attention), and two
        # all-to-alls of the GPU's b / g tokens (to the experts and back).
        want = 48 * (1e-5 + b * ring / link) + 2 * 48 * (1e-5 + (b / g) * a2a / link)
        assert math.isclose(moe.step_s(b, 0.0) - tp.step_s(b, 0.0), want - 2 * 48 * (1e-5 + b * ring / link), rel_tol=1e-9)
    # The trainer: per token, forward and backward each send it to its experts and back.
    t_ep = with_changes(base, {"trainer.expert_parallel": 8})
    plain, spread = TrainCost(base, 8), TrainCost(t_ep, 8)
    per_token = 2 * 2 * 48 * (8 * 2048 * 2 * 7 / 8) / 8 / link
    assert math.isclose(spread.step_s(1e5, 1e8) - plain.step_s(1e5, 1e8), 1e5 * per_token, rel_tol=1e-9)


@pytest.mark.parametrize("changes, key", [
    ({"rollout.expert_parallel": 2, "model": {}}, "rollout.expert_parallel"),  # a dense model
    ({"rollout.expert_parallel": 2}, "rollout.expert_parallel"),  # engines of 1 GPU
    ({"trainer.expert_parallel": 3}, "trainer.expert_parallel"),  # does not divide the trainer's GPUs
    ({"trainer.expert_parallel": 16, "resources.trainer_gpus": 16, "resources.rollout_gpus": 16}, "trainer.expert_parallel"),  # spans nodes, no interconnect
])
def test_expert_parallelism_that_cannot_be_is_refused_by_key(changes, key):
    data = {"model": QWEN3_30B_A3B, "resources": {"rollout_gpus": 4, "trainer_gpus": 4}}
    for dotted, value in changes.items():
        if dotted == "model":
            data["model"] = value
            continue
        section, name = dotted.split(".")
        data.setdefault(section, {})[name] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Scenario.model_validate(data)
