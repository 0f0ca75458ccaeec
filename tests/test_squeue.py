"""The staleness-aware queue: the compiled module against its oracle, and behaviour.

* Oracle tests drive ``ext._squeue`` (compiled) and ``ext._squeue_ref`` (the pure-Python
  reference) with the same operations and require the same answers: returned and evicted
  items, lengths, versions, counters, and the type and message of every exception. They are
  skipped only under ``ASYNCRL_PUREPYTHON=1``, where the compiled module is deliberately not
  used; anywhere else a missing compiled module fails them.
* Behaviour tests run against the backend that ``ext.squeue`` selects.
* Backend tests check the ``ASYNCRL_PUREPYTHON`` switch in ``ext.backend``.
"""

from __future__ import annotations

import enum
import gc
import importlib
import os
import pickle
import random
import sys
import threading
import time
import weakref

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from ext import _squeue_ref, backend
from ext.errors import QueueFull
from ext.squeue import StalenessQueue

PURE = os.environ.get(backend.ENV_VAR, "").strip() == "1"
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def compiled():
    """The compiled module; skipped only when ASYNCRL_PUREPYTHON=1, an ImportError otherwise."""
    if PURE:
        pytest.skip("ASYNCRL_PUREPYTHON=1: the compiled module is deliberately not used")
    return importlib.import_module("ext._squeue")


class Item:
    """A payload that compares by its number and survives pickling."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Item) and other.k == self.k

    def __hash__(self) -> int:
        return hash(self.k)

    def __repr__(self) -> str:
        return f"Item({self.k})"

    def __reduce__(self):
        return (Item, (self.k,))


# ---------------------------------------------------------------------------------------------
# oracle: the compiled queue and the reference side by side


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the exception is the answer being compared
        return ("raised", type(exc), str(exc))


class Pair:
    """Sends every call to the compiled queue and to the reference; they must agree."""

    def __init__(self, module, capacity, max_staleness) -> None:
        self.ext = module.StalenessQueue(capacity, max_staleness)
        self.ref = _squeue_ref.StalenessQueue(capacity, max_staleness)
        self.identical = True  # items are the very same objects (until a pickle round trip)
        self.fired: dict[str, list] = {"ext": [], "ref": []}  # what each queue's watches saw

    def watch(self, k, tag) -> None:
        """``notify_at(k, ...)`` on both; each callback logs the tag and its queue's length."""
        def callback_for(side):
            if tag is None:
                return None
            q = getattr(self, side)
            return lambda: self.fired[side].append((tag, len(q)))

        got = _outcome(self.ext.notify_at, k, callback_for("ext"))
        want = _outcome(self.ref.notify_at, k, callback_for("ref"))
        assert got == want, f"notify_at({k!r}): compiled {got!r}, reference {want!r}"
        self.check()

    def do(self, name: str, *args):
        return self.do_fresh(name, lambda: args)

    def do_fresh(self, name: str, make_args):
        """As ``do``, with arguments made anew for each queue (iterators are used up)."""
        args = make_args()
        got = _outcome(getattr(self.ext, name), *args)
        want = _outcome(getattr(self.ref, name), *make_args())
        assert got == want, f"{name}{args!r}: compiled {got!r}, reference {want!r}"
        if self.identical and got[0] == "ok" and isinstance(got[1], list):
            assert all(a is b for a, b in zip(got[1], want[1])), f"{name}{args!r}: other objects returned"
        self.check()
        return want

    def check(self) -> None:
        assert len(self.ext) == len(self.ref)
        assert self.ext.version == self.ref.version
        assert self.ext.capacity == self.ref.capacity
        assert self.ext.max_staleness == self.ref.max_staleness
        assert self.ext.counters() == self.ref.counters()
        assert self.fired["ext"] == self.fired["ref"]

    def roundtrip(self) -> None:
        self.ext = pickle.loads(pickle.dumps(self.ext))  # watches are not pickled
        self.ref = pickle.loads(pickle.dumps(self.ref))
        self.identical = False
        self.check()

    def drain(self) -> None:
        self.do("get_batch", len(self.ref) + 1)
        assert len(self.ref) == 0


BAD_INTS = [True, False, -1, 1.5, "1", None, np.int64(1)]


