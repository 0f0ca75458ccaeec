"""Compiled staleness-aware queue; same API and behaviour as ``ext._squeue_ref`` (the oracle).

A bounded FIFO whose every item carries the policy version it was generated with. The
consumer side holds the current version; an item older than ``version - max_staleness`` is
never handed out: it is evicted when the version is bumped, or refused on arrival if it is
already too old.

Layout (see _squeue.pxd):

* a ring of int64 versions (C array) and a list of item references of the same size, with a
  head index and a size: ``put`` writes one slot, ``get_batch`` moves references out of the
  oldest slots; both O(1) per item, no Python container is resized;
* a sorted table of the distinct versions present with their item counts. Versions nearly
  always arrive in order, so ``put``/``get`` touch its last/first entry in O(1) (a binary
  search otherwise). Its first entry is the oldest version present, so ``set_version`` knows
  in O(1) whether anything became stale and only scans the ring when something did;
* eviction finds, over the int64 ring alone, which positions stay and slides the kept
  versions together in place over the stale ones, from whichever end of the ring moves
  fewer (when the stale items are the oldest ones, as when versions arrive in order, it
  only advances the head); then it moves the item references along the same span with the
  GIL: kept ones are swapped into place, stale ones handed to the returned list, so the
  items' reference counts never change.

The ring starts preallocated at ``min(capacity, 65536)`` slots and doubles (up to
``capacity``) when full, so a large nominal capacity costs no memory until used.

C-only loops are ``nogil`` functions, run in a ``with nogil:`` block when they are long
(``_NOGIL_MIN`` positions or more) and with the GIL held otherwise: releasing the GIL around
a few hundred comparisons costs more than the loop, and getting it back can wait a whole
switch interval when another thread is busy. While it is released, ``_busy`` is set and
every other method waits (with the GIL released) until the owner is done, so a queue shared
between threads is never seen half-updated.

Versions are int64: ``set_version`` with a value above 2**63 - 1 raises ValueError (the
reference, on unbounded ints, accepts it); capacities, staleness bounds and batch sizes of
any size behave as in the reference.
"""

from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.ref cimport Py_INCREF
from libc.stdint cimport INT64_MAX, int64_t, uint8_t
from libc.string cimport memmove

from ext.errors import QueueFull

__all__ = ["QueueFull", "StalenessQueue"]


cdef extern from "Python.h":
    # Raw list access, for moving references without touching reference counts.
    list _list_new "PyList_New"(Py_ssize_t size)
    PyObject* _list_borrow "PyList_GET_ITEM"(object lst, Py_ssize_t i)
    void _list_steal "PyList_SET_ITEM"(object lst, Py_ssize_t i, PyObject* obj)


cdef inline void _take(list src, Py_ssize_t i, list dst, Py_ssize_t j) noexcept:
    """Move the reference in ``src[i]`` into the unset slot ``dst[j]``; ``src[i]`` becomes None."""
    _list_steal(dst, j, _list_borrow(src, i))
    Py_INCREF(None)
    _list_steal(src, i, <PyObject*>None)


cdef inline void _swap(list lst, Py_ssize_t i, Py_ssize_t j) noexcept:
    """Exchange two slots of ``lst`` (no reference count changes)."""
    cdef PyObject* a = _list_borrow(lst, i)
    _list_steal(lst, i, _list_borrow(lst, j))
    _list_steal(lst, j, a)


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef enum:
    _INITIAL_ALLOC = 1 << 16  # ring slots preallocated (fewer when the capacity is smaller)
    _INITIAL_VT = 16  # version-table entries preallocated
    _NOGIL_MIN = 1 << 14  # C loops at least this long release the GIL


# ---------------------------------------------------------------------------------------------
# argument checks (same messages as the reference)


cdef int64_t _check_int(str name, object value, int64_t minimum, bint* too_big) except -1:
    """``value`` as an int64 >= ``minimum``; ints beyond INT64_MAX set ``too_big`` and give INT64_MAX."""
    cdef int overflow = 0
    cdef long long x
    too_big[0] = False
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    x = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow > 0:
        too_big[0] = True
        return INT64_MAX
    if overflow < 0 or x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return x


