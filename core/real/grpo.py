"""The real trainer: GRPO on a Hugging Face causal LM with torch, for the local and ray runtimes.

One trainer step takes whole groups (the n responses to one prompt) and makes
``learn.minibatches`` Adam updates on slices of whole groups. Per response token t of
sample i in group g:

    A_i      = (R_i - mean_g R) / (std_g R + eps)          0 for a group whose rewards are all equal
    pi       = softmax(logits / T)                          T: the rollout temperature, so train and
                                                             behaviour log-probs are the same quantity
    PPO(r)   = min(r A_i, clip(r, 1-eps, 1+eps) A_i)

and ``learn.correction`` picks the off-policy correction of the loss: bypass, tis, decoupled,
icepop, seq_tis, seq_mis or m2po, each written out with its source in core/real/corrections.py.
The loss is the mean over the response tokens of the minibatch; prompt tokens are context only.

Each step also reports ``behaviour_kl``, KL(behaviour || policy) per token: how far the weights
moved between sampling and training. On the tiny task it, not the version count, is what
grows with the reward lost to stale data (docs/results/2026-11-30-staleness-drift.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from core.model.config import LearnSpec, LoraSpec
from core.api import Batch, TrainBackend
from core.model.sample import Sample
from core.real.corrections import RECOMPUTES_PROX, STATS, correction_loss
from core.real.device import CPU, is_accelerator, mesh, synchronize
from core.real.hf_model import load_model
from core.real.lora import adapter_parameters, wrap
from core.real.rank_group import RankGroup, token_balanced_cuts

log = logging.getLogger(__name__)

ADV_EPS = 1e-6


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """(r - mean) / (std + eps) of one group; all zeros when the rewards do not differ, because
    float rounding of the mean would otherwise turn "no signal" into tiny spurious advantages."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0 or np.ptp(r) == 0.0:
        return np.zeros_like(r, dtype=np.float32)
    return ((r - r.mean()) / (r.std() + ADV_EPS)).astype(np.float32)


def second_moment_keep(sq: torch.Tensor, threshold: float) -> torch.Tensor:
    """1 on the values of ``sq`` (squared log weights, 1-D) kept, 0 on the rest: drop the
    largest, as few as make the mean of the rest at most ``threshold`` (M2PO's trust region)."""
    order = torch.argsort(sq)
    running = torch.cumsum(sq[order], 0) / torch.arange(1, sq.numel() + 1, device=sq.device, dtype=sq.dtype)
    keep = int((running <= threshold).sum())  # the running mean of ascending values never falls
    flat = torch.zeros_like(sq)
    flat[order[:keep]] = 1.0
    return flat


def second_moment_mask(log_w: torch.Tensor, mask: torch.Tensor, threshold: float, ranks: Optional[RankGroup] = None) -> torch.Tensor:
    """1 on the response tokens kept, 0 elsewhere (``second_moment_keep`` of their (log w)^2).
    With ``ranks`` the tokens are those of the whole minibatch, every rank's: each rank's
    part is gathered in rank order, which is the order one rank holding them all sees."""
    sq = (log_w.detach() ** 2)[mask > 0]
    if ranks is not None and ranks.size > 1:
        everyone, at = ranks.gather(sq)
        flat = second_moment_keep(everyone, threshold)[at : at + sq.numel()]
    else:
        flat = second_moment_keep(sq, threshold)
    out = torch.zeros_like(mask)
    out[mask > 0] = flat
    return out


