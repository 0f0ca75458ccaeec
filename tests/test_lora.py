"""trainer.lora (core/real/lora.py): the scenario refuses an adapter that cannot work, the trainer
trains the adapter alone, a sync moves the adapter alone (its bytes), the torch engine samples
the adapted policy after it (its log-probs are the trainer's), a sync without the adapter fails
loudly, and the sim prices the adapter's bytes.

The engine test is the one that catches an adapter that never reached the engine: its
log-probs are compared with the adapted trainer's, which differ from the base model's by far
more than the tolerance (asserted too), so an engine that kept its base weights fails it."""

from __future__ import annotations

import asyncio
import itertools
import re

import numpy as np
import pytest

from core.model.config import LORA_TARGETS, LoraSpec, with_changes
from harness.scenario import ScenarioError, load

REAL = "scenarios/real-cpu-torch.yaml"
SIM = "scenarios/longtail-128gpu.yaml"


# -- the scenario ---------------------------------------------------------------------------
def test_lora_defaults_and_the_combinations_refused_before_anything_runs():
    sc = load(REAL, ["trainer.lora.rank=4"])
    assert sc.trainer.lora == LoraSpec(rank=4) and sc.trainer.lora.targets == LORA_TARGETS and sc.trainer.lora.alpha == 16.0
    assert load(REAL).trainer.lora is None
    refused = {
        "trainer.lora.targets=[]": "trainer.lora.targets = []: names no layer to adapt; fix: list one or more of q_proj",
        "trainer.lora.targets=[q_proj,q_proj]": "names a layer twice",
        "trainer.lora.targets=[lm_head]": "'lm_head' is not a linear layer of a decoder layer",
        "trainer.lora.targets=[c_attn]": "trainer.lora.targets = ['c_attn']: 'c_attn' names no linear layer of the tiny model (a Qwen2); fix: list only",
        "trainer.lora.rank=0": "trainer.lora.rank = 0",
        "engine.kind=vllm": "engine.kind = 'vllm': the vLLM engine takes no LoRA adapter from a weight sync, and trainer.lora is set",
    }
    for override, message in refused.items():
        with pytest.raises(ScenarioError) as err:
            load(REAL, ["trainer.lora.rank=8", override])
        line = str(err.value)
        assert message in line and "fix:" in line and "\n" not in line, line
    with pytest.raises(ScenarioError, match="names no linear layer of the sim's model figures"):
        load(SIM, ["trainer.lora.targets=[query_key_value]"])


def test_the_sim_prices_a_lora_sync_at_the_adapters_bytes():
    from core.sim.costs import TransferCost

    full = load(SIM)
    lora = with_changes(full, {"trainer.lora": {"rank": 8}})
    m = full.model  # Qwen2.5-7B: 28 layers, hidden 3584, 4 x 128 kv, MLP 18944; bf16
    h, kv, i = 3584, 4 * 128, 18944
    assert (m.layers, m.hidden, m.kv_heads * m.head_dim, m.intermediate, m.dtype_bytes) == (28, h, kv, i, 2)
    per_layer = 8 * ((h + h) + 2 * (h + kv) + (h + h) + 3 * (h + i))  # q, k and v, o, gate up and down
    assert per_layer * 28 == 20_185_088  # the 20.2 M of a rank-8 all-linear Qwen2.5-7B adapter
    for colocated in (False, True):
        assert TransferCost(full, colocated).bytes == m.params_b * 1e9 * 2  # unset: every weight, as before
        cost = TransferCost(lora, colocated)
        assert cost.bytes == per_layer * 28 * 2
        assert cost.seconds() < TransferCost(full, colocated).seconds()
    store = with_changes(lora, {"sync.transport": "object_store"})
    assert TransferCost(store, False).bytes == per_layer * 28 * 4  # float32 copies
    qv = with_changes(full, {"trainer.lora": {"rank": 16, "targets": ["q_proj", "v_proj"]}})
    assert TransferCost(qv, False).bytes == 28 * 16 * ((h + h) + (h + kv)) * 2


# -- trainer, sync and engine (torch) ---------------------------------------------------------
torch = pytest.importorskip("torch")

