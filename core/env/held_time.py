"""The intervals a run was held for an evaluation, and what a measured span spent outside them.

Sync mode stops its training clock while it evaluates; async mode, with ``env.hold_for_eval``,
holds its samplers and learner instead, and every part that times something (the store's
blocked sides, the learner's update and wait times, the driver's clock and timeline) counts
only the seconds outside the holds. Times are on whatever clock the caller reads, the same
for every call on one ``HeldTime``.
"""

from __future__ import annotations

from typing import Optional


class HeldTime:
    """Hold intervals on one clock."""

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []
        self._since: Optional[float] = None

    @property
    def holding(self) -> bool:
        return self._since is not None

    def hold(self, now: float) -> None:
        if self._since is None:
            self._since = now

    def end(self, now: float) -> None:
        if self._since is not None:
            self._spans.append((self._since, max(now, self._since)))
            self._since = None

    def held(self, a: float, b: float) -> float:
        """Seconds of [a, b] inside a hold (one still open counts up to ``b``)."""
        total = max(0.0, b - max(a, self._since)) if self._since is not None else 0.0
        for start, end in reversed(self._spans):  # in time order: most calls ask about the last few
            if end <= a:
                break
            total += max(0.0, min(b, end) - max(a, start))
        return total

    def running(self, a: float, b: float) -> float:
        """Seconds of [a, b] outside every hold."""
        return b - a - self.held(a, b)
