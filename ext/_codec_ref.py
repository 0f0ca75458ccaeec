"""Pure-Python reference of the sample codec (the oracle for ``ext._codec``).

A ``Sample`` is a small record: named numpy arrays plus named scalar metadata. ``encode``
turns it into a self-describing, pickle-free byte string; ``decode`` turns such bytes back
into a Sample whose arrays are zero-copy views into the input. The byte layout is specified in
docs/sample-format.md; this module is that specification in executable form, and the compiled
module must produce the very same bytes and raise the same errors (type and message).

Design points shared with the compiled module:

* Canonical encoding. Fields are sorted by name (UTF-8 byte order, which is code-point order),
  all padding is zero, arrays sit at the first 64-byte boundary after the previous field, and
  the total size is exactly what the fields need. The decoder rejects anything else, so every
  accepted input is the unique encoding of its Sample: ``encode(decode(b)) == b``.
* Validation before use. Every length, offset and shape product read from the input is
  checked, with overflow-safe arithmetic, against the bytes actually present before anything
  is sliced or allocated; nothing in the input is ever executed or imported.
* A 64-bit Fletcher-style checksum over 8 lanes of little-endian words (``checksum``) covers
  the whole encoding; any change confined to one aligned 8-byte word is always detected (see
  the proof in docs/sample-format.md), so every single-byte corruption is.

This reference uses ``struct`` for the header and field table and numpy for the array copies
and the checksum lanes; it is correct on hosts of either byte order.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

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

MAGIC = b"\x89ASAMP\r\n"
FORMAT_VERSION = 1
HEADER_SIZE = 64
ALIGNMENT = 64  # of every array's data, relative to the start of the encoding
MAX_NAME_BYTES = 255
MAX_NDIM = 8
_MAX_STR_BYTES = 0xFFFFFFFF
_MAX_FIELDS = 0xFFFFFFFF
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_M64 = 2**64 - 1

_KIND_ARRAY, _KIND_INT, _KIND_FLOAT, _KIND_BOOL, _KIND_STR, _KIND_NONE = 1, 2, 3, 4, 5, 6

# dtype code -> wire dtype (little-endian)
_DTYPES = {
    1: np.dtype("|b1"),
    2: np.dtype("|i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("|u1"),
    7: np.dtype("<u2"),
    8: np.dtype("<u4"),
    9: np.dtype("<u8"),
    10: np.dtype("<f2"),
    11: np.dtype("<f4"),
    12: np.dtype("<f8"),
}
_CODES = {(dt.kind, dt.itemsize): code for code, dt in _DTYPES.items()}
_SUPPORTED = "bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, float32, float64"

# header: magic, version, flags, n_fields, total size, field table size, checksum; 24 reserved
_HEADER = struct.Struct("<8sHHIQQQ")
_CHECKSUM_AT = 32
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")

# Checksum lane weights: odd for the plain sums, even for the running sums (see the docs).
_KA = tuple((0x9E3779B97F4A7C15 * (2 * j + 1)) & _M64 for j in range(8))
_KB = tuple(((0xC2B2AE3D27D4EB4F * (2 * j + 1)) << 1) & _M64 for j in range(8))
_CHUNK_BLOCKS = 1 << 16  # bounds the temporaries of the vectorised running sum


def _typename(obj: object) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) & -ALIGNMENT


# ---------------------------------------------------------------------------------------------
# checksum


def _fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finalizer: a bijection, so it keeps every difference."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _M64
    k ^= k >> 33
    return k


def _checksum(mv: memoryview) -> int:
    """Checksum of ``mv`` (whole 64-byte blocks), its bytes 32..39 taken as zero."""
    words = np.frombuffer(mv, dtype="<u8").reshape(-1, 8)
    n = words.shape[0]
    a = np.zeros(8, dtype=np.uint64)
    b = np.zeros(8, dtype=np.uint64)
    # a: lane sums; b: sums of the running lane sums = sum over blocks t of (n - t) * w_t.
    # uint64 array arithmetic wraps modulo 2**64, as the C kernels do.
    for start in range(0, n, _CHUNK_BLOCKS):
        chunk = words[start : start + _CHUNK_BLOCKS]
        weights = np.arange(n - start, n - start - chunk.shape[0], -1, dtype=np.uint64)
        a += chunk.sum(axis=0, dtype=np.uint64)
        b += (chunk * weights[:, None]).sum(axis=0, dtype=np.uint64)
    lane_a = [int(x) for x in a]
    lane_b = [int(x) for x in b]
    stored = int(words[0, 4])  # the checksum field is word 4 of block 0: take it out
    lane_a[4] = (lane_a[4] - stored) & _M64
    lane_b[4] = (lane_b[4] - stored * n) & _M64
    x = sum(lane_a[j] * _KA[j] + lane_b[j] * _KB[j] for j in range(8)) & _M64
    return _fmix64(x)


def _readable(buf: object, what: str) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"{what} needs a bytes-like object, got {_typename(buf)}") from None
    if not mv.c_contiguous:
        raise TypeError(f"{what} needs a C-contiguous buffer")
    return _bytes_view(mv)


def _bytes_view(mv: memoryview) -> memoryview:
    """``mv`` (C-contiguous) as a flat memoryview of unsigned bytes, same writability."""
    if mv.format == "B" and mv.ndim == 1:
        return mv
    return memoryview(np.frombuffer(mv, dtype=np.uint8))


def checksum(buf: object) -> int:
    """The checksum of the encoding in ``buf`` as the header stores it (bytes 32..39 are taken
    as zero); ``buf`` must be a whole number of 64-byte blocks."""
    mv = _readable(buf, "checksum()")
    n = mv.nbytes
    if n < HEADER_SIZE or n % ALIGNMENT:
        raise ValueError(f"checksum() needs a positive multiple of 64 bytes, got {n}")
    return _checksum(mv)


# ---------------------------------------------------------------------------------------------
# Sample


def _check_name(name: object) -> str:
    if type(name) is not str:
        if not isinstance(name, str):
            raise TypeError(f"field names must be str, got {_typename(name)}")
        name = str(name)
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"field name {name!r} is not valid utf-8") from None
    if n == 0:
        raise ValueError("field names must not be empty")
    if n > MAX_NAME_BYTES:
        raise ValueError(f"field name {name!r} is {n} bytes of utf-8 (at most {MAX_NAME_BYTES})")
    return name


def _dtype_code(name: str, a: np.ndarray) -> int:
    dt = a.dtype
    code = _CODES.get((dt.kind, dt.itemsize)) if dt.fields is None else None
    if code is None:
        raise TypeError(f"array {name!r} has unsupported dtype {dt} (supported: {_SUPPORTED})")
    if a.ndim > MAX_NDIM:
        raise ValueError(f"array {name!r} has {a.ndim} dimensions (at most {MAX_NDIM})")
    return code


def _check_array(name: str, a: object) -> np.ndarray:
    if type(a) is not np.ndarray:
        raise TypeError(f"array {name!r} must be a numpy.ndarray, got {_typename(a)}")
    _dtype_code(name, a)
    if not a.dtype.isnative:  # the wire is little-endian; a Sample holds native arrays
        a = a.astype(a.dtype.newbyteorder("="))
    return a


def _check_str(name: str, v: str) -> str:
    try:
        n = len(v.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"meta {name!r}: str is not valid utf-8") from None
    if n > _MAX_STR_BYTES:
        raise ValueError(f"meta {name!r}: str of {n} bytes is too long (at most {_MAX_STR_BYTES})")
    return v


def _check_meta(name: str, v: object) -> object:
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
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise ValueError(f"meta {name!r} is out of the int64 range")
    return v


def _new_sample(arrays: dict, meta: dict) -> Sample:
    """A Sample from already validated, sorted fields (no checks)."""
    s = Sample.__new__(Sample)
    s._arrays = arrays
    s._meta = meta
    return s


def _same_bits(x: object, y: object) -> bool:
    if type(x) is not type(y):
        return False
    if type(x) is float:
        return _F64.pack(x) == _F64.pack(y)
    return x == y


class Sample:
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

    __slots__ = ("_arrays", "_meta")
    __hash__ = None  # the arrays are mutable

    def __init__(self, arrays: Mapping | None = None, meta: Mapping | None = None) -> None:
        arrs = {}
        if arrays is not None:
            if not isinstance(arrays, Mapping):
                raise TypeError(f"arrays must be a mapping of names to numpy arrays, got {_typename(arrays)}")
            for name, a in arrays.items():
                name = _check_name(name)
                arrs[name] = _check_array(name, a)
        ms = {}
        if meta is not None:
            if not isinstance(meta, Mapping):
                raise TypeError(f"meta must be a mapping of names to scalars, got {_typename(meta)}")
            for name, v in meta.items():
                name = _check_name(name)
                if name in arrs:
                    raise ValueError(f"duplicate field name {name!r}")
                ms[name] = _check_meta(name, v)
        self._arrays = {k: arrs[k] for k in sorted(arrs)}
        self._meta = {k: ms[k] for k in sorted(ms)}

    @property
    def arrays(self) -> Mapping:
        """The arrays, by name (sorted), read-only."""
        return MappingProxyType(self._arrays)

    @property
    def meta(self) -> Mapping:
        """The scalar metadata, by name (sorted), read-only."""
        return MappingProxyType(self._meta)

    def __getitem__(self, name):
        try:
            return self._arrays[name]
        except KeyError:
            return self._meta[name]

    def __contains__(self, name) -> bool:
        return name in self._arrays or name in self._meta

    def __eq__(self, other):
        if not isinstance(other, Sample):
            return NotImplemented
        if self._arrays.keys() != other._arrays.keys() or self._meta.keys() != other._meta.keys():
            return False
        for name, a in self._arrays.items():
            b = other._arrays[name]
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                return False
        return all(_same_bits(v, other._meta[name]) for name, v in self._meta.items())

    def __repr__(self) -> str:
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


def _check_sample(sample: object) -> Sample:
    if not isinstance(sample, Sample):
        raise TypeError(f"expected a Sample, got {_typename(sample)}")
    return sample


def _plan(sample: Sample):
    """Fields in wire order as (name, name bytes, kind, value, code) plus the table size and
    the total size."""
    fields = []
    for name, a in sample._arrays.items():
        fields.append((name, name.encode("utf-8"), _KIND_ARRAY, a, _dtype_code(name, a)))
    for name, v in sample._meta.items():
        if v is None:
            kind = _KIND_NONE
        elif type(v) is bool:
            kind = _KIND_BOOL
        elif type(v) is int:
            kind = _KIND_INT
        elif type(v) is float:
            kind = _KIND_FLOAT
        else:
            kind = _KIND_STR
        fields.append((name, name.encode("utf-8"), kind, v, 0))
    fields.sort(key=lambda f: f[1])
    if len(fields) > _MAX_FIELDS:
        raise ValueError(f"a sample holds at most {_MAX_FIELDS} fields, this one has {len(fields)}")
    table = 0
    data = 0
    for _, nb, kind, v, _ in fields:
        table += 2 + len(nb)
        if kind == _KIND_ARRAY:
            table += 2 + 8 * v.ndim
            data = _align(data + v.nbytes)
        elif kind in (_KIND_INT, _KIND_FLOAT):
            table += 8
        elif kind == _KIND_BOOL:
            table += 1
        elif kind == _KIND_STR:
            table += 4 + len(v.encode("utf-8"))
    total = _align(HEADER_SIZE + table) + data
    if total > _INT64_MAX:
        raise ValueError("the encoding would exceed 2**63 - 1 bytes")
    return fields, table, total


def encoded_size(sample: Sample) -> int:
    """Bytes that ``encode(sample)`` produces (and ``encode_into`` needs)."""
    return _plan(_check_sample(sample))[2]


def _write(fields, table: int, total: int) -> bytearray:
    out = bytearray(total)  # zero-filled: every padding byte is zero
    _HEADER.pack_into(out, 0, MAGIC, FORMAT_VERSION, 0, len(fields), total, table, 0)
    p = HEADER_SIZE
    d = _align(HEADER_SIZE + table)
    for _, nb, kind, v, code in fields:
        out[p : p + 2] = bytes((kind, len(nb)))
        out[p + 2 : p + 2 + len(nb)] = nb
        p += 2 + len(nb)
        if kind == _KIND_ARRAY:
            out[p : p + 2] = bytes((code, v.ndim))
            struct.pack_into(f"<{v.ndim}Q", out, p + 2, *v.shape)
            p += 2 + 8 * v.ndim
            if v.size:
                view = np.ndarray(v.shape, dtype=_DTYPES[code], buffer=out, offset=d)
                view[...] = v  # any strides, any byte order -> C order, little-endian
                del view  # releases its export of ``out``
            d = _align(d + v.nbytes)
        elif kind == _KIND_INT:
            _I64.pack_into(out, p, v)
            p += 8
        elif kind == _KIND_FLOAT:
            _F64.pack_into(out, p, v)
            p += 8
        elif kind == _KIND_BOOL:
            out[p] = 1 if v else 0
            p += 1
        elif kind == _KIND_STR:
            sb = v.encode("utf-8")
            _U32.pack_into(out, p, len(sb))
            out[p + 4 : p + 4 + len(sb)] = sb
            p += 4 + len(sb)
    _U64.pack_into(out, _CHECKSUM_AT, _checksum(memoryview(out)))
    return out


def encode(sample: Sample) -> bytes:
    """The canonical encoding of ``sample`` (docs/sample-format.md)."""
    fields, table, total = _plan(_check_sample(sample))
    return bytes(_write(fields, table, total))


def _extent(a: np.ndarray):
    """Half-open address range of the memory that ``a`` reads; None if it reads none."""
    if a.size == 0:
        return None
    lo = hi = a.__array_interface__["data"][0]
    for n, s in zip(a.shape, a.strides):
        if s > 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    return lo, hi + a.itemsize


def encode_into(sample: Sample, buf: object) -> int:
    """Write the encoding of ``sample`` to the start of the writable buffer ``buf``; returns
    the number of bytes written. Raises ValueError, naming the size needed, if it is too small,
    and if it overlaps the memory of one of the sample's arrays."""
    _check_sample(sample)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"encode_into() needs a writable bytes-like object, got {_typename(buf)}") from None
    if mv.readonly:
        raise TypeError(f"encode_into() needs a writable buffer, got a read-only {_typename(buf)}")
    if not mv.c_contiguous:
        raise TypeError("encode_into() needs a C-contiguous buffer")
    mv = _bytes_view(mv)
    fields, table, total = _plan(sample)
    if mv.nbytes < total:
        raise ValueError(f"buffer too small: the encoding needs {total} bytes, the buffer has {mv.nbytes}")
    start = np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0]
    for name, _, kind, v, _ in fields:
        if kind == _KIND_ARRAY:
            ext = _extent(v)
            if ext is not None and ext[0] < start + total and start < ext[1]:
                raise ValueError(f"the buffer overlaps the memory of array {name!r}")
    mv[:total] = _write(fields, table, total)
    return total


