"""Where the Rollouter sends work: resumed groups back to the engine that holds their prefix,
and aborts to every engine at once."""

import asyncio

from core.api import CollectiveTicket, CollectiveTransfer, Engine
from core.model.config import Scenario, with_changes
from core.model.faults import CollectiveBroken, WorkerLost
from core.pipeline.param_sync import ParamSync
from core.pipeline.rollouter import Rollouter
from core.runtimes.dispatch import run_mode
from core.sim import virtual_clock
from harness.metrics import collect
from tests.test_faults import rollouter as fault_test_rollouter


class Slow(Engine):
    """A remote-like engine on the virtual clock: prompt 0 takes 2 s, the others 10 s, one
    token a second; abort_all ends the generations under way, their tokens kept."""

    def __init__(self, name: str, restart_s: float = 0.0) -> None:
        self.name, self.restart_s = name, restart_s
        self.version = 0
        self.streams: list[asyncio.Future] = []
        self.prompts: list[int] = []  # prompt ids of the groups it was given, in order

    async def generate(self, group, max_response_len, stop_ids=frozenset()):
        self.prompts.append(group.prompt_id)
        loop = asyncio.get_running_loop()
        stream = loop.create_future()
        self.streams.append(stream)
        loop.call_later(2.0 if group.prompt_id == 0 else 10.0, lambda: stream.done() or stream.set_result(True))
        t0 = loop.time()
        try:
            completed = await stream
        finally:
            self.streams.remove(stream)
            for s in group.unfinished():
                s.add_tokens(int(loop.time() - t0), self.version)
        if completed:
            for s in group.samples:
                s.finished, s.finished_at = True, loop.time()
        return completed

    async def abort_all(self):
        n = len(self.streams)
        for s in list(self.streams):
            s.set_result(False)
        return n

    async def update_weights(self, version, weights):
        self.version = version

    async def clear_cache(self):
        pass

    async def recover(self):
        await asyncio.sleep(self.restart_s)


def rollouter(engines, **kw) -> Rollouter:
    """test_faults' Rollouter, wide enough for a group on each of three engines."""
    return fault_test_rollouter(engines, **{"max_concurrency": 6, "window": 6, "plan_samples": 6, **kw})


def _interrupt_and_resume(engines, between=None):
    """Three groups on three engines; prompt 0 finishes, 1 and 2 are interrupted at 4 s and
    resumed (``between``: what happens to the Rollouter while paused)."""

    async def main():
        ro = rollouter(engines)
        run = asyncio.create_task(ro.run())
        await asyncio.sleep(4.0)
        await ro.pause("abort")
        assert [g.prompt_id for g in ro.cancel_queue] == [1, 2]
        if between is not None:
            between(ro)
        await ro.update_weights(1)
        await ro.resume()
        groups = await ro.queue.get_batch(3)
        await ro.stop()
        await run
        return ro, groups

    return virtual_clock.run(main())


def test_a_resumed_group_goes_back_to_the_engine_that_holds_its_prefix():
    engines = [Slow(f"e{i}") for i in range(3)]
    ro, groups = _interrupt_and_resume(engines)
    # Least-loaded routing would have sent 1 to e0 and 2 to e1 (all idle, lowest index first).
    assert [e.prompts for e in engines] == [[0], [1, 1], [2, 2]]
    assert ro.sticky_resumes == [0, 1, 1] and ro.moved_resumes == [0, 0, 0]
    assert sorted(g.prompt_id for g in groups) == [0, 1, 2]
    assert all(s.version_spans == [[0, 4], [1, 10]] for g in groups if g.prompt_id for s in g.samples)


def test_a_resumed_group_whose_engine_is_down_goes_to_the_least_loaded_one():
    engines = [Slow("e0"), Slow("e1", restart_s=1000.0), Slow("e2")]
    ro, groups = _interrupt_and_resume(engines, lambda ro: ro.worker_lost(1, WorkerLost("e1", "process", "killed")))
    assert [e.prompts for e in engines] == [[0, 1], [1], [2, 2]]
    assert ro.sticky_resumes == [0, 0, 1] and ro.moved_resumes == [1, 0, 0]
    assert sorted(g.prompt_id for g in groups) == [0, 1, 2]


