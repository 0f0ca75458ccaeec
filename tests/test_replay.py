"""The replay buffer: the compiled module against its oracle, and behaviour.

* Oracle tests drive ``ext._replay`` (compiled) and ``ext._replay_ref`` (the pure-Python
  reference) with the same operations and require the same answers: slots, gathered rows
  (byte for byte), weights (exactly), lengths, storage, and the type and message of every
  exception. They are skipped only under ``ASYNCRL_PUREPYTHON=1``, where the compiled module
  is deliberately not used; anywhere else a missing compiled module fails them.
* Behaviour tests run against the backend that ``ext.replay`` selects: sampling frequencies
  (chi-square), weights, stratification, wrap-around, seeding, bad arguments.
"""

from __future__ import annotations

import importlib
import math
import os
import random
import threading
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from ext import _replay_ref, backend
from ext.replay import BACKEND, ReplayBuffer

PURE = os.environ.get(backend.ENV_VAR, "").strip() == "1"

SPEC = {
    "obs": ((3,), np.float32),
    "act": ((), np.int64),
    "done": ((), np.bool_),
    "img": ((2, 2), np.uint8),
    "r": ((), np.float16),
}


@pytest.fixture(scope="module")
def compiled():
    """The compiled module; skipped only when ASYNCRL_PUREPYTHON=1, an ImportError otherwise."""
    if PURE:
        pytest.skip("ASYNCRL_PUREPYTHON=1: the compiled module is deliberately not used")
    return importlib.import_module("ext._replay")


def _rows(rng: np.random.Generator, n: int, spec=SPEC, start: int = 0) -> dict[str, np.ndarray]:
    """``n`` rows for ``spec``; field values encode the row number where the dtype allows."""
    out = {}
    for name, (shape, dtype) in spec.items():
        dt = np.dtype(dtype)
        if dt.kind == "b":
            a = rng.random((n, *shape)) < 0.5
        elif dt.kind in "iu":
            a = (np.arange(start, start + n).reshape(n, *([1] * len(shape))) + np.zeros((n, *shape), dtype=np.int64)) % 100
        else:
            a = rng.standard_normal((n, *shape))
        out[name] = np.ascontiguousarray(a, dtype=dt)
    return out


# ---------------------------------------------------------------------------------------------
# oracle: the compiled buffer and the reference side by side


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the exception is the answer being compared
        return ("raised", type(exc), str(exc))


