"""The GroupFilter: DAPO's dynamic sampling, judged on each group once it is scored.

A group whose rewards are all equal trains nothing under GRPO (every advantage is 0); one
whose rewards barely differ trains noise (its advantages are divided by a tiny std); one
whose mean reward is outside a band is too hard or already solved. The Rollouter drops such
a group with the filter's reason, which frees its staleness budget, so rollout samples on
until the trainer's batches are full. The share of samples passed so far is what admission
expects of groups not yet scored.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from core.model.config import FilterSpec

NO_VARIANCE = "filter_no_variance"
LOW_VARIANCE = "filter_low_variance"
BELOW_BAND = "filter_below_band"
ABOVE_BAND = "filter_above_band"


class FilterStarved(RuntimeError):
    """The filter dropped every group for ``filter.starve_batches`` trainer batches in a row."""


class GroupFilter:
    """Judges scored groups; counts the samples it passed and dropped. ``batch_size``: the
    trainer's, in samples (what a starving streak is counted in)."""

    def __init__(self, spec: FilterSpec, batch_size: int) -> None:
        self.spec = spec
        self.passed = 0
        self.dropped = 0
        self.streak = 0  # samples dropped since one last passed
        self._starve = spec.starve_batches * batch_size

    def verdict(self, rewards: Sequence[float]) -> Optional[str]:
        """The drop reason for a group with ``rewards`` (one per sample), or None: train it."""
        s = self.spec
        reason = None
        mean = sum(rewards) / len(rewards)
        if s.zero_variance and max(rewards) == min(rewards):
            reason = NO_VARIANCE
        elif s.min_reward_std and math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) <= s.min_reward_std:
            reason = LOW_VARIANCE
        elif s.min_mean_reward is not None and mean < s.min_mean_reward:
            reason = BELOW_BAND
        elif s.max_mean_reward is not None and mean > s.max_mean_reward:
            reason = ABOVE_BAND
        if reason is None:
            self.passed += len(rewards)
            self.streak = 0
            return None
        self.dropped += len(rewards)
        self.streak += len(rewards)
        if self.streak >= self._starve:
            raise FilterStarved(
                f"filter: dropped every group for {self.spec.starve_batches} trainer batches in a row ({self.streak} samples, "
                f"last reason {reason.removeprefix('filter_')}); fix: check the reward (does the policy earn any?) "
                "or widen filter's band, or raise filter.starve_batches")
        return reason

    def pass_rate(self) -> float:
        """The share of samples passed so far, at least ``min_pass_rate``; 1 before any verdict."""
        judged = self.passed + self.dropped
        if not judged:
            return 1.0
        return max(self.spec.min_pass_rate, self.passed / judged)

    def state(self) -> dict:
        return {"passed": self.passed, "dropped": self.dropped, "streak": self.streak}

    def restore(self, state: dict) -> None:
        self.passed, self.dropped, self.streak = state.get("passed", 0), state.get("dropped", 0), state.get("streak", 0)
