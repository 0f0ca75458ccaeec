"""Faults, recovery and whole-run checkpoints on the sim runtime.

1. Every fault kind, in every mode, over many seeds (fault times, steps and workers drawn
   per seed): the run completes, no sample is lost or trained twice, nothing is staler than
   the bound, every token is at least as new as its group's version and no newer than the
   version that trains it, and every injected fault is recovered.
2. A run stopped after step k and resumed from its checkpoint ends exactly as the run that
   never stopped: metrics, series and timeline.
3. The parts: the queue's journal, the durable queue's crash and recovery, the checkpoint
   file (round trip, atomic save, errors naming the byte), timeouts and restarts, and the
   Rollouter's handling of an engine that cancels its own stream on abort.
4. Every bad fault configuration names its dotted key.
"""

from __future__ import annotations

import asyncio
import os
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from core.sim import virtual_clock
from core.store import checkpoint
from core.store.checkpoint import CheckpointError, Snapshot
from core.model.config import MODES, ConfigError, Scenario, with_changes
from core.runtimes.dispatch import run_mode
from core.api import Engine, RunStopped
from core.sim.costs import DecodeCost
from core.sim.engine import SimEngine
from core.sim.workload import Workload
from core.model.faults import CallTimeout, RestartsExhausted, WorkerLost
from core.pipeline.supervised_engine import SupervisedEngine
from core.model.group_wire import to_record
from core.model.run_plan import RunPlan
from core.model.ledger import Ledger
from harness.metrics import WALL_CLOCK_KEYS, collect, series
from core.store.queue_journal import FRAME, QueueJournal
from core.pipeline.rollouter import Rollouter
from core.model.sample import Group, Sample
from core.pipeline.staleness_queue import AsyncStalenessQueue
from ext import codec
from harness.scenario import ScenarioError, load

QUICKSTART = Path(__file__).resolve().parent.parent / "scenarios" / "quickstart.yaml"
STEPS, SYNC_EVERY = 24, 4
FINAL_VERSION = (STEPS - 1) // SYNC_EVERY
# quickstart, smaller: 24 steps of 8 groups, responses capped at 8K tokens (a group generates
# in at most ~150 s, a run lasts 600-800 s). Timeouts and restarts short enough that a hang
# resolves and a restart ends well inside the run.
SMALL = [
    f"trainer.steps={STEPS}",
    f"trainer.sync_every={SYNC_EVERY}",
    "trainer.batch_size=128",
    "workload.max_response_len=8192",
    "checkpoint.every=1",
    "timeouts.generate_s=400",
    "timeouts.control_s=30",
    "recovery.engine_restart_s=20",
    "recovery.trainer_restart_s=30",
    "recovery.queue_restart_s=5",
]
WORKERS = 4  # rollout engines in async and partial (sync has 16); faults pick among these
SEEDS = 8
SEEDS_ALL = 12

_BASE: list[Scenario] = []


def base() -> Scenario:
    if not _BASE:
        _BASE.append(load(QUICKSTART, SMALL))
    return _BASE[0]


