"""The protocols between components: what each side may call of the other, and nothing more.

Every runtime plugs different objects into the same pipeline: a simulated engine, a torch
model, vLLM, or a proxy to any of them in a Ray actor; a modelled or a real trainer; the
Rollouter itself or a proxy to it in another actor. They meet here.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Protocol, Sequence

import numpy as np

from core.model.sample import Group


class RunStopped(Exception):
    """The run was stopped on purpose after a step (``stop_at_step``), as a crash would stop
    it; its checkpoints are left for ``--resume``."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run. At the first, rollout stopped and the tool calls under way were
    waited for and journaled; a second stopped the wait: ``unjournaled`` holds the ids of the
    calls it left running, which a resumed run may make again."""

    def __init__(self, unjournaled: Sequence[str] = ()) -> None:
        super().__init__()
        self.unjournaled = tuple(unjournaled)


# What a sync does to generations in flight: drain them, abort and resume them, or keep them
# running on the new weights (engines frozen between decode steps while the weights load).
PauseMode = Literal["wait", "abort", "keep"]


class Engine(Protocol):
    """What the Rollouter drives. Every method is awaitable so that a proxy has the same API."""

    name: str
    # What the report reads of an engine once it is closed.
    busy_s: float
    seq_s: float
    tokens_generated: int
    prefill_tokens: int

    async def generate(self, group: Group, max_response_len: int, stop_ids: frozenset[int] = frozenset()) -> bool:
        """Generate the group's unfinished responses in place, each up to ``max_response_len``
        response tokens in all; False if aborted first. A response ends at <eos>, at the cap,
        or at a token of ``stop_ids`` (an agent's turn), which it keeps as its last token."""

    async def abort_all(self) -> int:
        """Interrupt every request in flight (partial tokens stay on their samples)."""

    async def update_weights(self, version: int, weights: Any) -> None:
        """Load ``weights`` (None: the engine models weights, nothing to load) as ``version``."""

    async def clear_cache(self) -> None: ...

    async def freeze(self) -> None:
        """Stop between two decode steps, keeping every request and its KV cache, until
        ``thaw`` (inflight mode). Tokens generated so far stay tagged with the current version;
        ``update_weights`` may then load new weights under the running requests."""

    async def thaw(self) -> None:
        """Go on decoding what ``freeze`` stopped; tokens from here on carry the version loaded
        since, and no context is prefilled again."""

    def answers_now(self) -> bool:
        """True while abort_all, update_weights and clear_cache would return without waiting (a
        simulated engine with no fault set): the Rollouter then makes those calls one after the
        other instead of as a task each. An engine that subclasses this protocol inherits False."""
        return False

    async def recover(self) -> None:
        """After a loss: kill what is left of the worker and wait until it is back."""

    async def close(self, now: float) -> None:
        """End of run: close the open busy span; the counters are final after this."""


class AgentLoop(Protocol):
    """What the Rollouter runs a group through on an engine (None: one call of the engine, the
    one-turn episode): episodes of many turns, each a model turn (trained: behaviour
    logprobs, a version per token) or an observation a tool wrote (context, never trained:
    ``Sample.add_observation``), and a reward at the end (core/agent/loop.py)."""

    async def run(self, group: Group, engine: Engine, max_response_len: int, cut: asyncio.Event) -> bool:
        """Drive every unfinished sample of ``group`` to the end of its episode on ``engine``;
        False if interrupted first: the engine aborted, or ``cut`` set (a sync that aborts, the
        run's end) at a turn boundary or while the episode waited on its tools, which go on and
        are recorded. Every finished turn and answered call is kept on the samples."""

    async def settle(self) -> None:
        """Wait for the tool calls still running (the run's end: none is left unrecorded)."""

    def under_way(self) -> list[str]:
        """The ids of the tool calls running now, not yet recorded."""

    def forget(self, groups: Sequence[Group]) -> None:
        """The groups are done with (queued or dropped): their episodes' records may go."""

    def state(self) -> dict:
        """What a checkpoint keeps (taken while rollout is paused), and what the report reads
        (``RunResult.agent``)."""

    def restore(self, state: dict) -> None: ...


class LocalEngine(Engine, Protocol):
    """An engine in the runtime's own process, whose counters a whole-run checkpoint keeps."""

    def state(self) -> dict:
        """Counters (and, simulated, the engine's model state) of an idle engine."""

    def restore(self, state: dict) -> None: ...


@dataclass
class Batch:
    """What one trainer step (or several, when the trainer pulls a window) trains on.

    ``weights`` holds one importance weight per group, applied to each of its samples'
    tokens in the loss: a prioritized replay draw corrects its sampling bias through them.
    None means every weight is 1.
    """

    groups: list[Group] = field(default_factory=list)
    weights: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.groups)

    def head(self, k: int) -> "Batch":
        return Batch(self.groups[:k], None if self.weights is None else self.weights[:k])

    def tail(self, k: int) -> "Batch":
        """All but the first ``k`` groups."""
        return Batch(self.groups[k:], None if self.weights is None else self.weights[k:])

    def sample_weights(self) -> np.ndarray:
        """One weight per sample, in the order of the groups' samples."""
        sizes = [g.size for g in self.groups]
        if self.weights is None:
            return np.ones(sum(sizes), dtype=np.float64)
        return np.repeat(np.asarray(self.weights, dtype=np.float64), sizes)


