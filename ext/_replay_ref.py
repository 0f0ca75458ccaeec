"""Pure-Python reference of the replay buffer (the oracle for ``ext._replay``).

A fixed-capacity ring of transitions stored column by column, sampled uniformly or in
proportion to per-item priorities (prioritized experience replay, Schaul et al. 2016).

Storage: one numpy array per field, shape ``(capacity, *shape)``, zero-filled. The writer
cursor ``pos`` is the slot the next row goes to; ``size`` counts the stored rows, which always
occupy slots ``[0, size)`` (the ring fills from slot 0, then overwrites the oldest row).

Priorities (prioritized buffers only) live in two flat binary trees over ``L`` leaves, ``L``
the smallest power of two >= capacity: node ``i`` has children ``2i`` and ``2i + 1``, the root
is node 1, leaf ``j`` is node ``L + j``. Leaf ``j`` holds ``q_j = p_j ** alpha`` for a stored
slot, 0.0 (sum tree) or +inf (min tree) for an empty one. Every inner node is recomputed as
``left + right`` (``min(left, right)``) from its children after they change, never adjusted by
a delta, so each tree is a pure function of its leaves: the compiled module, whatever order it
visits nodes in, gets bit-identical sums. A new row gets ``max_priority ** alpha``, where
``max_priority`` is the largest priority ever set (1.0 until one is).

Sampling is stratified: the total mass ``T`` is split into ``n`` equal segments; draw ``i``
takes ``u = (i + r) * (T / n)`` with ``r`` uniform in [0, 1) and descends from the root, going
left when ``u < left`` and otherwise subtracting ``left`` and going right. Rounding can carry
``u`` past the last stored leaf into the empty ones, so a leaf >= size is clamped to
``size - 1`` (the stored slot next to where it landed). Importance weights are
``w_i = (N P(i))**-beta / max_j (N P(j))**-beta``, which is exactly ``(q_i / q_min)**-beta``
with ``q_min`` the min tree's root: no ``N`` or ``T`` enters, so nothing overflows and
fewer roundings are made. Weights are float64 (1.0 in a uniform buffer).

The random generator is xoshiro256** seeded by splitmix64 from a 64-bit seed, written out
here on Python ints so the compiled module (in C, without the GIL) reproduces every draw;
uniform indices use Lemire's unbiased multiply-and-reject. Every float operation below is
one IEEE double operation done in the same order as in the compiled module (``math.pow`` is
the C library's ``pow``, which numpy's vectorised power need not be).

Arguments are checked before anything is written, so a call that raises changes nothing.
Not thread-safe: callers that share a buffer between threads must lock around it.
"""

from __future__ import annotations

import math
import numbers
import operator
import secrets
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ReplayBuffer"]

_M64 = (1 << 64) - 1
_TWO64 = 1 << 64
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_KINDS = "biufc"  # bool, signed and unsigned integers, floats, complex
_MAX_DIMS = 32


# ---------------------------------------------------------------------------------------------
# argument checks (the compiled module raises the same exceptions with the same messages)


def _check_index(name: str, value: object, minimum: int) -> int:
    """An integer (int or numpy integer, not bool) >= ``minimum``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _check_real(name: str, value: object) -> float:
    """A finite real number >= 0, as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not (v >= 0.0 and v < math.inf):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return v


def _check_seed(seed: object) -> int:
    if seed is None:
        return secrets.randbits(64)
    v = _check_index("seed", seed, 0)
    if v >= _TWO64:
        raise ValueError(f"seed must be < 2**64, got {v}")
    return v


