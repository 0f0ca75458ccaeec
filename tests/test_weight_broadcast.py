"""Weights by collective broadcast (core/real/weight_broadcast.py): buckets, the group, and
engines' weights equal to the trainer's bit for bit after a sync. The ranks of a group run as
threads of this process here (gloo does not mind); the ray test runs them as actors."""

import asyncio
import itertools
import os
import threading
import time

# Before anything imports vllm: in-process engine core settings and a small CPU KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest

torch = pytest.importorskip("torch")

from core.model.config import LearnSpec
from core.model.faults import CollectiveBroken
from core.real.weight_broadcast import (
    BroadcastSource, GroupMember, ManifestMismatch, RollCall, TensorSpec, manifest_of, pack,
    plan_buckets, sha256_of, views,
)


def test_buckets_hold_at_most_the_size_and_a_larger_tensor_goes_alone():
    specs = [TensorSpec("a", (3, 5), "float32"), TensorSpec("b", (7,), "bfloat16"), TensorSpec("big", (40, 10), "float32"),
             TensorSpec("c", (2,), "float16"), TensorSpec("d", (20,), "float32")]
    buckets = plan_buckets(specs, 128)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["big"], ["c", "d"]]
    assert buckets[1].nbytes == 1600  # alone, over the bucket size
    for b in buckets:
        if len(b.specs) > 1:
            assert b.nbytes <= 128
        assert all(off % 8 == 0 for off in b.offsets)
        ends = [off + s.nbytes for s, off in zip(b.specs, b.offsets)]
        assert all(e <= nxt for e, nxt in zip(ends, b.offsets[1:]))  # no overlap
    assert [s.name for b in buckets for s in b.specs] == [s.name for s in specs]  # manifest order


def test_pack_and_views_round_trip_bit_for_bit_with_a_cast_to_bf16():
    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(33, 17, generator=g), "big": torch.randn(300, generator=g), "n": torch.randn(5, generator=g)}
    for dtype in ("float32", "bfloat16"):
        manifest = manifest_of(src.items(), dtype)
        buckets = plan_buckets(manifest, 2048)
        assert any(b.nbytes > 2048 for b in buckets) == (dtype == "float32")  # w alone is 2,244 bytes in fp32
        got = {}
        for b in buckets:
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            pack(buf, b, src)
            for name, v in views(buf, b):
                got[name] = v.clone()
        for name, t in src.items():
            want = t.to(getattr(torch, dtype))
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            assert sha256_of(got[name]) == sha256_of(want)


def _params(seed: int, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 32, generator=g).to(dtype), "layer.w": torch.randn(32, 32, generator=g).to(dtype),
            "norm": torch.randn(32, generator=g).to(dtype)}


def _sync(source, receivers, tensors, manifest, version=1, members=None):
    """One sync: the source sends in this thread while each receiver takes the ticket in its own."""
    names = members if members is not None else [r[0] for r in receivers]
    ticket = source.ticket(version).addressed(names, regroup=False)
    errors = []

    def receive(name, roll, state, params):
        try:
            m, join = roll.answer(ticket)
            if join:
                state["member"] = GroupMember(m, manifest_of(params.items()), timeout_s=20, who=name)
                state["member"].checksums = True
            state["bytes"] = state["member"].receive(ticket.bucket_bytes, lambda vs: [params[n].copy_(v) for n, v in vs])
        except Exception as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=receive, args=r) for r in receivers]
    for t in threads:
        t.start()
    try:
        st = source.send(ticket, lambda: tensors, manifest, threading.Event())
    finally:
        for t in threads:
            t.join(30)
    return st, errors


