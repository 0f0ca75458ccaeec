"""Each cost term enters the cost as its field's docstring says, and the defaults leave the
figures of scenarios written before the term as they were."""

import math

import numpy as np
import pytest

from core.model.config import Scenario, with_changes
from core.runtimes.dispatch import run_mode
from core.sim.costs import DecodeCost, TrainCost, TransferCost, allreduce_s, colocated_switch_s, dp_comm_s, matmul_params
from harness.metrics import implied_mfu

QWEN_EMBEDDING = 152064 * 3584


def test_defaults_price_the_costs_as_before_the_new_terms():
    sc = Scenario()
    m, g = sc.model, sc.gpu
    params = m.params_b * 1e9
    d = DecodeCost(sc, 1)
    bw = g.hbm_gb_s * 1e9 * g.hbm_efficiency
    assert d.weights_s == pytest.approx(params * m.dtype_bytes / bw)
    assert d.base_s(256) == pytest.approx(sc.rollout.decode_overhead_s + max(d.weights_s, 256 * 2 * params / (g.bf16_tflops * 1e12 * sc.rollout.decode_mfu)))
    t = TrainCost(sc, 8, colocated=True)
    assert t.sample_flops(1000, 1e6) == pytest.approx(6 * params * 1000 + 6 * m.layers * m.hidden * 1e6)
    assert t.flops == pytest.approx(8 * g.bf16_tflops * 1e12 * sc.trainer.mfu)


def test_activation_recompute_adds_one_forward():
    sc = Scenario()
    on = with_changes(sc, {"trainer.activation_recompute": True})
    plain, ckpt = TrainCost(sc, 4), TrainCost(on, 4)
    assert ckpt.sample_flops(5000, 3e7) == pytest.approx(plain.sample_flops(5000, 3e7) * 4 / 3)
    assert ckpt.step_s(5000, 3e7) - ckpt.overhead_s == pytest.approx((plain.step_s(5000, 3e7) - plain.overhead_s) * 4 / 3)
    # with a log-prob forward too: 5 passes run, 4 of them the algorithm's (model FLOPs)
    both = TrainCost(on, 4, recompute_logprobs=True)
    assert both.sample_flops(5000, 3e7) == pytest.approx(plain.sample_flops(5000, 3e7) * 5 / 3)
    assert both.model_flops(5000, 3e7) == pytest.approx(plain.sample_flops(5000, 3e7) * 4 / 3)
    assert ckpt.model_flops(5000, 3e7) == pytest.approx(plain.sample_flops(5000, 3e7))


def test_trainer_efficiency_per_placement():
    sc = with_changes(Scenario(), {"trainer.mfu": 0.5, "trainer.colocated_mfu": 0.2})
    assert TrainCost(sc, 4, colocated=True).flops == pytest.approx(4 * 148e12 * 0.2)
    assert TrainCost(sc, 4, colocated=False).flops == pytest.approx(4 * 148e12 * 0.5)
    # the sim's sync mode (colocated) trains slower per GPU than async on the same GPUs
    small = with_changes(sc, {"resources.rollout_gpus": 2, "resources.trainer_gpus": 2, "trainer.steps": 8,
                              "trainer.batch_size": 64, "workload.max_response_len": 2000, "trainer.step_overhead_s": 0.0})
    sync, asyn = run_mode(small, "sync"), run_mode(small, "async")
    assert implied_mfu(sync)["util/implied_trainer_mfu"] == pytest.approx(0.2)
    assert implied_mfu(asyn)["util/implied_trainer_mfu"] == pytest.approx(0.5)


def test_data_parallel_collectives_per_optimizer_step_and_flat_in_the_gpus():
    sc = Scenario()
    assert dp_comm_s(sc, 64, True) == 0  # no interconnect given: not priced, as before the term
    net = with_changes(sc, {"gpu.interconnect_gb_s": 25.0, "trainer.batch_size": 2048, "trainer.minibatch_size": 512})
    params = sc.model.params_b * 1e9
    per_step = 4 * params * (2 * 2 + 4)  # 4 optimizer steps: two bf16 gathers and an fp32 reduce-scatter each
    assert dp_comm_s(net, 16, False) == pytest.approx(15 / 16 * per_step / 25e9)
    assert dp_comm_s(net, 16, True) - dp_comm_s(net, 16, False) == pytest.approx(15 / 16 * params * 2 / 25e9)
    # within a node the ring runs over NVLink; one GPU has nothing to exchange
    assert dp_comm_s(net, 8, False) == pytest.approx(7 / 8 * per_step / (sc.gpu.nvlink_gb_s * 1e9))
    assert dp_comm_s(net, 1, True) == 0
    # at a fixed global batch the bytes per GPU do not shrink with more GPUs: the step's fixed part
    assert dp_comm_s(net, 64, False) / dp_comm_s(net, 16, False) == pytest.approx((63 / 64) / (15 / 16))
    t16, t64 = TrainCost(net, 16), TrainCost(net, 64)
    assert t16.fixed_s == pytest.approx(net.trainer.step_overhead_s + t16.comm_s)
    assert t64.step_s(1e6, 1e9) - t64.fixed_s == pytest.approx((t16.step_s(1e6, 1e9) - t16.fixed_s) / 4)