@pytest.fixture
def no_fsync(monkeypatch):
    """The many runs here write a checkpoint at every sync; what reaches the disk platter is
    not under test (the atomicity tests below keep the real fsync)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


# -- 1. every fault kind, every mode, many seeds -------------------------------------------------
def _when(rng: random.Random, last_step: int, last_s: float) -> dict:
    if rng.random() < 0.5:
        return {"at_step": rng.randint(1, last_step)}
    return {"at_s": round(rng.uniform(5.0, last_s), 3)}


def _worker(rng: random.Random) -> int:
    return rng.randrange(WORKERS)


# Each draws one fault that can act and be recovered before the run ends: a kill up to two
# steps before the end (the restart takes 20 s), a slowdown that ends inside the run, a hang
# on a call that comes again (update_weights and abort_all: a sync is still ahead).
FAULTS = {
    "kill_worker_at_s": lambda rng: {"kind": "kill", "worker": _worker(rng), "at_s": round(rng.uniform(5.0, 450.0), 3)},
    "kill_worker_at_step": lambda rng: {"kind": "kill", "worker": _worker(rng), "at_step": rng.randint(1, STEPS - 2)},
    "kill_queue": lambda rng: {"kind": "kill", "target": "queue", **_when(rng, STEPS - 2, 450.0)},
    "kill_trainer": lambda rng: {"kind": "kill", "target": "trainer", **_when(rng, STEPS - 2, 450.0)},
    "slow": lambda rng: {
        "kind": "slow", "worker": _worker(rng), "factor": round(rng.uniform(1.5, 3.0), 2),
        "duration_s": round(rng.uniform(20.0, 150.0), 1), **_when(rng, STEPS // 2, 300.0),
    },
    "hang_generate": lambda rng: {"kind": "hang", "call": "generate", "worker": _worker(rng), **_when(rng, STEPS // 2, 300.0)},
    "hang_update_weights": lambda rng: {
        "kind": "hang", "call": "update_weights", "worker": _worker(rng), **_when(rng, STEPS - SYNC_EVERY - 4, 300.0),
    },
    # Only partial mode aborts at a sync; sync and async call abort_all only at the end of the run.
    "hang_abort_all": lambda rng: {
        "kind": "hang", "call": "abort_all", "worker": _worker(rng), **_when(rng, STEPS - SYNC_EVERY - 4, 300.0),
    },
}
CASES = [(kind, mode) for kind in FAULTS for mode in MODES if kind != "hang_abort_all" or mode == "partial"]
CASES += [("all", mode) for mode in MODES]


def draw_faults(kind: str, mode: str, rng: random.Random) -> list[dict]:
    if kind != "all":
        return [FAULTS[kind](rng)]
    return [gen(rng) for k, gen in FAULTS.items() if k != "hang_abort_all" or mode == "partial"]


@pytest.fixture
def watch(monkeypatch):
    """Counts the requests each worker death loses, and every trained token whose version is
    older than its group's (the version staleness is measured from) or newer than the trainer's."""
    seen = {"lost_requests": 0, "bad_tokens": []}
    crash, trained = SimEngine.crash, Ledger.trained_groups

    def counting_crash(self, restart_s):
        n = crash(self, restart_s)
        seen["lost_requests"] += n
        return n

    def checking_trained(self, groups, version, now):
        for g in groups:
            for s in g.samples:
                for v, _ in s.version_spans:
                    if not g.version <= v <= version:
                        seen["bad_tokens"].append((g.prompt_id, g.version, v, version))
        return trained(self, groups, version, now)

    monkeypatch.setattr(SimEngine, "crash", counting_crash)
    monkeypatch.setattr(Ledger, "trained_groups", checking_trained)
    return seen


def check_run(result, faults: list[dict]) -> dict:
    """Everything a run with faults must still get right; returns its metrics."""
    m = collect(result)
    led = result.ledger
    assert result.trainer.step == result.scenario.trainer.steps == STEPS
    assert result.trainer.version == FINAL_VERSION
    assert m["trainer/final_version"] == FINAL_VERSION
    assert m["samples/lost"] == 0
    assert led.produced == led.trained + led.dropped_total + result.in_flight
    assert result.in_flight == 0
    # Trained at most once: the ledger raises on a second training; its mask agrees with its count.
    assert sum(led._trained_mask) == led.trained == led.trainings
    assert led.trained == STEPS * result.scenario.groups_per_step * result.scenario.workload.group_size
    assert m["staleness/max"] <= m["staleness/bound"]
    assert m["faults/injected"] == len(faults)
    assert m["faults/recovered"] == m["faults/injected"], result.faults.records
    assert all(r.recovered_s is not None and r.recovered_s >= r.at_s for r in result.faults.records)
    assert m["samples/requeued"] == led.requeued
    # A worker no fault killed or hung is never restarted (no call timed out by mistake), and
    # each kill or hang costs at most one restart.
    hits = [0] * len(result.engines)
    for f in faults:
        if f.get("target", "rollout_worker") == "rollout_worker" and f["kind"] in ("kill", "hang"):
            hits[f["worker"]] += 1
    for i, e in enumerate(result.engines):
        assert e.restarts <= hits[i], (e.name, e.restarts, faults)
        if any(f["kind"] == "kill" and f.get("target", "rollout_worker") == "rollout_worker" and f["worker"] == i for f in faults):
            assert e.restarts >= 1
    return m


@pytest.mark.parametrize("kind, mode", CASES)
def test_every_fault_is_recovered_and_nothing_is_lost(kind, mode, no_fsync, watch, tmp_path):
    n = SEEDS_ALL if kind == "all" else SEEDS
    requeued, lost_requests = [], []
    for seed in range(n):
        rng = random.Random(f"{kind}/{mode}/{seed}")
        faults = draw_faults(kind, mode, rng)
        # Every kill and hang restarts a worker; "all" may aim them all at one.
        sc = with_changes(base(), {"seed": seed, "faults": faults, "recovery.max_restarts": 6})
        before = watch["lost_requests"]
        system = run_mode(sc, mode, run_dir=tmp_path / f"{seed}")
        where = f"seed {seed}: {faults}"
        try:
            check_run(system, faults)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        assert not watch["bad_tokens"], f"{where}: tokens outside [group version, trained version]: {watch['bad_tokens'][:3]}"
        lost = watch["lost_requests"] - before
        # What a dead worker held is generated again: the groups of its requests were requeued.
        assert system.ledger.requeued >= lost, where
        requeued.append(system.ledger.requeued)
        lost_requests.append(lost)
    if (kind, mode) == ("kill_worker_at_step", "sync"):
        # Colocated: after a step every GPU trains, no worker generates; a kill there loses nothing.
        assert not any(lost_requests) and not any(requeued)
    elif kind.startswith("kill_worker") or kind == "all":
        assert any(lost_requests), "no worker died with work in flight: the seeds test nothing"
        assert any(requeued)
    if kind in ("kill_queue", "kill_trainer", "slow"):
        assert not any(requeued)


def test_a_worker_killed_idle_after_the_last_admission_is_restarted(no_fsync, tmp_path):
    # Sync mode admits its last window at the last sync; a worker killed after it gets no
    # call, yet its supervisor sees it die and restarts it.
    faults = [{"kind": "kill", "worker": 2, "at_step": STEPS - 2}]
    system = run_mode(with_changes(base(), {"faults": faults}), "sync", run_dir=tmp_path)
    m = check_run(system, faults)
    assert m["faults/recovered"] == 1 and m["samples/requeued"] == 0


def test_a_kill_and_a_hang_of_one_worker_cost_it_one_restart(no_fsync, tmp_path):
    # The hung generate fails with the worker (no wait for the timeout), and one restart
    # recovers both faults.
    faults = [
        {"kind": "hang", "call": "generate", "worker": 1, "at_s": 10.0},
        {"kind": "kill", "worker": 1, "at_s": 100.0},
    ]
    system = run_mode(with_changes(base(), {"faults": faults}), "async", run_dir=tmp_path)
    check_run(system, faults)
    assert system.engines[1].restarts == 1
    hang, kill = system.faults.records
    assert hang.recovered_s == kill.recovered_s == pytest.approx(100.0 + 20.0)


def _past_validation(faults: list[dict], max_restarts: int) -> Scenario:
    """A scenario whose faults kill one component more often than it may restart: validation
    refuses it (tests/corpus/scenarios/kills_past_max_restarts.yaml), so it is built around
    validation here to reach the guard a run keeps for deaths no scenario foretells (timeouts)."""
    sc = with_changes(base(), {"faults": faults, "recovery.max_restarts": len(faults)})
    return sc.model_copy(update={"recovery": sc.recovery.model_copy(update={"max_restarts": max_restarts})})


def test_max_restarts_exhausted_fails_the_run(no_fsync, tmp_path):
    sc = _past_validation([{"kind": "kill", "worker": 0, "at_step": s} for s in (2, 6)], 1)
    with pytest.raises(RestartsExhausted, match=r"engine000: lost 2 times, more than recovery\.max_restarts = 1"):
        run_mode(sc, "async", run_dir=tmp_path / "w")
    sc = _past_validation([{"kind": "kill", "target": "trainer", "at_step": s} for s in (2, 6)], 1)
    with pytest.raises(RestartsExhausted, match=r"trainer: killed 2 times, more than recovery\.max_restarts = 1"):
        run_mode(sc, "partial", run_dir=tmp_path / "t")


def test_a_trainer_behind_the_engines_never_moves_versions_back(no_fsync, watch, tmp_path):
    # A checkpoint every 3 versions: a trainer killed two syncs after one goes back two
    # versions while the engines keep the newer weights; it catches up without error.
    faults = [{"kind": "kill", "target": "trainer", "at_step": 21}]
    sc = with_changes(base(), {"faults": faults, "checkpoint.every": 3})
    for mode in MODES:
        check_run(run_mode(sc, mode, run_dir=tmp_path / mode), faults)
    assert not watch["bad_tokens"]


# -- 2. resume equivalence ---------------------------------------------------------------------
def outcome(system) -> tuple:
    m = {k: v for k, v in collect(system).items() if k not in WALL_CLOCK_KEYS}
    return m, series(system), {w: rows for w, rows in system.timeline.spans.items()}


def assert_same_outcome(a: tuple, b: tuple, where: str) -> None:
    for x, y, what in zip(a, b, ("metrics", "series", "timeline")):
        differ = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        assert not differ, f"{where}: {what} differ at {differ[:8]}"


def stop_and_resume(sc: Scenario, mode: str, run_dir: Path, k: int):
    with pytest.raises(RunStopped, match=f"after step {k}"):
        run_mode(sc, mode, run_dir=run_dir, stop_at_step=k)
    assert checkpoint.latest(run_dir / mode / "checkpoints") is not None
    return run_mode(sc, mode, run_dir=run_dir, resume=True)


SLOW = {"kind": "slow", "worker": 1, "at_s": 60.0, "duration_s": 200.0, "factor": 2.5}
RESUME_FAULTS = [
    # A slowdown under way across checkpoints, a worker killed, the queue killed, a hang, the
    # trainer killed: a resumed run replays what is left of each, as the original did.
    SLOW,
    {"kind": "kill", "worker": 0, "at_s": 80.0},
    {"kind": "kill", "target": "queue", "at_step": 5},
    {"kind": "hang", "call": "generate", "worker": 2, "at_s": 30.0},
    {"kind": "hang", "call": "update_weights", "worker": 3, "at_step": 10},
    {"kind": "kill", "target": "trainer", "at_step": 13},
]
# Agent episodes (2 to 5 turns, tools of ~3 s, KV held while they run), a worker killed mid-run:
# episodes stopped at their turn boundaries, contexts kept in engines, resumed as they were.
AGENT = {"min_turns": 2, "max_turns": 5, "tool_delay_s": {"median": 3.0, "sigma": 0.8, "high": 20.0},
         "observation_tokens": {"median": 100, "sigma": 0.5, "low": 1}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "every, faults, stops, more",
    [
        (1, [], lambda rng: sorted(rng.sample(range(1, STEPS), 3)), {}),
        (2, [], lambda rng: sorted(rng.sample(range(1, STEPS), 2)), {}),
        # Stopped while the slowdown is under way (60-260 s; the checkpoint of step 4 is at
        # 120-145 s): the resumed run must still end it on time.
        (1, [SLOW], lambda rng: [rng.randrange(5, 8)], {}),
        (1, RESUME_FAULTS, lambda rng: [rng.randrange(4, 12), rng.randrange(12, STEPS)], {}),
        (1, [{"kind": "kill", "worker": 0, "at_s": 80.0}], lambda rng: sorted(rng.sample(range(1, STEPS), 2)), {"agent": AGENT}),
        # Dynamic sampling (its pass rate counted in admission) and an over-provisioned surplus.
        (1, [], lambda rng: sorted(rng.sample(range(1, STEPS), 2)), {"filter": {"min_pass_rate": 0.5}, "rollout.overprovision": 1.5}),
    ],
    ids=["every1", "every2", "slowdown", "faults", "agent", "filter"],
)
def test_a_resumed_run_ends_as_the_run_that_never_stopped(mode, every, faults, stops, more, no_fsync, tmp_path):
    changes = {"checkpoint.every": every, "faults": faults, **more}
    sc = with_changes(base(), changes)
    full = outcome(run_mode(sc, mode, run_dir=tmp_path / "full"))
    rng = random.Random(f"resume/{mode}/{every}/{len(faults)}")
    for k in stops(rng):
        resumed = stop_and_resume(sc, mode, tmp_path / f"stop{k}", k)
        assert resumed.trainer.step == STEPS
        assert_same_outcome(full, outcome(resumed), f"{mode}, checkpoint.every {every}, stopped after step {k}")


def test_resuming_a_finished_or_foreign_run(no_fsync, tmp_path):
    sc = base()
    run_mode(sc, "async", run_dir=tmp_path)
    other = with_changes(sc, {"seed": 1})
    with pytest.raises(CheckpointError, match="not of this run"):
        run_mode(other, "async", run_dir=tmp_path, resume=True)


# -- 3. units ----------------------------------------------------------------------------------
def group(pid: int, version: int = 0, n: int = 2, tokens: int = 3) -> Group:
    samples = [Sample(uid=pid * n + i, prompt_id=pid, index=i, n_prompt=4, admitted_at=1.5) for i in range(n)]
    for s in samples:
        s.add_tokens(tokens, version)
        s.finished = True
        s.finished_at = 2.5
    return Group(prompt_id=pid, samples=samples, version=version, admitted_at=1.5, finished_at=2.5)


def wire(g: Group) -> bytes:
    return codec.encode(to_record(g))


def ids(groups) -> list[int]:
    return [g.prompt_id for g in groups]


COUNTS = {"put": 0, "got": 0, "evicted": 0, "stale_on_put": 0, "rejected_full": 0}


def test_the_journal_replays_puts_takes_removals_acks_and_redeliveries(tmp_path):
    j = QueueJournal(tmp_path / "q.journal")
    gs = [group(i) for i in range(6)]
    for g in gs[:4]:
        j.put(g)
    st = j.replay()
    assert ids(st.queued.values()) == [0, 1, 2, 3] and not st.unacked and not st.redeliver
    j.op("got", gs[:2], 0, {**COUNTS, "put": 4, "got": 2})
    j.op("removed", [gs[3]], 1, {**COUNTS, "put": 4, "got": 2, "evicted": 1})
    st = j.replay()
    assert ids(st.queued.values()) == [2] and ids(st.unacked.values()) == [0, 1]
    assert st.version == 1 and st.counters == {**COUNTS, "put": 4, "got": 2, "evicted": 1}
    j.op("acked", [], 1, {**COUNTS, "put": 4, "got": 2, "evicted": 1})
    j.put(gs[4])
    j.op("got", [gs[2]], 1, {**COUNTS, "put": 5, "got": 3, "evicted": 1})
    st = j.replay()
    assert ids(st.unacked.values()) == [2] and ids(st.queued.values()) == [4]
    j.op("redelivered", [], 1, {**COUNTS, "put": 5, "got": 3, "evicted": 1})
    st = j.replay()
    assert ids(st.redeliver) == [2] and not st.unacked and ids(st.queued.values()) == [4]
    j.op("got", [gs[2], gs[4]], 2, {**COUNTS, "put": 5, "got": 4, "evicted": 1})
    st = j.replay()
    assert not st.redeliver and not st.queued and ids(st.unacked.values()) == [2, 4] and st.version == 2
    # Groups come back whole.
    assert wire(st.unacked[4]) == wire(gs[4])
    # A snapshot (after an acknowledgement) replays to the same contents.
    j.rewrite([gs[5]], [gs[2]], 2, {**COUNTS, "put": 6, "got": 4, "evicted": 1})
    st = j.replay()
    assert ids(st.queued.values()) == [5] and ids(st.redeliver) == [2] and not st.unacked
    assert st.counters["put"] == 6
    j.close()


@pytest.mark.parametrize("cut", [1, 5, FRAME.size, FRAME.size + 7])
def test_a_torn_last_journal_record_is_ignored(tmp_path, cut):
    path = tmp_path / "q.journal"
    j = QueueJournal(path)
    j.put(group(0))
    j.op("got", [group(0)], 0, {**COUNTS, "put": 1, "got": 1})
    j.put(group(1))
    j.close()
    data = path.read_bytes()
    last = len(FRAME.pack(0)) + len(wire(group(1)))
    path.write_bytes(data[: len(data) - last + cut])  # the last put cut short by a crash
    st = QueueJournal(path).replay()
    assert ids(st.unacked.values()) == [0] and not st.queued


def test_a_corrupted_middle_journal_record_raises_checkpoint_error_at_its_offset(tmp_path):
    path = tmp_path / "q.journal"
    j = QueueJournal(path)
    for i in range(3):
        j.put(group(i))
    j.close()
    data = bytearray(path.read_bytes())
    rec = FRAME.size + len(wire(group(0)))
    data[rec + FRAME.size + 40] ^= 0x10  # a bit of the second record's body
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"byte {rec}: journal record unreadable") as exc:
        QueueJournal(path).replay()
    assert exc.value.offset == rec and str(path) in str(exc.value)


def durable_queue(tmp_path, max_staleness: int = 1) -> AsyncStalenessQueue:
    return AsyncStalenessQueue(capacity=32, max_staleness=max_staleness, journal=QueueJournal(tmp_path / "q.journal"))


def test_a_crashed_queue_recovers_its_contents_counters_and_unacked_groups(tmp_path):
    async def main():
        q = durable_queue(tmp_path)
        for i in range(4):
            assert await q.put(group(i, 0), 0)
        q.set_version(1)
        for i in range(4, 7):
            assert await q.put(group(i, 1), 1)
        assert ids(await q.get_batch(2)) == [0, 1]  # delivered, not acknowledged
        before = (ids(q.contents()), q.counters(), ids(q.unacked()), q.version, len(q))
        q.crash()
        assert q.is_down() and len(q) == 0
        evicted = q.recover()
        after = (ids(q.contents()), q.counters(), ids(q.unacked()), q.version, len(q))
        # The trainer restarts: it gets the unacknowledged groups again, first.
        assert q.redeliver() == 2
        return before, evicted, after, ids(await q.get_batch(3))

    before, evicted, after, again = virtual_clock.run(main())
    assert evicted == [] and after == before
    assert before[0] == [2, 3, 4, 5, 6] and before[2] == [0, 1]
    assert again == [0, 1, 2]


def test_a_queue_down_while_the_version_moves_recovers_at_the_new_version(tmp_path):
    async def main():
        q = durable_queue(tmp_path)
        for i, v in enumerate([0, 0, 1, 1]):
            if v > q.version:
                q.set_version(v)
            await q.put(group(i, v), v)
        before = q.counters()
        q.crash()
        assert q.set_version(2) == []  # a sync while it is down: nothing there to evict
        evicted = q.recover()
        return before, ids(evicted), ids(q.contents()), q.counters(), q.version

    before, evicted, left, after, version = virtual_clock.run(main())
    assert version == 2 and evicted == [0, 1] and left == [2, 3]
    assert after == {**before, "evicted": before["evicted"] + 2}


def test_a_consumer_waiting_across_a_queue_crash_gets_what_is_put_after(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        q = durable_queue(tmp_path)
        got = asyncio.create_task(q.get_batch(2))
        await asyncio.sleep(1.0)
        q.crash()
        loop.call_later(5.0, q.recover)  # back with nothing in it

        async def produce():
            for i in range(2):
                await asyncio.sleep(4.0)
                await q.put(group(i), 0)  # the first waits for the queue to be back

        await produce()
        return ids(await asyncio.wait_for(got, 10.0)), loop.time()

    items, t = virtual_clock.run(main())
    assert items == [0, 1] and t == pytest.approx(10.0)  # the first put waited for the queue (5 -> 6 s)


def test_redeliver_gives_the_unacknowledged_groups_first_and_ack_forgets_them(tmp_path):
    async def main():
        q = durable_queue(tmp_path)
        for i in range(5):
            await q.put(group(i), 0)
        first = ids(await q.get_batch(2))
        assert ids(q.unacked()) == [0, 1]
        assert q.redeliver() == 2 and not q.unacked()
        again = ids(await q.get_batch(3))
        q.ack()
        assert not q.unacked() and q.redeliver() == 0
        return first, again, ids(await q.get_batch(2))

    assert virtual_clock.run(main()) == ([0, 1], [0, 1, 2], [3, 4])


def snapshot() -> Snapshot:
    snap = Snapshot(
        state={"step": 7, "nested": {"xs": [1, 2.5, None], "s": "é"}, "inf": float("inf")},
        arrays={"a": np.arange(6, dtype=np.int64).reshape(2, 3), "b": np.linspace(0, 1, 5)},
    )
    pid = 0
    for slot in checkpoint.SLOTS:
        for _ in range(2):
            g = group(pid, version=pid % 3)
            g.aborts = g.resumes = pid % 2
            snap.groups[slot].append(g)
            pid += 1
    return snap


def test_a_checkpoint_round_trips_every_slot():
    snap = snapshot()
    back = checkpoint.decode(checkpoint.encode(snap))
    assert back.state == snap.state
    assert set(back.arrays) == {"a", "b"}
    for k, v in snap.arrays.items():
        np.testing.assert_array_equal(back.arrays[k], v)
        assert back.arrays[k].dtype == v.dtype
    for slot in checkpoint.SLOTS:
        assert [wire(g) for g in back.groups[slot]] == [wire(g) for g in snap.groups[slot]], slot
    assert sum(len(v) for v in back.groups.values()) == 2 * len(checkpoint.SLOTS)


def test_checkpoint_decode_errors_name_the_byte():
    good = checkpoint.encode(snapshot())
    head = checkpoint.HEADER.size

    def error(buf: bytes) -> CheckpointError:
        with pytest.raises(CheckpointError) as exc:
            checkpoint.decode(buf, "ckpt")
        assert str(exc.value).startswith("ckpt:") and "fix:" in str(exc.value)
        if exc.value.offset is not None:
            assert f"byte {exc.value.offset}:" in str(exc.value)
        return exc.value

    e = error(good[:20])
    assert e.offset == 20 and "truncated" in e.problem
    e = error(good[:-9])
    assert e.offset == len(good) - 9 and "truncated" in e.problem
    e = error(b"\x89NOTCKP\n" + good[8:])
    assert e.offset == 0 and "magic" in e.problem
    e = error(good[:8] + struct.pack("<H", 2) + good[10:])
    assert e.offset == 8 and "format version 2" in e.problem
    # A flipped bit inside a record: its checksum fails, the offset is that record's start.
    rec0 = struct.unpack_from("<Q", good, head)[0]
    rec1 = head + FRAME.size + rec0 + FRAME.size
    for at, start in ((head + FRAME.size + 30, head + FRAME.size), (rec1 + 50, rec1)):
        bad = bytearray(good)
        bad[at] ^= 0x04
        e = error(bytes(bad))
        assert e.offset == start, (at, e)
        assert ("record 0" if start < rec1 else "record 1") in e.problem
    # A record length that runs past the end: the offset is its frame.
    bad = bytearray(good)
    struct.pack_into("<Q", bad, head, len(good))
    e = error(bytes(bad))
    assert e.offset == head and "runs past the end" in e.problem


def test_checkpoint_save_keeps_the_newest_and_loads_them_back(tmp_path):
    tens = {"weights": {"w": np.arange(4.0)}, "optimizer": {"m": np.ones(3)}}
    for step in range(1, 6):
        snap = Snapshot(state={"step": step})
        checkpoint.save(tmp_path, step, snap, tens, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000004", "step-000005"]
    latest = checkpoint.latest(tmp_path)
    assert checkpoint.load(latest).state == {"step": 5}
    np.testing.assert_array_equal(checkpoint.load_tensors(latest, "weights")["w"], np.arange(4.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("where", ["state", "tensors", "safetensors", "rename"])
def test_a_checkpoint_save_that_fails_midway_leaves_the_previous_one_intact(tmp_path, monkeypatch, where):
    tens = {"weights": {"w": np.arange(4.0)}}
    checkpoint.save(tmp_path, 1, Snapshot(state={"step": 1}), tens)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-000001").iterdir()}

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if where in ("state", "tensors"):
        calls = []
        replace = os.replace

        def failing_replace(src, dst):
            calls.append(dst)
            if len(calls) == (1 if where == "state" else 2):
                boom()
            return replace(src, dst)

        monkeypatch.setattr(os, "replace", failing_replace)
    elif where == "safetensors":
        import safetensors.numpy

        monkeypatch.setattr(safetensors.numpy, "save", boom)
    else:
        monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(tmp_path, 2, Snapshot(state={"step": 2}), tens)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"], "no partial checkpoint, no temporary left"
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-000001").iterdir()} == before
    assert checkpoint.load(checkpoint.latest(tmp_path)).state == {"step": 1}


class Stuck(Engine):
    """An engine whose every call hangs."""

    name = "engine007"

    async def _hang(self, *args):
        await asyncio.Event().wait()

    generate = abort_all = update_weights = clear_cache = recover = _hang


@pytest.mark.parametrize(
    "call, args, seconds, key",
    [
        ("generate", (None, 16), 40.0, "timeouts.generate_s"),
        ("update_weights", (3, None), 7.0, "timeouts.control_s"),
        ("abort_all", (), 7.0, "timeouts.control_s"),
        ("clear_cache", (), 7.0, "timeouts.control_s"),
        ("recover", (), 11.0, "timeouts.restart_s"),
    ],
)
def test_a_call_that_times_out_names_the_engine_the_call_and_the_key(call, args, seconds, key):
    async def main():
        e = SupervisedEngine(Stuck(), generate_s=40.0, control_s=7.0, restart_s=11.0, max_restarts=3)
        loop = asyncio.get_running_loop()
        with pytest.raises(CallTimeout) as exc:
            await getattr(e, call)(*args)
        return exc.value, loop.time()

    err, t = virtual_clock.run(main())
    assert t == pytest.approx(seconds)
    assert isinstance(err, WorkerLost) and err.component == "engine007"
    assert err.call == ("restart" if call == "recover" else call)
    assert str(err).startswith(f"engine007.{err.call}: no answer within {seconds:g} s")
    assert key in str(err)


def test_recover_past_max_restarts_raises_restarts_exhausted():
    class Quick(Stuck):
        async def recover(self):
            await asyncio.sleep(1.0)

    async def main():
        e = SupervisedEngine(Quick(), 1.0, 1.0, 5.0, max_restarts=2)
        await e.recover()
        await e.recover()
        with pytest.raises(RestartsExhausted, match=r"engine007: lost 3 times, more than recovery\.max_restarts = 2"):
            await e.recover()

    virtual_clock.run(main())


def test_a_hung_call_its_caller_gives_up_on_leaves_the_worker_stuck_until_a_restart():
    sc = base()
    from core.sim.costs import DecodeCost
    from core.sim.workload import Workload

    async def main():
        e = SimEngine("engine000", DecodeCost(sc, 1), Workload(sc.workload, 0), 8)
        e.restart_s = 3.0
        e.hang_next = "update_weights"
        task = asyncio.create_task(e.update_weights(1))
        await asyncio.sleep(1.0)
        task.cancel()  # e.g. the trainer that waited on the sync died
        await asyncio.gather(task, return_exceptions=True)
        stuck = e.hang_next
        await e.recover()  # killed and restarted
        await e.update_weights(1)
        return stuck, e.hang_next, e.version

    assert virtual_clock.run(main()) == ("update_weights", None, 1)


class Fake(Engine):
    """A rollout engine on the virtual clock: a generation takes 10 s; abort_all cancels the
    streams under way, which then raise CancelledError out of generate, as vLLM's do."""

    def __init__(self, name: str, update_s: float = 0.0, restart_s: float = 0.0) -> None:
        self.name, self.update_s, self.restart_s = name, update_s, restart_s
        self.version = 0
        self.streams: list[asyncio.Future] = []
        self.calls = 0

    async def generate(self, group, max_response_len, stop_ids=frozenset()):
        self.calls += 1
        loop = asyncio.get_running_loop()
        stream = loop.create_future()
        self.streams.append(stream)
        loop.call_later(10.0, lambda: stream.done() or stream.set_result(True))
        t0 = loop.time()
        try:
            await stream
        finally:
            self.streams.remove(stream)
            for s in group.unfinished():  # tokens so far, one per second
                s.add_tokens(int(loop.time() - t0), self.version)
        for s in group.samples:
            s.finished, s.finished_at = True, loop.time()
        return True

    async def abort_all(self):
        n = len(self.streams)
        for s in list(self.streams):
            s.cancel()
        return n

    async def update_weights(self, version, weights):
        await asyncio.sleep(self.update_s)
        self.version = version

    async def clear_cache(self):
        pass

    async def recover(self):
        await asyncio.sleep(self.restart_s)
        self.version = -1


