"""The ray runtime: every component a Ray actor, reached through a proxy with the same
awaitable methods it has in one process (the seeds' proxy-wrapper pattern).

    driver (run_ray) ── asyncio.wait ──► RolloutActor: Rollouter + staleness queue + ledger(produced, dropped)
                                         │ EngineProxy ──► EngineActor × engines (torch or vLLM)
                                         │ ServeReward ──► Serve deployment "reward" (reward.serve)
                                     TrainerActor: Trainer + ParamSync + torch GRPO + ledger(trained)
                                         │ QueueProxy / RolloutProxy ──► RolloutActor
                                         └ ray.put(weights) once per version ─► every EngineActor gets the ObjectRef

The wiring inside each actor is ``core.pipeline.wiring``'s (``connect_rollout`` / ``connect_trainer``),
so the classes that run are the ones the sim and local runtimes run. Groups cross actors as
codec bytes (their pickle is ``core.model.group_wire``'s codec record), and only their
metadata crosses the rollout actor: an engine actor puts a group's tokens in the object store
(owned by the rollout actor), scores them unless Serve does (from the reference), and the
trainer resolves the reference. An interrupted group's partial tokens stay in its engine,
which takes them back when the group resumes there; another engine fetches them by reference. A placement group pins one
bundle per rollout engine and one for the trainer; ``sync`` colocates the trainer with the
engines on their bundles, as the sim's colocated baseline does.

Faults fire and the trainer is supervised through ``core.runtimes.supervision``, as in one
process. At a due sync both actors write their side of one whole checkpoint, which a resumed
run (``resume``) puts back into fresh actors (``core.runtimes.ray_checkpoint``). So does a run
whose rollout actor died: the queue and the producer's ledger went with it, so the whole run
goes back to that checkpoint (``recovery.max_restarts`` times at most), and run time goes on. Each process has its own monotonic clock: the driver measures every actor's offset
once (the midpoint of a round trip) and moves their timestamps onto its own, zero at the
start, in the ``RunResult`` it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from core.api import Batch, PauseMode, RunStopped
from core.model.config import Placement, Scenario
from core.model.faults import CallTimeout, FaultLog, FaultPlan, RestartsExhausted, WorkerLost, worker_key
from core.model.ledger import Ledger
from core.model.progress import Progress
from core.model.result import EngineCounters, RunResult, SyncCounters, TrainerCounters
from core.model.group_wire import attach_tokens, encode_tokens
from core.model.sample import Group
from core.model.timeline import Timeline
from core.pipeline.wiring import (
    ProgressFn, Workers, connect_rollout, connect_trainer, consumer_in_flight, end_rollout, make_queue, producer_in_flight,
    release_unused, trained_bound,
)
from core.real.evaluation import Evaluations
from core.real.reward import EngineReward, ServeReward, TaskPrompts, deploy_reward, make_task
from core.real.hf_model import ensure_model_dir
from core.real.workers import REAL_RUNTIME_ENV, make_backend, make_engine
from core.runtimes.local import ProcessesFn
from core.real.hf_model import model_dtype
from core.runtimes.broadcast_transfer import BroadcastTransfer
from core.runtimes.object_store_transfer import ObjectStoreTransfer
from core.runtimes.ray_checkpoint import (
    RayResume, discard_after, load_ray_run, load_rollout_side, save_rollout_side, shifted_records, shifted_spans,
)
from core.runtimes.ray_cluster import code_env, kill_node, node_id, node_scenario, on_node, pack_model
from core.runtimes.run_checkpoint import (
    FORMAT, checkpoint_dir, due, restore_trainer_side, save_trainer_side, scenario_digest, trainer_state_at,
)
from core.runtimes.supervision import FaultInjector, strike, supervise_trainer
from core.runtimes.trainer_ranks import RankedBackend, TrainerRankHost
from core.sim.workload import Workload
from core.store.checkpoint import Snapshot, latest, load, load_tensors

log = logging.getLogger(__name__)

# Every Ray process gets these. vLLM's own settings (KV cache size, multiprocessing) are set
# by VllmEngine in its process before vLLM is imported.
ENV_VARS = {**REAL_RUNTIME_ENV, "RAY_AUTH_MODE": "disabled"}
# A local instance keeps idle workers instead of killing them after a second: a remote
# function (an evaluator) then reuses a warm process rather than importing torch again, which
# costs seconds of a core that the run being measured needs.
LOCAL_SYSTEM_CONFIG = {"num_workers_soft_limit": 32}


def _ray():
    import ray  # imported on use: a sim run never pays for importing Ray

    return ray


def _died() -> tuple[type, ...]:
    """What a call raises when its actor is dead or being restarted."""
    ex = _ray().exceptions
    return ex.RayActorError, ex.ActorUnavailableError


def start_cluster(address: Optional[str], num_cpus: Optional[int]) -> bool:
    """Connect to ``address``, or start a local instance of ``num_cpus`` (None: every core);
    True if this call started it. An instance already connected in this process (a test
    session's) is reused."""
    ray = _ray()
    for k, v in ENV_VARS.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return False
    env = {"env_vars": dict(ENV_VARS)}
    if address:
        # Joining a cluster: its other nodes have no copy of this code, so it goes with the job.
        ray.init(address=address, runtime_env={**env, **code_env(Path(__file__).resolve().parents[2])}, log_to_driver=False)
    else:
        # "local": a new instance even when another is running on this machine (ray.init would
        # join that one, and refuse num_cpus).
        ray.init(
            address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=env,
            log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG,
        )
    return True


@contextlib.contextmanager
def cluster(address: Optional[str], num_cpus: Optional[int], serve: bool = False):
    """Ray connected for the block: started (and stopped after) unless already connected;
    ``serve``: shut Ray Serve down first."""
    started = start_cluster(address, num_cpus)
    try:
        yield
    finally:
        if started:
            if serve:
                from ray import serve

                serve.shutdown()
            _ray().shutdown()


# -- actors ----------------------------------------------------------------------------------
class EngineHost:
    """A rollout engine in its own actor (torch or vLLM)."""

    def __init__(self, sc: Scenario, name: str, threads: int, seed: int, shipped: tuple = ()) -> None:
        sc = node_scenario(sc, shipped)  # the model where this node has it
        self.timeline = Timeline()
        self.engine = make_engine(sc, name, threads, self.timeline, seed)
        self._slow: Optional[tuple[float, float, float]] = None  # (factor, from, until)
        self._hang: Optional[str] = None
        # Finished groups are scored here, where their tokens are, unless a Serve deployment scores them.
        self._task = None if sc.reward.serve else make_task(sc)
        # Interrupted groups by prompt id, their partial tokens kept for their resume here.
        self._held: dict[int, Group] = {}
        self.resumed_held = self.resumed_fetched = 0  # resumes from tokens kept here, or fetched by reference

    async def start(self) -> None:
        await self.engine.start()

    async def generate(self, group: Group, max_response_len: int, payload: list) -> tuple[tuple[bool, Group], bytes]:
        """Generate ``group`` (its metadata; ``payload``: [a reference to its partial tokens] or
        []); returns ((completed, its metadata), its tokens record) as two results
        (``num_returns=2``): the caller awaits the first and passes the second on by reference,
        so the tokens are never decoded on the way; the trainer resolves it."""
        await self._enter("generate")
        await self._take_tokens(group, payload)
        t0 = asyncio.get_running_loop().time()
        completed = await self.engine.generate(group, max_response_len)
        if completed and self._slow is not None:
            # A slowed worker: what overlapped the interval took ``factor`` times as long.
            factor, lo, hi = self._slow
            overlap = min(asyncio.get_running_loop().time(), hi) - max(t0, lo)
            if overlap > 0:
                await asyncio.sleep((factor - 1.0) * overlap)
        if completed:
            self._held.pop(group.prompt_id, None)
            if self._task is not None:
                for s in group.samples:
                    s.reward = self._task.reward(group.prompt_id, s.response_tokens, sample=s.uid)
        else:
            self._held[group.prompt_id] = group
        return (completed, group.without_tokens()), encode_tokens(group)

    async def _take_tokens(self, group: Group, payload: list) -> None:
        """Give a resumed group its partial tokens: those kept here (no transfer), else fetched."""
        if not any(s.n_response for s in group.samples):
            return
        held = self._held.pop(group.prompt_id, None)
        if held is not None and all(h.n_response == s.n_response for h, s in zip(held.samples, group.samples)):
            for h, s in zip(held.samples, group.samples):
                s.response_tokens, s.logprobs = h.response_tokens, h.logprobs
            self.resumed_held += 1
            return
        if not payload:
            raise ValueError(f"prompt {group.prompt_id}: {sum(s.n_response for s in group.samples)} tokens generated, none held here or referenced")
        attach_tokens(group, await payload[0])
        self.resumed_fetched += 1

    async def abort_all(self) -> int:
        await self._enter("abort_all")
        return await self.engine.abort_all()

    async def update_weights(self, version: int, weights: Any) -> None:
        await self._enter("update_weights")
        await self.engine.update_weights(version, weights)

    async def freeze(self) -> None:
        await self._enter("freeze")
        await self.engine.freeze()

    async def thaw(self) -> None:
        await self._enter("thaw")
        await self.engine.thaw()

    # faults (core/runtimes/supervision.py): injected by the rollout actor
    def slow(self, factor: float, duration_s: float) -> None:
        now = asyncio.get_running_loop().time()
        self._slow = (factor, now, now + duration_s)

    def hang(self, call: str) -> None:
        self._hang = call

    async def _enter(self, call: str) -> None:
        if self._hang == call:
            self._hang = None
            await asyncio.get_running_loop().create_future()  # never answers: the caller's timeout ends it

    async def clear_cache(self) -> None:
        await self.engine.clear_cache()

    def counters(self) -> dict:
        """What a whole checkpoint keeps of this engine (taken while rollout is paused)."""
        return {"meter": self.engine.state(), "resumed_held": self.resumed_held, "resumed_fetched": self.resumed_fetched,
                "spans": dict(self.timeline.spans)}

    def restore_counters(self, st: dict) -> None:
        """A resumed run's engine goes on counting from its checkpoint (spans on this clock)."""
        self.engine.restore(st["meter"])
        self.resumed_held, self.resumed_fetched = st["resumed_held"], st["resumed_fetched"]
        for w, rows in st["spans"].items():
            self.timeline.spans[w][:0] = rows

    async def close(self) -> dict:
        e = self.engine
        await e.close(asyncio.get_running_loop().time())
        return {
            "busy_s": e.busy_s,
            "seq_s": e.seq_s,
            "tokens_generated": e.tokens_generated,
            "prefill_tokens": e.prefill_tokens,
            "spans": dict(self.timeline.spans),
            "step_spans": e.step_spans(),
            "resumed_held": self.resumed_held,
            "resumed_fetched": self.resumed_fetched,
        }

    def now(self) -> float:
        return time.monotonic()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return node_id()


class EngineProxy:
    """The engine protocol, forwarded to an ``EngineHost`` actor."""

    def __init__(self, name: str, handle: Any, offset: float, pid: int = 0) -> None:
        self.name = name
        self.handle = handle
        self.offset = offset  # actor clock minus this process's clock
        self.pid = pid  # of the actor's current process: a restart changes it
        self.dead = False  # a call saw the actor die (Ray restarts it)
        self.busy_s = self.seq_s = 0.0
        self.tokens_generated = self.prefill_tokens = 0
        self.resumed_held = self.resumed_fetched = 0
        self.spans: dict = {}

    async def _remote(self, call: str, *args: Any) -> Any:
        """A call to the actor; its death (or a restart in progress) is ``WorkerLost``."""
        return await self._answer(getattr(self.handle, call).remote(*args), call)

    async def _answer(self, ref: Any, call: str) -> Any:
        try:
            return await ref
        except _died() as exc:
            self.dead = True
            raise WorkerLost(self.name, call, f"the actor died ({type(exc).__name__})") from None

    async def generate(self, group: Group, max_response_len: int) -> bool:
        """The group's metadata goes, and comes back with its tokens record as a second result
        that this process never resolves: it holds the reference (and owns it, so the tokens
        outlive the engine's process) for the trainer, or another engine, to resolve. A resumed
        group's reference goes in a list, so Ray hands it over unresolved."""
        payload = [group.payload] if group.payload is not None else []
        group.payload = None  # not pickled along with the metadata a second time
        try:
            head, tokens = self.handle.generate.options(num_returns=2).remote(group, max_response_len, payload)
            completed, done = await self._answer(head, "generate")
        except BaseException:
            group.payload = payload[0] if payload else None  # what it had: its tokens are still there
            raise
        done.shift_times(-self.offset)
        group.take_generation(done)
        group.payload = tokens
        if completed:
            for mine, theirs in zip(group.samples, done.samples):
                mine.reward = theirs.reward  # scored in the engine's process (EngineReward)
        return completed

    async def abort_all(self) -> int:
        return await self._remote("abort_all")

    async def update_weights(self, version: int, weights: Any) -> None:
        # ``weights`` is [ObjectRef]: passed bare, Ray resolves it in the engine's process,
        # from the object store, without a copy through this one. A broadcast ticket goes as
        # it is: the engine joins the trainer's group and receives.
        if isinstance(weights, list):
            weights = weights[0] if weights else None
        await self._remote("update_weights", version, weights)

    async def clear_cache(self) -> None:
        await self._remote("clear_cache")

    async def freeze(self) -> None:
        await self._remote("freeze")

    async def thaw(self) -> None:
        await self._remote("thaw")

    def kill(self) -> None:
        """End the actor's process; Ray starts a new one (``max_restarts``)."""
        self.dead = True
        _ray().kill(self.handle, no_restart=False)

    async def recover(self) -> None:
        """Kill a hung actor, wait for Ray to bring a new process up, start its engine."""
        if not self.dead:
            self.kill()
        while True:
            try:
                pid = await self.handle.pid.remote()
            except _died():
                pid = None
            if pid is not None and pid != self.pid:
                break
            await asyncio.sleep(0.2)
        self.pid, self.dead = pid, False
        await self._remote("start")

    async def close(self, now: float) -> None:
        stats = await self.handle.close.remote()
        self.spans = {w: [[k, a - self.offset, b - self.offset] for k, a, b in rows] for w, rows in stats.pop("spans").items()}
        for k, v in stats.items():
            setattr(self, k, v)


class RolloutHost:
    """The Rollouter, its queue and the producer half of the ledger, in one actor: the queue
    lives with its producer, so a finished group costs no hop before it is queued."""

    def __init__(self, sc: Scenario, mode: str, run_dir: str) -> None:
        self.sc, self.mode, self.run_dir = sc, mode, run_dir
        self._get: Optional[asyncio.Task] = None
        self.zero = 0.0  # this clock at run time 0 (checkpoints hold run times)
        # The driver's faults (it kills the trainer): which fired, and its records, for the checkpoint.
        self.driver_fired: list[int] = []
        self.driver_records: list[dict] = []

    def connect(self, engines: list[tuple[str, Any, float, int]], reward_handle: Any) -> None:
        """Wire the producer side to the engine actors (name, handle, clock offset to ours, pid).

        Tokens go from the engine actors to the trainer by reference, owned by this actor
        (they outlive an engine's death, and go when this actor drops the group): this actor
        handles counts, versions, times and rewards only. Rewards are scored where the tokens
        are: in the engine actor, or by the Serve deployment from the reference."""
        sc, mode = self.sc, self.mode
        task = make_task(sc)  # the tokenizer: this actor is on the driver's node, which sees the model
        proxies = [EngineProxy(name, h, off, pid) for name, h, off, pid in engines]
        reward = ServeReward(reward_handle, sc.timeouts.control_s) if reward_handle is not None else EngineReward()
        workers = Workers(proxies, backend=None, transfer=None, prompts=TaskPrompts(task), reward=reward)
        self.ledger = Ledger(trained_bound(sc, mode), reuse=sc.replay.enabled)
        self.queue = make_queue(sc, mode, self.run_dir)
        self.faults = FaultLog()
        self.rollouter = connect_rollout(sc, mode, workers, self.ledger, self.queue, self.faults)
        self.engines = proxies

    async def run(self) -> None:
        await self.rollouter.run()

    async def get_batch(self, n: int) -> list[Group]:
        # Kept as a task: a trainer that dies while waiting leaves it behind, and its
        # replacement cancels it (redeliver) before it can take groups for nobody.
        self._get = asyncio.ensure_future(self.queue.get_batch(n))
        return await self._get

    async def ack(self) -> None:
        self.queue.ack()

    def set_zero(self, zero: float) -> None:
        self.zero = zero

    def driver_faults(self, fired: list[int], records: list[dict]) -> None:
        """The driver's fault state (run times), kept for the next checkpoint."""
        self.driver_fired, self.driver_records = fired, records

    async def checkpoint(self, name: str, version: int, t0: float, t1: float) -> None:
        """The rollout side of the checkpoint the trainer just wrote (``name``, at the sync to
        ``version``, begun at run time t0, rollout paused at t1): it makes it whole. Then the
        queue forgets what the trainer has trained. Skipped while a worker is being restarted:
        its generations are not quiet; the previous whole checkpoint stays the one resumed."""
        if self.rollouter.recovering():
            log.info("rollout side of checkpoint %s skipped: a worker is being restarted", name)
        else:
            snap = await self._capture(version, t0, t1)
            path = checkpoint_dir(self.run_dir, self.mode) / name
            await asyncio.to_thread(save_rollout_side, path, snap, self.sc.checkpoint.keep)
        self.queue.ack()

    async def _capture(self, version: int, t0: float, t1: float) -> Snapshot:
        sc, ro, q, z = self.sc, self.rollouter, self.queue, self.zero
        loop = asyncio.get_running_loop()
        engines = await asyncio.gather(*(_timed(e.handle.counters.remote(), sc.timeouts.control_s, e.name, "counters") for e in self.engines))
        for e, sup, st in zip(self.engines, ro.engines, engines):
            st["spans"] = shifted_spans(st["spans"], -e.offset - z)  # engine clock -> this one -> run time
            st["restarts"] = sup.restarts
        snap = Snapshot(state={
            "format": FORMAT, "side": "rollout", "scenario": scenario_digest(sc), "scenario_name": sc.name, "mode": self.mode,
            "clock": loop.time() - z,
            "sync": {"version": version, "t0": t0, "t1": t1},
            "ledger": self.ledger.state(shift_s=-z),
            "rollouter": ro.state(),
            "queue": {"version": q.version, "counters": q.counters()},
            "engines": engines,
            "faults": {
                "fired": sorted(set(self.driver_fired)), "driver": self.driver_records,
                "records": shifted_records(self.faults.state(), -z),
            },
        })
        for slot, groups in (("queued", q.contents()), ("interrupted", list(ro.cancel_queue)), ("retry", list(ro.retry_queue))):
            snap.groups[slot] = await asyncio.gather(*(self._with_tokens(g) for g in groups))
        return snap

    async def _with_tokens(self, g: Group) -> Group:
        """A copy of ``g`` holding its tokens (resolved from their reference), in run time."""
        c = g.without_tokens()
        if g.payload is not None:
            attach_tokens(c, await g.payload)
        c.shift_times(-self.zero)
        return c

    async def restore_run(self, path: str) -> None:
        """A resumed run: back to the rollout side of checkpoint ``path``, paused inside the
        sync it was taken in (the trainer finishes it). Groups' tokens go into this run's
        object store, owned here, as the engines' would be."""
        snap = await asyncio.to_thread(load_rollout_side, path)
        st, z, ray = snap.state, self.zero, _ray()

        def live(g: Group) -> Group:
            g.shift_times(z)
            m = g.without_tokens()
            m.payload = ray.put(encode_tokens(g))
            return m

        groups = {slot: [live(g) for g in snap.groups[slot]] for slot in ("queued", "interrupted", "retry")}
        self.ledger.restore(st["ledger"])
        self.ledger.shift_times(z)
        # This run's engines are new processes: none holds an interrupted group's prefix.
        self.rollouter.restore({**st["rollouter"], "holders": []}, groups["interrupted"], groups["retry"], paused=True)
        self.queue.restore(st["queue"]["version"], groups["queued"], st["queue"]["counters"])
        f = st["faults"]
        self.faults.records[:] = FaultLog.from_state(shifted_records(f["records"], z)).records
        self.driver_fired, self.driver_records = list(f["fired"]), list(f["driver"])
        if len(st["engines"]) != len(self.engines):
            raise ValueError(f"{path}: {len(st['engines'])} engine states for {len(self.engines)} engines")
        calls = []
        for e, sup, es in zip(self.engines, self.rollouter.engines, st["engines"]):
            sup.restarts = es["restarts"]
            es = {**es, "spans": shifted_spans(es["spans"], z + e.offset)}
            calls.append(_timed(e.handle.restore_counters.remote(es), self.sc.timeouts.control_s, e.name, "restore_counters"))
        await asyncio.gather(*calls)

    async def redeliver(self, trained: bytes = b"") -> int:
        """A restarted trainer: drop the dead one's wait, hand back what it was given since its
        checkpoint. ``trained``: the restored ledger's ``trained_mask``; a group it counts was
        trained before a checkpoint whose ack the kill cut off, and is acknowledged, not given again."""
        if self._get is not None and not self._get.done():
            self._get.cancel()
            await asyncio.gather(self._get, return_exceptions=True)
        q = self.queue
        done = [q.wire.key(g) for g in q.unacked() if Ledger.all_trained(trained, g)]
        if done:
            log.info("%d group(s) trained before the checkpoint were never acknowledged; not redelivered", len(done))
            q.ack(done)
        return q.redeliver()

    def weights_from(self, trainer: Any) -> None:
        """An engine back from a restart cannot join a broadcast alone: it loads a copy of the
        trainer's weights through the object store, or, with none to be had (the trainer being
        restarted, or behind), rejoins at the next sync."""
        control_s = self.sc.timeouts.control_s

        async def catch_up(version: int) -> Optional[list]:
            try:
                return await _timed(trainer.catch_up.remote(version), control_s, "trainer", "catch_up")
            except (*_died(), CallTimeout) as exc:
                log.warning("no copy of the weights for a restarted engine (%s); it rejoins at the next sync", exc)
                return None

        self.rollouter.catch_up = catch_up

    async def inject(self, i: int) -> None:
        """Fault ``i`` of the scenario, on a rollout worker (the driver fires it)."""
        targets = _WorkerTargets(self)
        strike(self.sc.faults[i], targets, self.faults, asyncio.get_running_loop().time())
        await asyncio.gather(*targets.calls)

    def node_lost(self, workers: list[int]) -> None:
        """These workers' node is being taken down (the driver does it): each is a kill of its
        own, restarted (elsewhere) as one."""
        now = asyncio.get_running_loop().time()
        for i in workers:
            proxy = self.engines[i]
            self.faults.injected("kill", worker_key(i), now)
            proxy.dead = True  # its process goes with the node: nothing to kill, only to wait for
            self.rollouter.worker_lost(i, WorkerLost(proxy.name, "node", "its node was lost"))

    async def pause(self, mode: str) -> None:
        await self.rollouter.pause(mode)

    async def update_weights(self, version: int, weights: Any) -> None:
        await self.rollouter.update_weights(version, weights)

    async def resume(self) -> None:
        await self.rollouter.resume()

    async def stop(self) -> dict:
        """End of run: stop, account for what was never queued or trained, close engines."""
        if self._get is not None and not self._get.done():
            self._get.cancel()
        self.queue.ack()  # the run is over: what was trained stays trained
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
            "engines": [
                EngineCounters.of(e, sup.restarts, self.rollouter.resume_counts(i))
                for i, (e, sup) in enumerate(zip(self.engines, self.rollouter.engines))
            ],
            "queue_counters": self.queue.counters(),
            "in_flight": producer_in_flight(self.rollouter, self.queue, self.sc.workload.group_size),
            "faults": self.faults.state(),
        }

    def now(self) -> float:
        return time.monotonic()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return node_id()