def _same(a, b) -> bool:
    """Deep equality; arrays must agree in dtype, shape and bytes (so NaNs and -0.0 count)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class Pair:
    """Sends every call to the compiled buffer and to the reference; they must agree."""

    def __init__(self, module, *args, **kwargs) -> None:
        self.ext = module.ReplayBuffer(*args, **kwargs)
        self.ref = _replay_ref.ReplayBuffer(*args, **kwargs)
        self.check()

    def do(self, name: str, *args):
        got = _outcome(getattr(self.ext, name), *args)
        want = _outcome(getattr(self.ref, name), *args)
        assert _same(got, want), f"{name}: compiled {got!r}, reference {want!r}"
        self.check()
        return want

    def check(self) -> None:
        assert len(self.ext) == len(self.ref)
        assert self.ext.capacity == self.ref.capacity
        assert self.ext.prioritized == self.ref.prioritized
        assert self.ext.alpha == self.ref.alpha
        assert self.ext.seed == self.ref.seed
        assert self.ext.max_priority == self.ref.max_priority
        assert _same(self.ext.spec, self.ref.spec)
        assert _same(self.ext.storage(), self.ref.storage())


def _bad_batch(rng: random.Random, batch: dict[str, np.ndarray]) -> dict:
    """``batch`` with one thing wrong (or, now and then, still right)."""
    b = dict(batch)
    name = rng.choice(list(b))
    kind = rng.randrange(8)
    if kind == 0:
        del b[name]
    elif kind == 1:
        b["extra"] = b[name]
    elif kind == 2:
        b[name] = b[name].astype(np.float64 if b[name].dtype != np.float64 else np.float32)
    elif kind == 3:
        b[name] = b[name][..., None]
    elif kind == 4:
        b[name] = np.concatenate([b[name], b[name][:1]])  # one row too many
    elif kind == 5:
        b[name] = b[name].tolist()
    elif kind == 6:
        b = list(b.values())
    else:
        b[name] = b[name][::-1]  # non-contiguous, valid
    return b


BAD_N = [0, -1, 1.0, "2", None, True]
BAD_BETA = [-0.1, math.nan, math.inf, "x", None, True]


def _random_op(rng: random.Random, nrng: np.random.Generator, pair: Pair, serial: list[int]):
    """One operation, valid most of the time; invalid ones must fail the same way in both."""
    size, cap = len(pair.ref), pair.ref.capacity
    r = rng.random()
    if r < 0.35:
        n = rng.choice([0, 1, 1, 2, 3, cap - 1, cap, cap + 1, 2 * cap + 3, rng.randrange(1, 3 * cap + 2)])
        n = max(0, n)
        batch = _rows(nrng, n, start=serial[0])
        serial[0] += n
        if rng.random() < 0.15:
            batch = {k: np.asfortranarray(v) if v.ndim > 1 else v[::-1] for k, v in batch.items()}
        if rng.random() < 0.15:
            # the compiled add reads a dict in the spec's order, its own key objects: other
            # orders and equal keys that are other objects go the lookup way
            items = list(batch.items())
            rng.shuffle(items)
            batch = {"".join(list(k)) if rng.random() < 0.5 else k: v for k, v in items}
        if rng.random() < 0.2:
            batch = _bad_batch(rng, batch)
        elif rng.random() < 0.1:
            batch = types.MappingProxyType(batch)  # a Mapping that is not a dict
        return ("add", batch)
    if r < 0.7:
        n = rng.choice([1, 1, 2, 3, size, size + 1, max(1, size // 2)])
        if rng.random() < 0.07:
            n = rng.choice(BAD_N)
        beta = rng.choice([0.0, 0.4, 1.0, rng.random(), 2.5, 0])
        if rng.random() < 0.05:
            beta = rng.choice(BAD_BETA)
        return ("sample", n, beta)
    n = rng.choice([0, 1, 2, 5, size, 2 * size + 1])
    idx = nrng.integers(0, max(size, 1), n)
    pr = nrng.random(n) * 10 ** rng.choice([-3, 0, 2]) + 1e-9
    x = rng.random()
    if x < 0.04 and n:
        idx[rng.randrange(n)] = rng.choice([-1, size, size + 5])
    elif x < 0.08 and n:
        pr[rng.randrange(n)] = rng.choice([0.0, -1.0, math.nan, math.inf, -math.inf])
    elif x < 0.1:
        pr = pr[:-1] if n else pr
    elif x < 0.13:
        idx = idx.astype(rng.choice([np.int32, np.uint64, np.uint8 if size < 256 else np.uint16, np.float64]))
    elif x < 0.16:
        pr = pr.astype(rng.choice([np.float32, np.float16])) if rng.random() < 0.7 else pr.astype(np.int64) + 1
    elif x < 0.18:
        idx, pr = idx.tolist(), pr.tolist()
    elif x < 0.19:
        idx = idx.reshape(1, -1)
    elif x < 0.2:
        pr = pr.astype(np.complex128)
    elif x < 0.25 and n > 1:
        idx[1:] = idx[0]  # repeated slots: the last priority wins
    return ("update_priorities", idx, pr)


@pytest.mark.parametrize("seed", range(24))
def test_random_sequences_match_reference(compiled, seed):
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    capacity = rng.choice([1, 2, 3, 5, 8, 13, 16, 33])
    prioritized = seed % 3 != 0
    alpha = rng.choice([0.0, 0.6, 1.0, 0.5, 2.0])
    pair = Pair(compiled, capacity, SPEC, prioritized=prioritized, alpha=alpha, seed=seed)
    serial = [0]
    for _ in range(250):
        pair.do(*_random_op(rng, nrng, pair, serial))


def test_sequences_hit_every_path(compiled):
    """The random sequences reach wrap-around, oversized batches, repeated slots, failures."""
    seen = {"wrap": 0, "oversized": 0, "raised": 0, "ok_update": 0, "ok_sample": 0}
    for seed in range(24):
        rng = random.Random(seed)
        nrng = np.random.default_rng(seed)
        cap = rng.choice([1, 2, 3, 5, 8, 13, 16, 33])
        pair = Pair(compiled, cap, SPEC, prioritized=seed % 3 != 0, alpha=rng.choice([0.0, 0.6, 1.0, 0.5, 2.0]), seed=seed)
        serial = [0]
        for _ in range(250):
            op = _random_op(rng, nrng, pair, serial)
            out = pair.do(*op)
            if out[0] == "raised":
                seen["raised"] += 1
            elif op[0] == "add":
                n = len(out[1])
                seen["oversized"] += n > cap
                seen["wrap"] += n and (out[1][0] + n > cap)
            elif op[0] == "sample":
                seen["ok_sample"] += 1
            elif pair.ref.prioritized:
                seen["ok_update"] += 1
    assert all(v > 0 for v in seen.values()), seen


def test_large_batches_match_reference(compiled):
    """Loops long enough to release the GIL, a capacity that is not a power of two, a full ring."""
    nrng = np.random.default_rng(5)
    spec = {"obs": ((8,), np.float32), "a": ((), np.int32)}
    pair = Pair(compiled, 3000, spec, prioritized=True, alpha=0.7, seed=11)
    for n in (1000, 1500, 999, 2999, 7000):
        pair.do("add", _rows(nrng, n, spec))
        for _ in range(3):
            out = pair.do("sample", 500, 0.6)
            idx = out[1][1]
            pair.do("update_priorities", idx, nrng.random(len(idx)) * 5 + 0.01)
    pair.do("update_priorities", np.arange(3000), nrng.random(3000) + 0.5)
    pair.do("sample", 3000, 1.0)
    uni = Pair(compiled, 3000, spec, seed=3)
    uni.do("add", _rows(nrng, 4000, spec))
    uni.do("sample", 2000, 0.4)


class ReplayMachine(RuleBasedStateMachine):
    """Hypothesis drives both buffers with the same rules; every step must agree."""

    module = None  # the compiled module, set by the test

    def __init__(self) -> None:
        super().__init__()
        self.pair: Pair | None = None
        self.nrng = np.random.default_rng(0)
        self.serial = 0

    @initialize(
        capacity=st.integers(1, 12),
        prioritized=st.booleans(),
        alpha=st.sampled_from([0.0, 0.6, 1.0]),
        seed=st.integers(0, 2**64 - 1),
    )
    def make(self, capacity, prioritized, alpha, seed):
        self.pair = Pair(self.module, capacity, SPEC, prioritized=prioritized, alpha=alpha, seed=seed)

    @rule(n=st.integers(0, 30))
    def add(self, n):
        self.pair.do("add", _rows(self.nrng, n, start=self.serial))
        self.serial += n

    @rule(n=st.integers(-1, 14), beta=st.floats(0, 2) | st.sampled_from([-1.0, math.nan]))
    def sample(self, n, beta):
        self.pair.do("sample", n, beta)

    @rule(data=st.data())
    def update(self, data):
        size = len(self.pair.ref)
        n = data.draw(st.integers(0, 6))
        idx = data.draw(st.lists(st.integers(-1, size), min_size=n, max_size=n))
        finite = st.floats(-1.0, 1e3) | st.floats(1e-300, 1e-250) | st.floats(1e250, 1e300)
        odd = st.sampled_from([math.nan, math.inf, -math.inf, 0.0])
        pr = data.draw(st.lists(finite | odd, min_size=n, max_size=n))
        self.pair.do("update_priorities", np.array(idx, dtype=np.int64), np.array(pr, dtype=np.float64))

    @invariant()
    def agree(self):
        if self.pair is not None:
            self.pair.check()


def test_stateful_matches_reference(compiled):
    ReplayMachine.module = compiled
    run_state_machine_as_test(ReplayMachine, settings=settings(max_examples=60, stateful_step_count=30))


# ---------------------------------------------------------------------------------------------
# behaviour, on the selected backend


def test_backend_matches_the_switch():
    """"1" serves the reference; "0" and unset the compiled module (built wherever this runs)."""
    assert BACKEND == ("ref" if PURE else "ext")
    assert ReplayBuffer.__module__ == ("ext._replay_ref" if PURE else "ext._replay")


def test_chi_square_prioritized_frequencies():
    """200k stratified draws over 50 items with priorities 1..50: counts match p ** alpha."""
    k, alpha = 50, 0.7
    buf = ReplayBuffer(k, {"x": ((), np.int32)}, prioritized=True, alpha=alpha, seed=1234)
    buf.add({"x": np.arange(k, dtype=np.int32)})
    p = np.arange(1, k + 1, dtype=np.float64)[::-1].copy()
    buf.update_priorities(np.arange(k), p)
    counts = np.zeros(k)
    draws = 0
    while draws < 200_000:
        batch, idx, _ = buf.sample(k, 0.5)
        assert np.array_equal(batch["x"], idx)
        counts += np.bincount(idx, minlength=k)
        draws += k
    expected = draws * p**alpha / np.sum(p**alpha)
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    # 99.9% quantile of chi-square with 49 degrees of freedom (Wilson-Hilferty: 85.4). Stratified
    # draws vary less than independent ones, so this bound is conservative.
    assert chi2 < 85.4, chi2
    # and it is not trivially passing: uniform expectations are far off
    uniform = np.full(k, draws / k)
    assert float(np.sum((counts - uniform) ** 2 / uniform)) > 1000


def test_chi_square_single_draws():
    """Independent single draws (n=1) over 20 items: counts match p ** alpha."""
    k, alpha = 20, 1.0
    buf = ReplayBuffer(k, {"x": ((), np.int8)}, prioritized=True, alpha=alpha, seed=99)
    buf.add({"x": np.zeros(k, dtype=np.int8)})
    p = np.linspace(0.5, 5.0, k)
    buf.update_priorities(np.arange(k), p)
    draws = 20_000
    counts = np.bincount([int(buf.sample(1)[1][0]) for _ in range(draws)], minlength=k)
    expected = draws * p / p.sum()
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 43.8, chi2  # 99.9% quantile, 19 degrees of freedom


def test_chi_square_uniform():
    k = 37
    buf = ReplayBuffer(64, {"x": ((), np.int16)}, seed=7)
    buf.add({"x": np.arange(k, dtype=np.int16)})
    counts = np.zeros(k)
    for _ in range(2000):
        batch, idx, w = buf.sample(k)
        assert np.all(w == 1.0) and w.dtype == np.float64
        assert np.array_equal(batch["x"], idx)
        counts += np.bincount(idx, minlength=k)
    expected = counts.sum() / k
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 67.0, chi2  # 99.9% quantile, 36 degrees of freedom
    assert counts.min() > 0


def test_weights_match_a_direct_computation():
    cap, alpha, beta = 40, 0.6, 0.7
    buf = ReplayBuffer(cap, {"x": ((), np.float32)}, prioritized=True, alpha=alpha, seed=3)
    buf.add({"x": np.zeros(30, dtype=np.float32)})
    rng = np.random.default_rng(0)
    p = rng.random(30) * 100 + 0.001
    buf.update_priorities(np.arange(30), p)
    _, idx, w = buf.sample(30, beta)
    q = p**alpha
    P = q / q.sum()
    n = len(buf)
    direct = (n * P[idx]) ** -beta / np.max((n * P) ** -beta)
    assert w.dtype == np.float64
    np.testing.assert_allclose(w, direct, rtol=1e-12, atol=0)
    assert w.max() <= 1.0
    # the item with the least priority has weight exactly 1
    _, idx, w = buf.sample(30, beta)
    assert np.all((w == 1.0) == (idx == np.argmin(p)))


def test_new_items_get_the_running_max_priority():
    alpha = 0.5
    buf = ReplayBuffer(8, {"x": ((), np.int32)}, prioritized=True, alpha=alpha, seed=0)
    assert buf.max_priority == 1.0
    buf.add({"x": np.arange(4, dtype=np.int32)})
    _, _, w = buf.sample(4, 1.0)
    assert np.all(w == 1.0)  # every item has priority 1.0 so far
    buf.update_priorities(np.array([0, 1, 2, 3]), np.array([9.0, 0.25, 1.0, 4.0]))
    assert buf.max_priority == 9.0
    buf.update_priorities(np.array([0]), np.array([0.5]))  # lowering it keeps the running max
    assert buf.max_priority == 9.0
    new = buf.add({"x": np.array([10, 11], dtype=np.int32)})
    assert list(new) == [4, 5]
    q = {0: 0.5**alpha, 1: 0.25**alpha, 2: 1.0, 3: 4.0**alpha, 4: 9.0**alpha, 5: 9.0**alpha}
    q_min = min(q.values())
    for _ in range(20):
        _, idx, w = buf.sample(6, 1.0)
        for i, wi in zip(idx, w):
            assert wi == pytest.approx((q[int(i)] / q_min) ** -1.0, rel=1e-12)


def test_stratification_samples_equal_priorities_once_each():
    for cap in (16, 10, 1, 7):
        buf = ReplayBuffer(cap, {"x": ((), np.int32)}, prioritized=True, seed=cap)
        buf.add({"x": np.arange(cap, dtype=np.int32)})
        for _ in range(10):
            batch, idx, w = buf.sample(cap, 0.4)
            assert list(idx) == list(range(cap))  # one draw per segment, in segment order
            assert list(batch["x"]) == list(range(cap))
            assert np.all(w == 1.0)


def test_stratified_slots_come_out_sorted():
    buf = ReplayBuffer(100, {"x": ((), np.int32)}, prioritized=True, seed=5)
    buf.add({"x": np.arange(100, dtype=np.int32)})
    buf.update_priorities(np.arange(100), np.random.default_rng(1).random(100) + 0.1)
    for n in (1, 7, 50, 100):
        _, idx, _ = buf.sample(n)
        assert np.all(np.diff(idx) >= 0)


def test_wrap_around_keeps_the_last_capacity_rows():
    spec = {"v": ((2,), np.int64), "s": ((), np.uint16)}
    buf = ReplayBuffer(5, spec, seed=0)
    rows = np.arange(40, dtype=np.int64)

    def batch(lo, hi):
        return {"v": np.stack([rows[lo:hi], -rows[lo:hi]], axis=1), "s": rows[lo:hi].astype(np.uint16)}

    assert list(buf.add(batch(0, 3))) == [0, 1, 2]
    assert list(buf.add(batch(3, 7))) == [3, 4, 0, 1]  # wraps
    assert len(buf) == 5
    assert list(buf.storage()["s"]) == [5, 6, 2, 3, 4]
    assert list(buf.add(batch(7, 19))) == [(2 + i) % 5 for i in range(12)]  # longer than the ring
    # rows 14..18 survive; row r sits in slot (r - 7 + 2) % 5
    store = buf.storage()
    for r in range(14, 19):
        assert store["s"][(r - 5) % 5] == r
        assert list(store["v"][(r - 5) % 5]) == [r, -r]
    assert list(buf.add(batch(19, 20))) == [4]
    assert buf.storage()["s"][4] == 19
    assert len(buf) == 5


def test_oversized_batch_sets_priorities_of_every_slot():
    buf = ReplayBuffer(4, {"x": ((), np.int32)}, prioritized=True, seed=0)
    buf.add({"x": np.arange(2, dtype=np.int32)})
    buf.update_priorities(np.array([0, 1]), np.array([5.0, 3.0]))
    buf.add({"x": np.arange(9, dtype=np.int32)})
    _, idx, w = buf.sample(4, 1.0)
    assert list(idx) == [0, 1, 2, 3] and np.all(w == 1.0)  # all at max priority 5


def test_noncontiguous_and_fortran_inputs_are_copied_correctly():
    spec = {"m": ((3, 2), np.float64), "v": ((), np.int32)}
    buf = ReplayBuffer(10, spec, seed=0)
    base = np.arange(60, dtype=np.float64).reshape(10, 3, 2)
    m = np.asfortranarray(base[::2])
    v = np.arange(20, dtype=np.int32)[::4]
    buf.add({"m": m, "v": v})
    assert np.array_equal(buf.storage()["m"][:5], base[::2])
    assert np.array_equal(buf.storage()["v"][:5], v)


def test_all_supported_dtypes_round_trip():
    dtypes = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float16, np.float32, np.float64, np.complex64, ">i4", "<f8"]
    spec = {f"f{i}": ((2,), dt) for i, dt in enumerate(dtypes)}
    buf = ReplayBuffer(6, spec, seed=0)
    rng = np.random.default_rng(0)
    data = {k: (rng.random((4, 2)) * 100).astype(dt) for k, (_, dt) in spec.items()}
    buf.add(data)
    batch, idx, _ = buf.sample(4)
    for k in spec:
        assert batch[k].dtype == np.dtype(spec[k][1])
        assert batch[k].tobytes() == data[k][idx].tobytes()


def test_zero_row_add_changes_nothing():
    buf = ReplayBuffer(3, {"x": ((), np.int32)}, seed=0)
    out = buf.add({"x": np.zeros(0, dtype=np.int32)})
    assert out.dtype == np.int64 and out.shape == (0,)
    assert len(buf) == 0


def test_storage_views_are_read_only():
    buf = ReplayBuffer(3, {"x": ((2,), np.int32)}, seed=0)
    buf.add({"x": np.ones((2, 2), dtype=np.int32)})
    view = buf.storage()["x"]
    assert view.shape == (3, 2)
    with pytest.raises(ValueError):
        view[0, 0] = 5
    assert list(view[:, 0]) == [1, 1, 0]


def test_properties():
    buf = ReplayBuffer(7, {"o": (4, "float32"), "a": ([], int)}, prioritized=True, alpha=1, seed=np.uint64(3))
    assert buf.capacity == 7 and buf.prioritized is True and buf.alpha == 1.0 and buf.seed == 3
    assert buf.spec == {"o": ((4,), np.dtype(np.float32)), "a": ((), np.dtype(int))}


def _draws(buf, rounds: int = 6, n: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Fill ``buf`` (capacity >= 50, one int32 field "x") the same way every time, then the
    slots and weights of ``rounds`` samples of ``n``."""
    buf.add({"x": np.arange(50, dtype=np.int32)})
    if buf.prioritized:
        buf.update_priorities(np.arange(50), np.linspace(0.5, 7.0, 50))
    out = [buf.sample(n, 0.5) for _ in range(rounds)]
    return np.concatenate([o[1] for o in out]), np.concatenate([o[2] for o in out])


