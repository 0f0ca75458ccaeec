"""The real engines (torch, vLLM) against the engine protocol, on the tiny local model.

Each engine is started once per module on one event loop (vLLM takes seconds to start and
its ``AsyncLLM`` is bound to the loop it started on). Tests that load other weights put the
original ones back, so the teacher-forced reference model stays valid for the next test.
"""

from __future__ import annotations

import os

# Before anything imports vllm: in-process engine core settings and a small CPU KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import asyncio  # noqa: E402
import itertools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from core.model.sample import Group, Sample  # noqa: E402
from core.model.timeline import GENERATE, Timeline  # noqa: E402
from tests.polling import wait_for  # noqa: E402

# vLLM's engine is the runtime's subject (`make test`'s pure-Python pass skips it); torch's runs in both.
ENGINES = ["torch", pytest.param("vllm", marks=pytest.mark.runtime)]
# Teacher-forced log-probs agree to float32 noise on torch; vLLM's CPU kernels differ more.
ATOL = {"torch": 1e-3, "vllm": 1e-2}
MAX_NUM_SEQS = 32
_uids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def reference(model_dir):
    """Teacher-forced log-probs of ``prompt + response`` under the HF model with ``state``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}

    def logprobs(sample: Sample, temperature: float, state: dict[str, np.ndarray] | None = None) -> np.ndarray:
        sd = original if state is None else {k: torch.from_numpy(v) for k, v in state.items()}
        model.load_state_dict(sd, strict=False)
        p = len(sample.prompt_tokens)
        ids = torch.tensor([list(sample.prompt_tokens) + sample.response_tokens.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, p - 1 : -1]
        lp = torch.log_softmax(logits / temperature, dim=-1)
        return lp.gather(1, torch.tensor(sample.response_tokens.tolist())[:, None])[:, 0].numpy()

    return logprobs


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, model_dir, loop):
    timeline = Timeline()
    kw = dict(max_num_seqs=MAX_NUM_SEQS, temperature=1.0, seed=0, threads=2, timeline=timeline)
    if request.param == "torch":
        from core.real.engine_torch import TorchEngine

        eng = TorchEngine("torch0", model_dir, **kw)
    else:
        from core.real.engine_vllm import VllmEngine

        eng = VllmEngine("vllm0", model_dir, max_model_len=512, **kw)
    loop.run_until_complete(eng.start())
    eng.kind = request.param
    yield eng
    loop.run_until_complete(eng.close(loop.time()))
    assert timeline.spans[eng.name], "busy periods are on the timeline"


def make_group(n: int, prompt: list[int], prompt_id: int = 0) -> Group:
    tokens = np.asarray(prompt, dtype=np.int64)
    samples = [
        Sample(uid=next(_uids), prompt_id=prompt_id, index=i, n_prompt=len(prompt), prompt_tokens=tokens)
        for i in range(n)
    ]
    return Group(prompt_id=prompt_id, samples=samples, version=0, admitted_at=0.0)


PROMPT = [2, 5, 9, 12, 7, 3]


def check_sample(s: Sample, max_len: int, eos: int) -> None:
    assert s.n_response == len(s.response_tokens) == len(s.logprobs) <= max_len
    assert all(lp <= 1e-6 for lp in s.logprobs)
    assert sum(n for _, n in s.version_spans) == s.n_response
    if s.finished:
        assert s.response_tokens[-1] == eos or s.n_response == max_len
        assert eos not in s.response_tokens[:-1]
        assert s.started_at <= s.finished_at



def test_group_generates(engine, loop):
    g = make_group(8, PROMPT)
    tokens0 = engine.tokens_generated
    assert loop.run_until_complete(engine.generate(g, 48)) is True
    for s in g.samples:
        assert s.finished
        check_sample(s, 48, engine.eos_token_id)
        assert s.version_spans == [[0, s.n_response]]
    assert engine.tokens_generated - tokens0 == sum(s.n_response for s in g.samples)
    assert len({tuple(s.response_tokens) for s in g.samples}) > 1, "samples differ at temperature 1"


def test_a_turn_ends_at_a_stop_id_and_keeps_it(engine, loop, reference):
    """An agent's turn: generation stops at the first token of ``stop_ids`` (as at <eos>), which
    stays the response's last token; generating again goes on from there."""
    first = make_group(8, PROMPT)
    assert loop.run_until_complete(engine.generate(first, 48))
    # A token the model does sample, a few tokens in, so some responses stop early on it.
    stop = next(int(t) for s in first.samples for t in s.response_tokens[2:-1] if t != engine.eos_token_id)
    g = make_group(16, PROMPT)
    assert loop.run_until_complete(engine.generate(g, 48, frozenset({stop}))) is True
    stopped = [s for s in g.samples if s.n_response and s.response_tokens[-1] == stop]
    assert stopped, "some response sampled the stop id"
    for s in g.samples:
        assert s.finished
        assert stop not in s.response_tokens[:-1].tolist(), "nothing is generated past a stop id"
        np.testing.assert_allclose(s.logprobs, reference(s, 1.0), atol=ATOL[engine.kind])
    s = stopped[0]
    n = s.n_response
    s.finished = False  # the agent loop's next turn
    assert loop.run_until_complete(engine.generate(Group(0, [s], 0, 0.0), n + 16))
    assert s.n_response > n and s.response_tokens[n - 1] == stop
    np.testing.assert_allclose(s.logprobs, reference(s, 1.0), atol=ATOL[engine.kind])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_behaviour_policy(engine, loop, reference, temperature):
    engine.temperature = temperature
    try:
        g = make_group(4, PROMPT)
        assert loop.run_until_complete(engine.generate(g, 32))
    finally:
        engine.temperature = 1.0
    for s in g.samples:
        np.testing.assert_allclose(s.logprobs, reference(s, temperature), atol=ATOL[engine.kind])


