"""The agent loop of the real runtimes: ``ToolLoop`` on the run's tokenizer and ``tools``."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from core.agent.loop import Limits, ToolLoop, TurnCodec
from core.agent.tool_call import CLOSE
from core.agent.tools import ToolBox, build_tools
from core.api import AgentLoop
from core.model.run_plan import RunPlan
from core.pipeline.wiring import durable
from core.real.task import Task
from core.store.tool_journal import NAME as JOURNAL
from core.store.tool_journal import ToolJournal


class NoCallToken(ValueError):
    """The tokenizer has no single token that ends a tool call."""


def make_agent(plan: RunPlan, task: Task, run_dir: Optional[Path] = None) -> Optional[AgentLoop]:
    """With ``agent``/``tools``, episodes that call the tools; else None (one completion per sample).
    ``NoCallToken`` where the tokenizer cannot end a turn at ``</tool_call>`` (the engines stop
    on one token id). A durable run (checkpoints) journals the calls' results in its mode's
    directory, beside the queue's journal (``make_queue``)."""
    sc = plan.scenario
    spec = sc.episodes
    if spec is None:
        return None
    ids = task.encode(CLOSE)
    if len(ids) != 1:
        raise NoCallToken(f"the model's tokenizer writes {CLOSE} as {len(ids)} tokens {ids[:8]}, and a turn ends at one: "
                          f"fix: use a model whose tokenizer has {CLOSE} as a token (Qwen2.5's has), or build the tiny model with tiny_model.tool_tokens: true")
    codec = TurnCodec(ids[0], task.eos_ids, task.encode, task.decode)
    limits = Limits(spec.max_turns, spec.max_tool_calls, spec.max_episode_tokens or sc.real_max_positions)
    delay = spec.tool_delay_s
    seed = sc.seed

    def delay_s(call_id: str) -> float:
        # Drawn from the call's id: a call made again after an interruption waits as long.
        return float(delay.draw(np.random.default_rng([seed, zlib.crc32(call_id.encode())]), 1)[0])

    journal = ToolJournal(Path(run_dir) / plan.mode / JOURNAL) if run_dir is not None and durable(sc) else None
    box = ToolBox(build_tools(sc.tools), delay=delay_s if delay.median > 0 or delay.low > 0 else None, journal=journal)
    return ToolLoop(box, codec, limits)
