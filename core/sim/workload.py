"""The prompts a run feeds and, for the simulated engine, how long each response wants to be.

Lengths depend only on (seed, prompt id, response index), never on scheduling, so every
mode of a scenario sees exactly the same workload.
"""

from __future__ import annotations

import math

import numpy as np

from core.model.config import WorkloadSpec
from core.model.length_file import read_lengths

_BLOCK = 1024


_PHI = np.frompyfunc(lambda z: 0.5 * math.erfc(-z / math.sqrt(2.0)), 1, 1)


class Workload:
    """Deterministic response lengths: lognormal with a per-prompt component, clipped; or,
    with ``workload.lengths``, the file's distribution drawn through the same normals (its
    quantile at Phi(z)), so a group's lengths stay correlated as ``prompt_share`` says."""

    def __init__(self, spec: WorkloadSpec, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        self._blocks: dict[int, np.ndarray] = {}
        self._empirical = read_lengths(spec.lengths) if spec.lengths is not None else None

    def _block(self, b: int) -> np.ndarray:
        s = self.spec
        rng = np.random.default_rng([self.seed, b])
        z_prompt = rng.standard_normal((_BLOCK, 1))
        z_resp = rng.standard_normal((_BLOCK, s.group_size))
        z = np.sqrt(s.prompt_share) * z_prompt + np.sqrt(1.0 - s.prompt_share) * z_resp
        if self._empirical is not None:
            lengths = np.rint(self._empirical.at(_PHI(z).astype(np.float64)))
        else:
            lengths = np.rint(s.response_median * np.exp(s.response_sigma * z))
        return np.clip(lengths, 1, s.max_response_len).astype(np.int64)

    def response_lengths(self, prompt_id: int) -> np.ndarray:
        """Target length of each of the group's responses (EOS position in the sim)."""
        b, row = divmod(prompt_id, _BLOCK)
        block = self._blocks.get(b)
        if block is None:
            block = self._blocks[b] = self._block(b)
        return block[row]

    def reward_spread(self, prompt_id: int) -> float:
        """Modeled std of the group's 0/1 rewards: the GRPO learning signal that a prioritized
        replay ranks groups by (a group all right or all wrong has zero advantage).

        Each prompt gets a pass rate drawn uniformly from [0, 1] and each response passes
        with it, from a stream seeded apart from the lengths so that lengths never change.
        """
        rng = np.random.default_rng([self.seed, prompt_id, 1])
        rewards = rng.random(self.spec.group_size) < rng.random()
        return float(rewards.std())

    def sample_lengths(self, n_prompts: int = 8192) -> np.ndarray:
        """Response lengths of the first ``n_prompts`` prompts, one row per group."""
        return np.concatenate([self._block(b) for b in range(-(-n_prompts // _BLOCK))])[:n_prompts]