class _WorkerTargets:
    """What a fault does to a rollout worker from the rollout actor, which holds the proxies.
    The queue lives in this actor and is not killed alone (config refuses it on ray); the
    trainer is the driver's to kill."""

    def __init__(self, host: RolloutHost) -> None:
        self.host = host
        self.calls: list = []  # remote calls the fault made, awaited before inject returns

    def kill_worker(self, worker: int) -> None:
        proxy = self.host.engines[worker]
        proxy.kill()
        # Ray reports the process gone at once; an idle worker is restarted right away too.
        self.host.rollouter.worker_lost(worker, WorkerLost(proxy.name, "process", "killed"))

    def slow_worker(self, worker: int, factor: float, duration_s: float) -> None:
        loop, faults = asyncio.get_running_loop(), self.host.faults
        self.calls.append(self.host.engines[worker].handle.slow.remote(factor, duration_s))
        loop.call_later(duration_s, lambda: faults.recovered(worker_key(worker), loop.time(), ("slow",)))

    def hang_worker(self, worker: int, call: str) -> None:
        self.calls.append(self.host.engines[worker].handle.hang.remote(call))

    def kill_queue(self) -> None:
        raise ValueError("the queue is not killed alone on the ray runtime (it lives in the rollout actor)")

    def kill_trainer(self) -> None:
        raise ValueError("the driver kills the trainer actor, not the rollout actor")

    def kill_node(self, of: str, worker: int) -> None:
        raise ValueError("the driver takes a node down, not the rollout actor")