def test_two_receivers_get_the_sources_tensors_bit_for_bit_in_their_dtype_through_one_bucket():
    trainer = _params(1)  # fp32 master weights
    source = BroadcastSource("127.0.0.1", bucket_bytes=4096, timeout_s=20)
    allocated = []
    source.on_alloc = allocated.append
    manifest = manifest_of(trainer.items(), "bfloat16")
    receivers = [(f"e{i}", RollCall(f"e{i}", 20), {}, _params(10 + i, torch.bfloat16)) for i in range(2)]
    try:
        st, errors = _sync(source, receivers, trainer, manifest)
        assert not errors
        assert st.regrouped and st.bytes == sum(s.nbytes for s in manifest) == (64 * 32 + 32 * 32 + 32) * 2
        # The sender's only staging memory: one bucket, never a copy of the model.
        assert allocated == [max(b.nbytes for b in plan_buckets(manifest, 4096))] and allocated[0] <= 4096
        for _, _, state, params in receivers:
            for n, t in trainer.items():
                assert params[n].dtype == torch.bfloat16
                assert sha256_of(params[n]) == sha256_of(t.to(torch.bfloat16)) == state["member"].received[n], n
        # A second sync with the same members reuses the group.
        trainer["norm"].add_(1.0)
        st, errors = _sync(source, receivers, trainer, manifest, version=2)
        assert not errors and not st.regrouped
        for _, _, _, params in receivers:
            assert sha256_of(params["norm"]) == sha256_of(trainer["norm"].to(torch.bfloat16))
    finally:
        source.close()


def _raised(call) -> list:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what the test asserts on
        return [exc]
    return []


def test_a_restarted_receiver_asked_into_the_old_group_breaks_the_sync_at_once():
    """A new process addressed as a member of the group its predecessor was in (no regroup):
    both sides break (CollectiveBroken) instead of waiting for a receive that never comes."""
    trainer = _params(1)
    source = BroadcastSource("127.0.0.1", bucket_bytes=4096, timeout_s=20)
    manifest = manifest_of(trainer.items())
    old = ("e0", RollCall("e0", 20), {}, _params(2))
    try:
        assert not _sync(source, [old], trainer, manifest)[1]
        old[2]["member"].close()  # its process died
        ticket = source.ticket(2).addressed(["e0"], regroup=False)
        refused = []
        new = threading.Thread(target=lambda: refused.extend(_raised(lambda: RollCall("e0", 20).answer(ticket))))
        t0 = time.monotonic()
        new.start()
        with pytest.raises(CollectiveBroken):
            source.send(ticket, lambda: trainer, manifest, threading.Event())
        new.join(20)
        assert time.monotonic() - t0 < 10
        assert len(refused) == 1 and "restarted since" in str(refused[0])
    finally:
        source.close()


def test_a_member_lost_after_checking_in_breaks_the_sync_instead_of_holding_the_trainer():
    """A member that passed the manifest check and died before connecting (its node lost at that
    moment): gloo's rendezvous would wait for it with no end. Once every member's call is over
    (the rollout side saw it lost) the source gives the group up, and the next sync, to a new
    process, forms a new one."""
    trainer = _params(1)
    source = BroadcastSource("127.0.0.1", bucket_bytes=4096, timeout_s=60)
    manifest = manifest_of(trainer.items())
    try:
        ticket = source.ticket(1).addressed(["e0"], regroup=True)
        lost = threading.Event()

        def checks_in_and_dies():
            roll = RollCall("e0", 20)
            m, join = roll.answer(ticket)
            assert join
            roll._store.set(f"{m.prefix}check/{m.rank}", "ok")  # then its process is gone
            time.sleep(0.5)
            lost.set()  # the rollout side's call to it ended: lost

        dying = threading.Thread(target=checks_in_and_dies)
        t0 = time.monotonic()
        dying.start()
        with pytest.raises(CollectiveBroken, match="left while the group formed"):
            source.send(ticket, lambda: trainer, manifest, lost)
        dying.join(10)
        assert time.monotonic() - t0 < 10  # not gloo's timeout, not the source's 60 s
        st, errors = _sync(source, [("e0", RollCall("e0", 20), {}, _params(2))], trainer, manifest, version=2)
        assert not errors and st.regrouped and st.bytes == sum(s.nbytes for s in manifest)
    finally:
        source.close()


