"""A real rollout engine on vLLM's ``AsyncLLM``: vLLM does the batching, this adapts the protocol.

Each sample becomes one request whose prompt is the prompt plus the response so far, so a
resumed sample re-prefills its partial response. Outputs stream as deltas and are kept per
request until the request ends or is aborted, so an abort keeps exactly the tokens seen.
Weights come by collective broadcast into the worker (core/real/vllm_weight_receiver.py), or,
from an object-store transfer, through ``reload_weights`` from a safetensors file in a fresh
directory: tensors passed over the engine's RPC would be serialized into lists.

Implements the ``Engine`` protocol of ``core/api.py``. vLLM is imported in ``start()``
only, so importing this module stays cheap.

In-flight weight updates (``freeze``, ``update_weights``, ``thaw``) use what vLLM 0.32 has:
``AsyncLLM.pause_generation(mode="keep", clear_cache=False)`` stops the scheduler between
two engine steps (``PAUSED_ALL``: no token is scheduled) with every request and its KV blocks
kept; ``reload_weights`` then swaps the weights under them, and ``resume_generation`` goes on
decoding from the kept KV. Token versions come from vLLM itself: the engine core labels every
step's outputs with its weight version (``set_weight_version``), and the output processor
turns those labels into (version, first token) runs per request. So a token sampled before
the pause but read from the stream after it still carries the old version: it is tagged by the
step that sampled it, never by when it was read.

What vLLM cannot do, and what stands in for it:

* KV computed under the old weights stays under a running request after the update (its
  prompt and the tokens before the freeze are not recomputed): that is the point of keeping it.
* The prefix cache cannot be reset while requests hold blocks, and vLLM has no call that drops
  only the free cached blocks. Every request is therefore submitted with its version as cache
  salt, so a request of a newer version never hits a prefix computed by older weights. A request
  submitted while frozen, before the new weights load, carries the old salt but is prefilled
  after ``thaw`` on the new weights.
* Frozen time counts as busy: the requests are held, their KV resident.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from core.model.owned import discard_owned, make_owned
from core.model.sample import Group, Sample
from core.real.engine_meter import EngineMeter
from core.model.config import ConfigError
from core.real.device import CPU, cpu_flags, cpu_runs_bf16
from core.real.hf_model import model_dtype
from core.real.weight_broadcast import BroadcastTicket, RollCall, broken_as_collective
from core.model.timeline import Timeline

log = logging.getLogger(__name__)

# vLLM mixes this class into its Worker (engine arg ``worker_extension_cls``).
WORKER_EXTENSION = "core.real.vllm_weight_receiver.BroadcastReceiverExtension"
# Must be in the environment before vllm is imported; callers may override them.
VLLM_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


class _Request:
    __slots__ = ("id", "sample", "ctx", "tokens", "logprobs", "spans", "task", "done")

    def __init__(self, rid: str, sample: Sample, ctx: int = 0) -> None:
        self.id = rid
        self.sample = sample
        self.ctx = ctx  # context tokens when submitted
        # vLLM hands tokens over as lists, a few per output: kept so, made arrays once at the end.
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[list[int]] = []  # [version, n] runs over ``tokens``
        self.task: Optional[asyncio.Task] = None
        self.done = False


class VllmEngine(EngineMeter):
    """A rollout engine backed by one vLLM ``AsyncLLM``.

    ``freeze``/``thaw`` keep generations running across a weight update (see the module
    docstring for what vLLM 0.32 allows and what is missing). Whether the KV cache survived
    shows in ``scheduled_tokens`` (every position the model computed, prefill and decode,
    from vLLM's per-step iteration details) and ``preempted_requests`` (requests vLLM
    rescheduled after preempting them, recomputing their context): after a thaw the first
    grows by one per token decoded, the second not at all. ``prefill_tokens`` cannot show it:
    it is counted once per request, at its first output.
    """

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
        max_model_len: int = 512,
        kv_cache_gb: Optional[float] = None,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "auto",
    ) -> None:
        self.name = name
        self.model_dir = Path(model_dir)
        self.dtype = dtype  # resolved against the model's own at start(): building touches no file
        self.max_num_seqs = max_num_seqs
        # Public so tests can switch to greedy (0.0) between generations.
        self.temperature = temperature
        self.seed = seed
        # Unused on CPU: vLLM binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND).
        self.threads = threads
        self.timeline = timeline
        self.device = device
        self.max_model_len = max_model_len
        self.kv_cache_gb = kv_cache_gb
        self.gpu_memory_utilization = gpu_memory_utilization
        self.version = 0
        self._init_meter()
        self.eos_token_id: int = -1
        self._engine: Any = None
        self._tied = False
        self._ids = itertools.count()
        self._live: dict[str, _Request] = {}
        self._frozen = False
        self.scheduled_tokens = 0
        self.preempted_requests = 0
        # Wall-clock times of thaws: a step gap spanning one is a freeze, not a step.
        self._thaws: list[float] = []
        # One row per engine step, for calibration: (time, running, context held, prompt tokens, generated tokens).
        self.iterations: list[tuple[float, int, int, int, int]] = []
        self._roll = RollCall(name)  # weights by broadcast: this engine's answers to the trainer
        self.received_checksums = False  # tests: keep the sha256 of every tensor received
        self.last_received: dict = {}

    # -- protocol ---------------------------------------------------------------------------
    async def start(self) -> None:
        # vLLM's own "auto" would run a float32 checkpoint in float16: the model's dtype, resolved here.
        self.dtype = model_dtype(self.model_dir, self.dtype)
        if self.device == CPU and self.dtype == "bfloat16" and not cpu_runs_bf16(cpu_flags()):
            raise ConfigError("engine.dtype", self.dtype, "vLLM's CPU backend computes bfloat16 on AVX-512 processors, and this "
                              "one has no avx512f", "set engine.dtype: float32, or engine.kind: torch (its bfloat16 runs on any CPU)")
        for k, v in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
        if self.device == CPU and self.kv_cache_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gb)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _StepLog(StatLoggerBase):
            """vLLM calls ``record`` once per engine step's outputs: the only per-step view
            of its scheduler that the engine core (in its own process) gives."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                engine._on_iteration(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            dtype=self.dtype,
            # Joins the trainer's broadcast group and loads buckets in place (update_weights).
            worker_extension_cls=WORKER_EXTENSION,
            max_model_len=self.max_model_len,
            enforce_eager=True,
            max_num_seqs=self.max_num_seqs,
            seed=self.seed,
            # Behaviour log-probs must be those of the distribution sampled from (after temperature).
            logprobs_mode="processed_logprobs",
            # Per-step scheduled tokens: what shows that a thaw prefilled nothing again.
            enable_logging_iteration_details=True,
        )
        if self.device != "cpu":
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            if self.kv_cache_gb is not None:
                kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gb * 2**30)
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, disable_log_stats=True), stat_loggers=[_StepLog])
        hf_config = self._engine.model_config.hf_config
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        eos = hf_config.eos_token_id
        self.eos_token_id = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        await self._engine.engine_core.set_weight_version_async(str(self.version))
        log.info("%s: vLLM started on %s (%s)", self.name, self.model_dir, self.device)

    async def generate(self, group: Group, max_response_len: int, stop_ids: frozenset[int] = frozenset()) -> bool:
        """Generate every unfinished response of ``group``; False if aborted first."""
        if self._engine is None:
            raise RuntimeError(f"{self.name}: start() the engine first")
        loop = asyncio.get_running_loop()
        now = loop.time()
        reqs = []
        for s in group.unfinished():
            context = [int(t) for t in s.prompt_tokens] + np.asarray(s.response_tokens).tolist()
            want = min(max_response_len - s.n_response, self.max_model_len - len(context))
            if want <= 0:  # resumed at the cap
                s.finished = True
                s.finished_at = now
                continue
            req = _Request(f"{self.name}-{next(self._ids)}", s, len(context))
            req.task = asyncio.create_task(self._stream(req, context, want, stop_ids), name=req.id)
            reqs.append(req)
        if not reqs:
            return True
        self._advance(now)
        for req in reqs:
            self._live[req.id] = req
            # vLLM's scheduler is not observable from here: submission stands for scheduling.
            if req.sample.started_at != req.sample.started_at:  # NaN: first time scheduled
                req.sample.started_at = now
        self._busy(now)
        results = await asyncio.gather(*(r.task for r in reqs), return_exceptions=True)
        for r in results:
            # A task aborted before it first ran ends cancelled rather than returning False.
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r
        return all(r is True for r in results)

    async def abort_all(self) -> int:
        """Interrupt every request; tokens already seen stay on their samples."""
        reqs = [r for r in self._live.values() if not r.done]
        for req in reqs:
            self._release(req, finished=False)
            req.task.cancel()  # AsyncLLM.generate aborts the request in the engine when cancelled
        if reqs:
            await asyncio.gather(*(r.task for r in reqs), return_exceptions=True)
        return len(reqs)

    async def freeze(self) -> None:
        """Stop between two engine steps; requests and their KV blocks stay in vLLM."""
        if self._frozen:
            return
        await self._engine.pause_generation(mode="keep", clear_cache=False)
        self._frozen = True

    async def thaw(self) -> None:
        if not self._frozen:
            return
        self._thaws.append(time.time())
        await self._engine.resume_generation()
        self._frozen = False

    async def update_weights(self, version: int, weights: Optional[dict[str, np.ndarray]] = None) -> None:
        """Load ``weights`` as ``version``: on an idle engine, or under requests kept by ``freeze``."""
        if self._live and not self._frozen:
            raise RuntimeError(f"{self.name}: update_weights with requests in flight; pause the rollout first")
        if isinstance(weights, BroadcastTicket):
            with broken_as_collective(self.name):
                await self._receive(weights)
            if not self._frozen:
                await self.clear_cache()
        elif weights is not None:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else None
            # The weights in a subdirectory of a stamped one: vLLM reads every file it is given.
            owned = make_owned(root, f"asyncrl-{self.name}-w{version}-", "weights")
            wdir = str(owned / "weights")
            try:
                os.mkdir(wdir)
                await asyncio.to_thread(_save, weights, wdir, self._tied)
                await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": wdir})
            finally:
                discard_owned(owned, "weights")
            if not self._frozen:
                # Cached prefixes hold KV of the old weights (frozen, the version salt keeps them apart).
                await self.clear_cache()
        # Labels every step from here on; frozen, the next step is after thaw.
        await self._engine.engine_core.set_weight_version_async(str(version))
        self.version = version

    async def _receive(self, ticket: BroadcastTicket) -> None:
        """Take a broadcast in vLLM's worker: roll call here, join and receive there."""
        self._roll.timeout_s = ticket.timeout_s
        m, join = await asyncio.to_thread(self._roll.answer, ticket)
        if join:
            await self._engine.collective_rpc("asyncrl_join", args=(vars(m), ticket.timeout_s, self.name, str(self.model_dir)))
        got = await self._engine.collective_rpc("asyncrl_receive", args=(ticket.bucket_bytes, self.received_checksums))
        self.last_received = got[0]

    async def clear_cache(self) -> None:
        """Drop vLLM's prefix cache; retried while just-aborted requests still hold blocks."""
        if self._frozen and self._live:
            # Kept requests hold their blocks, so no reset can succeed; the version salt
            # already keeps newer requests off prefixes of older weights.
            log.debug("%s: frozen with requests kept, prefix cache left as it is", self.name)
            return
        for _ in range(100):
            if await self._engine.reset_prefix_cache():
                return
            await asyncio.sleep(0.01)
        raise RuntimeError(f"{self.name}: vLLM refused to reset its prefix cache (requests still running?)")

    async def close(self, now: float) -> None:
        await self.abort_all()
        self._advance(now)
        self._idle(now)
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # -- requests --------------------------------------------------------------------------------
    async def _stream(self, req: _Request, context: list[int], max_tokens: int, stop_ids: frozenset[int]) -> bool:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            stop_token_ids=sorted(stop_ids) or None,  # kept as the response's last token, as <eos> is
        )
        counted = False
        # Salted by version: cached prefixes are shared only by requests of the same weights.
        prompt = TokensPrompt(prompt_token_ids=context, cache_salt=f"v{self.version}")
        stream = self._engine.generate(prompt, params, request_id=req.id)
        try:
            async for out in stream:
                if req.done:  # aborted: later tokens are never seen
                    break
                if not counted:
                    counted = True
                    self.prefill_tokens += len(context) - (out.num_cached_tokens or 0)
                o = out.outputs[0]
                if o.token_ids:
                    self._tag(req, len(o.token_ids), o.weight_versions)
                for tok, lps in zip(o.token_ids, o.logprobs, strict=True):
                    req.tokens.append(int(tok))
                    req.logprobs.append(float(lps[tok].logprob))
                if o.finish_reason is not None and o.finish_reason != "abort":
                    self._release(req, finished=True)
                    return True
        except asyncio.CancelledError:
            if not req.done:  # cancelled from outside the engine: count it as an abort
                self._release(req, finished=False)
            return False
        finally:
            await stream.aclose()  # aborts the request in vLLM if it is still running
        if not req.done:
            self._release(req, finished=False)
        return False

    def _tag(self, req: _Request, n: int, final: Any) -> None:
        """Record the versions of the request's next ``n`` tokens, as vLLM labelled the steps
        that sampled them: from the finished output's spans, else from the live request state."""
        starts: list[tuple[str, int]] = []
        if final is not None:
            starts = [(s.version, s.start) for s in final]
        else:
            op = self._engine.output_processor
            for rid in reversed(op.external_req_ids.get(req.id, ())):
                state = op.request_states.get(rid)
                if state is not None:
                    starts = list(state.weight_version_starts)
                    break
        runs = [(self._label_version(v), s) for v, s in starts]
        if not runs or runs[0][1] > 0:  # unlabelled tokens (not expected): the version now
            runs.insert(0, (self.version, 0))
        lo, hi = len(req.tokens), len(req.tokens) + n
        for i, (v, s) in enumerate(runs):
            e = runs[i + 1][1] if i + 1 < len(runs) else math.inf
            k = int(min(e, hi) - max(s, lo))
            if k <= 0:
                continue
            if req.spans and req.spans[-1][0] == v:
                req.spans[-1][1] += k
            else:
                req.spans.append([v, k])

    def _label_version(self, label: str) -> int:
        try:
            return int(label)
        except ValueError:
            return self.version

    # -- bookkeeping -------------------------------------------------------------------------------
    def _on_iteration(self, sched: Any, it: Any) -> None:
        if sched is not None:
            details = getattr(sched, "iteration_details", None)
            if details is not None:
                self.scheduled_tokens += details.num_ctx_tokens + details.num_generation_tokens
            cache = getattr(sched, "prefix_cache_stats", None)
            if cache is not None:
                self.preempted_requests += cache.preempted_requests
        if it is None:
            return
        running = sched.num_running_reqs if sched is not None else len(self._live)
        context = sum(r.ctx + len(r.tokens) for r in self._live.values())
        self.iterations.append((it.iteration_timestamp, running, context, it.num_prompt_tokens, it.num_generation_tokens))

    def step_spans(self) -> dict:
        """vLLM mixes prefill into decode steps (chunked prefill): each step is one row
        (running, context held, prompt tokens, seconds), its time the gap since the previous
        step's outputs while requests were running (a gap after an idle engine, or across a
        freeze, is dropped)."""
        steps = []
        for (t0, run0, _, _, _), (t1, run1, ctx, prompt, _) in zip(self.iterations, self.iterations[1:]):
            thawed = bisect.bisect_right(self._thaws, t0) < bisect.bisect_right(self._thaws, t1)
            if run0 > 0 and not thawed:
                steps.append((run1, ctx, prompt, t1 - t0))
        return {"steps": steps}

    def _release(self, req: _Request, finished: bool) -> None:
        now = asyncio.get_running_loop().time()
        self._advance(now)
        req.done = True
        cuts, n = [], 0  # the meter's (first token, version) runs, from the [version, n] spans
        for v, k in req.spans:
            cuts.append((n, v))
            n += k
        self._deliver(req.sample, req.tokens[:n], req.logprobs[:n], finished, now, cuts or None)
        self._live.pop(req.id, None)
        self._idle(now)


def _save(weights: dict[str, np.ndarray], wdir: str, tied: bool) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
    # A reload without lm_head.weight leaves vLLM's LM head on its old tensor (the tie is not
    # re-established), so the tied head is written out explicitly, as its own copy.
    if tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, os.path.join(wdir, "model.safetensors"))
