"""In-flight weight updates on the vLLM engine: ``freeze``, ``update_weights`` under running
requests, ``thaw``.

One engine per module on one event loop (vLLM takes seconds to start and its ``AsyncLLM`` is
bound to the loop it started on); a test that loads other weights puts the original ones back.
Skipped where vllm is not installed, except the version tagging unit test, which needs none.
"""

from __future__ import annotations

import os

# Before anything imports vllm: in-process engine core settings and a small CPU KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import asyncio  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from core.model.sample import Group, Sample  # noqa: E402
from core.real.engine_vllm import VllmEngine, _Request  # noqa: E402
from tests.polling import wait_for  # noqa: E402

# The vLLM engine is the subject: `make test`'s pure-Python pass skips it.
pytestmark = pytest.mark.runtime

ATOL = 1e-2  # vLLM's CPU kernels against the HF model, as in test_engines
PROMPT = [2, 5, 9, 12, 7, 3]
MAX_LEN = 64
_uids = itertools.count()





@pytest.fixture(scope="module")
def engine(tiny_model_dir, loop):
    pytest.importorskip("vllm")
    eng = VllmEngine("vllm-inflight", tiny_model_dir, max_num_seqs=16, temperature=1.0, seed=0, max_model_len=512)
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.close(loop.time()))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Teacher-forced log-probs of ``prompt + response[:n]`` under the original HF model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logprobs(sample: Sample, n: int) -> np.ndarray:
        p = len(sample.prompt_tokens)
        response = sample.response_tokens[:n].tolist()
        ids = torch.tensor([list(sample.prompt_tokens) + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, p - 1 : -1]
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, torch.tensor(response)[:, None])[:, 0].numpy()

    return logprobs


def make_group(n: int, prompt: list[int] = PROMPT) -> Group:
    tokens = np.asarray(prompt, dtype=np.int64)
    samples = [
        Sample(uid=next(_uids), prompt_id=0, index=i, n_prompt=len(prompt), prompt_tokens=tokens) for i in range(n)
    ]
    return Group(prompt_id=0, samples=samples, version=0, admitted_at=0.0)


def check_sample(s: Sample, eos: int) -> None:
    assert s.n_response == len(s.response_tokens) == len(s.logprobs) <= MAX_LEN
    assert sum(n for _, n in s.version_spans) == s.n_response
    if s.finished:
        assert s.response_tokens[-1] == eos or s.n_response == MAX_LEN



def all_running(engine: VllmEngine, g: Group, tokens: int = 3):
    """True once every sample of ``g`` is live, having streamed ``tokens`` (prefilled, decoding),
    or already finished (early EOS)."""
    return lambda: (
        bool(engine._live)
        and len(engine._live) + sum(s.finished for s in g.samples) == g.size
        and all(len(r.tokens) >= tokens for r in engine._live.values())
    )


def test_tag_splits_a_delta_at_the_step_that_changed_version():
    """A delta read after the thaw can hold tokens sampled before the freeze: each token takes
    the version of the step that sampled it, from the live request state or the final spans."""
    eng = VllmEngine("unit", "/nonexistent")
    state = SimpleNamespace(weight_version_starts=[("0", 0)])
    op = SimpleNamespace(external_req_ids={"r": ["r-abc"]}, request_states={"r-abc": state})
    eng._engine = SimpleNamespace(output_processor=op)
    req = _Request("r", Sample(uid=0, prompt_id=0, index=0, n_prompt=1))

    def read(n: int, final=None) -> None:
        eng._tag(req, n, final)
        req.tokens.extend([7] * n)

    read(3)
    state.weight_version_starts.append(("1", 5))  # steps up to token 5 on version 0, then 1
    read(4)
    assert req.spans == [[0, 5], [1, 2]]
    final = [SimpleNamespace(version="0", start=0, end=5), SimpleNamespace(version="1", start=5, end=9)]
    read(2, final)
    assert req.spans == [[0, 5], [1, 4]]
    eng.version = 3
    lone = _Request("gone", Sample(uid=1, prompt_id=0, index=0, n_prompt=1))
    eng._tag(lone, 2, None)  # no state left and no final spans: the version now
    assert lone.spans == [[3, 2]]


