"""The rollout actor (``RolloutHost``): the Rollouter, its staleness queue and the producer half
of the ledger, driving the engine actors through their proxies, with what a fault does to a
rollout worker from there (``_WorkerTargets``) and its side of each whole checkpoint. And the
two proxies the trainer actor reaches it through: ``QueueProxy`` (its batches) and
``RolloutProxy`` (what ParamSync pauses, updates and resumes)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from core.api import Batch, PauseMode
from core.model.run_plan import RunPlan
from core.model.faults import CallTimeout, FaultLog, WorkerLost, worker_key
from core.model.group_wire import attach_tokens, encode_tokens
from core.model.ledger import Ledger
from core.model.result import EngineCounters
from core.model.sample import Group
from core.model.timeline import Timeline
from core.pipeline.wiring import Workers, connect_rollout, end_rollout, make_ledger, make_queue, producer_in_flight
from core.real.reward import EngineReward, ServeReward, TaskPrompts, TaskReward, make_task
from core.runtimes.agent import make_agent
from core.runtimes.ray_actor import ActorIdentity, died, ray_module, timed
from core.runtimes.ray_checkpoint import load_rollout_side, save_rollout_side
from core.runtimes.ray_engine_host import EngineProxy
from core.runtimes.run_checkpoint import checkpoint_dir, header
from core.runtimes.run_state import ROLLOUT_GROUPS, RolloutSide, shifted_records, shifted_spans
from core.runtimes.supervision import strike
from core.store.checkpoint import Snapshot

log = logging.getLogger(__name__)


class RolloutHost(ActorIdentity):
    """The Rollouter, its queue and the producer half of the ledger, in one actor: the queue
    lives with its producer, so a finished group costs no hop before it is queued."""

    def __init__(self, plan: RunPlan, run_dir: str) -> None:
        self.plan, self.sc, self.mode, self.run_dir = plan, plan.scenario, plan.mode, run_dir
        self.trainer: Any = None  # the trainer actor, once it is up (``weights_from``)
        self._get: Optional[asyncio.Task] = None
        self.zero = 0.0  # this clock at run time 0 (checkpoints hold run times)
        self.agents = False  # agent episodes: their tokens are held here (connect)
        # The driver's faults (it kills the trainer): which fired, and its records, for the checkpoint.
        self.driver_fired: list[int] = []
        self.driver_records: list[dict] = []

    def connect(self, engines: list[tuple[str, Any, float, int]], reward_handle: Any) -> None:
        """Wire the producer side to the engine actors (name, handle, clock offset to ours, pid).

        Tokens go from the engine actors to the trainer by reference, owned by this actor
        (they outlive an engine's death, and go when this actor drops the group): this actor
        handles counts, versions, times and rewards only. Rewards are scored where the tokens
        are: in the engine actor, or by the Serve deployment from the reference."""
        sc = self.sc
        task = make_task(sc)  # the tokenizer: this actor is on the driver's node, which sees the model
        # Agent episodes run here, tools and all: a tool's record outlives an engine's death.
        # Their tokens come here with each turn, and they are scored here once they end.
        agent = make_agent(self.plan, task, self.run_dir)
        self.agents = agent is not None
        proxies = [EngineProxy(name, h, off, pid, tokens_here=self.agents) for name, h, off, pid in engines]
        if reward_handle is not None:
            reward = ServeReward(reward_handle, sc.timeouts.control_s)
        else:
            reward = TaskReward(task) if self.agents else EngineReward()
        workers = Workers(proxies, backend=None, transfer=None, prompts=TaskPrompts(task), reward=reward, agent=agent)
        self.ledger = make_ledger(self.plan)
        self.queue = make_queue(self.plan, self.run_dir)
        self.faults = FaultLog()
        self.rollouter = connect_rollout(self.plan, workers, self.ledger, self.queue, self.faults, catch_up=self._catch_up)
        self.side = RolloutSide(self.rollouter, self.queue, self.ledger)
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
        sc, z = self.sc, self.zero
        engines = await asyncio.gather(*(timed(e.handle.counters.remote(), sc.timeouts.control_s, e.name, "counters") for e in self.engines))
        for e, sup, st in zip(self.engines, self.rollouter.engines, engines):
            st["spans"] = shifted_spans(st["spans"], -e.offset - z)  # engine clock -> this one -> run time
            st["restarts"] = sup.restarts
        snap = Snapshot(state={
            **header(sc, self.mode, {"version": version, "t0": t0, "t1": t1}, side="rollout"),
            **self.side.state(asyncio.get_running_loop().time(), z),
            "engines": engines,
            "faults": {
                "fired": sorted(set(self.driver_fired)), "driver": self.driver_records,
                "records": shifted_records(self.faults.state(), -z),
            },
        })
        for slot, groups in self.side.groups().items():
            snap.groups[slot] = await asyncio.gather(*(self._with_tokens(g) for g in groups))
        return snap

    async def _with_tokens(self, g: Group) -> Group:
        """A copy of ``g`` holding its tokens (resolved from their reference), in run time."""
        c = g.without_tokens()
        if g.payload is not None:
            attach_tokens(c, await g.payload)
        else:  # an agent's episode holds its tokens here
            c.take_generation(g)
        c.shift_times(-self.zero)
        return c

    async def restore_run(self, path: str) -> None:
        """A resumed run: back to the rollout side of checkpoint ``path``, paused inside the
        sync it was taken in (the trainer finishes it). Groups' tokens go into this run's
        object store, owned here, as the engines' would be."""
        snap = await asyncio.to_thread(load_rollout_side, path)
        st, z, ray = snap.state, self.zero, ray_module()

        def live(g: Group) -> Group:
            g.shift_times(z)
            if self.agents:  # episodes keep their tokens here
                return g
            m = g.without_tokens()
            m.payload = ray.put(encode_tokens(g))
            return m

        groups = {slot: [live(g) for g in snap.groups[slot]] for slot in ROLLOUT_GROUPS}
        # This run's engines are new processes: none holds an interrupted group's prefix.
        self.side.restore(st, groups, z, paused=True, new_engines=True)
        f = st["faults"]
        self.faults.records[:] = FaultLog.from_state(shifted_records(f["records"], z)).records
        self.driver_fired, self.driver_records = list(f["fired"]), list(f["driver"])
        if len(st["engines"]) != len(self.engines):
            raise ValueError(f"{path}: {len(st['engines'])} engine states for {len(self.engines)} engines")
        calls = []
        for e, sup, es in zip(self.engines, self.rollouter.engines, st["engines"]):
            sup.restarts = es["restarts"]
            es = {**es, "spans": shifted_spans(es["spans"], z + e.offset)}
            calls.append(timed(e.handle.restore_counters.remote(es), self.sc.timeouts.control_s, e.name, "restore_counters"))
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
        """The trainer actor, which ``_catch_up`` asks for weights."""
        self.trainer = trainer

    async def _catch_up(self, version: int) -> Optional[list]:
        """An engine back from a restart cannot join a broadcast alone: it loads a copy of the
        trainer's weights through the object store, or, with none to be had (the trainer being
        restarted, or behind, or not up yet), rejoins at the next sync."""
        if self.trainer is None:
            return None
        try:
            return await timed(self.trainer.catch_up.remote(version), self.sc.timeouts.control_s, "trainer", "catch_up")
        except (*died(), CallTimeout) as exc:
            log.warning("no copy of the weights for a restarted engine (%s); it rejoins at the next sync", exc)
            return None

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

    async def halt(self) -> None:
        """The run was stopped (``stop_at_step``): generation ends, tool calls under way are
        recorded; nothing else is accounted for (the resumed run goes back to a checkpoint)."""
        await self.rollouter.stop()

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
            "agent": self.rollouter.agent.state() if self.rollouter.agent is not None else None,
        }


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


