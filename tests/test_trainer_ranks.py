"""Data-parallel trainer ranks (core/real/rank_group.py, core/real/grpo.py): two ranks in a gloo
process group, each a process of its own, make the same update as one rank holding the whole
batch, and stay identical to each other.

Tolerance (fp32 on CPU): after one step, |loss(2 ranks) - loss(1 rank)| <= 1e-6 and every
weight within 2e-5 of one rank's (lr / 50; see WEIGHT_ATOL). The two ranks sum partial sums
where one rank sums once, so the figures differ by float rounding only (where each minibatch
is one group, so that one rank holds all of it, they are equal bit for bit); the two ranks'
weights are compared bit for bit.
"""

from __future__ import annotations

import asyncio
import copy
import pickle
import socket

import numpy as np
import pytest
import torch

from core.api import Batch
from core.model.config import LearnSpec, LoraSpec
from core.real.grpo import TorchTrainBackend
from core.real.rank_group import RankGroup, token_balanced_cuts

LOSS_ATOL = 1e-6
# One Adam step moves a weight by up to lr (1e-3 here) whatever the gradient's size, and by
# lr * g / (|g| + eps) near g = 0, where the rounding of a sum in another order is magnified:
# measured up to 6e-6 (m2po), 2e-6 for the others; the bound is lr / 50.
WEIGHT_ATOL = 2e-5

# (correction, minibatches): with 4 groups, 2 minibatches give each rank one group of each; 4
# give each minibatch one group, so one rank holds nothing of it and still takes part.
CASES = [("bypass", 2), ("tis", 2), ("decoupled", 2), ("icepop", 2), ("seq_tis", 2), ("seq_mis", 2), ("m2po", 2), ("m2po", 4), ("decoupled", 4)]
# learn.sharding: fsdp2, (correction, minibatches, param_dtype): every rank holds a group of each
# minibatch (a sharded forward needs every rank). In float32 the two shards' gradients are
# reduce-scattered where one rank sums once: the same float rounding as the replicas', so the
# same tolerance. In bfloat16 the forward and backward round to 8 bits of mantissa, and the
# two ranks' partial sums are rounded where one rank's whole sum is: a near-zero gradient may
# change sign, and Adam's first step (lr * g / |g|) then moves that weight by up to 2 lr the
# other way. So the bound is on the update as a whole: |update(2) - update(1)| / |update(1)|
# over all weights, measured 0.019 (BF16_UPDATE_RTOL 0.1; the worst weight 1.5e-3, within 2 lr per step).
FSDP_CASES = [("decoupled", 2, "float32"), ("m2po", 2, "float32"), ("decoupled", 2, "bfloat16")]
BF16_UPDATE_RTOL = 0.1
# trainer.lora on both shardings: each rank draws its adapter from a seed of its own (rank 0's
# must win), and only the adapter moves; lr 1e-2, as LoRA trains (docs/real-runtimes.md).
LORA, LORA_LEARN = LoraSpec(rank=4), dict(minibatches=2, lr=1e-2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _groups(model_dir) -> list:
    """Four groups sampled from the tiny model, behaviour log-probs moved off the policy (so
    every correction's weights, truncation and masks have work), rewards spread; the last
    group's rewards are all equal (no signal)."""
    from test_grpo import _onpolicy_groups

    b = TorchTrainBackend(model_dir, LearnSpec(), threads=1)
    gs = _onpolicy_groups(b, model_dir, n_groups=4, n=4, max_len=10, seed=3)
    rng = np.random.default_rng(7)
    for g in gs:
        for s in g.samples:
            s.logprobs = (np.asarray(s.logprobs) + rng.normal(0.0, 0.4, len(s.logprobs))).tolist()
    for s in gs[-1].samples:
        s.reward = 0.5
    return gs


def _step(backend: TorchTrainBackend, groups: list) -> tuple[float, dict, dict]:
    """One collective step on this rank's part: (loss, weights, the step's figures)."""
    t0 = 0.0
    learned = backend.learn_part(backend.shards(Batch(copy.deepcopy(groups)))[backend.ranks.rank])
    info = backend.summary(Batch(groups), 0, learned, t0)
    return info["loss"], backend.weights(), info


def _rank_main(rank: int, size: int, port: int, model_dir: str, path: str, out: str) -> None:
    torch.set_num_threads(1)
    groups = pickle.loads(open(path, "rb").read())
    ranks = RankGroup.join(f"127.0.0.1:{port}", rank, size, "cpu", timeout_s=60)
    got, sharded, resumed = [], [], {}
    try:
        for correction, k in CASES:
            b = TorchTrainBackend(model_dir, LearnSpec(correction=correction, minibatches=k), threads=1)
            b.join(ranks)
            loss, w, info = _step(b, groups)
            got.append((loss, w, info["updates"], info["masked_frac"], info["is_truncated_frac"]))
        for correction, k, dtype in FSDP_CASES:
            b = TorchTrainBackend(model_dir, LearnSpec(correction=correction, minibatches=k, sharding="fsdp2", param_dtype=dtype), threads=1)
            b.join(ranks)
            loss, w, info = _step(b, groups)
            sharded.append((loss, w, info["updates"], _shard_sizes(b)))
        resumed = _stop_and_resume(model_dir, ranks, groups, f"{out}-shards")
        lora = []
        for sharding in ("ddp", "fsdp2"):
            b = TorchTrainBackend(model_dir, LearnSpec(sharding=sharding, **LORA_LEARN), threads=1, lora=LORA, seed=rank)
            b.join(ranks)
            loss, w, _ = _step(b, groups)
            lora.append((loss, w))
    finally:
        ranks.leave()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"ddp": got, "fsdp2": sharded, "resume": resumed, "lora": lora}, f)