# ---------------------------------------------------------------------------------------------
# decode


def _first_nonzero(mv: memoryview, lo: int, hi: int) -> int:
    """Offset of the first nonzero byte in mv[lo:hi], or -1."""
    gap = mv[lo:hi].tobytes()
    stripped = gap.lstrip(b"\0")
    return -1 if not stripped else lo + len(gap) - len(stripped)


def _check_padding(mv: memoryview, lo: int, hi: int) -> None:
    at = _first_nonzero(mv, lo, hi)
    if at >= 0:
        raise CodecError(f"nonzero padding byte at offset {at}")


def decode(buf: object) -> Sample:
    """The Sample encoded in ``buf`` (bytes, bytearray, memoryview, numpy uint8, anything
    C-contiguous with the buffer protocol). Arrays are views into ``buf`` (read-only when it is)
    that keep it alive. Raises CodecError for anything but a valid encoding; never executes
    anything from the input."""
    mv = _readable(buf, "decode()")
    n = mv.nbytes
    if n < HEADER_SIZE:
        raise CodecError(f"truncated: buffer has {n} bytes, less than the {HEADER_SIZE}-byte header")
    magic, version, flags, n_fields, total, table, stored = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError("bad magic: not an encoded sample")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
    if total > n:
        raise CodecError(f"truncated: header says {total} bytes, buffer has {n}")
    if total < n:
        raise CodecError(f"trailing bytes: header says {total} bytes, buffer has {n}")
    if n % ALIGNMENT:
        raise CodecError(f"size {n} is not a multiple of {ALIGNMENT}")
    computed = _checksum(mv)
    if computed != stored:
        raise CodecError(f"checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")
    # From here on the bytes are intact; what follows catches well-checksummed crafted input.
    if flags:
        raise CodecError(f"unsupported flags {flags:#06x}")
    if _first_nonzero(mv, _HEADER.size, HEADER_SIZE) >= 0:
        raise CodecError("reserved header bytes are not zero")
    if table > total - HEADER_SIZE:
        raise CodecError(f"field table of {table} bytes overruns the {total}-byte encoding")
    end = HEADER_SIZE + table
    d = _align(end)
    _check_padding(mv, end, d)
    p = HEADER_SIZE
    arrays = {}
    meta = {}
    prev = b""
    for i in range(n_fields):
        if end - p < 2:
            raise CodecError(f"field {i}: runs past the end of the field table")
        kind, nlen = mv[p], mv[p + 1]
        p += 2
        if nlen == 0:
            raise CodecError(f"field {i}: empty name")
        if end - p < nlen:
            raise CodecError(f"field {i}: runs past the end of the field table")
        nb = mv[p : p + nlen].tobytes()
        p += nlen
        try:
            name = nb.decode("utf-8")
        except UnicodeDecodeError:
            raise CodecError(f"field {i}: name is not valid utf-8") from None
        if nb <= prev:
            if nb == prev:
                raise CodecError(f"duplicate field name {name!r}")
            raise CodecError(f"field {i} ({name!r}): names are not in sorted order")
        prev = nb
        where = f"field {i} ({name!r})"
        if kind == _KIND_ARRAY:
            if end - p < 2:
                raise CodecError(f"{where}: runs past the end of the field table")
            code, ndim = mv[p], mv[p + 1]
            p += 2
            dt = _DTYPES.get(code)
            if dt is None:
                raise CodecError(f"{where}: unknown dtype code {code}")
            if ndim > MAX_NDIM:
                raise CodecError(f"{where}: {ndim} dimensions (at most {MAX_NDIM})")
            if end - p < 8 * ndim:
                raise CodecError(f"{where}: runs past the end of the field table")
            shape = struct.unpack_from(f"<{ndim}Q", mv, p)
            p += 8 * ndim
            # itemsize times the nonzero dimensions must fit in int64 (numpy's own rule)
            size = dt.itemsize
            empty = False
            for dim in shape:
                if dim == 0:
                    empty = True
                elif dim > _INT64_MAX // size:
                    raise CodecError(f"{where}: shape {shape} overflows")
                else:
                    size *= dim
            nbytes = 0 if empty else size
            if nbytes > total - d:
                raise CodecError(f"{where}: array data out of bounds ({nbytes} bytes at offset {d}, encoding has {total})")
            # np.frombuffer keeps the memoryview (and so the buffer's export) as the base;
            # np.ndarray(buffer=...) would not, and a bytearray could then be resized under it
            arrays[name] = np.frombuffer(mv, dtype=dt, count=nbytes // dt.itemsize, offset=d).reshape(shape)
            _check_padding(mv, d + nbytes, _align(d + nbytes))
            d = _align(d + nbytes)
        elif kind == _KIND_INT or kind == _KIND_FLOAT:
            if end - p < 8:
                raise CodecError(f"{where}: runs past the end of the field table")
            meta[name] = (_I64 if kind == _KIND_INT else _F64).unpack_from(mv, p)[0]
            p += 8
        elif kind == _KIND_BOOL:
            if end - p < 1:
                raise CodecError(f"{where}: runs past the end of the field table")
            v = mv[p]
            p += 1
            if v > 1:
                raise CodecError(f"{where}: bool byte {v} is not 0 or 1")
            meta[name] = v == 1
        elif kind == _KIND_STR:
            if end - p < 4:
                raise CodecError(f"{where}: runs past the end of the field table")
            slen = _U32.unpack_from(mv, p)[0]
            p += 4
            if end - p < slen:
                raise CodecError(f"{where}: runs past the end of the field table")
            try:
                meta[name] = mv[p : p + slen].tobytes().decode("utf-8")
            except UnicodeDecodeError:
                raise CodecError(f"{where}: str value is not valid utf-8") from None
            p += slen
        elif kind == _KIND_NONE:
            meta[name] = None
        else:
            raise CodecError(f"{where}: unknown kind {kind}")
    if p != end:
        raise CodecError(f"field table has {end - p} unused bytes")
    if d != total:
        raise CodecError(f"{total - d} bytes after the last field")
    return _new_sample(arrays, meta)