def test_a_manifest_mismatch_is_one_error_naming_the_tensor():
    trainer = _params(1)
    source = BroadcastSource("127.0.0.1", bucket_bytes=4096, timeout_s=20)
    wrong = _params(2)
    wrong["layer.w"] = torch.zeros(32, 16)
    receivers = [("e0", RollCall("e0", 20), {}, wrong)]
    try:
        with pytest.raises(ManifestMismatch, match=r"layer\.w.*\[32, 32\] float32.*\[32, 16\] float32"):
            _, errors = _sync(source, receivers, trainer, manifest_of(trainer.items()))
    finally:
        source.close()


def test_a_sync_nobody_answers_sends_nothing():
    source = BroadcastSource("127.0.0.1", bucket_bytes=4096, timeout_s=20)
    try:
        skipped = threading.Event()
        skipped.set()
        st = source.send(source.ticket(1), lambda: {}, [], skipped)
        assert st.bytes == 0 and source.group is None
    finally:
        source.close()


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_torch_engines_in_bf16_take_a_trainers_fp32_weights_bit_for_bit_with_no_fp32_copy(tiny_model_dir, monkeypatch, sharding):
    """Whole parameters, or (fsdp2, one rank in a group of its own) shards gathered one tensor
    at a time as the buckets are packed, in manifest order."""
    from core.real import grpo
    from core.real.engine_torch import TorchEngine
    from core.real.grpo import TorchTrainBackend
    from core.real.rank_group import RankGroup
    from core.runtimes.broadcast_transfer import BroadcastTransfer

    backend = TorchTrainBackend(tiny_model_dir, LearnSpec(sharding=sharding), threads=1)
    if sharding == "fsdp2":
        backend.join(RankGroup.alone("cpu", timeout_s=20))
    with torch.no_grad():  # weights a train step could have made
        for p in backend.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    gathered = []
    read = grpo.GatheredParameters.__getitem__
    monkeypatch.setattr(grpo.GatheredParameters, "__getitem__", lambda self, n: gathered.append(n) or read(self, n))
    # The broadcast path never makes the trainer's fp32 numpy copy of the model.
    monkeypatch.setattr(backend, "weights", lambda: pytest.fail("weights() copied the model"))
    engines = [TorchEngine(f"e{i}", tiny_model_dir, dtype="bfloat16") for i in range(2)]
    bucket = 8 * 1024
    transfer = BroadcastTransfer(backend, "127.0.0.1", bucket_bytes=bucket, dtype="bfloat16", timeout_s=20)
    allocated = []
    transfer.source.on_alloc = allocated.append

    async def sync(version):
        ticket = transfer.ticket(version).addressed([e.name for e in engines], regroup=False)
        receiving = asyncio.ensure_future(asyncio.gather(*(e.update_weights(version, ticket) for e in engines)))
        await transfer.send(ticket, receiving)
        await receiving

    async def main():
        for e in engines:
            await e.start()
        await sync(1)

    try:
        asyncio.run(main())
        trained = {n: grpo._full(t) for n, t in backend.parameters().items()}
        assert gathered == list(trained)  # read one by one, in manifest order
        assert all(hasattr(t, "full_tensor") == (sharding == "fsdp2") for t in backend.parameters().values())  # shards gathered
        embed = "model.embed_tokens.weight"
        assert trained[embed].numel() * 2 > bucket  # the embedding goes alone, straight into the engines' parameter
        for e in engines:
            got = dict(e.model.named_parameters())
            assert got.keys() == trained.keys()
            for n, t in trained.items():
                assert got[n].dtype == torch.bfloat16
                assert sha256_of(got[n]) == sha256_of(t.detach().to(torch.bfloat16)), n
            assert e.model.lm_head.weight.data_ptr() == got[embed].data_ptr()  # still tied
            assert e.version == 1
        assert transfer.bytes == sum(t.numel() * 2 for t in trained.values())
        # One staging buffer: a bucket, or the largest tensor when one is larger (it goes alone),
        # in bf16 - a fraction of the model, never its fp32 copy.
        largest = max(t.numel() * 2 for t in trained.values())
        assert allocated == [max(bucket, largest)] and allocated[0] * 4 < transfer.bytes
    finally:
        transfer.close()