def _shard_sizes(b: TorchTrainBackend) -> int:
    """Elements of the parameters this rank holds."""
    return sum(p.to_local().numel() for p in b.model.parameters())


def _stop_and_resume(model_dir: str, ranks: RankGroup, groups: list, shards: str) -> dict:
    """Two fsdp2 steps uninterrupted, against one step, a sharded checkpoint (every rank writes
    its shards), a new trainer on every rank restored from it, and the second step."""
    spec = LearnSpec(minibatches=2, sharding="fsdp2")
    b = TorchTrainBackend(model_dir, spec, threads=1)
    b.join(ranks)
    _step(b, groups)
    b.save_shards(shards)
    _, uninterrupted, _ = _step(b, groups)
    again = TorchTrainBackend(model_dir, spec, threads=1)
    again.join(ranks)
    fresh = again.weights()
    again.load_shards(shards)
    _, resumed, _ = _step(again, groups)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "fresh": fresh}


def test_token_balanced_cuts_are_contiguous_and_fill_every_rank():
    assert token_balanced_cuts([5, 5, 5, 5], 2) == [0, 2, 4]
    assert token_balanced_cuts([10, 1, 1, 1], 2) == [0, 1, 4]
    assert token_balanced_cuts([1, 1, 1, 100], 2) == [0, 3, 4]
    assert token_balanced_cuts([1, 2, 3], 3) == [0, 1, 2, 3]
    assert token_balanced_cuts([7], 2) in ([0, 0, 1], [0, 1, 1])  # fewer groups than ranks: one rank idles
    assert token_balanced_cuts([4, 4], 1) == [0, 2]