@pytest.mark.parametrize("prioritized", [False, True])
def test_an_unseeded_buffer_reports_the_seed_it_draws_with(prioritized):
    """Without a seed one is drawn from the OS, and ``seed`` is that one: a buffer given it
    draws exactly the same slots and weights."""
    spec = {"x": ((), np.int32)}
    drawn = ReplayBuffer(64, spec, prioritized=prioritized)
    replay = ReplayBuffer(64, spec, prioritized=prioritized, seed=drawn.seed)
    assert replay.seed == drawn.seed
    a, b = _draws(drawn), _draws(replay)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # and the draws depend on it: the next seed draws something else
    other = _draws(ReplayBuffer(64, spec, prioritized=prioritized, seed=(drawn.seed + 1) % 2**64))
    assert not np.array_equal(a[0], other[0])


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, None])
def test_compiled_and_reference_draw_the_same_for_a_seed(compiled, seed, prioritized):
    """The generator is part of the contract: for any 64-bit seed (None: one from the OS)
    both backends draw the same slots and weights, so a seeded run is the same run on either."""
    spec = {"x": ((), np.int32)}
    ext = compiled.ReplayBuffer(64, spec, prioritized=prioritized, seed=seed)
    ref = _replay_ref.ReplayBuffer(64, spec, prioritized=prioritized, seed=ext.seed)
    got, want = _draws(ext, rounds=20), _draws(ref, rounds=20)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