async def _timed(ref: Any, seconds: float, component: str, call: str) -> Any:
    """Await a remote call; no answer in time is a ``CallTimeout`` naming the component and call."""
    try:
        async with asyncio.timeout(seconds):
            return await ref
    except TimeoutError:
        raise CallTimeout(component, call, seconds, "timeouts.control_s") from None


class QueueProxy:
    """The trainer's batch source: the queue in the rollout actor. ``get_batch`` waits as long
    as producing a batch takes, so it has no timeout of its own: the engines' timeouts bound
    how long the producer can stall."""

    def __init__(self, handle: Any, offset: float) -> None:
        self.handle = handle
        self.offset = offset  # rollout actor clock minus the trainer's

    async def get_batch(self, n: int) -> Batch:
        """The groups' metadata from the rollout actor, their tokens from where the engines put
        them (by reference, mapped without a copy)."""
        groups = await self.handle.get_batch.remote(n)
        tokens = await asyncio.gather(*(g.payload for g in groups))
        for g, buf in zip(groups, tokens):
            attach_tokens(g, buf)
            g.payload = None  # the tokens are here now
            g.shift_times(-self.offset)
        return Batch(groups)


class RolloutProxy:
    """What ParamSync drives: pause, update_weights, resume of the Rollouter in its actor.
    A pause drains the longest generation in flight, so it gets the generate timeout too."""

    def __init__(self, handle: Any, control_s: float, generate_s: Optional[float] = None) -> None:
        self.handle = handle
        self.control_s = control_s
        self.generate_s = generate_s or control_s

    async def pause(self, mode: PauseMode) -> None:
        await _timed(self.handle.pause.remote(mode), self.generate_s + self.control_s, "rollouter", "pause")

    async def update_weights(self, version: int, weights: Any) -> None:
        await _timed(self.handle.update_weights.remote(version, weights), self.control_s, "rollouter", "update_weights")

    async def resume(self) -> None:
        await _timed(self.handle.resume.remote(), self.control_s, "rollouter", "resume")