def test_an_engine_restarted_since_holds_nothing_of_its_groups():
    engines = [Slow("e0"), Slow("e1", restart_s=0.5), Slow("e2")]

    async def main():
        ro = rollouter(engines)
        run = asyncio.create_task(ro.run())
        await asyncio.sleep(4.0)
        await ro.pause("abort")
        ro.worker_lost(1, WorkerLost("e1", "process", "killed"))
        await asyncio.sleep(1.0)  # back, with an empty cache
        assert not ro.recovering()
        await ro.update_weights(1)
        await ro.resume()
        await ro.queue.get_batch(3)
        await ro.stop()
        await run
        return ro

    ro = virtual_clock.run(main())
    assert ro.sticky_resumes == [0, 0, 1] and sum(ro.moved_resumes) == 1


class Barrier(Slow):
    """abort_all answers only once every engine's abort_all has been called: engines
    aborted one after the other never get past the first."""

    def __init__(self, name: str, called: list, everyone: int) -> None:
        super().__init__(name)
        self.called, self.everyone = called, everyone

    async def abort_all(self):
        self.called.append(self.name)
        while len(self.called) < self.everyone:
            await asyncio.sleep(0.001)
        return await super().abort_all()


class Now(Slow):
    """An engine whose control calls return without waiting (as a simulated one's do)."""

    def __init__(self, name: str, tasks: list) -> None:
        super().__init__(name)
        self.tasks = tasks

    def answers_now(self) -> bool:
        return True

    async def abort_all(self):
        self.tasks.append(asyncio.current_task())
        return len(self.streams)


def test_aborts_reach_every_engine_at_once():
    called: list = []
    engines = [Barrier(f"e{i}", called, 3) for i in range(3)]

    async def main():
        ro = rollouter(engines)
        run = asyncio.create_task(ro.run())
        await asyncio.sleep(4.0)
        t0 = asyncio.get_running_loop().time()
        await ro.pause("abort")
        t1 = asyncio.get_running_loop().time()
        await ro.stop()
        await run
        return ro, t1 - t0

    ro, waited = virtual_clock.run(main())
    # Sequential aborts would have timed out on the first (control_s = 30 s) and lost it.
    assert waited < 1.0 and not ro._down
    assert sorted(called[:3]) == ["e0", "e1", "e2"]
    assert [g.prompt_id for g in ro.cancel_queue] == [] and ro.sticky_resumes == [0, 0, 0]


def test_engines_that_answer_now_abort_in_the_callers_step_the_others_concurrently():
    called: list = []
    tasks: list = []
    engines = [Now("now0", tasks), Barrier("r1", called, 2), Now("now2", tasks), Barrier("r3", called, 2)]

    async def main():
        ro = rollouter(engines)
        me = asyncio.current_task()
        await ro._each_up("abort_all")
        return me

    me = virtual_clock.run(main())
    assert tasks == [me, me]  # not a task each: no completion due now can slip in between
    assert sorted(called) == ["r1", "r3"]


_SIM = {
    "resources.rollout_gpus": 4, "resources.trainer_gpus": 4, "trainer.batch_size": 64, "trainer.steps": 4,
    "trainer.sync_every": 1, "workload.max_response_len": 4096, "staleness.max_staleness": 4,
}


def test_the_sim_resumes_interrupted_groups_where_their_prefix_is():
    m = collect(run_mode(with_changes(Scenario(), _SIM), "partial"))
    assert m["partial/resumes"] > 0 and m["rollout/sticky_resumes"] == m["partial/resumes"]
    assert m["rollout/moved_resumes"] == 0 and m["samples/lost"] == 0


def test_the_sim_moves_the_groups_of_a_worker_lost_during_a_sync():
    # Worker 1 hangs loading the weights: its timeout restarts it, empty, under its interrupted groups.
    hang = {"kind": "hang", "target": "rollout_worker", "worker": 1, "call": "update_weights", "at_step": 1}
    m = collect(run_mode(with_changes(Scenario(), {**_SIM, "faults": [hang]}), "partial"))
    assert m["rollout/moved_resumes"] > 0 and m["rollout/sticky_resumes"] > 0
    assert m["rollout/sticky_resumes"] + m["rollout/moved_resumes"] == m["partial/resumes"]
    assert m["samples/lost"] == 0


class Ticket(CollectiveTicket):
    """Collective weights, as a broadcast ticket is to the Rollouter: every receiver named first."""

    def __init__(self, members=(), regroup=False) -> None:
        self.members, self.regroup = members, regroup

    def addressed(self, members, regroup):
        return Ticket(tuple(members), regroup)


class Loads(Slow):
    """Records what each update_weights was given."""

    def __init__(self, name: str, restart_s: float = 0.0) -> None:
        super().__init__(name, restart_s)
        self.loads: list = []

    async def update_weights(self, version, weights):
        self.loads.append((version, weights))
        self.version = version