@pytest.mark.parametrize("prioritized", [False, True])
def test_seeded_buffers_reproduce_and_seeds_differ(prioritized):
    def run(seed):
        buf = ReplayBuffer(50, {"x": ((), np.int32)}, prioritized=prioritized, seed=seed)
        buf.add({"x": np.arange(50, dtype=np.int32)})
        if prioritized:
            buf.update_priorities(np.arange(50), np.arange(1, 51, dtype=np.float64))
        return np.concatenate([buf.sample(20)[1] for _ in range(5)])

    assert np.array_equal(run(1), run(1))
    assert not np.array_equal(run(1), run(2))
    a = ReplayBuffer(2, {"x": ((), np.int8)})
    b = ReplayBuffer(2, {"x": ((), np.int8)})
    assert a.seed != b.seed  # drawn from the OS


def test_update_priorities_on_a_uniform_buffer_is_refused():
    buf = ReplayBuffer(4, {"x": ((), np.int32)}, seed=0)
    buf.add({"x": np.zeros(2, dtype=np.int32)})
    with pytest.raises(TypeError, match="prioritized"):
        buf.update_priorities([0], [1.0])


def test_rounding_past_the_last_stored_leaf_is_clamped():
    """A draw that rounding carries past the stored leaves lands on the last stored slot.

    The reference is driven with a generator that always returns the largest double below 1,
    so the last stratum's draw is (n - 2**-53) * (T / n), which can round to T or above."""

    class Top:
        def random(self):
            return 1.0 - 2.0**-53

    hits = 0
    for n in range(1, 60):
        buf = _replay_ref.ReplayBuffer(64, {"x": ((), np.int8)}, prioritized=True, alpha=1.0, seed=0)
        buf.add({"x": np.zeros(n, dtype=np.int8)})
        buf.update_priorities(np.arange(n), 0.1 + 0.37 * np.arange(n) % 3.0 + 1e-3)
        buf._rng = Top()
        seg = float(buf._sum[1]) / n
        if (n - 1 + Top().random()) * seg >= float(buf._sum[1]):
            hits += 1
        _, idx, w = buf.sample(n)
        assert idx.max() <= n - 1 and np.all(np.isfinite(w)) and np.all(w > 0)
    assert hits > 0  # the edge case was reached


