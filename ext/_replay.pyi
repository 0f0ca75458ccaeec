"""Type stub of the compiled replay buffer (ext/_replay.pyx).

Same API and results as the pure-Python reference ``ext._replay_ref`` (same slots, rows,
weights and exceptions for the same seed and calls). Not thread-safe by contract; concurrent
calls never crash (a call that released the GIL makes the others wait). Unlike the reference,
whose zeroed storage takes pages as rows first land, the whole storage is resident once the
constructor returns (its pages are faulted in there, in bulk).
"""

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

__all__ = ["ReplayBuffer"]

class ReplayBuffer:
    """Fixed-capacity columnar ring of transitions with uniform or prioritized sampling."""

    def __init__(
        self,
        capacity: int,
        spec: Mapping[str, tuple[tuple[int, ...] | int, DTypeLike]],
        prioritized: bool = False,
        alpha: float = 0.6,
        seed: int | None = None,
    ) -> None: ...
    @property
    def capacity(self) -> int: ...
    @property
    def spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]: ...
    @property
    def prioritized(self) -> bool: ...
    @property
    def alpha(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def max_priority(self) -> float: ...
    def __len__(self) -> int: ...
    def storage(self) -> dict[str, np.ndarray]:
        """Read-only views of the whole storage, ``(capacity, *shape)`` per field (slots >= len
        hold zeros); they change as rows are added."""
    def add(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """Append the rows of ``batch`` (every field, shape ``(n, *shape)``, the spec's dtype
        exactly); returns the slot of each row (int64[n]). Beyond capacity the oldest rows are
        overwritten, as if the rows were added one at a time."""
    def update_priorities(self, indices: ArrayLike, priorities: ArrayLike) -> None:
        """Set the priorities of stored slots; each must be finite and > 0 (``p ** alpha``
        must be a positive float small enough that the tree total stays finite). A repeated
        slot keeps its last priority; the running maximum counts them all."""
    def sample(self, n: int, beta: float = 0.4) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``n`` rows (1 <= n <= len) drawn with replacement: uniformly, or stratified in
        proportion to ``p ** alpha``. Returns (batch, slots int64[n], weights float64[n]);
        weights are 1.0 in a uniform buffer, else normalised importance weights
        ``(q_i / q_min) ** -beta`` (max 1 over the stored items)."""
