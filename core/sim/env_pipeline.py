"""The env pipeline (seeds 001 and 003) on the virtual clock: samplers, the replay and the learner
on modelled costs (``EnvSimSpec``), paced by the real rate limiter.

    sampler i, on machine i % sim.machines (each chunk):
        compute   send_every vector steps: envs x env_step_s + forward_s + envs x forward_env_s each,
                  slowed where a machine's samplers oversubscribe its cores
        send      rows x row_bytes over its machine's outgoing link and machine 0's incoming link
                  (none for machine 0's own samplers), half an RPC latency each way
        insert    the replay's work (replay_call_s + rows x replay_insert_row_s, one call at a time),
                  then the limiter's wait_insert
        weights   if a newer version was published: fetch it (an RPC); the first sampler of a
                  machine to want a version pulls param_bytes over the links, its neighbours
                  read that copy, as Ray fetches an object once per node
    learner, on machine 0 beside the replay (as core/runtimes/ray_env.py LearnerHost):
        one call samples dqn.batches_per_call batches through the limiter while the learner
        updates on the previous call's; learner_update_s each; a new version, one ray.put,
        every dqn.publish_every updates

    sync (as core/runtimes/local_env.py): one process collects a chunk, inserts it, then updates for
    as long as the limiter lets it sample; every cost adds up.

A link or the replay is a first-come-first-served resource: a request's finish time is computed
when it arrives, so a chunk is a handful of events however many env steps it holds. Jitter is
drawn from seeded generators; a run is a function of its scenario and seed.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Protocol

from core.model.env_config import EnvScenario
from core.model.progress import ProgressFn, VersionPublished

# Seeds of each sampler's jitter, apart from every other stream of a run.
JITTER_SEED = 3_000


class Limiter(Protocol):
    """The rate limiter's side the pipeline uses (core/env/rate_limiter.py RateLimiter)."""

    async def wait_insert(self, rows: int) -> None: ...

    def inserted(self, rows: int) -> None: ...

    async def wait_sample(self, rows: int) -> None: ...

    def sampled(self, rows: int) -> None: ...

    def can_sample(self, rows: int) -> bool: ...


class Fifo:
    """A resource that serves one request at a time, in the order they arrive."""

    __slots__ = ("free_at", "busy_s")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def serve(self, now: float, seconds: float) -> float:
        """When a request arriving ``now`` and needing ``seconds`` is done."""
        start = now if now > self.free_at else self.free_at
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at


def transfer(now: float, out: Fifo, into: Fifo, seconds: float) -> float:
    """When bytes sent ``now`` have arrived: they hold the sender's outgoing link and the
    receiver's incoming link together, from when both are free."""
    start = max(now, out.free_at, into.free_at)
    out.free_at = into.free_at = start + seconds
    out.busy_s += seconds
    into.busy_s += seconds
    return start + seconds


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def sleep_until(loop, when: float) -> asyncio.Future:
    """``asyncio.sleep`` to an absolute time on the virtual clock's light timers: the sim sleeps a
    few times per chunk, and a plain sleep's timer handle and context were most of its cost."""
    fut = loop.create_future()
    loop.call_at_light(when, partial(_wake, fut))
    return fut


@dataclass
class EnvSimResult:
    """What one simulated run did, and where its time went (seconds are virtual)."""

    train_s: float = 0.0
    env_steps: int = 0
    rows: int = 0
    chunks: int = 0
    updates: int = 0
    versions: int = 0
    weight_fetches: int = 0
    """Versions the samplers took, all together."""
    weight_pulls: int = 0
    """Versions that crossed a link to a machine (one per machine and version at most)."""
    bytes_sent: int = 0
    """Chunk bytes that crossed a link."""
    sampler_s: dict = field(default_factory=dict)
    """Summed over samplers: ``compute``, ``send`` (links, RPC, the replay's queue and work),
    ``weights`` (fetches); the limiter's wait is its own figure."""
    learner_s: dict = field(default_factory=dict)
    """``update_s``: the learner's updates; ``sample_wait_s``: waiting for a sample call's answer."""
    links: dict = field(default_factory=dict)
    """Per machine, the busy fraction of its outgoing and incoming link."""
    replay_busy: float = 0.0
    """The busy fraction of the replay actor."""