def rollouter(engines, queue=None, **kw) -> Rollouter:
    args = dict(
        engines=[SupervisedEngine(e, 100.0, 30.0, 60.0, max_restarts=3) for e in engines],
        queue=queue if queue is not None else AsyncStalenessQueue(capacity=8, max_staleness=1),
        ledger=Ledger(1),
        group_size=2,
        prompt_tokens=4,
        max_response_len=64,
        max_concurrency=2,
        window=2,
        lead=0.0,
        max_staleness=1,
        plan_samples=2,
        stop_timeout_s=30.0,
    )
    return Rollouter(**{**args, **kw})


def test_an_engine_that_cancels_its_stream_on_abort_does_not_leak_cancelled_error():
    async def main():
        loop = asyncio.get_running_loop()
        engine = Fake("fake0")
        ro = rollouter([engine])
        run = asyncio.create_task(ro.run())
        await asyncio.sleep(4.0)
        assert engine.calls == 1 and ro.running == 2
        await ro.pause("abort")  # must return, not raise CancelledError
        assert not run.done(), "the cancellation leaked into the Rollouter"
        assert asyncio.current_task().cancelling() == 0
        [g] = ro.cancel_queue
        assert g.aborts == 1 and all(s.interrupts == 1 and s.n_response == 4 for s in g.samples)
        await ro.update_weights(1)
        await ro.resume()
        [done] = await ro.queue.get_batch(1)
        t = loop.time()
        assert await ro.stop() == []
        await run
        return done, t, engine.calls, ro

    g, t, calls, ro = virtual_clock.run(main())
    assert calls == 2 and t == pytest.approx(14.0)
    assert g.resumes == g.aborts == 1
    assert all(s.finished and s.version_spans == [[0, 4], [1, 10]] for s in g.samples)
    ro.ledger.trained_groups([g], 1, t)  # resumed as often as interrupted, within staleness
    assert ro.ledger.trained == 2 and ro.in_flight() == 0


