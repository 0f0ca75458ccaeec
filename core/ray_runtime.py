"""The ray runtime: every component a Ray actor, reached through a proxy with the same
awaitable methods it has in one process (the seeds' proxy-wrapper pattern).

    driver (run_ray) ── ray.wait ──► RolloutActor: Rollouter + staleness queue + ledger(produced, dropped)
                                         │ EngineProxy ──► EngineActor × engines (torch or vLLM)
                                         │ ServeReward ──► Serve deployment "reward" (reward.serve)
                                     TrainerActor: Trainer + ParamSync + torch GRPO + ledger(trained)
                                         │ QueueProxy / RolloutProxy ──► RolloutActor
                                         └ ray.put(weights) once per version ─► every EngineActor gets the ObjectRef

The wiring inside each actor is ``core.driver``'s (``connect_rollout`` / ``connect_trainer``),
so the classes that run are the ones the sim and local runtimes run. Groups cross actors as
codec bytes (their pickle is ``core.group_wire``'s codec record). A placement group pins one
bundle per rollout engine and one for the trainer; ``sync`` colocates the trainer with the
engines on their bundles, as the sim's colocated baseline does.

Each process has its own monotonic clock: the driver measures every actor's offset once
(the midpoint of a round trip) and moves their timestamps onto its own, zero at the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from core.config import Scenario
from core.driver import (
    ProgressFn, System, Workers, connect_rollout, connect_trainer, end_rollout, queue_capacity, release_unused,
    trained_bound,
)
from core.evaluation import Evaluations
from core.ledger import Ledger
from core.placement import Placement, effective_staleness
from core.sample import Group
from core.staleness_queue import AsyncStalenessQueue
from core.timeline import Timeline
from core.workers import REAL_RUNTIME_ENV

log = logging.getLogger(__name__)

# Every Ray process gets these. vLLM's own settings (KV cache size, multiprocessing) are set
# by VllmEngine in its process before vLLM is imported.
ENV_VARS = {**REAL_RUNTIME_ENV, "RAY_AUTH_MODE": "disabled"}
# A local instance keeps idle workers instead of killing them after a second: a remote
# function (an evaluator) then reuses a warm process rather than importing torch again, which
# costs seconds of a core that the run being measured needs.
LOCAL_SYSTEM_CONFIG = {"num_workers_soft_limit": 32}


def _ray():
    import ray  # imported on use: the sim runtime never needs Ray

    return ray


def start_cluster(sc: Scenario) -> bool:
    """Connect to ``ray.address``, or start a local instance; True if this call started it.
    An instance already connected in this process (a test session's) is reused."""
    ray = _ray()
    for k, v in ENV_VARS.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return False
    env = {"env_vars": dict(ENV_VARS)}
    if sc.ray.address:
        ray.init(address=sc.ray.address, runtime_env=env, log_to_driver=False)
    else:
        ray.init(
            num_cpus=sc.ray.num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=env,
            log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG,
        )
    return True


@contextlib.contextmanager
def cluster(sc: Scenario):
    """Ray connected for the block: started (and stopped after) unless already connected."""
    started = start_cluster(sc)
    try:
        yield
    finally:
        if started:
            if sc.reward.serve:
                from ray import serve

                serve.shutdown()
            _ray().shutdown()


# -- actors ----------------------------------------------------------------------------------
class EngineHost:
    """A rollout engine in its own actor (torch or vLLM)."""

    def __init__(self, sc: Scenario, name: str, threads: int, seed: int) -> None:
        from core.workers import make_engine

        self.timeline = Timeline()
        self.engine = make_engine(sc, name, threads, self.timeline, seed)

    async def start(self) -> None:
        await self.engine.start()

    async def generate(self, group: Group, max_response_len: int) -> tuple[bool, Group]:
        completed = await self.engine.generate(group, max_response_len)
        return completed, group

    async def abort_all(self) -> int:
        return await self.engine.abort_all()

    async def update_weights(self, version: int, weights: Any) -> None:
        await self.engine.update_weights(version, weights)

    async def clear_cache(self) -> None:
        await self.engine.clear_cache()

    async def close(self) -> dict:
        e = self.engine
        await e.close(asyncio.get_running_loop().time())
        return {
            "busy_s": e.busy_s,
            "seq_s": e.seq_s,
            "tokens_generated": e.tokens_generated,
            "prefill_tokens": e.prefill_tokens,
            "spans": dict(self.timeline.spans),
        }

    def now(self) -> float:
        return time.monotonic()

    def pid(self) -> int:
        return os.getpid()


class EngineProxy:
    """The engine protocol, forwarded to an ``EngineHost`` actor."""

    def __init__(self, name: str, handle: Any, offset: float) -> None:
        self.name = name
        self.handle = handle
        self.offset = offset  # actor clock minus this process's clock
        self.busy_s = self.seq_s = 0.0
        self.tokens_generated = self.prefill_tokens = 0
        self.spans: dict = {}

    async def generate(self, group: Group, max_response_len: int) -> bool:
        completed, done = await self.handle.generate.remote(group, max_response_len)
        done.shift_times(-self.offset)
        group.take_generation(done)
        return completed

    async def abort_all(self) -> int:
        return await self.handle.abort_all.remote()

    async def update_weights(self, version: int, weights: Any) -> None:
        # ``weights`` is [ObjectRef]: passed bare, Ray resolves it in the engine's process,
        # from the object store, without a copy through this one.
        await self.handle.update_weights.remote(version, weights[0] if weights else None)

    async def clear_cache(self) -> None:
        await self.handle.clear_cache.remote()

    async def close(self, now: float) -> None:
        stats = await self.handle.close.remote()
        self.spans = {w: [[k, a - self.offset, b - self.offset] for k, a, b in rows] for w, rows in stats.pop("spans").items()}
        for k, v in stats.items():
            setattr(self, k, v)


class RolloutHost:
    """The Rollouter, its queue and the producer half of the ledger, in one actor: the queue
    lives with its producer, so a finished group costs no hop before it is queued."""

    def __init__(self, sc: Scenario, mode: str) -> None:
        self.sc, self.mode = sc, mode

    def connect(self, engines: list[tuple[str, Any, float]], reward_handle: Any) -> None:
        """Wire the producer side to the engine actors (name, handle, clock offset to ours)."""
        from core.reward import ServeReward, TaskPrompts, TaskReward, make_task

        sc, mode = self.sc, self.mode
        task = make_task(sc)
        proxies = [EngineProxy(name, h, off) for name, h, off in engines]
        reward = ServeReward(reward_handle) if reward_handle is not None else TaskReward(task)
        workers = Workers(proxies, backend=None, transfer=None, prompts=TaskPrompts(task), reward=reward)
        self.ledger = Ledger(trained_bound(sc, mode), reuse=sc.replay.enabled)
        max_staleness, _ = effective_staleness(sc, mode)
        self.queue = AsyncStalenessQueue(capacity=queue_capacity(sc, mode), max_staleness=max_staleness)
        self.rollouter = connect_rollout(sc, mode, workers, self.ledger, self.queue)
        self.engines = proxies

    async def run(self) -> None:
        await self.rollouter.run()

    async def get_batch(self, n: int) -> list[Group]:
        return await self.queue.get_batch(n)

    async def pause(self, mode: str) -> None:
        await self.rollouter.pause(mode)

    async def update_weights(self, version: int, weights: Any) -> None:
        await self.rollouter.update_weights(version, weights)

    async def resume(self) -> None:
        await self.rollouter.resume()

    async def stop(self) -> dict:
        """End of run: stop, account for what was never queued or trained, close engines."""
        await end_rollout(self.rollouter, self.queue, self.ledger)
        now = asyncio.get_running_loop().time()
        await asyncio.gather(*(e.close(now) for e in self.engines))
        timeline = Timeline()
        for e in self.engines:
            for w, rows in e.spans.items():
                timeline.spans[w].extend(rows)
        return {
            "ledger": self.ledger,
            "timeline": timeline,
            "engines": [_EngineView(e.name, e.busy_s, e.seq_s, e.tokens_generated, e.prefill_tokens) for e in self.engines],
            "queue": _QueueView(self.queue.counters(), len(self.queue)),
            "in_flight": self.rollouter.in_flight(),
        }

    def now(self) -> float:
        return time.monotonic()

    def pid(self) -> int:
        return os.getpid()


class QueueProxy:
    """The trainer's batch source: the queue in the rollout actor."""

    def __init__(self, handle: Any, offset: float) -> None:
        self.handle = handle
        self.offset = offset  # rollout actor clock minus the trainer's

    async def get_batch(self, n: int) -> list[Group]:
        groups = await self.handle.get_batch.remote(n)
        for g in groups:
            g.shift_times(-self.offset)
        return groups


class RolloutProxy:
    """What ParamSync drives: pause, update_weights, resume of the Rollouter in its actor."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def pause(self, mode: str) -> None:
        await self.handle.pause.remote(mode)

    async def update_weights(self, version: int, weights: Any) -> None:
        await self.handle.update_weights.remote(version, weights)

    async def resume(self) -> None:
        await self.handle.resume.remote()


class ObjectStoreTransfer:
    """``ray.put`` the trainer's weights once per version; every engine gets that one ObjectRef."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.latest: tuple[int, list] = (0, [])
        self.bytes = 0

    async def send(self, version: int) -> list:
        weights = await asyncio.to_thread(self.backend.weights)
        self.bytes = sum(w.nbytes for w in weights.values())
        ref = _ray().put(weights)
        self.latest = (version, [ref])
        return [ref]


class TrainerHost:
    """The Trainer, its ParamSync and the torch GRPO backend, with the trained half of the ledger."""

    def __init__(self, sc: Scenario, mode: str, rollout: Any, threads: int) -> None:
        from core.workers import make_backend

        self.sc, self.mode = sc, mode
        self.rollout = rollout
        self.backend = make_backend(sc, threads)
        self.transfer = ObjectStoreTransfer(self.backend)
        self.timeline = Timeline()
        self.ledger = Ledger(trained_bound(sc, mode), reuse=sc.replay.enabled)
        self.trainer = None
        self.end_s = 0.0

    async def connect(self, rollout_offset: float) -> None:
        """Wire the trainer side; ``rollout_offset`` is the rollout actor's clock minus ours."""
        workers = Workers([], self.backend, self.transfer)
        self.trainer, self.param_sync, self.replay = connect_trainer(
            self.sc, self.mode, workers, self.ledger, QueueProxy(self.rollout, rollout_offset),
            RolloutProxy(self.rollout), self.timeline,
        )

    async def run(self) -> None:
        await self.trainer.run()
        self.end_s = asyncio.get_running_loop().time()

    def progress(self) -> tuple[int, float, int, int]:
        t = self.trainer
        return t.step, time.monotonic(), self.ledger.trainings, t.version

    def latest_weights(self) -> tuple[int, list]:
        return self.transfer.latest

    def finish(self) -> dict:
        """End of run: what the trainer holds untrained is dropped; the trainer half of the run."""
        t = self.trainer
        release_unused(t, self.replay, self.ledger)
        ps = self.param_sync
        return {
            "ledger": self.ledger,
            "timeline": self.timeline,
            "end_s": self.end_s,
            "trainer": _TrainerView(t.step, t.version, t.wait_s, t.step_info),
            "param_sync": _SyncView(ps.pause_s, ps.drain_s, ps.transfer_s),
            "backend": _BackendView(self.backend.compute_s, self.backend.flops, getattr(self.backend, "peak_flops", 0.0)),
            "replay": _ReplayView(self.replay.counters()) if self.replay else None,
        }

    def now(self) -> float:
        return time.monotonic()

    def pid(self) -> int:
        return os.getpid()


# -- what the report reads of remote components ------------------------------------------------
@dataclass
class _EngineView:
    name: str
    busy_s: float
    seq_s: float
    tokens_generated: int
    prefill_tokens: int


@dataclass
class _QueueView:
    _counters: dict
    length: int

    def counters(self) -> dict:
        return self._counters

    def __len__(self) -> int:
        return self.length


@dataclass
class _TrainerView:
    step: int
    version: int
    wait_s: float
    step_info: list
    holding: list = field(default_factory=list)


@dataclass
class _SyncView:
    pause_s: list
    drain_s: list
    transfer_s: list


@dataclass
class _BackendView:
    compute_s: float
    flops: float
    peak_flops: float


@dataclass
class _ReplayView:
    _counters: dict

    def counters(self) -> dict:
        return self._counters

    def untrained(self) -> list:
        return []


@dataclass
class _RolloutView:
    held: int

    def in_flight(self) -> int:
        return self.held


# -- the driver --------------------------------------------------------------------------------
def _offset(handle: Any, probes: int = 5) -> float:
    """The actor's clock minus ours: the midpoint of the shortest of a few round trips (the
    first call may wait for the actor to start, so it is only a warm-up)."""
    ray = _ray()
    ray.get(handle.now.remote())
    best = None
    for _ in range(probes):
        t0 = time.monotonic()
        remote_now = ray.get(handle.now.remote())
        t1 = time.monotonic()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, remote_now - (t0 + t1) / 2)
    return best[1]