def _ranks_main(rank: int, ports: tuple[int, int], model_dir: str, groups_path: str, state_path: str, out: str) -> None:
    """One rank's process, for both tests below: the step of every case in one group, then the
    restore in another. Starting a process (torch, the model) is most of what a rank costs."""
    _rank_main(rank, 2, ports[0], model_dir, groups_path, out)
    _restore_main(rank, ports[1], model_dir, state_path, f"{out}-restored")


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory) -> dict:
    """Two rank processes (spawned, gloo), started once for the module: what each returned for
    the update cases and for the restore, with the batch and the checkpoint they were given."""
    tmp = tmp_path_factory.mktemp("ranks")
    groups = _groups(tiny_model_dir)
    trained = TorchTrainBackend(tiny_model_dir, LearnSpec(minibatches=1), threads=1)
    asyncio.run(trained.train_step(Batch(copy.deepcopy(groups)), 0))
    state = trained.state_dict()
    (tmp / "groups.pkl").write_bytes(pickle.dumps(groups))
    (tmp / "state.pkl").write_bytes(pickle.dumps(state))
    out = str(tmp / "got")
    ctx = torch.multiprocessing.get_context("spawn")
    ports = (_free_port(), _free_port())
    args = (ports, str(tiny_model_dir), str(tmp / "groups.pkl"), str(tmp / "state.pkl"), out)
    procs = [ctx.Process(target=_ranks_main, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    exits = [p.exitcode for p in procs]

    def read(path: str) -> list:
        return [pickle.loads(open(f"{path}.{r}", "rb").read()) for r in range(2)] if exits == [0, 0] else []

    got = read(out)
    return {
        "groups": groups, "state": state, "exits": exits, "restored": read(f"{out}-restored"), "shards": f"{out}-shards",
        "two": [g["ddp"] for g in got], "fsdp2": [g["fsdp2"] for g in got], "resume": [g["resume"] for g in got],
        "lora": [g["lora"] for g in got],
    }


def test_two_ranks_make_the_update_of_one(tiny_model_dir, ranks):
    """Every correction: the loss and weights after one step on the same batch, 2 ranks
    (2 processes, gloo) against 1; and the 2 ranks' weights equal bit for bit."""
    groups = ranks["groups"]
    assert ranks["exits"] == [0, 0]
    two = ranks["two"]
    start = TorchTrainBackend(tiny_model_dir, LearnSpec(), threads=1).weights()  # the untrained model's
    for i, (correction, k) in enumerate(CASES):
        one = TorchTrainBackend(tiny_model_dir, LearnSpec(correction=correction, minibatches=k), threads=1)
        loss1, w1, info1 = _step(one, groups)
        (loss_a, wa, upd_a, masked_a, trunc_a), (loss_b, wb) = two[0][i], two[1][i][:2]
        case = f"{correction}, {k} minibatches"
        for name in w1:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=f"{case}: ranks differ on {name}")
        assert loss_a == loss_b, case
        assert abs(loss_a - loss1) <= LOSS_ATOL, (case, loss_a, loss1)
        worst = max(float(np.abs(wa[n] - w1[n]).max()) for n in w1)
        assert worst <= WEIGHT_ATOL, (case, worst)
        assert upd_a == info1["updates"], case  # the no-signal minibatch is skipped on both sides alike
        assert masked_a == pytest.approx(info1["masked_frac"], abs=1e-9), case
        assert trunc_a == pytest.approx(info1["is_truncated_frac"], abs=1e-9), case
        # The step moved the weights: the comparison is not of two untouched models.
        assert max(float(np.abs(w1[n] - start[n]).max()) for n in w1) > 1e-4, case


def test_two_lora_ranks_ddp_or_fsdp2_make_the_adapter_update_of_one(tiny_model_dir, ranks):
    """trainer.lora under both shardings: the adapter after one step on 2 ranks (each started
    from another random A) is one rank's, and the 2 ranks' are equal bit for bit."""
    assert ranks["exits"] == [0, 0]
    one = TorchTrainBackend(tiny_model_dir, LearnSpec(**LORA_LEARN), threads=1, lora=LORA, seed=0)
    start = one.weights()
    loss1, w1, _ = _step(one, ranks["groups"])
    assert all("lora_" in n for n in w1) and max(float(np.abs(w1[n] - start[n]).max()) for n in w1) > 1e-3
    for i, sharding in enumerate(("ddp", "fsdp2")):
        (loss_a, wa), (loss_b, wb) = ranks["lora"][0][i], ranks["lora"][1][i]
        assert wa.keys() == w1.keys(), sharding
        for n in wa:
            np.testing.assert_array_equal(wa[n], wb[n], err_msg=f"{sharding}: ranks differ on {n}")
        assert abs(loss_a - loss1) <= LOSS_ATOL, (sharding, loss_a, loss1)
        # lr 10x the others', and an adapter's few weights near g = 0 magnify rounding more:
        # measured 2.1e-4 (lr / 48) on a CPU without AVX-512, so lr / 20; a wrong update is off by ~lr.
        assert max(float(np.abs(wa[n] - w1[n]).max()) for n in w1) <= 25 * WEIGHT_ATOL, sharding


def _one_sharded_rank(model_dir, spec: LearnSpec) -> TorchTrainBackend:
    b = TorchTrainBackend(model_dir, spec, threads=1)
    b.join(RankGroup.alone("cpu", timeout_s=60))
    return b


def test_two_fsdp2_ranks_make_the_update_of_one(tiny_model_dir, ranks):
    """learn.sharding: fsdp2 over gloo, 2 processes: each holds half of every parameter (and
    of Adam's state), and one step makes the update of one rank holding the whole batch, in
    float32 within the replicas' tolerance, in bfloat16 compute within BF16_WEIGHT_ATOL."""
    assert ranks["exits"] == [0, 0]
    groups = ranks["groups"]
    untrained = TorchTrainBackend(tiny_model_dir, LearnSpec(), threads=1)
    whole = sum(p.numel() for p in untrained.model.parameters())
    start = untrained.weights()
    for i, (correction, k, dtype) in enumerate(FSDP_CASES):
        case = f"fsdp2 {correction}, {k} minibatches, {dtype}"
        (loss_a, wa, upd_a, held_a), (loss_b, wb, _, held_b) = ranks["fsdp2"][0][i], ranks["fsdp2"][1][i]
        assert held_a + held_b == whole and max(held_a, held_b) < whole, case  # sharded, not replicated
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=f"{case}: ranks differ on {name}")
        if dtype == "float32":
            one = TorchTrainBackend(tiny_model_dir, LearnSpec(correction=correction, minibatches=k), threads=1)
        else:
            one = _one_sharded_rank(tiny_model_dir, LearnSpec(correction=correction, minibatches=k, sharding="fsdp2", param_dtype=dtype))
        loss1, w1, info1 = _step(one, groups)
        worst = max(float(np.abs(wa[n] - w1[n]).max()) for n in w1)
        assert upd_a == info1["updates"], case
        if dtype == "float32":
            assert abs(loss_a - loss1) <= LOSS_ATOL, (case, loss_a, loss1)
            assert worst <= WEIGHT_ATOL, (case, worst)
            continue
        lr = LearnSpec().lr
        assert abs(loss_a - loss1) <= 1e-3, (case, loss_a, loss1)
        assert worst <= 2 * lr * k * 1.01, (case, worst)  # k Adam steps, each at most lr per weight
        diff = np.sqrt(sum(float(((wa[n] - w1[n]) ** 2).sum()) for n in w1))
        moved = np.sqrt(sum(float(((w1[n] - start[n]) ** 2).sum()) for n in w1))
        assert diff / moved <= BF16_UPDATE_RTOL, (case, diff / moved)