def test_stop_hands_back_a_generation_that_ignores_abort():
    class Deaf(Fake):
        async def abort_all(self):
            return 0

    async def main():
        ro = rollouter([Deaf("deaf0")])
        run = asyncio.create_task(ro.run())
        await asyncio.sleep(1.0)
        left = await ro.stop()  # waits stop_timeout_s, then cancels it
        await run
        return left, ro.in_flight(), asyncio.get_running_loop().time()

    left, held, t = virtual_clock.run(main())
    # It finished at 10 s, before the 30 s stop timeout: nothing is left, it was queued.
    assert left == [] and held == 0 and t == pytest.approx(10.0)

    class Deafer(Deaf):
        async def generate(self, group, max_response_len, stop_ids=frozenset()):
            await asyncio.Event().wait()

    async def main2():
        ro = rollouter([Deafer("deaf1")], stop_timeout_s=5.0)
        run = asyncio.create_task(ro.run())
        await asyncio.sleep(1.0)
        left = await ro.stop()
        await run
        return left, ro.in_flight()

    left, held = virtual_clock.run(main2())
    assert [g.prompt_id for g in left] == [0] and held == 0


def test_a_worker_back_during_a_sync_loads_the_new_version():
    # Worker 1 dies; it is back (5 s) while worker 0 still loads the new weights (10 s). It was
    # not among the engines the sync loads, so it must load the new version itself.
    async def main():
        a, b = Fake("a", update_s=10.0), Fake("b", restart_s=5.0)
        ro = rollouter([a, b])
        ro.worker_lost(1, WorkerLost("b", "generate", "died"))
        await ro.update_weights(1)
        await asyncio.sleep(1.0)
        return a.version, b.version, ro._down, ro.version

    assert virtual_clock.run(main()) == (1, 1, set(), 1)


