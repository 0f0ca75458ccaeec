"""Compiled replay buffer; same API and results as ``ext._replay_ref`` (the oracle).

A fixed-capacity ring of transitions stored column by column, sampled uniformly or in
proportion to per-item priorities (prioritized experience replay). The reference's module
docstring describes the semantics (slots, trees, stratified sampling, weights, the random
generator); everything here gives bit-identical answers. What is specific to this module:

* Storage is one zero-filled numpy array per field (``(capacity, *shape)``, C order) whose
  data pointer, row size and dtype are kept in a C array of ``Field``; rows move with
  ``memcpy``. ``add`` checks every field against the spec through the numpy C API (dtype by
  pointer, then ``PyArray_EquivTypes``; ndim, dims, C-contiguity) and copies a batch in at
  most two ``memcpy`` per field (the wrap-around split). A non-contiguous input is first made
  contiguous by numpy. Dtypes must match exactly: a float64 array for a float32 field is a
  TypeError, never a silent cast.
* The priority trees are the reference's binary sum and min trees, stored at every other
  binary level only: the leaves, the level two above them, and so on up to the root. Each
  stored node's four children (its binary grandchildren) sit in one 64-byte block with their
  mins, ``[s0 s1 s2 s3 m0 m1 m2 m3]``, so a root-to-leaf path touches one cache line per two
  binary levels for both trees (ten lines for a 1M-leaf tree, where the flat pair of trees
  took up to forty). A node's sum is computed in the binary tree's order, ``(s0 + s1) + (s2 +
  s3)``, so it is bit for bit the reference's node, and the descent forms the skipped binary
  level's values (``s0 + s1``) with the same additions. The block memory is allocated on
  2 MiB boundaries and marked for transparent huge pages.
* Storage pages are paid for in the constructor, in one ``MADV_POPULATE_WRITE`` per field
  (the kernel zero-fills them in bulk, on the transparent huge pages numpy marks large arrays
  for; one written byte per page where the kernel predates it), so the first pass over a
  fresh buffer runs as fast as every later one and does not swing with where its page faults
  land. A buffer's whole storage is resident from the start, as cpprb's is.
* Rows go into a field whose storage is far larger than the cache (16 MiB and up) with
  streaming stores: the slots a full ring overwrites are cold, and a plain store would read
  each line before writing it.
* ``sample`` writes its indices into the returned int64 array and uses the returned float64
  weights array as the scratch space of the tree descent, so it allocates nothing else. The
  descent is level-synchronous: all ``n`` draws go down one level before any goes further,
  so their cache misses overlap, and the block each draw needs next is prefetched. Each step
  is branch-free.
* Tree updates set the leaves, then recompute every ancestor level by level (a node shared
  by several updated leaves is recomputed more than once, which is harmless: a node's value
  is a function of its children only). ``add`` updates one or two contiguous leaf ranges.
* The generator (xoshiro256**, Lemire bounded draws) is C code on a state kept in the object.

C loops are ``nogil`` functions, run in a ``with nogil:`` block when they handle
``_NOGIL_MIN`` rows or more and with the GIL held otherwise (releasing it costs more than a
short loop and getting it back can wait a whole switch interval). While it is released,
``_busy`` is set and every other method waits (GIL released) until the owner is done, so a
buffer shared between threads is never seen half-updated and never crashes; it is still not
thread-safe by contract (which thread goes first is up to the scheduler).
"""

import math
import numbers
import operator
import secrets
import sys
from collections.abc import Mapping

import numpy as np

cimport numpy as cnp
from cpython.dict cimport PyDict_GetItemWithError, PyDict_Next, PyDict_Size
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.math cimport INFINITY, pow
from libc.stdint cimport INT64_MAX, int64_t, uint64_t
from libc.string cimport memcpy

cnp.import_array()

__all__ = ["ReplayBuffer"]


cdef extern from "numpy/arrayobject.h":
    # Declared here with a raw descriptor: it steals a reference, which the caller provides.
    object _empty "PyArray_Empty"(int nd, cnp.npy_intp* dims, cnp.PyArray_Descr* descr, int fortran)