# ---------------------------------------------------------------------------------------------
# bad arguments: same exception type under both backends (messages compared by the oracle),
# and nothing changes


def _filled(prioritized=True):
    buf = ReplayBuffer(6, SPEC, prioritized=prioritized, alpha=1.5, seed=42)
    buf.add(_rows(np.random.default_rng(0), 4))
    return buf


GOOD = _rows(np.random.default_rng(1), 2)


def _with(**changes):
    b = dict(GOOD)
    for k, v in changes.items():
        if v is None:
            del b[k]
        else:
            b[k] = v
    return b


BAD_CALLS = [
    ("add not a mapping", lambda b: b.add([GOOD["obs"]]), TypeError),
    ("add missing field", lambda b: b.add(_with(act=None)), KeyError),
    ("add extra field", lambda b: b.add({**GOOD, "zzz": GOOD["act"]}), KeyError),
    ("add list value", lambda b: b.add(_with(act=[1, 2])), TypeError),
    ("add wrong dtype", lambda b: b.add(_with(obs=GOOD["obs"].astype(np.float64))), TypeError),
    ("add byte-swapped dtype", lambda b: b.add(_with(act=GOOD["act"].astype(">i8"))), TypeError),
    ("add wrong row shape", lambda b: b.add(_with(obs=np.zeros((2, 4), np.float32))), ValueError),
    ("add missing batch dim", lambda b: b.add(_with(obs=np.zeros(3, np.float32))), ValueError),
    ("add scalar array", lambda b: b.add(_with(act=np.int64(3))), TypeError),
    ("add 0-d array", lambda b: b.add(_with(act=np.array(3))), ValueError),
    ("add row count mismatch", lambda b: b.add(_with(done=np.zeros(3, np.bool_))), ValueError),
    ("sample n=0", lambda b: b.sample(0), ValueError),
    ("sample n<0", lambda b: b.sample(-3), ValueError),
    ("sample n float", lambda b: b.sample(2.0), TypeError),
    ("sample n bool", lambda b: b.sample(True), TypeError),
    ("sample n > len", lambda b: b.sample(5), ValueError),
    ("sample beta<0", lambda b: b.sample(2, -0.5), ValueError),
    ("sample beta nan", lambda b: b.sample(2, math.nan), ValueError),
    ("sample beta inf", lambda b: b.sample(2, math.inf), ValueError),
    ("sample beta str", lambda b: b.sample(2, "0.4"), TypeError),
    ("update length mismatch", lambda b: b.update_priorities([0, 1], [1.0]), ValueError),
    ("update index -1", lambda b: b.update_priorities([0, -1], [1.0, 1.0]), IndexError),
    ("update index == len", lambda b: b.update_priorities([4], [1.0]), IndexError),
    ("update index huge uint64", lambda b: b.update_priorities(np.array([2**64 - 1], np.uint64), [1.0]), IndexError),
    ("update priority 0", lambda b: b.update_priorities([0, 1], [1.0, 0.0]), ValueError),
    ("update priority negative", lambda b: b.update_priorities([0], [-2.0]), ValueError),
    ("update priority nan", lambda b: b.update_priorities([0], [math.nan]), ValueError),
    ("update priority inf", lambda b: b.update_priorities([0], [math.inf]), ValueError),
    ("update priority ** alpha overflows", lambda b: b.update_priorities([0, 1], [2.0, 1e250]), ValueError),
    ("update priority ** alpha underflows", lambda b: b.update_priorities([0], [1e-250]), ValueError),
    ("update float indices", lambda b: b.update_priorities([0.0], [1.0]), TypeError),
    ("update bool priorities", lambda b: b.update_priorities([0], [True]), TypeError),
    ("update 2-d indices", lambda b: b.update_priorities([[0]], [1.0]), ValueError),
    ("update 2-d priorities", lambda b: b.update_priorities([0], [[1.0]]), ValueError),
]