SPEC = LoraSpec(rank=4, alpha=8.0)
_uids = itertools.count()


def _adapted_trainer(model_dir):
    """A LoRA trainer whose adapter moved (B is zero at the start: the base model's policy)."""
    from core.model.config import LearnSpec
    from core.real.grpo import TorchTrainBackend

    b = TorchTrainBackend(model_dir, LearnSpec(), threads=1, lora=SPEC)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in b.trainable():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return b


def _group(n: int = 4):
    from core.model.sample import Group, Sample

    prompt = np.asarray([2, 5, 9, 12, 7, 3], dtype=np.int64)
    samples = [Sample(uid=next(_uids), prompt_id=0, index=i, n_prompt=len(prompt), prompt_tokens=prompt) for i in range(n)]
    return Group(prompt_id=0, samples=samples, version=0, admitted_at=0.0)


def _trainer_logprobs(backend, samples) -> list[np.ndarray]:
    """The adapted trainer's teacher-forced log-probs of each sample's response."""
    from core.real.grpo import _Batch

    with torch.no_grad():
        lp = backend._logprobs(_Batch(samples, np.zeros(len(samples), np.float32), np.ones(len(samples)), "cpu"))
    return [lp[i, s.n_prompt - 1 : s.n_prompt - 1 + s.n_response].numpy() for i, s in enumerate(samples)]


def _base_logprobs(model_dir, samples) -> list[np.ndarray]:
    from core.model.config import LearnSpec
    from core.real.grpo import TorchTrainBackend

    return _trainer_logprobs(TorchTrainBackend(model_dir, LearnSpec(), threads=1), samples)


@pytest.mark.parametrize("transport", ["local", "broadcast"])
def test_after_an_adapter_only_sync_the_engine_samples_the_adapted_policy(tiny_model_dir, transport):
    """The sync moves the adapter's tensors alone (its bytes, a fraction of the model's), and
    the engine's behaviour log-probs are then the adapted trainer's, not the base model's."""
    from core.real.engine_torch import TorchEngine
    from core.real.weight_broadcast import manifest_of
    from core.real.workers import LocalWeightTransfer
    from core.runtimes.broadcast_transfer import BroadcastTransfer

    backend = _adapted_trainer(tiny_model_dir)
    engine = TorchEngine("e0", tiny_model_dir, lora=SPEC, seed=1, temperature=1.0)
    adapter = 2 * 4 * sum(4 * (i + o) for i, o in [(128, 128), (128, 64), (128, 64), (128, 128), (128, 256), (128, 256), (256, 128)])
    full = sum(t.numel() * 4 for t in backend.model.get_base_model().state_dict().values() if t.dtype == torch.float32)
    group = _group()

    async def main():
        await engine.start()
        if transport == "local":
            transfer = LocalWeightTransfer(backend, "float32")
            await engine.update_weights(1, await transfer.send(1))
        else:
            transfer = BroadcastTransfer(backend, "127.0.0.1", bucket_bytes=16 * 1024, dtype="float32", timeout_s=20)
            try:
                assert [s.name for s in transfer.manifest] == list(backend.parameters()) and all("lora_" in s.name for s in transfer.manifest)
                ticket = transfer.ticket(1).addressed([engine.name], regroup=False)
                receiving = asyncio.ensure_future(engine.update_weights(1, ticket))
                await transfer.send(ticket, receiving)
                await receiving
            finally:
                transfer.close()
        await engine.generate(group, 16)
        await engine.close(0.0)
        return transfer.bytes

    moved = asyncio.run(main())
    assert moved == adapter == sum(s.nbytes for s in manifest_of(backend.parameters().items(), "float32"))
    assert moved * 15 < full  # rank 4 of a 128-wide model: 1/16 of its weights or less
    adapted = _trainer_logprobs(backend, group.samples)
    base = _base_logprobs(tiny_model_dir, group.samples)
    assert sum(s.n_response for s in group.samples) >= 8
    for s, want, was in zip(group.samples, adapted, base):
        np.testing.assert_allclose(s.logprobs, want, atol=1e-4)
        assert np.abs(was - want).max() > 0.05  # the base policy is far off: an engine without the adapter fails above