cdef inline int64_t _check_version(StalenessQueue q, object version) except -1:
    cdef bint too_big
    cdef int64_t v = _check_int("version", version, 0, &too_big)
    if too_big or v > q._version:
        raise ValueError(f"item version {version} is newer than the queue's version {q._version_obj}")
    return v


# ---------------------------------------------------------------------------------------------
# ring and version table (C data only)


cdef inline Py_ssize_t _phys(const Ring* r, Py_ssize_t i) noexcept nogil:
    """Physical slot of logical position ``i`` (0 <= i <= size <= alloc)."""
    cdef Py_ssize_t p = r.head + i
    if p >= r.alloc:
        p -= r.alloc
    return p


cdef inline Py_ssize_t _vt_lower_bound(const Ring* r, int64_t v) noexcept nogil:
    """Index of the first version-table entry whose version is >= ``v``."""
    cdef Py_ssize_t lo = r.vt_lo, hi = r.vt_hi, mid
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if r.vt[mid].version < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline void _vt_add(Ring* r, int64_t v) noexcept nogil:
    """Count one more item of version ``v``; a free entry must have been reserved."""
    cdef Py_ssize_t n = r.vt_hi - r.vt_lo, pos
    if n and r.vt[r.vt_hi - 1].version == v:  # the common case: the newest version again
        r.vt[r.vt_hi - 1].count += 1
        return
    if n and v < r.vt[r.vt_lo].version and r.vt_lo > 0:  # older than everything present
        r.vt_lo -= 1
        r.vt[r.vt_lo].version = v
        r.vt[r.vt_lo].count = 1
        return
    if r.vt_hi == r.vt_alloc:  # slide the live entries down to free the end
        memmove(r.vt, r.vt + r.vt_lo, n * sizeof(VersionCount))
        r.vt_lo = 0
        r.vt_hi = n
    if n == 0 or r.vt[r.vt_hi - 1].version < v:
        pos = r.vt_hi
    else:
        pos = _vt_lower_bound(r, v)
        if r.vt[pos].version == v:
            r.vt[pos].count += 1
            return
        memmove(r.vt + pos + 1, r.vt + pos, (r.vt_hi - pos) * sizeof(VersionCount))
    r.vt[pos].version = v
    r.vt[pos].count = 1
    r.vt_hi += 1


cdef inline void _vt_remove(Ring* r, int64_t v) noexcept nogil:
    """Count one item of version ``v`` less; ``v`` is present."""
    cdef Py_ssize_t pos
    if r.vt[r.vt_lo].version == v:  # the common case: FIFO hands out the oldest version
        pos = r.vt_lo
    elif r.vt[r.vt_hi - 1].version == v:
        pos = r.vt_hi - 1
    else:
        pos = _vt_lower_bound(r, v)
    r.vt[pos].count -= 1
    if r.vt[pos].count:
        return
    if pos == r.vt_lo:
        r.vt_lo += 1
    else:
        memmove(r.vt + pos, r.vt + pos + 1, (r.vt_hi - pos - 1) * sizeof(VersionCount))
        r.vt_hi -= 1
    if r.vt_lo == r.vt_hi:
        r.vt_lo = 0
        r.vt_hi = 0


cdef void _store_versions(Ring* r, const int64_t* buf, Py_ssize_t n, int64_t floor) noexcept nogil:
    """Append the versions ``buf[:n]`` that are >= ``floor`` after the last item (slots and
    table entries reserved); the item references follow, with the GIL."""
    cdef Py_ssize_t k, t = r.size
    cdef int64_t v
    for k in range(n):
        v = buf[k]
        if v >= floor:
            r.vers[_phys(r, t)] = v
            _vt_add(r, v)
            t += 1


