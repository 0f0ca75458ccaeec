"""What a run tells while it goes, as facts: a trainer step ended, weights were synced, a
learner published a version, a policy was evaluated.

The runtimes hand them to the caller's progress callback (``run_mode(on_step=...)``; an env
run's ``on_progress``) in the order they happened, times on the run's own clock (the sim's
virtual seconds, or seconds since a real run's start). The harness shows and logs them
(harness/console.py, harness/live_metrics.py); nothing in core reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union


@dataclass(frozen=True)
class StepTrained:
    """A trainer step ended: what it trained, and the run's totals so far."""

    step: int
    version: int  # of the weights the step trained
    at_s: float
    samples: int  # trained by this step
    staleness_sum: int  # versions behind the trained weights, summed over this step's samples
    trainings: int  # samples trained so far (one that a replay stage reuses counts each time)
    trained: int  # distinct samples trained so far
    tokens: int  # prompt + response tokens trained so far
    staleness_total: int  # staleness_sum so far
    staleness_max: int  # so far
    figures: dict = field(default_factory=dict)  # the backend's figures of the step (tokens; a real one: loss, reward_mean, ...)


@dataclass(frozen=True)
class WeightsSynced:
    """Rollout took the weights of ``version``: the pause, what of it was the drain (or abort),
    and the transfer. A restarted or resumed trainer's first sync is one too."""

    version: int
    at_s: float
    pause_s: float
    drain_s: float
    transfer_s: float


@dataclass(frozen=True)
class VersionPublished:
    """An env learner published a new weight version to its samplers."""

    version: int
    at_s: float
    env_steps: int  # acted by the samplers so far
    updates: int  # gradient updates so far
    figures: dict = field(default_factory=dict)  # the learner's figures of the batch, where it keeps any (PPO)


@dataclass(frozen=True)
class PolicyEvaluated:
    """A greedy evaluation of the policy of ``version`` ended."""

    version: Optional[int]  # None where the runtime cannot tell which version it evaluated
    at_s: float  # when the evaluated weights existed, on the training clock
    env_steps: int
    eval_return: float


Progress = Union[StepTrained, WeightsSynced, VersionPublished, PolicyEvaluated]
ProgressFn = Callable[[Progress], None]
