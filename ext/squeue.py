"""The staleness-aware queue, from the backend that ``ext.backend`` selects."""

from ext.backend import load, name_of
from ext.errors import QueueFull

_impl = load("squeue")
StalenessQueue = _impl.StalenessQueue
BACKEND = name_of(_impl)

__all__ = ["BACKEND", "QueueFull", "StalenessQueue"]