def peak_flops(threads: int, device: str = CPU, dtype: str = "float32") -> float:
    """Achievable FLOP/s of ``device`` in ``dtype`` with ``threads`` intra-op threads, MEASURED
    by a short (< 1 s) square-GEMM probe; not a datasheet figure. The denominator of the
    trainer's MFU, in the dtype it computes in. On a CPU the best of a few sizes: where a dtype
    has no native kernels (bfloat16 without AVX-512) a large GEMM runs 3x slower than a small one
    (0.95 against 3.1 GFLOP/s at 1,024 and 128 here), and a probe of one large size put a tiny
    model's bf16 trainer above 100 % MFU."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sizes = (4096,) if is_accelerator(device) else (128, 512, 1024)
        best = 0.0
        for n in sizes:
            a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
            b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
            a @ b  # warm-up: thread pool, allocator, kernel selection
            synchronize(device)
            t_end = time.perf_counter() + 0.6 / len(sizes)
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                a @ b
                synchronize(device)
                dt = time.perf_counter() - t0
                best = max(best, 2.0 * n**3 / dt)
        return best
    finally:
        torch.set_num_threads(old)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one (an FSDP2 DTensor) gathered from every rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class GatheredParameters:
    """A model's parameters as whole tensors, read in order; a sharded one's each gathered from
    every rank when it is read: a sender reading them one by one (a broadcast bucket after
    another) holds one whole tensor at a time, never the whole model. Each such read is a
    collective, so every rank reads the same names in the same order; ``finish`` reads what
    was not, so that the ranks end together even when a send stopped half-way."""

    def __init__(self, named: dict[str, torch.Tensor], sharded: bool) -> None:
        self._named = named
        self._sharded = sharded
        self._order = list(named)
        self._next = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise KeyError(f"{name} read out of order: every rank gathers {expected} next")
        self._next += 1
        if not self._sharded:
            return self._named[name]
        with torch.no_grad():
            return _full(self._named[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def finish(self) -> None:
        while self._next < len(self._order):
            self[self._order[self._next]]


class _Batch:
    """Right-padded token ids of a list of samples and, per target position, what the loss needs."""

    def __init__(self, samples: list[Sample], adv: np.ndarray, weight: np.ndarray, device: str) -> None:
        seqs = [
            np.concatenate([np.asarray(s.prompt_tokens, dtype=np.int64), np.asarray(s.response_tokens, dtype=np.int64)])
            for s in samples
        ]
        lens = [len(x) for x in seqs]
        T = max(lens)
        B = len(samples)
        ids = np.zeros((B, T), dtype=np.int64)
        attn = np.zeros((B, T), dtype=np.int64)
        # Targets are shifted by one: position j of these arrays is token j+1 of the sequence.
        mask = np.zeros((B, T - 1), dtype=np.float32)
        beh = np.zeros((B, T - 1), dtype=np.float32)
        a = np.zeros((B, T - 1), dtype=np.float32)
        for i, (s, x) in enumerate(zip(samples, seqs)):
            ids[i, : len(x)] = x
            attn[i, : len(x)] = 1
            p, n = len(s.prompt_tokens), len(s.response_tokens)
            if len(s.logprobs) != n:
                raise ValueError(f"sample {s.uid}: {n} response tokens but {len(s.logprobs)} logprobs")
            mask[i, p - 1 : p - 1 + n] = s.loss_mask() if s.observations else 1.0  # what a tool wrote is not trained
            beh[i, p - 1 : p - 1 + n] = s.logprobs
            a[i, p - 1 : p - 1 + n] = adv[i]
        self.ids = torch.from_numpy(ids).to(device)
        self.attn = torch.from_numpy(attn).to(device)
        self.mask = torch.from_numpy(mask).to(device)
        self.beh = torch.from_numpy(beh).to(device)
        self.adv = torch.from_numpy(a).to(device)
        # Each sample's importance weight (a prioritized replay draw's), on all its tokens.
        self.weight = torch.from_numpy(np.asarray(weight, dtype=np.float32).reshape(B, 1)).to(device)
        self.tokens = int(sum(lens))
        self.tokens_sq = int(sum(n * n for n in lens))
        self.response_tokens = int(mask.sum())


class TorchTrainBackend(TrainBackend):
    """GRPO trainer step of a real model; same protocol as ``SimTrainBackend``."""

    def __init__(
        self,
        model_dir: str | Path,
        learn: LearnSpec,
        *,
        threads: int,
        device: str = "cpu",
        seed: int = 0,
        temperature: float = 1.0,
        lora: Optional[LoraSpec] = None,
    ) -> None:
        self.ranks = RankGroup()  # alone until ``join``
        self.sharded = False  # FSDP2 (learn.sharding), from ``join`` on: each rank holds a shard of every parameter
        self.learn = learn
        self.threads = threads
        self.device = device
        self.temperature = float(temperature)
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        # On CPU, torch's SDPA kernels are 3-40x slower than eager attention at these sizes
        # (measured: padded batch of 64 x 80 tokens, 2 threads; decode with a padding mask worst).
        attn = "sdpa" if is_accelerator(device) else "eager"
        self.model = load_model(model_dir, attn_implementation=attn)
        # trainer.lora: only the adapter trains, and only it is synced (core/real/lora.py).
        self.lora = lora
        if lora is not None:
            self.model = wrap(self.model, lora)
        self.model = self.model.to(device)
        self.model.train()
        self.opt = torch.optim.Adam(self.trainable(), lr=learn.lr)
        self._device_type = torch.device(device).type
        cfg = self.model.config
        self.params = sum(p.numel() for p in self.model.parameters())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._attn_width = cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
        self.compute_s = 0.0
        self.flops = 0.0
        self.peak_flops = 0.0  # set by whoever measured the devices (core/real/workers.py)
        self.steps = 0
        # weights() may be called from another thread than the step's worker.
        self._lock = threading.Lock()

    # ---- data-parallel ranks -------------------------------------------------------------

    def join(self, ranks: RankGroup) -> None:
        """Train as rank ``ranks.rank`` of ``ranks.size`` from now on; every rank calls it at once.
        ``learn.sharding: fsdp2`` shards the model (``fully_shard`` on every decoder layer, then
        the root, over a mesh of the ranks; one rank too, in a group of its own) and gradients
        are reduce-scattered in the backward pass; ``ddp`` keeps a whole replica on each rank,
        which starts from rank 0's weights and optimizer state. The same code on every device:
        the device module picks the collective backend."""
        with self._lock:
            self.ranks = ranks
        # As DDP does: every replica starts from rank 0's. Sharded, the base weights are the
        # model directory's on every rank, but a LoRA adapter's A is drawn: rank 0's, before
        # each rank keeps its shard of it.
        if ranks.size > 1 and not self.sharded and (self.learn.sharding != "fsdp2" or self.lora is not None):
            self._replicate()
        with self._lock:
            if self.learn.sharding == "fsdp2" and not self.sharded:
                self._shard()

    def _shard(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # imported on use: only a sharded trainer needs it

        # Parameters are cast to param_dtype for compute; the float32 shards stay the master
        # weights that Adam updates, and gradients are reduced in reduce_dtype.
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, self.learn.param_dtype), reduce_dtype=getattr(torch, self.learn.reduce_dtype))
        over = mesh(self._device_type, self.ranks.size)
        layers = (self.model.get_base_model() if self.lora is not None else self.model).model.layers
        for layer in layers:
            fully_shard(layer, mesh=over, mp_policy=policy)
        fully_shard(self.model, mesh=over, mp_policy=policy)
        # The loss is already normalised by the whole minibatch's tokens: sum, not mean, and
        # by a plain SUM, which every backend has (a divide factor is NCCL's PREMUL_SUM). Each
        # fully_shard'ed module reduces its own parameters: every one is told, not the root alone.
        for module in (*layers, self.model):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self.opt = torch.optim.Adam(self.trainable(), lr=self.learn.lr)
        self.sharded = True

    def join_group(self, address: str, rank: int, size: int, timeout_s: float) -> None:
        """Form the process group of ``size`` ranks that rank 0 serves at ``address`` (host:port)
        with the others, and ``join`` it; blocks until every rank is there."""
        self.join(RankGroup.join(address, rank, size, self.device, timeout_s))

    def shards(self, step_batch: Batch) -> list[list[Batch]]:
        """Each rank's part of the step, per minibatch: a contiguous run of whole groups, the
        runs about equal in tokens. Rank r trains ``shards(b)[r]``; with one rank it is the
        minibatches themselves."""
        n = self.ranks.size
        out: list[list[Batch]] = [[] for _ in range(n)]
        for mb in self._minibatches(step_batch):
            sizes = [sum(len(s.prompt_tokens) + len(s.response_tokens) for s in g.samples) for g in mb.groups]
            edges = token_balanced_cuts(sizes, n)
            if self.sharded and len(mb) < n:
                raise ValueError(
                    f"a minibatch of {len(mb)} groups for {n} sharded ranks: every FSDP rank needs a group of each minibatch; "
                    "fix: fewer learn.minibatches or ray.trainer_ranks, or a larger trainer.batch_size"
                )
            for r in range(n):
                out[r].append(mb.tail(edges[r]).head(edges[r + 1] - edges[r]))
        return out

    # ---- the protocol -------------------------------------------------------------------

    async def train_step(self, batch: Batch, version: int) -> dict:
        # The step's math releases the GIL, so the caller's loop keeps scheduling meanwhile.
        return await asyncio.to_thread(self._train_step, batch, version)

    # ---- weights ------------------------------------------------------------------------

    def weights(self) -> dict[str, np.ndarray]:
        """Float32 numpy copies under the names ``save_pretrained`` writes (a tied lm_head once);
        with ``trainer.lora`` the adapter's tensors alone (``parameters``).
        Sharded (FSDP2), every rank must call it at once: the full tensors are gathered."""
        return {n: t.numpy() for n, t in self.weights_as("float32").items()}

    def weights_as(self, dtype: str) -> dict[str, torch.Tensor]:
        """Copies of the weights in ``dtype`` on the host, cast as a broadcast casts them into
        its buckets (``Tensor.copy_``: round to nearest even), for an engine in this process.
        Sharded, every rank calls it at once, and one whole tensor is gathered at a time."""
        with self._lock, torch.no_grad():
            src = self.export()
            out = {}
            for n in src:
                full = src[n]
                out[n] = torch.empty(full.shape, dtype=getattr(torch, dtype)).copy_(full)
            return out

    def parameters(self) -> dict[str, torch.Tensor]:
        """What a weight sync moves and a checkpoint keeps: the live parameters, no copy, under
        the names ``save_pretrained`` writes (a tied lm_head once); with ``trainer.lora`` the
        adapter's tensors alone, under their sync names (core/real/lora.py), the base being
        the model directory's. Sharded: each a DTensor of the whole shape. Read under ``lock``."""
        if self.lora is not None:
            return adapter_parameters(self.model)
        return dict(self.model.named_parameters())

    def trainable(self) -> list[torch.Tensor]:
        """The parameters Adam updates: all of them, or the adapter's (the base frozen)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def export(self) -> GatheredParameters:
        """What a weight sync reads, by name in ``parameters`` order: the live parameters, or,
        sharded, each gathered whole as it is read (a collective that every rank takes part
        in, reading the same names in the same order). Under ``lock``; ``finish`` it."""
        return GatheredParameters(self.parameters(), self.sharded)

    @property
    def lock(self):
        """Held by a train step: whoever reads ``parameters`` holds it too."""
        return self._lock

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        if self.sharded:
            raise ValueError("a sharded trainer restores through load_shards, on every rank at once")
        with self._lock, torch.no_grad():
            params = self.parameters()
            missing = params.keys() - weights.keys()
            extra = weights.keys() - params.keys()
            if missing or extra:
                raise KeyError(f"weights do not match the model: missing {sorted(missing)}, unexpected {sorted(extra)}")
            for n, p in params.items():
                w = weights[n]
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"{n}: shape {tuple(w.shape)}, model has {tuple(p.shape)}")
                p.copy_(torch.from_numpy(np.asarray(w, dtype=np.float32)))

    def state_dict(self) -> dict[str, dict[str, np.ndarray]]:
        """What a checkpoint keeps of the trainer: weights and Adam's moments, by parameter name.
        The ranks' are identical, so rank 0 alone saves. A sharded trainer keeps none here:
        every rank writes its shards (``save_shards``)."""
        if self.sharded:
            return {}
        with self._lock, torch.no_grad():
            opt = {}
            for n, p in self.parameters().items():
                st = self.opt.state.get(p)
                if st:
                    for k, v in st.items():
                        opt[f"{n}::{k}"] = v.detach().to("cpu").numpy().copy()
        return {"weights": self.weights(), "optimizer": opt}

    @property
    def tensor_files(self) -> tuple[str, ...]:
        """The safetensors files ``state_dict`` gives a checkpoint; none when sharded."""
        return () if self.sharded else ("weights", "optimizer")

    def load(self, tensors: Optional[dict[str, dict[str, np.ndarray]]]) -> None:
        """Back to a checkpoint: weights and optimizer state as ``state_dict`` wrote them.
        With ranks every rank calls it at once, rank 0 with the tensors and the others with
        None: they receive rank 0's weights and optimizer state."""
        if self.sharded:
            raise ValueError("a sharded trainer restores through load_shards, on every rank at once")
        if tensors is None and self.ranks.rank == 0:
            raise ValueError("rank 0 restores from the checkpoint's tensors; only the other ranks receive them")
        if tensors is not None:
            self.load_weights(tensors["weights"])
            with self._lock, torch.no_grad():
                params = self.parameters()
                self.opt.state.clear()
                for key, v in tensors["optimizer"].items():
                    name, _, k = key.partition("::")
                    if name not in params:
                        raise KeyError(f"optimizer state for unknown parameter {name!r}")
                    p = params[name]
                    self.opt.state[p][k] = torch.from_numpy(np.array(v)).to(p.device if v.ndim else "cpu")
        if self.ranks.size > 1:
            self._replicate()

    def _replicate(self) -> None:
        """Every rank's weights and Adam state made rank 0's, by broadcast (whole replicas)."""
        ranks = self.ranks
        with self._lock, torch.no_grad():
            params = list(self.model.parameters())
            ranks.broadcast_(p.data for p in params)
            has = torch.tensor([float(bool(self.opt.state))], dtype=torch.float64)
            ranks.broadcast_([has])
            if not float(has):
                self.opt.state.clear()
                return
            for p in self.trainable():
                st = self._adam_state(p)
                ranks.broadcast_([st["step"], st["exp_avg"], st["exp_avg_sq"]])

    def _adam_state(self, p: torch.Tensor) -> dict:
        """Adam's state of ``p``, made zero (as Adam's first step makes it) where it has none yet."""
        st = self.opt.state[p]
        if "step" not in st:
            st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        return st

    # ---- sharded checkpoints --------------------------------------------------------------

    def _sharded_state(self) -> dict[str, torch.Tensor]:
        """Every tensor a sharded checkpoint holds, by name: each parameter's shard and its Adam
        state (``name::exp_avg``, ``name::exp_avg_sq`` sharded alike, ``name::step`` a scalar
        every rank holds). Adam's state is made before the first step, zero, as Adam itself
        would make it, so a checkpoint always has the same tensors."""
        out: dict[str, torch.Tensor] = {}
        for n, p in self.model.named_parameters():
            out[n] = p.data
            if not p.requires_grad:  # a frozen LoRA base: no optimizer state
                continue
            st = self._adam_state(p)
            for k in ("step", "exp_avg", "exp_avg_sq"):
                out[f"{n}::{k}"] = st[k]
        return out

    def save_shards(self, into: str | Path) -> None:
        """Sharded: write this rank's shards into the directory ``into`` as every rank does at
        once (torch.distributed.checkpoint in safetensors files, which hold raw tensors and
        their offsets: no code runs on load, unlike its default pickled metadata). Ranks on
        several nodes need ``into`` on storage they all mount."""
        import torch.distributed.checkpoint as dcp

        with self._lock, torch.no_grad():
            dcp.save(self._sharded_state(), storage_writer=dcp.HuggingFaceStorageWriter(str(into), save_distributed=True))

    def load_shards(self, path: str | Path) -> None:
        """Sharded: every rank reads its shards from ``save_shards``' directory at once; the
        checkpoint may have been written by another number of ranks (resharded on load)."""
        import torch.distributed.checkpoint as dcp

        with self._lock, torch.no_grad():
            state = self._sharded_state()
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))

    # ---- the math -----------------------------------------------------------------------

    def _logprobs(self, batch: _Batch) -> torch.Tensor:
        """log pi(target) at temperature T, shape (B, T-1)."""
        with self._compute_cast():
            logits = self.model(input_ids=batch.ids, attention_mask=batch.attn, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        return logp.gather(-1, batch.ids[:, 1:, None]).squeeze(-1)

    def _compute_cast(self):
        """bfloat16 compute over float32 weights where FSDP2 does not cast them itself."""
        if self.learn.param_dtype == "float32" or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=getattr(torch, self.learn.param_dtype))

    def _loss(
        self, batch: _Batch, prox: Optional[torch.Tensor], correction: str, ntok: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, dict]:
        """The loss of ``batch``, summed over its response tokens over ``ntok`` (the whole
        minibatch's response tokens, every rank's; None: this batch's own), and its stats as sums."""
        ranks = self.ranks
        return correction_loss(
            correction, self._logprobs(batch), prox, batch.beh, batch.adv, batch.mask, batch.weight,
            is_cap=self.learn.is_cap, clip_eps=self.learn.clip_eps, ntok=ntok,
            second_moment=lambda log_w, m: second_moment_mask(log_w, m, self.learn.m2_threshold, ranks),
        )

    def _minibatches(self, batch: Batch) -> list[Batch]:
        n = len(batch)
        k = max(1, min(self.learn.minibatches, n))
        edges = np.linspace(0, n, k + 1).round().astype(int)
        return [batch.tail(a).head(b - a) for a, b in zip(edges[:-1], edges[1:]) if b > a]

    def _batch(self, batch: Batch) -> _Batch:
        samples: list[Sample] = []
        adv: list[np.ndarray] = []
        for g in batch.groups:
            samples.extend(g.samples)
            adv.append(group_advantages(np.array([s.reward or 0.0 for s in g.samples])))
        return _Batch(samples, np.concatenate(adv) if adv else np.zeros(0, np.float32), batch.sample_weights(), self.device)

    def gradient(self, batch: Batch, correction: Optional[str] = None) -> dict[str, torch.Tensor]:
        """The loss gradient on ``batch`` as one minibatch, without an update (tests, diagnostics)."""
        correction = self.learn.correction if correction is None else correction
        with self._lock:
            batch = self._batch(batch)
            prox = None
            if correction in RECOMPUTES_PROX:
                with torch.no_grad():
                    prox = self._logprobs(batch)
            self.model.zero_grad(set_to_none=True)
            loss, _ = self._loss(batch, prox, correction)
            loss.backward()
            out = {
                n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in self.model.named_parameters()
            }
            self.model.zero_grad(set_to_none=True)
            return out

    def _train_step(self, step_batch: Batch, version: int) -> dict:
        t0 = time.perf_counter()
        learned = self.learn_part(self.shards(step_batch)[self.ranks.rank])
        return self.summary(step_batch, version, learned, time.perf_counter() - t0)

    _STATS = STATS

    def learn_part(self, parts: list[Batch]) -> dict:
        """This rank's part of one step: per minibatch, its slice of groups (``shards``). Every
        rank calls it at once with as many slices, some maybe empty. What is decided is
        decided on the whole minibatch: the loss normaliser (its response tokens), whether it
        has any signal, the gradient (summed over the ranks before the norm is clipped) and the
        stats; so every rank makes the same update, and the same as one rank holding it all."""
        torch.set_num_threads(self.threads)  # intra-op threads are per OS thread under OpenMP
        ranks = self.ranks
        comm0 = ranks.comm_s
        correction = self.learn.correction
        params = self.trainable()
        with self._lock:
            batches = [self._batch(mb) if len(mb) else None for mb in parts]
            prox: list[Optional[torch.Tensor]] = [None] * len(batches)
            if self.learn.recomputes_prox:
                # All proximal log-probs come from the weights at the start of the step, before any update.
                with torch.no_grad():
                    prox = [self._logprobs(b) if b is not None else None for b in batches]
            losses, norms = [], []
            acc = dict.fromkeys(self._STATS, 0.0)
            for b, px in zip(batches, prox):
                # Response tokens, and tokens with a non-zero advantage, of the whole minibatch.
                counts = torch.tensor(
                    [0.0, 0.0] if b is None else [float(b.mask.sum()), float((b.adv != 0).sum())], dtype=torch.float32, device=self.device
                )
                ranks.sum_(counts)
                if b is not None:
                    loss, st = self._loss(b, px, correction, counts[0])
                else:
                    loss, st = None, dict.fromkeys(self._STATS, 0.0)
                    if correction == "m2po":  # the other ranks gather every rank's log weights
                        second_moment_mask(torch.zeros(0, device=self.device), torch.zeros(0, device=self.device), self.learn.m2_threshold, ranks)
                reduced = torch.tensor(
                    [0.0 if loss is None else float(loss.detach())] + [st[k] for k in self._STATS], dtype=torch.float64, device=self.device
                )
                ranks.sum_(reduced)
                for k, v in zip(self._STATS, reduced[1:].tolist()):
                    acc[k] += v
                losses.append(float(reduced[0]))
                if not float(counts[1]):
                    continue  # no signal in this minibatch: Adam's momentum alone should not move the weights
                self.opt.zero_grad(set_to_none=True)
                if loss is not None:
                    loss.backward()
                if not self.sharded:  # FSDP2 reduce-scatters in the backward pass
                    ranks.sum_grads(params, dtype=getattr(torch, self.learn.reduce_dtype))
                norm = torch.nn.utils.clip_grad_norm_(params, self.learn.grad_clip)
                norms.append(float(_full(norm)))
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        synchronize(self.device)
        return {"losses": losses, "norms": norms, "acc": acc, "comm_s": ranks.comm_s - comm0}

    def summary(self, step_batch: Batch, version: int, learned: dict, dt: float) -> dict:
        """What the step measured, from the whole step batch and ``learn_part``'s reduced
        figures (identical on every rank); ``dt``: the step's seconds."""
        groups = step_batch.groups
        losses, norms, acc = learned["losses"], learned["norms"], learned["acc"]
        lens = [len(s.prompt_tokens) + len(s.response_tokens) for g in groups for s in g.samples]
        tokens = int(sum(lens))
        tokens_sq = int(sum(n * n for n in lens))
        passes = 3.0 + (1.0 if self.learn.recomputes_prox else 0.0)
        # Same convention as core.sim.costs.TrainCost: 2P FLOPs per token per forward, backward twice that.
        flops = 2.0 * passes * self.params * tokens + 2.0 * passes * self._attn_width * tokens_sq
        self.compute_s += dt
        self.flops += flops
        self.steps += 1
        rewards = [s.reward or 0.0 for g in groups for s in g.samples]
        # Versions behind the trained weights, per response token (inflight responses span several).
        lag = [(version - v, k) for g in groups for s in g.samples for v, k in s.sampled_spans()]
        lag_tokens = sum(k for _, k in lag)
        ntok = max(acc["ntok"], 1.0)
        log.debug("step %d (version %d): %d tokens, %d updates, %.3f s", self.steps, version, tokens, len(norms), dt)
        return {
            "loss": float(np.mean(losses)) if losses else 0.0,
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            # Responses that earned any reward: on the arithmetic task, those that called the tool right.
            "reward_positive_share": float(np.mean(np.asarray(rewards) > 0)) if rewards else 0.0,
            "is_weight_mean": acc["is_weight_sum"] / ntok,
            "is_truncated_frac": acc["is_truncated"] / ntok,
            "masked_frac": acc["masked"] / ntok,
            "token_staleness_mean": sum(d * k for d, k in lag) / lag_tokens if lag_tokens else 0.0,
            "token_staleness_max": max((d for d, k in lag if k), default=0),
            "clip_frac": acc["clipped"] / ntok,
            # Measured against the step's proximal policy where the correction recomputes it, else
            # against the weights each minibatch is trained with.
            "behaviour_kl": acc["drift"] / ntok,
            "grad_norm": float(np.mean(norms)) if norms else 0.0,
            "updates": len(norms),
            "tokens": tokens,
            "response_tokens": int(acc["ntok"]),  # trained: observation tokens are not
            "observation_tokens": sum(s.observed for g in groups for s in g.samples),
            "flops": flops,
            "compute_s": dt,
            # For calibration (harness/calibrate.py): what the step's cost and the lengths depend on.
            "tokens_sq": tokens_sq,
            "threads": self.threads,
            "response_lens": [s.n_response for g in groups for s in g.samples],
            # The policy each response was sampled by: its newest token's (a response finished
            # under newer weights counts as theirs), so the reward is never credited to a version
            # trained on fewer samples than produced it.
            "rewards": rewards,
            "sample_versions": [max((v for v, k in s.sampled_spans() if k), default=g.version) for g in groups for s in g.samples],
            "prompt_lens": [s.n_prompt for g in groups for s in g.samples],
            "version": version,
            # Seconds of the step in collectives between the trainer's ranks (0 with one).
            "comm_s": learned["comm_s"],
            "ranks": self.ranks.size,
        }