class TrainerHost:
    """The Trainer, its ParamSync and the torch GRPO backend, with the trained half of the ledger.
    With ``peers`` (``ray.trainer_ranks`` > 1) it is rank 0 of a data-parallel trainer, the
    others ``TrainerRankHost`` actors (core/runtimes/trainer_ranks.py)."""

    def __init__(
        self, sc: Scenario, mode: str, rollout: Any, threads: int, run_dir: str, peers: tuple = (),
        stop_at_step: Optional[int] = None, shipped: tuple = (),
    ) -> None:
        self.sc, self.mode, self.run_dir = sc, mode, run_dir
        self.rollout = rollout
        self.stop_at_step = stop_at_step
        self.zero = 0.0  # this clock at run time 0 (checkpoints hold run times)
        self.resynced_at: Optional[float] = None
        here = node_scenario(sc, shipped)  # the model where this node has it; ``sc`` stays the run's identity
        self.backend = make_backend(here, threads)
        if peers:
            self.backend = RankedBackend(self.backend, list(peers))
        self.transfer = _transfer(here, self.backend)
        self.timeline = Timeline()
        self.ledger = Ledger(trained_bound(sc, mode), reuse=sc.replay.enabled)
        self.trainer = None
        self.end_s = 0.0
        self.told: list[Progress] = []  # steps and syncs since the driver last asked, on this actor's clock

    async def connect(self, rollout_offset: float) -> None:
        """Wire the trainer side; ``rollout_offset`` is the rollout actor's clock minus ours.
        With ranks, a new process group of them first (the others are fresh processes)."""
        sc, mode = self.sc, self.mode
        if isinstance(self.backend, RankedBackend):
            await self.backend.form_group(sc.timeouts.restart_s)
        workers = Workers([], self.backend, self.transfer, spread=Workload(sc.workload, sc.seed).reward_spread)
        self.trainer, self.param_sync, self.replay = connect_trainer(
            sc, mode, workers, self.ledger, QueueProxy(self.rollout, rollout_offset),
            RolloutProxy(self.rollout, sc.timeouts.control_s, sc.timeouts.generate_s), self.timeline,
        )
        self.param_sync.on_synced = self.told.append
        self.trainer.on_step = self._stepped
        if not sc.checkpoint.every:
            return

        async def checkpoint(version: int, t0: float, t1: float) -> None:
            # The trainer's side first, then the rollout side makes it whole (and acknowledges).
            z = self.zero
            path = await asyncio.to_thread(
                save_trainer_side, sc, mode, self.run_dir, self.trainer, self.ledger, self.backend, version,
                zero=z, extra=self._extra(),
            )
            if path is not None:
                await _timed(self.rollout.checkpoint.remote(path.name, version, t0 - z, t1 - z), sc.timeouts.control_s, "rollouter", "checkpoint")

        self.param_sync.checkpoint = checkpoint
        # A whole checkpoint holds no generation in flight: an inflight sync that takes one aborts them.
        self.param_sync.checkpoint_captures_rollout = lambda version: due(sc, version)
        if latest(checkpoint_dir(self.run_dir, mode)) is None:  # what a trainer dying before its first sync goes back to
            save_trainer_side(sc, mode, self.run_dir, self.trainer, self.ledger, self.backend, 0, at_start=True, zero=self.zero)

    def _stepped(self, event: Progress) -> None:
        self.told.append(event)
        if self.stop_at_step is not None and event.step >= self.stop_at_step:
            raise RunStopped(f"stopped after step {event.step}")

    def _extra(self) -> dict:
        """What a resume takes back besides the trainer's own side (run times)."""
        ps, be = self.param_sync, self.backend
        return {
            "param_sync": {"pause_s": ps.pause_s, "drain_s": ps.drain_s, "transfer_s": ps.transfer_s},
            "timeline": shifted_spans(dict(self.timeline.spans), -self.zero),
            "backend": {"compute_s": be.compute_s, "flops": be.flops},
        }

    def set_zero(self, zero: float) -> None:
        self.zero = zero

    async def restore_run(self, path: str) -> None:
        """A resumed run: back to the trainer side of whole checkpoint ``path``."""
        snap = await asyncio.to_thread(load, path)
        st, z = snap.state, self.zero
        self.trainer.restore(trainer_state_at(st["trainer"], z),
                             snap.groups["holding"])
        self.ledger.restore(st["ledger"], fields=self.ledger.TRAINED_FIELDS)
        self.ledger.shift_times(z)
        ps, be = self.param_sync, self.backend
        p = st["param_sync"]
        ps.pause_s, ps.drain_s, ps.transfer_s = list(p["pause_s"]), list(p["drain_s"]), list(p["transfer_s"])
        own = be.backend if isinstance(be, RankedBackend) else be  # rank 0's backend counts the work
        own.compute_s, own.flops = st["backend"]["compute_s"], st["backend"]["flops"]
        for w, rows in shifted_spans(st["timeline"], z).items():
            self.timeline.spans[w][:0] = rows
        await asyncio.to_thread(lambda: be.load({stem: load_tensors(path, stem) for stem in be.tensor_files}))

    async def restore(self) -> None:
        """A restarted trainer: back to the latest checkpoint; the queue hands back what the
        dead one was given since."""
        await asyncio.to_thread(restore_trainer_side, self.trainer, self.ledger, self.backend, self.run_dir, self.mode, self.zero)
        await _timed(self.rollout.redeliver.remote(self.ledger.trained_mask()), self.sc.timeouts.control_s, "rollouter", "redeliver")

    async def run(self, resync: bool = False, resume: Optional[tuple[int, float, float]] = None) -> None:
        """Train to the end; ``resync``: first move the engines to this trainer's weights;
        ``resume``: first finish the sync (version, t0, t1 in run time) a checkpoint was taken in."""
        loop = asyncio.get_running_loop()

        async def first() -> None:
            await self.param_sync.sync(self.trainer.version, checkpoint=False)
            self.resynced_at = loop.time()

        async def finish() -> None:
            version, t0, t1 = resume
            await self.param_sync.finish(version, t0 + self.zero, t1 + self.zero)

        await self.trainer.run(first if resync else finish if resume is not None else None)
        self.end_s = loop.time()

    def progress(self) -> tuple[int, int, Optional[float], list[Progress]]:
        """(step, version, when a restarted trainer resynced, what happened since the last call)."""
        t = self.trainer
        told, self.told[:] = list(self.told), []
        return t.step, t.version, self.resynced_at, told

    async def catch_up(self, version: int) -> Optional[list]:
        """A copy of the weights for an engine back from a restart (``RolloutHost.weights_from``),
        in the object store; None while this trainer is behind ``version`` (restored from an
        older checkpoint). Weights trained past ``version`` and not yet synced go as ``version``:
        that engine's tokens then count as staler than they are, never as fresher."""
        if self.trainer is None or self.trainer.version < version:
            return None
        weights = await asyncio.to_thread(self.backend.weights)
        return [_ray().put(weights)]

    def latest_weights(self) -> tuple[int, list]:
        return self.transfer.latest

    def finish(self) -> dict:
        """End of run: what the trainer holds untrained is dropped; the trainer half of the run."""
        t, be, ps = self.trainer, self.backend, self.param_sync
        release_unused(t, self.replay, self.ledger)
        return {
            "ledger": self.ledger,
            "timeline": self.timeline,
            "end_s": self.end_s,
            "trainer": TrainerCounters(t.step, t.version, t.wait_s, t.step_info, be.compute_s, be.flops, be.peak_flops),
            "sync": SyncCounters(ps.pause_s, ps.drain_s, ps.transfer_s),
            "replay_counters": self.replay.counters() if self.replay else None,
            "in_flight": consumer_in_flight(t, self.replay),
        }

    def now(self) -> float:
        return time.monotonic()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return node_id()


