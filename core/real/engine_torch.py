"""A real rollout engine on plain transformers: continuous batching over a padded KV cache.

One decode-loop task serves every in-flight request. Requests that arrive while the loop
runs join at the next step: they are prefilled on their own (identical contexts, such as
the fresh samples of a group, are prefilled once) and merged into the running batch,
right-aligned with it and masked on the left. Forward passes run in a worker thread so the
event loop stays responsive; all bookkeeping happens on the event loop between steps.

The cache is one preallocated buffer per layer, [rows, kv heads, columns, head dim]: a
decode step writes one column in place, a row that joins is written into its own slot, and
the live columns move back to the middle when they reach the end. Growing the cache by
concatenation copied all of it per layer per step, and transformers' masked attention copies
K and V once more to repeat them for every query head: a batch with rows of different
lengths (any batch that requests join) cost 1.4 times the same step without padding, and
twice what it costs now (docs/results/2026-12-01-torch-engine-cache.md).

In inflight mode ``freeze`` parks the loop between two steps with the batch and its cache
kept, ``update_weights`` loads new weights under it, and ``thaw`` decodes on from that cache.
Each request records where the version changed, so its tokens reach the sample as runs of
(version, tokens, logprobs) when it ends.

Implements the ``Engine`` protocol of ``core/api.py`` with real tokens and log-probs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from core.model.config import LoraSpec
from core.model.sample import LOGPROB_DTYPE, TOKEN_DTYPE, Group, Sample
from core.real.engine_meter import EngineMeter
from core.real.hf_model import load_model, model_dtype
from core.real.lora import AdapterMerge
from core.real.weight_broadcast import BroadcastTicket, GroupMember, RollCall, broken_as_collective, manifest_of
from core.model.timeline import Timeline

log = logging.getLogger(__name__)

# The attention the engine loads its model with: torch's SDPA with the padding mask and the
# grouped key/value heads as they are (same results as transformers' "sdpa", which repeats K
# and V to every query head whenever a mask is given, on CPU).
GQA_SDPA = "asyncrl_gqa_sdpa"


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    causal = query.shape[2] > 1 and attention_mask is None and (module.is_causal if is_causal is None else is_causal)
    out = F.scaled_dot_product_attention(
        query, key, value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _register_gqa_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, _gqa_sdpa)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


class _SlotLayer(DynamicLayer):
    """One layer of the cache a decode step sees: the live columns [lo, hi) of the engine's
    buffer for its rows; ``update`` writes the step's keys and values at column hi in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lo: int, hi: int) -> None:
        super().__init__()
        self._k, self._v, self._lo, self._hi = keys, values, lo, hi
        self.keys, self.values = keys[:, :, lo:hi], values[:, :, lo:hi]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        self._k[:, :, self._hi : self._hi + n] = key_states
        self._v[:, :, self._hi : self._hi + n] = value_states
        self._hi += n
        self.keys, self.values = self._k[:, :, self._lo : self._hi], self._v[:, :, self._lo : self._hi]
        return self.keys, self.values


class _Request:
    __slots__ = ("sample", "context", "max_tokens", "stop", "tokens", "logprobs", "n", "cuts", "future", "done")

    def __init__(self, sample: Sample, context: list[int], max_tokens: int, version: int, future: asyncio.Future,
                 stop: frozenset[int] = frozenset()) -> None:
        self.sample = sample
        self.context = context
        self.max_tokens = max_tokens
        self.stop = stop  # token ids that end the request besides <eos>, kept as its last token
        # The response as it is sampled, in the arrays it is handed over in: n tokens so far.
        self.tokens = np.empty(max_tokens, dtype=TOKEN_DTYPE)
        self.logprobs = np.empty(max_tokens, dtype=LOGPROB_DTYPE)
        self.n = 0
        self.cuts: list[tuple[int, int]] = [(0, version)]  # (first token, version) of each run
        self.future = future
        self.done = False  # finished or aborted: its row is dropped at the next step

    def cut(self, version: int) -> None:
        """Tokens from here on are of ``version``."""
        n = self.n
        start, current = self.cuts[-1]
        if current == version:
            return
        if start == n:
            self.cuts[-1] = (n, version)
        else:
            self.cuts.append((n, version))