def test_a_two_rank_fsdp2_trainer_stopped_and_resumed_ends_as_the_uninterrupted_one(tiny_model_dir, ranks):
    """Each rank writes its shards (torch.distributed.checkpoint, safetensors), new trainers
    read them back, and the next step ends bit for bit where the uninterrupted trainer's did
    (Adam's moments and step count restored too: otherwise the update differs). One rank
    reads the same checkpoint resharded and ends there within float rounding."""
    assert ranks["exits"] == [0, 0]
    for r in range(2):
        got = ranks["resume"][r]
        moved = max(float(np.abs(got["uninterrupted"][n] - got["fresh"][n]).max()) for n in got["fresh"])
        assert moved > 1e-4  # the restored trainer did not start where the checkpoint was
        for n, w in got["uninterrupted"].items():
            np.testing.assert_array_equal(got["resumed"][n], w, err_msg=f"rank {r}: {n}")
    one = _one_sharded_rank(tiny_model_dir, LearnSpec(minibatches=2, sharding="fsdp2"))
    one.load_shards(ranks["shards"])
    _, w1, _ = _step(one, ranks["groups"])
    worst = max(float(np.abs(w1[n] - w).max()) for n, w in ranks["resume"][0]["uninterrupted"].items())
    assert worst <= WEIGHT_ATOL


