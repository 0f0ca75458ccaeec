"""The env pipeline's replay: the sample-to-insert rate limiter and the transition replay on
``ext.replay``, in process and as a Ray actor."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

from core.env.rate_limiter import LimiterClosed, RateLimiter
from core.env.transition_replay import ChunkAccountingError, TransitionReplay
from core.model.transition_wire import TransitionChunk

SPEC = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}


def rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n)
    return {
        "obs": np.repeat(i[:, None], 4, axis=1).astype(np.float32),
        "action": i.astype(np.int64),
        "reward": (i % 3).astype(np.float32),
    }


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.mark.parametrize("seed", range(12))
def test_random_sides_hold_the_band_and_never_deadlock(seed):
    """Two sides with random request sizes and random pauses: after warm-up the owed samples stay
    in the band (an insert of the warm-up may overshoot it by one request), and the run ends."""
    rng = random.Random(seed)
    spi = rng.choice([0.25, 0.5, 1.0, 2.0, 8.0])
    max_insert, max_sample = rng.randint(1, 16), rng.randint(1, 32)
    need = max_insert * spi + max_sample
    eb = need / 2 * rng.choice([1.0, 1.5, 4.0])
    lim = RateLimiter(spi, rng.randint(1, 64), eb, max_insert, max_sample)
    centre = lim.min_size_to_sample * spi
    low, high = centre - eb, centre + eb + (max_insert - 1) * spi
    seen: list[float] = []

    def check():
        if lim.samples:
            assert lim.lag >= low - 1e-9
        if lim.inserts >= lim.min_size_to_sample:
            assert lim.lag <= high + 1e-9
        seen.append(lim.lag)

    async def inserter():
        for _ in range(300):
            k = rng.randint(1, max_insert)
            await lim.wait_insert(k)
            lim.inserted(k)
            check()
            if rng.random() < 0.5:
                await asyncio.sleep(0)
        lim.close()

    async def sampler():
        while True:
            n = rng.randint(1, max_sample)
            try:
                await lim.wait_sample(n)
            except LimiterClosed:
                return
            lim.sampled(n)
            check()
            if rng.random() < 0.5:
                await asyncio.sleep(0)

    async def both():
        await asyncio.gather(inserter(), sampler())

    run(both())
    assert lim.samples > 0
    # The ratio over the run: the owed samples at the end are in the band.
    assert abs(lim.inserts * spi - lim.samples - centre) <= eb + max(max_insert * spi, max_sample)


def test_the_faster_side_is_the_one_that_waits():
    async def case(slow: str):
        lim = RateLimiter(1.0, 8, 8.0, 4, 8)

        async def inserter():
            for i in range(40):
                await lim.wait_insert(4)
                lim.inserted(4)
                if slow == "insert":
                    await asyncio.sleep(0.002)
            lim.close()

        async def sampler():
            while True:
                try:
                    await lim.wait_sample(8)
                except LimiterClosed:
                    return
                lim.sampled(8)
                if slow == "sample":
                    await asyncio.sleep(0.002)

        await asyncio.gather(inserter(), sampler())
        return lim.stats()

    fast_sampler = run(case("insert"))
    assert fast_sampler["sample_blocked_calls"] > 0 and fast_sampler["sample_blocked_s"] > 0
    assert fast_sampler["insert_blocked_calls"] == 0
    fast_inserter = run(case("sample"))
    assert fast_inserter["insert_blocked_calls"] > 0 and fast_inserter["insert_blocked_s"] > 0
    # The ratio held both ways: 160 rows inserted, each sampled about once.
    for st in (fast_sampler, fast_inserter):
        assert st["inserts"] == 160
        assert abs(st["samples"] - 160) <= 8 + 8


def test_sampling_waits_for_min_size_and_a_timeout_counts_nothing():
    async def case():
        lim = RateLimiter(1.0, 10, 5.0, 4, 4)
        with pytest.raises(asyncio.TimeoutError):
            await lim.wait_sample(4, timeout=0.05)
        assert lim.samples == 0 and lim.stats()["sample_blocked_calls"] == 1
        assert lim.stats()["sample_blocked_s"] >= 0.04
        for _ in range(3):
            await lim.wait_insert(4)  # warm-up: inserts never wait
            lim.inserted(4)
        await lim.wait_sample(4, timeout=0.05)

    run(case())


def test_close_releases_a_waiter_and_refuses_later_requests():
    async def case():
        lim = RateLimiter(1.0, 4, 4.0, 2, 4)
        waiter = asyncio.ensure_future(lim.wait_sample(2))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        lim.close()
        with pytest.raises(LimiterClosed):
            await waiter
        with pytest.raises(LimiterClosed):
            await lim.wait_insert(1)

    run(case())


@pytest.mark.parametrize(
    "args, match",
    [
        ((0.0, 1, 4.0, 1, 1), "samples_per_insert=0.0"),
        ((math.nan, 1, 4.0, 1, 1), "samples_per_insert=nan"),
        ((1.0, 0, 4.0, 1, 1), "min_size_to_sample=0"),
        ((1.0, 1, -1.0, 1, 1), "error_buffer=-1.0"),
        ((1.0, 1, 4.0, True, 1), "max_insert=True"),
        ((2.0, 8, 2.0, 4, 8), r"error_buffer=2.0: .* use error_buffer >= 8"),
    ],
)
def test_bad_limiter_arguments_are_one_error_each(args, match):
    with pytest.raises(ValueError, match=match):
        RateLimiter(*args)


def test_requests_larger_than_declared_are_refused():
    lim = RateLimiter(1.0, 4, 8.0, 4, 8)
    with pytest.raises(ValueError, match=r"insert of 5 rows: .* \[1, 4\]"):
        lim.can_insert(5)
    with pytest.raises(ValueError, match=r"sample of 0 rows"):
        lim.can_sample(0)


def replay(capacity: int = 8, **kw) -> TransitionReplay:
    lim = kw.pop("limiter", None) or RateLimiter(1.0, 4, 8.0, 8, 4)
    return TransitionReplay(capacity, SPEC, limiter=lim, prioritized=kw.pop("prioritized", False), alpha=0.6, seed=0)


def test_rows_overwritten_before_any_draw_are_counted():
    async def case():
        rp = replay(capacity=8)
        await rp.insert(rows(8))
        _, slots, _ = await rp.sample(4, beta=0.4)
        never = 8 - len(set(slots.tolist()))
        await rp.insert(rows(8, start=8))  # overwrites all eight slots
        st = rp.stats()
        assert st["rows_evicted_unsampled"] == never
        assert st["rows_inserted"] == 16 and st["rows_sampled"] == 4 and st["size"] == 8

    run(case())


def test_a_malformed_insert_raises_and_the_limiter_counts_nothing():
    async def case():
        rp = replay()
        bad = rows(2)
        bad["action"] = bad["action"].astype(np.int32)
        with pytest.raises((TypeError, ValueError)):
            await rp.insert(bad)
        ragged = rows(2)
        ragged["reward"] = ragged["reward"][:1]
        with pytest.raises(ValueError, match="same number of rows"):
            await rp.insert(ragged)
        assert rp.limiter.inserts == 0 and len(rp) == 0

    run(case())


def test_prioritized_draws_follow_updated_priorities():
    async def case():
        rp = replay(capacity=8, prioritized=True, limiter=RateLimiter(64.0, 8, 1024.0, 8, 8))
        slots = await rp.insert(rows(8))
        pr = np.full(8, 1e-3)
        pr[3] = 10.0
        rp.update_priorities(slots, pr)
        batch, drawn, weights = await rp.sample(8, beta=1.0)
        assert (drawn == slots[3]).mean() > 0.5
        assert batch["action"][drawn == slots[3]].tolist() == [3] * int((drawn == slots[3]).sum())
        # (q_i / q_min) ** -beta, q proportional to p ** alpha: the favoured row counts least.
        expected = (10.0 / 1e-3) ** (-0.6 * 1.0)
        assert weights[drawn == slots[3]] == pytest.approx(expected)

    run(case())


def test_a_journaled_replay_rebuilt_after_a_crash_holds_the_same_rows_and_counts(tmp_path):
    """A replay actor restarted by Ray runs its constructor again on the same journal: the rows,
    the counts, the limiter's state and each sampler's place in its chunks come back; a chunk
    sent again by a sampler that never heard back is not taken twice."""
    path = tmp_path / "replay.journal"
    spec = {**SPEC, "version": ((), np.int64)}

    def chunk(sampler: int, seq: int, n: int) -> TransitionChunk:
        return TransitionChunk(sampler=sampler, seq=seq, columns=rows(n, start=10 * seq + 100 * sampler),
                               version=np.full(n, seq, np.int64), env_steps=n + 1,
                               episode_returns=np.array([float(seq)]), episode_lengths=np.array([seq + 1]))

    def rebuilt() -> TransitionReplay:
        return TransitionReplay(8, spec, limiter=RateLimiter(1.0, 4, 8.0, 8, 4), prioritized=True, alpha=0.6, seed=0, journal=path)

    async def case():
        rp = rebuilt()
        for seq in range(3):
            await rp.insert_chunk(chunk(0, seq, 3))
        await rp.insert_chunk(chunk(1, 0, 2))
        await rp.sample(4, beta=0.4)
        before = rp.stats()
        back = rebuilt()  # the restart
        after = back.stats()
        for k in ("size", "rows_inserted", "rows_sampled", "chunks", "env_steps", "episodes", "inserts", "samples"):
            assert after[k] == before[k], k
        assert after["restored_chunks"] == 4 and back.limiter.lag == rp.limiter.lag
        assert await back.resume_point(0) == (3, 12) and await back.resume_point(1) == (1, 3)
        # The ring holds the same rows in the same slots (the last 8 of 11 inserted).
        for k, col in rp.buffer.storage().items():
            assert np.array_equal(back.buffer.storage()[k], col), k
        assert await back.insert_chunk(chunk(0, 2, 3)) == 0  # resent after the crash: already taken
        assert back.stats()["chunks_resent"] == 1 and back.stats()["chunks"] == 4
        with pytest.raises(ChunkAccountingError, match="chunk 5 arrived where chunk 3 was due"):
            await back.insert_chunk(chunk(0, 5, 3))
        await back.insert_chunk(chunk(0, 3, 3))
        # A torn last record (the crash cut a write short) is ignored, the rest read back.
        path.write_bytes(path.read_bytes() + b"\x40\x00\x00\x00\x00\x00\x00\x00partial")
        again = rebuilt()
        assert again.stats()["chunks"] == 5 and again.stats()["rows_inserted"] == 14

    run(case())


def test_replay_refuses_a_min_size_it_cannot_serve():
    with pytest.raises(ValueError, match="min_size_to_sample=2 is fewer rows than one sample of max_sample=4"):
        replay(limiter=RateLimiter(1.0, 2, 8.0, 4, 4))
    with pytest.raises(ValueError, match="more rows than the capacity 8"):
        replay(limiter=RateLimiter(1.0, 16, 16.0, 4, 4))


@pytest.mark.runtime
def test_the_replay_as_a_ray_actor_paces_a_fast_learner(ray_session):
    """The same class, ``ray.remote``-wrapped: an async actor whose waiting sample call does not
    stop inserts from other callers (were it a threaded or plain actor, the first waiting sample
    would hold every insert back and the run would time out)."""
    import ray

    actor = ray.remote(TransitionReplay).options(num_cpus=0).remote(
        64, SPEC, limiter=RateLimiter(2.0, 16, 16.0, 8, 8), prioritized=False, alpha=0.6, seed=0
    )

    async def case():
        async def sampler():
            drawn = 0
            while True:
                try:
                    batch, _, _ = await actor.sample.remote(8, 0.4, 5.0)
                except LimiterClosed:  # Ray re-raises the actor's error as a subclass of it
                    return drawn
                assert batch["obs"].shape == (8, 4)
                drawn += 8

        async def inserter():
            for i in range(20):
                await actor.insert.remote(rows(8, start=8 * i))
                await asyncio.sleep(0.02)
            await actor.close.remote()

        drawn, _ = await asyncio.gather(sampler(), inserter())
        return drawn

    try:
        drawn = run(case(), timeout=60)
        st = ray.get(actor.stats.remote())
    finally:
        ray.kill(actor)
    assert st["rows_inserted"] == 160 and st["rows_sampled"] == drawn
    assert abs(st["inserts"] * 2.0 - st["samples"] - 16 * 2.0) <= 16.0 + 16
    assert st["sample_blocked_calls"] > 0