def test_the_trainer_trains_the_adapter_alone_and_checkpoints_it(tiny_model_dir):
    from core.api import Batch
    from core.model.config import LearnSpec
    from core.real.grpo import TorchTrainBackend

    b = TorchTrainBackend(tiny_model_dir, LearnSpec(minibatches=1, lr=1e-2), threads=1, lora=SPEC)
    base = {n: p.detach().clone() for n, p in b.model.named_parameters() if not p.requires_grad}
    start = {n: p.detach().clone() for n, p in b.parameters().items()}
    assert len(b.trainable()) == len(start) == 2 * 7 * 2  # A and B, 7 layers, 2 decoder layers
    assert all(float(start[n].abs().max()) == 0.0 for n in start if "lora_B" in n)  # the base policy at first
    g = _group(4)
    for i, s in enumerate(g.samples):
        s.response_tokens, s.n_response = np.asarray([4 + i, 5, 6], dtype=np.int64), 3
        s.logprobs = np.full(3, -3.0, dtype=np.float32)
        s.reward, s.finished = float(i), True
    b.learn_part([Batch([g])])
    assert all(torch.equal(p, base[n]) for n, p in b.model.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(p, start[n]) for n, p in b.parameters().items())
    state = b.state_dict()
    assert set(state["weights"]) == set(start) and {k.partition("::")[0] for k in state["optimizer"]} <= set(start)
    again = TorchTrainBackend(tiny_model_dir, LearnSpec(minibatches=1, lr=1e-2), threads=1, lora=SPEC, seed=5)
    again.load(state)
    assert all(torch.equal(again.parameters()[n], p) for n, p in b.parameters().items())


def test_a_sync_without_the_adapter_fails_loudly_and_changes_nothing(tiny_model_dir, weights):
    from core.real.engine_torch import TorchEngine
    from core.real.lora import AdapterMismatch
    from core.real.weight_broadcast import ManifestMismatch, check_manifest, manifest_of

    backend = _adapted_trainer(tiny_model_dir)
    sent = {n: t.detach().numpy().copy() for n, t in backend.parameters().items()}
    engine = TorchEngine("e0", tiny_model_dir, lora=SPEC)
    plain = TorchEngine("plain", tiny_model_dir)

    async def main():
        await engine.start()
        await plain.start()
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        missing = dict(sent)
        missing.pop("model.layers.1.mlp.down_proj.lora_B.weight")
        misshapen = {**sent, "model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((8, 128), np.float32)}
        cases = [(missing, "lacks adapter tensor model.layers.1.mlp.down_proj.lora_B.weight"),
                 (dict(weights), "lacks adapter tensor .* [(]28 of 28 missing[)]: the adapter did not arrive"),  # a full-weight sync
                 ({**sent, "model.norm.weight": weights["model.norm.weight"]}, "holds model.norm.weight, which is not an adapter tensor"),
                 (misshapen, "the sync has [8, 128], this engine expects [4, 128]")]
        for tensors, message in cases:
            with pytest.raises(AdapterMismatch, match=message if "(" in message else re.escape(message)):
                await engine.update_weights(1, tensors)
        assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
        assert engine.version == 0
        with pytest.raises(ValueError, match="weights do not match the model"):  # an adapter to an engine without trainer.lora
            await plain.update_weights(1, sent)
        await engine.update_weights(1, sent)  # the whole adapter: taken
        assert engine.version == 1
        return engine._adapter.specs

    expected = asyncio.run(main())
    # The broadcast's manifest check, at the group's setup: the engine names what did not arrive.
    trainer = manifest_of(backend.parameters().items(), "float32")
    check_manifest(trainer, expected, "e0")
    with pytest.raises(ManifestMismatch, match="tensor model.layers.0.self_attn.o_proj.lora_B.weight of this engine is not sent"):
        check_manifest([s for s in trainer if s.name != "model.layers.0.self_attn.o_proj.lora_B.weight"], expected, "e0")
    with pytest.raises(ManifestMismatch, match="the trainer sends model.embed_tokens.weight, which this engine does not have"):
        check_manifest(manifest_of([(n, torch.from_numpy(w)) for n, w in weights.items()], "float32"), expected, "e0")
