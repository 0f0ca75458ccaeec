"""Type stub of the compiled sample codec (ext/_codec.pyx).

Same API, bytes and errors as the pure-Python reference ``ext._codec_ref``; the byte layout is
docs/sample-format.md. The compiled module imports on little-endian hosts only.
"""

from collections.abc import Mapping
from typing import Final, Union

import numpy as np
from numpy.typing import NDArray

from ext.errors import CodecError as CodecError

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

MAGIC: Final[bytes]  # b"\x89ASAMP\r\n"
FORMAT_VERSION: Final[int]  # 1: the only version this build reads and writes
HEADER_SIZE: Final[int]  # 64
ALIGNMENT: Final[int]  # 64: of every array's data, relative to the start of the encoding
MAX_NAME_BYTES: Final[int]  # 255: field names, in bytes of UTF-8
MAX_NDIM: Final[int]  # 8

# What ``meta`` holds once stored: int is int64-range. On construction numpy scalars
# (np.bool_, np.integer, np.float16/32/64) and subclasses of int/float/str are converted to
# these plain types.
Scalar = Union[int, float, bool, str, None]

# bool, int8..int64, uint8..uint64, float16/32/64; any strides; non-native order is converted
Array = NDArray[np.generic]

# anything with the buffer protocol, C-contiguous: bytes, bytearray, memoryview, numpy arrays
Buffer = Union[bytes, bytearray, memoryview, NDArray[np.uint8]]

class Sample:
    """Named numpy arrays plus named scalar metadata; the unit that ``encode`` serialises.

    Names are non-empty str of at most 255 bytes of UTF-8, unique across arrays and meta;
    fields are kept sorted by name. Arrays are held by reference. ``==`` compares names,
    dtypes, shapes and values bitwise (NaN equals a NaN of the same bits; 0.0 != -0.0;
    1 != True != 1.0). Unhashable. Pickles at protocol 5 with the arrays out of band.
    """

    def __init__(
        self,
        arrays: Mapping[str, Array] | None = None,
        meta: Mapping[str, Scalar | np.bool_ | np.integer | np.floating] | None = None,
    ) -> None: ...
    @property
    def arrays(self) -> Mapping[str, Array]:
        """The arrays, by name (sorted), read-only."""
    @property
    def meta(self) -> Mapping[str, Scalar]:
        """The scalar metadata, by name (sorted), read-only."""
    def __getitem__(self, name: str) -> Array | Scalar: ...
    def __contains__(self, name: object) -> bool: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __reduce_ex__(self, protocol: int) -> tuple: ...

def encoded_size(sample: Sample) -> int:
    """Bytes that ``encode(sample)`` produces (and ``encode_into`` needs)."""

def encode(sample: Sample) -> bytes:
    """The canonical encoding of ``sample``."""

def encode_into(sample: Sample, buf: bytearray | memoryview | NDArray[np.uint8]) -> int:
    """Write the encoding to the start of the writable, C-contiguous ``buf``; returns the bytes
    written. ValueError (naming the size needed) if ``buf`` is too small or overlaps one of
    the sample's arrays; TypeError if it is not a writable C-contiguous buffer."""

def decode(buf: Buffer) -> Sample:
    """The Sample encoded in exactly ``buf``; arrays are views into it (read-only when it is)
    that keep it alive. CodecError for anything but a valid encoding."""

def checksum(buf: Buffer) -> int:
    """The checksum the header of the encoding in ``buf`` stores (bytes 32..39 taken as zero);
    ``buf`` must be a positive multiple of 64 bytes."""
