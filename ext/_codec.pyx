"""Compiled sample codec; same API, bytes and errors as ``ext._codec_ref`` (the oracle).

A ``Sample`` (named numpy arrays plus named scalar metadata) is encoded into the canonical,
pickle-free layout of docs/sample-format.md: a 64-byte header, a field table, then each
array's data at a 64-byte boundary, all covered by a checksum. ``decode`` returns a Sample
whose arrays are views into the input buffer.

Where the time goes, and what is done about it:

* Small samples (a few KiB) are dominated by per-call overhead: ``decode`` builds each array
  with ``PyArray_NewFromDescr`` over the buffer (base set to the buffer or a memoryview that
  holds its export), reuses the name strings of the previous decode when the bytes match
  (samples of one stream carry the same field names), and never goes through the validating
  constructor. ``encode`` plans the layout in a C array of field records, reading names
  through the str objects' cached UTF-8, with no Python containers built.
* Large samples are dominated by memory passes: ``encode`` copies every C-contiguous array
  and accumulates the checksum in the same pass (one read, one write per byte); ``decode``
  verifies the checksum in one read pass. The block kernels use SSE2 (every x86-64), AVX2
  or AVX-512F when the CPU has them (the widest is picked at import), a portable C loop
  elsewhere; all compute the same function. Arrays that are not C-contiguous in native byte order are first copied into place
  by numpy, then only summed.
* Long passes release the GIL (``_NOGIL_MIN`` bytes or more); releasing it around a short
  pass costs more than the pass.

Validation never trusts the input: every length, offset and shape product is checked with
overflow-safe arithmetic against the bytes present before anything is read or allocated, the
structural values are copied into C locals once (a buffer mutated by another thread cannot
change them after the checks), and nothing is ever executed or imported.

This module supports little-endian hosts only (it refuses to import elsewhere; the pure-Python
reference, which ``ext.backend`` then falls back to, handles both byte orders).
"""

import pickle
import sys
from collections.abc import Mapping

import numpy as np

cimport cython
cimport numpy as cnp
from cpython.buffer cimport PyBUF_FULL_RO, PyBuffer_IsContiguous, PyBuffer_Release, PyObject_CheckBuffer, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from libc.stdint cimport INT64_MAX, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from ext.errors import CodecError

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "CodecError",
    "Sample",
    "checksum",
    "decode",
    "encode",
    "encode_into",
    "encoded_size",
]

if sys.byteorder != "little":
    raise ImportError("ext._codec supports little-endian hosts only; use the pure-Python ext._codec_ref")

cnp.import_array()


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    bint PyUnicode_IS_COMPACT_ASCII(PyObject* s)
    void* PyUnicode_DATA(PyObject* s)
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject* s)
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    object PyDictProxy_New(object mapping)
    object PyMemoryView_FromObject(object obj)
    Py_buffer* PyMemoryView_GET_BUFFER(object mv)
    object PyLong_FromLongLong(long long v)
    long long PyLong_AsLongLong(object v) except? -1
    object PyFloat_FromDouble(double v)


cdef extern from "numpy/arrayobject.h":
    ctypedef struct Descr "PyArray_Descr"
    # declared here because numpy's .pxd leaves it out; steals a reference to ``descr``
    object PyArray_NewFromDescr(PyTypeObject* subtype, Descr* descr, int nd, cnp.npy_intp* dims,
                                cnp.npy_intp* strides, void* data, int flags, PyObject* obj)


