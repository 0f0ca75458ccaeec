"""The pickle-free sample codec, from the backend that ``ext.backend`` selects.

``encode``/``encode_into``/``decode`` turn a ``Sample`` (named numpy arrays plus scalar
metadata) into the checksummed binary layout of docs/sample-format.md and back; decoded
arrays are zero-copy views into the input buffer. Untrusted bytes only ever go through
``decode``, which raises ``CodecError`` (a ValueError) for anything but a valid encoding.
"""

from ext.backend import load, name_of
from ext.errors import CodecError

_impl = load("codec")
Sample = _impl.Sample
encode = _impl.encode
encode_into = _impl.encode_into
encoded_size = _impl.encoded_size
decode = _impl.decode
checksum = _impl.checksum
MAGIC = _impl.MAGIC
FORMAT_VERSION = _impl.FORMAT_VERSION
HEADER_SIZE = _impl.HEADER_SIZE
ALIGNMENT = _impl.ALIGNMENT
MAX_NAME_BYTES = _impl.MAX_NAME_BYTES
MAX_NDIM = _impl.MAX_NDIM
BACKEND = name_of(_impl)

__all__ = [*_impl.__all__, "BACKEND"]
