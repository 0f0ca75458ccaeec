"""Rewards of the real runtimes: the task scored in process, or through a Ray Serve deployment.

The Rollouter awaits ``score(group)`` on a finished group either way; with ``reward.serve``
the same scoring code runs in Serve replicas (``.options(...)``, ``.bind(...)``,
``serve.run``) and the Rollouter calls them through the deployment handle.
"""

from __future__ import annotations

import asyncio

from typing import Any

import numpy as np

from core.model.config import Scenario, TaskSpec
from core.model.sample import Group
from core.model.faults import CallTimeout, WorkerLost
from core.real.task import Task
from core.real.tiny_model import load_tokenizer


def make_task(sc: Scenario) -> Task:
    """The scenario's task, tokenized with the tiny model's tokenizer."""
    return task_from(sc.task, sc.seed, sc.tiny_model.path)


def task_from(t: TaskSpec, seed: int, model_dir) -> Task:
    """A task on the tokenizer of ``model_dir``; ``<eos>`` stays a word of decoded text,
    which the reward needs."""
    tok = load_tokenizer(model_dir)
    return Task(
        seed=seed,
        alphabet=t.alphabet,
        min_letters=t.min_letters,
        max_letters=t.max_letters,
        length_per_letter=t.length_per_letter,
        truncated_reward=t.truncated_reward,
        overshoot=t.overshoot,
        encode=lambda text: tok.encode(text, add_special_tokens=False),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
    )


class TaskPrompts:
    """The Rollouter's prompt source: the task's training prompts."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def tokens(self, prompt_id: int) -> np.ndarray:
        return self.task.tokens(prompt_id)


class TaskReward:
    """Scores in the caller's process: cheap, so it runs inline on the Rollouter's loop."""

    def __init__(self, task: Task) -> None:
        self.task = task

    async def score(self, group: Group) -> list[float]:
        return [self.task.reward(group.prompt_id, s.response_tokens) for s in group.samples]


class RewardService:
    """The Serve deployment's replica: the same task scoring, behind a deployment handle."""

    def __init__(self, sc: Scenario) -> None:
        self.task = make_task(sc)

    def score(self, prompt_id: int, responses: list[list[int]]) -> list[float]:
        return [self.task.reward(prompt_id, r) for r in responses]


class ServeReward:
    """The Rollouter's view of the deployment: the same ``score`` as ``TaskReward``."""

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    async def score(self, group: Group) -> list[float]:
        """The deployment's rewards; a replica that fails or does not answer in time is ``WorkerLost``."""
        from ray.exceptions import RayError  # only the ray runtime scores through Serve

        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.handle.score.remote(group.prompt_id, [list(s.response_tokens) for s in group.samples])
        except TimeoutError:
            raise CallTimeout("reward", "score", self.timeout_s, "timeouts.control_s") from None
        except RayError as exc:
            raise WorkerLost("reward", "score", f"the deployment failed ({type(exc).__name__})") from None


def deploy_reward(sc: Scenario) -> Any:
    """Start the reward deployment on the connected Ray cluster; returns its handle."""
    from ray import serve

    # Called from the Rollouter through the handle only: no HTTP proxy to start.
    serve.start(proxy_location="Disabled")
    app = (
        serve.deployment(RewardService, name="reward")
        .options(num_replicas=sc.reward.replicas, ray_actor_options={"num_cpus": 0})
        .bind(sc)
    )
    return serve.run(app, name="asyncrl-reward", route_prefix=None)