class BatchSource(Protocol):
    """Where the Trainer's batches come from: the staleness queue, or the replay stage in front of it."""

    async def get_batch(self, n: int) -> Batch:
        """``n`` whole groups; waits until they are there."""


class TrainBackend(Protocol):
    """One trainer step, modelled or real, and what a checkpoint keeps of the trainer."""

    compute_s: float  # time spent in steps
    flops: float  # model FLOPs of those steps (0 where they are modelled)
    peak_flops: float  # the devices' peak FLOP/s, for MFU (0 where not measured)
    tensor_files: tuple[str, ...]  # the safetensors files ``state_dict`` writes, e.g. ("weights", "optimizer")
    sharded: bool  # each rank holds a shard: checkpoints go through save_shards / load_shards instead

    def save_shards(self, into: Path) -> None:
        """Sharded: every rank writes its part of the trainer's state into ``into`` at once."""
        raise NotImplementedError

    def load_shards(self, path: Path) -> None:
        """Sharded: every rank reads its part back from ``save_shards``' directory at once."""
        raise NotImplementedError

    async def train_step(self, batch: Batch, version: int) -> dict:
        """Train on ``batch`` with the weights of ``version``; what the step measured."""

    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        """Weights and optimizer state by file stem (one entry per ``tensor_files``)."""

    def load(self, tensors: dict[str, dict[str, np.ndarray]]) -> None:
        """Back to what ``state_dict`` returned."""

    def state(self) -> dict:
        """The counters a checkpoint keeps (its tensors go through ``state_dict``). A backend
        that subclasses this protocol inherits this and ``restore``."""
        return {"compute_s": self.compute_s, "flops": self.flops}

    def restore(self, state: dict) -> None:
        self.compute_s, self.flops = state["compute_s"], state["flops"]


class WeightTransfer(Protocol):
    """A point-to-point transfer: the trainer publishes, then the engines load what it returns."""

    bytes: Optional[int]  # what the latest send moved (in the engines' dtype where it casts); None: not counted

    async def send(self, version: int) -> Any:
        """Publish the trainer's weights as ``version``; returns what every engine loads."""


class CollectiveTicket(ABC):
    """What the engines load in a collective sync: they take it together, while the trainer
    sends, never one alone. The rollout side addresses it to the engines that take part."""

    version: int

    @abstractmethod
    def addressed(self, members: list[str], regroup: bool) -> "CollectiveTicket":
        """This ticket for ``members``; ``regroup``: they form a new group (one was restarted)."""


class CollectiveTransfer(ABC):
    """A collective transfer (a broadcast): ParamSync hands the rollout side a ticket, then sends
    while the engines receive; the two run at once."""

    bytes: Optional[int] = None  # what the latest send moved; None: not counted

    @abstractmethod
    def ticket(self, version: int) -> CollectiveTicket: ...

    @abstractmethod
    async def send(self, ticket: CollectiveTicket, receiving: "asyncio.Future") -> None:
        """Send while ``receiving`` (the engines' loads) runs; return once everything is out, or at
        once when the rollout side ends ``receiving`` without taking part."""


class ReservingClock(ABC):
    """An event loop that can reserve a timer's place now and set it later (the virtual clock):
    a deadline that is only set if its call comes to wait keeps the order of timers it would
    have had. Real loops are not; the deadline is then set at once."""

    @abstractmethod
    def reserve_timer(self) -> int: ...

    @abstractmethod
    def call_at_reserved(self, when: float, seq: int, callback: Callable[[], None]) -> Any: ...


class RolloutControl(Protocol):
    """What ParamSync drives: the Rollouter itself, or a proxy to it in its actor."""

    async def pause(self, mode: PauseMode) -> None: ...

    async def update_weights(self, version: int, weights: Any) -> None: ...

    async def resume(self) -> None: ...


class PromptSource(Protocol):
    def tokens(self, prompt_id: int) -> np.ndarray:
        """The prompt's token ids."""


class RewardFn(Protocol):
    async def score(self, group: Group) -> list[float]:
        """One reward per sample of a finished group."""
