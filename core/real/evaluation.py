"""Evaluation of the policy on held-out prompts, beside training and never in its way.

Every ``eval.every`` versions the driver scores the weights of that version on
``eval.prompts`` held-out prompts (the task's separate prompt stream), split among
``eval.workers``: Ray remote functions on the ray runtime, collected with ``ray.wait`` as
they finish, or worker threads on the local runtime. Responses are sampled as rollout samples
them, with a fixed seed: the draws are the same for every version, so a score
moves only when the policy does. (Greedy decoding says little here: the argmax token is
rarely <eos>, so a greedy response almost never ends.) Training never waits for an evaluation; one that has not
finished ``eval.timeout_s`` after the run ended is reported missing, not waited for.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import numpy as np

from core.model.config import Scenario
from core.model.reward_fn import reward_failed
from core.real.reward import make_task
from core.real.hf_model import load_model
from core.real.lora import AdapterMerge

log = logging.getLogger(__name__)


def evaluate(sc: Scenario, weights: Optional[dict], version: int, prompt_ids: list[int], threads: Optional[int] = None) -> dict:
    """Responses of the policy with ``weights`` (None: the initial ones) to held-out prompts,
    sampled at the rollout temperature with a fixed seed, and their rewards. ``threads`` sets torch's (process-wide) thread count: a Ray
    evaluator owns its process; in the local runtime it must leave the trainer's alone."""
    import torch  # imported on use: the driver that only schedules evaluations never needs it

    if threads is not None:
        torch.set_num_threads(threads)
    model = load_model(sc.real_model_path)
    if weights is not None and sc.trainer.lora is not None:
        AdapterMerge(model, sc.trainer.lora, "evaluator").apply(weights)  # the adapter, checked, onto the base
    elif weights is not None:
        # numpy from the object store, or tensors in the engines' dtype from a local sync.
        model.load_state_dict({k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)) for k, v in weights.items()}, strict=False)
    model.eval()
    task = make_task(sc)
    cfg = model.config
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
    pad = eos if cfg.pad_token_id is None else cfg.pad_token_id  # many models name no pad token
    prompts = [task.tokens(pid, held_out=True) for pid in prompt_ids]
    width = max(len(p) for p in prompts)
    # One batched generate, prompts left-padded: a few hundred decode steps in all.
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.from_numpy(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(sc.seed * 100_003 + prompt_ids[0])  # the same draws for every version
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=sc.workload.max_response_len,
            do_sample=True,
            temperature=sc.engine.temperature,
            top_k=0,
            top_p=1.0,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    rewards, lengths = [], []
    for pid, row in zip(prompt_ids, out[:, width:].tolist()):
        if eos in row:  # what follows the first <eos> is padding
            row = row[: row.index(eos) + 1]
        rewards.append(task.reward(pid, row, held_out=True))
        lengths.append(len(row))
    return {"version": version, "rewards": rewards, "lengths": lengths}


def _warm() -> None:
    import time

    import torch  # noqa: F401
    import transformers  # noqa: F401

    time.sleep(1.0)  # overlap the tasks, so each gets its own worker


def _chunks(sc: Scenario) -> list[list[int]]:
    ids = list(range(sc.eval.prompts))
    k = min(sc.eval.workers, len(ids))
    return [ids[i::k] for i in range(k)]


class Evaluations:
    """The results so far, one entry per evaluated version: ``{version, reward_mean,
    length_mean, prompts, started_s, done_s}`` in the run's clock."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.every = sc.eval.every
        self.next_version = 0  # version 0, the initial policy, is the baseline
        self.results: list[dict] = []
        self.missing: list[int] = []
        self._parts: dict[int, list] = {}  # version -> partial results
        self._started: dict[int, float] = {}
        self._pending: dict[Any, int] = {}  # ObjectRef or Task -> version

    def _collect(self, version: int, part: dict, now: float) -> None:
        parts = self._parts.setdefault(version, [])
        parts.append(part)
        if len(parts) == len(_chunks(self.sc)):
            # A held-out response whose scoring failed (reward.on_error: skip) is left out of the mean.
            rewards = [r for p in parts for r in p["rewards"] if not reward_failed(r)]
            lengths = [n for p in parts for n in p["lengths"]]
            self.results.append({
                "version": version,
                "reward_mean": float(np.mean(rewards)) if rewards else None,
                "length_mean": float(np.mean(lengths)),
                "prompts": len(rewards),
                "started_s": self._started[version],
                "done_s": now,
            })
            self.results.sort(key=lambda r: r["version"])

    # -- ray runtime ------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Start the evaluators' worker processes before the run is timed: each imports torch
        and transformers once, here, instead of in the middle of the measured run."""
        import ray

        if not self.every:
            return
        remote = ray.remote(_warm).options(num_cpus=self.sc.eval.num_cpus)
        ray.get([remote.remote() for _ in _chunks(self.sc)], timeout=self.sc.timeouts.restart_s)

    def poll(self, trainer: Any, version: int, now: float) -> None:
        """Launch an evaluation when a due version is out; collect the finished ones."""
        import ray

        if self.every and version >= self.next_version:
            v, refs = ray.get(trainer.latest_weights.remote(), timeout=self.sc.timeouts.control_s)
            if v >= self.next_version:
                # Version 0 is the model directory's weights: nothing was published yet.
                weights = refs[0] if refs else None
                remote = ray.remote(evaluate).options(num_cpus=self.sc.eval.num_cpus)
                for chunk in _chunks(self.sc):
                    self._pending[remote.remote(self.sc, weights, v, chunk, 1)] = v
                self._started[v] = now
                self.next_version = v + self.every
        if self._pending:
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            for ref in ready:
                self._collect(self._pending.pop(ref), ray.get(ref), now)

    def finish(self, now: float) -> None:
        """Collect what finishes within ``eval.timeout_s``; the rest is reported missing."""
        import ray

        if self._pending:
            ready, rest = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=self.sc.eval.timeout_s)
            for ref in ready:
                self._collect(self._pending.pop(ref), ray.get(ref), now)
            for ref in rest:
                ray.cancel(ref, force=True)
        self._finish_missing()

    # -- local runtime ----------------------------------------------------------------------
    def launch_local(self, weights: Optional[dict], version: int, now: float) -> None:
        """Start evaluating ``version`` in worker threads of this process."""
        if not self.every or version < self.next_version:
            return
        loop = asyncio.get_running_loop()
        for chunk in _chunks(self.sc):
            task = loop.create_task(asyncio.to_thread(evaluate, self.sc, weights, version, chunk))
            self._pending[task] = version
            task.add_done_callback(lambda t: self._local_done(t, loop))
        self._started[version] = now
        self.next_version = version + self.every

    def _local_done(self, task: asyncio.Task, loop) -> None:
        version = self._pending.pop(task, None)
        if version is not None and not task.cancelled() and task.exception() is None:
            self._collect(version, task.result(), loop.time())

    async def finish_local(self) -> None:
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=self.sc.eval.timeout_s)
            for task in list(self._pending):
                task.cancel()
        self._finish_missing()

    def _finish_missing(self) -> None:
        done = {r["version"] for r in self.results}
        self.missing = sorted(set(self._started) - done)
        self._pending.clear()