def test_freeze_update_thaw_keeps_requests_and_their_kv(engine, loop, weights, perturbed, reference):
    g = make_group(8)

    async def run():
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await wait_for(all_running(engine, g), timeout=30.0, every=0.002)
        await engine.freeze()
        t_frozen = time.time()
        seen = {r.sample.uid: len(r.tokens) for r in engine._live.values()}
        await asyncio.sleep(0.05)  # outputs of the last step before the pause are in
        before = (engine.scheduled_tokens, engine.preempted_requests, engine.prefill_tokens)
        await asyncio.sleep(0.3)
        counters = (engine.scheduled_tokens, engine.preempted_requests, engine.prefill_tokens)
        assert counters == before, "frozen: no step ran"
        assert not task.done()
        await engine.update_weights(1, perturbed)
        assert engine.version == 1 and not task.done()
        await engine.thaw()
        t_thawed = time.time()
        assert await task is True
        await asyncio.sleep(0.05)  # the last step's stats are recorded
        after = (engine.scheduled_tokens, engine.preempted_requests, engine.prefill_tokens)
        return seen, before, after, t_thawed - t_frozen

    try:
        seen, before, after, frozen_s = loop.run_until_complete(run())
    finally:
        loop.run_until_complete(engine.update_weights(0, weights))
    split = 0
    for s in g.samples:
        assert s.finished
        check_sample(s, engine.eos_token_id)
        if s.version_spans == [[0, s.n_response]]:  # its last token came from the step before the pause
            continue
        (v0, k), (v1, m) = s.version_spans
        assert (v0, v1) == (0, 1) and k >= seen.get(s.uid, 0) and m >= 1
        split += 1
        # Tokens tagged 0 were sampled by the original model on a context it computed itself.
        np.testing.assert_allclose(s.logprobs[:k], reference(s, k), atol=ATOL)
        # The first token tagged 1 was sampled by the perturbed weights: it is off the original
        # model by more than the tokens before it (float noise) are.
        d = np.abs(np.asarray(s.logprobs[: k + 1]) - reference(s, k + 1))
        assert d[k] > 10 * d[:k].max() + 1e-5, d
    assert split >= 6, "most requests ran on across the update"
    decoded_after = sum(n for s in g.samples for v, n in s.version_spans if v == 1)
    sched, preempted, prefill = (a - b for a, b in zip(after, before))
    # KV survived: after the thaw each step computed one position per token it decoded, and no
    # running context was prefilled again (a recompute would add ~len(PROMPT)+k per request).
    assert sched == decoded_after, (sched, decoded_after)
    assert preempted == 0 and prefill == 0
    # Calibration does not read the frozen gap as one long step.
    assert all(dt < frozen_s for *_, dt in engine.step_spans()["steps"])


def test_update_weights_in_flight_not_frozen_raises(engine, loop):
    g = make_group(4)

    async def run():
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await asyncio.sleep(0)  # generate() has submitted its requests
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.update_weights(engine.version + 1, None)
        assert engine.version == 0
        await engine.abort_all()
        assert await task is False

    loop.run_until_complete(run())
    for s in g.samples:
        check_sample(s, engine.eos_token_id)


def test_abort_all_while_frozen(engine, loop, weights):
    g = make_group(6)

    async def run():
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await wait_for(all_running(engine, g), timeout=30.0, every=0.002)
        await engine.freeze()
        live = {r.sample.uid for r in engine._live.values()}
        assert await engine.abort_all() == len(live)
        assert await task is False
        await engine.update_weights(1, None)  # nothing in flight any more: allowed
        await engine.thaw()
        await engine.clear_cache()  # the aborted requests freed their blocks
        h = make_group(2)
        assert await engine.generate(h, 16) is True
        return h, live

    try:
        h, live = loop.run_until_complete(run())
    finally:
        loop.run_until_complete(engine.update_weights(0, weights))
    assert len(live) >= 4
    for s in g.samples:
        check_sample(s, engine.eos_token_id)
        assert s.version_spans == [[0, s.n_response]]
        assert s.finished != (s.uid in live)
        assert s.finished or s.n_response >= 3, "aborted with the tokens it had streamed"
    for s in h.samples:
        assert s.finished and s.version_spans == [[1, s.n_response]]


def test_requests_submitted_while_frozen_wait_for_thaw(engine, loop):
    g = make_group(2)

    async def run():
        await engine.freeze()
        await engine.freeze()  # idempotent
        task = asyncio.create_task(engine.generate(g, 16))
        before = engine.scheduled_tokens
        await asyncio.sleep(0.2)
        assert engine.scheduled_tokens == before and not task.done()
        await engine.thaw()
        await engine.thaw()
        assert await task is True

    loop.run_until_complete(run())
    for s in g.samples:
        assert s.finished and s.version_spans == [[0, s.n_response]]
