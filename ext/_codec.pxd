# Declarations of the compiled sample codec (ext/_codec.pyx), so other Cython modules can
# `cimport` the Sample type. The Python-level API is documented in _codec.pyi and is that of
# the pure-Python reference ext/_codec_ref.py; the byte layout is docs/sample-format.md.


cdef class Sample:
    # name -> numpy.ndarray and name -> int/float/bool/str/None, each in sorted name order
    # (UTF-8 byte order). Private and never mutated after construction, so encode can trust
    # the meta types and the order; arrays are re-checked (their dtype or shape can change).
    cdef dict _arrays
    cdef dict _meta
