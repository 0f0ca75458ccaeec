"""The simulated engine against a token-by-token reference of continuous batching."""

import asyncio

import numpy as np
import pytest

from core.sim import virtual_clock
from core.model.config import Scenario, with_changes
from core.sim.costs import DecodeCost
from core.sim.engine import SimEngine, _terms
from core.model.sample import Group, Sample
from core.sim.workload import Workload
from core.runtimes.dispatch import run_mode
from harness.metrics import collect
from tests.engine_reference import stepped_finish_times, stepped_with_capacity


class FixedLengths:
    """A workload whose group g has the given response lengths."""

    def __init__(self, lengths):
        self.lengths = {g: np.asarray(v) for g, v in lengths.items()}

    def response_lengths(self, prompt_id):
        return self.lengths[prompt_id]


def group(pid, n, prompt=64):
    return Group(pid, [Sample(pid * n + i, pid, i, prompt) for i in range(n)], version=0, admitted_at=0.0)


def test_finish_times_match_token_by_token_reference():
    sc = Scenario()
    cost = DecodeCost(sc, 1)
    lengths = [37, 120, 5, 300, 300, 64, 1, 999]
    wl = FixedLengths({0: lengths})

    async def main():
        e = SimEngine("e", cost, wl, max_num_seqs=64)
        g = group(0, len(lengths))
        assert await e.generate(g, 10_000)
        return g, e

    g, e = virtual_clock.run(main())
    ref = stepped_finish_times(cost, 64, lengths, cost.prefill_s(0, 64))
    got = [s.finished_at for s in g.samples]
    # The engine integrates step time over a real-valued step count: within 0.5 % of stepping.
    np.testing.assert_allclose(got, ref, rtol=5e-3)
    assert [s.n_response for s in g.samples] == lengths
    assert e.tokens_generated == sum(lengths)
    assert all(s.version_spans == [[0, n]] for s, n in zip(g.samples, lengths))


def test_max_num_seqs_queues_the_rest():
    sc = Scenario()
    cost = DecodeCost(sc, 1)
    wl = FixedLengths({0: [100] * 4})

    async def main():
        e = SimEngine("e", cost, wl, max_num_seqs=2)
        g = group(0, 4)
        await e.generate(g, 10_000)
        return sorted(s.finished_at for s in g.samples)

    t = virtual_clock.run(main())
    assert t[0] == pytest.approx(t[1])
    assert t[2] == pytest.approx(t[3])
    assert t[2] > 1.9 * t[0]  # the second pair starts only when the first pair is done


def test_abort_keeps_partial_tokens_and_resume_finishes_at_budget():
    sc = Scenario()
    cost = DecodeCost(sc, 1)
    wl = FixedLengths({0: [50, 5000, 400]})

    async def main():
        loop = asyncio.get_running_loop()
        e = SimEngine("e", cost, wl, max_num_seqs=8)
        g = group(0, 3)
        task = asyncio.create_task(e.generate(g, 1000))
        await asyncio.sleep(1.0)
        assert await e.abort_all() == 2
        assert await task is False
        partial = [s.n_response for s in g.samples]
        await e.update_weights(1)
        t0 = loop.time()
        assert await e.generate(g, 1000) is True
        return g, partial, loop.time() - t0

    g, partial, _ = virtual_clock.run(main())
    assert partial[0] == 50 and 0 < partial[1] < 1000 and 0 < partial[2] < 400
    assert [s.n_response for s in g.samples] == [50, 1000, 400]  # the 5000-token one is cut at the budget
    long = g.samples[1]
    assert long.version_spans == [[0, partial[1]], [1, 1000 - partial[1]]]
    assert list(np.unique(long.token_versions())) == [0, 1]


def test_update_weights_refuses_in_flight_requests():
    sc = Scenario()
    wl = FixedLengths({0: [100]})

    async def main():
        e = SimEngine("e", DecodeCost(sc, 1), wl, max_num_seqs=8)
        task = asyncio.create_task(e.generate(group(0, 1), 1000))
        await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="pause the rollout first"):
            await e.update_weights(1)
        await e.abort_all()
        await task

    virtual_clock.run(main())