def test_requests_join_a_running_batch(engine, loop, reference):
    """A group that arrives mid-generation (another prompt length) is batched with the first."""
    a, b = make_group(4, PROMPT, 1), make_group(4, PROMPT[:3] + [20, 21, 22, 23, 24, 25], 2)

    async def run():
        first = asyncio.create_task(engine.generate(a, 64))
        await wait_for(lambda: any(s.finished for s in a.samples))
        assert a.unfinished(), "the first group is still running when the second arrives"
        return await asyncio.gather(first, engine.generate(b, 64))

    assert loop.run_until_complete(run()) == [True, True]
    for s in a.samples + b.samples:
        check_sample(s, 64, engine.eos_token_id)
        np.testing.assert_allclose(s.logprobs, reference(s, 1.0), atol=ATOL[engine.kind])


def test_torch_cache_wraps_around_under_a_batch_that_never_empties(model_dir, loop, reference):
    """The torch engine's buffers grow to 2 x max positions columns at most: a batch joined
    again and again for longer than that moves its live columns back (``_fit``), and every
    token's log-prob still matches a forward pass over the whole text."""
    from core.real.engine_torch import TorchEngine

    eng = TorchEngine("torch-wrap", model_dir, max_num_seqs=8, seed=1)
    loop.run_until_complete(eng.start())
    eng.max_positions = 24  # buffers of 48 columns; responses up to 24 - 6 tokens
    moved = []
    fit = eng._fit
    eng._fit = lambda width, kv=None: (moved.append(eng._mask.shape[1]), fit(width, kv))

    async def run():
        groups, tasks = [], []
        for i in range(12):  # each joins while the one before is running
            g = make_group(2, PROMPT[: 3 + i % 4], prompt_id=i)
            groups.append(g)
            tasks.append(asyncio.create_task(eng.generate(g, 64)))
            await wait_for(lambda: any(s.n_response for s in g.samples) or all(s.finished for s in g.samples))
        assert all(await asyncio.gather(*tasks))
        return groups

    try:
        groups = loop.run_until_complete(run())
        steps = len(eng.decode_steps)
    finally:
        loop.run_until_complete(eng.close(loop.time()))
    assert steps > 48
    assert moved.count(48) >= 2, "the live columns reached the end of the widest buffer and moved back"
    for s in (s for g in groups for s in g.samples):
        check_sample(s, 24 - len(s.prompt_tokens), eng.eos_token_id)
        np.testing.assert_allclose(s.logprobs, reference(s, 1.0), atol=ATOL["torch"])