cdef void _forget_oldest(Ring* r, Py_ssize_t k) noexcept nogil:
    """Take the ``k`` oldest items out of the version table (the ring itself is not moved)."""
    cdef Py_ssize_t i
    for i in range(k):
        _vt_remove(r, r.vers[_phys(r, i)])


cdef bint _evict_versions(Ring* r, int64_t floor, Py_ssize_t n_evict, Py_ssize_t cut,
                          uint8_t* keep, Py_ssize_t* first_out, Py_ssize_t* last_out,
                          bint* upward_out) noexcept nogil:
    """Take the ``n_evict`` versions older than ``floor`` out of the ring.

    Finds the first and the last stale position (the scan stops at the last one), then
    slides the kept versions together in place, in order, over the stale ones, from
    whichever end moves fewer: downward (toward the head) over [first, size), or upward
    (toward the tail) over [0, last]; when the stale items are the oldest ones, as when
    versions arrive in order, nothing moves at all. ``keep[i]`` tells, for each position of
    that span, whether it stays; the item references follow with the GIL. Drops the version
    table entries before ``cut`` (those older than ``floor``). Returns False, having changed
    nothing, if the stale items are not all there (a corrupt table).
    """
    cdef Py_ssize_t i, j, seen = 0, first = -1, last = -1
    cdef int64_t x
    cdef bint upward
    for i in range(r.size):
        if r.vers[_phys(r, i)] < floor:
            if seen == 0:
                first = i
            seen += 1
            if seen == n_evict:
                last = i
                break
    if last < 0:
        return False
    upward = last + 1 < r.size - first
    first_out[0] = first
    last_out[0] = last
    upward_out[0] = upward
    if upward:
        j = last
        for i in range(last, -1, -1):
            x = r.vers[_phys(r, i)]
            if x >= floor:
                if j != i:
                    r.vers[_phys(r, j)] = x
                keep[i] = 1
                j -= 1
            else:
                keep[i] = 0
    else:
        j = first
        for i in range(first, r.size):
            x = r.vers[_phys(r, i)]
            if x >= floor:
                if j != i:
                    r.vers[_phys(r, j)] = x
                keep[i] = 1
                j += 1
            else:
                keep[i] = 0
    r.vt_lo = cut
    if r.vt_lo == r.vt_hi:
        r.vt_lo = 0
        r.vt_hi = 0
    return True


cdef int _vt_reserve(Ring* r, Py_ssize_t extra) except -1:
    """Make sure ``extra`` more distinct versions fit in the table (at most one per item)."""
    cdef Py_ssize_t n = r.vt_hi - r.vt_lo, want = r.vt_alloc
    cdef VersionCount* grown
    if r.vt_alloc - n >= extra:
        return 0
    if want < _INITIAL_VT:
        want = _INITIAL_VT
    while want - n < extra:
        want *= 2
    grown = <VersionCount*>PyMem_Realloc(r.vt, want * sizeof(VersionCount))
    if grown == NULL:
        raise MemoryError("StalenessQueue: cannot grow the version table")
    r.vt = grown
    r.vt_alloc = want
    return 0


cdef int _ring_reserve(StalenessQueue q, Py_ssize_t needed) except -1:
    """Make sure the ring has at least ``needed`` (<= capacity) slots; unwraps it when it grows."""
    cdef Ring* r = &q._ring
    cdef Py_ssize_t new_alloc, i, p
    cdef int64_t* vers
    cdef list items
    if needed <= r.alloc:
        return 0
    new_alloc = r.alloc * 2 if r.alloc <= q._cap // 2 else q._cap
    if new_alloc < needed:
        new_alloc = needed
    vers = <int64_t*>PyMem_Malloc(new_alloc * sizeof(int64_t))
    if vers == NULL:
        raise MemoryError(f"StalenessQueue: cannot allocate {new_alloc} slots")
    items = [None] * new_alloc
    for i in range(r.size):
        p = _phys(r, i)
        vers[i] = r.vers[p]
        items[i] = q._items[p]
    PyMem_Free(r.vers)
    r.vers = vers
    r.alloc = new_alloc
    r.head = 0
    q._items = items
    return 0