def test_freeze_keeps_requests_and_shifts_them_by_the_freeze_alone():
    # In-flight weight update: frozen for d seconds, every response ends exactly d later than
    # without the freeze, its tokens split at the freeze between the versions, and nothing is
    # prefilled again.
    sc = Scenario()
    lengths = [37, 120, 5, 300, 64, 999]
    cost = DecodeCost(sc, 1)
    d, at = 2.5, 0.4

    async def main(freeze: bool):
        e = SimEngine("e", cost, FixedLengths({0: lengths}), max_num_seqs=64)
        g = group(0, len(lengths))
        task = asyncio.create_task(e.generate(g, 10_000))
        if freeze:
            await asyncio.sleep(at)
            await e.freeze()
            with pytest.raises(asyncio.TimeoutError):  # nothing moves while frozen
                await asyncio.wait_for(asyncio.shield(task), d)
            await e.update_weights(1)
            await e.thaw()
        assert await task
        return g, e

    plain, e0 = virtual_clock.run(main(False))
    kept, e1 = virtual_clock.run(main(True))
    for a, b, n in zip(plain.samples, kept.samples, lengths):
        assert b.n_response == n
        if a.finished_at <= at:
            assert b.finished_at == pytest.approx(a.finished_at) and b.version_spans == [[0, n]]
        else:
            assert b.finished_at == pytest.approx(a.finished_at + d, rel=1e-9)
            assert b.version_spans[-1][0] == 1 and sum(k for _, k in b.version_spans) == n
            assert [v for v, _ in b.version_spans] in ([0, 1], [1])
    assert e1.prefill_tokens == e0.prefill_tokens and e1.tokens_generated == e0.tokens_generated
    assert e1.busy_s == pytest.approx(e0.busy_s, rel=1e-9)  # the freeze is not generation time


def test_requests_sent_to_a_frozen_engine_start_when_it_thaws():
    sc = Scenario()
    wl = FixedLengths({0: [50], 1: [50]})

    async def main():
        e = SimEngine("e", DecodeCost(sc, 1), wl, max_num_seqs=8)
        await e.freeze()
        g = group(1, 1)
        task = asyncio.create_task(e.generate(g, 1000))
        await asyncio.sleep(3.0)
        assert not task.done() and e.prefill_tokens == 0
        await e.update_weights(2)
        await e.thaw()
        assert await task
        return g

    g = virtual_clock.run(main())
    assert g.samples[0].version_spans == [[2, 50]] and g.samples[0].started_at == pytest.approx(3.0)


def test_workload_lengths_are_deterministic_and_clipped():
    sc = with_changes(Scenario(), {"workload.max_response_len": 3000})
    a, b = Workload(sc.workload, 7), Workload(sc.workload, 7)
    order = [5, 1, 3000, 2]
    first = [a.response_lengths(p).tolist() for p in order]
    second = [b.response_lengths(p).tolist() for p in reversed(order)][::-1]
    assert first == second
    assert max(max(x) for x in first) <= 3000
    assert Workload(sc.workload, 8).response_lengths(5).tolist() != first[0]


LONG_TAIL = [400, 900, 1500, 2000, 2500, 3000, 600, 1200]


def run_group(cost, lengths, max_num_seqs=64, cap=None):
    """One group on one engine (KV capacity ``cap`` tokens when given)."""
    if cap is not None:
        cost.kv_capacity_tokens = cap

    async def main():
        e = SimEngine("e", cost, FixedLengths({0: lengths}), max_num_seqs=max_num_seqs)
        g = group(0, len(lengths))
        assert await e.generate(g, 10_000)
        return g, e

    return virtual_clock.run(main())


@pytest.mark.parametrize("cap,max_num_seqs", [(5000, 64), (3500, 64), (4000, 3)])
def test_kv_capacity_preempts_like_the_token_by_token_reference(cap, max_num_seqs):
    """A full KV cache preempts the most recent request (vLLM V1, recompute): the event engine
    preempts as often, recomputes as many tokens and finishes every response when stepping does."""
    cost = DecodeCost(Scenario(), 1)
    g, e = run_group(cost, LONG_TAIL, max_num_seqs, cap)
    ref, preemptions, recomputed, prefilled = stepped_with_capacity(cost, 64, LONG_TAIL, cap, max_num_seqs)
    assert e.preemptions == preemptions > 0
    assert e.recomputed_tokens == recomputed > 0
    np.testing.assert_allclose([s.finished_at for s in g.samples], ref, rtol=5e-3)
    # Every response is generated whole, once: preempted tokens are kept, not generated again.
    assert [s.n_response for s in g.samples] == LONG_TAIL
    assert e.tokens_generated == sum(LONG_TAIL)
    # The recompute is charged as prefill: the prompt once per admission round, then what the preempted held.
    assert e.prefill_tokens == prefilled