def test_partial_rollout_resumes_on_new_weights(engine, loop, reference, weights, perturbed):
    g = make_group(8, PROMPT)
    max_len = 300

    async def first_pass():
        task = asyncio.create_task(engine.generate(g, max_len))
        # Tokens flow once a sample has finished; the others are mid-response then.
        await wait_for(lambda: any(s.finished for s in g.samples) or task.done())
        n = await engine.abort_all()
        return n, await task

    n, ok = loop.run_until_complete(first_pass())
    assert not ok and n >= 1
    cut = {s.uid: s.n_response for s in g.samples if not s.finished}
    assert cut, "some samples were interrupted"
    for s in g.samples:
        check_sample(s, max_len, engine.eos_token_id)
    try:
        loop.run_until_complete(engine.update_weights(1, perturbed))
        assert engine.version == 1
        assert loop.run_until_complete(engine.generate(g, max_len)) is True
        for s in g.samples:
            assert s.finished
            check_sample(s, max_len, engine.eos_token_id)
            if s.uid in cut:
                spans = [[0, cut[s.uid]], [1, s.n_response - cut[s.uid]]] if cut[s.uid] else [[1, s.n_response]]
                assert s.version_spans == spans
                versions = s.token_versions()
                expect = np.where(versions == 0, reference(s, 1.0), reference(s, 1.0, perturbed))
                np.testing.assert_allclose(s.logprobs, expect, atol=ATOL[engine.kind])
            else:
                assert s.version_spans == [[0, s.n_response]]
    finally:
        loop.run_until_complete(engine.update_weights(0, weights))


def test_weights_change_the_engine(engine, loop, reference, weights, perturbed):
    def greedy() -> list[list[int]]:
        g = make_group(2, PROMPT)
        assert loop.run_until_complete(engine.generate(g, 24))
        return [s.response_tokens.tolist() for s in g.samples]

    engine.temperature = 0.0
    try:
        before = greedy()
        assert before[0] == before[1], "greedy decoding is deterministic"
        loop.run_until_complete(engine.update_weights(1, perturbed))
        changed = greedy()
        # Every weight is live, the tied LM head included: sampling matches the new model.
        engine.temperature = 1.0
        g = make_group(3, PROMPT)
        assert loop.run_until_complete(engine.generate(g, 32))
        for s in g.samples:
            assert s.version_spans == [[1, s.n_response]]
            np.testing.assert_allclose(s.logprobs, reference(s, 1.0, perturbed), atol=ATOL[engine.kind])
        engine.temperature = 0.0
        loop.run_until_complete(engine.update_weights(0, weights))
        restored = greedy()
    finally:
        engine.temperature = 1.0
        loop.run_until_complete(engine.update_weights(0, weights))
    assert changed != before
    assert restored == before


def test_update_weights_in_flight_raises_and_idle_abort(engine, loop):
    assert loop.run_until_complete(engine.abort_all()) == 0

    async def run():
        g = make_group(4, PROMPT)
        task = asyncio.create_task(engine.generate(g, 300))
        await asyncio.sleep(0)  # generate() has submitted its requests
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.update_weights(engine.version, None)
        await engine.abort_all()
        await task
        await engine.update_weights(engine.version, None)  # fine once idle
        return g

    g = loop.run_until_complete(run())
    for s in g.samples:
        check_sample(s, 300, engine.eos_token_id)
    assert loop.run_until_complete(engine.abort_all()) == 0


def test_accounting(engine, loop):
    def counters() -> tuple[float, ...]:
        return (engine.tokens_generated, engine.prefill_tokens, engine.busy_s, engine.seq_s)

    before = counters()
    g = make_group(6, PROMPT)
    loop.run_until_complete(engine.clear_cache())
    t0 = loop.time()
    assert loop.run_until_complete(engine.generate(g, 40))
    wall = loop.time() - t0
    tokens, prefill, busy, seq = (a - b for a, b in zip(counters(), before))
    assert tokens == sum(s.n_response for s in g.samples)
    assert prefill >= len(PROMPT)  # the shared prompt at least once
    assert 0 < busy <= wall + 1e-6
    # Between one and all six samples were running at every busy moment.
    assert busy * (1 - 1e-9) <= seq <= 6 * busy * (1 + 1e-9)
    spans = engine.timeline.spans[engine.name]
    assert spans[-1][0] == GENERATE and spans[-1][2] <= loop.time()


def test_cancelled_generate_stops_its_requests(engine, loop):
    g = make_group(4, PROMPT)

    async def run():
        task = asyncio.create_task(engine.generate(g, 300))
        await wait_for(lambda: any(s.finished for s in g.samples) or task.done())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await engine.abort_all() == 0, "nothing left running"
        await engine.update_weights(engine.version, None)

    loop.run_until_complete(run())
    for s in g.samples:
        check_sample(s, 300, engine.eos_token_id)