def _kill_between_syncs(catch_up):
    """Two engines; e1 is killed after the sync to version 1 and back at once; then a sync to 2."""
    engines = [Loads("e0"), Loads("e1", restart_s=0.5)]

    async def main():
        ro = rollouter(engines)
        ro.catch_up = catch_up
        run = asyncio.create_task(ro.run())
        await ro.pause("abort")
        await ro.update_weights(1, Ticket())
        await ro.resume()
        ro.worker_lost(1, WorkerLost("e1", "process", "killed"))
        await asyncio.sleep(1.0)
        back = 1 not in ro._down
        await ro.pause("abort")
        await ro.update_weights(2, Ticket())
        await ro.resume()
        await ro.stop()
        await run
        return back

    return engines, virtual_clock.run(main())


def test_an_engine_back_from_a_restart_loads_a_copy_and_the_next_broadcast_regroups():
    asked = []

    async def catch_up(version):
        asked.append(version)
        return ["copy"]

    (e0, e1), back = _kill_between_syncs(catch_up)
    assert back and asked == [1]  # routed to again before any sync: it loaded the copy alone
    assert e1.loads[1] == (1, ["copy"])
    # The sync after names both, and forms a new group: e1 is a new process.
    last = e1.loads[-1][1]
    assert e1.loads[-1][0] == 2 and last.members == ("e0", "e1") and last.regroup
    assert e0.loads[-1][1].regroup and not e0.loads[0][1].regroup


def test_an_engine_with_no_copy_to_load_rejoins_at_the_next_broadcast():
    async def none(version):
        return None

    (e0, e1), back = _kill_between_syncs(none)
    assert not back  # out of routing until the next sync
    assert [v for v, _ in e1.loads] == [1, 2] and e1.loads[-1][1].members == ("e0", "e1") and e1.loads[-1][1].regroup


def test_a_sync_the_only_engine_missed_while_restarting_leaves_the_next_to_form_a_new_group():
    """The engine's restart spans a sync that nobody takes part in: the trainer keeps the group
    it had with the dead process, so the sync after must form a new one, not reuse that."""
    engine = Loads("e0", restart_s=3.0)

    async def catch_up(version):
        return ["copy"]

    async def main():
        ro = rollouter([engine])
        ro.catch_up = catch_up
        run = asyncio.create_task(ro.run())
        for version in (1, 2, 3):
            if version == 2:
                ro.worker_lost(0, WorkerLost("e0", "process", "killed"))
                await asyncio.sleep(0.5)  # still coming back: the sync to 2 has no member
            await ro.pause("abort")
            await ro.update_weights(version, Ticket())
            await ro.resume()
            if version == 2:
                await asyncio.sleep(5.0)  # back, with a copy of version 2
                assert 0 not in ro._down
        await ro.stop()
        await run

    virtual_clock.run(main())
    assert [v for v, _ in engine.loads] == [1, 2, 3] and engine.loads[1][1] == ["copy"]
    last = engine.loads[-1][1]
    assert last.members == ("e0",) and last.regroup


class Broken(Slow):
    async def generate(self, group, max_response_len, stop_ids=frozenset()):
        raise ValueError("not a lost worker: a bug")


def test_an_error_a_generation_did_not_expect_fails_the_run_instead_of_stalling_it():
    async def main():
        ro = rollouter([Broken("e0")])
        try:
            await asyncio.wait_for(ro.run(), 60.0)
        except ValueError as exc:
            return str(exc)

    assert virtual_clock.run(main()) == "not a lost worker: a bug"


class BreaksOnce(CollectiveTransfer):
    """A collective transfer whose first send breaks (a member died mid-way)."""

    def __init__(self) -> None:
        self.sends = 0

    def ticket(self, version):
        return Ticket()

    async def send(self, ticket, receiving):
        self.sends += 1
        await asyncio.sleep(0.1)
        if self.sends == 1:
            raise CollectiveBroken("trainer", "Connection closed by peer")


def test_a_broken_broadcast_is_sent_again():
    engines = [Loads("e0"), Loads("e1")]
    transfer = BreaksOnce()

    async def main():
        ro = rollouter(engines)
        run = asyncio.create_task(ro.run())
        sync = ParamSync(rollouter=ro, transfer=transfer, mode="abort")
        await sync.sync(1)
        await ro.stop()
        await run
        return sync

    sync = virtual_clock.run(main())
    assert transfer.sends == 2 and len(sync.transfer_s) == 1
    assert [len(e.loads) for e in engines] == [2, 2]  # the source dropped its group: the second try forms one