cdef inline int _wait_idle(StalenessQueue q) except -1:
    """Wait (GIL released) while another thread is inside a GIL-free section of ``q``."""
    while q._busy:
        with nogil:
            sched_yield()
    return 0


# ---------------------------------------------------------------------------------------------


cdef class StalenessQueue:
    """Bounded, version-tagged FIFO with a consumer-side staleness gate."""

    def __cinit__(self):
        # A consistent empty state (capacity 0) until __init__ runs, so even an object made
        # with StalenessQueue.__new__ fails cleanly instead of crashing.
        self._items = []
        self._cap = 0
        self._ms = 0
        self._version = 0
        self._version_obj = 0

    def __init__(self, capacity, max_staleness):
        cdef bint too_big
        cdef int64_t cap = _check_int("capacity", capacity, 1, &too_big)
        cdef int64_t ms = _check_int("max_staleness", max_staleness, 0, &too_big)
        cdef Ring* r = &self._ring
        cdef Py_ssize_t alloc
        cdef int64_t* vers
        cdef VersionCount* vt
        cdef list items, old_items
        _wait_idle(self)
        if cap > PY_SSIZE_T_MAX:
            cap = PY_SSIZE_T_MAX
        alloc = <Py_ssize_t>cap if cap < _INITIAL_ALLOC else _INITIAL_ALLOC
        items = [None] * alloc
        vers = <int64_t*>PyMem_Malloc(alloc * sizeof(int64_t))
        vt = <VersionCount*>PyMem_Malloc(_INITIAL_VT * sizeof(VersionCount))
        if vers == NULL or vt == NULL:
            PyMem_Free(vers)
            PyMem_Free(vt)
            raise MemoryError(f"StalenessQueue: cannot allocate {alloc} slots")
        # Re-initialising drops the items held so far; keep them alive until the queue is
        # consistent again, since their finalizers may call it.
        old_items = self._items
        self._items = items
        PyMem_Free(r.vers)
        PyMem_Free(r.vt)
        r.vers = vers
        r.alloc = alloc
        r.head = 0
        r.size = 0
        r.vt = vt
        r.vt_lo = 0
        r.vt_hi = 0
        r.vt_alloc = _INITIAL_VT
        self._capacity_obj = capacity
        self._max_staleness_obj = max_staleness
        self._cap = <Py_ssize_t>cap
        self._ms = ms
        self._version = 0
        self._version_obj = 0
        self._n_put = 0
        self._n_got = 0
        self._n_evicted = 0
        self._n_stale_on_put = 0
        self._n_rejected_full = 0
        self._watch_k = 0
        self._watch_cb = None

    def __dealloc__(self):
        PyMem_Free(self._ring.vers)
        PyMem_Free(self._ring.vt)

    @property
    def capacity(self):
        return self._capacity_obj

    @property
    def max_staleness(self):
        return self._max_staleness_obj

    @property
    def version(self):
        return self._version_obj

    def __len__(self):
        return self._ring.size

    def put(self, item, version):
        """Store ``item``; False if it is already staler than the budget (counted, not stored).

        Raises ``QueueFull`` when the queue is at capacity.
        """
        cdef Ring* r = &self._ring
        cdef int64_t v = _check_version(self, version)
        cdef Py_ssize_t p
        _wait_idle(self)
        if r.size >= self._cap:
            self._n_rejected_full += 1
            raise QueueFull(f"queue is full ({self._capacity_obj} items)")
        if v < self._version - self._ms:
            self._n_stale_on_put += 1
            return False
        if r.size == r.alloc:
            _ring_reserve(self, r.size + 1)
        if r.vt_hi == r.vt_alloc:
            _vt_reserve(r, 1)
        p = _phys(r, r.size)
        r.vers[p] = v
        self._items[p] = item
        _vt_add(r, v)
        r.size += 1
        self._n_put += 1
        if self._watch_cb is not None and r.size >= self._watch_k:
            self._fire()
        return True

    cdef int _fire(self) except -1:
        cb = self._watch_cb
        self._watch_cb = None  # cleared first: the callback may set a new watch
        cb()
        return 0

    def notify_at(self, k, callback):
        """Call ``callback()`` once the queue holds at least ``k`` items (now, if it does).

        One watch at a time: a new one replaces the last; ``callback=None`` cancels. The watch
        fires from the ``put``/``put_many`` that reaches ``k``, after the items are stored, and
        is not pickled.
        """
        cdef bint too_big
        cdef int64_t want = _check_int("k", k, 1, &too_big)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        _wait_idle(self)
        self._watch_cb = None
        if callback is None:
            return
        if not too_big and want <= self._ring.size:
            callback()
            return
        self._watch_k = PY_SSIZE_T_MAX if too_big or want > PY_SSIZE_T_MAX else <Py_ssize_t>want
        self._watch_cb = callback

    def put_many(self, items, versions):
        """Store all items or none; returns how many were stored (stale ones are not)."""
        cdef Ring* r = &self._ring
        cdef list its = list(items)
        cdef Py_ssize_t n = len(its), m = 0, cap_buf = n + 1, k, t = 0, start = 0, runs
        cdef int64_t floor, v
        cdef int64_t* buf = <int64_t*>PyMem_Malloc(cap_buf * sizeof(int64_t))
        cdef int64_t* grown
        if buf == NULL:
            raise MemoryError()
        try:
            for version in versions:
                v = _check_version(self, version)
                if m == cap_buf:
                    cap_buf *= 2
                    grown = <int64_t*>PyMem_Realloc(buf, cap_buf * sizeof(int64_t))
                    if grown == NULL:
                        raise MemoryError()
                    buf = grown
                buf[m] = v
                m += 1
            if n != m:
                raise ValueError(f"{n} items but {m} versions")
            _wait_idle(self)
            if r.size + n > self._cap:
                self._n_rejected_full += 1
                raise QueueFull(f"{n} items do not fit: {r.size}/{self._capacity_obj} used")
            _ring_reserve(self, r.size + n)
            # each run of equal versions adds at most one distinct version to the table
            runs = 1 if n else 0
            for k in range(1, n):
                runs += buf[k] != buf[k - 1]
            _vt_reserve(r, runs)
            floor = self._version - self._ms
            start = r.size
            if n >= _NOGIL_MIN:
                self._busy = 1
                with nogil:
                    _store_versions(r, buf, n, floor)
                self._busy = 0
            else:
                _store_versions(r, buf, n, floor)
            t = start
            for k in range(n):
                if buf[k] >= floor:
                    self._items[_phys(r, t)] = its[k]
                    t += 1
        finally:
            PyMem_Free(buf)
        r.size = t
        self._n_put += t - start
        self._n_stale_on_put += n - (t - start)
        if self._watch_cb is not None and r.size >= self._watch_k:
            self._fire()
        return t - start

    def get_batch(self, n):
        """Pop up to ``n`` items, oldest first."""
        cdef Ring* r = &self._ring
        cdef bint too_big
        cdef int64_t want = _check_int("n", n, 0, &too_big)
        cdef Py_ssize_t k, i
        cdef list out
        _wait_idle(self)
        k = r.size if too_big or want > r.size else <Py_ssize_t>want
        out = _list_new(k)
        if k >= _NOGIL_MIN:
            self._busy = 1
            with nogil:
                _forget_oldest(r, k)
            self._busy = 0
        else:
            _forget_oldest(r, k)
        for i in range(k):
            _take(self._items, _phys(r, i), out, i)  # the output list takes over the reference
        r.head = _phys(r, k)
        r.size -= k
        if r.size == 0:
            r.head = 0
        self._n_got += k
        return out

    def set_version(self, version):
        """Advance the consumer version; returns the items evicted as too stale, oldest first."""
        cdef Ring* r = &self._ring
        cdef bint too_big
        cdef int64_t v = _check_int("version", version, 0, &too_big)
        cdef int64_t floor
        cdef Py_ssize_t cut, i, j, e, p, n_evict = 0, size, first = 0, last = 0
        cdef uint8_t* keep
        cdef bint upward = False, found
        cdef list evicted
        if too_big:
            raise ValueError(f"version must be <= {INT64_MAX}, got {version}")
        _wait_idle(self)
        if v < self._version:
            raise ValueError(f"version must not go back: {version} < {self._version_obj}")
        floor = v - self._ms
        if r.vt_lo == r.vt_hi or r.vt[r.vt_lo].version >= floor:
            # nothing present is older than the new floor: O(1), no scan
            self._version = v
            self._version_obj = version
            return []
        cut = _vt_lower_bound(r, floor)
        for i in range(r.vt_lo, cut):
            n_evict += r.vt[i].count
        size = r.size
        evicted = _list_new(n_evict)
        keep = <uint8_t*>PyMem_Malloc(size)
        if keep == NULL:
            raise MemoryError()
        if size >= _NOGIL_MIN:
            self._busy = 1
            with nogil:
                found = _evict_versions(r, floor, n_evict, cut, keep, &first, &last, &upward)
            self._busy = 0
        else:
            found = _evict_versions(r, floor, n_evict, cut, keep, &first, &last, &upward)
        if not found:
            PyMem_Free(keep)
            raise SystemError(f"StalenessQueue: {n_evict} stale items expected, not found")
        self._version = v
        self._version_obj = version
        # Move the references along the same span. Invariant (downward): logical slots
        # [first, j) hold the kept items in order, slots [j, i) hold None; so a kept item swaps
        # with the None at j, and a stale one hands its reference to the evicted list and
        # leaves None behind. Upward is the mirror image, and fills the evicted list from
        # its end so that it stays oldest first.
        if upward:
            j = last
            e = n_evict
            for i in range(last, -1, -1):
                p = _phys(r, i)
                if keep[i]:
                    if j != i:
                        _swap(self._items, p, _phys(r, j))
                    j -= 1
                else:
                    e -= 1
                    _take(self._items, p, evicted, e)
            e = n_evict - e
            r.head = _phys(r, n_evict)
        else:
            j = first
            e = 0
            for i in range(first, size):
                p = _phys(r, i)
                if keep[i]:
                    if j != i:
                        _swap(self._items, p, _phys(r, j))
                    j += 1
                else:
                    _take(self._items, p, evicted, e)
                    e += 1
        PyMem_Free(keep)
        r.size = size - e
        if r.size == 0:
            r.head = 0
        self._n_evicted += e
        if e != n_evict:  # cannot happen unless the version table is corrupt
            raise SystemError(f"StalenessQueue: evicted {e} items, version table said {n_evict}")
        return evicted

    def counters(self):
        """Cumulative counts: put, got, evicted, stale_on_put, rejected_full."""
        return {
            "put": self._n_put,
            "got": self._n_got,
            "evicted": self._n_evicted,
            "stale_on_put": self._n_stale_on_put,
            "rejected_full": self._n_rejected_full,
        }

    def __reduce__(self):
        cdef Ring* r = &self._ring
        cdef Py_ssize_t i, p
        _wait_idle(self)
        items = []
        versions = []
        for i in range(r.size):
            p = _phys(r, i)
            items.append(self._items[p])
            versions.append(r.vers[p])
        counters = (self._n_put, self._n_got, self._n_evicted, self._n_stale_on_put, self._n_rejected_full)
        return (
            _restore,
            (type(self), self._capacity_obj, self._max_staleness_obj, self._version_obj, items, versions, counters),
        )


def _restore(cls, capacity, max_staleness, version, items, versions, counters):
    """Rebuild a pickled queue (``StalenessQueue.__reduce__``)."""
    cdef StalenessQueue q = cls.__new__(cls)
    StalenessQueue.__init__(q, capacity, max_staleness)
    q.set_version(version)
    q.put_many(items, versions)
    q._n_put, q._n_got, q._n_evicted, q._n_stale_on_put, q._n_rejected_full = counters
    return q