def test_the_rollout_version_never_goes_back():
    async def main():
        q = AsyncStalenessQueue(capacity=8, max_staleness=1)
        a = Fake("a")
        ro = rollouter([a], queue=q)
        await ro.update_weights(2)
        await ro.update_weights(1)  # a trainer restored from an older checkpoint
        await ro.update_weights(2)
        return ro.version, a.version, q.version

    assert virtual_clock.run(main()) == (2, 2, 2)


# -- 4. config validation ----------------------------------------------------------------------
BAD_FAULTS = [
    ("{kind: kill}", [], "faults.0", "exactly one of at_s and at_step"),
    ("{kind: kill, at_s: 1, at_step: 2}", [], "faults.0", "exactly one of at_s and at_step"),
    (f"{{kind: kill, at_step: {STEPS}}}", [], "faults.0.at_step", "the run ends"),
    ("{kind: kill, at_step: 0}", [], "faults.0.at_step", "greater than or equal to 1"),
    ("{kind: kill, at_s: -1}", [], "faults.0.at_s", "greater than or equal to 0"),
    ("{kind: slow, target: queue, at_s: 1}", [], "faults.0.target", "acts on a rollout worker"),
    ("{kind: hang, target: trainer, at_s: 1}", [], "faults.0.target", "acts on a rollout worker"),
    (f"{{kind: kill, worker: {WORKERS}, at_s: 1}}", [], "faults.0.worker", "rollout workers in the smallest mode"),
    ("{kind: kill, target: trainer, at_s: 1}", ["checkpoint.every=0"], "checkpoint.every", "kills the trainer"),
    ("{kind: slow, factor: 0.5, at_s: 1}", [], "faults.0.factor", "greater than or equal to 1"),
    ("{kind: slow, duration_s: 0, at_s: 1}", [], "faults.0.duration_s", "greater than 0"),
    ("{kind: hang, call: train, at_s: 1}", [], "faults.0.call", "not one of the choices"),
    ("{kind: explode, at_s: 1}", [], "faults.0.kind", "not one of the choices"),
    ("{kind: kill, target: engine, at_s: 1}", [], "faults.0.target", "not one of the choices"),
    ("{kind: kill, at_s: 1, when: 3}", [], "faults.0.when", "unknown key"),
    ("{kind: kill, at_s: 1}", ["replay.enabled=true", "checkpoint.every=0"], "faults", "replay ring is not checkpointed"),
    ("{kind: kill, at_s: 1}", ["replay.enabled=true"], "checkpoint.every", "replay ring is not checkpointed"),
]


