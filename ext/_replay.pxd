# Declarations of the compiled replay buffer (ext/_replay.pyx), so other Cython modules can
# `cimport` it. The Python-level API is documented in _replay.pyi and is that of the
# pure-Python reference ext/_replay_ref.py.

from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint64_t

cimport numpy as cnp


cdef struct Rng:
    # xoshiro256** state (never all zero: splitmix64 seeds it)
    uint64_t s[4]


cdef struct Field:
    char* data  # row 0 of the storage array; row i starts at data + i * row_bytes
    Py_ssize_t row_bytes
    cnp.PyArray_Descr* descr  # borrowed: ReplayBuffer._dtypes holds the reference
    int ndim  # 1 + len(shape): the dimensions of a batch of rows
    cnp.npy_intp* dims  # the batch shape (n, *shape); dims[0] is set per call


cdef enum:
    _MAX_LEVELS = 40  # stored levels of a priority tree: at most 1 + ceil(63 / 2)


cdef struct Tree:
    # The binary sum and min trees over 2**depth leaves, stored at every other binary level
    # (see the module docstring): level k (0 the root, nlv - 1 the leaves) holds the nodes of
    # binary level bits[k] in blocks of four, [s0 s1 s2 s3 m0 m1 m2 m3], 64 bytes each.
    double* data
    int nlv
    Py_ssize_t off[_MAX_LEVELS]  # where level k's blocks start, in doubles
    int shift[_MAX_LEVELS]  # bits[k] - bits[k - 1]: 2 (four children), or 1 at the top
    int bits[_MAX_LEVELS]


cdef class ReplayBuffer:
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _pos  # the slot the next row is written to
    cdef Py_ssize_t _size  # rows stored, in slots [0, _size)
    cdef Py_ssize_t _nfields
    cdef Field* _fields
    cdef cnp.npy_intp* _dims  # every field's batch shape, one after the other
    # Spec, in order (the Python-level side of _fields) and the storage arrays.
    cdef tuple _names
    cdef tuple _shapes
    cdef tuple _dtypes
    cdef tuple _expected  # '(n, 64)': the shape each field must have, for error messages
    cdef frozenset _name_set
    cdef tuple _arrays
    cdef bint _prioritized
    cdef double _alpha
    cdef object _seed
    cdef Rng _rng
    # Priority trees (prioritized only) over _leaves = 2**_depth leaves, leaf j for slot j.
    cdef Py_ssize_t _leaves
    cdef int _depth
    cdef Tree _tree
    cdef double _max_p  # the largest priority ever set (1.0 at first)
    cdef double _max_q  # _max_p ** alpha: what a new row gets
    cdef double _q_limit  # the largest p ** alpha accepted
    # Set while a method runs with the GIL released; other threads wait for it to clear.
    cdef int _busy

    cdef Py_ssize_t _check_field(self, Py_ssize_t f, object a, Py_ssize_t n, const char** src,
                                 PyObject** held) except -1
    cdef void _draw_and_gather(self, int64_t* ip, double* wp, Py_ssize_t k, Py_ssize_t size,
                               double beta, char** dst) noexcept nogil