cdef extern from *:
    """
    #include <stdlib.h>
    #include <sys/mman.h>
    #define rb_prefetch(p) __builtin_prefetch((const void *)(p))
    #define rb_prefetch_w(p) __builtin_prefetch((const void *)(p), 1)
    #define rb_prefetch_l2(p) __builtin_prefetch((const void *)(p), 0, 1)
    /* Fault in [p, p + bytes) now, writable: the kernel zero-fills the pages in one call, in
       bulk (huge pages where the range is marked for them), rather than one fault per page
       when rows first land. Returns 0, or -1 where the kernel has no MADV_POPULATE_WRITE
       (Linux < 5.14) and the caller touches the pages itself. */
    static int rb_populate(char *p, size_t bytes) {
    #ifdef MADV_POPULATE_WRITE
        uintptr_t page = 4096, lo = ((uintptr_t)p + page - 1) & ~(page - 1), hi = ((uintptr_t)p + bytes) & ~(page - 1);
        if (hi <= lo) return 0;
        return madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) == 0 ? 0 : -1;
    #else
        (void)p; (void)bytes;
        return -1;
    #endif
    }
    static void rb_prefault(char *p, size_t bytes) {
        size_t k;
        if (rb_populate(p, bytes) == 0) return;
        for (k = 0; k < bytes; k += 4096) ((volatile char *)p)[k] = 0;  /* zero already: a write fault */
    }
    #if defined(__x86_64__) || defined(_M_X64)
    #include <emmintrin.h>
    /* memcpy for long copies into the ring: the slots written are cold (their last reader was
       long ago), so stores that skip the cache save reading every line before overwriting it
       (the read a plain store makes first: half the destination's memory traffic). */
    static void rb_copy_stream(char *dst, const char *src, size_t n) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15, k;
        if (n < 4096) { memcpy(dst, src, n); return; }
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        for (k = 0; k + 64 <= n; k += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + k)), b = _mm_loadu_si128((const __m128i *)(src + k + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + k + 32)), d = _mm_loadu_si128((const __m128i *)(src + k + 48));
            _mm_stream_si128((__m128i *)(dst + k), a); _mm_stream_si128((__m128i *)(dst + k + 16), b);
            _mm_stream_si128((__m128i *)(dst + k + 32), c); _mm_stream_si128((__m128i *)(dst + k + 48), d);
        }
        memcpy(dst + k, src + k, n - k);
        _mm_sfence();  /* the streamed rows are visible before the call returns */
    }
    #else
    #define rb_copy_stream memcpy
    #endif
    /* Memory on 2 MiB boundaries, marked for transparent huge pages: a priority tree is read
       along random root-to-leaf paths, and on 4 KiB pages nearly every lower level of a path
       is a TLB miss. Freed with free(). */
    static void *rb_alloc_pages(size_t bytes) {
        void *p = NULL;
        size_t align = (size_t)2 << 20, size = (bytes + align - 1) & ~(align - 1);
        if (size == 0 || posix_memalign(&p, align, size) != 0) return NULL;
    #ifdef MADV_HUGEPAGE
        (void)madvise(p, size, MADV_HUGEPAGE);
    #endif
        return p;
    }
    /* High and low halves of the 128-bit product a * b. */
    static inline uint64_t rb_mul128(uint64_t a, uint64_t b, uint64_t *low) {
        unsigned __int128 m = (unsigned __int128)a * b;
        *low = (uint64_t)m;
        return (uint64_t)(m >> 64);
    }
    """
    void rb_prefetch(const void* p) nogil
    void rb_prefetch_w(const void* p) nogil
    void rb_prefetch_l2(const void* p) nogil
    void* rb_alloc_pages(size_t bytes) nogil
    void rb_prefault(char* p, size_t bytes) nogil
    void rb_copy_stream(char* dst, const char* src, size_t n) nogil
    void rb_free "free"(void* p) nogil
    uint64_t rb_mul128(uint64_t a, uint64_t b, uint64_t* low) nogil


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef enum:
    _NOGIL_MIN = 64  # C loops over at least this many rows, draws or slots release the GIL
    _MAX_DIMS = 32
    _STACK_FIELDS = 16  # per-call field tables up to this size live on the C stack
    _STREAM_MIN_STORAGE = 16 << 20  # fields with more storage than this are written past the cache

cdef double _INV53 = 1.0 / 9007199254740992.0  # 2**-53
cdef str _KINDS = "biufc"


# ---------------------------------------------------------------------------------------------
# argument checks (same exceptions and messages as the reference)


cdef object _check_index(str name, object value, Py_ssize_t minimum):
    """An integer (int or numpy integer, not bool) >= ``minimum``, as given (a Python int)."""
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be an int, got bool")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


cdef double _check_real(str name, object value) except -1.0:
    """A finite real number >= 0, as a double."""
    cdef double v
    if type(value) is float:
        v = value
    else:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
        try:
            v = float(value)
        except OverflowError:
            v = INFINITY
    if not (v >= 0.0 and v < INFINITY):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return v


cdef object _check_seed(object seed):
    if seed is None:
        return secrets.randbits(64)
    v = _check_index("seed", seed, 0)
    if v >= 2**64:
        raise ValueError(f"seed must be < 2**64, got {v}")
    return v


cdef tuple _parse_spec(object spec):
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
        except Exception:  # numpy raises TypeError or ValueError for non-dtypes
            raise TypeError(f"field {name!r}: {dtype!r} is not a numpy dtype") from None
        if dt.kind not in _KINDS or dt.shape != ():
            raise TypeError(f"field {name!r}: dtype {dt} is not supported (use bool, an integer, float or complex type)")
        names.append(name)
        shapes.append(shape)
        dtypes.append(dt)
    return tuple(names), tuple(shapes), tuple(dtypes)