def _transfer(sc: Scenario, backend: Any) -> Any:
    """The scenario's weight transport. A broadcast group is served from this process, on a
    free port of this node: a restarted trainer serves a new one, and the engines join it."""
    ray = _ray()
    if sc.sync.transport == "object_store":
        return ObjectStoreTransfer(backend, ray.put)
    return BroadcastTransfer(
        backend, ray.util.get_node_ip_address(), bucket_bytes=int(sc.sync.bucket_mb * 2**20),
        dtype=model_dtype(sc.real_model_path, sc.engine.dtype), device=backend.device,
        timeout_s=sc.timeouts.control_s, put=ray.put, publish_every=sc.eval.every,
    )


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


def _back(name: str, handle: Any, old_pid: int, sc: Scenario, deadline: float) -> int:
    """Wait for the new process of an actor Ray restarts; its pid."""
    ray = _ray()
    while True:
        try:
            pid = ray.get(handle.pid.remote(), timeout=sc.timeouts.control_s)
            if pid != old_pid:
                return pid
        except (*_died(), ray.exceptions.GetTimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{name}: not back within {sc.timeouts.restart_s:g} s of its death; "
                "fix: raise timeouts.restart_s or recovery.max_restarts"
            )
        time.sleep(0.2)


def _restart_trainer(run: "_Actors", sc: Scenario) -> tuple[int, float]:
    """Wait for Ray's new trainer process, wire it, and restore it from its checkpoint. Its
    other ranks were in the dead one's process group, maybe blocked in a collective with it:
    they are restarted too, and join the new rank 0's group as fresh processes."""
    ray = _ray()
    deadline = time.monotonic() + sc.timeouts.restart_s
    for peer in run.peers:
        ray.kill(peer, no_restart=False)
    run.peer_pids = [_back(f"trainer rank {r + 1}", p, old, sc, deadline) for r, (p, old) in enumerate(zip(run.peers, run.peer_pids))]
    trainer, off_rollout = run.trainer, run.off_rollout
    pid = _back("trainer", trainer, run.trainer_pid, sc, deadline)
    off = _offset(trainer)
    ray.get(trainer.set_zero.remote(run.t0 + off), timeout=sc.timeouts.control_s)
    ray.get(trainer.connect.remote(off_rollout - off), timeout=sc.timeouts.restart_s)
    ray.get(trainer.restore.remote(), timeout=sc.timeouts.restart_s)
    return pid, off


