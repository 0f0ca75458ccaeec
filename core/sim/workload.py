"""The prompts a run feeds and, for the simulated engine, how long each response wants to be.

Lengths depend only on (seed, prompt id, response index), never on scheduling, so every
mode of a scenario sees exactly the same workload.
"""

from __future__ import annotations

import math

import numpy as np

from dataclasses import dataclass
from typing import Optional

from core.model.config import AgentSpec, WorkloadSpec
from core.model.length_file import read_lengths

_BLOCK = 1024


_PHI = np.frompyfunc(lambda z: 0.5 * math.erfc(-z / math.sqrt(2.0)), 1, 1)


@dataclass(frozen=True, slots=True)
class EpisodePlan:
    """One simulated agent episode: its model turns, each but the last ending in a tool call,
    and each call's answer and latency. Positions count the response: model and answer tokens."""

    turn_ends: tuple[int, ...]  # the response position at which each model turn ends
    answers: tuple[int, ...]  # tokens of each call's answer (one per turn but the last)
    tool_s: tuple[float, ...]  # seconds each call takes
    reason: str  # how the episode ends (core/agent/loop.py END_REASONS)


class Workload:
    """Deterministic response lengths: lognormal with a per-prompt component, clipped; or,
    with ``workload.lengths``, the file's distribution drawn through the same normals (its
    quantile at Phi(z)), so a group's lengths stay correlated as ``prompt_share`` says."""

    def __init__(self, spec: WorkloadSpec, seed: int, agent: Optional[AgentSpec] = None, prompts_per_step: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self.agent = agent
        self._blocks: dict[int, np.ndarray] = {}
        self._empirical = read_lengths(spec.lengths) if spec.lengths is not None else None
        if spec.length_drift and prompts_per_step < 1:
            raise ValueError("workload.length_drift needs the prompts of one trainer step: build the workload with Workload.of(scenario)")
        self.prompts_per_step = prompts_per_step

    @classmethod
    def of(cls, sc, agent: Optional[AgentSpec] = None) -> "Workload":
        """The scenario's workload: its lengths drift over the trainer's steps where it says so."""
        return cls(sc.workload, sc.seed, agent, sc.trainer.batch_size // sc.workload.group_size)

    def drift(self, prompt_ids: np.ndarray) -> np.ndarray:
        """The factor on the lengths of each prompt: ``workload.length_drift`` at the trainer step
        the prompt is planned for, linear between its points and flat beyond them."""
        steps, factors = zip(*self.spec.length_drift)
        return np.interp(prompt_ids / self.prompts_per_step, steps, factors)

    def _block(self, b: int) -> np.ndarray:
        s = self.spec
        rng = np.random.default_rng([self.seed, b])
        z_prompt = rng.standard_normal((_BLOCK, 1))
        z_resp = rng.standard_normal((_BLOCK, s.group_size))
        z = np.sqrt(s.prompt_share) * z_prompt + np.sqrt(1.0 - s.prompt_share) * z_resp
        if self._empirical is not None:
            raw = self._empirical.at(_PHI(z).astype(np.float64))
        else:
            raw = s.response_median * np.exp(s.response_sigma * z)
        if s.length_drift:  # unset, the lengths are bit for bit those of before the drift
            raw = raw * self.drift(b * _BLOCK + np.arange(_BLOCK, dtype=np.float64))[:, None]
        return np.clip(np.rint(raw), 1, s.max_response_len).astype(np.int64)

    def response_lengths(self, prompt_id: int) -> np.ndarray:
        """Target length of each of the group's responses (EOS position in the sim)."""
        b, row = divmod(prompt_id, _BLOCK)
        block = self._blocks.get(b)
        if block is None:
            block = self._blocks[b] = self._block(b)
        return block[row]

    def rewards(self, prompt_id: int) -> np.ndarray:
        """The group's modelled 0/1 rewards: the prompt's pass rate is drawn from
        Beta(workload.pass_rate_alpha, pass_rate_beta) and each response passes with it, from a
        stream seeded apart from the lengths so that lengths never change."""
        s = self.spec
        rng = np.random.default_rng([self.seed, prompt_id, 1])
        draws = rng.random(s.group_size)  # before the rate: the stream's order since the first release
        if s.pass_rate_alpha == 1.0 and s.pass_rate_beta == 1.0:
            rate = rng.random()
        else:
            rate = rng.beta(s.pass_rate_alpha, s.pass_rate_beta)
        return (draws < rate).astype(np.float64)

    def reward_spread(self, prompt_id: int) -> float:
        """Modeled std of the group's 0/1 rewards: the GRPO learning signal that a prioritized
        replay ranks groups by (a group all right or all wrong has zero advantage)."""
        return float(self.rewards(prompt_id).std())

    def sample_lengths(self, n_prompts: int = 8192) -> np.ndarray:
        """Response lengths of the first ``n_prompts`` prompts, one row per group."""
        return np.concatenate([self._block(b) for b in range(-(-n_prompts // _BLOCK))])[:n_prompts]

    def episode(self, prompt_id: int, index: int) -> EpisodePlan:
        """The agent episode of response ``index`` to prompt ``prompt_id`` (``agent`` set).

        Its model tokens are the response length the workload draws for it (so the long tail
        of ``workload`` holds for episodes too), split evenly over T turns, T uniform in
        [agent.min_turns, agent.max_turns]; each call's answer and latency are drawn from
        ``agent.observation_tokens`` and ``agent.tool_delay_s``. From a stream of its own, so
        lengths stay what they are without agents. An episode past ``agent.max_tool_calls``
        calls, or whose context would pass ``workload.max_response_len`` or
        ``agent.max_episode_tokens``, ends there, as the real loop ends it."""
        a = self.agent
        length = int(self.response_lengths(prompt_id)[index])
        rng = np.random.default_rng([self.seed, prompt_id, index, 2])
        turns = min(int(rng.integers(a.min_turns, a.max_turns + 1)), length)
        answers = np.maximum(np.rint(a.observation_tokens.draw(rng, turns - 1)), 1).astype(np.int64).tolist()
        tool_s = a.tool_delay_s.draw(rng, turns - 1).tolist()
        reason = "eos"
        if turns - 1 > a.max_tool_calls:
            turns, reason = a.max_tool_calls + 1, "max_tool_calls"
        cap, binding = self.spec.max_response_len, "max_response_len"
        if a.max_episode_tokens is not None and a.max_episode_tokens - self.spec.prompt_tokens < cap:
            cap, binding = max(a.max_episode_tokens - self.spec.prompt_tokens, 1), "max_episode_tokens"
        per, extra = divmod(length, turns)
        ends, pos = [], 0
        for k in range(turns):
            pos += per + (k < extra)
            if pos >= cap:  # the turn runs into the context's end
                ends.append(cap)
                return EpisodePlan(tuple(ends), tuple(answers[: k]), tuple(tool_s[: k]), binding)
            ends.append(pos)
            if k < turns - 1:
                if pos + answers[k] >= cap:  # its answer would fill the context: the episode ends unanswered
                    return EpisodePlan(tuple(ends), tuple(answers[: k]), tuple(tool_s[: k]), binding)
                pos += answers[k]
        return EpisodePlan(tuple(ends), tuple(answers[: turns - 1]), tuple(tool_s[: turns - 1]), reason)


class ModelledReward:
    """The sim's scorer (``core.api.RewardFn``): the workload's modelled 0/1 rewards, at no
    cost in time. Only runs that filter groups need one; without it groups carry no reward."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload

    async def score(self, group) -> list[float]:
        return self.workload.rewards(group.prompt_id).tolist()