# The checksum block kernels, in C for the SIMD intrinsics (see docs/sample-format.md for the
# function they compute). Each absorbs ``n`` whole 64-byte blocks of ``src`` into the 8 lanes
# (a[j] += word j; b[j] += a[j]) and, when ``dst`` is not NULL, copies them to ``dst`` in the
# same pass. Loads and stores are unaligned: the buffers are only 64-byte aligned relative to
# the start of the encoding. SSE2 is part of x86-64; AVX2 and AVX-512F are compiled with
# function target attributes (no build flags needed) and used only when the CPU has them.
cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__x86_64__) || defined(_M_X64)
    #include <emmintrin.h>
    #define CODEC_HAVE_SSE2 1
    #else
    #define CODEC_HAVE_SSE2 0
    #endif
    #if CODEC_HAVE_SSE2 && defined(__GNUC__)
    #include <immintrin.h>
    #define CODEC_HAVE_AVX2 1
    #else
    #define CODEC_HAVE_AVX2 0
    #endif

    typedef struct { uint64_t a[8]; uint64_t b[8]; } codec_lanes;
    typedef void (*codec_kernel)(codec_lanes*, uint8_t*, const uint8_t*, size_t);

    static void codec_blocks_scalar(codec_lanes* s, uint8_t* dst, const uint8_t* src, size_t n) {
        uint64_t a[8], b[8], w;
        size_t i;
        int j;
        memcpy(a, s->a, sizeof a);
        memcpy(b, s->b, sizeof b);
        for (i = 0; i < n; i++, src += 64) {
            if (dst) { memcpy(dst, src, 64); dst += 64; }
            for (j = 0; j < 8; j++) {
                memcpy(&w, src + 8 * j, 8);
                a[j] += w;
                b[j] += a[j];
            }
        }
        memcpy(s->a, a, sizeof a);
        memcpy(s->b, b, sizeof b);
    }

    typedef uint64_t (*codec_fold)(const codec_lanes*, const uint64_t*, const uint64_t*);

    static uint64_t codec_fold_scalar(const codec_lanes* s, const uint64_t* ka, const uint64_t* kb) {
        uint64_t x = 0;
        int j;
        for (j = 0; j < 8; j++) x += s->a[j] * ka[j] + s->b[j] * kb[j];
        return x;
    }

    #if CODEC_HAVE_SSE2
    #define CODEC_SSE2_STEP(s_) \\
        a0 = _mm_add_epi64(a0, w0); a1 = _mm_add_epi64(a1, w1); \\
        a2 = _mm_add_epi64(a2, w2); a3 = _mm_add_epi64(a3, w3); \\
        b0 = _mm_add_epi64(b0, a0); b1 = _mm_add_epi64(b1, a1); \\
        b2 = _mm_add_epi64(b2, a2); b3 = _mm_add_epi64(b3, a3);
    static void codec_blocks_sse2(codec_lanes* s, uint8_t* dst, const uint8_t* src, size_t n) {
        __m128i a0 = _mm_loadu_si128((const __m128i*)s->a), a1 = _mm_loadu_si128((const __m128i*)(s->a + 2));
        __m128i a2 = _mm_loadu_si128((const __m128i*)(s->a + 4)), a3 = _mm_loadu_si128((const __m128i*)(s->a + 6));
        __m128i b0 = _mm_loadu_si128((const __m128i*)s->b), b1 = _mm_loadu_si128((const __m128i*)(s->b + 2));
        __m128i b2 = _mm_loadu_si128((const __m128i*)(s->b + 4)), b3 = _mm_loadu_si128((const __m128i*)(s->b + 6));
        __m128i w0, w1, w2, w3;
        size_t i;
        if (dst) {
            for (i = 0; i < n; i++, src += 64, dst += 64) {
                w0 = _mm_loadu_si128((const __m128i*)src); w1 = _mm_loadu_si128((const __m128i*)(src + 16));
                w2 = _mm_loadu_si128((const __m128i*)(src + 32)); w3 = _mm_loadu_si128((const __m128i*)(src + 48));
                _mm_storeu_si128((__m128i*)dst, w0); _mm_storeu_si128((__m128i*)(dst + 16), w1);
                _mm_storeu_si128((__m128i*)(dst + 32), w2); _mm_storeu_si128((__m128i*)(dst + 48), w3);
                CODEC_SSE2_STEP(0)
            }
        } else {
            for (i = 0; i < n; i++, src += 64) {
                w0 = _mm_loadu_si128((const __m128i*)src); w1 = _mm_loadu_si128((const __m128i*)(src + 16));
                w2 = _mm_loadu_si128((const __m128i*)(src + 32)); w3 = _mm_loadu_si128((const __m128i*)(src + 48));
                CODEC_SSE2_STEP(0)
            }
        }
        _mm_storeu_si128((__m128i*)s->a, a0); _mm_storeu_si128((__m128i*)(s->a + 2), a1);
        _mm_storeu_si128((__m128i*)(s->a + 4), a2); _mm_storeu_si128((__m128i*)(s->a + 6), a3);
        _mm_storeu_si128((__m128i*)s->b, b0); _mm_storeu_si128((__m128i*)(s->b + 2), b1);
        _mm_storeu_si128((__m128i*)(s->b + 4), b2); _mm_storeu_si128((__m128i*)(s->b + 6), b3);
    }
    #else
    #define codec_blocks_sse2 codec_blocks_scalar
    #endif

    #if CODEC_HAVE_AVX2
    /* Four blocks x1..x4 per step, the same function as four single steps:
       a += x1 + x2 + x3 + x4 and b += 4a + 4x1 + 3x2 + 2x3 + x4, written with the prefix sums
       c_k = x1 + .. + xk as b += 4a + (c1 + c2 + c3 + c4), a += c4. The a -> b chain is then
       two adds per four blocks instead of per block, which is what limits a read pass. */
    #define CODEC_STEP4(T, add, shl, a, b, x1, x2, x3, x4) do { \
        T c2 = add(x1, x2), c3 = add(c2, x3), c4 = add(c3, x4); \
        b = add(b, add(shl(a, 2), add(add(x1, c2), add(c3, c4)))); \
        a = add(a, c4); \
    } while (0)

    __attribute__((target("avx2")))
    static void codec_blocks_avx2(codec_lanes* s, uint8_t* dst, const uint8_t* src, size_t n) {
        /* lanes 0-3 (bytes 0-31 of a block) in a0/b0, lanes 4-7 in a1/b1 */
        __m256i a0 = _mm256_loadu_si256((const __m256i*)s->a), a1 = _mm256_loadu_si256((const __m256i*)(s->a + 4));
        __m256i b0 = _mm256_loadu_si256((const __m256i*)s->b), b1 = _mm256_loadu_si256((const __m256i*)(s->b + 4));
        __m256i x[8];
        size_t i = 0;
        int k;
        for (; i + 4 <= n; i += 4, src += 256) {
            for (k = 0; k < 8; k++) x[k] = _mm256_loadu_si256((const __m256i*)(src + 32 * k));
            if (dst) {
                for (k = 0; k < 8; k++) _mm256_storeu_si256((__m256i*)(dst + 32 * k), x[k]);
                dst += 256;
            }
            CODEC_STEP4(__m256i, _mm256_add_epi64, _mm256_slli_epi64, a0, b0, x[0], x[2], x[4], x[6]);
            CODEC_STEP4(__m256i, _mm256_add_epi64, _mm256_slli_epi64, a1, b1, x[1], x[3], x[5], x[7]);
        }
        for (; i < n; i++, src += 64) {
            x[0] = _mm256_loadu_si256((const __m256i*)src); x[1] = _mm256_loadu_si256((const __m256i*)(src + 32));
            if (dst) {
                _mm256_storeu_si256((__m256i*)dst, x[0]); _mm256_storeu_si256((__m256i*)(dst + 32), x[1]);
                dst += 64;
            }
            a0 = _mm256_add_epi64(a0, x[0]); a1 = _mm256_add_epi64(a1, x[1]);
            b0 = _mm256_add_epi64(b0, a0); b1 = _mm256_add_epi64(b1, a1);
        }
        _mm256_storeu_si256((__m256i*)s->a, a0); _mm256_storeu_si256((__m256i*)(s->a + 4), a1);
        _mm256_storeu_si256((__m256i*)s->b, b0); _mm256_storeu_si256((__m256i*)(s->b + 4), b1);
    }
    __attribute__((target("avx512f")))
    static void codec_blocks_avx512(codec_lanes* s, uint8_t* dst, const uint8_t* src, size_t n) {
        __m512i a = _mm512_loadu_si512((const void*)s->a), b = _mm512_loadu_si512((const void*)s->b);
        __m512i x1;
        size_t i = 0;
        /* One block per step: two 512-bit adds per block on the two ports that run them,
           each chain one add long, so a block a cycle; the four-block step of the AVX2
           kernel costs 2.5 adds per block here. */
        if (dst && ((uintptr_t)src & 63) && !((uintptr_t)src & 7) && n) {
            /* A source off a cache line (numpy starts arrays on 16 bytes) makes every 64-byte
               load straddle two lines; instead each line is loaded once, aligned, and a block
               is put together from two of them. The first and last loads read a few bytes
               around the source, inside lines it occupies (so on its pages). */
            const __m512i* line = (const __m512i*)((uintptr_t)src & ~(uintptr_t)63);
            __m512i lo = _mm512_load_si512((const void*)line), hi;
            switch (((uintptr_t)src & 63) >> 3) {
            #define CODEC_ALIGNR(k_) case k_: \
                for (; i < n; i++, dst += 64) { \
                    hi = _mm512_load_si512((const void*)(++line)); \
                    x1 = _mm512_alignr_epi64(hi, lo, k_); \
                    lo = hi; \
                    _mm512_storeu_si512((void*)dst, x1); \
                    a = _mm512_add_epi64(a, x1); \
                    b = _mm512_add_epi64(b, a); \
                } \
                break;
            CODEC_ALIGNR(1) CODEC_ALIGNR(2) CODEC_ALIGNR(3) CODEC_ALIGNR(4) CODEC_ALIGNR(5) CODEC_ALIGNR(6) CODEC_ALIGNR(7)
            #undef CODEC_ALIGNR
            }
        } else if (dst) {
            for (; i < n; i++, src += 64, dst += 64) {
                x1 = _mm512_loadu_si512((const void*)src);
                _mm512_storeu_si512((void*)dst, x1);
                a = _mm512_add_epi64(a, x1);
                b = _mm512_add_epi64(b, a);
            }
        } else {
            for (; i < n; i++, src += 64) {
                x1 = _mm512_loadu_si512((const void*)src);
                a = _mm512_add_epi64(a, x1);
                b = _mm512_add_epi64(b, a);
            }
        }
        _mm512_storeu_si512((void*)s->a, a);
        _mm512_storeu_si512((void*)s->b, b);
    }
    /* The weighted sum of the lanes that the checksum's finish mixes. The AVX-512 kernel leaves
       its lanes with two 512-bit stores, and 64-bit loads of their upper halves are not
       forwarded from those: each waited for every store still pending (all of the copy's)
       to reach the cache, a third of an encode's fixed cost. Its fold loads the lanes at the
       width they were stored and takes them out of registers. */
    __attribute__((target("avx512f")))
    static uint64_t codec_fold_avx512(const codec_lanes* s, const uint64_t* ka, const uint64_t* kb) {
        __m512i v[2] = {_mm512_loadu_si512((const void*)s->a), _mm512_loadu_si512((const void*)s->b)};
        const uint64_t* k[2] = {ka, kb};
        uint64_t x = 0;
        int h, q;
        for (h = 0; h < 2; h++) {
            __m256i half[2] = {_mm512_castsi512_si256(v[h]), _mm512_extracti64x4_epi64(v[h], 1)};
            for (q = 0; q < 2; q++) {
                __m128i lo = _mm256_castsi256_si128(half[q]), hi = _mm256_extracti128_si256(half[q], 1);
                x += (uint64_t)_mm_cvtsi128_si64(lo) * k[h][4 * q] + (uint64_t)_mm_extract_epi64(lo, 1) * k[h][4 * q + 1]
                   + (uint64_t)_mm_cvtsi128_si64(hi) * k[h][4 * q + 2] + (uint64_t)_mm_extract_epi64(hi, 1) * k[h][4 * q + 3];
            }
        }
        return x;
    }
    static int codec_cpu_has(int which) {
        __builtin_cpu_init();
        if (which == 2) return __builtin_cpu_supports("avx2") ? 1 : 0;
        if (which == 3) return __builtin_cpu_supports("avx512f") ? 1 : 0;
        return 0;
    }
    #else
    #define codec_blocks_avx2 codec_blocks_scalar
    #define codec_blocks_avx512 codec_blocks_scalar
    #define codec_fold_avx512 codec_fold_scalar
    static int codec_cpu_has(int which) { (void)which; return 0; }
    #endif

    /* a * b into *out; nonzero when the product passes INT64_MAX (numpy's bound on an array's
       bytes). A multiply and a flag where a division by the item size cost tens of cycles. */
    static inline int codec_mul_past_int64(uint64_t a, uint64_t b, uint64_t* out) {
    #if defined(__GNUC__)
        return __builtin_mul_overflow(a, b, out) || *out > (uint64_t)INT64_MAX;
    #else
        if (b && a > (uint64_t)INT64_MAX / b) return 1;
        *out = a * b;
        return 0;
    #endif
    }
    """
    ctypedef struct codec_lanes:
        uint64_t a[8]
        uint64_t b[8]
    ctypedef void (*codec_kernel)(codec_lanes*, uint8_t*, const uint8_t*, size_t) noexcept nogil
    void codec_blocks_scalar(codec_lanes*, uint8_t*, const uint8_t*, size_t) noexcept nogil
    void codec_blocks_sse2(codec_lanes*, uint8_t*, const uint8_t*, size_t) noexcept nogil
    void codec_blocks_avx2(codec_lanes*, uint8_t*, const uint8_t*, size_t) noexcept nogil
    void codec_blocks_avx512(codec_lanes*, uint8_t*, const uint8_t*, size_t) noexcept nogil
    ctypedef uint64_t (*codec_fold)(const codec_lanes*, const uint64_t*, const uint64_t*) noexcept nogil
    uint64_t codec_fold_scalar(const codec_lanes*, const uint64_t*, const uint64_t*) noexcept nogil
    uint64_t codec_fold_avx512(const codec_lanes*, const uint64_t*, const uint64_t*) noexcept nogil
    int CODEC_HAVE_SSE2
    int codec_cpu_has(int which)
    int codec_mul_past_int64(uint64_t a, uint64_t b, uint64_t* out) noexcept nogil


MAGIC = b"\x89ASAMP\r\n"
FORMAT_VERSION = 1
HEADER_SIZE = 64
ALIGNMENT = 64
MAX_NAME_BYTES = 255
MAX_NDIM = 8

cdef enum:
    _HEADER = 64
    _ALIGN = 64
    _VERSION = 1
    _MAX_NAME = 255
    _MAX_NDIM = 8
    _CHECKSUM_AT = 32
    _HEADER_USED = 40  # bytes 40..63 are reserved (zero)
    _KIND_ARRAY = 1
    _KIND_INT = 2
    _KIND_FLOAT = 3
    _KIND_BOOL = 4
    _KIND_STR = 5
    _KIND_NONE = 6
    _N_CODES = 13  # dtype codes 1..12
    _STACK_FIELDS = 16  # field records planned on the stack (more go to the heap)
    _NAME_CACHE = 64  # field positions whose decoded names are remembered
    _NOGIL_MIN = 1 << 16  # memory passes at least this long release the GIL

cdef const char* _MAGIC = b"\x89ASAMP\r\n"
cdef uint64_t _MAX_STR_BYTES = 0xFFFFFFFF
cdef uint64_t _MAX_FIELDS = 0xFFFFFFFF
_SUPPORTED = "bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, float32, float64"

# dtype code -> numpy type number and item size (index 0 unused)
cdef int _TYPENUM[_N_CODES]
cdef int _ITEMSIZE[_N_CODES]
_TYPENUM[:] = [-1, cnp.NPY_BOOL, cnp.NPY_INT8, cnp.NPY_INT16, cnp.NPY_INT32, cnp.NPY_INT64,
               cnp.NPY_UINT8, cnp.NPY_UINT16, cnp.NPY_UINT32, cnp.NPY_UINT64,
               cnp.NPY_FLOAT16, cnp.NPY_FLOAT32, cnp.NPY_FLOAT64]
_ITEMSIZE[:] = [0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8]
# The dtype objects of the codes, owned by this list for the module's lifetime.
_DESCRS = [None] + [cnp.PyArray_DescrFromType(_TYPENUM[c]) for c in range(1, _N_CODES)]
cdef Descr* _DESCR[_N_CODES]
for _c in range(1, _N_CODES):
    _DESCR[_c] = <Descr*>_DESCRS[_c]

# Checksum lane weights: odd for the plain sums, even for the running sums (see the docs).
cdef uint64_t _KA[8]
cdef uint64_t _KB[8]
for _j in range(8):
    _KA[_j] = <uint64_t>0x9E3779B97F4A7C15 * <uint64_t>(2 * _j + 1)
    _KB[_j] = (<uint64_t>0xC2B2AE3D27D4EB4F * <uint64_t>(2 * _j + 1)) << 1

cdef codec_kernel _blocks = codec_blocks_scalar
cdef codec_fold _fold = codec_fold_scalar
cdef str _kernel_name = "scalar"
_KERNELS = {"scalar": 0}
if CODEC_HAVE_SSE2:
    _KERNELS["sse2"] = 1
if codec_cpu_has(2):
    _KERNELS["avx2"] = 2
if codec_cpu_has(3):
    _KERNELS["avx512"] = 3


def _kernels():
    """Names of the checksum kernels this CPU can run (for tests and benchmarks)."""
    return list(_KERNELS)


def _use_kernel(str name):
    """Switch the checksum kernel (all compute the same function); returns the previous name."""
    global _blocks, _fold, _kernel_name
    cdef str previous = _kernel_name
    which = _KERNELS[name]
    _fold = codec_fold_avx512 if which == 3 else codec_fold_scalar
    if which == 0:
        _blocks = codec_blocks_scalar
    elif which == 1:
        _blocks = codec_blocks_sse2
    elif which == 2:
        _blocks = codec_blocks_avx2
    else:
        _blocks = codec_blocks_avx512
    _kernel_name = name
    return previous


_use_kernel(max(_KERNELS, key=_KERNELS.get))  # the widest this CPU runs


# ---------------------------------------------------------------------------------------------
# little helpers


cdef inline Py_ssize_t _align(Py_ssize_t n) noexcept nogil:
    return (n + _ALIGN - 1) & ~(<Py_ssize_t>_ALIGN - 1)


cdef inline uint64_t _rd64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef inline uint32_t _rd32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline uint16_t _rd16(const uint8_t* p) noexcept nogil:
    cdef uint16_t v
    memcpy(&v, p, 2)
    return v


cdef inline void _wr64(uint8_t* p, uint64_t v) noexcept nogil:
    memcpy(p, &v, 8)


cdef inline uint64_t _fmix64(uint64_t k) noexcept nogil:
    """MurmurHash3's 64-bit finalizer: a bijection, so it keeps every difference."""
    k ^= k >> 33
    k *= <uint64_t>0xFF51AFD7ED558CCD
    k ^= k >> 33
    k *= <uint64_t>0xC4CEB9FE1A85EC53
    k ^= k >> 33
    return k