def _random_op(rng: random.Random, pair: Pair, serial: list[int]):
    """One operation, valid most of the time; invalid ones must fail the same way in both."""
    version = pair.ref.version
    ms = pair.ref.max_staleness

    def old_version() -> int:  # current, recent, or already too stale
        return max(0, version - rng.choice([0, 0, 0, 1, 2, ms, ms + 1, ms + 3]))

    def item() -> Item:
        serial[0] += 1
        return Item(serial[0])

    r = rng.random()
    if r < 0.33:
        v = old_version() if rng.random() < 0.93 else rng.choice([version + 1, version + 10**30, *BAD_INTS])
        return ("put", item(), v)
    if r < 0.48:
        n = rng.choice([0, 1, 2, 3, 5, 8, 13])
        versions = [old_version() for _ in range(n)]
        if rng.random() < 0.05:
            versions.append(old_version())  # one version too many
        if versions and rng.random() < 0.05:
            versions[rng.randrange(len(versions))] = rng.choice([version + 1, *BAD_INTS])
        return ("put_many", [item() for _ in range(n)], versions)
    if r < 0.78:
        n = rng.choice([0, 1, 1, 2, 3, 5, 8, 64, 10**30]) if rng.random() < 0.95 else rng.choice(BAD_INTS)
        return ("get_batch", n)
    if r < 0.94:
        step = rng.choice([0, 1, 1, 1, 2, ms, ms + 1, ms + 5, 1000])  # with occasional jumps
        v = version + step if rng.random() < 0.95 else rng.choice([version - 1, *BAD_INTS])
        return ("set_version", v)
    if r < 0.99:
        k = len(pair.ref) + rng.choice([-1, 0, 1, 1, 2, 5, 10**30]) if rng.random() < 0.95 else rng.choice(BAD_INTS)
        serial[0] += 1
        return ("watch", k, None if rng.random() < 0.1 else serial[0])
    return ("roundtrip",)


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_match_reference(compiled, seed):
    rng = random.Random(seed)
    capacity = rng.choice([1, 2, 3, 4, 7, 16, 33, 128])
    max_staleness = rng.choice([0, 0, 1, 1, 2, 3, 8])
    pair = Pair(compiled, capacity, max_staleness)
    serial = [0]
    for _ in range(1500):
        op = _random_op(rng, pair, serial)
        if op[0] == "roundtrip":
            pair.roundtrip()
        elif op[0] == "watch":
            pair.watch(*op[1:])
        else:
            pair.do(*op)
    pair.drain()
    assert pair.fired["ref"], "no watch ever fired"


def test_sequences_hit_every_path(compiled):
    """The random sequences above do reach full queues, stale puts and evictions."""
    totals = dict.fromkeys(["put", "got", "evicted", "stale_on_put", "rejected_full"], 0)
    for seed in range(40):
        rng = random.Random(seed)
        pair = Pair(compiled, rng.choice([1, 2, 3, 4, 7, 16, 33, 128]), rng.choice([0, 0, 1, 1, 2, 3, 8]))
        serial = [0]
        for _ in range(300):
            op = _random_op(rng, pair, serial)
            if op[0] == "watch":
                pair.watch(*op[1:])
            elif op[0] != "roundtrip":
                pair.do(*op)
        for key, value in pair.ext.counters().items():
            totals[key] += value
    assert all(value > 0 for value in totals.values()), totals