@pytest.mark.parametrize("fault, extra, key, problem", BAD_FAULTS)
def test_a_bad_fault_names_its_dotted_key(fault, extra, key, problem):
    good = "{kind: kill, at_s: 5}"
    with pytest.raises(ScenarioError) as exc:
        load(QUICKSTART, SMALL + extra + [f"faults=[{good}, {fault}]"])
    msg = str(exc.value)
    key1 = key.replace("faults.0", "faults.1")
    assert f": {key1} = " in msg and problem in msg and "fix:" in msg, msg


def test_config_errors_carry_the_key_and_value():
    sc = base()
    data = sc.model_dump()
    data["faults"] = [{"kind": "kill", "at_s": 1.0}, {"kind": "kill", "at_step": STEPS + 3}]
    with pytest.raises(ValidationError) as exc:
        Scenario.model_validate(data)
    err = exc.value.errors()[0]["ctx"]["error"]
    assert isinstance(err, ConfigError)
    assert (err.key, err.value) == ("faults.1.at_step", STEPS + 3)
    assert f"use at most {STEPS - 1}" in err.fix
    # Faults on the local runtime, and a queue kill on ray without whole checkpoints to go back to, are refused by name.
    with pytest.raises(ValidationError, match=r"faults = '\[\.\.\.\]': faults are injected on the sim and ray runtimes"):
        with_changes(sc, {"runtime": "local", "engine.kind": "torch", "workload.max_response_len": 64,
                          "faults": [{"kind": "kill", "at_s": 1.0}]})
    with pytest.raises(ValidationError, match=r"checkpoint\.every = 0: faults\.0 kills the rollout actor"):
        with_changes(sc, {"runtime": "ray", "engine.kind": "vllm", "workload.max_response_len": 64, "checkpoint.every": 0,
                          "faults": [{"kind": "kill", "target": "queue", "at_s": 1.0}]})


