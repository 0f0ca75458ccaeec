"""On the ray runtime a group's tokens go from the engine actor to the trainer by reference:
what the rollout actor's side receives is metadata, and a resumed group takes its partial
tokens back from the engine that holds them, or fetches them by reference elsewhere."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from core.model.group_wire import attach_tokens
from core.model.sample import Group, Sample
from tests.test_runtimes import small

# The ray runtime's engine actors are the subject: `make test`'s pure-Python pass skips them.
pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def engines(ray_session, tiny_model_dir):
    from core.real.reward import make_task
    from core.runtimes.ray_engine_host import EngineHost, EngineProxy

    sc = small("scenarios/real-cpu-torch.yaml", tiny_model_dir)
    cls = ray_session.remote(EngineHost).options(num_cpus=0)
    handles = [cls.remote(sc, f"engine{i:03d}", 1, i) for i in range(2)]
    ray_session.get([h.start.remote() for h in handles], timeout=120)
    yield [EngineProxy(f"engine{i:03d}", h, 0.0) for i, h in enumerate(handles)], make_task(sc)
    for h in handles:
        ray_session.kill(h)


def _group(task, pid: int, n: int = 2) -> Group:
    tokens = task.tokens(pid)
    samples = [Sample(pid * n + i, pid, i, len(tokens), tokens) for i in range(n)]
    return Group(prompt_id=pid, samples=samples, version=0, admitted_at=0.0)


def _tokens(ray, group: Group) -> Group:
    """What the trainer does with a group it is handed (QueueProxy.get_batch)."""
    attach_tokens(group, ray.get(group.payload, timeout=60))
    return group


def test_a_finished_group_reaches_this_side_as_metadata_and_a_reference(ray_session, engines):
    proxies, task = engines
    g = _group(task, 0)
    assert asyncio.run(proxies[0].generate(g, 16))
    # Counts, spans and rewards came back; not one token.
    assert all(s.finished and s.n_response > 0 and len(s.response_tokens) == len(s.logprobs) == 0 for s in g.samples)
    assert all(s.version_spans == [[0, s.n_response]] for s in g.samples)
    assert isinstance(g.payload, ray_session.ObjectRef)
    got = _tokens(ray_session, g)
    assert [len(s.response_tokens) for s in got.samples] == [s.n_response for s in got.samples]
    assert all(s.response_tokens.dtype == np.int32 and s.logprobs.dtype == np.float64 for s in got.samples)
    assert [s.reward for s in got.samples] == [task.reward(0, s.response_tokens) for s in got.samples]


def test_a_resumed_group_takes_its_tokens_back_from_its_engine_or_by_reference(ray_session, engines):
    proxies, task = engines

    async def interrupted(proxy, g: Group, after_s: float) -> bool:
        """Generate, aborting ``after_s`` later."""
        run = asyncio.ensure_future(proxy.generate(g, 400))
        await asyncio.sleep(after_s)
        await proxy.abort_all()
        return await run

    async def main():
        # A group cut with tokens in every response: how long that takes depends on the
        # machine, so the abort comes later on each try.
        for pid in range(1, 9):
            g = _group(task, pid)
            if not await interrupted(proxies[0], g, 0.05 * pid) and all(s.n_response for s in g.samples):
                break
        else:
            pytest.fail("no generation was cut with tokens in every response")
        partial = [s.n_response for s in g.samples]
        held_ref = g.payload
        # Back to the engine that holds it: it uses the tokens it kept.
        await interrupted(proxies[0], g, 0.05)
        mid = [s.n_response for s in g.samples]
        # Elsewhere: fetched by reference, and generation goes on from there.
        done = await proxies[1].generate(g, 400)
        return done, partial, mid, held_ref, g

    done, partial, mid, held_ref, g = asyncio.run(main())
    assert done and all(0 < p <= m <= s.n_response for p, m, s in zip(partial, mid, g.samples))
    whole = _tokens(ray_session, g)
    start = _tokens(ray_session, Group(g.prompt_id, [Sample(s.uid, g.prompt_id, s.index, s.n_prompt, n_response=p) for s, p in zip(g.samples, partial)], 0, 0.0, payload=held_ref))
    for s, head in zip(whole.samples, start.samples):
        np.testing.assert_array_equal(s.response_tokens[: head.n_response], head.response_tokens)
    stats = [ray_session.get(p.handle.close.remote(), timeout=60) for p in proxies]
    assert (stats[0]["resumed_held"], stats[0]["resumed_fetched"]) == (1, 0)
    assert (stats[1]["resumed_held"], stats[1]["resumed_fetched"]) == (0, 1)