class QueueMachine(RuleBasedStateMachine):
    """Hypothesis drives both queues with the same rules; every step must agree."""

    module = None  # the compiled module, set by the test

    def __init__(self) -> None:
        super().__init__()
        self.pair: Pair | None = None
        self.serial = 0

    def _item(self) -> Item:
        self.serial += 1
        return Item(self.serial)

    def _version(self, back: int) -> int:  # back < 0: newer than the queue
        return max(0, self.pair.ref.version - back)

    @initialize(capacity=st.integers(1, 12), max_staleness=st.integers(0, 3))
    def make(self, capacity, max_staleness):
        self.pair = Pair(self.module, capacity, max_staleness)

    @rule(back=st.integers(-1, 6))
    def put(self, back):
        self.pair.do("put", self._item(), self._version(back))

    @rule(backs=st.lists(st.integers(-1, 6), max_size=10), extra=st.integers(-1, 1))
    def put_many(self, backs, extra):
        versions = [self._version(b) for b in backs]
        items = [self._item() for _ in range(max(0, len(versions) + extra))]
        self.pair.do("put_many", items, versions)

    @rule(n=st.integers(0, 14) | st.just(10**20))
    def get_batch(self, n):
        self.pair.do("get_batch", n)

    @rule(step=st.integers(-1, 7))
    def set_version(self, step):
        self.pair.do("set_version", max(0, self.pair.ref.version + step) if step >= 0 else self.pair.ref.version - 1)

    @rule(method=st.sampled_from(["put", "put_many", "get_batch", "set_version"]), bad=st.sampled_from(BAD_INTS))
    def bad_argument(self, method, bad):
        args = {
            "put": (self._item(), bad),
            "put_many": ([self._item()], [bad]),
            "get_batch": (bad,),
            "set_version": (bad,),
        }[method]
        self.pair.do(method, *args)

    @rule()
    def roundtrip(self):
        self.pair.roundtrip()

    @invariant()
    def agree(self):
        if self.pair is not None:
            self.pair.check()


def test_stateful_matches_reference(compiled):
    QueueMachine.module = compiled
    run_state_machine_as_test(QueueMachine, settings=settings(max_examples=150, stateful_step_count=50))


def test_every_stale_pattern_matches_reference(compiled):
    """All 2**10 sets of stale positions in a full, wrapped-around ring of 10 slots: eviction
    slides the kept items from either end and must agree with the reference every time."""
    for mask in range(1 << 10):
        pair = Pair(compiled, 10, 1)
        pair.do("set_version", 1)
        pair.do("put_many", [Item(-i) for i in range(3)], [1, 1, 1])
        pair.do("get_batch", 3)  # the ring's head is now at slot 3
        versions = [0 if mask >> i & 1 else 1 for i in range(10)]
        pair.do("put_many", [Item(i) for i in range(10)], versions)
        pair.do("set_version", 2)
        free = 10 - len(pair.ref)
        pair.do("put_many", [Item(100 + i) for i in range(free)], [2] * free)
        pair.drain()


def test_large_queue_matches_reference(compiled):
    """Ring growth past the preallocated slots, and loops long enough to release the GIL."""
    pair = Pair(compiled, 300_000, 2)
    rng = random.Random(7)
    serial = iter(range(10**9))
    for v in range(1, 4):
        pair.do("set_version", v)
        n = 40_000
        versions = [rng.choice([v, v, v - 1, max(0, v - 2), max(0, v - 3)]) for _ in range(n)]
        pair.do("put_many", [Item(next(serial)) for _ in range(n)], versions)
    for _ in range(30_000):  # single puts across the growth boundary
        pair.do("put", Item(next(serial)), pair.ref.version - rng.randint(0, 2))
    pair.do("get_batch", 20_000)
    pair.do("set_version", pair.ref.version + 1)
    pair.do("put_many", [Item(next(serial)) for _ in range(20_000)], [pair.ref.version] * 20_000)
    pair.do("set_version", pair.ref.version + 2)
    pair.do("get_batch", 50_000)
    pair.do("set_version", pair.ref.version + 3)
    pair.drain()
    counters = pair.ext.counters()
    assert counters["evicted"] > 0 and counters["stale_on_put"] > 0 and counters["got"] > 0


def test_generators_are_consumed_like_the_reference(compiled):
    pair = Pair(compiled, 10, 1)
    items = [Item(i) for i in range(3)]
    pair.do_fresh("put_many", lambda: (iter(items), (0 for _ in range(3))))
    pair.do_fresh("put_many", lambda: (iter([Item(9)]), iter([0, 0])))  # mismatch found after both are read
    more = [Item(i) for i in range(4)]
    pair.do_fresh("put_many", lambda: ((x for x in more), iter([0, "x", 0, 0])))
    pair.do_fresh("put_many", lambda: ((x for x in more), iter([0, 0, 0, 0])))
    pair.do_fresh("put_many", lambda: (dict.fromkeys(items), {0: "zero", 1: "one", 2: "two"}))
    pair.drain()