def test_a_failed_reward_scores_the_finished_group_again_and_loses_nothing():
    """A reward service that fails (or times out) once: the finished group goes back to the
    Rollouter, which scores it again without generating it again."""

    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        async def score(self, group):
            self.calls += 1
            if self.calls == 1:
                raise WorkerLost("reward", "score", "the deployment failed")
            return [1.0] * group.size

    async def main():
        engine, reward = Fake("fake0"), Flaky()
        ro = rollouter([engine], reward=reward)
        run = asyncio.create_task(ro.run())
        [g] = await ro.queue.get_batch(1)
        await ro.stop()
        await run
        return g, engine.calls, reward.calls, ro

    g, generations, scorings, ro = virtual_clock.run(main())
    assert scorings == 2 and generations == 2  # the second call finds every sample finished
    assert [s.reward for s in g.samples] == [1.0, 1.0]
    assert all(s.n_response == 10 for s in g.samples)  # not generated twice
    assert ro.ledger.requeued == 2 and ro.in_flight() == 0


class _Answering(Engine):
    """An engine that says its control calls answer at once; ``wait`` makes clear_cache lie."""

    name = "answering"

    def __init__(self, now: bool, wait: bool = False) -> None:
        self.now, self.wait, self.cleared = now, wait, 0

    def answers_now(self) -> bool:
        return self.now

    async def clear_cache(self) -> None:
        if self.wait:
            await asyncio.sleep(1.0)
        self.cleared += 1


