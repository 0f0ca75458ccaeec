"""In-flight weight updates in the torch engine: ``freeze``, ``update_weights`` under running
requests, ``thaw``. Generations go on across the sync from the KV cache they had, and every
token carries the version of the weights that sampled it.

The tiny model decodes a step in milliseconds, so each test starts its own seeded engine
(cheap) and freezes after a few decode steps, while most responses are still running.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
import torch

from core.model.sample import Group, Sample
from core.model.timeline import GENERATE, Timeline
from core.real.engine_torch import TorchEngine
from core.real.hf_model import load_model
from tests.polling import wait_for

PROMPT = [2, 5, 9, 12, 7, 3]
MAX_LEN = 64
ATOL = 1e-3
_uids = itertools.count()





def start_engine(model_dir, loop, **kw) -> TorchEngine:
    eng = TorchEngine("torch0", model_dir, max_num_seqs=32, temperature=1.0, seed=0, threads=1, **kw)
    loop.run_until_complete(eng.start())
    return eng


@pytest.fixture
def engine(tiny_model_dir, loop):
    eng = start_engine(tiny_model_dir, loop, timeline=Timeline())
    yield eng
    loop.run_until_complete(asyncio.wait_for(eng.close(loop.time()), 10))


def make_group(n: int, prompt: list[int] = PROMPT, prompt_id: int = 0) -> Group:
    tokens = np.asarray(prompt, dtype=np.int64)
    samples = [
        Sample(uid=next(_uids), prompt_id=prompt_id, index=i, n_prompt=len(prompt), prompt_tokens=tokens)
        for i in range(n)
    ]
    return Group(prompt_id=prompt_id, samples=samples, version=0, admitted_at=0.0)


def check_sample(s: Sample) -> None:
    assert s.n_response == len(s.response_tokens) == len(s.logprobs) <= MAX_LEN
    assert sum(n for _, n in s.version_spans) == s.n_response
    assert all(n > 0 for _, n in s.version_spans)



async def freeze_after(engine: TorchEngine, steps: int) -> None:
    """Freeze once the decode loop has taken ``steps`` more decode steps."""
    target = len(engine.decode_steps) + steps
    await wait_for(lambda: len(engine.decode_steps) >= target)
    await engine.freeze()


def inflight_reference(model, sample: Sample, k: int, old: dict, new: dict) -> np.ndarray:
    """Log-probs of ``sample`` whose first ``k`` response tokens were sampled under ``old`` and
    the rest under ``new``, decoding on from the KV cache ``old`` computed. The last token
    sampled before the freeze is fed, so its KV computed, by the first step after it."""
    def load(state: dict) -> None:
        model.load_state_dict({n: torch.from_numpy(v) for n, v in state.items()}, strict=False)

    p = len(sample.prompt_tokens)
    ids = torch.tensor([list(sample.prompt_tokens) + sample.response_tokens.tolist()])
    with torch.no_grad():
        load(old)
        first = model(input_ids=ids[:, : p + k - 1], use_cache=True)
        load(new)
        rest = model(input_ids=ids[:, p + k - 1 : -1], past_key_values=first.past_key_values, use_cache=True)
    logits = torch.cat([first.logits[0, p - 1 :], rest.logits[0]])
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(sample.response_tokens.tolist())[:, None])[:, 0].numpy()


def test_update_under_running_requests(engine, loop, tiny_model_dir, weights, perturbed):
    g = make_group(8)

    async def run():
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await freeze_after(engine, 8)
        steps, prefill = len(engine.decode_steps), engine.prefill_tokens
        running = [s for s in g.samples if not s.finished]
        await asyncio.sleep(0.05)
        assert len(engine.decode_steps) == steps, "no step runs while frozen"
        assert running and not task.done()
        await engine.update_weights(1, perturbed)
        assert engine.version == 1 and engine.prefill_tokens == prefill
        await engine.thaw()
        assert await task is True
        return prefill, running

    prefill, running = loop.run_until_complete(run())
    assert engine.prefill_tokens == prefill, "no context was prefilled again"
    model = load_model(tiny_model_dir).eval()
    for s in g.samples:
        assert s.finished
        check_sample(s)
        if s in running:
            (v0, k), (v1, m) = s.version_spans
            assert (v0, v1) == (0, 1) and k + m == s.n_response
            expect = inflight_reference(model, s, k, weights, perturbed)
            np.testing.assert_allclose(s.logprobs, expect, atol=ATOL)
        else:
            assert s.version_spans == [[0, s.n_response]]
    assert engine.tokens_generated == sum(s.n_response for s in g.samples)


def test_identical_weights_do_not_perturb_sampling(tiny_model_dir, loop, weights):
    """Two syncs to the same weights, mid-generation: same tokens and log-probs as a run
    without any, only the versions differ."""

    def run(syncs: int) -> Group:
        eng = start_engine(tiny_model_dir, loop)
        g = make_group(8)

        async def go():
            task = asyncio.create_task(eng.generate(g, MAX_LEN))
            for version in range(1, syncs + 1):
                await freeze_after(eng, 6)
                await eng.update_weights(version, weights)
                await eng.thaw()
            assert await task

        try:
            loop.run_until_complete(go())
        finally:
            loop.run_until_complete(eng.close(loop.time()))
        return g

    plain, synced = run(0), run(2)
    assert any(len(s.version_spans) == 3 for s in synced.samples), "some response spans both syncs"
    for a, b in zip(plain.samples, synced.samples):
        check_sample(b)
        np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.version_spans == [[0, a.n_response]]
        versions = [v for v, _ in b.version_spans]
        assert versions[0] == 0 and versions == sorted(set(versions)) and set(versions) <= {0, 1, 2}


def test_update_in_flight_not_frozen_raises(engine, loop):
    g = make_group(4)

    async def run():
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await freeze_after(engine, 2)
        await engine.thaw()
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.update_weights(1, None)
        assert engine.version == 0
        return await task

    assert loop.run_until_complete(run()) is True
    for s in g.samples:
        check_sample(s)
        assert s.version_spans == [[0, s.n_response]]


def test_abort_while_frozen_keeps_tokens_and_resumes(engine, loop, perturbed):
    g = make_group(8)

    async def run():
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await freeze_after(engine, 8)
        n = await engine.abort_all()
        assert await asyncio.wait_for(task, 5) is False
        await engine.update_weights(1, perturbed)  # still frozen, nothing in flight
        await engine.thaw()
        return n

    n = loop.run_until_complete(run())
    cut = {s.uid: s.n_response for s in g.samples if not s.finished}
    assert n == len(cut) > 0
    for s in g.samples:
        check_sample(s)
        assert s.version_spans == [[0, s.n_response]]
        if s.uid in cut:
            assert s.n_response >= 8, "the tokens before the freeze are kept"
    # The interrupted samples resume on the new weights, their tokens so far as context.
    assert loop.run_until_complete(engine.generate(g, MAX_LEN)) is True
    for s in g.samples:
        assert s.finished
        check_sample(s)
        if s.uid in cut and s.n_response > cut[s.uid]:
            assert s.version_spans == [[0, cut[s.uid]], [1, s.n_response - cut[s.uid]]]


def test_requests_arriving_while_frozen_join_after_thaw(engine, loop, perturbed):
    a, b = make_group(4, prompt_id=1), make_group(4, PROMPT[:3] + [20, 21, 22, 23], prompt_id=2)

    async def run():
        first = asyncio.create_task(engine.generate(a, MAX_LEN))
        await freeze_after(engine, 4)
        prefill = engine.prefill_tokens
        second = asyncio.create_task(engine.generate(b, MAX_LEN))
        await asyncio.sleep(0.05)
        assert engine.prefill_tokens == prefill and not second.done()
        assert all(np.isnan(s.started_at) for s in b.samples), "not scheduled while frozen"
        await engine.update_weights(1, perturbed)
        await engine.thaw()
        return await asyncio.gather(first, second)

    assert loop.run_until_complete(run()) == [True, True]
    for s in a.samples + b.samples:
        assert s.finished
        check_sample(s)
    for s in b.samples:
        assert s.version_spans == [[1, s.n_response]]


def test_freeze_idle_then_generate_waits_for_thaw(engine, loop):
    g = make_group(2)

    async def run():
        await engine.freeze()
        task = asyncio.create_task(engine.generate(g, 8))
        await asyncio.sleep(0.05)
        assert not task.done() and engine.tokens_generated == 0
        await engine.update_weights(3, None)
        await engine.thaw()
        return await task

    assert loop.run_until_complete(run()) is True
    for s in g.samples:
        check_sample(s)
        assert s.version_spans == [[3, s.n_response]]


def test_frozen_time_is_not_busy(engine, loop):
    g = make_group(8)
    pause = 0.2

    async def run():
        t0 = loop.time()
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await freeze_after(engine, 4)
        frozen_at = loop.time()
        await asyncio.sleep(pause)
        thawed_at = loop.time()
        await engine.thaw()
        assert await task
        return t0, frozen_at, thawed_at, loop.time()

    t0, frozen_at, thawed_at, t1 = loop.run_until_complete(run())
    assert 0 < engine.busy_s <= (t1 - t0) - (thawed_at - frozen_at) + 1e-6
    assert engine.seq_s <= 8 * engine.busy_s * (1 + 1e-9)
    spans = [sp for sp in engine.timeline.spans[engine.name] if sp[0] == GENERATE]
    assert len(spans) >= 2, "the freeze splits the busy period"
    assert not any(start < thawed_at and end > frozen_at for _, start, end in spans)


def test_close_while_frozen(engine, loop):
    g = make_group(4)

    async def run():
        task = asyncio.create_task(engine.generate(g, MAX_LEN))
        await freeze_after(engine, 4)
        await asyncio.wait_for(engine.close(loop.time()), 5)
        return await asyncio.wait_for(task, 5)

    assert loop.run_until_complete(run()) is False
    cut = [s for s in g.samples if not s.finished]
    assert cut
    for s in g.samples:
        check_sample(s)
        assert s.version_spans == [[0, s.n_response]]
    assert all(s.n_response >= 4 for s in cut), "the tokens before the freeze are kept"