def _bundles(sc: Scenario, place: Placement) -> list[dict]:
    """One bundle per rollout engine, then one per trainer rank (none colocated: the ranks
    share the engines' bundles), in one placement group that keeps them together."""
    r, t = sc.ray.rollout, sc.ray.trainer
    rollout = [{"CPU": r.num_cpus, "GPU": r.num_gpus} for _ in range(place.engines)]
    if place.colocated:
        return rollout
    return rollout + [{"CPU": t.num_cpus, "GPU": t.num_gpus} for _ in range(sc.ray.trainer_ranks)]


def _trainer_bundle(place: Placement, rank: int) -> int:
    """The bundle of trainer rank ``rank``: its own after the engines', or, colocated, an engine's."""
    return rank % place.engines if place.colocated else place.engines + rank


def _clean(bundle: dict) -> dict:
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}


def run_ray(
    sc: Scenario,
    mode: str,
    on_step: Optional[ProgressFn] = None,
    on_processes: Optional[ProcessesFn] = None,
    run_dir=None,
    resume: bool = False,
    stop_at_step: Optional[int] = None,
) -> RunResult:
    """Run one mode with every component in its own Ray actor; the driver only watches, and
    injects the scenario's faults. ``run_dir`` keeps the checkpoints (it must be on storage
    every node sees); a temporary directory when None. ``resume``: start from the latest
    whole checkpoint there (core/runtimes/ray_checkpoint.py), or from the start if there is
    none; ``stop_at_step``: stop after that trainer step, as a crash would (``RunStopped``)."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-ray-") as tmp:
        where = os.path.abspath(run_dir if run_dir is not None else tmp)
        point = None
        if resume:
            point = load_ray_run(where, sc, mode)
            discard_after(checkpoint_dir(where, mode), point.path if point is not None else None)
        carried = _Carried()
        while True:
            try:
                return _run_ray(sc, mode, on_step, on_processes, where, point, stop_at_step, carried)
            except _RolloutLost as exc:
                # The queue, the Rollouter and the producer's ledger died with the actor: the
                # groups made since the last whole checkpoint are gone, so the trainer goes back too.
                carried.restarts += 1
                if carried.restarts > sc.recovery.max_restarts:
                    raise RestartsExhausted(
                        f"the rollout actor: died {carried.restarts} times, more than recovery.max_restarts = {sc.recovery.max_restarts}"
                    ) from None
                point = load_ray_run(where, sc, mode)
                discard_after(checkpoint_dir(where, mode), point.path if point is not None else None)
                log.warning("%s; the run goes back to %s", exc, point.path.name if point is not None else "its start")


class _RolloutLost(RuntimeError):
    """The rollout actor died mid-run (``run_ray`` brings the run back to its last whole checkpoint)."""


@dataclass
class _Carried:
    """What a run keeps across its rollout actor's deaths: when it started, its clock's zero,
    which faults fired and the driver's fault records (those since the checkpoint it goes back
    to are not in it)."""

    restarts: int = 0
    started: Optional[float] = None
    t0: Optional[float] = None
    fired: set = field(default_factory=set)
    records: list = field(default_factory=list)


@dataclass
class _Actors:
    """The run's actors as the driver sees them, with each one's clock offset to the driver's."""

    rollout: Any
    trainer: Any
    off_rollout: float
    off_trainer: float
    trainer_pid: int
    off_engines: dict
    peers: list  # trainer ranks 1..N-1
    peer_pids: list
    restarting: bool = False
    t0: float = 0.0  # the driver's clock at run time 0
    engines: list = field(default_factory=list)  # engine actors, in worker order
    nodes: dict = field(default_factory=dict)  # component -> node ids it has run on, in order

    def named(self) -> list[tuple[str, Any]]:
        return ([(f"engine{i:03d}", h) for i, h in enumerate(self.engines)] + [("rollouter", self.rollout), ("trainer", self.trainer)]
                + [(f"trainer_rank{r + 1}", p) for r, p in enumerate(self.peers)])

    def note_nodes(self, timeout_s: float) -> dict[str, str]:
        """Where each component runs now (asked of the actors themselves), added to ``nodes``."""
        ray, now = _ray(), {}
        for name, h in self.named():
            try:
                now[name] = ray.get(h.node.remote(), timeout=timeout_s)
            except _died():  # being restarted: where it comes back is seen next time
                continue
        for name, node in now.items():
            seen = self.nodes.setdefault(name, [])
            if not seen or seen[-1] != node:
                seen.append(node)
        return now


