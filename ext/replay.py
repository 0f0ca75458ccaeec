"""The replay buffer, from the backend that ``ext.backend`` selects."""

from ext.backend import load, name_of

_impl = load("replay")
ReplayBuffer = _impl.ReplayBuffer
BACKEND = name_of(_impl)

__all__ = ["BACKEND", "ReplayBuffer"]