def test_control_calls_run_in_place_only_when_every_engine_answers_at_once():
    async def main():
        quick, slow = _Answering(True), _Answering(False)
        loop, ran = asyncio.get_running_loop(), []
        r = rollouter([quick, quick])
        loop.call_soon(ran.append, "other")
        await r._each_up("clear_cache")  # both called here, in order, without yielding to the loop
        assert quick.cleared == 2 and ran == []
        await asyncio.sleep(0)
        r = rollouter([quick, slow])  # one engine that may wait: every call a task behind its deadline
        loop.call_soon(ran.append, "other")
        await r._each_up("clear_cache")
        assert quick.cleared == 3 and slow.cleared == 1 and ran == ["other", "other"]
        liar = SupervisedEngine(_Answering(True, wait=True), 100.0, 30.0, 60.0, max_restarts=3)
        with pytest.raises(RuntimeError, match="waited though the engine answers at once"):
            liar.call_now("clear_cache")

    virtual_clock.run(main())
    # a simulated engine answers at once until a fault is set on it
    sc = Scenario()
    e = SimEngine("e", DecodeCost(sc, 1), Workload(sc.workload, sc.seed), 4)
    assert e.answers_now()
    e.hang_next = "clear_cache"
    assert not e.answers_now()


def test_a_trainer_killed_between_its_checkpoint_and_the_ack_is_not_given_its_trained_groups_again(tmp_path):
    """The ray trainer saves its checkpoint, then acknowledges the queue: a kill in between
    leaves groups unacknowledged that the restored ledger counts as trained. The rollout actor
    acknowledges those from the ledger's mask and redelivers only the rest."""
    from core.runtimes.ray_rollout_host import RolloutHost  # imports torch (core.real): only this test pays for it

    async def main():
        host = RolloutHost(RunPlan.of(base(), "async"), str(tmp_path))
        host.queue = durable_queue(tmp_path)
        gs = [group(i) for i in range(3)]
        for g in gs:
            await host.queue.put(g, g.version)
        given = await host.get_batch(3)
        assert ids(given) == [0, 1, 2]
        trained = Ledger(max_staleness=1)
        trained.trained_groups(given[:2], 0, 3.0)  # in the checkpoint; the ack never came
        assert await host.redeliver(trained.trained_mask()) == 1
        assert ids(await host.queue.get_batch(1)) == [2]
        assert ids(host.queue.unacked()) == [2]
        # With no mask (a checkpoint from before any step) everything unacknowledged comes back.
        assert await host.redeliver() == 1

    asyncio.run(main())