def _run_ray(
    sc: Scenario, mode: str, on_step, on_processes, run_dir: str, point: Optional[RayResume] = None, stop_at_step: Optional[int] = None,
    carried: Optional[_Carried] = None,
) -> RunResult:
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ensure_model_dir(sc)  # the tiny model is built on first use
    sc = sc.with_absolute_paths()  # actors may run elsewhere than this working directory
    with cluster(sc.ray.address, sc.ray.num_cpus, sc.reward.serve):  # started here unless already connected (the harness starts one per run)
        place = Placement.of(sc, mode)
        actors: list = []
        pg = None
        serve_started = False
        try:
            bundles = _bundles(sc, place)
            pg = placement_group([_clean(b) for b in bundles], strategy=sc.ray.placement_strategy)
            ray.get(pg.ready(), timeout=sc.timeouts.control_s)
            share = 0.5 if place.colocated else 1.0  # colocated: engine and trainer split a bundle

            def pinned(i: int, role) -> dict:
                return {
                    "num_cpus": role.num_cpus * share,
                    "num_gpus": role.num_gpus * share,
                    "max_concurrency": role.max_concurrency,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                }

            control_s = sc.timeouts.control_s
            restarts = {"max_restarts": sc.recovery.max_restarts}  # Ray brings a killed worker back
            # The model, for the nodes that do not see its path (each keeps one copy): passed in a
            # tuple, so an actor resolves it only if it needs it.
            shipped = (ray.put(pack_model(sc.real_model_path)),) if sc.ray.ship_model else ()
            engine_cls = ray.remote(EngineHost)
            engines = []
            for i in range(place.engines):
                name = f"engine{i:03d}"
                h = engine_cls.options(**pinned(i, sc.ray.rollout), **restarts).remote(sc, name, place.gpus_per_engine, sc.seed * 1000 + i, shipped)
                engines.append((name, h))
                actors.append(h)
            starting = [h.start.remote() for _, h in engines]
            c = sc.ray.controller
            # The rollout actor holds the queue and the producer's ledger: when it dies, run_ray
            # brings the whole run back. It stays on the driver's node, which a run cannot lose and go on.
            rollout = ray.remote(RolloutHost).options(
                num_cpus=c.num_cpus, num_gpus=c.num_gpus, max_concurrency=c.max_concurrency, scheduling_strategy=on_node(node_id()),
            ).remote(sc, mode, run_dir)
            actors.append(rollout)
            # Every actor is created before any is waited for: the trainer loads its model while
            # the engines start (created once they were up, a run waited for the two in turn).
            ranks = sc.ray.trainer_ranks
            threads = max(1, place.trainer_gpus // ranks)  # each rank its share of the trainer's devices
            peers = [
                ray.remote(TrainerRankHost).options(**pinned(_trainer_bundle(place, r), sc.ray.trainer), **restarts).remote(sc, r, threads, shipped)
                for r in range(1, ranks)
            ]
            actors.extend(peers)
            trainer = ray.remote(TrainerHost).options(**pinned(_trainer_bundle(place, 0), sc.ray.trainer), **restarts).remote(
                sc, mode, rollout, threads, run_dir, tuple(peers), stop_at_step, shipped
            )
            actors.append(trainer)
            ray.get(starting, timeout=sc.timeouts.restart_s)
            off_engines = [_offset(h) for _, h in engines]
            engine_pids = ray.get([h.pid.remote() for _, h in engines], timeout=control_s)
            reward_handle = None
            if sc.reward.serve:
                reward_handle = deploy_reward(sc)
                serve_started = True
            off_rollout = _offset(rollout)
            ray.get(rollout.connect.remote(
                [(name, h, off - off_rollout, pid) for (name, h), off, pid in zip(engines, off_engines, engine_pids)], reward_handle,
            ), timeout=control_s)
            # Every actor here shares the host's monotonic clock unless the cluster spans nodes,
            # and then the offsets matter.
            off_trainer = _offset(trainer)
            ray.get(trainer.connect.remote(off_rollout - off_trainer), timeout=sc.timeouts.restart_s)
            trainer_pid = ray.get(trainer.pid.remote(), timeout=control_s)
            ray.get(rollout.weights_from.remote(trainer), timeout=control_s)
            peer_pids = ray.get([p.pid.remote() for p in peers], timeout=control_s)
            if on_processes is not None:
                pids = ray.get([rollout.pid.remote()], timeout=control_s)
                names = [n for n, _ in engines] + ["rollouter", "trainer"] + [f"trainer_rank{r}" for r in range(1, ranks)]
                on_processes(list(zip(names, engine_pids + pids + [trainer_pid] + peer_pids)))
            run = _Actors(
                rollout, trainer, off_rollout, off_trainer, trainer_pid, {n: off for (n, _), off in zip(engines, off_engines)}, peers, peer_pids,
                engines=[h for _, h in engines],
            )
            run.note_nodes(control_s)
            return asyncio.run(_watch(sc, mode, place, run, on_step, point, carried or _Carried()))
        finally:
            for a in actors:
                ray.kill(a)
            if pg is not None:
                remove_placement_group(pg)
            if serve_started:
                from ray import serve

                serve.delete("asyncrl-reward")


async def _watch(
    sc: Scenario, mode: str, place: Placement, run: _Actors, on_step: Optional[ProgressFn], point: Optional[RayResume],
    carried: _Carried,
) -> RunResult:
    """The driver's loop: it blocks on nothing, and every poll_s reports progress, launches
    evaluations and fires the faults due. The trainer is supervised as in one process.
    ``point``: a whole checkpoint that both sides go back to first; run time goes on from it,
    or, for a run brought back after its rollout actor died (``carried``), from now."""
    ray, died = _ray(), _died()
    control_s = sc.timeouts.control_s
    rollout = run.rollout
    evals = Evaluations(sc)
    evals.warm_up()
    plan = FaultPlan(sc.faults, set())
    faults = FaultLog()  # the trainer's; the rollout actor keeps its workers'
    if carried.t0 is None:
        carried.started = time.monotonic()
        carried.t0 = carried.started - (point.clock if point is not None else 0.0)
    started = carried.started
    t0 = run.t0 = carried.t0
    ray.get([rollout.set_zero.remote(t0 + run.off_rollout), run.trainer.set_zero.remote(t0 + run.off_trainer)], timeout=control_s)
    if point is not None:
        ray.get(rollout.restore_run.remote(str(point.path)), timeout=sc.timeouts.restart_s)
        ray.get(run.trainer.restore_run.remote(str(point.path)), timeout=sc.timeouts.restart_s)
        plan.fired.update(point.fired)
        faults.records[:] = FaultLog.from_state(point.driver_faults).records
    # Back after the rollout actor died: what fired since the checkpoint stays fired, and recorded.
    plan.fired.update(carried.fired)
    have = {(r.kind, r.target, r.at_s) for r in faults.records}
    faults.records.extend(r for r in FaultLog.from_state(carried.records).records if (r.kind, r.target, r.at_s) not in have)

    def share() -> None:
        """The driver's faults go into the rollout side of the next checkpoint, and survive its actor."""
        carried.fired, carried.records = set(plan.fired), faults.state()
        rollout.driver_faults.remote(sorted(plan.fired), faults.state())

    share()

    lost_nodes: dict[str, list[str]] = {}  # a node fault's record -> the records of what ran there

    def fire(i: int, f) -> None:
        if f.target in ("trainer", "queue", "node"):
            strike(f, _DriverTargets(run, sc, faults, lost_nodes, time.monotonic() - t0), faults, time.monotonic() - t0)
        else:
            ray.get(rollout.inject.remote(i), timeout=control_s)
        share()

    async def rollout_lost() -> bool:
        try:
            await _timed(rollout.pid.remote(), control_s, "rollouter", "pid")
            return False
        except died:
            return True
        except CallTimeout:
            return False

    async def train(resync: bool) -> None:
        # A resumed run finishes the sync its checkpoint was taken in; a restarted trainer resyncs.
        try:
            await run.trainer.run.remote(resync, None if resync or point is None else point.sync)
        except died as exc:
            # The trainer's call into a dead rollout actor: its error, not its death.
            if isinstance(exc, ray.exceptions.RayTaskError) and await rollout_lost():
                raise _RolloutLost("the rollout actor died") from None
            raise

    async def restart() -> None:
        run.restarting = True  # a trainer being wired answers no progress, and no fault strikes it
        try:
            run.trainer_pid, run.off_trainer = await asyncio.to_thread(_restart_trainer, run, sc)
        finally:
            run.restarting = False

    def tell(told: list) -> None:
        if on_step is not None:
            for event in told:
                on_step(replace(event, at_s=event.at_s - run.off_trainer - t0))

    injector = FaultInjector(plan, fire)
    rolling = asyncio.ensure_future(_await(rollout.run.remote()))
    training = asyncio.ensure_future(supervise_trainer(train, restart, sc.recovery.max_restarts, died))
    step = 0
    try:
        while True:
            done, _ = await asyncio.wait({rolling, training}, timeout=sc.ray.poll_s, return_when=asyncio.FIRST_COMPLETED)
            if training in done:
                training.result()
                break
            if rolling in done:
                if await rollout_lost():
                    raise _RolloutLost("the rollout actor died")
                rolling.result()
                raise RuntimeError("the rollouter stopped before the trainer finished")
            if run.restarting:
                continue
            try:
                step, version, resynced, told = await _timed(run.trainer.progress.remote(), control_s, "trainer", "progress")
                if resynced is not None and any(r.target == "trainer" and r.recovered_s is None for r in faults.records):
                    faults.recovered("trainer", resynced - run.off_trainer - t0)
                    share()
                tell(told)
                if told and any(r.target == "queue" and r.recovered_s is None for r in faults.records):
                    faults.recovered("queue", told[0].at_s - run.off_trainer - t0, ("kill",))  # training again
                    share()
                evals.poll(run.trainer, version, time.monotonic() - t0)
            except died:
                pass  # the trainer is being restarted
            injector.poll(step, time.monotonic() - t0)
    except BaseException as exc:
        lost = isinstance(exc, died) and await rollout_lost()  # a call into it from here
        for task in (rolling, training):
            task.cancel()
        await asyncio.gather(rolling, training, return_exceptions=True)
        if lost:
            raise _RolloutLost("the rollout actor died") from None
        if isinstance(exc, RunStopped):  # raised in the trainer actor: its own message, not Ray's traceback
            raise RunStopped(str(getattr(exc, "cause", exc))) from None
        raise
    tell(ray.get(run.trainer.progress.remote(), timeout=control_s)[3])  # the steps since the last poll
    trained = ray.get(run.trainer.finish.remote(), timeout=control_s)
    run.note_nodes(control_s)
    rolled = ray.get(rollout.stop.remote(), timeout=sc.timeouts.generate_s)
    evals.finish(time.monotonic() - t0)
    await _timed(rolling, control_s, "rollouter", "run")  # a rollouter that failed after the trainer finished fails the run
    wall_s = time.monotonic() - started
    # Everything onto the driver's clock, zero at the start.
    dt_r, dt_t = -run.off_rollout - t0, -run.off_trainer - t0
    ledger: Ledger = rolled["ledger"]
    ledger.shift_times(dt_r)
    trained["ledger"].shift_times(dt_t)
    ledger.merge(trained["ledger"])
    timeline = Timeline()
    for part, dt in ((rolled["timeline"], dt_r), (trained["timeline"], dt_t)):
        for w, rows in part.spans.items():
            timeline.spans[w].extend([[k, a + dt, b + dt] for k, a, b in rows])
    tc = trained["trainer"]
    for info in tc.step_info:
        info["end_s"] += dt_t
    for rec in FaultLog.from_state(rolled["faults"]).records:
        rec.at_s += dt_r
        rec.recovered_s = None if rec.recovered_s is None else rec.recovered_s + dt_r
        faults.records.append(rec)
    faults.records.sort(key=lambda r: r.at_s)
    _node_recoveries(faults, lost_nodes)
    return RunResult(
        scenario=sc,
        mode=mode,
        placement=place,
        ledger=ledger,
        timeline=timeline,
        engines=rolled["engines"],
        trainer=tc,
        sync=trained["sync"],
        queue_counters=rolled["queue_counters"],
        replay_counters=trained["replay_counters"],
        in_flight=rolled["in_flight"] + trained["in_flight"],
        faults=faults,
        end_s=trained["end_s"] + dt_t,
        wall_s=wall_s,
        evaluations=evals.results,
        clock_offsets_s={"rollouter": run.off_rollout, "trainer": run.off_trainer, **run.off_engines},
        nodes=run.nodes,
    )


def _node_recoveries(faults: FaultLog, lost_nodes: dict[str, list[str]]) -> None:
    """A lost node is recovered when everything that ran on it is: its record closes with the
    last of theirs (the first record of each after the node's), or stays open with any of them."""
    for rec in faults.records:
        parts = lost_nodes.get(rec.target)
        if parts is None or rec.recovered_s is not None:
            continue
        ends = []
        for part in parts:
            # An engine's record is the rollout actor's, taken just after the node's on its clock
            # and moved onto the driver's (an offset good to a round trip): a second's slack.
            after = [r for r in faults.records if r.target == part and r.kind == "kill" and r.at_s >= rec.at_s - 1.0]
            ends.append(after[0].recovered_s if after else None)
        if all(e is not None for e in ends):
            rec.recovered_s = max([rec.at_s, *ends])


async def _await(ref: Any) -> Any:
    return await ref


class _DriverTargets:
    """The driver's side of a fault: it kills the trainer actor (Ray restarts it), the rollout
    actor that holds the queue (the run goes back to its last whole checkpoint), or takes a
    node down with whatever runs there."""

    def __init__(self, run: _Actors, sc: Scenario, faults: FaultLog, lost_nodes: dict, now: float) -> None:
        self.run, self.sc, self.faults, self.lost_nodes, self.now = run, sc, faults, lost_nodes, now
        self.trainer, self.rollout = run.trainer, run.rollout

    def kill_trainer(self) -> None:
        _ray().kill(self.trainer, no_restart=False)

    def kill_node(self, of: str, worker: int) -> None:
        """Take down the node that runs ``of`` (rollout worker ``worker``, or the trainer): its
        engines are told lost to the rollout actor (restarted elsewhere when Ray has a place
        for them), the trainer, if there, dies and is supervised back as after its own kill."""
        run, control_s = self.run, self.sc.timeouts.control_s
        where = run.note_nodes(control_s)
        name = "trainer" if of == "trainer" else f"engine{worker:03d}"
        node = where.get(name)
        if node is None:
            raise RuntimeError(f"{name} is being restarted: its node is not known; fix: fire the node fault at another step")
        if node == where["rollouter"]:
            raise RuntimeError(
                f"the node of {name} ({node}) is the driver's, where the rollout actor lives: losing it ends the run; "
                "fix: ray.placement_strategy STRICT_SPREAD, or a head node without CPUs for the bundles"
            )
        lost = [i for i in range(len(run.engines)) if where.get(f"engine{i:03d}") == node]
        trainer_lost = any(where.get(n) == node for n, _ in run.named() if n.startswith("trainer"))
        target = f"node_of_{worker_key(worker) if of == 'rollout_worker' else of}"
        self.lost_nodes[target] = [worker_key(i) for i in lost] + (["trainer"] if trainer_lost else [])
        log.warning("taking node %s down: %s", node, ", ".join(self.lost_nodes[target]) or "nothing of this run")
        if trainer_lost:
            self.faults.injected("kill", "trainer", self.now)
        if lost:
            _ray().get(run.rollout.node_lost.remote(lost), timeout=control_s)
        kill_node(node)

    def kill_queue(self) -> None:
        _ray().kill(self.rollout, no_restart=True)

    def kill_worker(self, worker: int) -> None:
        raise ValueError("a rollout worker's fault is fired in the rollout actor")

    def slow_worker(self, worker: int, factor: float, duration_s: float) -> None:
        raise ValueError("a rollout worker's fault is fired in the rollout actor")

    def hang_worker(self, worker: int, call: str) -> None:
        raise ValueError("a rollout worker's fault is fired in the rollout actor")