class EnvPipelineSim:
    """One run of the env pipeline on modelled costs; ``run`` inside a virtual-clock loop."""

    def __init__(self, sc: EnvScenario, mode: str, seed: int, limiter: Limiter, row_bytes: int, param_bytes: int,
                 on_progress: Optional[ProgressFn] = None) -> None:
        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: the env pipeline runs sync or async")
        self.sc, self.mode, self.seed, self.limiter = sc, mode, seed, limiter
        self.on_progress = on_progress  # told every version published
        s, e = sc.sim, sc.env
        self.row_bytes, self.param_bytes = row_bytes, param_bytes
        self.bytes_per_s = s.nic_gbit_s * 1e9 / 8
        self.half_rpc = s.rpc_latency_s / 2
        machines = s.machines if mode == "async" else 1
        self.out = [Fifo() for _ in range(machines)]
        self.into = [Fifo() for _ in range(machines)]
        self.replay = Fifo()
        vector_step = e.envs_per_sampler * (s.env_step_s + s.forward_env_s) + s.forward_s
        self.vector_step_s = [vector_step * self._cpu_share(m, machines) for m in range(machines)]
        # Per machine: the newest weight version it holds, and from when.
        self.held = [(0, 0.0) for _ in range(machines)]
        self.version = 0
        self.r = EnvSimResult(sampler_s={"compute": 0.0, "send": 0.0, "weights": 0.0},
                              learner_s={"update_s": 0.0, "sample_wait_s": 0.0})

    def _cpu_share(self, m: int, machines: int) -> float:
        """How much slower a sampler computes on machine ``m``: its samplers (and the learner on
        machine 0) over its cores, if they oversubscribe them."""
        cores = self.sc.sim.cores_per_machine
        if cores is None or self.mode == "sync":
            return 1.0
        busy = len(range(m, self.sc.env.samplers, machines)) + (1 if m == 0 else 0)
        return max(1.0, busy / cores)

    async def run(self) -> EnvSimResult:
        if self.mode == "sync":
            await self._sync()
        else:
            await self._async()
        r = self.r
        span = r.train_s or 1.0
        r.links = {f"machine{m}": {"out": self.out[m].busy_s / span, "in": self.into[m].busy_s / span}
                   for m in range(len(self.out))}
        r.replay_busy = self.replay.busy_s / span
        return r

    # ---- sync ---------------------------------------------------------------------------

    async def _sync(self) -> None:
        sc, s, lim, r = self.sc, self.sc.sim, self.limiter, self.r
        loop = asyncio.get_running_loop()
        e, b = sc.env, sc.dqn.batch_size
        rows = e.envs_per_sampler * e.send_every
        jitter = random.Random(self.seed * 7919 + JITTER_SEED)
        while r.env_steps < e.env_steps:
            compute = e.send_every * self.vector_step_s[0] * self._draw(jitter)
            await sleep_until(loop, loop.time() + compute)
            r.sampler_s["compute"] += compute
            # Never waits here (the learner drained the band); if it did, the loop would stall
            # and the virtual clock says so.
            await lim.wait_insert(rows)
            lim.inserted(rows)
            r.chunks += 1
            r.env_steps += rows
            r.rows += rows
            n = 0
            while lim.can_sample(b):
                lim.sampled(b)
                n += 1
            r.updates += n
            published, r.versions = r.versions, r.updates // sc.dqn.publish_every
            r.learner_s["update_s"] += n * s.learner_update_s
            replay_s = s.replay_call_s + rows * s.replay_insert_row_s + n * (s.replay_call_s + b * s.replay_sample_row_s)
            self.replay.busy_s += replay_s
            await sleep_until(loop, loop.time() + replay_s + n * s.learner_update_s)
            for v in range(published + 1, r.versions + 1):  # the turn's versions, told once it ends
                self._published(v, v * sc.dqn.publish_every)
        r.train_s = loop.time()

    # ---- async --------------------------------------------------------------------------

    async def _async(self) -> None:
        loop = asyncio.get_running_loop()
        n = self.sc.env.samplers
        quota = -(-self.sc.env.env_steps // n)
        samplers = asyncio.gather(*(self._sampler(i, quota) for i in range(n)))
        learner = asyncio.ensure_future(self._learner())
        try:
            await asyncio.wait([samplers, learner], return_when=asyncio.FIRST_COMPLETED)
            if learner.done():
                learner.result()  # its error, if it failed
                raise RuntimeError("the simulated learner stopped before the samplers did")
            samplers.result()
            self.r.train_s = loop.time()
        finally:
            for t in (samplers, learner):
                t.cancel()
            await asyncio.gather(samplers, learner, return_exceptions=True)

    async def _sampler(self, i: int, quota: int) -> None:
        sc, s, lim, r = self.sc, self.sc.sim, self.limiter, self.r
        loop = asyncio.get_running_loop()
        e = sc.env
        m = i % len(self.out)
        jitter = random.Random(self.seed * 7919 + JITTER_SEED + 1 + i)
        rows = e.envs_per_sampler * e.send_every
        nbytes = rows * self.row_bytes
        wire_s = nbytes / self.bytes_per_s
        work_s = s.replay_call_s + rows * s.replay_insert_row_s
        version, steps, carry = 0, 0, 0.0
        while steps < quota:
            compute = e.send_every * self.vector_step_s[m] * self._draw(jitter)
            await sleep_until(loop, loop.time() + carry + compute)
            r.sampler_s["compute"] += compute
            # The whole way to the replay is booked when the chunk is sent: its place in the
            # replay's queue, as on the links, is its place in sending order.
            t0 = loop.time()
            if m:
                arrive = transfer(t0, self.out[m], self.into[0], wire_s) + self.half_rpc
                r.bytes_sent += nbytes
            else:
                arrive = t0 + self.half_rpc
            t1 = self.replay.serve(arrive, work_s)
            await sleep_until(loop, t1)
            await lim.wait_insert(rows)
            lim.inserted(rows)
            t2 = loop.time()
            r.sampler_s["send"] += t1 - t0 + self.half_rpc  # the reply's half rides on the next sleep
            r.chunks += 1
            r.rows += rows
            r.env_steps += rows
            steps += rows
            carry = self.half_rpc  # the insert's reply, slept with the next compute
            if self.version > version:
                # Asked once the reply is in; the answer comes back once the machine holds it.
                version = self.version
                ask = t2 + 2 * self.half_rpc
                done = max(self._pull(m, version, ask), ask) + self.half_rpc
                r.sampler_s["weights"] += done - t2 - self.half_rpc
                r.weight_fetches += 1
                carry = done - t2
        await sleep_until(loop, loop.time() + carry)

    def _pull(self, m: int, version: int, now: float) -> float:
        """When machine ``m`` holds ``version``: at once on machine 0, where the learner put it;
        elsewhere after one pull over the links, shared by the machine's samplers."""
        held, ready = self.held[m]
        if held >= version:
            return ready
        ready = now if m == 0 else transfer(now, self.out[0], self.into[m], self.param_bytes / self.bytes_per_s)
        if m:
            self.r.weight_pulls += 1
        self.held[m] = (version, ready)
        return ready

    async def _sample_call(self, rows: int) -> None:
        """One learner call to the replay on its machine: the limiter, then the replay's work."""
        s, lim = self.sc.sim, self.limiter
        loop = asyncio.get_running_loop()
        await sleep_until(loop, loop.time() + self.half_rpc)
        await lim.wait_sample(rows)
        lim.sampled(rows)
        await sleep_until(loop, self.replay.serve(loop.time(), s.replay_call_s + rows * s.replay_sample_row_s) + self.half_rpc)

    async def _learner(self) -> None:
        d, s, r = self.sc.dqn, self.sc.sim, self.r
        loop = asyncio.get_running_loop()
        k, rows = d.batches_per_call, d.batches_per_call * d.batch_size
        incoming = asyncio.ensure_future(self._sample_call(rows))
        try:
            while True:
                t0 = loop.time()
                await incoming
                r.learner_s["sample_wait_s"] += loop.time() - t0
                incoming = asyncio.ensure_future(self._sample_call(rows))
                left = k
                while left:
                    n = min(left, d.publish_every - r.updates % d.publish_every)
                    await sleep_until(loop, loop.time() + n * s.learner_update_s)
                    r.learner_s["update_s"] += n * s.learner_update_s
                    r.updates += n
                    left -= n
                    if r.updates % d.publish_every == 0:
                        self.version += 1
                        r.versions = self.version
                        self.held[0] = (self.version, loop.time())
                        self._published(self.version, r.updates)
        finally:
            incoming.cancel()

    def _published(self, version: int, updates: int) -> None:
        if self.on_progress is not None:
            at = asyncio.get_running_loop().time()
            self.on_progress(VersionPublished(version, at, self.r.env_steps, updates))

    def _draw(self, rng: random.Random) -> float:
        j = self.sc.sim.jitter
        return 1.0 + j * (2.0 * rng.random() - 1.0) if j else 1.0