class TorchEngine(EngineMeter):
    """A rollout engine running a Hugging Face causal LM with batched sampling."""

    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        *,
        max_num_seqs: int = 64,
        temperature: float = 1.0,
        seed: int = 0,
        threads: int = 1,
        timeline: Optional[Timeline] = None,
        device: str = "cpu",
        dtype: str = "auto",
        lora: Optional[LoraSpec] = None,
    ) -> None:
        self.name = name
        self.model_dir = Path(model_dir)
        self.dtype = model_dtype(self.model_dir, dtype)
        self.max_num_seqs = max_num_seqs
        # Public so tests can switch to greedy (0.0) between generations.
        self.temperature = temperature
        self.seed = seed
        self.threads = threads
        self.timeline = timeline
        self.device = torch.device(device)
        self.version = 0
        self._init_meter()
        self.model = None
        self.eos_token_id: int = -1
        self.max_positions: int = 0
        self._gen: Optional[torch.Generator] = None
        self._waiting: deque[_Request] = deque()
        self._rows: list[_Request] = []  # one per batch row: row i is slot i of the buffers
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer [max_num_seqs, H, columns, D]
        self._mask = torch.zeros(0, 0, dtype=torch.bool)  # [max_num_seqs, columns]; False on padding
        self._lo = self._hi = 0  # the live columns: every row's tokens end at hi - 1
        self._pos = torch.zeros(0, dtype=torch.long)  # next position id of each row
        self._last = torch.zeros(0, dtype=torch.long)  # last sampled token of each row
        self._task: Optional[asyncio.Task] = None
        self._live: set[_Request] = set()  # submitted, not yet finished or aborted
        self._thawed = asyncio.Event()  # the decode loop waits on it while frozen
        self._thawed.set()
        self._between = asyncio.Event()  # clear while a step runs in the worker thread
        self._between.set()
        self._roll = RollCall(name)  # weights by broadcast: this engine's answers to the trainer
        self._member: Optional[GroupMember] = None
        # trainer.lora: syncs bring the adapter alone, merged onto this engine's own base weights.
        self.lora = lora
        self._adapter: Optional[AdapterMerge] = None

    @property
    def frozen(self) -> bool:
        return not self._thawed.is_set()

    # -- protocol ---------------------------------------------------------------------------
    async def start(self) -> None:
        torch.set_num_threads(self.threads)
        self.model = await asyncio.to_thread(self._load)
        cfg = self.model.config
        eos = cfg.eos_token_id
        self.eos_token_id = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        self.max_positions = int(cfg.max_position_embeddings)
        self._gen = torch.Generator(device=self.device).manual_seed(self.seed)
        log.info("%s: loaded %s on %s", self.name, self.model_dir, self.device)

    def _load(self):
        _register_gqa_sdpa()
        model = load_model(self.model_dir, attn_implementation=GQA_SDPA, dtype=getattr(torch, self.dtype))
        model = model.to(self.device).eval()
        if self.lora is not None:
            self._adapter = AdapterMerge(model, self.lora, self.name)
        return model

    async def generate(self, group: Group, max_response_len: int, stop_ids: frozenset[int] = frozenset()) -> bool:
        """Generate every unfinished response of ``group``; False if aborted first."""
        if self.model is None:
            raise RuntimeError(f"{self.name}: start() the engine first")
        loop = asyncio.get_running_loop()
        reqs = []
        for s in group.unfinished():
            context = [int(t) for t in s.prompt_tokens] + np.asarray(s.response_tokens).tolist()
            want = min(max_response_len - s.n_response, self.max_positions - len(context))
            if want <= 0:  # resumed at the cap
                s.finished = True
                s.finished_at = loop.time()
                continue
            reqs.append(_Request(s, context, want, self.version, loop.create_future(), stop_ids))
        if not reqs:
            return True
        self._advance(loop.time())
        self._live.update(reqs)
        self._busy(loop.time())
        self._waiting.extend(reqs)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"{self.name}-decode")
        try:
            results = await asyncio.gather(*(r.future for r in reqs))
        except asyncio.CancelledError:
            # The caller gave up: stop its requests as an abort would, keeping what was seen.
            for req in reqs:
                if not req.done:
                    self._release(req, finished=False)
            raise
        return all(results)

    async def abort_all(self) -> int:
        """Interrupt every request; tokens already seen stay on their samples."""
        # Requests being prefilled are in neither queue nor batch: abort from the live set.
        reqs = list(self._live)
        for req in reqs:
            self._release(req, finished=False)
        self._waiting.clear()
        return len(reqs)

    async def freeze(self) -> None:
        """Park the decode loop between two steps, every request and the KV cache kept."""
        if self.frozen:
            return
        self._thawed.clear()
        # A step under way finishes, its tokens of the current version and its time busy.
        await self._between.wait()
        self._meter_freeze(asyncio.get_running_loop().time())

    async def thaw(self) -> None:
        """Decode on from the kept cache; requests that arrived while frozen join now."""
        if not self.frozen:
            return
        self._meter_thaw(asyncio.get_running_loop().time())
        self._thawed.set()

    async def update_weights(self, version: int, weights: Optional[dict[str, np.ndarray]] = None) -> None:
        if self.frozen:
            # Under running requests: their cache stays as it is, computed with the old weights.
            await self._between.wait()
            if weights is not None:
                await asyncio.to_thread(self._load_weights, weights)
            self._set_version(version)
            return
        if self._live:
            raise RuntimeError(f"{self.name}: update_weights with requests in flight; pause the rollout first")
        # An aborted step may still be running in the worker thread; never write under it.
        if self._task is not None:
            await self._task
        if self._live:
            raise RuntimeError(f"{self.name}: requests were submitted during update_weights")
        if weights is not None:
            await asyncio.to_thread(self._load_weights, weights)
        self._set_version(version)

    def _set_version(self, version: int) -> None:
        for req in self._live:
            req.cut(version)
        self.version = version

    def _load_weights(self, weights) -> None:
        if isinstance(weights, BroadcastTicket):
            with broken_as_collective(self.name):
                self._receive(weights)
            return
        if self._adapter is not None:
            self._adapter.apply(weights)  # refuses a sync without the adapter, or with another one
            return
        state = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = [k for k in missing if not (tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{self.name}: weights do not match the model: missing {missing}, unexpected {unexpected}")

    def _receive(self, ticket: BroadcastTicket) -> None:
        """Take a broadcast: every tensor lands in its parameter, through one bucket, or
        straight into the parameter when it is a bucket alone."""
        self._roll.timeout_s = ticket.timeout_s
        m, join = self._roll.answer(ticket)
        # A tied lm_head is the embedding's tensor: listed once. With an adapter: its tensors,
        # which the manifest check then holds the trainer's to (a sync without them fails).
        params = self._adapter.received if self._adapter is not None else dict(self.model.named_parameters())
        if join:
            if self._member is not None:
                self._member.close()
            self._member = None
            expected = self._adapter.specs if self._adapter is not None else manifest_of(params.items())
            self._member = GroupMember(m, expected, device=str(self.device), timeout_s=ticket.timeout_s, who=self.name)

        def load(views) -> None:
            for name, v in views:
                params[name].copy_(v)

        def direct(spec):
            p = params[spec.name]
            return p.data.view(-1).view(torch.uint8) if p.is_contiguous() else None

        with torch.no_grad():
            self._member.receive(ticket.bucket_bytes, load, direct=direct)
            if self._adapter is not None:
                self._adapter.merge()

    async def clear_cache(self) -> None:
        """KV rows are dropped as soon as their request ends: nothing is cached across requests."""

    async def close(self, now: float) -> None:
        await self.abort_all()
        await self.thaw()  # a frozen loop would never see that its requests are gone
        if self._task is not None:
            await self._task
        self._advance(now)
        self._idle(now)
        self.model = None
        self._kv, self._mask = [], torch.zeros(0, 0, dtype=torch.bool)

    # -- bookkeeping on the event loop --------------------------------------------------------
    def _release(self, req: _Request, finished: bool) -> None:
        now = asyncio.get_running_loop().time()
        self._advance(now)
        req.done = True
        n = req.n  # copied out: the sample must not keep the whole max_tokens buffer alive
        self._deliver(req.sample, req.tokens[:n].copy(), req.logprobs[:n].copy(), finished, now, req.cuts)
        self._live.discard(req)
        self._idle(now)
        if not req.future.done():
            req.future.set_result(finished)

    def _accept(self, rows: list[_Request], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Record one sampled token per row; finish the rows that stop."""
        toks = tokens.tolist()
        lps = logprobs.tolist()
        for req, tok, lp in zip(rows, toks, lps):
            if req.done:  # aborted while the step ran: the token is never seen
                continue
            n = req.n
            req.tokens[n] = tok
            req.logprobs[n] = lp
            req.n = n = n + 1
            if tok == self.eos_token_id or n >= req.max_tokens or tok in req.stop:
                self._release(req, finished=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self.frozen:
                    await self._thawed.wait()
                    continue
                t0 = loop.time()
                self._drop_done()
                room = self.max_num_seqs - len(self._rows)
                if self._waiting and room > 0:
                    new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                    now = loop.time()
                    for req in new:
                        if req.sample.started_at != req.sample.started_at:  # NaN: first time scheduled
                            req.sample.started_at = now
                    before = self.prefill_tokens
                    toks, lps = await self._step(self._prefill, new)
                    self._accept(new, toks, lps)
                    # The whole iteration, bookkeeping included: what the next step waits for.
                    self.prefills.append((self.prefill_tokens - before, loop.time() - t0))
                elif self._rows:
                    rows = list(self._rows)
                    context = int(self._pos.sum())
                    toks, lps = await self._step(self._decode)
                    self._accept(rows, toks, lps)
                    self.decode_steps.append((len(rows), context, loop.time() - t0))
                else:
                    return
        except Exception as exc:
            log.exception("%s: decode loop failed", self.name)
            self._advance(loop.time())
            for req in list(self._live):
                req.done = True
                self._live.discard(req)
                if not req.future.done():
                    req.future.set_exception(exc)
            self._idle(loop.time())
            self._rows, self._waiting = [], deque()
            self._empty_batch()

    async def _step(self, fn, *args) -> tuple[torch.Tensor, torch.Tensor]:
        self._between.clear()
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self._between.set()

    # -- the batch, touched only by the decode loop (in the worker thread or between steps) ---
    def _empty_batch(self) -> None:
        """No rows, the live columns back home; the buffers stay allocated for the next rows."""
        self._lo = self._hi = self._home()
        self._pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)

    def _home(self) -> int:
        """Where the live columns end after a reset or a compaction: the buffer's middle, so
        its right half is room for as many decode steps."""
        return self._mask.shape[1] // 2

    @torch.inference_mode()  # the buffers were made under it, in the prefill
    def _drop_done(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if not r.done]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows = []
            self._empty_batch()
            return
        n, lo, hi = len(keep), self._lo, self._hi
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if keep != list(range(n)):  # move the kept rows into the first slots
            for k, v in self._kv:
                k[:n, :, lo:hi] = k[:, :, lo:hi].index_select(0, idx)
                v[:n, :, lo:hi] = v[:, :, lo:hi].index_select(0, idx)
            self._mask[:n, lo:hi] = self._mask[:, lo:hi].index_select(0, idx)
        self._pos = self._pos.index_select(0, idx)
        self._last = self._last.index_select(0, idx)
        self._rows = [self._rows[i] for i in keep]
        # Columns that are padding for every remaining row are dead weight in every step.
        live = self._mask[:n, lo:hi].any(dim=0).nonzero()
        self._lo = lo + int(live[0])

    def _fit(self, width: int, kv: Optional[list[tuple[torch.Tensor, ...]]] = None) -> None:
        """Move the live columns to end at home, with home at least ``width``: the buffers
        double (up to 2 x max positions, which no row outgrows) when they are too short, so
        they stay as wide as the longest rows need, not as the model allows."""
        n, lo, hi = len(self._rows), self._lo, self._hi
        home = self._home()
        if width > home:
            home = min(max(2 * home, 64, 1 << (width - 1).bit_length()), self.max_positions)
            like = kv or self._kv
            # Zeros: padding is masked, but a masked NaN would still poison the weighted sum.
            grown = [
                tuple(torch.zeros(self.max_num_seqs, t.shape[1], 2 * home, t.shape[3], dtype=t.dtype, device=self.device) for t in layer)
                for layer in like
            ]
            mask = torch.zeros(self.max_num_seqs, 2 * home, dtype=torch.bool, device=self.device)
        else:
            grown, mask = self._kv, self._mask
        new_lo = home - (hi - lo)
        if n:
            for (k, v), (k1, v1) in zip(self._kv, grown):
                k1[:n, :, new_lo:home] = k[:n, :, lo:hi].clone()
                v1[:n, :, new_lo:home] = v[:n, :, lo:hi].clone()
            mask[:n, new_lo:home] = self._mask[:n, lo:hi].clone()
        self._kv, self._mask = grown, mask
        self._lo, self._hi = new_lo, home

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if self.temperature > 0:
            logp = torch.log_softmax(logits / self.temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=self._gen).squeeze(1)
        else:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)

    @torch.inference_mode()
    def _prefill(self, new: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ``new`` requests, merge them into the batch; returns their first tokens."""
        # Identical contexts share one prefill: a fresh group's samples all hold the same prompt.
        unique: dict[tuple[int, ...], list[int]] = {}
        for i, req in enumerate(new):
            unique.setdefault(tuple(req.context), []).append(i)
        by_len: dict[int, list[tuple[int, ...]]] = {}
        for ctx in unique:
            by_len.setdefault(len(ctx), []).append(ctx)
        logits = [None] * len(new)
        parts = []  # (rows, kv, length) of each prefilled bucket, expanded to one row per request
        for length, ctxs in by_len.items():
            ids = torch.tensor(ctxs, dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, use_cache=True)
            self.prefill_tokens += ids.numel()
            rep = torch.tensor([j for j, ctx in enumerate(ctxs) for _ in unique[ctx]], device=self.device)
            order = [i for ctx in ctxs for i in unique[ctx]]
            last = out.logits[:, -1].index_select(0, rep)
            for r, i in enumerate(order):
                logits[i] = last[r]
            layers = out.past_key_values.layers
            kv = [(lay.keys.index_select(0, rep), lay.values.index_select(0, rep)) for lay in layers]
            parts.append((order, kv, length))
        tok, lp = self._sample(torch.stack(logits))
        for order, kv, length in parts:
            idx = torch.tensor(order, device=self.device)
            self._merge([new[i] for i in order], kv, length, tok.index_select(0, idx))
        return tok, lp

    def _merge(self, rows: list[_Request], kv: list[tuple[torch.Tensor, ...]], length: int, last: torch.Tensor) -> None:
        """Write prefilled rows (all of ``length`` tokens) into the next slots, ending at column hi."""
        if not self._rows:
            self._empty_batch()
        if self._hi < length:
            self._fit(max(self._hi - self._lo, length), kv)
        b, n, hi = len(self._rows), len(rows), self._hi
        start = hi - length
        if start < self._lo:  # the new rows are the longest: the others are padding there
            self._mask[:b, start : self._lo] = False
            self._lo = start
        for (k, v), (k1, v1) in zip(self._kv, kv):
            k[b : b + n, :, start:hi] = k1
            v[b : b + n, :, start:hi] = v1
        self._mask[b : b + n, self._lo : start] = False
        self._mask[b : b + n, start:hi] = True
        pos = torch.full((n,), length, dtype=torch.long, device=self.device)
        self._pos = torch.cat([self._pos, pos])
        self._last = torch.cat([self._last, last])
        self._rows.extend(rows)

    @torch.inference_mode()
    def _decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = len(self._rows)
        if self._hi == self._mask.shape[1]:
            self._fit(self._hi - self._lo)
        lo, hi = self._lo, self._hi
        self._mask[:b, hi] = True
        cache = Cache(layers=[_SlotLayer(k[:b], v[:b], lo, hi) for k, v in self._kv])
        out = self.model(
            input_ids=self._last[:, None],
            attention_mask=self._mask[:b, lo : hi + 1],
            position_ids=self._pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        self._hi = hi + 1
        self._pos = self._pos + 1
        tok, lp = self._sample(out.logits[:, -1])
        self._last = tok
        return tok, lp
