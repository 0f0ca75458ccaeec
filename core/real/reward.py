"""Rewards of the real runtimes: the task scored in process, or through a Ray Serve deployment.

The task is the scenario's prompts (the letters task or ``task.prompts``) scored by its own
reward or by ``reward.fn``; the Serve replicas build the same task from the scenario, so a
user's reward function is imported there by name, as in the Rollouter's process.

The Rollouter awaits ``score(group)`` on a finished group either way; with ``reward.serve``
the same scoring code runs in Serve replicas (``.options(...)``, ``.bind(...)``,
``serve.run``) and the Rollouter calls them through the deployment handle.
"""

from __future__ import annotations

import asyncio

from typing import Any, Optional

import numpy as np

from core.model.config import RewardSpec, Scenario, TaskSpec
from core.model.sample import Group
from core.model.faults import CallTimeout, WorkerLost
from core.model.group_wire import read_tokens
from core.model.model_dir import read_model_dir
from core.model.prompt_file import read_prompts
from core.model.reward_fn import GuardedReward, load_reward_fn
from core.model.user_code import UserCodeError
from core.real.hf_model import load_tokenizer
from core.real.task import ArithmeticPrompts, FilePrompts, LetterPrompts, LetterScore, Task, arithmetic_score, exact_match


def make_task(sc: Scenario) -> Task:
    """The scenario's prompts and reward, on the tokenizer of the model the run loads."""
    return task_from(sc.task, sc.seed, sc.real_model_path, sc.reward, sc.real_max_positions, sc.workload.max_response_len)


def task_from(t: TaskSpec, seed: int, model_dir, reward: Optional[RewardSpec] = None, max_positions: Optional[int] = None,
              max_response_len: int = 1) -> Task:
    """The task ``t`` on the tokenizer of ``model_dir``: the letters task unless ``t.prompts``
    names a file; scored by ``reward.fn`` (``module:function``, behind the guard) when given,
    else by the task's own reward. A response ends at the tokenizer's or the model config's
    end-of-sequence token; a file's prompts leave it ``max_response_len`` of ``max_positions``."""
    tok = load_tokenizer(model_dir)
    if t.kind == "arithmetic":
        prompts = ArithmeticPrompts(seed, t.digits)
    elif t.prompts is None:
        prompts = LetterPrompts(seed, t.alphabet, t.min_letters, t.max_letters)
    else:
        held_out = read_prompts(t.eval_prompts) if t.eval_prompts is not None else None
        prompts = FilePrompts(read_prompts(t.prompts), held_out, seed)
    reward = reward or RewardSpec()
    if reward.fn is not None:
        score = GuardedReward(load_reward_fn(reward.fn, reward.timeout_s), reward.fn, reward.timeout_s)
    elif t.kind == "arithmetic":
        score = arithmetic_score
    elif t.prompts is not None:
        score = exact_match
    else:
        score = LetterScore(t.length_per_letter, t.truncated_reward, t.overshoot)
    eos = {e for e in (tok.eos_token_id, *read_model_dir(model_dir).eos_ids) if e is not None}
    return Task(
        prompts,
        score,
        # Special tokens stay words of the text: the letters reward counts them as words off the prompt.
        encode=lambda text: tok.encode(text, add_special_tokens=False),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        bos_id=tok.bos_token_id,
        eos_ids=eos,
        max_positions=max_positions,
        max_response_len=max_response_len,
        truncation=t.prompt_truncation,
        skip_failed=reward.on_error == "skip",
    )


class TaskPrompts:
    """The Rollouter's prompt source: the task's training prompts, each checked to fit the
    model before the run starts."""

    def __init__(self, task: Task) -> None:
        task.check_lengths()
        self.task = task

    def tokens(self, prompt_id: int) -> np.ndarray:
        return self.task.tokens(prompt_id)


class TaskReward:
    """Scores in the caller's process: cheap, so it runs inline on the Rollouter's loop."""

    def __init__(self, task: Task) -> None:
        self.task = task

    async def score(self, group: Group) -> list[float]:
        return [self.task.reward(group.prompt_id, s.response_tokens, sample=s.uid) for s in group.samples]


class RewardService:
    """The Serve deployment's replica: the same task scoring, behind a deployment handle."""

    def __init__(self, sc: Scenario) -> None:
        self.task = make_task(sc)

    def score(self, prompt_id: int, first_uid: int, responses: list[list[int]]) -> list[float]:
        """The rewards of a group's responses, in order (their samples' uids count up from ``first_uid``)."""
        return [self.task.reward(prompt_id, r, sample=first_uid + i) for i, r in enumerate(responses)]

    async def score_tokens(self, prompt_id: int, first_uid: int, n: int, payload: list) -> list[float]:
        """Score the ``n`` responses of a tokens record by reference (``payload``: [ObjectRef]),
        read from the object store here: they never pass through the caller."""
        off, tokens, _ = read_tokens(await payload[0], prompt_id, n)
        return [self.task.reward(prompt_id, tokens[a:b], sample=first_uid + i) for i, (a, b) in enumerate(zip(off[:-1], off[1:]))]


class EngineReward:
    """The rewards the engine actors gave the groups they finished, where the tokens are (the
    ray runtime without ``reward.serve``): the Rollouter's ``score`` with nothing left to do."""

    async def score(self, group: Group) -> list[float]:
        return [s.reward for s in group.samples]


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
                first = group.samples[0].uid
                if group.payload is not None:  # the tokens are in the object store: the replica reads them there
                    return await self.handle.score_tokens.remote(group.prompt_id, first, group.size, [group.payload])
                return await self.handle.score.remote(group.prompt_id, first, [np.asarray(s.response_tokens).tolist() for s in group.samples])
        except UserCodeError as exc:  # the user's function failed in the replica: that, not a lost worker
            raise exc.plain() from None
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