@pytest.mark.parametrize("prioritized", [True, False])
@pytest.mark.parametrize("what,call,exc", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_and_change_nothing(what, call, exc, prioritized):
    buf = _filled(prioritized)
    twin = _filled(prioritized)
    before = {k: v.copy() for k, v in buf.storage().items()}
    if what.startswith("update") and not prioritized:
        exc = TypeError  # a uniform buffer refuses update_priorities before looking at arguments
    with pytest.raises(exc):
        call(buf)
    assert len(buf) == len(twin) and buf.max_priority == twin.max_priority
    assert all(np.array_equal(before[k], v) for k, v in buf.storage().items())
    # neither the random generator nor the trees moved: both keep sampling alike
    for _ in range(3):
        a, b = buf.sample(4, 0.5), twin.sample(4, 0.5)
        assert np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_empty_buffer_cannot_be_sampled():
    buf = ReplayBuffer(3, {"x": ((), np.int8)}, seed=0)
    with pytest.raises(ValueError, match="empty"):
        buf.sample(1)


BAD_CONSTRUCTORS = [
    ((0, SPEC), {}, ValueError),
    ((-5, SPEC), {}, ValueError),
    ((2.5, SPEC), {}, TypeError),
    ((True, SPEC), {}, TypeError),
    ((4, [("x", ((), "f4"))]), {}, TypeError),
    ((4, {}), {}, ValueError),
    ((4, {1: ((), "f4")}), {}, TypeError),
    ((4, {"x": "f4"}), {}, TypeError),
    ((4, {"x": ((), "f4", 1)}), {}, TypeError),
    ((4, {"x": ((2.0,), "f4")}), {}, TypeError),
    ((4, {"x": ((0,), "f4")}), {}, ValueError),
    ((4, {"x": ((-1,), "f4")}), {}, ValueError),
    ((4, {"x": ((), "not-a-dtype")}), {}, TypeError),
    ((4, {"x": ((), object)}), {}, TypeError),
    ((4, {"x": ((), "U3")}), {}, TypeError),
    ((4, {"x": ((), [("a", "f4")])}), {}, TypeError),
    ((4, SPEC), {"prioritized": 1}, TypeError),
    ((4, SPEC), {"alpha": -0.1}, ValueError),
    ((4, SPEC), {"alpha": math.nan}, ValueError),
    ((4, SPEC), {"alpha": "0.6"}, TypeError),
    ((4, SPEC), {"alpha": 10**400}, ValueError),
    ((4, SPEC), {"seed": -1}, ValueError),
    ((4, SPEC), {"seed": 2**64}, ValueError),
    ((4, SPEC), {"seed": 1.5}, TypeError),
]


@pytest.mark.parametrize("args,kwargs,exc", BAD_CONSTRUCTORS)
def test_bad_constructor_arguments(args, kwargs, exc):
    with pytest.raises(exc):
        ReplayBuffer(*args, **kwargs)


@pytest.mark.parametrize("args,kwargs,exc", BAD_CONSTRUCTORS)
def test_bad_constructor_arguments_match_reference(compiled, args, kwargs, exc):
    got = _outcome(lambda: compiled.ReplayBuffer(*args, **kwargs))
    want = _outcome(lambda: _replay_ref.ReplayBuffer(*args, **kwargs))
    assert got == want and got[0] == "raised" and got[1] is exc


@pytest.mark.parametrize("what,call,exc", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_match_reference_messages(compiled, what, call, exc):
    ext = compiled.ReplayBuffer(6, SPEC, prioritized=True, alpha=1.5, seed=42)
    ref = _replay_ref.ReplayBuffer(6, SPEC, prioritized=True, alpha=1.5, seed=42)
    batch = _rows(np.random.default_rng(0), 4)
    ext.add(batch)
    ref.add(batch)
    got, want = _outcome(call, ext), _outcome(call, ref)
    assert got == want and got[1] is exc


# ---------------------------------------------------------------------------------------------
# properties (hypothesis), on the selected backend


@settings(max_examples=60)
@given(cap=st.integers(1, 9), sizes=st.lists(st.integers(0, 25), max_size=8))
def test_ring_contents_match_a_model(cap, sizes):
    """After any sequence of adds, slot s holds the last row written to it, and len is right."""
    buf = ReplayBuffer(cap, {"r": ((), np.int64)}, seed=0)
    model: dict[int, int] = {}
    row = 0
    pos = 0
    for n in sizes:
        slots = buf.add({"r": np.arange(row, row + n, dtype=np.int64)})
        assert list(slots) == [(pos + i) % cap for i in range(n)]
        for i in range(n):
            model[(pos + i) % cap] = row + i
        row += n
        pos = (pos + n) % cap
        assert len(buf) == min(cap, row)
    stored = buf.storage()["r"]
    for s, r in model.items():
        assert stored[s] == r


@settings(max_examples=40)
@given(
    p=st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=12),
    alpha=st.sampled_from([0.0, 0.3, 0.6, 1.0]),
    beta=st.floats(0, 1),
)
def test_sampled_slots_and_weights_are_valid(p, alpha, beta):
    k = len(p)
    buf = ReplayBuffer(16, {"x": ((), np.int32)}, prioritized=True, alpha=alpha, seed=k)
    buf.add({"x": np.arange(k, dtype=np.int32)})
    buf.update_priorities(np.arange(k), np.array(p))
    q = np.array(p) ** alpha
    for n in {1, k}:
        batch, idx, w = buf.sample(n, beta)
        assert np.all((idx >= 0) & (idx < k)) and np.array_equal(batch["x"], idx)
        np.testing.assert_allclose(w, (q[idx] / q.min()) ** -beta, rtol=1e-9)
        assert np.all(w <= 1.0) and np.all(w > 0)


# ---------------------------------------------------------------------------------------------
# compiled-only


def test_threads_sharing_a_buffer_do_not_crash(compiled):
    """Big calls release the GIL; concurrent callers wait their turn and nothing breaks."""
    spec = {"o": ((16,), np.float32)}
    buf = compiled.ReplayBuffer(5000, spec, prioritized=True, seed=0)
    buf.add({"o": np.zeros((5000, 16), np.float32)})
    errors: list[BaseException] = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                buf.add({"o": rng.standard_normal((700, 16), dtype=np.float32)})
                _, idx, _ = buf.sample(512)
                buf.update_priorities(idx, rng.random(512) + 0.1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _, idx, w = buf.sample(100, 1.0)
    assert np.all(w <= 1.0) and np.all(idx < 5000)


def test_compiled_object_cannot_be_reinitialised(compiled):
    """All memory is set up in __cinit__: calling __init__ again does nothing."""
    buf = compiled.ReplayBuffer(4, {"x": ((), np.int8)}, prioritized=True, seed=0)
    buf.add({"x": np.zeros(3, np.int8)})
    buf.__init__(100, {"y": ((), np.int8)})
    assert buf.capacity == 4 and len(buf) == 3