cdef str _expected_shape(tuple shape):
    return "(n" + "".join([f", {d}" for d in shape]) + ")"


# ---------------------------------------------------------------------------------------------
# the random generator: xoshiro256** (Blackman & Vigna), seeded by splitmix64


cdef inline uint64_t _splitmix64(uint64_t* state) noexcept nogil:
    cdef uint64_t z
    state[0] += 0x9E3779B97F4A7C15ULL
    z = state[0]
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline void _rng_seed(Rng* r, uint64_t seed) noexcept nogil:
    cdef uint64_t sm = seed
    cdef int i
    for i in range(4):
        r.s[i] = _splitmix64(&sm)


cdef inline uint64_t _rng_next(Rng* r) noexcept nogil:
    cdef uint64_t x = r.s[1] * 5
    cdef uint64_t result = ((x << 7) | (x >> 57)) * 9
    cdef uint64_t t = r.s[1] << 17
    r.s[2] ^= r.s[0]
    r.s[3] ^= r.s[1]
    r.s[1] ^= r.s[2]
    r.s[0] ^= r.s[3]
    r.s[2] ^= t
    r.s[3] = (r.s[3] << 45) | (r.s[3] >> 19)
    return result


cdef inline double _rng_random(Rng* r) noexcept nogil:
    """Uniform in [0, 1): the top 53 bits."""
    return <double>(_rng_next(r) >> 11) * _INV53


cdef inline uint64_t _rng_below(Rng* r, uint64_t bound) noexcept nogil:
    """Uniform in [0, bound), unbiased (Lemire 2019); 0 < bound."""
    cdef uint64_t low, threshold
    cdef uint64_t high = rb_mul128(_rng_next(r), bound, &low)
    if low < bound:
        threshold = (0 - bound) % bound
        while low < threshold:
            high = rb_mul128(_rng_next(r), bound, &low)
    return high


# ---------------------------------------------------------------------------------------------
# C loops (no Python objects)


cdef void _copy_in(const Field* fields, Py_ssize_t nf, const char** src, Py_ssize_t skip,
                   Py_ssize_t start, Py_ssize_t first, Py_ssize_t second, Py_ssize_t cap) noexcept nogil:
    """Rows [skip, skip + first) of each source go to slots [start, start + first), the next
    ``second`` rows to slots [0, second). A field whose storage is far larger than a core's
    cache is written with streaming stores: its slots are cold when overwritten; a small
    ring stays in cache and is copied plainly."""
    cdef Py_ssize_t f, rb
    for f in range(nf):
        rb = fields[f].row_bytes
        if rb * cap >= _STREAM_MIN_STORAGE:
            rb_copy_stream(fields[f].data + start * rb, src[f] + skip * rb, first * rb)
            if second:
                rb_copy_stream(fields[f].data, src[f] + (skip + first) * rb, second * rb)
        else:
            memcpy(fields[f].data + start * rb, src[f] + skip * rb, first * rb)
            if second:
                memcpy(fields[f].data, src[f] + (skip + first) * rb, second * rb)


cdef inline void _prefetch_row(const Field* fields, Py_ssize_t nf, Py_ssize_t slot) noexcept nogil:
    """Ask for the lines of the next add's row now, for writing. Adds of a few rows (an env
    stepper's) land on lines nothing has touched since the ring last passed, and every page
    or so on a page the TLB has lost: fetched here, they arrive while the caller is between
    calls instead of stalling the next add's copy."""
    cdef Py_ssize_t f, k, rb
    for f in range(nf):
        rb = fields[f].row_bytes
        for k in range(0, rb if rb < 512 else 512, 64):
            rb_prefetch_w(fields[f].data + slot * rb + k)


cdef void _gather(char* out, const char* data, Py_ssize_t rb, const int64_t* idx,
                  Py_ssize_t n) noexcept nogil:
    """out[j] = data[idx[j]], rows of ``rb`` bytes. Fixed small sizes compile to one move;
    long rows prefetch a few draws ahead, since the rows are scattered over the storage: every
    line of the row (up to 512 bytes), not its first alone (a scattered row's other lines are
    not fetched by the hardware before the copy reaches them), into L2 (the copy is eight
    draws behind, and 8 rows of lines in L1 would push out the output being written)."""
    cdef Py_ssize_t j, k
    if rb == 4:
        for j in range(n):
            memcpy(out + 4 * j, data + 4 * idx[j], 4)
    elif rb == 8:
        for j in range(n):
            memcpy(out + 8 * j, data + 8 * idx[j], 8)
    elif rb == 1:
        for j in range(n):
            out[j] = data[idx[j]]
    elif rb == 2:
        for j in range(n):
            memcpy(out + 2 * j, data + 2 * idx[j], 2)
    elif rb < 64:
        for j in range(n):
            memcpy(out + rb * j, data + rb * idx[j], rb)
    else:
        for j in range(n):
            if j + 8 < n:
                for k in range(0, rb if rb < 512 else 512, 64):
                    rb_prefetch_l2(data + rb * idx[j + 8] + k)
            memcpy(out + rb * j, data + rb * idx[j], rb)


