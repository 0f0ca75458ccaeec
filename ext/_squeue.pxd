# Declarations of the compiled staleness-aware queue (ext/_squeue.pyx), so other Cython
# modules can `cimport` it. The Python-level API is documented in _squeue.pyi and is that of
# the pure-Python reference ext/_squeue_ref.py.

from libc.stdint cimport int64_t


cdef struct VersionCount:
    int64_t version
    Py_ssize_t count


cdef struct Ring:
    # Versions of the queued items, in a ring of `alloc` slots: logical position i (0 = oldest)
    # lives at physical slot (head + i) mod alloc. The matching items live at the same slots
    # of StalenessQueue._items.
    int64_t* vers
    Py_ssize_t alloc
    Py_ssize_t head
    Py_ssize_t size
    # The distinct versions present in the queue with their item counts, sorted ascending,
    # live in vt[vt_lo:vt_hi]; vt[vt_lo].version is the oldest version present.
    VersionCount* vt
    Py_ssize_t vt_lo
    Py_ssize_t vt_hi
    Py_ssize_t vt_alloc


cdef class StalenessQueue:
    # The arguments as given (the properties return them unchanged, as the reference does).
    cdef object _capacity_obj
    cdef object _max_staleness_obj
    cdef object _version_obj
    # The same values as C integers: capacity clamped to PY_SSIZE_T_MAX and max_staleness to
    # INT64_MAX, which changes no answer (no queue can hold more items, no version is older).
    cdef Py_ssize_t _cap
    cdef int64_t _ms
    cdef int64_t _version
    # Item references: a list of exactly ring.alloc slots; a slot holds None when empty.
    cdef list _items
    cdef Ring _ring
    cdef long long _n_put
    cdef long long _n_got
    cdef long long _n_evicted
    cdef long long _n_stale_on_put
    cdef long long _n_rejected_full
    # Set while a method runs with the GIL released; other threads wait for it to clear.
    cdef int _busy
    # notify_at: call _watch_cb() once the queue holds _watch_k items (None: no watch).
    cdef Py_ssize_t _watch_k
    cdef object _watch_cb

    cdef int _fire(self) except -1