def test_a_rank_receives_rank_zeros_weights_and_optimizer_state(ranks):
    """Restore: rank 0 loads the checkpoint's tensors, the others receive them (a collective)."""
    state = ranks["state"]
    assert ranks["exits"] == [0, 0]
    for r in range(2):
        got = ranks["restored"][r]
        for part in ("weights", "optimizer"):
            assert got[part].keys() == state[part].keys()
            for k, v in state[part].items():
                np.testing.assert_array_equal(got[part][k], v, err_msg=f"rank {r}: {part} {k}")


def _restore_main(rank: int, port: int, model_dir: str, path: str, out: str) -> None:
    torch.set_num_threads(1)
    ranks = RankGroup.join(f"127.0.0.1:{port}", rank, 2, "cpu", timeout_s=60)
    try:
        b = TorchTrainBackend(model_dir, LearnSpec(minibatches=1), threads=1)
        b.join(ranks)
        b.load(pickle.loads(open(path, "rb").read()) if rank == 0 else None)
        state = b.state_dict()
    finally:
        ranks.leave()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(state, f)


def test_trainer_ranks_that_do_not_fit_are_refused_by_name(tiny_model_dir):
    from pydantic import ValidationError

    from core.model.config import with_changes
    from harness.scenario import load

    sc = with_changes(load("scenarios/real-cpu-torch.yaml"), {"tiny_model.path": str(tiny_model_dir)})
    with pytest.raises(ValidationError, match=r"ray.trainer_ranks = 2: trainer ranks are actors of the ray runtime, not of local; fix: set runtime: ray"):
        with_changes(sc, {"ray.trainer_ranks": 2, "resources.trainer_gpus": 2})
    with pytest.raises(ValidationError, match=r"ray.trainer_ranks = 2: does not divide resources.trainer_gpus = 3 .*fix: use a divisor of 3"):
        with_changes(sc, {"runtime": "ray", "ray.trainer_ranks": 2, "resources.trainer_gpus": 3})
    with pytest.raises(ValidationError, match=r"ray.trainer_ranks = 4: sync colocates each rank with an engine, and it has 3"):
        with_changes(sc, {"runtime": "ray", "ray.trainer_ranks": 4, "resources.trainer_gpus": 4, "resources.rollout_gpus": 2,
                          "resources.gpus_per_engine": 2, "modes": ["sync"]})
    assert with_changes(sc, {"runtime": "ray", "ray.trainer_ranks": 2, "resources.trainer_gpus": 2}).ray.trainer_ranks == 2


@pytest.mark.runtime
def test_ray_run_with_two_trainer_ranks_loses_nothing_through_a_trainer_kill(ray_session, tiny_model_dir):
    """real-cpu-torch on the ray runtime, scaled down, the trainer 2 ranks (half a CPU each,
    so that engine and ranks fit the session's 2). Rank 0 is killed after step 2: Ray
    restarts it, rank 1 is restarted with it, they form a new group and go back to the
    checkpoint. Every sample produced is trained or dropped with a reason."""
    from test_runtimes import assert_recovered_run, small

    from core.runtimes.dispatch import run_mode

    sc = small(
        "scenarios/real-cpu-torch.yaml", tiny_model_dir, modes=["async"],
        **{"runtime": "ray", "resources.trainer_gpus": 2, "ray.trainer_ranks": 2, "ray.trainer.num_cpus": 0.5,
           "trainer.steps": 4, "trainer.batch_size": 16, "workload.max_response_len": 24,
           "checkpoint.every": 1, "ray.poll_s": 0.1, "faults": [{"kind": "kill", "target": "trainer", "at_step": 2}]},
    )
    system = run_mode(sc, "async")
    m = assert_recovered_run(system)
    assert m["faults/injected"] == 1 and m["faults/recovered"] == 1
    assert m["learn/reward_mean"] > 0
    info = system.trainer.step_info
    assert all(i["ranks"] == 2 and i["comm_s"] > 0 for i in info)
