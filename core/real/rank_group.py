"""The trainer's data-parallel ranks: one torch process group, and the few collectives the GRPO
step needs (core/real/grpo.py).

Every rank holds the whole model (DDP) on CPU, and on GPU a shard of it (FSDP2, see
``TorchTrainBackend``). Gradients are summed with one all-reduce per bucket after the
backward pass, not by ``DistributedDataParallel``'s hooks: the step decides between backward
and the update whether to update at all (a minibatch with no signal anywhere), and a rank may
hold no sample of a minibatch, which DDP's hooks cannot express. The device module
(core/real/device.py) picks the backend.
A group of one rank has no process group: every collective is the identity, so a single
trainer runs exactly the code it ran before ranks existed.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

import torch

from core.real.device import join_default_group

log = logging.getLogger(__name__)

# Gradients are reduced in buckets of this many bytes: the extra memory of a reduction is one
# bucket, not a second copy of the model's gradients.
BUCKET_BYTES = 32 << 20


class RankGroup:
    """This process's place among the trainer's ranks, and the collectives between them.
    ``comm_s`` adds up the seconds spent in collectives (waiting for the slowest rank included)."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.rank = rank
        self.size = size
        self.comm_s = 0.0
        self.formed = size > 1  # this process is in a process group it formed, to be left

    @classmethod
    def join(cls, address: str, rank: int, size: int, device: str, timeout_s: float) -> "RankGroup":
        """Form (or join) the process group of ``size`` ranks that rank 0 serves at
        ``address`` (host:port); blocks until every rank has joined. A process joins one group
        at a time: a group it was in before is left first."""
        if size == 1:
            return cls()
        backend = join_default_group(address, rank, size, device, timeout_s)
        log.info("trainer rank %d of %d joined the %s group at %s", rank, size, backend, address)
        return cls(rank, size)

    @classmethod
    def alone(cls, device: str, timeout_s: float) -> "RankGroup":
        """A group of this process alone, with a process group all the same: what a sharded
        (FSDP2) trainer of one rank needs for its mesh. Collectives stay the identity."""
        join_default_group(None, 0, 1, device, timeout_s)
        ranks = cls()
        ranks.formed = True
        return ranks

    def leave(self) -> None:
        import torch.distributed as dist

        if self.formed and dist.is_initialized():
            dist.destroy_process_group()
        self.formed = False

    # ---- collectives: every rank calls the same ones in the same order ------------------

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.comm_s += time.perf_counter() - t0

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` replaced in place by its sum over the ranks."""
        if self.size > 1:
            import torch.distributed as dist

            self._timed(dist.all_reduce, t, op=dist.ReduceOp.SUM)
        return t

    def gather(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The 1-D tensors of every rank, concatenated in rank order, and where this rank's
        part starts in it. The parts may differ in length."""
        if self.size == 1:
            return t, 0
        import torch.distributed as dist

        lens = torch.zeros(self.size, dtype=torch.int64, device=t.device)
        lens[self.rank] = t.numel()
        self.sum_(lens)
        longest = int(lens.max())
        padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
        padded[: t.numel()] = t
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._timed(dist.all_gather, parts, padded)
        out = torch.cat([p[: int(n)] for p, n in zip(parts, lens)])
        return out, int(lens[: self.rank].sum())

    def broadcast_(self, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
        """Each of ``tensors`` replaced in place by rank ``src``'s."""
        if self.size == 1:
            return
        import torch.distributed as dist

        for t in tensors:
            self._timed(dist.broadcast, t, src=src)

    def sum_grads(self, params: list[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES, dtype: Optional[torch.dtype] = None) -> None:
        """Every parameter's gradient replaced by its sum over the ranks, summed in ``dtype``
        (None: the gradients' own); a rank with no gradient for a parameter (it held no
        sample) adds zeros."""
        if self.size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            if size >= bucket_bytes:
                self._sum_bucket(bucket, dtype)
                bucket, size = [], 0
        if bucket:
            self._sum_bucket(bucket, dtype)

    def _sum_bucket(self, grads: list[torch.Tensor], dtype: Optional[torch.dtype]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dtype is not None and dtype != flat.dtype:
            flat = flat.to(dtype)
        self.sum_(flat)
        at = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[at : at + n].view_as(g))
            at += n


def token_balanced_cuts(tokens: list[int], parts: int) -> list[int]:
    """Edges (``parts`` + 1 of them, from 0 to len(tokens)) cutting the items into contiguous
    runs of about equal tokens, every run non-empty while there are items enough."""
    n = len(tokens)
    total = float(sum(tokens))
    cum = [0.0]
    for t in tokens:
        cum.append(cum[-1] + t)
    edges = [0]
    for r in range(1, parts):
        target = total * r / parts
        # The cut nearest the target that leaves every run non-empty, when there are enough items.
        lo, hi = (edges[-1] + 1, n - (parts - r)) if n >= parts else (edges[-1], n)
        best = min(range(lo, hi + 1), key=lambda k: abs(cum[k] - target))
        edges.append(best)
    edges.append(n)
    return edges