# ---------------------------------------------------------------------------------------------
# compiled-only properties


def test_version_beyond_int64_is_refused_cleanly(compiled):
    q = compiled.StalenessQueue(4, 1)
    q.put("a", 0)
    with pytest.raises(ValueError, match="version must be <="):
        q.set_version(INT64_MAX + 1)
    assert q.version == 0 and len(q) == 1
    q.set_version(INT64_MAX)  # the largest version is fine
    assert q.version == INT64_MAX and len(q) == 0
    with pytest.raises(ValueError, match="newer"):
        q.put("b", 2**80)
    assert q.put("c", INT64_MAX)
    assert q.get_batch(5) == ["c"]


def test_uninitialised_object_fails_cleanly(compiled):
    q = compiled.StalenessQueue.__new__(compiled.StalenessQueue)
    assert len(q) == 0
    assert q.get_batch(3) == []
    assert q.set_version(1) == []
    with pytest.raises(QueueFull):
        q.put("a", 0)
    with pytest.raises(QueueFull):
        q.put_many(["a"], [0])
    q.__init__(2, 0)  # and it can still be made usable
    assert (q.capacity, q.max_staleness, q.version) == (2, 0, 0)
    assert q.put("a", 0) is True
    assert q.get_batch(3) == ["a"]


def test_threads_sharing_a_queue_stay_consistent(compiled):
    """Big batches release the GIL; concurrent callers wait, nothing is lost or duplicated."""
    q = compiled.StalenessQueue(400_000, 1)
    deadline = time.monotonic() + 1.5
    got: list[int] = []
    evicted: list[int] = []
    stored: list[int] = []
    errors: list[BaseException] = []

    def guard(fn):
        def run():
            try:
                while time.monotonic() < deadline:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        return run

    def producer():
        try:
            stored.append(q.put_many(range(20_000), [q.version] * 20_000))
        except QueueFull:
            pass
        try:
            stored.append(int(q.put(-1, q.version)))
        except QueueFull:
            pass

    def consumer():
        got.append(len(q.get_batch(17_000)))

    def trainer():
        evicted.append(len(q.set_version(q.version + 1)))
        time.sleep(0.001)

    threads = [threading.Thread(target=guard(f)) for f in (producer, producer, consumer, trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    c = q.counters()
    assert c["put"] == sum(stored)
    assert c["got"] == sum(got) and c["evicted"] == sum(evicted)
    assert c["put"] == c["got"] + c["evicted"] + len(q)
    assert c["evicted"] > 0 and c["got"] > 0
    rest = q.get_batch(len(q))
    assert len(rest) == c["put"] - c["got"] - c["evicted"]


def test_finalizers_may_call_the_queue_while_it_drops_items(compiled):
    """Re-initialising releases the old items only once the queue is consistent again.

    (The reference is not built for this: its per-version counts are reset after the items.)
    """
    q = compiled.StalenessQueue(4, 0)

    class Payload:
        def __del__(self):
            q.put("from __del__", 0)

    q.put(Payload(), 0)
    q.__init__(4, 0)  # drops the payload
    gc.collect()
    assert len(q) <= 1
    assert q.get_batch(4) in ([], ["from __del__"])


# ---------------------------------------------------------------------------------------------
# behaviour of the selected backend


def test_fifo_order():
    q = StalenessQueue(10, 2)
    for i in range(6):
        assert q.put(i, 0) is True
    assert q.get_batch(2) == [0, 1]
    assert q.put_many([6, 7], [0, 0]) == 2
    assert q.get_batch(0) == []
    assert q.get_batch(100) == [2, 3, 4, 5, 6, 7]
    assert q.get_batch(1) == []
    assert len(q) == 0


def test_capacity_bound_and_all_or_nothing():
    q = StalenessQueue(3, 0)
    q.put("a", 0)
    q.put("b", 0)
    with pytest.raises(QueueFull):
        q.put_many(["c", "d"], [0, 0])  # only one would fit: none is stored
    assert len(q) == 2
    q.put("c", 0)
    with pytest.raises(QueueFull):
        q.put("d", 0)
    with pytest.raises(QueueFull):
        q.put_many(["d"], [0])
    assert q.put_many([], []) == 0  # nothing to store always fits
    assert len(q) == 3
    assert q.counters()["rejected_full"] == 3
    assert q.get_batch(5) == ["a", "b", "c"]


def test_full_is_checked_before_staleness():
    q = StalenessQueue(1, 0)
    q.set_version(5)
    q.put("a", 5)
    with pytest.raises(QueueFull):
        q.put("stale", 1)
    assert q.counters()["stale_on_put"] == 0 and q.counters()["rejected_full"] == 1


def test_set_version_evicts_stale_items_in_order():
    q = StalenessQueue(10, 1)
    q.set_version(1)
    q.put_many(["a", "b", "c", "d", "e"], [0, 1, 0, 1, 1])
    assert q.set_version(1) == []  # same version: nothing new is stale
    assert q.set_version(2) == ["a", "c"]
    assert len(q) == 3
    assert q.version == 2
    assert q.get_batch(10) == ["b", "d", "e"]
    assert q.counters()["evicted"] == 2


def test_version_jump_evicts_everything():
    q = StalenessQueue(10, 2)
    q.set_version(3)
    q.put_many(["a", "b"], [1, 3])
    assert q.set_version(100) == ["a", "b"]
    assert len(q) == 0
    assert q.put("c", 100)
    assert q.get_batch(1) == ["c"]


def test_zero_staleness_keeps_only_the_current_version():
    q = StalenessQueue(10, 0)
    q.put("a", 0)
    assert q.set_version(1) == ["a"]
    assert q.put("b", 0) is False
    assert q.put("c", 1) is True
    assert q.get_batch(5) == ["c"]


def test_stale_on_put_is_counted_not_stored():
    q = StalenessQueue(10, 1)
    q.set_version(5)
    assert q.put("old", 3) is False
    assert q.put("ok", 4) is True
    assert q.put_many(["x", "y", "z"], [3, 5, 2]) == 1
    assert len(q) == 2
    assert q.get_batch(5) == ["ok", "y"]
    assert q.counters() == {"put": 2, "got": 2, "evicted": 0, "stale_on_put": 3, "rejected_full": 0}


def test_counters_add_up():
    q = StalenessQueue(5, 1)
    assert q.counters() == {"put": 0, "got": 0, "evicted": 0, "stale_on_put": 0, "rejected_full": 0}
    q.put_many(list("abcde"), [0] * 5)
    with pytest.raises(QueueFull):
        q.put("f", 0)
    q.get_batch(2)
    q.set_version(2)
    q.put("g", 0)
    c = q.counters()
    assert c == {"put": 5, "got": 2, "evicted": 3, "stale_on_put": 1, "rejected_full": 1}
    assert c["put"] == c["got"] + c["evicted"] + len(q)


def test_properties():
    q = StalenessQueue(7, 3)
    assert (q.capacity, q.max_staleness, q.version) == (7, 3, 0)
    q.set_version(4)
    assert q.version == 4


def test_huge_ints_behave_like_unbounded_ones():
    q = StalenessQueue(10**30, 10**30)
    assert q.capacity == 10**30 and q.max_staleness == 10**30
    q.put("a", 0)
    q.set_version(10**12)
    assert q.put("b", 0) is True  # nothing is ever stale
    assert q.get_batch(10**30) == ["a", "b"]


class Version(enum.IntEnum):
    ONE = 1


def test_int_subclasses_are_ints_and_numpy_ints_are_not():
    q = StalenessQueue(4, 1)
    q.set_version(Version.ONE)
    assert q.put("a", Version.ONE)
    assert q.get_batch(Version.ONE) == ["a"]
    with pytest.raises(TypeError):
        q.put("b", np.int64(1))
    with pytest.raises(TypeError):
        StalenessQueue(np.int32(4), 1)


@pytest.mark.parametrize(
    ("capacity", "max_staleness", "error"),
    [
        (0, 1, ValueError),
        (-3, 1, ValueError),
        (True, 1, TypeError),
        (4.0, 1, TypeError),
        ("4", 1, TypeError),
        (None, 1, TypeError),
        (4, -1, ValueError),
        (4, False, TypeError),
        (4, 0.5, TypeError),
        (4, None, TypeError),
        (-(10**30), 1, ValueError),
    ],
)
def test_bad_constructor_arguments(capacity, max_staleness, error):
    with pytest.raises(error, match="capacity|max_staleness"):
        StalenessQueue(capacity, max_staleness)


@pytest.mark.parametrize(
    ("method", "args", "error"),
    [
        ("put", ("x", True), TypeError),
        ("put", ("x", -1), ValueError),
        ("put", ("x", 1.0), TypeError),
        ("put", ("x", None), TypeError),
        ("put", ("x", "0"), TypeError),
        ("put", ("x", 3), ValueError),  # newer than the queue's version (2)
        ("put", ("x", 10**30), ValueError),
        ("put", ("x", -(10**30)), ValueError),
        ("put_many", (["x"], [True]), TypeError),
        ("put_many", (["x"], [3]), ValueError),
        ("put_many", (["x", "y"], [0]), ValueError),
        ("put_many", (["x"], [0, 0]), ValueError),
        ("put_many", (["x", "y"], [0, -1]), ValueError),
        ("put_many", (["x"], None), TypeError),
        ("put_many", (None, [0]), TypeError),
        ("get_batch", (True,), TypeError),
        ("get_batch", (-1,), ValueError),
        ("get_batch", (1.0,), TypeError),
        ("get_batch", (None,), TypeError),
        ("set_version", (True,), TypeError),
        ("set_version", (-1,), ValueError),
        ("set_version", (2.5,), TypeError),
        ("set_version", (1,), ValueError),  # going back
        ("set_version", ("3",), TypeError),
    ],
)
def test_bad_arguments_raise_and_change_nothing(method, args, error):
    q = StalenessQueue(8, 1)
    q.set_version(2)
    q.put_many(["a", "b"], [1, 2])
    before = q.counters()
    with pytest.raises(error):
        getattr(q, method)(*args)
    assert q.counters() == before
    assert q.version == 2
    assert q.get_batch(8) == ["a", "b"]


def test_pickle_round_trip():
    q = StalenessQueue(6, 1)
    q.set_version(3)
    q.put_many([Item(1), Item(2), Item(3)], [2, 3, 3])
    q.put(Item(4), 1)  # stale on put
    q.get_batch(1)
    copy = pickle.loads(pickle.dumps(q))
    assert type(copy) is type(q)
    assert (copy.capacity, copy.max_staleness, copy.version, len(copy)) == (6, 1, 3, 2)
    assert copy.counters() == q.counters()
    assert copy.set_version(4) == []
    assert copy.set_version(5) == [Item(2), Item(3)]
    assert q.get_batch(5) == [Item(2), Item(3)]  # the original is untouched


def test_items_are_released():
    """The queue keeps no reference to what it handed out, evicted, or held when deleted."""

    class Payload:
        pass

    q = StalenessQueue(8, 0)
    objs = [Payload() for _ in range(6)]
    refs = [weakref.ref(o) for o in objs]
    q.put_many(objs[:4], [0] * 4)
    q.put(objs[4], 0)
    q.put(objs[5], 0)
    out = q.get_batch(2)
    evicted = q.set_version(1)
    assert out == objs[:2] and evicted == objs[2:]
    del objs, out, evicted
    gc.collect()
    assert all(r() is None for r in refs)
    held = Payload()
    ref = weakref.ref(held)
    q.put(held, 1)
    del held, q
    gc.collect()
    assert ref() is None


def test_reference_cycles_through_the_queue_are_collected():
    class Payload:
        pass

    q = StalenessQueue(4, 0)
    p = Payload()
    p.queue = q  # item -> queue -> item
    q.put(p, 0)
    ref = weakref.ref(p)
    del p, q
    gc.collect()
    assert ref() is None


def test_refcounts_are_balanced():
    """Moving references in and out (put, get, evict) neither leaks nor over-releases."""
    q = StalenessQueue(64, 1)
    obj = object()
    base = sys.getrefcount(obj)
    for round_ in range(20):
        q.put_many([obj] * 20, [q.version] * 20)
        q.put(obj, q.version)
        q.get_batch(7)
        q.set_version(q.version + 2 if round_ % 3 else q.version + 1)
    q.get_batch(100)
    assert sys.getrefcount(obj) == base
    assert sys.getrefcount(None) > 0