def _greedy(engine, n_tokens=24):
    import numpy as np

    from core.model.sample import Group, Sample

    uids = itertools.count()
    prompt = np.asarray([2, 5, 9, 12, 7, 3], dtype=np.int64)
    g = Group(prompt_id=0, samples=[Sample(uid=next(uids), prompt_id=0, index=0, n_prompt=6, prompt_tokens=prompt)],
              version=0, admitted_at=0.0)
    return g


@pytest.mark.runtime
def test_vllm_takes_a_broadcast_bit_for_bit_with_no_file(tiny_model_dir, monkeypatch):
    """vLLM repacks its linear weights on CPU, so what can be compared bit for bit is what the
    worker received (per tensor, against the trainer's) and the parameters it keeps as they are
    (embedding, norms); the rest shows in generation, identical to loading the same weights
    from a file."""
    from core.real.engine_vllm import VllmEngine
    from core.real.grpo import TorchTrainBackend
    from core.real.hf_model import model_dtype
    from core.runtimes.broadcast_transfer import BroadcastTransfer

    backend = TorchTrainBackend(tiny_model_dir, LearnSpec(), threads=1)
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    name = f"bcast-vllm-{os.getpid()}"
    engine = VllmEngine(name, tiny_model_dir, max_model_len=256, temperature=0.0, max_num_seqs=4)
    engine.received_checksums = True
    # The trainer's side resolves the engines' dtype as the ray runtime does (the engine, at start).
    transfer = BroadcastTransfer(backend, "127.0.0.1", bucket_bytes=16 * 1024, dtype=model_dtype(tiny_model_dir), timeout_s=30)
    monkeypatch.setattr(backend, "weights", lambda: pytest.fail("weights() copied the model"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    seen: set = set()
    watching = threading.Event()

    def watch():  # any file of this engine's in /dev/shm while it syncs
        while not watching.is_set():
            seen.update(f for f in os.listdir(shm) if name in f)

    async def main():
        await engine.start()
        g = _greedy(engine)
        assert await engine.generate(g, 24)
        before = list(g.samples[0].response_tokens)
        ticket = transfer.ticket(1).addressed([name], regroup=False)
        receiving = asyncio.ensure_future(engine.update_weights(1, ticket))
        await transfer.send(ticket, receiving)
        await receiving
        g = _greedy(engine)
        assert await engine.generate(g, 24)
        after_broadcast = (list(g.samples[0].response_tokens), list(g.samples[0].logprobs))
        shapes = {n: list(t.shape) for n, t in backend.parameters().items()}
        params = await engine._engine.collective_rpc("asyncrl_parameter_checksums", args=(shapes,))
        # The same weights through the file path (object store's): the same generation.
        monkeypatch.undo()
        await engine.update_weights(2, backend.weights())
        assert params[0] == (await engine._engine.collective_rpc("asyncrl_parameter_checksums", args=(shapes,)))[0]
        g = _greedy(engine)
        assert await engine.generate(g, 24)
        after_file = (list(g.samples[0].response_tokens), list(g.samples[0].logprobs))
        await engine.close(0.0)
        return before, after_broadcast, after_file, params[0]

    watcher = threading.Thread(target=watch) if shm else None
    if watcher:
        watcher.start()
    try:
        before, after_broadcast, after_file, params = asyncio.run(main())
    finally:
        watching.set()
        if watcher:
            watcher.join()
        transfer.close()
    trained = backend.parameters()
    got = engine.last_received["checksums"]
    assert engine.dtype == "float32" and got.keys() == trained.keys()
    for n, t in trained.items():
        assert got[n] == sha256_of(t.detach()), n
    kept = [n for n in params if n in trained]
    assert "model.embed_tokens.weight" in kept and any("norm" in n for n in kept)
    for n in kept:
        assert params[n] == sha256_of(trained[n].detach()), n
    assert after_broadcast[0] != before  # the new weights decode
    assert after_broadcast == after_file
    # Only the file path wrote into /dev/shm (the watcher saw its directory, so it was looking).
    assert not shm or all("-w2-" in f for f in seen) and seen