def test_preemption_costs_time_and_ample_capacity_changes_nothing():
    ample, _ = run_group(DecodeCost(Scenario(), 1), LONG_TAIL, cap=float("inf"))
    default, e = run_group(DecodeCost(Scenario(), 1), LONG_TAIL)  # an H20's 1.2M tokens
    small, s = run_group(DecodeCost(Scenario(), 1), LONG_TAIL, cap=3500)
    assert e.preemptions == 0
    assert [x.finished_at for x in default.samples] == [x.finished_at for x in ample.samples]
    assert s.preemptions > 0
    assert max(x.finished_at for x in small.samples) > max(x.finished_at for x in ample.samples)


def test_kv_capacity_from_memory_and_weights():
    """H20 (96 GB x 0.9, 1 GB reserve) less Qwen2.5-7B's 15.24 GB of bf16 weights, over 56 KiB of
    KV per token (2 x 28 layers x 4 KV heads x 128 x 2 bytes)."""
    sc = Scenario()
    assert DecodeCost(sc, 1).kv_capacity_tokens == pytest.approx((96 * 0.9 - 1 - 15.24) * 1e9 / 57344)
    # Two GPUs per engine: twice the memory, the weights once.
    assert DecodeCost(sc, 2).kv_capacity_tokens == pytest.approx((2 * (96 * 0.9 - 1) - 15.24) * 1e9 / 57344)


def test_a_small_kv_cache_preempts_and_every_response_still_finishes_whole():
    """A whole run on engines with little memory: preemptions and recomputed prefill are
    reported, nothing is lost, and sync mode (the same samples whatever the timing) trains
    exactly the tokens it trains with ample memory, later."""
    sc = with_changes(Scenario(), {
        "resources.rollout_gpus": 2, "resources.trainer_gpus": 2, "trainer.batch_size": 64, "trainer.steps": 3,
        "workload.max_response_len": 4096, "staleness.max_staleness": 4,
    })
    small = with_changes(sc, {"gpu.memory_gb": 19.5})  # ~20k tokens of KV cache per engine
    assert DecodeCost(small, 1).kv_capacity_tokens < 25_000
    for mode in ("sync", "async", "partial", "inflight"):
        ample_run, small_run = run_mode(sc, mode), run_mode(small, mode)
        ample, tight = collect(ample_run), collect(small_run)
        assert ample["rollout/preemptions"] == 0 < tight["rollout/preemptions"]
        assert ample["tokens/recomputed_prefill"] == 0 < tight["tokens/recomputed_prefill"]
        assert tight["samples/lost"] == 0 and tight["samples/trainings"] == 3 * 64
        if mode == "sync":
            assert tight["tokens/generated"] == ample["tokens/generated"]
            assert tight["tokens/trained_response"] == ample["tokens/trained_response"]
            assert tight["tokens/prefill"] == ample["tokens/prefill"] + tight["tokens/recomputed_prefill"]
            assert small_run.end_s > ample_run.end_s


@pytest.mark.parametrize("calibrated", [False, True])
def test_the_event_paths_step_terms_are_the_cost_models_floats(calibrated):
    """The engine's tables of step terms stand in for ``DecodeCost.step_s`` on its hottest path:
    they must give the very same floats, or a simulation's figures move."""
    cost = DecodeCost(Scenario(), 4)
    if calibrated:  # the calibrated form: no roofline terms, measured coefficients
        cost.overhead_s, cost.weights_s, cost.per_seq_compute_s = 0.011, 0.0, 3.3e-5
        cost.allreduce_fixed_s = cost.allreduce_per_seq_s = 0.0
        cost.kv_s_per_token = 7.1e-9
    terms = _terms(cost)
    terms.grow(300)
    rng = np.random.default_rng(0)
    for b in range(1, 300):
        c = float(rng.uniform(0, 2e6))
        assert terms.base[b] + c * terms.kv == cost.step_s(b, c)
        assert terms.half_kv[b] == 0.5 * cost.kv_s_per_token * b