def test_tensor_parallel_allreduce_is_zero_on_one_gpu_and_grows_with_batch():
    sc = Scenario()
    one, two, four = DecodeCost(sc, 1), DecodeCost(sc, 2), DecodeCost(sc, 4)
    assert one.allreduce_fixed_s == 0 and one.allreduce_per_seq_s == 0
    assert allreduce_s(sc, 1, 256) == 0
    m = sc.model
    for cost, tp in ((two, 2), (four, 4)):
        assert cost.allreduce_fixed_s == pytest.approx(2 * m.layers * sc.rollout.allreduce_latency_s)
        per_seq = 2 * m.layers * 2 * (tp - 1) / tp * m.hidden * m.dtype_bytes / (sc.gpu.nvlink_gb_s * 1e9)
        assert cost.allreduce_per_seq_s == pytest.approx(per_seq)
    # bigger batches move more bytes; the term is on top of the roofline
    assert two.allreduce_per_seq_s > 0
    assert two.base_s(64) == pytest.approx(
        sc.rollout.decode_overhead_s + max(two.weights_s, 64 * two.per_seq_compute_s) + two.allreduce_fixed_s + 64 * two.allreduce_per_seq_s
    )
    assert two.base_s_many(np.array([1.0, 64.0])) == pytest.approx([two.base_s(1), two.base_s(64)])
    # prefill pays the same all-reduces over its tokens
    no_ar = two.prefill_s(0, 512) - two.allreduce_fixed_s - 512 * two.allreduce_per_seq_s
    assert no_ar == pytest.approx((2 * two.params * 512 + 2 * m.layers * m.hidden * 512**2) / (2 * 148e12 * sc.rollout.prefill_mfu))


def test_colocated_switch_from_bytes_and_bandwidth():
    sc = with_changes(Scenario(), {"resources.rollout_gpus": 16, "resources.trainer_gpus": 16})
    p = sc.model.params_b * 1e9
    per_gpu = p * 14.0 / 32 + p * 2 / 1
    rebuild = sc.sync.kv_rebuild_s  # the engine's KV cache released and allocated again
    assert colocated_switch_s(sc) == pytest.approx(2 * per_gpu / 25e9 + rebuild)
    # a bigger model or a slower host link costs more; tensor-parallel engines hold less each
    assert colocated_switch_s(with_changes(sc, {"model.params_b": 14.0})) > colocated_switch_s(sc)
    assert colocated_switch_s(with_changes(sc, {"sync.offload_gb_s": 12.5})) - rebuild == pytest.approx(2 * (colocated_switch_s(sc) - rebuild))
    tp2 = with_changes(sc, {"resources.gpus_per_engine": 2})
    assert colocated_switch_s(tp2) == pytest.approx(2 * (p * 14.0 / 32 + p) / 25e9 + rebuild)
    t = TransferCost(sc, colocated=True)
    host = (28 * 12 + 3) * sc.sync.per_tensor_s  # each tensor of Qwen2.5-7B looked up and copied
    assert t.seconds() == pytest.approx(sc.sync.latency_s + colocated_switch_s(sc) + p * 2 / 400e9 + host)
    assert TransferCost(sc, colocated=False).switch_s == 0
    # an explicit figure overrides the computed one
    assert TransferCost(with_changes(sc, {"sync.colocated_switch_s": 3.0}), colocated=True).switch_s == 3.0


def test_decode_flops_leave_the_embedding_lookup_out():
    sc = Scenario()
    qwen = with_changes(sc, {"model.vocab": 152064})
    assert matmul_params(sc.model) == pytest.approx(7.62e9)
    assert matmul_params(qwen.model) == pytest.approx(7.62e9 - QWEN_EMBEDDING)
    assert matmul_params(with_changes(qwen, {"model.tied_embeddings": True}).model) == pytest.approx(7.62e9)
    d, dq = DecodeCost(sc, 1), DecodeCost(qwen, 1)
    ratio = (7.62e9 - QWEN_EMBEDDING) / 7.62e9
    assert dq.per_seq_compute_s == pytest.approx(d.per_seq_compute_s * ratio)
    assert dq.weights_s == pytest.approx(d.weights_s * ratio)
    assert TrainCost(qwen, 1).sample_flops(1000, 0) == pytest.approx(TrainCost(sc, 1).sample_flops(1000, 0) * ratio)
    # the weights moved at a sync are all of them
    assert TransferCost(qwen, colocated=False).bytes == TransferCost(sc, colocated=False).bytes