cdef inline double* _node(const Tree* t, int k, int64_t i) noexcept nogil:
    """Node ``i`` of stored level ``k``: its sum; its min is 4 doubles further."""
    return t.data + t.off[k] + (i >> 2) * 8 + (i & 3)


cdef inline void _recompute(const Tree* t, int k, int64_t i) noexcept nogil:
    """Node ``i`` of level ``k`` from its children, block ``i`` of level ``k + 1``. The sum is
    taken in the binary tree's order (pairs first), so every stored node and every binary
    node the descent forms in between are the reference's values bit for bit."""
    cdef const double* c = t.data + t.off[k + 1] + i * 8
    cdef double* p = _node(t, k, i)
    cdef double a, b
    if t.shift[k + 1] == 2:
        p[0] = (c[0] + c[1]) + (c[2] + c[3])
        a = c[4] if c[4] < c[5] else c[5]
        b = c[6] if c[6] < c[7] else c[7]
        p[4] = a if a < b else b
    else:
        p[0] = c[0] + c[1]
        p[4] = c[4] if c[4] < c[5] else c[5]


cdef inline void _set_leaf(const Tree* t, int64_t slot, double q) noexcept nogil:
    cdef double* p = _node(t, t.nlv - 1, slot)
    p[0] = q
    p[4] = q


cdef void _tree_fill(const Tree* t, Py_ssize_t lo1, Py_ssize_t hi1, Py_ssize_t lo2, Py_ssize_t hi2,
                     double q) noexcept nogil:
    """Set leaves [lo1, hi1) and [lo2, hi2) (either may be empty) to ``q``, then recompute
    their ancestors level by level."""
    cdef Py_ssize_t i
    cdef int k, sh
    for i in range(lo1, hi1):
        _set_leaf(t, i, q)
    for i in range(lo2, hi2):
        _set_leaf(t, i, q)
    for k in range(t.nlv - 2, -1, -1):
        # the parents of nodes [a, b) are [a >> sh, ((b - 1) >> sh) + 1)
        sh = t.shift[k + 1]
        if hi1 > lo1:
            lo1 >>= sh
            hi1 = ((hi1 - 1) >> sh) + 1
            for i in range(lo1, hi1):
                _recompute(t, k, i)
        if hi2 > lo2:
            lo2 >>= sh
            hi2 = ((hi2 - 1) >> sh) + 1
            for i in range(lo2, hi2):
                _recompute(t, k, i)


cdef void _tree_update(const Tree* t, const int64_t* slots, const double* qs, int64_t* nodes,
                       Py_ssize_t n) noexcept nogil:
    """Set leaf ``slots[j]`` to ``qs[j]`` in order (a repeated slot keeps its last value), then
    recompute the ancestors; ``nodes`` is scratch for ``n`` (>= 1) node numbers.

    Level by level, so the cache misses of different paths overlap; the parent a path writes
    next is prefetched a few paths ahead (its children are the block just written, in cache).
    Paths that have met are recomputed once when they are adjacent (sampled slots come out
    sorted), more often otherwise, which is harmless; from the level that has no more nodes
    than there are paths, the whole span between the outermost paths is recomputed instead."""
    cdef Py_ssize_t j, w
    cdef int64_t i, prev, lo, hi
    cdef int k, kk, sh
    for j in range(n):
        _set_leaf(t, slots[j], qs[j])
        nodes[j] = slots[j]
    for k in range(t.nlv - 2, -1, -1):
        sh = t.shift[k + 1]
        if (<int64_t>1 << t.bits[k]) <= n:
            lo = nodes[0]
            hi = nodes[0]
            for j in range(1, n):
                if nodes[j] < lo:
                    lo = nodes[j]
                if nodes[j] > hi:
                    hi = nodes[j]
            kk = k
            while True:
                lo >>= t.shift[kk + 1]
                hi >>= t.shift[kk + 1]
                for i in range(lo, hi + 1):
                    _recompute(t, kk, i)
                if kk == 0:
                    break
                kk -= 1
            return
        prev = -1
        w = 0
        for j in range(n):
            if j + 8 < n:
                rb_prefetch_w(_node(t, k, nodes[j + 8] >> sh))
            i = nodes[j] >> sh
            if i != prev:
                _recompute(t, k, i)
                nodes[w] = i
                w += 1
                prev = i
        n = w


cdef void _draw_uniform(Rng* rng, int64_t* idx, Py_ssize_t n, uint64_t size) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(n):
        idx[j] = <int64_t>_rng_below(rng, size)


