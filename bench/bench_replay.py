"""Micro-benchmarks of the replay buffer: compiled vs reference vs numpy vs cpprb.

Run with ``pytest bench/bench_replay.py --benchmark-only``. Every implementation gets the
same data: fields obs float32[64], next_obs float32[64], act int32, reward float32, done
float32; capacity 1,000,000; batches of 256 (and single rows). Implementations:

* ``ext``    the compiled ``ext._replay`` (required unless ASYNCRL_PUREPYTHON=1)
* ``ref``    the pure-Python reference ``ext._replay_ref``
* ``numpy``  uniform groups: ``NumpyRing`` (columnar arrays and a cursor, slice writes, fancy
             index gather with ``Generator.integers``); prioritized groups: ``NumpySumTree``
             (the same ring with a flat array sum tree and min tree, updated level by level
             with vectorised fancy indexing or slices, and a stratified descent vectorised
             over the batch)
* ``cpprb``  ``cpprb.ReplayBuffer`` / ``cpprb.PrioritizedReplayBuffer`` (C++ segment trees)

Groups: ``add 256`` and ``add 1`` (uniform buffers, already full, so every write overwrites
old rows and no page is touched for the first time), ``add 256 prioritized``, ``sample 256
uniform``, ``sample 256 prioritized`` (full buffers with random priorities), ``update
priorities 256`` for the slots a sample returned (the PER training loop) and for uniformly
random slots. A buffer is filled once per implementation and kind (module-scoped fixtures,
torn down before the next: each holds ~520 MB).

Inputs are drawn the way a training loop draws them: no call reuses the inputs of an earlier
one (slots, priorities, rows), so no implementation skips work on a value that did not change
or finds its tree paths still in cache from the last time. (Cycling 16 slot/priority sets, as
these benchmarks once did, made cpprb's random-slot update ~6x faster by min time than on
fresh inputs and ours ~2x, on one machine: numbers for inputs no training loop produces.)

* ``update priorities 256``: every round gets fresh priorities (uniform in [0.01, 10.01)) for
  fresh slots, the ones ``sample(256)`` of the same buffer returns just before (sorted, as
  stratified draws come out) or 256 drawn uniformly at random; both made outside the timing.
  The third case, ``fixed slots``, updates one random set of 256 slots again and again (fresh
  priorities each time): the cache-hot case, where the update's own work is all there is.
* ``add 256``, ``add 256 prioritized``: a fresh batch of random rows every round, made outside
  the timing. The prioritized buffer starts with random priorities and the group makes fewer
  than CAPACITY / 256 adds, so every add replaces random priorities with the running maximum
  (after a full wrap every slot would already hold the maximum).
* ``add 1``: rows of a pre-generated stream of distinct rows, walked front to back and never
  wrapped (the stream has one row per call made; running out fails the benchmark). At well
  under a microsecond a call, making a row per call outside the timing would add a timer
  call to every measured call.
* ``sample``: every call draws new slots from the buffer's own generator.

The add and update benchmarks run a fixed number of rounds (``benchmark.pedantic``), since their
inputs are counted out in advance; ``--benchmark-max-time`` and ``--benchmark-min-rounds`` do
not apply to them.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

from ext import _replay_ref

CAPACITY = 1_000_000
BATCH = 256
ALPHA = 0.6
BETA = 0.4
SPEC = {
    "obs": ((64,), np.float32),
    "next_obs": ((64,), np.float32),
    "act": ((), np.int32),
    "reward": ((), np.float32),
    "done": ((), np.float32),
}
CPPRB_ENV = {"obs": {"shape": 64}, "next_obs": {"shape": 64}, "act": {"dtype": np.int32}, "reward": {}, "done": {}}
# Rounds of the benchmarks whose inputs are made per round (outside the timing), after WARMUP.
ROUNDS = 1000
WARMUP = 20
# `add 1`: ADD1_ROUNDS rounds of ADD1_CALLS calls each, after ADD1_WARMUP such rounds.
ADD1_ROUNDS, ADD1_CALLS, ADD1_WARMUP = 200, 100, 5
# every prioritized add must replace priorities that are not the running maximum: no wrap
assert (ROUNDS + WARMUP) * BATCH < CAPACITY


def _rows(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.standard_normal((n, 64), dtype=np.float32),
        "next_obs": rng.standard_normal((n, 64), dtype=np.float32),
        "act": rng.integers(0, 18, n, dtype=np.int32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "done": (rng.random(n) < 0.01).astype(np.float32),
    }


# ---------------------------------------------------------------------------------------------
# baselines


class NumpyRing:
    """Uniform replay in plain numpy: one array per field, a write cursor, fancy-index gather."""

    def __init__(self, capacity: int, spec: dict, seed: int = 0) -> None:
        self.capacity = capacity
        self.arrays = {k: np.zeros((capacity, *shape), dtype=dt) for k, (shape, dt) in spec.items()}
        self.pos = 0
        self.size = 0
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.size

    def _write(self, batch: dict[str, np.ndarray]) -> tuple[int, int]:
        """Rows go to [pos, pos + n) mod capacity (n <= capacity); returns (first slot, n)."""
        n = len(batch["obs"])
        pos, cap = self.pos, self.capacity
        end = pos + n
        if end <= cap:
            for k, a in self.arrays.items():
                a[pos:end] = batch[k]
        else:
            split = cap - pos
            for k, a in self.arrays.items():
                b = batch[k]
                a[pos:] = b[:split]
                a[: end - cap] = b[split:]
        self.pos = end % cap
        self.size = min(cap, self.size + n)
        return pos, n

    def add(self, batch: dict[str, np.ndarray]) -> None:
        self._write(batch)

    def sample(self, n: int, beta: float = 0.0):
        idx = self.rng.integers(0, self.size, n)
        return {k: a[idx] for k, a in self.arrays.items()}, idx, None


class NumpySumTree(NumpyRing):
    """Prioritized replay in plain numpy: flat sum and min trees over 2**k leaves."""

    def __init__(self, capacity: int, spec: dict, alpha: float = ALPHA, seed: int = 0) -> None:
        super().__init__(capacity, spec, seed)
        self.alpha = alpha
        self.leaves = 1 << (capacity - 1).bit_length()
        self.depth = self.leaves.bit_length() - 1
        self.sum = np.zeros(2 * self.leaves)
        self.min = np.full(2 * self.leaves, np.inf)
        self.max_p = 1.0

    def _set_range(self, lo: int, hi: int, q: float) -> None:
        """Leaves [lo, hi) get q; their ancestors are recomputed with strided slices."""
        s, m = self.sum, self.min
        lo += self.leaves
        hi += self.leaves
        s[lo:hi] = q
        m[lo:hi] = q
        for _ in range(self.depth):
            lo >>= 1
            hi = ((hi - 1) >> 1) + 1
            np.add(s[2 * lo : 2 * hi : 2], s[2 * lo + 1 : 2 * hi : 2], out=s[lo:hi])
            np.minimum(m[2 * lo : 2 * hi : 2], m[2 * lo + 1 : 2 * hi : 2], out=m[lo:hi])

    def add(self, batch: dict[str, np.ndarray]) -> None:
        pos, n = self._write(batch)
        q = self.max_p**self.alpha
        end = pos + n
        if end <= self.capacity:
            self._set_range(pos, end, q)
        else:
            self._set_range(pos, self.capacity, q)
            self._set_range(0, end - self.capacity, q)

    def update_priorities(self, idx: np.ndarray, priorities: np.ndarray) -> None:
        s, m = self.sum, self.min
        q = priorities**self.alpha
        node = idx + self.leaves
        s[node] = q
        m[node] = q
        for _ in range(self.depth):
            node >>= 1  # repeated parents all write the same value
            left = 2 * node
            s[node] = s[left] + s[left + 1]
            m[node] = np.minimum(m[left], m[left + 1])
        self.max_p = max(self.max_p, float(priorities.max()))

    def sample(self, n: int, beta: float = BETA):
        s = self.sum
        total = s[1]
        u = (np.arange(n) + self.rng.random(n)) * (total / n)
        node = np.ones(n, dtype=np.int64)
        for _ in range(self.depth):
            node *= 2
            left = s[node]
            right = u >= left
            np.subtract(u, left, out=u, where=right)
            node += right
        idx = node - self.leaves
        np.minimum(idx, self.size - 1, out=idx)
        p = s[idx + self.leaves] / total
        w = (self.size * p) ** -beta / (self.size * (self.min[1] / total)) ** -beta
        return {k: a[idx] for k, a in self.arrays.items()}, idx, w


class Cpprb:
    """cpprb behind the same add/sample/update_priorities calls."""

    def __init__(self, prioritized: bool) -> None:
        import cpprb

        if prioritized:
            self.rb = cpprb.PrioritizedReplayBuffer(CAPACITY, CPPRB_ENV, alpha=ALPHA)
        else:
            self.rb = cpprb.ReplayBuffer(CAPACITY, CPPRB_ENV)
        self.prioritized = prioritized

    def __len__(self) -> int:
        return self.rb.get_stored_size()

    def add(self, batch: dict[str, np.ndarray]) -> None:
        self.rb.add(**batch)

    def sample(self, n: int, beta: float = BETA):
        if self.prioritized:
            out = self.rb.sample(n, beta=beta)
            return out, out["indexes"], out["weights"]
        return self.rb.sample(n), None, None

    def update_priorities(self, idx: np.ndarray, priorities: np.ndarray) -> None:
        self.rb.update_priorities(idx, priorities)


def _compiled():
    if os.environ.get("ASYNCRL_PUREPYTHON", "").strip() == "1":
        pytest.skip("ASYNCRL_PUREPYTHON=1: the compiled module is deliberately not used")
    return importlib.import_module("ext._replay").ReplayBuffer  # ImportError fails the bench


def _make(impl: str, prioritized: bool):
    if impl == "ext":
        return _compiled()(CAPACITY, SPEC, prioritized=prioritized, alpha=ALPHA, seed=0)
    if impl == "ref":
        return _replay_ref.ReplayBuffer(CAPACITY, SPEC, prioritized=prioritized, alpha=ALPHA, seed=0)
    if impl == "numpy":
        return NumpySumTree(CAPACITY, SPEC) if prioritized else NumpyRing(CAPACITY, SPEC)
    return Cpprb(prioritized)


IMPLS = ["ext", "ref", "numpy", "cpprb"]


def _filled(impl: str, prioritized: bool):
    """A full buffer: CAPACITY rows (and random priorities when prioritized)."""
    buf = _make(impl, prioritized)
    rng = np.random.default_rng(1)
    chunk = _rows(rng, 1 << 16)
    for start in range(0, CAPACITY, 1 << 16):
        n = min(1 << 16, CAPACITY - start)
        buf.add({k: v[:n] for k, v in chunk.items()})
    assert len(buf) == CAPACITY
    if prioritized:
        step = 1 << 17
        for start in range(0, CAPACITY, step):
            idx = np.arange(start, min(start + step, CAPACITY), dtype=np.int64)
            buf.update_priorities(idx, rng.random(len(idx)) * 10.0 + 0.01)
    return buf


@pytest.fixture(scope="module", params=IMPLS)
def uniform_buffer(request):
    buf = _filled(request.param, False)
    yield buf
    del buf


@pytest.fixture(scope="module", params=IMPLS)
def prioritized_buffer(request):
    buf = _filled(request.param, True)
    yield buf
    del buf


class Counted:
    """Fresh inputs per round for ``benchmark.pedantic`` (its ``setup``), counted."""

    def __init__(self, make) -> None:
        self.make = make
        self.rounds = 0

    def __call__(self):
        self.rounds += 1
        return self.make(), {}


def _pedantic(benchmark, target, make_args) -> Counted:
    """``target(*make_args())`` timed for ROUNDS rounds (after WARMUP), one fresh set of
    arguments per round, made outside the timing."""
    setup = Counted(make_args)
    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    return setup


def _priorities(rng: np.random.Generator) -> np.ndarray:
    return rng.random(BATCH) * 10.0 + 0.01


# ---------------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="add 256")
def test_add_256(benchmark, uniform_buffer):
    rng = np.random.default_rng(2)
    _pedantic(benchmark, uniform_buffer.add, lambda: (_rows(rng, BATCH),))
    assert len(uniform_buffer) == CAPACITY


@pytest.mark.benchmark(group="add 1")
def test_add_1(benchmark, uniform_buffer):
    calls = (ADD1_ROUNDS + ADD1_WARMUP) * ADD1_CALLS + 1  # + 1: pedantic's call for the result
    stream = _rows(np.random.default_rng(3), calls)
    rows = [{k: v[i : i + 1] for k, v in stream.items()} for i in range(calls)]
    nxt = iter(rows).__next__  # a C-level callable; StopIteration if the stream runs out
    add = uniform_buffer.add
    benchmark.pedantic(lambda: add(nxt()), rounds=ADD1_ROUNDS, warmup_rounds=ADD1_WARMUP, iterations=ADD1_CALLS)
    assert len(uniform_buffer) == CAPACITY


@pytest.mark.benchmark(group="add 256 prioritized")
def test_add_256_prioritized(benchmark, prioritized_buffer):
    rng = np.random.default_rng(2)
    setup = _pedantic(benchmark, prioritized_buffer.add, lambda: (_rows(rng, BATCH),))
    assert setup.rounds * BATCH < CAPACITY  # no wrap: every add replaced random priorities
    assert len(prioritized_buffer) == CAPACITY


@pytest.mark.benchmark(group="sample 256 uniform")
def test_sample_uniform(benchmark, uniform_buffer):
    batch, _, _ = benchmark(uniform_buffer.sample, BATCH)
    assert batch["obs"].shape == (BATCH, 64) and batch["act"].dtype == np.int32


@pytest.mark.benchmark(group="sample 256 prioritized")
def test_sample_prioritized(benchmark, prioritized_buffer):
    batch, idx, w = benchmark(prioritized_buffer.sample, BATCH, BETA)
    assert batch["obs"].shape == (BATCH, 64) and len(idx) == BATCH
    assert np.all(w > 0) and np.all(w <= 1.0 + 1e-6)


@pytest.mark.benchmark(group="update priorities 256 (sampled slots)")
def test_update_priorities_sampled(benchmark, prioritized_buffer):
    """The PER training loop: new priorities for the slots the buffer's own sample just
    returned (stratified draws, so the slots come out sorted)."""
    rng = np.random.default_rng(4)
    sample = prioritized_buffer.sample

    def fresh():
        return np.asarray(sample(BATCH, BETA)[1]), _priorities(rng)

    _pedantic(benchmark, prioritized_buffer.update_priorities, fresh)


@pytest.mark.benchmark(group="update priorities 256 (fixed slots)")
def test_update_priorities_fixed(benchmark, prioritized_buffer):
    """One set of 256 random slots, updated again and again with new priorities: the paths
    stay in cache, so this times the update's own work, not the memory's."""
    rng = np.random.default_rng(6)
    slots = rng.integers(0, CAPACITY, BATCH, dtype=np.int64)

    def fresh():
        return slots, _priorities(rng)

    _pedantic(benchmark, prioritized_buffer.update_priorities, fresh)


@pytest.mark.benchmark(group="update priorities 256 (random slots)")
def test_update_priorities_random(benchmark, prioritized_buffer):
    """Slots drawn uniformly at random (unsorted), new priorities every call."""
    rng = np.random.default_rng(5)

    def fresh():
        return rng.integers(0, CAPACITY, BATCH, dtype=np.int64), _priorities(rng)

    _pedantic(benchmark, prioritized_buffer.update_priorities, fresh)


@pytest.mark.benchmark(group="first fill, fresh processes")
def test_first_fill_in_fresh_processes(benchmark):
    """The first pass over a fresh 1M-row buffer, ours and cpprb's, six fresh processes each
    (bench/first_fill.py): the rows per second of each fill and their spread go to extra_info,
    which bench/targets.py reads. The time measured is the whole set of processes."""
    _compiled()
    import first_fill

    result = benchmark.pedantic(first_fill.run, args=(6,), rounds=1, iterations=1)
    for impl, s in result["summary"].items():
        benchmark.extra_info[f"{impl}_fill_rows_per_s_median"] = s["rows_per_s_median"]
        benchmark.extra_info[f"{impl}_fill_spread"] = s["spread"]
        benchmark.extra_info[f"{impl}_to_full_s_median"] = s["to_full_s_median"]
        # each process's figures, in the order they ran: a slow constructor (pages the host had
        # taken back, bench/page_cost.py) and the fill after it show up side by side
        benchmark.extra_info[f"{impl}_ctor_s"] = s["ctor_s"]
        benchmark.extra_info[f"{impl}_fill_s"] = s["fill_s"]
    assert all(len(r) == 6 for r in result["runs"].values())