def test_implied_mfu_of_a_sim_run():
    """Model FLOPs over busy GPU-seconds at peak: with no step overhead the trainer's is its MFU,
    3/4 of it with activation recompute (the recompute is not model work); the engines' is
    2 x matmul params per token generated or prefilled over their busy GPU-seconds."""
    sc = Scenario.model_validate({
        "resources": {"rollout_gpus": 2, "trainer_gpus": 2}, "model": {"vocab": 152064},
        "workload": {"max_response_len": 2000}, "trainer": {"batch_size": 64, "steps": 8, "step_overhead_s": 0.0, "mfu": 0.3},
    })
    result = run_mode(sc, "partial")
    m = implied_mfu(result)
    assert m["util/implied_trainer_mfu"] == pytest.approx(0.3)
    busy = sum(e.busy_s for e in result.engines)
    tokens = sum(e.tokens_generated + e.prefill_tokens for e in result.engines)
    assert m["util/implied_rollout_mfu"] == pytest.approx(2 * (7.62e9 - QWEN_EMBEDDING) * tokens / (busy * 148e12))
    assert 0 < m["util/implied_rollout_mfu"] < 1
    ckpt = implied_mfu(run_mode(with_changes(sc, {"trainer.activation_recompute": True}), "partial"))
    assert ckpt["util/implied_trainer_mfu"] == pytest.approx(0.3 * 3 / 4)
    with_overhead = implied_mfu(run_mode(with_changes(sc, {"trainer.step_overhead_s": 5.0}), "partial"))
    assert with_overhead["util/implied_trainer_mfu"] < 0.3
    assert not math.isnan(with_overhead["util/implied_rollout_mfu"])


@pytest.mark.parametrize("fitted", ["colocated", "separated"])
def test_calibrated_engine_costs_hold_in_the_fitted_placement_and_scale_in_the_other(fitted):
    cal = {"decode_overhead_s": 0.004, "decode_per_seq_s": 2e-4, "decode_kv_s_per_token": 3e-6, "prefill_s_per_token": 1e-4,
           "train_overhead_s": 0.3, "train_s_per_token": 1e-4, "train_s_per_token_sq": 0.0, "train_devices": 2,
           "transfer_s": 0.01, "decode_placement": fitted, "separated_decode_speedup": 1.5}
    sc = Scenario.model_validate({"calibrated": cal})
    same = DecodeCost(sc, 1, colocated=fitted == "colocated")
    other = DecodeCost(sc, 1, colocated=fitted != "colocated")
    assert same.step_s(8, 1000) == pytest.approx(0.004 + 8 * 2e-4 + 1000 * 3e-6)
    assert same.prefill_s(0, 10) == pytest.approx(10 * 1e-4)
    # separated engines step 1.5x as fast as colocated ones, whichever was measured
    ratio = 1.5 if fitted == "colocated" else 1 / 1.5
    assert same.step_s(8, 1000) / other.step_s(8, 1000) == pytest.approx(ratio)
    assert same.prefill_s(0, 10) / other.prefill_s(0, 10) == pytest.approx(ratio)


def test_broadcast_prices_bytes_in_the_models_dtype_in_pipelined_stages():
    """Separated engines on other nodes: the weights in the model's dtype, bucket by bucket through
    three pipelined stages (the trainer's gather, the wire, the in-place load); the slowest sets
    the pace, the others add one bucket, every tensor and every bucket pays its host cost."""
    sc = Scenario()
    s, g = sc.sync, sc.gpu
    p = sc.model.params_b * 1e9
    wire, load = s.bandwidth_gb_s * 1e9, g.hbm_gb_s * g.hbm_efficiency * 1e9 / 2
    bucket = s.bucket_mb * 2**20
    buckets = math.ceil(p * 2 / bucket)
    host = (28 * 12 + 3) * s.per_tensor_s + buckets * s.bucket_overhead_s
    gather = 63 / 64 * p * 2 / wire  # 64 trainer GPUs over the nodes' NICs
    t = TransferCost(sc, colocated=False)
    assert t.bytes == p * 2
    assert t.seconds() == pytest.approx(s.latency_s + host + p * 2 / wire + (gather + p * 2 / load) * bucket / (p * 2))
    # fp32 weights move twice the bytes; a bucket larger than the model is one bucket
    fp32 = with_changes(sc, {"model.dtype_bytes": 4, "sync.bucket_mb": 1e6})
    assert TransferCost(fp32, colocated=False).seconds() == pytest.approx(
        s.latency_s + 339 * s.per_tensor_s + s.bucket_overhead_s + p * 4 / wire + 63 / 64 * p * 4 / wire + p * 4 / load)
    # a load slower than the wire sets the pace instead, and the wire adds one bucket
    slow = with_changes(sc, {"gpu.hbm_gb_s": 20.0, "gpu.hbm_efficiency": 1.0})
    assert TransferCost(slow, colocated=False).seconds() == pytest.approx(
        s.latency_s + host + p * 2 / 10e9 + (p * 2 / wire + gather) * bucket / (p * 2)
    )
    # the fallback moves float32 copies at its measured rate
    store = with_changes(sc, {"sync.transport": "object_store"})
    assert TransferCost(store, colocated=False).seconds() == pytest.approx(s.latency_s + p * 4 / (s.object_store_gb_s * 1e9))
    assert TransferCost(store, colocated=False).seconds() > 10 * t.seconds()
