"""bf16 end to end on CPU and the trainer's sharding as a setting (issue 36): the local runtime
with a bf16 torch engine and an fsdp2 trainer computing in bf16 over float32 master weights.
After every sync each engine's weights equal the trainer's cast to bf16 bit for bit, and a
sync moves half the bytes of a float32 one. The refusals are one line each."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from core.model.config import ConfigError, with_changes
from core.model.progress import WeightsSynced
from core.runtimes import local
from core.runtimes.dispatch import run_mode
from harness.metrics import collect
from harness.scenario import load
from tests.test_runtimes import assert_accounted, small


def _run_checking_every_sync(sc, mode: str) -> tuple[object, list[int], object]:
    """The run, and per sync the number of engine tensors that differ from the trainer's
    master weights cast to the engines' dtype (compared on the loop, while nothing trains)."""
    built = []
    make = local.local_workers

    def capture(*args, **kwargs):
        built.append(make(*args, **kwargs))
        return built[-1]

    differing: list[int] = []

    def on_step(event) -> None:
        if not isinstance(event, WeightsSynced):
            return
        workers = built[0]
        master = workers.backend.weights_as("bfloat16")
        n = 0
        for engine in workers.engines:
            got = dict(engine.model.named_parameters())
            assert got.keys() == master.keys()
            n += sum(not (got[k].dtype == torch.bfloat16 and torch.equal(got[k].view(torch.int16), master[k].view(torch.int16))) for k in master)
        differing.append(n)

    local.local_workers = capture
    try:
        system = run_mode(sc, mode, on_step=on_step)
    finally:
        local.local_workers = make
    return system, differing, built[0]


@pytest.mark.parametrize("mode", ["sync", "inflight"])
def test_a_bf16_fsdp2_run_syncs_the_trainers_weights_bit_for_bit_in_half_the_bytes(tiny_model_dir, mode):
    sc = small(
        "scenarios/real-cpu-torch.yaml", tiny_model_dir, modes=[mode],
        **{"engine.dtype": "bfloat16", "learn.sharding": "fsdp2", "learn.param_dtype": "bfloat16", "trainer.steps": 3,
           "trainer.batch_size": 16, "workload.max_response_len": 24},
    )
    system, differing, workers = _run_checking_every_sync(sc, mode)
    m = assert_accounted(system)
    assert workers.backend.sharded and workers.backend.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert len(differing) == m["sync/count"] >= 2 and differing == [0] * len(differing)
    params = sum(p.numel() for p in workers.backend.parameters().values())
    assert m["sync/bytes_mean"] == 2 * params  # float32 would be 4 per parameter


def test_sharding_and_precision_that_cannot_run_are_refused_by_name(tiny_model_dir):
    sc = with_changes(load("scenarios/real-cpu-torch.yaml"), {"tiny_model.path": str(tiny_model_dir)})
    ray = {"runtime": "ray", "ray.trainer_ranks": 2, "resources.trainer_gpus": 2}
    with pytest.raises(ValidationError, match=r"learn.sharding = 'none': one trainer holds the whole model, and ray.trainer_ranks = 2; fix: "):
        with_changes(sc, {**ray, "learn.sharding": "none"})
    with pytest.raises(ValidationError, match=r"learn.sharding = 'fsdp2': an fsdp2 trainer's process group and vLLM's own .*; fix: use engine.kind: torch"):
        with_changes(sc, {"engine.kind": "vllm", "learn.sharding": "fsdp2"})
    # 64 samples of 8 are 8 groups, 4 minibatches of 2: four ranks leave two without a group.
    with pytest.raises(ValidationError, match=r"a minibatch of 2 groups leaves one of 4 ranks without a group; fix: use fewer learn.minibatches"):
        with_changes(sc, {**ray, "ray.trainer_ranks": 4, "resources.trainer_gpus": 4, "modes": ["async"], "learn.sharding": "fsdp2"})
    with pytest.raises(ValidationError, match=r"learn.param_dtype"):
        with_changes(sc, {"learn.param_dtype": "float16"})
    assert with_changes(sc, {**ray, "learn.sharding": "fsdp2"}).learn.sharding == "fsdp2"


def test_vllm_on_a_cpu_without_avx512_refuses_bf16_in_one_line(tiny_model_dir, monkeypatch):
    """vLLM's CPU backend has bfloat16 kernels for AVX-512 only. This machine has avx512f (and
    avx512_bf16, amx_bf16), so the refusal is shown with the flags of a processor without."""
    import asyncio

    from core.real import device, engine_vllm

    assert device.cpu_runs_bf16(device.cpu_flags()) == ("avx512f" in device.cpu_flags())
    monkeypatch.setattr(engine_vllm, "cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    engine = engine_vllm.VllmEngine("e0", tiny_model_dir, dtype="bfloat16", max_model_len=64)
    with pytest.raises(ConfigError) as err:
        asyncio.run(engine.start())
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("engine.dtype = 'bfloat16': vLLM's CPU backend computes bfloat16 on AVX-512 processors")
    assert "fix: set engine.dtype: float32" in str(err.value)
    assert not device.cpu_runs_bf16({"avx2"}) and device.cpu_runs_bf16({"avx512f", "avx512bw"})