class QueueProxy:
    """The trainer's batch source: the queue in the rollout actor. ``get_batch`` waits as long
    as producing a batch takes, so it has no timeout of its own: the engines' timeouts bound
    how long the producer can stall."""

    def __init__(self, handle: Any, offset: float) -> None:
        self.handle = handle
        self.offset = offset  # rollout actor clock minus the trainer's

    async def get_batch(self, n: int) -> Batch:
        """The groups' metadata from the rollout actor, their tokens from where the engines put
        them (by reference, mapped without a copy), or, for agent episodes, with them."""
        groups = await self.handle.get_batch.remote(n)
        by_ref = [g for g in groups if g.payload is not None]  # an agent's episode brings its tokens along
        tokens = await asyncio.gather(*(g.payload for g in by_ref))
        for g, buf in zip(by_ref, tokens):
            attach_tokens(g, buf)
            g.payload = None  # the tokens are here now
        for g in groups:
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
        await timed(self.handle.pause.remote(mode), self.generate_s + self.control_s, "rollouter", "pause")

    async def update_weights(self, version: int, weights: Any) -> None:
        await timed(self.handle.update_weights.remote(version, weights), self.control_s, "rollouter", "update_weights")

    async def resume(self) -> None:
        await timed(self.handle.resume.remote(), self.control_s, "rollouter", "resume")