def _bundles(sc: Scenario, place: Placement) -> list[dict]:
    r, t = sc.ray.rollout, sc.ray.trainer
    rollout = [{"CPU": r.num_cpus, "GPU": r.num_gpus} for _ in range(place.engines)]
    if place.colocated:
        return rollout
    return rollout + [{"CPU": t.num_cpus, "GPU": t.num_gpus}]


def _clean(bundle: dict) -> dict:
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}


# The most a quick control call (progress, clock, pid) may take before the run is declared stuck.
RPC_TIMEOUT_S = 60.0

ProcessesFn = Callable[[list[tuple[str, int]]], None]


def run_ray(
    sc: Scenario,
    mode: str,
    on_step: Optional[ProgressFn] = None,
    on_processes: Optional[ProcessesFn] = None,
    run_dir=None,
) -> System:
    """Run one mode with every component in its own Ray actor; the driver only watches."""
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from core.tiny_model import ensure

    ensure(sc.tiny_model.path, sc.tiny_model)
    sc = sc.model_copy(update={"tiny_model": sc.tiny_model.model_copy(update={"path": os.path.abspath(sc.tiny_model.path)})})
    with cluster(sc):  # started here unless already connected (the harness starts one per run)
        place = Placement.of(sc, mode)
        actors: list = []
        pg = None
        serve_started = False
        try:
            bundles = _bundles(sc, place)
            pg = placement_group([_clean(b) for b in bundles], strategy=sc.ray.placement_strategy)
            ray.get(pg.ready(), timeout=120)
            share = 0.5 if place.colocated else 1.0  # colocated: engine and trainer split a bundle

            def pinned(i: int, role) -> dict:
                return {
                    "num_cpus": role.num_cpus * share,
                    "num_gpus": role.num_gpus * share,
                    "max_concurrency": role.max_concurrency,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                }

            engine_cls = ray.remote(EngineHost)
            engines = []
            for i in range(place.engines):
                name = f"engine{i:03d}"
                h = engine_cls.options(**pinned(i, sc.ray.rollout)).remote(sc, name, place.gpus_per_engine, sc.seed * 1000 + i)
                engines.append((name, h))
                actors.append(h)
            ray.get([h.start.remote() for _, h in engines], timeout=600)
            off_engines = [_offset(h) for _, h in engines]
            reward_handle = None
            if sc.reward.serve:
                from core.reward import deploy_reward

                reward_handle = deploy_reward(sc)
                serve_started = True
            c = sc.ray.controller
            rollout = ray.remote(RolloutHost).options(num_cpus=c.num_cpus, num_gpus=c.num_gpus, max_concurrency=c.max_concurrency).remote(sc, mode)
            actors.append(rollout)
            off_rollout = _offset(rollout)
            ray.get(rollout.connect.remote([(name, h, off - off_rollout) for (name, h), off in zip(engines, off_engines)], reward_handle))
            trainer_bundle = 0 if place.colocated else place.engines
            trainer = ray.remote(TrainerHost).options(**pinned(trainer_bundle, sc.ray.trainer)).remote(
                sc, mode, rollout, place.trainer_gpus
            )
            actors.append(trainer)
            # Every actor here shares the host's monotonic clock unless the cluster spans nodes,
            # and then the offsets matter.
            off_trainer = _offset(trainer)
            ray.get(trainer.connect.remote(off_rollout - off_trainer), timeout=120)
            if on_processes is not None:
                pids = ray.get([h.pid.remote() for _, h in engines] + [rollout.pid.remote(), trainer.pid.remote()])
                names = [n for n, _ in engines] + ["rollouter", "trainer"]
                on_processes(list(zip(names, pids)))

            evals = Evaluations(sc)
            evals.warm_up()
            t0 = time.monotonic()
            run_refs = {rollout.run.remote(): "rollouter", trainer.run.remote(): "trainer"}
            last_step = 0
            while True:
                # Watch, never block: the run's two loops, evaluations, progress.
                ready, _ = ray.wait(list(run_refs), num_returns=1, timeout=sc.ray.poll_s)
                step, now, trainings, version = ray.get(trainer.progress.remote(), timeout=RPC_TIMEOUT_S)
                if on_step is not None and step != last_step:
                    on_step(step, now - off_trainer - t0, trainings)
                    last_step = step
                evals.poll(trainer, version, time.monotonic() - t0)
                if ready:
                    who = run_refs[ready[0]]
                    ray.get(ready[0])  # raises the actor's error
                    if who == "rollouter":
                        raise RuntimeError("the rollouter stopped before the trainer finished")
                    break
            trained = ray.get(trainer.finish.remote())
            rolled = ray.get(rollout.stop.remote())
            evals.finish(time.monotonic() - t0)
            for ref in run_refs:
                if run_refs[ref] == "rollouter":
                    ray.get(ref, timeout=60)  # a rollouter that failed after the trainer finished fails the run
            # Everything onto the driver's clock, zero at the start.
            dt_r, dt_t = -off_rollout - t0, -off_trainer - t0
            ledger: Ledger = rolled["ledger"]
            ledger.shift_times(dt_r)
            trained["ledger"].shift_times(dt_t)
            ledger.merge(trained["ledger"])
            timeline = Timeline()
            for part, dt in ((rolled["timeline"], dt_r), (trained["timeline"], dt_t)):
                for w, rows in part.spans.items():
                    timeline.spans[w].extend([[k, a + dt, b + dt] for k, a, b in rows])
            tv = trained["trainer"]
            for info in tv.step_info:
                info["end_s"] += dt_t
            system = System(
                sc, mode, place, ledger, timeline, rolled["queue"], rolled["engines"],
                _RolloutView(rolled["in_flight"]), trained["param_sync"], tv, trained["backend"], trained["replay"],
            )
            system.end_s = trained["end_s"] + dt_t
            system.wall_s = time.monotonic() - t0
            system.evaluations = evals.results
            return system
        finally:
            for a in actors:
                ray.kill(a)
            if pg is not None:
                remove_placement_group(pg)
            if serve_started:
                from ray import serve

                serve.delete("asyncrl-reward")