cdef void _draw_prioritized(Rng* rng, const Tree* t, Py_ssize_t size, double beta, int64_t* idx,
                            double* w, Py_ssize_t n) noexcept nogil:
    """Stratified draws: ``idx`` gets the slots, ``w`` (scratch for the descent) the weights.
    A step down a level of four children makes the binary tree's two steps: the left child's
    value is c0 + c1, then c0 or c2, exactly as the binary tree holds them."""
    cdef Py_ssize_t j
    cdef int k, go, go2
    cdef int64_t c, leaf
    cdef const double* b
    cdef const double* root = t.data + t.off[0]
    cdef double seg = root[0] / n, left, q_min = root[4]
    for j in range(n):
        w[j] = (<double>j + _rng_random(rng)) * seg
        idx[j] = 0
    for k in range(1, t.nlv):
        if t.shift[k] == 1:
            for j in range(n):
                b = t.data + t.off[k] + idx[j] * 8
                go = w[j] >= b[0]
                w[j] -= b[0] * go  # branch-free: left * 0.0 is 0.0, and u - 0.0 is u exactly
                idx[j] = 2 * idx[j] + go
            continue
        for j in range(n):
            b = t.data + t.off[k] + idx[j] * 8
            left = b[0] + b[1]
            go = w[j] >= left
            w[j] -= left * go
            left = b[2 * go]
            go2 = w[j] >= left
            w[j] -= left * go2
            c = 4 * idx[j] + 2 * go + go2
            idx[j] = c
            if k + 1 < t.nlv:
                rb_prefetch(t.data + t.off[k + 1] + c * 8)
    for j in range(n):
        leaf = idx[j]
        if leaf >= size:  # rounding carried the draw past the last stored leaf
            leaf = size - 1
        idx[j] = leaf
        w[j] = pow(_node(t, t.nlv - 1, leaf)[0] / q_min, -beta)


