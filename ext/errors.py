"""Exceptions shared by both backends of every hot path, so callers catch one class."""


class QueueFull(Exception):
    """Raised by ``StalenessQueue.put``/``put_many`` when the items do not fit; nothing is stored."""
