"""Exceptions shared by both backends of every hot path, so callers catch one class."""


class QueueFull(Exception):
    """Raised by ``StalenessQueue.put``/``put_many`` when the items do not fit; nothing is stored."""


class CodecError(ValueError):
    """Raised by ``ext.codec.decode`` for bytes that are not a valid sample encoding (truncated,
    corrupted, of an unknown format version, or crafted); the message names the reason."""