cdef void _tree_layout(Tree* t, int depth) noexcept nogil:
    """The stored levels of a tree of depth ``depth``: binary levels depth, depth - 2, ... down
    to 0 or 1, and the root; blocks of four nodes each (one for a level of one or two)."""
    cdef int k, nlv = depth // 2 + 1 + depth % 2
    cdef Py_ssize_t off = 0
    t.nlv = nlv
    for k in range(nlv):
        t.bits[k] = depth - 2 * (nlv - 1 - k) if k > 0 else 0
        t.shift[k] = t.bits[k] - t.bits[k - 1] if k > 0 else 0
        t.off[k] = off
        off += (((<Py_ssize_t>1 << t.bits[k]) + 3) // 4) * 8


cdef inline int _wait_idle(ReplayBuffer b) except -1:
    """Wait (GIL released) while another thread is inside a GIL-free section of ``b``."""
    while b._busy:
        with nogil:
            sched_yield()
    return 0


# ---------------------------------------------------------------------------------------------


cdef class ReplayBuffer:
    """Fixed-capacity columnar ring of transitions with uniform or prioritized sampling."""

    def __cinit__(self, capacity, spec, prioritized=False, alpha=0.6, seed=None):
        # Everything is allocated here, once: there is no __init__ to call again, so the
        # pointers never change while a thread works on them without the GIL.
        cdef Py_ssize_t cap, f, k, ndims = 0, leaves = 1, size_doubles
        cdef int depth = 0
        cdef cnp.ndarray arr
        cdef cnp.npy_intp* dims
        cap = _check_index("capacity", capacity, 1)
        names, shapes, dtypes = _parse_spec(spec)
        if not isinstance(prioritized, bool):
            raise TypeError(f"prioritized must be a bool, got {type(prioritized).__name__}")
        self._alpha = _check_real("alpha", alpha)
        self._seed = _check_seed(seed)
        self._cap = cap
        self._names = names
        self._shapes = shapes
        self._dtypes = dtypes
        self._expected = tuple([_expected_shape(s) for s in shapes])
        self._name_set = frozenset(names)
        self._nfields = len(names)
        self._prioritized = prioritized
        _rng_seed(&self._rng, <uint64_t>self._seed)
        self._arrays = tuple([np.zeros((cap, *s), dtype=d) for s, d in zip(shapes, dtypes)])
        for s in shapes:
            ndims += 1 + len(s)
        self._fields = <Field*>PyMem_Malloc(self._nfields * sizeof(Field))
        self._dims = <cnp.npy_intp*>PyMem_Malloc(ndims * sizeof(cnp.npy_intp))
        if self._fields == NULL or self._dims == NULL:
            raise MemoryError()
        dims = self._dims
        for f in range(self._nfields):
            arr = self._arrays[f]
            self._fields[f].data = <char*>cnp.PyArray_DATA(arr)
            self._fields[f].row_bytes = cnp.PyArray_STRIDES(arr)[0]
            self._fields[f].descr = <cnp.PyArray_Descr*>dtypes[f]
            self._fields[f].ndim = 1 + len(shapes[f])
            self._fields[f].dims = dims
            dims[0] = 0
            for k in range(len(shapes[f])):
                dims[1 + k] = shapes[f][k]
            dims += self._fields[f].ndim
        # The storage's pages are paid for here, once, in bulk: the first pass over a fresh
        # buffer then runs at the speed of every later one (see the module docstring).
        with nogil:
            for f in range(self._nfields):
                rb_prefault(self._fields[f].data, <size_t>(self._fields[f].row_bytes * cap))
        self._max_p = 1.0
        self._max_q = pow(1.0, self._alpha)
        while leaves < cap:
            leaves *= 2
            depth += 1
        self._leaves = leaves
        self._depth = depth
        self._q_limit = sys.float_info.max / (2 * leaves)
        if prioritized:
            _tree_layout(&self._tree, depth)
            size_doubles = self._tree.off[self._tree.nlv - 1] + max(leaves // 4, 1) * 8
            self._tree.data = <double*>rb_alloc_pages(size_doubles * sizeof(double))
            if self._tree.data == NULL:
                raise MemoryError(f"ReplayBuffer: cannot allocate priority trees of {leaves} leaves")
            for k in range(0, size_doubles, 8):
                for f in range(4):
                    self._tree.data[k + f] = 0.0
                    self._tree.data[k + 4 + f] = INFINITY

    def __dealloc__(self):
        PyMem_Free(self._fields)
        PyMem_Free(self._dims)
        rb_free(self._tree.data)

    # -- properties ---------------------------------------------------------------------------

    @property
    def capacity(self):
        return self._cap

    @property
    def spec(self):
        return {n: (s, d) for n, s, d in zip(self._names, self._shapes, self._dtypes)}

    @property
    def prioritized(self):
        return self._prioritized

    @property
    def alpha(self):
        return self._alpha

    @property
    def seed(self):
        return self._seed

    @property
    def max_priority(self):
        return self._max_p

    def __len__(self):
        return self._size

    def storage(self):
        """Read-only views of the whole storage, ``(capacity, *shape)`` per field (slots >= len
        hold zeros); they change as rows are added."""
        out = {}
        for name, a in zip(self._names, self._arrays):
            view = a.view()
            view.flags.writeable = False
            out[name] = view
        return out

    # -- add ----------------------------------------------------------------------------------

    cdef Py_ssize_t _check_field(self, Py_ssize_t f, object a, Py_ssize_t n, const char** src,
                                 PyObject** held) except -1:
        """Check ``a`` against field ``f`` (and the row count ``n`` of field 0, if f > 0); on
        success its rows' address goes to ``src[f]`` and a reference to ``held[f]``. Returns
        its row count."""
        cdef Field* fd = &self._fields[f]
        cdef cnp.ndarray arr
        cdef cnp.PyArray_Descr* d
        cdef cnp.npy_intp* dims
        cdef int k
        cdef bint ok
        if not cnp.PyArray_Check(a):
            raise TypeError(f"field {self._names[f]!r}: expected a numpy array, got {type(a).__name__}")
        arr = <cnp.ndarray>a
        d = cnp.PyArray_DESCR(arr)
        if d != fd.descr and not cnp.PyArray_EquivTypes(<cnp.dtype>d, <cnp.dtype>fd.descr):
            raise TypeError(
                f"field {self._names[f]!r}: dtype {arr.dtype} does not match the spec's "
                f"{self._dtypes[f]} (no implicit casting)"
            )
        ok = cnp.PyArray_NDIM(arr) == fd.ndim
        if ok:
            dims = cnp.PyArray_DIMS(arr)
            for k in range(1, fd.ndim):
                if dims[k] != fd.dims[k]:
                    ok = False
                    break
        if not ok:
            raise ValueError(f"field {self._names[f]!r}: expected shape {self._expected[f]}, got {(<object>arr).shape}")
        if f > 0 and cnp.PyArray_DIMS(arr)[0] != n:
            raise ValueError(
                f"field {self._names[f]!r} has {cnp.PyArray_DIMS(arr)[0]} rows, field {self._names[0]!r} has {n}"
            )
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            arr = np.ascontiguousarray(arr)
        src[f] = <const char*>cnp.PyArray_DATA(arr)
        Py_INCREF(arr)
        held[f] = <PyObject*>arr
        return cnp.PyArray_DIMS(arr)[0]

    def add(self, batch):
        """Append the rows of ``batch`` (every field, shape ``(n, *shape)``, the spec's dtype
        exactly); returns the slot of each row (int64[n]). Beyond capacity the oldest rows are
        overwritten, as if the rows were added one at a time."""
        cdef Py_ssize_t nf = self._nfields, f, nheld = 0, n = 0, j, p
        cdef Py_ssize_t cap = self._cap, keep, skip, start, first, second
        cdef const char* stack_src[_STACK_FIELDS]
        cdef PyObject* stack_held[_STACK_FIELDS]
        cdef const char** src = stack_src
        cdef PyObject** held = stack_held
        cdef PyObject* item
        cdef PyObject* entry
        cdef Py_ssize_t at = 0
        cdef cnp.ndarray out
        cdef int64_t* slots
        cdef bint is_dict = type(batch) is dict
        if not is_dict and not isinstance(batch, Mapping):
            raise TypeError(f"batch must be a mapping of field name to array, got {type(batch).__name__}")
        if nf > _STACK_FIELDS:
            src = <const char**>PyMem_Malloc(nf * sizeof(char*))
            held = <PyObject**>PyMem_Malloc(nf * sizeof(PyObject*))
            if src == NULL or held == NULL:
                PyMem_Free(src)
                PyMem_Free(held)
                raise MemoryError()
        try:
            for f in range(nf):
                name = self._names[f]
                if is_dict:
                    # A batch built from the spec's names holds them in its order, the same str
                    # objects: its f-th entry is then field f, with no hash lookup. Any other
                    # key is looked up.
                    if not (PyDict_Next(batch, &at, &entry, &item) and entry == <PyObject*>name):
                        item = PyDict_GetItemWithError(batch, name)
                        if item == NULL:
                            raise KeyError(f"batch is missing field {name!r}")
                    a = <object>item
                else:
                    if name not in batch:
                        raise KeyError(f"batch is missing field {name!r}")
                    a = batch[name]
                n = self._check_field(f, a, n, src, held)
                nheld += 1
            if (PyDict_Size(batch) if is_dict else len(batch)) != nf:
                for key in batch:
                    if key not in self._name_set:
                        raise KeyError(f"batch has unexpected field {key!r}")
            out = cnp.PyArray_SimpleNew(1, <cnp.npy_intp*>&n, cnp.NPY_INT64)
            slots = <int64_t*>cnp.PyArray_DATA(out)
            _wait_idle(self)
            p = self._pos
            for j in range(n):
                slots[j] = p
                p += 1
                if p == cap:
                    p = 0
            if n:
                keep = n if n < cap else cap  # of a longer batch only the last `cap` rows survive
                skip = n - keep
                start = self._pos + skip
                if start >= cap:  # skip > 0 only for a batch longer than the buffer: no division otherwise
                    start %= cap
                first = keep if keep < cap - start else cap - start
                second = keep - first
                if n >= _NOGIL_MIN:
                    self._busy = 1
                    with nogil:
                        _copy_in(self._fields, nf, src, skip, start, first, second, cap)
                        if self._prioritized:
                            _tree_fill(&self._tree, start, start + first, 0, second, self._max_q)
                    self._busy = 0
                else:
                    _copy_in(self._fields, nf, src, skip, start, first, second, cap)
                    if self._prioritized:
                        _tree_fill(&self._tree, start, start + first, 0, second, self._max_q)
                    _prefetch_row(self._fields, nf, p)
                self._pos = p
                self._size = cap if self._size + n >= cap else self._size + n
            return out
        finally:
            for f in range(nheld):
                Py_DECREF(<object>held[f])
            if nf > _STACK_FIELDS:
                PyMem_Free(src)
                PyMem_Free(held)

    # -- priorities ---------------------------------------------------------------------------

    def update_priorities(self, indices, priorities):
        """Set the priorities of stored slots; each must be finite and > 0 (``p ** alpha``
        must be a positive float small enough that the tree total stays finite). A repeated
        slot keeps its last priority; the running maximum counts them all."""
        cdef cnp.ndarray idx, idx64, pr, pr64
        cdef Py_ssize_t n, j, size
        cdef const int64_t* slots
        cdef const double* ps
        cdef double* qs
        cdef int64_t* nodes
        cdef double p, q, top, alpha = self._alpha
        if not self._prioritized:
            raise TypeError("update_priorities needs a prioritized buffer (this one has prioritized=False)")
        idx = indices if cnp.PyArray_Check(indices) else np.asarray(indices)
        if cnp.PyArray_TYPE(idx) != cnp.NPY_INT64 or cnp.PyArray_NDIM(idx) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(idx):
            if idx.dtype.kind not in "iu" and idx.size:
                raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
            if idx.ndim != 1:
                raise ValueError(f"indices must be 1-D, got shape {(<object>idx).shape}")
            if idx.dtype.kind == "u" and idx.dtype.itemsize == 8:
                # values above INT64_MAX are out of range anyway: clamp them rather than wrap
                idx64 = np.ascontiguousarray(np.minimum(idx, INT64_MAX), dtype=np.int64)
            else:
                idx64 = np.ascontiguousarray(idx, dtype=np.int64) if idx.size else np.empty(0, dtype=np.int64)
        else:
            idx64 = idx
        pr = priorities if cnp.PyArray_Check(priorities) else np.asarray(priorities)
        if cnp.PyArray_TYPE(pr) != cnp.NPY_FLOAT64 or cnp.PyArray_NDIM(pr) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(pr):
            if pr.dtype.kind not in "iuf" and pr.size:
                raise TypeError(f"priorities must be real numbers, got dtype {pr.dtype}")
            if pr.ndim != 1:
                raise ValueError(f"priorities must be 1-D, got shape {(<object>pr).shape}")
            pr64 = np.ascontiguousarray(pr, dtype=np.float64) if pr.size else np.empty(0)
        else:
            pr64 = pr
        n = cnp.PyArray_DIMS(idx64)[0]
        if n != cnp.PyArray_DIMS(pr64)[0]:
            raise ValueError(f"{n} indices but {cnp.PyArray_DIMS(pr64)[0]} priorities")
        _wait_idle(self)
        size = self._size
        slots = <const int64_t*>cnp.PyArray_DATA(idx64)
        ps = <const double*>cnp.PyArray_DATA(pr64)
        for j in range(n):
            if slots[j] < 0 or slots[j] >= size:
                raise IndexError(f"index {int(idx[j])} (position {j}) is out of range for {size} stored items")
        if n == 0:
            return
        qs = <double*>PyMem_Malloc(n * (sizeof(double) + sizeof(int64_t)))
        if qs == NULL:
            raise MemoryError()
        nodes = <int64_t*>(qs + n)
        try:
            top = self._max_p
            for j in range(n):
                p = ps[j]
                if not (p > 0.0 and p < INFINITY):
                    raise ValueError(f"priority {p!r} (position {j}) must be finite and > 0")
                q = pow(p, alpha)
                if not (q > 0.0 and q <= self._q_limit):
                    raise ValueError(f"priority {p!r} (position {j}) ** alpha={alpha!r} is out of range")
                qs[j] = q
                if p > top:
                    top = p
            if n >= _NOGIL_MIN:
                self._busy = 1
                with nogil:
                    _tree_update(&self._tree, slots, qs, nodes, n)
                self._busy = 0
            else:
                _tree_update(&self._tree, slots, qs, nodes, n)
            if top > self._max_p:
                self._max_p = top
                self._max_q = pow(top, alpha)
        finally:
            PyMem_Free(qs)

    # -- sample -------------------------------------------------------------------------------

    def sample(self, n, beta=0.4):
        """``n`` rows (1 <= n <= len) drawn with replacement: uniformly, or stratified in
        proportion to ``p ** alpha``. Returns (batch, slots int64[n], weights float64[n]);
        weights are 1.0 in a uniform buffer, else normalised importance weights
        ``(q_i / q_min) ** -beta`` (max 1 over the stored items)."""
        cdef Py_ssize_t k, f, size, nf = self._nfields
        cdef double b
        cdef cnp.ndarray idx, w, o
        cdef int64_t* ip
        cdef double* wp
        cdef Field* fd
        cdef dict batch
        cdef char* stack_dst[_STACK_FIELDS]
        cdef char** dst = stack_dst
        k = _check_index("n", n, 1)
        b = _check_real("beta", beta)
        _wait_idle(self)
        size = self._size
        if size == 0:
            raise ValueError("cannot sample from an empty buffer")
        if k > size:
            raise ValueError(f"n={k} is more than the {size} items stored")
        idx = cnp.PyArray_SimpleNew(1, <cnp.npy_intp*>&k, cnp.NPY_INT64)
        w = cnp.PyArray_SimpleNew(1, <cnp.npy_intp*>&k, cnp.NPY_FLOAT64)
        ip = <int64_t*>cnp.PyArray_DATA(idx)
        wp = <double*>cnp.PyArray_DATA(w)
        if nf > _STACK_FIELDS:
            dst = <char**>PyMem_Malloc(nf * sizeof(char*))
            if dst == NULL:
                raise MemoryError()
        try:
            batch = {}
            for f in range(nf):
                fd = &self._fields[f]
                fd.dims[0] = k
                Py_INCREF(<object>fd.descr)  # _empty steals it
                o = _empty(fd.ndim, fd.dims, fd.descr, 0)
                dst[f] = <char*>cnp.PyArray_DATA(o)
                batch[self._names[f]] = o
            if k >= _NOGIL_MIN:
                self._busy = 1
                with nogil:
                    self._draw_and_gather(ip, wp, k, size, b, dst)
                self._busy = 0
            else:
                self._draw_and_gather(ip, wp, k, size, b, dst)
        finally:
            if nf > _STACK_FIELDS:
                PyMem_Free(dst)
        return batch, idx, w

    cdef void _draw_and_gather(self, int64_t* ip, double* wp, Py_ssize_t k, Py_ssize_t size,
                               double beta, char** dst) noexcept nogil:
        cdef Py_ssize_t f, j
        if self._prioritized:
            _draw_prioritized(&self._rng, &self._tree, size, beta, ip, wp, k)
        else:
            _draw_uniform(&self._rng, ip, k, <uint64_t>size)
            for j in range(k):
                wp[j] = 1.0
        for f in range(self._nfields):
            _gather(dst[f], self._fields[f].data, self._fields[f].row_bytes, ip, k)