def _parse_spec(spec: object) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...], tuple[np.dtype, ...]]:
    """Field names, shapes and dtypes, in the spec's order."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"spec must be a mapping of field name to (shape, dtype), got {type(spec).__name__}")
    if not spec:
        raise ValueError("spec has no fields")
    names, shapes, dtypes = [], [], []
    for name, entry in spec.items():
        if not isinstance(name, str):
            raise TypeError(f"field names must be str, got {type(name).__name__}")
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"field {name!r}: spec must be a (shape, dtype) pair, got {entry!r}")
        shape, dtype = entry
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise TypeError(f"field {name!r}: shape must be a tuple of ints, got {shape!r}")
        shape = tuple(shape)
        if len(shape) > _MAX_DIMS or not all(d >= 1 for d in shape):
            raise ValueError(f"field {name!r}: shape must have at most {_MAX_DIMS} dimensions, each >= 1, got {shape!r}")
        try:
            dt = np.dtype(dtype)
        except Exception:  # noqa: BLE001 - numpy raises TypeError or ValueError for non-dtypes
            raise TypeError(f"field {name!r}: {dtype!r} is not a numpy dtype") from None
        if dt.kind not in _KINDS or dt.shape != ():
            raise TypeError(f"field {name!r}: dtype {dt} is not supported (use bool, an integer, float or complex type)")
        names.append(name)
        shapes.append(shape)
        dtypes.append(dt)
    return tuple(names), tuple(shapes), tuple(dtypes)


def _expected_shape(shape: tuple[int, ...]) -> str:
    """'(n, 64)' for shape (64,): how an error message spells what a field must look like."""
    return "(n" + "".join(f", {d}" for d in shape) + ")"


# ---------------------------------------------------------------------------------------------
# the random generator: xoshiro256** (Blackman & Vigna), seeded by splitmix64


def _splitmix64(state: int) -> tuple[int, int]:
    """(new state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


class _Xoshiro256:
    __slots__ = ("s0", "s1", "s2", "s3")

    def __init__(self, seed: int) -> None:
        sm = seed
        sm, self.s0 = _splitmix64(sm)
        sm, self.s1 = _splitmix64(sm)
        sm, self.s2 = _splitmix64(sm)
        sm, self.s3 = _splitmix64(sm)

    def next(self) -> int:
        s0, s1, s2, s3 = self.s0, self.s1, self.s2, self.s3
        x = (s1 * 5) & _M64
        result = ((((x << 7) | (x >> 57)) & _M64) * 9) & _M64
        t = (s1 << 17) & _M64
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        s3 = ((s3 << 45) | (s3 >> 19)) & _M64
        self.s0, self.s1, self.s2, self.s3 = s0, s1, s2, s3
        return result

    def random(self) -> float:
        """Uniform in [0, 1): the top 53 bits."""
        return (self.next() >> 11) * _INV53

    def below(self, bound: int) -> int:
        """Uniform in [0, bound), unbiased (Lemire 2019); 0 < bound < 2**64."""
        m = self.next() * bound
        low = m & _M64
        if low < bound:
            threshold = (_TWO64 - bound) % bound
            while low < threshold:
                m = self.next() * bound
                low = m & _M64
        return m >> 64


# ---------------------------------------------------------------------------------------------


class ReplayBuffer:
    """Fixed-capacity columnar ring of transitions with uniform or prioritized sampling."""

    def __init__(
        self,
        capacity: int,
        spec: Mapping[str, tuple[Any, Any]],
        prioritized: bool = False,
        alpha: float = 0.6,
        seed: int | None = None,
    ) -> None:
        cap = _check_index("capacity", capacity, 1)
        names, shapes, dtypes = _parse_spec(spec)
        if not isinstance(prioritized, bool):
            raise TypeError(f"prioritized must be a bool, got {type(prioritized).__name__}")
        a = _check_real("alpha", alpha)
        self._seed = _check_seed(seed)
        self._cap = cap
        self._names = names
        self._shapes = shapes
        self._dtypes = dtypes
        self._expected = tuple(_expected_shape(s) for s in shapes)
        self._prioritized = prioritized
        self._alpha = a
        self._rng = _Xoshiro256(self._seed)
        self._arrays = {n: np.zeros((cap, *s), dtype=d) for n, s, d in zip(names, shapes, dtypes)}
        self._pos = 0
        self._size = 0
        self._max_p = 1.0
        self._max_q = math.pow(1.0, a)
        leaves = 1
        while leaves < cap:
            leaves *= 2
        self._leaves = leaves
        # Largest q = p ** alpha accepted: 2 * leaves of them still sum to a finite total.
        self._q_limit = sys.float_info.max / (2 * leaves)
        if prioritized:
            self._sum = np.zeros(2 * leaves, dtype=np.float64)
            self._min = np.full(2 * leaves, np.inf, dtype=np.float64)

    # -- properties ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {n: (s, d) for n, s, d in zip(self._names, self._shapes, self._dtypes)}

    @property
    def prioritized(self) -> bool:
        return self._prioritized

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def max_priority(self) -> float:
        return self._max_p

    def __len__(self) -> int:
        return self._size

    def storage(self) -> dict[str, np.ndarray]:
        """Read-only views of the whole storage, ``(capacity, *shape)`` per field (slots >= len
        hold zeros); they change as rows are added."""
        out = {}
        for name in self._names:
            view = self._arrays[name].view()
            view.flags.writeable = False
            out[name] = view
        return out

    # -- add ----------------------------------------------------------------------------------

    def _check_batch(self, batch: object) -> tuple[list[np.ndarray], int]:
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch must be a mapping of field name to array, got {type(batch).__name__}")
        arrays = []
        n = 0
        for f, name in enumerate(self._names):
            if name not in batch:
                raise KeyError(f"batch is missing field {name!r}")
            a = batch[name]
            if not isinstance(a, np.ndarray):
                raise TypeError(f"field {name!r}: expected a numpy array, got {type(a).__name__}")
            if a.dtype != self._dtypes[f]:
                raise TypeError(
                    f"field {name!r}: dtype {a.dtype} does not match the spec's {self._dtypes[f]} (no implicit casting)"
                )
            if a.ndim != 1 + len(self._shapes[f]) or a.shape[1:] != self._shapes[f]:
                raise ValueError(f"field {name!r}: expected shape {self._expected[f]}, got {a.shape}")
            if f == 0:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise ValueError(f"field {name!r} has {a.shape[0]} rows, field {self._names[0]!r} has {n}")
            arrays.append(a)
        if len(batch) != len(self._names):
            for key in batch:
                if key not in self._arrays:
                    raise KeyError(f"batch has unexpected field {key!r}")
        return arrays, n

    def add(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """Append the rows of ``batch`` (every field, shape ``(n, *shape)``, the spec's dtype
        exactly); returns the slot of each row (int64[n]). Beyond capacity the oldest rows are
        overwritten, as if the rows were added one at a time."""
        arrays, n = self._check_batch(batch)
        cap = self._cap
        slots = (self._pos + np.arange(n, dtype=np.int64)) % cap
        if n == 0:
            return slots
        keep = min(n, cap)  # of a batch longer than the ring only the last `cap` rows survive
        written = slots[n - keep :]
        for name, a in zip(self._names, arrays):
            self._arrays[name][written] = a[n - keep :]
        if self._prioritized:
            self._set_leaves(written, [self._max_q] * keep)
        self._pos = (self._pos + n) % cap
        self._size = min(cap, self._size + n)
        return slots

    # -- priorities ---------------------------------------------------------------------------

    def _set_leaves(self, slots: np.ndarray, qs: list[float]) -> None:
        """Set leaves (in order: a repeated slot keeps its last value), then recompute every
        ancestor level by level from its children."""
        leaves = self._leaves
        s, m = self._sum, self._min
        for slot, q in zip(slots.tolist(), qs):
            s[leaves + slot] = q
            m[leaves + slot] = q
        nodes = np.unique(np.asarray(slots, dtype=np.int64) + leaves)
        while leaves > 1:
            nodes = np.unique(nodes >> 1)
            s[nodes] = s[2 * nodes] + s[2 * nodes + 1]
            m[nodes] = np.minimum(m[2 * nodes], m[2 * nodes + 1])
            leaves >>= 1

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set the priorities of stored slots; each must be finite and > 0 (``p ** alpha``
        must be a positive float small enough that the tree total stays finite). A repeated
        slot keeps its last priority; the running maximum counts them all."""
        if not self._prioritized:
            raise TypeError("update_priorities needs a prioritized buffer (this one has prioritized=False)")
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu" and idx.size:
            raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        pr = np.asarray(priorities)
        if pr.dtype.kind not in "iuf" and pr.size:
            raise TypeError(f"priorities must be real numbers, got dtype {pr.dtype}")
        if pr.ndim != 1:
            raise ValueError(f"priorities must be 1-D, got shape {pr.shape}")
        if idx.shape[0] != pr.shape[0]:
            raise ValueError(f"{idx.shape[0]} indices but {pr.shape[0]} priorities")
        size = self._size
        slots = [int(i) for i in idx]
        for j, i in enumerate(slots):
            if i < 0 or i >= size:
                raise IndexError(f"index {i} (position {j}) is out of range for {size} stored items")
        ps = pr.astype(np.float64).tolist() if pr.size else []
        qs = []
        alpha = self._alpha
        for j, p in enumerate(ps):
            if not (p > 0.0 and p < math.inf):
                raise ValueError(f"priority {p!r} (position {j}) must be finite and > 0")
            try:
                q = math.pow(p, alpha)
            except OverflowError:  # C's pow gives inf, refused just below
                q = math.inf
            if not (q > 0.0 and q <= self._q_limit):
                raise ValueError(f"priority {p!r} (position {j}) ** alpha={alpha!r} is out of range")
            qs.append(q)
        if not slots:
            return
        self._set_leaves(np.asarray(slots, dtype=np.int64), qs)
        top = max(ps)
        if top > self._max_p:
            self._max_p = top
            self._max_q = math.pow(top, alpha)

    # -- sample -------------------------------------------------------------------------------

    def sample(self, n: int, beta: float = 0.4) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``n`` rows (1 <= n <= len) drawn with replacement: uniformly, or stratified in
        proportion to ``p ** alpha``. Returns (batch, slots int64[n], weights float64[n]);
        weights are 1.0 in a uniform buffer, else normalised importance weights
        ``(q_i / q_min) ** -beta`` (max 1 over the stored items)."""
        k = _check_index("n", n, 1)
        b = _check_real("beta", beta)
        size = self._size
        if size == 0:
            raise ValueError("cannot sample from an empty buffer")
        if k > size:
            raise ValueError(f"n={k} is more than the {size} items stored")
        rng = self._rng
        if not self._prioritized:
            idx = np.array([rng.below(size) for _ in range(k)], dtype=np.int64)
            weights = np.ones(k, dtype=np.float64)
        else:
            s = self._sum
            seg = float(s[1]) / k
            u = np.array([(i + rng.random()) * seg for i in range(k)], dtype=np.float64)
            node = np.ones(k, dtype=np.int64)
            leaves = self._leaves
            while leaves > 1:  # every draw descends one level per step
                left = s[2 * node]
                right = u >= left
                u = np.where(right, u - left, u)
                node = 2 * node + right
                leaves >>= 1
            idx = node - self._leaves
            np.minimum(idx, size - 1, out=idx)  # rounding past the last stored leaf
            q_min = float(self._min[1])
            qs = self._sum[self._leaves + idx].tolist()
            weights = np.array([math.pow(q / q_min, -b) for q in qs], dtype=np.float64)
        batch = {name: self._arrays[name][idx] for name in self._names}
        return batch, idx, weights