cdef inline uint64_t _finish(const codec_lanes* s) noexcept nogil:
    return _fmix64(_fold(s, _KA, _KB))


cdef uint64_t _checksum_blocks(const uint8_t* data, Py_ssize_t n) noexcept nogil:
    """Checksum of ``data[:n]`` (n a positive multiple of 64), bytes 32..39 taken as zero.

    The blocks are summed as they are, and the word at 32 (lane 4 of the first block, which
    a[4] holds once and b[4] once per block) is taken out of the lanes' weighted sum after:
    the same value, mod 2**64, without a zeroed copy of the header, whose stores the kernel's
    wide load could only read once they had reached the cache."""
    cdef codec_lanes s
    cdef uint64_t word = _rd64(data + _CHECKSUM_AT), blocks = <uint64_t>(n // _ALIGN)
    memset(&s, 0, sizeof(s))
    _blocks(&s, NULL, data, <size_t>blocks)
    return _fmix64(_fold(&s, _KA, _KB) - word * _KA[_CHECKSUM_AT // 8] - blocks * word * _KB[_CHECKSUM_AT // 8])


cdef uint64_t _checksum(const uint8_t* data, Py_ssize_t n):
    cdef uint64_t c
    if n >= _NOGIL_MIN:
        with nogil:
            c = _checksum_blocks(data, n)
        return c
    return _checksum_blocks(data, n)


cdef str _typename(object obj):
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def checksum(buf):
    """The checksum of the encoding in ``buf`` as the header stores it (bytes 32..39 are taken
    as zero); ``buf`` must be a whole number of 64-byte blocks."""
    cdef Py_buffer view
    if not PyObject_CheckBuffer(buf):
        raise TypeError(f"checksum() needs a bytes-like object, got {_typename(buf)}")
    PyObject_GetBuffer(buf, &view, PyBUF_FULL_RO)
    try:
        if not PyBuffer_IsContiguous(&view, b'C'):
            raise TypeError("checksum() needs a C-contiguous buffer")
        if view.len < _HEADER or view.len % _ALIGN:
            raise ValueError(f"checksum() needs a positive multiple of 64 bytes, got {view.len}")
        return _checksum(<const uint8_t*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------------------------------------
# Sample


cdef str _check_name(object name):
    cdef Py_ssize_t n
    if type(name) is not str:
        if not isinstance(name, str):
            raise TypeError(f"field names must be str, got {_typename(name)}")
        name = str(name)
    try:
        PyUnicode_AsUTF8AndSize(name, &n)
    except UnicodeEncodeError:
        raise ValueError(f"field name {name!r} is not valid utf-8") from None
    if n == 0:
        raise ValueError("field names must not be empty")
    if n > _MAX_NAME:
        raise ValueError(f"field name {name!r} is {n} bytes of utf-8 (at most {_MAX_NAME})")
    return name


cdef int _dtype_code(str name, cnp.ndarray a) except -1:
    """The wire dtype code of ``a``; raises as the reference does for what cannot be encoded."""
    cdef cnp.dtype dt = <cnp.dtype>cnp.PyArray_DESCR(a)
    cdef char kind = dt.kind
    cdef Py_ssize_t size = dt.itemsize
    cdef int code = 0
    if kind == b'b':
        code = 1 if size == 1 else 0
    elif kind == b'i' or kind == b'u':
        code = 2 if size == 1 else 3 if size == 2 else 4 if size == 4 else 5 if size == 8 else 0
        if code and kind == b'u':
            code += 4
    elif kind == b'f':
        code = 10 if size == 2 else 11 if size == 4 else 12 if size == 8 else 0
    if code == 0:
        raise TypeError(f"array {name!r} has unsupported dtype {a.dtype} (supported: {_SUPPORTED})")
    if cnp.PyArray_NDIM(a) > _MAX_NDIM:
        raise ValueError(f"array {name!r} has {cnp.PyArray_NDIM(a)} dimensions (at most {_MAX_NDIM})")
    return code


cdef object _check_array(str name, object a):
    if type(a) is not cnp.ndarray:
        raise TypeError(f"array {name!r} must be a numpy.ndarray, got {_typename(a)}")
    _dtype_code(name, a)
    if not a.dtype.isnative:  # the wire is little-endian; a Sample holds native arrays
        a = a.astype(a.dtype.newbyteorder("="))
    return a


cdef str _check_str(str name, str v):
    cdef Py_ssize_t n
    try:
        PyUnicode_AsUTF8AndSize(v, &n)
    except UnicodeEncodeError:
        raise ValueError(f"meta {name!r}: str is not valid utf-8") from None
    if <uint64_t>n > _MAX_STR_BYTES:
        raise ValueError(f"meta {name!r}: str of {n} bytes is too long (at most {_MAX_STR_BYTES})")
    return v


cdef object _check_meta(str name, object v):
    """``v`` as the plain Python scalar that is stored (and that decoding gives back)."""
    t = type(v)
    if t is float or t is bool or v is None:
        return v
    if t is str:
        return _check_str(name, v)
    if t is not int:
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, (int, np.integer)):
            v = int(v)
        elif isinstance(v, (float, np.float16, np.float32)):
            return float(v)
        elif isinstance(v, str):
            return _check_str(name, str(v))
        else:
            raise TypeError(f"meta {name!r} must be int, float, bool, str or None, got {_typename(v)}")
    if not -(2**63) <= v <= 2**63 - 1:
        raise ValueError(f"meta {name!r} is out of the int64 range")
    return v


cdef inline uint64_t _float_bits(object x):
    cdef double v = PyFloat_AS_DOUBLE(x)
    cdef uint64_t bits
    memcpy(&bits, &v, 8)
    return bits


cdef bint _same_bits(object x, object y):
    if type(x) is not type(y):
        return False
    if type(x) is float:
        return _float_bits(x) == _float_bits(y)
    return x == y


cdef dict _EMPTY = {}  # shared by Samples until their fields are set; never mutated


# Not tracked by the cycle collector: a Sample holds two private dicts of ndarrays and scalars,
# and ndarrays are not tracked either, so no cycle through a Sample could ever be found; the
# tracking only cost every decode a gc link and a share of the collections it set off.
@cython.no_gc
cdef class Sample:
    """Named numpy arrays plus named scalar metadata; the unit that ``encode`` serialises.

    ``arrays`` maps names to ``numpy.ndarray`` (dtypes bool, int8..int64, uint8..uint64,
    float16/32/64; at most 8 dimensions; any strides). Arrays are held by reference, not
    copied, except that non-native byte order is converted (a copy) on construction.
    ``meta`` maps names to int (int64 range), float, bool, str or None; numpy scalars and
    subclasses are stored as the plain Python type. Names are non-empty str of at most 255
    bytes of UTF-8, unique across arrays and meta. Fields are kept sorted by name.

    ``==`` compares names, dtypes, shapes and values bitwise (NaN equals a NaN of the same
    bits; 0.0 differs from -0.0; 1 differs from True and 1.0).
    """

    def __cinit__(self):
        # A consistent empty state even for Sample.__new__(Sample), which decode() uses.
        self._arrays = _EMPTY
        self._meta = _EMPTY

    def __init__(self, arrays=None, meta=None):
        cdef dict arrs = {}, ms = {}
        cdef str key
        if arrays is not None:
            if not isinstance(arrays, Mapping):
                raise TypeError(f"arrays must be a mapping of names to numpy arrays, got {_typename(arrays)}")
            for name, a in arrays.items():
                key = _check_name(name)
                arrs[key] = _check_array(key, a)
        if meta is not None:
            if not isinstance(meta, Mapping):
                raise TypeError(f"meta must be a mapping of names to scalars, got {_typename(meta)}")
            for name, v in meta.items():
                key = _check_name(name)
                if key in arrs:
                    raise ValueError(f"duplicate field name {key!r}")
                ms[key] = _check_meta(key, v)
        self._arrays = {k: arrs[k] for k in sorted(arrs)}
        self._meta = {k: ms[k] for k in sorted(ms)}

    @property
    def arrays(self):
        """The arrays, by name (sorted), read-only."""
        return PyDictProxy_New(self._arrays)

    @property
    def meta(self):
        """The scalar metadata, by name (sorted), read-only."""
        return PyDictProxy_New(self._meta)

    def __getitem__(self, name):
        try:
            return self._arrays[name]
        except KeyError:
            return self._meta[name]

    def __contains__(self, name):
        return name in self._arrays or name in self._meta

    def __eq__(self, other):
        if not isinstance(other, Sample):
            return NotImplemented
        cdef Sample o = other
        if self._arrays.keys() != o._arrays.keys() or self._meta.keys() != o._meta.keys():
            return False
        for name, a in self._arrays.items():
            b = o._arrays[name]
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        for name, v in self._meta.items():
            if not _same_bits(v, o._meta[name]):
                return False
        return True

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # the arrays are mutable

    def __repr__(self):
        arrays = ", ".join(f"{k!r}: {a.dtype}{list(a.shape)}" for k, a in self._arrays.items())
        meta = ", ".join(f"{k!r}: {v!r}" for k, v in self._meta.items())
        return f"Sample(arrays={{{arrays}}}, meta={{{meta}}})"

    def __reduce_ex__(self, protocol):
        # Pickle is the trusted, in-process path (Ray); untrusted bytes go through decode().
        if protocol < 5:
            return (Sample, (self._arrays, self._meta))
        names = tuple(self._arrays)
        arrays = [np.ascontiguousarray(a) for a in self._arrays.values()]
        return (
            _restore,
            (
                names,
                tuple(a.dtype.str for a in arrays),
                tuple(a.shape for a in arrays),
                # out of band with a buffer_callback: no copy of the array data
                tuple(pickle.PickleBuffer(a) for a in arrays),
                self._meta,
            ),
        )


def _restore(names, dtypes, shapes, buffers, meta):
    """Rebuild a Sample pickled at protocol 5 (``Sample.__reduce_ex__``)."""
    arrays = {
        name: np.frombuffer(buf, dtype=dt).reshape(shape)
        for name, dt, shape, buf in zip(names, dtypes, shapes, buffers)
    }
    return Sample(arrays, meta)


# ---------------------------------------------------------------------------------------------
# encode


cdef struct Field:
    const char* name
    Py_ssize_t name_len
    int kind
    int code  # arrays: dtype code
    int ndim
    bint direct  # arrays: C-contiguous in native order, copied by the fused kernel
    cnp.npy_intp dims[_MAX_NDIM]
    Py_ssize_t nbytes  # arrays: data bytes
    Py_ssize_t offset  # arrays: where the data goes
    const uint8_t* src  # arrays: their data; str: the UTF-8 bytes
    uint64_t bits  # int64 / float64 bits / bool; str: the length
    PyObject* obj  # the array or value (borrowed: the sample's dicts hold it)


cdef inline Sample _check_sample(object sample):
    if not isinstance(sample, Sample):
        raise TypeError(f"expected a Sample, got {_typename(sample)}")
    return <Sample>sample


cdef int _plan_array(Field* f, str name, cnp.ndarray a) except -1:
    cdef int k
    f.kind = _KIND_ARRAY
    f.code = _dtype_code(name, a)
    f.ndim = cnp.PyArray_NDIM(a)
    for k in range(f.ndim):
        f.dims[k] = cnp.PyArray_DIMS(a)[k]
    f.nbytes = cnp.PyArray_NBYTES(a)
    f.direct = cnp.PyArray_IS_C_CONTIGUOUS(a) and cnp.PyArray_ISNOTSWAPPED(a)
    f.src = <const uint8_t*>cnp.PyArray_DATA(a)
    f.obj = <PyObject*>a
    return 0


cdef int _plan_meta(Field* f, str name, object v) except -1:
    cdef double x
    cdef Py_ssize_t n
    f.obj = <PyObject*>v
    f.bits = 0
    if v is None:
        f.kind = _KIND_NONE
    elif v is True or v is False:
        f.kind = _KIND_BOOL
        f.bits = 1 if v is True else 0
    elif type(v) is int:
        f.kind = _KIND_INT
        f.bits = <uint64_t>(<int64_t>PyLong_AsLongLong(v))
    elif type(v) is float:
        f.kind = _KIND_FLOAT
        x = PyFloat_AS_DOUBLE(v)
        memcpy(&f.bits, &x, 8)
    else:
        f.kind = _KIND_STR
        f.src = <const uint8_t*>PyUnicode_AsUTF8AndSize(v, &n)
        f.bits = <uint64_t>n
    return 0


cdef inline const char* _utf8(PyObject* s, Py_ssize_t* n) except NULL:
    """A str's UTF-8 bytes: a compact ASCII str's own characters, read in place without a call
    (field names nearly always are), else CPython's cached UTF-8 copy."""
    if PyUnicode_IS_COMPACT_ASCII(s):
        n[0] = PyUnicode_GET_LENGTH(s)
        return <const char*>PyUnicode_DATA(s)
    return PyUnicode_AsUTF8AndSize(<object>s, n)


cdef inline int _name_cmp(const char* a, Py_ssize_t na, const char* b, Py_ssize_t nb) noexcept nogil:
    """memcmp's order on names, then length; a loop in line, since names are a few bytes and
    a call to memcmp costs more than the comparison."""
    cdef Py_ssize_t k, m = na if na < nb else nb
    for k in range(m):
        if a[k] != b[k]:
            return -1 if <uint8_t>a[k] < <uint8_t>b[k] else 1
    return (na > nb) - (na < nb)


cdef Py_ssize_t _plan(Sample s, Field* fields, Py_ssize_t* table_out) except -1:
    """Fill ``fields`` (len(arrays) + len(meta) records) in wire order; returns the total size.

    The two dicts are each sorted by name, so wire order is their merge.
    """
    cdef Py_ssize_t pa = 0, pm = 0, i = 0, table = 0, data = 0, na, nm
    cdef PyObject* ka = NULL
    cdef PyObject* va = NULL
    cdef PyObject* km = NULL
    cdef PyObject* vm = NULL
    cdef const char* sa = NULL
    cdef const char* sm = NULL
    cdef bint has_a, has_m, take_a
    cdef Field* f
    cdef Py_ssize_t count = len(s._arrays) + len(s._meta)
    if <uint64_t>count > _MAX_FIELDS:
        raise ValueError(f"a sample holds at most {_MAX_FIELDS} fields, this one has {count}")
    has_a = PyDict_Next(s._arrays, &pa, &ka, &va)
    if has_a:
        sa = _utf8(ka, &na)
    has_m = PyDict_Next(s._meta, &pm, &km, &vm)
    if has_m:
        sm = _utf8(km, &nm)
    while has_a or has_m:
        take_a = has_a and (not has_m or _name_cmp(sa, na, sm, nm) < 0)
        f = &fields[i]
        if take_a:
            f.name = sa
            f.name_len = na
            _plan_array(f, <str>ka, <cnp.ndarray>va)
            table += 4 + na + 8 * f.ndim
            if f.nbytes > INT64_MAX - data - _ALIGN:
                raise ValueError("the encoding would exceed 2**63 - 1 bytes")
            data = _align(data + f.nbytes)
            has_a = PyDict_Next(s._arrays, &pa, &ka, &va)
            if has_a:
                sa = _utf8(ka, &na)
        else:
            f.name = sm
            f.name_len = nm
            _plan_meta(f, <str>km, <object>vm)
            table += 2 + nm
            if f.kind == _KIND_INT or f.kind == _KIND_FLOAT:
                table += 8
            elif f.kind == _KIND_BOOL:
                table += 1
            elif f.kind == _KIND_STR:
                table += 4 + <Py_ssize_t>f.bits
            has_m = PyDict_Next(s._meta, &pm, &km, &vm)
            if has_m:
                sm = _utf8(km, &nm)
        i += 1
    if i != count:
        raise RuntimeError("Sample fields changed while encoding")
    table_out[0] = table
    if data > INT64_MAX - _align(_HEADER + table):
        raise ValueError("the encoding would exceed 2**63 - 1 bytes")
    return _align(_HEADER + table) + data


cdef int _place_arrays(Field* fields, Py_ssize_t n, Py_ssize_t table) noexcept nogil:
    """Set the data offset of every array field."""
    cdef Py_ssize_t i, d = _align(_HEADER + table)
    for i in range(n):
        if fields[i].kind == _KIND_ARRAY:
            fields[i].offset = d
            d = _align(d + fields[i].nbytes)
    return 0


cdef int _copy_strided(Field* fields, Py_ssize_t n, uint8_t* dst) except -1:
    """Let numpy copy the arrays that are not C-contiguous in native order into place (any
    strides, byte swapping included); the checksum pass then only reads them."""
    cdef Py_ssize_t i
    cdef Field* f
    for i in range(n):
        f = &fields[i]
        if f.kind == _KIND_ARRAY and not f.direct and f.nbytes:
            Py_INCREF(<object>_DESCR[f.code])  # stolen by PyArray_NewFromDescr
            view = PyArray_NewFromDescr(<PyTypeObject*>cnp.ndarray, _DESCR[f.code], f.ndim, f.dims, NULL,
                                        dst + f.offset, cnp.NPY_ARRAY_WRITEABLE, NULL)
            cnp.PyArray_CopyInto(view, <cnp.ndarray>f.obj)
    return 0


cdef void _write(Field* fields, Py_ssize_t n, Py_ssize_t table, Py_ssize_t total, uint8_t* dst) noexcept nogil:
    """Header, field table, padding and array data into ``dst[:total]``, checksum last; one
    pass over the array data (copy and checksum fused)."""
    cdef codec_lanes s
    cdef uint8_t tail[_ALIGN]
    cdef Py_ssize_t i, p = _HEADER, start = _align(_HEADER + table), full, rest
    cdef uint32_t n32
    cdef int k
    cdef Field* f
    cdef uint16_t version = _VERSION
    memset(dst, 0, _HEADER)
    memcpy(dst, _MAGIC, 8)
    memcpy(dst + 8, &version, 2)
    n32 = <uint32_t>n
    memcpy(dst + 12, &n32, 4)
    _wr64(dst + 16, <uint64_t>total)
    _wr64(dst + 24, <uint64_t>table)
    for i in range(n):
        f = &fields[i]
        dst[p] = <uint8_t>f.kind
        dst[p + 1] = <uint8_t>f.name_len
        memcpy(dst + p + 2, f.name, f.name_len)
        p += 2 + f.name_len
        if f.kind == _KIND_ARRAY:
            dst[p] = <uint8_t>f.code
            dst[p + 1] = <uint8_t>f.ndim
            p += 2
            for k in range(f.ndim):
                _wr64(dst + p, <uint64_t>f.dims[k])
                p += 8
        elif f.kind == _KIND_INT or f.kind == _KIND_FLOAT:
            _wr64(dst + p, f.bits)
            p += 8
        elif f.kind == _KIND_BOOL:
            dst[p] = <uint8_t>f.bits
            p += 1
        elif f.kind == _KIND_STR:
            n32 = <uint32_t>f.bits
            memcpy(dst + p, &n32, 4)
            memcpy(dst + p + 4, f.src, <size_t>f.bits)
            p += 4 + <Py_ssize_t>f.bits
    memset(dst + p, 0, start - p)
    memset(&s, 0, sizeof(s))
    _blocks(&s, NULL, dst, <size_t>(start // _ALIGN))
    for i in range(n):
        f = &fields[i]
        if f.kind != _KIND_ARRAY or f.nbytes == 0:
            continue
        full = f.nbytes // _ALIGN
        rest = f.nbytes - full * _ALIGN
        if f.direct:
            _blocks(&s, dst + f.offset, f.src, <size_t>full)
            if rest:
                memset(tail, 0, _ALIGN)
                memcpy(tail, f.src + full * _ALIGN, rest)
                memcpy(dst + f.offset + full * _ALIGN, tail, _ALIGN)
                _blocks(&s, NULL, tail, 1)
        else:  # already copied by numpy: zero the padding, then only sum
            if rest:
                memset(dst + f.offset + f.nbytes, 0, _ALIGN - rest)
            _blocks(&s, NULL, dst + f.offset, <size_t>(full + (rest != 0)))
    _wr64(dst + _CHECKSUM_AT, _finish(&s))


cdef int _encode_to(Field* fields, Py_ssize_t n, Py_ssize_t table, Py_ssize_t total, uint8_t* dst) except -1:
    _place_arrays(fields, n, table)
    _copy_strided(fields, n, dst)
    if total >= _NOGIL_MIN:
        with nogil:
            _write(fields, n, table, total, dst)
    else:
        _write(fields, n, table, total, dst)
    return 0


cdef Field* _alloc_fields(Sample s, Field* stack):
    cdef Py_ssize_t n = len(s._arrays) + len(s._meta)
    if n <= _STACK_FIELDS:
        return stack
    cdef Field* f = <Field*>PyMem_Malloc(n * sizeof(Field))
    if f == NULL:
        raise MemoryError()
    return f


def encoded_size(sample):
    """Bytes that ``encode(sample)`` produces (and ``encode_into`` needs)."""
    cdef Sample s = _check_sample(sample)
    cdef Field stack[_STACK_FIELDS]
    cdef Field* fields = _alloc_fields(s, stack)
    cdef Py_ssize_t table
    try:
        return _plan(s, fields, &table)
    finally:
        if fields != stack:
            PyMem_Free(fields)


def encode(sample):
    """The canonical encoding of ``sample`` (docs/sample-format.md)."""
    cdef Sample s = _check_sample(sample)
    cdef Field stack[_STACK_FIELDS]
    cdef Field* fields = _alloc_fields(s, stack)
    cdef Py_ssize_t table, total, n = len(s._arrays) + len(s._meta)
    try:
        total = _plan(s, fields, &table)
        out = PyBytes_FromStringAndSize(NULL, total)
        _encode_to(fields, n, table, total, <uint8_t*>PyBytes_AS_STRING(out))
        return out
    finally:
        if fields != stack:
            PyMem_Free(fields)


cdef int _check_overlap(Field* fields, Py_ssize_t n, size_t start, size_t end) except -1:
    """Refuse a destination that overlaps the memory an array reads (numpy's extent rule)."""
    cdef Py_ssize_t i
    cdef int k
    cdef size_t lo, hi
    cdef cnp.npy_intp step
    cdef cnp.ndarray a
    for i in range(n):
        if fields[i].kind != _KIND_ARRAY:
            continue
        a = <cnp.ndarray>fields[i].obj
        if cnp.PyArray_SIZE(a) == 0:
            continue
        lo = hi = <size_t>cnp.PyArray_DATA(a)
        for k in range(cnp.PyArray_NDIM(a)):
            step = cnp.PyArray_STRIDES(a)[k] * (cnp.PyArray_DIMS(a)[k] - 1)
            if step > 0:
                hi += <size_t>step
            else:
                lo -= <size_t>(-step)
        hi += <size_t>cnp.PyArray_ITEMSIZE(a)
        if lo < end and start < hi:
            name = PyUnicode_DecodeUTF8(fields[i].name, fields[i].name_len, NULL)
            raise ValueError(f"the buffer overlaps the memory of array {name!r}")
    return 0


def encode_into(sample, buf):
    """Write the encoding of ``sample`` to the start of the writable buffer ``buf``; returns
    the number of bytes written. Raises ValueError, naming the size needed, if it is too small,
    and if it overlaps the memory of one of the sample's arrays."""
    cdef Sample s = _check_sample(sample)
    cdef Py_buffer view
    cdef cnp.ndarray arr
    if type(buf) is cnp.ndarray:  # numpy cannot resize a referenced array: no export needed
        arr = <cnp.ndarray>buf
        if not cnp.PyArray_ISWRITEABLE(arr):
            raise TypeError(f"encode_into() needs a writable buffer, got a read-only {_typename(buf)}")
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            raise TypeError("encode_into() needs a C-contiguous buffer")
        return _encode_into(s, <uint8_t*>cnp.PyArray_DATA(arr), cnp.PyArray_NBYTES(arr))
    if not PyObject_CheckBuffer(buf):
        raise TypeError(f"encode_into() needs a writable bytes-like object, got {_typename(buf)}")
    PyObject_GetBuffer(buf, &view, PyBUF_FULL_RO)  # held until done: the buffer cannot resize
    try:
        if view.readonly:
            raise TypeError(f"encode_into() needs a writable buffer, got a read-only {_typename(buf)}")
        if not PyBuffer_IsContiguous(&view, b'C'):
            raise TypeError("encode_into() needs a C-contiguous buffer")
        return _encode_into(s, <uint8_t*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef Py_ssize_t _encode_into(Sample s, uint8_t* dst, Py_ssize_t size) except -1:
    cdef Field stack[_STACK_FIELDS]
    cdef Field* fields = _alloc_fields(s, stack)
    cdef Py_ssize_t table, total, n = len(s._arrays) + len(s._meta)
    try:
        total = _plan(s, fields, &table)
        if size < total:
            raise ValueError(f"buffer too small: the encoding needs {total} bytes, the buffer has {size}")
        _check_overlap(fields, n, <size_t>dst, <size_t>dst + <size_t>total)
        _encode_to(fields, n, table, total, dst)
        return total
    finally:
        if fields != stack:
            PyMem_Free(fields)


# ---------------------------------------------------------------------------------------------
# decode


cdef list _names = [None] * _NAME_CACHE  # name str of field i in the last decode
# Their UTF-8 bytes (owned by the str objects that _names holds), compared without a call.
cdef const char* _name_bytes[_NAME_CACHE]
cdef Py_ssize_t _name_len[_NAME_CACHE]


cdef object _name_at(Py_ssize_t i, const uint8_t* p, Py_ssize_t n):
    """The field name at ``p[:n]`` as str, reusing the previous decode's object when equal."""
    cdef Py_ssize_t cn
    cdef const char* c
    if i < _NAME_CACHE and _name_len[i] == n and memcmp(_name_bytes[i], p, <size_t>n) == 0:
        return _names[i]
    try:
        name = PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
    except UnicodeDecodeError:
        raise CodecError(f"field {i}: name is not valid utf-8") from None
    if i < _NAME_CACHE:
        c = PyUnicode_AsUTF8AndSize(name, &cn)  # before the cache changes: it can raise
        _names[i] = name
        _name_bytes[i] = c
        _name_len[i] = cn
    return name


cdef int _check_padding(const uint8_t* data, Py_ssize_t lo, Py_ssize_t hi) except -1:
    cdef Py_ssize_t k = lo
    while k + 8 <= hi and _rd64(data + k) == 0:  # eight bytes a step; a nonzero word is found bytewise
        k += 8
    for k in range(k, hi):
        if data[k]:
            raise CodecError(f"nonzero padding byte at offset {k}")
    return 0


cdef object _view(const uint8_t* p, int code, int ndim, cnp.npy_intp* dims, object base, bint writable):
    """An ndarray of dtype ``code`` over ``p`` that keeps ``base`` alive."""
    Py_INCREF(<object>_DESCR[code])  # stolen by PyArray_NewFromDescr
    arr = PyArray_NewFromDescr(<PyTypeObject*>cnp.ndarray, _DESCR[code], ndim, dims, NULL, <void*>p,
                               cnp.NPY_ARRAY_WRITEABLE if writable else 0, NULL)
    cnp.set_array_base(<cnp.ndarray>arr, base)
    return arr


cdef object _decode(const uint8_t* data, Py_ssize_t n, object base, bint writable):
    cdef uint64_t total, table, stored, computed, dim, size, nbytes, slen
    cdef uint32_t n_fields, i
    cdef uint16_t version, flags
    cdef Py_ssize_t p, end, d
    cdef int kind, nlen, code, ndim, k
    cdef bint empty
    cdef cnp.npy_intp dims[_MAX_NDIM]
    cdef const uint8_t* prev = NULL
    cdef Py_ssize_t prev_len = 0
    cdef int64_t iv
    cdef double fv
    cdef dict arrays, meta
    cdef Sample s
    if n < _HEADER:
        raise CodecError(f"truncated: buffer has {n} bytes, less than the {_HEADER}-byte header")
    if memcmp(data, _MAGIC, 8) != 0:
        raise CodecError("bad magic: not an encoded sample")
    version = _rd16(data + 8)
    if version != _VERSION:
        raise CodecError(f"unsupported format version {version} (this build reads {_VERSION})")
    total = _rd64(data + 16)
    if total > <uint64_t>n:
        raise CodecError(f"truncated: header says {total} bytes, buffer has {n}")
    if total < <uint64_t>n:
        raise CodecError(f"trailing bytes: header says {total} bytes, buffer has {n}")
    if n % _ALIGN:
        raise CodecError(f"size {n} is not a multiple of {_ALIGN}")
    computed = _checksum(data, n)
    stored = _rd64(data + _CHECKSUM_AT)
    if computed != stored:
        raise CodecError(f"checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")
    # From here on the bytes are intact; what follows catches well-checksummed crafted input.
    flags = _rd16(data + 10)
    if flags:
        raise CodecError(f"unsupported flags {flags:#06x}")
    if _rd64(data + _HEADER_USED) | _rd64(data + _HEADER_USED + 8) | _rd64(data + _HEADER_USED + 16):
        raise CodecError("reserved header bytes are not zero")
    table = _rd64(data + 24)
    if table > total - _HEADER:
        raise CodecError(f"field table of {table} bytes overruns the {total}-byte encoding")
    n_fields = _rd32(data + 12)
    end = _HEADER + <Py_ssize_t>table
    d = _align(end)
    _check_padding(data, end, d)
    p = _HEADER
    arrays = {}
    meta = {}
    for i in range(n_fields):
        if end - p < 2:
            raise CodecError(f"field {i}: runs past the end of the field table")
        kind = data[p]
        nlen = data[p + 1]
        p += 2
        if nlen == 0:
            raise CodecError(f"field {i}: empty name")
        if end - p < nlen:
            raise CodecError(f"field {i}: runs past the end of the field table")
        name = _name_at(i, data + p, nlen)
        if prev != NULL and _name_cmp(<const char*>(data + p), nlen, <const char*>prev, prev_len) <= 0:
            if _name_cmp(<const char*>(data + p), nlen, <const char*>prev, prev_len) == 0:
                raise CodecError(f"duplicate field name {name!r}")
            raise CodecError(f"field {i} ({name!r}): names are not in sorted order")
        prev = data + p
        prev_len = nlen
        p += nlen
        if kind == _KIND_ARRAY:
            if end - p < 2:
                raise CodecError(f"field {i} ({name!r}): runs past the end of the field table")
            code = data[p]
            ndim = data[p + 1]
            p += 2
            if code < 1 or code >= _N_CODES:
                raise CodecError(f"field {i} ({name!r}): unknown dtype code {code}")
            if ndim > _MAX_NDIM:
                raise CodecError(f"field {i} ({name!r}): {ndim} dimensions (at most {_MAX_NDIM})")
            if end - p < 8 * ndim:
                raise CodecError(f"field {i} ({name!r}): runs past the end of the field table")
            # itemsize times the nonzero dimensions must fit in int64 (numpy's own rule)
            size = <uint64_t>_ITEMSIZE[code]
            empty = False
            for k in range(ndim):
                dim = _rd64(data + p + 8 * k)
                if dim == 0:
                    empty = True
                elif codec_mul_past_int64(size, dim, &size):
                    shape = tuple([_rd64(data + p + 8 * j) for j in range(ndim)])
                    raise CodecError(f"field {i} ({name!r}): shape {shape} overflows")
                dims[k] = <cnp.npy_intp>dim
            p += 8 * ndim
            nbytes = 0 if empty else size
            if nbytes > total - <uint64_t>d:
                raise CodecError(
                    f"field {i} ({name!r}): array data out of bounds ({nbytes} bytes at offset {d}, encoding has {total})"
                )
            arrays[name] = _view(data + d, code, ndim, dims, base, writable)
            _check_padding(data, d + <Py_ssize_t>nbytes, _align(d + <Py_ssize_t>nbytes))
            d = _align(d + <Py_ssize_t>nbytes)
        elif kind == _KIND_INT or kind == _KIND_FLOAT:
            if end - p < 8:
                raise CodecError(f"field {i} ({name!r}): runs past the end of the field table")
            if kind == _KIND_INT:
                memcpy(&iv, data + p, 8)
                meta[name] = PyLong_FromLongLong(iv)
            else:
                memcpy(&fv, data + p, 8)
                meta[name] = PyFloat_FromDouble(fv)
            p += 8
        elif kind == _KIND_BOOL:
            if end - p < 1:
                raise CodecError(f"field {i} ({name!r}): runs past the end of the field table")
            k = data[p]
            p += 1
            if k > 1:
                raise CodecError(f"field {i} ({name!r}): bool byte {k} is not 0 or 1")
            meta[name] = k == 1
        elif kind == _KIND_STR:
            if end - p < 4:
                raise CodecError(f"field {i} ({name!r}): runs past the end of the field table")
            slen = _rd32(data + p)
            p += 4
            if <uint64_t>(end - p) < slen:
                raise CodecError(f"field {i} ({name!r}): runs past the end of the field table")
            try:
                meta[name] = PyUnicode_DecodeUTF8(<const char*>(data + p), <Py_ssize_t>slen, NULL)
            except UnicodeDecodeError:
                raise CodecError(f"field {i} ({name!r}): str value is not valid utf-8") from None
            p += <Py_ssize_t>slen
        elif kind == _KIND_NONE:
            meta[name] = None
        else:
            raise CodecError(f"field {i} ({name!r}): unknown kind {kind}")
    if p != end:
        raise CodecError(f"field table has {end - p} unused bytes")
    if <uint64_t>d != total:
        raise CodecError(f"{total - <uint64_t>d} bytes after the last field")
    s = Sample.__new__(Sample)
    s._arrays = arrays
    s._meta = meta
    return s


def decode(buf):
    """The Sample encoded in ``buf`` (bytes, bytearray, memoryview, numpy uint8, anything
    C-contiguous with the buffer protocol). Arrays are views into ``buf`` (read-only when it is)
    that keep it alive. Raises CodecError for anything but a valid encoding; never executes
    anything from the input."""
    cdef Py_buffer* view
    if type(buf) is bytes:  # immutable: the arrays can hold the bytes object itself
        return _decode(<const uint8_t*>PyBytes_AS_STRING(buf), PyBytes_GET_SIZE(buf), buf, False)
    if type(buf) is cnp.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>buf):
        # numpy refuses to resize an array that is referenced, so the array itself is a safe
        # base (no memoryview needed)
        return _decode(<const uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>buf), cnp.PyArray_NBYTES(<cnp.ndarray>buf), buf,
                       cnp.PyArray_ISWRITEABLE(<cnp.ndarray>buf))
    if not PyObject_CheckBuffer(buf):
        raise TypeError(f"decode() needs a bytes-like object, got {_typename(buf)}")
    mv = PyMemoryView_FromObject(buf)  # holds the export: a bytearray cannot resize under the views
    view = PyMemoryView_GET_BUFFER(mv)
    if not PyBuffer_IsContiguous(view, b'C'):
        raise TypeError("decode() needs a C-contiguous buffer")
    return _decode(<const uint8_t*>view.buf, view.len, mv, not view.readonly)
