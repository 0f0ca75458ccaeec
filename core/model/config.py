"""The scenario: every knob of a run, validated once, frozen, each default written here only.

Hardware and model defaults describe verl's published fully-async setup (Qwen2.5-7B on
NVIDIA H20); every number says where it comes from. Nothing here is fitted to a result.
"""

from __future__ import annotations

import functools
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from core.model.measurements import COLLECTIVE_CALL, EAGER_LAYER, EAGER_MOE_LAYER, HOST_COPY_GB_S, KV_REBUILD, MICRO_BATCH_HALF_TOKENS, PER_TENSOR, SYNC_LATENCY
from core.model.length_file import LengthFileError, read_lengths
from core.model.model_dir import ModelDirError, check_loadable, linear_layers, read_model_dir, read_tokenizer
from core.model.owned import is_owned
from core.model.prompt_file import PromptFileError, read_prompts
from core.model.lookup_file import LookupFileError, read_lookup
from core.model.reward_fn import load_reward_fn
from core.model.tool_spec import BUILTIN_TOOLS, NAME as TOOL_NAME, check_tool_fn
from core.model.user_code import UserCodeError

Mode = Literal["sync", "async", "partial", "inflight"]
MODES: tuple[str, ...] = ("sync", "async", "partial", "inflight")
Correction = Literal["bypass", "tis", "decoupled", "icepop", "seq_tis", "seq_mis", "m2po"]
RECOMPUTES_PROX: frozenset[str] = frozenset({"decoupled", "icepop", "seq_tis", "seq_mis", "m2po"})
"""The corrections (core/real/corrections.py) that weigh against the proximal policy: one no-grad forward per step."""
RENAMED_CORRECTIONS: dict[str, str] = {"none": "bypass", "masked": "icepop"}
"""Earlier names of two corrections, refused with the new one."""
# The stamp's kind of a tiny-model directory asyncrl built (core/model/owned.py).
TINY_MODEL_KIND = "tiny-model"


# Ceilings of the counts that size a run's work or memory: far above any real run, low enough
# that a slip (a zero too many, 2**63) is refused up front instead of hanging the simulator.
MAX_DEVICES = 100_000
"""GPUs, CPU cores, machines, actors or workers of one role (the largest clusters built hold about 100,000 GPUs)."""
MAX_SAMPLES = 10_000_000
"""Samples, sequences, groups, rows or environments held or taken at once (verl's batches are a few
thousand samples; DQN's replay holds 1M rows, Ape-X's 2M)."""
MAX_TOKENS = 10_000_000
"""Tokens of one prompt or response (past the longest context window any model serves)."""
MAX_STEPS = 1_000_000
"""Trainer steps, versions, epochs or restarts (published RL runs of LLMs take hundreds to thousands of steps)."""
MAX_ENV_STEPS = 100_000_000_000
"""Environment steps of a run (Ape-X's Atari runs took 22.8 billion frames)."""
MAX_DIM = 1_000_000
"""A model's layers, widths, heads or vocabulary (the largest models' hidden sizes are a few ten thousand)."""
MAX_BYTES = 1_000_000_000_000
"""Bytes of one thing on the wire (a terabyte)."""
MAX_GB = 1_000_000
"""Gigabytes of memory one thing reserves (a petabyte)."""
MAX_SEEDS = 1_000
MAX_TOOLS = 64  # a prompt that lists more than this many tools is not one a model reads well
"""Seeds of one run (each runs every mode once)."""
MAX_INT = 2**53
"""Any whole number: the largest a JSON report carries exactly (a float64's mantissa)."""
MAX_FLOAT = 1e9
"""Any real number's magnitude: a billion seconds is 31 years, a billion GB/s or TFLOP/s beyond any device."""
ECHO_CHARS = 200  # the most of a value an error message repeats: a path whole, never a megabyte


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 3, ECHO_CHARS, 40, ECHO_CHARS


def shown(value: object) -> str:
    """``repr(value)`` cut short: an error message never echoes an unbounded value (a YAML alias
    bomb expands to gigabytes), and building it costs as little (reprlib stops early)."""
    return clipped(_SHORT.repr(value))


def clipped(text: str) -> str:
    """At most ``ECHO_CHARS`` of a piece of text an error line repeats, as it is (no quotes)."""
    return text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 3] + "..."


REFUSED = "refused"
"""The pydantic error type of a value a validator refuses with its own fix (ctx: problem, fix)."""


def refused(problem: str, fix: str) -> PydanticCustomError:
    """A field validator's error that keeps the field's dotted location (a ``ConfigError`` names its key itself)."""
    return PydanticCustomError(REFUSED, "{problem}", {"problem": problem, "fix": fix})


NAME_BYTES = 100  # a name is a directory name (most file systems take 255 bytes) and a plot title
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def name_problem(text: str) -> Optional[str]:
    """Why ``text`` cannot name a run (its directory, its plots' titles); None if it can. Only
    letters, digits, '-', '_' and '.' (no '/', NUL or path escape; no '$' or '\\' that plots
    would read as TeX), not starting with '.', at most ``NAME_BYTES`` bytes."""
    if len(text.encode("utf-8", "surrogatepass")) > NAME_BYTES:
        return f"is longer than {NAME_BYTES} bytes"
    if not _NAME.fullmatch(text):
        return "may hold only letters, digits, '-', '_' and '.', and not start with '.' (it names a directory)"
    return None


def safe_name(text: str) -> str:
    """A name like ``text`` that ``name_problem`` accepts: what a fix suggests."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", text).lstrip(".-")[:NAME_BYTES]
    return out or "run"


def _check_name(text: str) -> str:
    problem = name_problem(text)
    if problem is not None:
        raise refused(problem, f"use e.g. {safe_name(text)!r}")
    return text


RunName = Annotated[str, AfterValidator(_check_name)]
"""A run's name: it names the run's directory and titles its reports."""


class ConfigError(ValueError):
    """One bad value: the dotted key, the value, what is wrong and how to fix it."""

    def __init__(self, key: str, value: object, problem: str, fix: str) -> None:
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        super().__init__(f"{key} = {shown(value)}: {problem}; fix: {fix}")


def check_runs(modes: tuple, seeds: tuple, choices: tuple[str, ...]) -> None:
    """What every scenario's ``modes`` and ``seeds`` must be: at least one mode, each once; seeds
    distinct and not negative."""
    if not modes:
        raise ConfigError("modes", list(modes), "no mode to run", f"list one or more of {', '.join(choices)}")
    if len(set(modes)) != len(modes):
        raise ConfigError("modes", list(modes), "a mode is listed twice", "list each mode once")
    if len(set(seeds)) != len(seeds) or any(x < 0 for x in seeds):
        raise ConfigError("seeds", list(seeds), "seeds must be distinct and not negative", "list each seed once, e.g. [0, 1, 2]")


class _Frozen(BaseModel):
    # allow_inf_nan: an infinite delay or bandwidth never ends a simulated wait (it hung the sim).
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        """YAML 1.1 reads yes, no, on and off as true and false, and pydantic would take those as 1
        and 0: ``mfu: yes`` ran at 100 % MFU. A number field refuses them."""
        if isinstance(value, bool) and _takes_a_number_not_a_bool(cls, info.field_name):
            raise refused(f"is {str(value).lower()}, not a number (YAML reads yes, no, on and off as true and false)",
                          "write a number")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, value: object) -> object:
        """Every number of every field (and inside its tuples and dicts) within ``MAX_INT`` or
        ``MAX_FLOAT``, whatever ceiling the field itself has: one rule for all of them."""
        _check_magnitude(value)
        return value


@functools.lru_cache(maxsize=None)
def _takes_a_number_not_a_bool(model: type[BaseModel], name: str) -> bool:
    kinds, todo = set(), [model.model_fields[name].annotation]
    while todo:
        t = todo.pop()
        args = typing.get_args(t)
        if typing.get_origin(t) in (typing.Union, types.UnionType, Annotated):
            todo.extend(args)
        else:
            kinds.add(t)
    return bool(kinds & {int, float}) and bool not in kinds


def _check_magnitude(value: object) -> None:
    if isinstance(value, bool) or isinstance(value, BaseModel):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise refused("is beyond any count a run has", f"use a number of magnitude at most 2**53 = {MAX_INT}")
    elif isinstance(value, float):
        if abs(value) > MAX_FLOAT:
            raise refused("is beyond anything physical in this field's unit", f"use a number of magnitude at most {MAX_FLOAT:g}")
    elif isinstance(value, (tuple, list)):
        for v in value:
            _check_magnitude(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_magnitude(k)
            _check_magnitude(v)


class ModelSpec(_Frozen):
    """The policy model. Read by: the sim runtime for its figures (costs, memory); the real
    runtimes for ``path`` (without it they train ``tiny_model``).

    With ``path`` the figures come from that directory (core/model/model_dir.py): layers,
    hidden, kv_heads, head_dim, vocab, tied_embeddings and max_positions from config.json,
    params_b counted exactly from the safetensors headers. A figure written beside ``path``
    must agree with the directory (params_b within 1 %, the rounding of a model card), else
    the scenario is refused naming both; ``name`` and ``dtype_bytes`` (the directory's name
    and dtype) may be set to anything, and so may params_b when the directory has no weights
    to count and it would only be estimated from the figures."""

    path: Optional[str] = None
    """A local Hugging Face causal-LM directory (config.json, *.safetensors weights, tokenizer
    files), relative to the working directory. The real runtimes train and serve it, loaded
    from disk only (nothing is downloaded; asyncrl never writes into it), after the scenario
    check has read every safetensors header and loaded its tokenizer, so a damaged directory is
    refused in one line before anything runs. For the sim, config.json alone is enough. None:
    the figures below, and the tiny model on real runtimes."""
    name: str = "Qwen2.5-7B"
    """A label for reports."""
    params_b: float = Field(7.62, gt=0)
    """Parameters in billions (Qwen2.5-7B model card: 7.61 B)."""
    layers: int = Field(28, ge=1, le=MAX_DIM)
    """Transformer layers (Qwen2.5-7B config.json: num_hidden_layers 28)."""
    hidden: int = Field(3584, ge=1, le=MAX_DIM)
    """Hidden size (Qwen2.5-7B config.json: hidden_size 3584)."""
    kv_heads: int = Field(4, ge=1, le=MAX_DIM)
    """Key/value heads (Qwen2.5-7B config.json: num_key_value_heads 4, GQA)."""
    head_dim: int = Field(128, ge=1, le=MAX_DIM)
    """Head dimension (Qwen2.5-7B: 3584 / 28 heads)."""
    intermediate: int = Field(18944, ge=1, le=MAX_DIM)
    """Width of the gated MLP (Qwen2.5-7B config.json: intermediate_size 18944). Read only to
    price a LoRA adapter's gate/up/down matrices (``trainer.lora``)."""
    dtype_bytes: int = Field(2, ge=1, le=8)
    """Bytes per weight and per KV element (bf16)."""
    vocab: Optional[int] = Field(None, ge=1, le=MAX_DIM)
    """Vocabulary size (Qwen2.5-7B config.json: vocab_size 152064). Given, the input embedding
    (vocab x hidden parameters) is a lookup: left out of the FLOPs and of the weights a decode
    step reads, unless ``tied_embeddings``. None prices every parameter as a matmul weight, as
    scenarios written before this field were."""
    tied_embeddings: bool = False
    """The output layer reuses the input embedding (Qwen2.5-7B config.json: tie_word_embeddings
    false; Qwen2.5-1.5B: true); tied, its matrix is multiplied by the lm_head and nothing is left out."""
    max_positions: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    """Longest prompt + response the model takes (config.json max_position_embeddings), read
    from ``path``. None: not checked."""
    heads: Optional[int] = Field(None, ge=1, le=MAX_DIM)
    """Query heads (config.json num_attention_heads): attention's width is heads x head_dim,
    which prices the quadratic attention term of prefill and training. None: the width is
    ``hidden`` (true of Qwen2.5 and Llama; Qwen3's MoE models are twice as wide)."""
    experts: int = Field(1, ge=1, le=MAX_DIM)
    """Routed experts per MoE layer (Qwen3-30B-A3B config.json: num_experts 128). 1: a dense model."""
    experts_per_token: int = Field(1, ge=1, le=MAX_DIM)
    """Routed experts each token goes to, top-k (Qwen3-30B-A3B: num_experts_per_tok 8)."""
    tensors: Optional[int] = Field(None, ge=1, le=MAX_DIM)
    """Named tensors in the checkpoint, each a lookup and a copy at a weight sync (and one
    collective where the sync is not bucketed). None: counted from the architecture, Qwen's
    layout: 12 per dense layer (q, k, v with biases, o, gate, up, down, two norms; Qwen2.5-7B:
    339 in all), 9 + 3 x experts per MoE layer (Qwen3-30B-A3B: 18,867), plus embeddings, final
    norm and head."""
    expert_params_b: float = Field(0.0, ge=0)
    """Parameters of one routed expert, all MoE layers together, in billions: for a gated MLP,
    3 x hidden x moe_intermediate_size x MoE layers (Qwen3-30B-A3B: 3 x 2048 x 768 x 48 =
    0.2265). Counted in ``params_b``; what is not routed (attention, embeddings, a shared
    expert, the router) every token multiplies. 0: a dense model."""

    @model_validator(mode="after")
    def _from_path(self) -> "ModelSpec":
        if self.path is None:
            return self
        try:
            figures = read_model_dir(self.path)
        except ModelDirError as exc:
            raise ConfigError("model.path", self.path, str(exc), "give a local Hugging Face model directory (config.json, *.safetensors, tokenizer)") from None
        given = self.model_fields_set
        for key, value in figures.stated().items():
            if key in given and not _agrees(getattr(self, key), value):
                shown = f"{value:.4g}" if key == "params_b" else repr(value)
                raise ConfigError(f"model.{key}", getattr(self, key), f"model.path {self.path} says {shown}", f"remove model.{key}, or set it to {shown}")
        if "params_b" not in given and figures.params is None and figures.params_estimate is None:
            raise ConfigError("model.params_b", self.params_b, f"model.path {self.path} has no weights to count and its figures "
                              "do not give the count (a mixture of experts, or no intermediate_size)",
                              "set model.params_b from the model card")
        read = {**figures.defaults(), **figures.stated()}
        for key, value in read.items():
            if key not in given:
                # Filled in, not set: a copy with another model.path (with_changes) reads that directory's.
                object.__setattr__(self, key, value)
        return self

    @model_validator(mode="after")
    def _experts(self) -> "ModelSpec":
        k, e = self.experts_per_token, self.experts
        if k > e:
            raise ConfigError("model.experts_per_token", k, f"is more than model.experts = {e}", f"use at most {e}")
        routed = e * self.expert_params_b
        if routed >= self.params_b:
            raise ConfigError("model.expert_params_b", self.expert_params_b,
                              f"{e} experts of it make {routed:.4g} B, not less than model.params_b = {self.params_b}",
                              "give one expert's parameters over all MoE layers, in billions")
        return self


def _agrees(given: object, read: object) -> bool:
    """An explicit figure against the directory's: the same, or a parameter count within 1 %."""
    if isinstance(read, bool) or isinstance(given, bool) or not isinstance(given, (int, float)):
        return given == read
    if isinstance(read, float):
        return math.isclose(given, read, rel_tol=0.01)
    return given == read


class GpuSpec(_Frozen):
    """One accelerator. Read by: the sim runtime only (a real run measures its devices)."""

    name: str = "H20"
    """A label for reports (verl's fully-async experiments ran on H20)."""
    hbm_gb_s: float = Field(4000.0, gt=0)
    """Peak memory bandwidth in GB/s (NVIDIA H20 datasheet: 4.0 TB/s HBM3)."""
    bf16_tflops: float = Field(148.0, gt=0)
    """Dense BF16 peak in TFLOP/s (NVIDIA H20 datasheet: 148)."""
    fp8_tflops: Optional[float] = Field(None, gt=0)
    """Dense FP8 peak in TFLOP/s (NVIDIA H20 datasheet: 296; H100 SXM: 1,979), what the GEMMs of
    an ``engine.dtype: fp8`` rollout reach. None: FP8 GEMMs run at the BF16 peak (only the
    bytes halve), the conservative reading of what FP8 buys."""
    hbm_efficiency: float = Field(0.8, gt=0, le=1)
    """Fraction of peak bandwidth a decode kernel reaches (typical for large streaming reads on HBM3)."""
    nvlink_gb_s: float = Field(450.0, gt=0)
    """NVLink bandwidth per GPU and direction in GB/s, for tensor-parallel all-reduces
    (NVIDIA H20 datasheet: 900 GB/s NVLink, both directions)."""
    memory_gb: float = Field(96.0, gt=0)
    """Memory per GPU in GB (NVIDIA H20 datasheet: 96 GB HBM3); with the weights, it sets the
    engines' KV-cache capacity (``kv_capacity_tokens``)."""
    gpus_per_node: int = Field(8, ge=1, le=MAX_DEVICES)
    """GPUs joined by NVLink in one node (an HGX H20 board: 8); a data-parallel trainer on more
    spans nodes, and its collectives run at ``interconnect_gb_s``."""
    interconnect_gb_s: Optional[float] = Field(None, gt=0)
    """Bandwidth per GPU between nodes in GB/s that a data-parallel trainer's collectives reach
    (e.g. 25 for one 200 Gb/s NIC per GPU, 50 for 400 Gb/s). Given, a sharded trainer's weight
    gathers and gradient reduction are priced (``core.sim.costs.dp_comm_s``); None leaves them
    out, as scenarios written before this field were."""


class ResourcesSpec(_Frozen):
    """Who gets which GPUs. `sync` mode colocates: every GPU generates, then every GPU trains.
    Read by: every runtime (on a machine without GPUs a real run counts CPU cores instead)."""

    rollout_gpus: int = Field(64, ge=1, le=MAX_DEVICES)
    """GPUs serving rollout in async, partial and inflight modes (verl table: 64 of 128)."""
    trainer_gpus: int = Field(64, ge=1, le=MAX_DEVICES)
    """GPUs training in async, partial and inflight modes (verl table: 64 of 128)."""
    gpus_per_engine: int = Field(1, ge=1, le=MAX_DEVICES)
    """Tensor-parallel size of one rollout engine; a 7B model fits one H20 (96 GB)."""


class WorkloadSpec(_Frozen):
    """Prompts and the response-length distribution (lognormal, clipped). Read by: every runtime
    for group_size and max_response_len; the lengths themselves by the sim only (real engines
    generate until <eos> or the cap)."""

    group_size: int = Field(16, ge=1, le=MAX_SAMPLES)
    """Responses per prompt, the GRPO group n (verl DAPO recipe: rollout.n 16)."""
    prompt_tokens: int = Field(512, ge=1, le=MAX_TOKENS)
    """Prompt length in tokens, chat template included (DAPO-Math prompts are a few hundred tokens)."""
    response_median: int = Field(1200, ge=1, le=MAX_TOKENS)
    """Median response length in tokens before clipping (assumed: early DAPO-Math training on a 7B model)."""
    response_sigma: float = Field(1.0, ge=0)
    """Lognormal sigma of response length; 1.0 puts p99 near 10x the median, the long tail."""
    prompt_share: float = Field(0.5, ge=0, le=1)
    """Share of the log-length variance that belongs to the prompt (hard prompts make every response long)."""
    max_response_len: int = Field(28672, ge=1, le=MAX_TOKENS)
    """Hard cap on response tokens (verl fully-async table: max_response_length 28K)."""
    lengths: Optional[str] = None
    """A file of response lengths the sim draws from instead of the lognormal: a JSON/YAML list
    (e.g. a real run's, written by harness.calibrate), a {length: count} histogram or
    {edges, counts}; relative to the working directory. Drawn through the same normal per
    response as the lognormal, so prompt_share still correlates a group. None: the lognormal."""
    length_drift: tuple[tuple[float, float], ...] = ()
    """Response lengths over training, as ``[[step, factor], ...]``: a group trained at ``step``
    has its lengths (median and tail alike) multiplied by the factor, linear between points and
    flat beyond the ends; e.g. ``[[0, 1.0], [400, 2.5]]`` for a run whose mean response grows
    2.5x over 400 steps (DAPO, verl's DAPO recipes report growth of that order). The step of a
    group is the one its prompt is planned for (its position in the prompt order over
    ``trainer.batch_size``), so every mode sees the same lengths. Sim only. Empty: no drift."""
    pass_rate_alpha: float = Field(1.0, gt=0, le=1000)
    """Each prompt's pass rate (the chance that one response earns reward 1) is Beta(alpha,
    beta); 1 and 1 make it uniform. Read by the sim alone: its modelled 0/1 rewards, which a
    filter judges and a prioritized replay ranks. A lower alpha models a harder prompt set
    (more all-wrong groups), a lower beta an easier one (more all-right groups)."""
    pass_rate_beta: float = Field(1.0, gt=0, le=1000)
    """The beta of each prompt's Beta(alpha, beta) pass rate (see pass_rate_alpha)."""

    @model_validator(mode="after")
    def _drift(self) -> "WorkloadSpec":
        steps = [p[0] for p in self.length_drift]
        for i, (step, factor) in enumerate(self.length_drift):
            if not (step >= 0 and factor > 0 and math.isfinite(step) and math.isfinite(factor)):
                raise ConfigError(f"workload.length_drift.{i}", [step, factor], "needs a step >= 0 and a factor > 0",
                                  "write [step, factor], e.g. [[0, 1.0], [400, 2.0]]")
        if steps != sorted(set(steps)):
            raise ConfigError("workload.length_drift", [list(p) for p in self.length_drift], "its steps do not rise",
                              "list the points in order of step, each step once")
        return self

    @model_validator(mode="after")
    def _lengths_file(self) -> "WorkloadSpec":
        if self.lengths is not None:
            try:
                read_lengths(self.lengths)
            except LengthFileError as exc:
                raise ConfigError("workload.lengths", self.lengths, str(exc), "give a JSON/YAML list of lengths, a {length: count} histogram or {edges, counts}") from None
        return self


class RolloutSpec(_Frozen):
    """The rollout engines: a continuous-batching decode model. Read by: every runtime for
    max_num_seqs and max_concurrency; the cost terms by the sim only."""

    max_num_seqs: int = Field(256, ge=1, le=MAX_SAMPLES)
    """Sequences one engine decodes at once (vLLM default max_num_seqs: 256)."""
    max_concurrency: Optional[int] = Field(None, ge=1, le=MAX_SAMPLES)
    """Generations in flight across all engines; None means engines x max_num_seqs, at least one group."""
    decode_overhead_s: float = Field(0.002, ge=0)
    """Fixed cost of one decode step: scheduling, sampling, launches (assumed, vLLM V1 with CUDA graphs)."""
    decode_mfu: float = Field(0.5, gt=0, le=1)
    """Fraction of BF16 peak reached by decode GEMMs once compute-bound (assumed)."""
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    """Fraction of BF16 peak reached by prefill, including re-prefill of resumed partial responses (assumed)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of each GPU's memory an engine takes for weights, activations and KV cache (vLLM
    default gpu_memory_utilization: 0.9)."""
    activation_reserve_gb: float = Field(1.0, ge=0)
    """Memory per GPU an engine keeps for activations and workspace, not for KV cache (assumed:
    ~1 GB, what vLLM's profiling run finds for a 7B model at its default batched-token limit)."""
    allreduce_latency_s: float = Field(1e-5, ge=0)
    """Fixed cost of one tensor-parallel all-reduce, two per layer per decode step when
    resources.gpus_per_engine > 1 (assumed: ~10 us, a small NCCL or vLLM custom all-reduce on NVLink)."""
    expert_parallel: int = Field(1, ge=1, le=MAX_DEVICES)
    """GPUs an engine spreads a mixture of experts' experts over instead of splitting each expert
    (vLLM's --enable-expert-parallel: the engine's tensor-parallel GPUs). 1, or
    resources.gpus_per_engine: each MoE layer then trades its tensor-parallel all-reduce for an
    all-to-all that sends each token to its experts' GPUs and back (core/sim/costs.py)."""
    enforce_eager: bool = False
    """vLLM's ``enforce_eager``, common in RL launch scripts: decode steps launch each layer's
    kernels from the host (``eager_layer_s``) instead of replaying captured CUDA graphs (vLLM's
    default, False)."""
    eager_layer_s: float = Field(EAGER_LAYER.value, ge=0)
    """Without CUDA graphs: host seconds to launch one dense layer's kernels in a decode step
    (core/model/measurements.py EAGER_LAYER)."""
    eager_moe_layer_s: float = Field(EAGER_MOE_LAYER.value, ge=0)
    """Without CUDA graphs: host seconds a mixture-of-experts layer adds to ``eager_layer_s``
    (router top-k, token permutation, the fused-MoE launch and its gather; core/model/measurements.py
    EAGER_MOE_LAYER)."""
    overprovision: float = Field(1.0, ge=1, le=4)
    """Samples in flight beyond what the staleness budget admits, as a factor of one sync
    window (APRIL, arXiv 2509.18521): 1.25 admits a quarter window more. Once every sample the
    budget admits at this version is done, what still generates is cut: resumed after the next
    sync in partial and inflight mode (holding tokens of an older policy), dropped in sync and
    async mode (``samples/dropped_overprovision_cut``). 1: off."""


class FilterSpec(_Frozen):
    """Dynamic sampling (DAPO, arXiv 2503.14476): a scored group that carries no learning signal
    is dropped (``samples/dropped_filter_<reason>``), and rollout samples on until every trainer
    batch is full. Read by the Rollouter on every runtime; the sim scores groups with the
    workload's modelled 0/1 rewards (``workload.pass_rate_alpha``)."""

    zero_variance: bool = True
    """Drop a group whose rewards are all equal: every GRPO advantage in it is 0 (reason ``no_variance``)."""
    min_reward_std: float = Field(0.0, ge=0)
    """Drop a group whose rewards' standard deviation is not above this (reason
    ``low_variance``): with a graded reward, responses that differ by a hair get advantages
    of full size once divided by their tiny std, which is noise. 0: off."""
    min_mean_reward: Optional[float] = None
    """Drop a group whose mean reward is below this: too hard to learn from yet (reason
    ``below_band``). None: no floor."""
    max_mean_reward: Optional[float] = None
    """Drop a group whose mean reward is above this: already solved (reason ``above_band``). None: no ceiling."""
    min_pass_rate: float = Field(0.25, gt=0, le=1)
    """The lowest share of samples admission expects the filter to pass. Apart from sync mode,
    admission counts a group not yet scored at the pass rate measured so far, never below this,
    so that enough generates to fill batches; at most 1 / min_pass_rate times what the
    staleness budget counts is in flight. Survivors beyond the budget are evicted as stale,
    never trained. 1: count every unscored group whole (no over-sampling ahead of scores)."""
    starve_batches: int = Field(20, ge=1, le=MAX_STEPS)
    """The run fails with one error line once the filter has dropped this many trainer
    batches' worth of groups in a row and passed none (DAPO's max_num_gen_batches): a policy
    that earns no reward at all, or a band no group falls in, would otherwise sample forever."""

    @model_validator(mode="after")
    def _filters_something(self) -> "FilterSpec":
        lo, hi = self.min_mean_reward, self.max_mean_reward
        if not self.zero_variance and lo is None and hi is None and not self.min_reward_std:
            raise ConfigError("filter.zero_variance", False, "with no reward band or min_reward_std the filter drops nothing",
                              "set zero_variance: true, min_reward_std, or a band (min_mean_reward / max_mean_reward), or remove filter")
        if lo is not None and hi is not None and lo >= hi:
            raise ConfigError("filter.min_mean_reward", lo, f"is not below filter.max_mean_reward = {hi}: every group is dropped",
                              f"use a floor below {hi}")
        return self


LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of every decoder layer of a model with a gated MLP (Llama, Qwen2, Mistral;
the tiny model is a Qwen2): the names the sim knows the shapes of, and the default targets."""
_LORA_NOT_TARGETS = frozenset({"embed_tokens", "lm_head"})  # an embedding and a head that may be tied to it


class LoraSpec(_Frozen):
    """A LoRA adapter (peft's ``LoraConfig``): the trainer trains it with the base weights frozen,
    and a weight sync moves only its tensors. Read by: the local and ray runtimes (trainer, torch
    engine, evaluators); the sim for the bytes of a sync (core/sim/costs.py)."""

    rank: int = Field(8, ge=1, le=MAX_DIM)
    """r: each targeted weight W (out x in) is trained as W0 + (alpha / r) B A, with A (r x in)
    drawn at random and B (out x r) zero at the start, so the first rollout is the base model's.
    A sync moves r (in + out) numbers per targeted matrix per layer."""
    alpha: float = Field(16.0, gt=0)
    """Scale of the update: B A is multiplied by alpha / r (peft's lora_alpha; 2 r is the common choice)."""
    targets: tuple[str, ...] = LORA_TARGETS
    """Leaf names of the linear layers adapted in every decoder layer (peft's target_modules).
    Default: all seven of a gated-MLP decoder, attention and MLP. The sim and the tiny model know
    those seven; a ``model.path`` must have a linear layer of each name."""

    @field_validator("targets")
    @classmethod
    def _targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise refused("names no layer to adapt", f"list one or more of {', '.join(LORA_TARGETS)}")
        if len(set(value)) != len(value):
            raise refused("names a layer twice", "list each target once")
        bad = [t for t in value if t in _LORA_NOT_TARGETS or not t.isidentifier()]
        if bad:
            raise refused(f"{bad[0]!r} is not a linear layer of a decoder layer (an adapter on the embedding or the head is not supported)",
                          f"list linear layers only, such as {', '.join(LORA_TARGETS)}")
        return value


class TrainerSpec(_Frozen):
    """The trainer: GRPO steps on whole groups. Read by: every runtime for batch_size, sync_every
    and steps; the cost terms by the sim only."""

    batch_size: int = Field(512, ge=1, le=MAX_SAMPLES)
    """Samples per trainer step, whole groups (32 prompts x 16, verl ppo_mini_batch_size 32)."""
    sync_every: int = Field(4, ge=1, le=MAX_STEPS)
    """Trainer steps per weight sync, i.e. per version (verl trigger_parameter_sync_step 4)."""
    steps: int = Field(1000, ge=1, le=MAX_STEPS)
    """Trainer steps in the run."""
    mfu: float = Field(0.4, gt=0, le=1)
    """Model FLOPs utilization of training (Llama 3 paper: 38-43 % BF16 MFU on H100 at scale)."""
    step_overhead_s: float = Field(1.0, ge=0)
    """Fixed cost per step: optimizer update and gradient reduction of a sharded 7B model (assumed)."""
    recompute_logprobs: tuple[Mode, ...] = ()
    """Modes whose trainer recomputes behaviour log-probs in an extra forward pass (verl colocate: old_log_prob)."""
    colocated_mfu: Optional[float] = Field(None, gt=0, le=1)
    """MFU of the trainer when it shares its GPUs with the engines (sync mode); None: trainer.mfu.
    verl's published 16:16 phase times put its colocated trainer at 2.3x fewer samples per
    GPU-second than its separated one (docs/results/2026-11-30-published-predictions.md)."""
    minibatch_size: Optional[int] = Field(None, ge=1, le=MAX_SAMPLES)
    """Samples per optimizer step (verl: ppo_mini_batch_size x rollout.n); a trainer step of
    ``batch_size`` samples takes batch_size / minibatch_size of them, each gathering the sharded
    weights and reducing the gradients once (priced only with ``gpu.interconnect_gb_s``). None:
    one optimizer step per trainer step."""
    grad_reduce_bytes: int = Field(4, ge=1, le=8)
    """Bytes per gradient element in the data-parallel reduction (verl FSDP mixed precision:
    reduce_dtype float32)."""
    activation_recompute: bool = False
    """Gradient checkpointing: the backward recomputes the forward, 4 forward passes per sample
    instead of 3 (verl DAPO recipes: enable_gradient_checkpointing True; AReaL: gradient_checkpointing
    true). False keeps scenarios written before this field as they were."""
    expert_parallel: int = Field(1, ge=1, le=MAX_DEVICES)
    """Trainer GPUs each set of a mixture of experts' experts is spread over (Megatron's EP): every
    MoE layer sends each token to its experts' GPUs and back, forward and backward, over NVLink
    within a node and ``gpu.interconnect_gb_s`` beyond (core/sim/costs.py). It must divide the
    trainer's GPUs (sync: all of them). 1: experts data-parallel like every other weight."""
    micro_batch_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    """Tokens one GPU trains in one micro-batch (verl: ppo_max_token_len_per_gpu with dynamic
    batch size; Megatron: micro_batch_size x sequence length). Given, a sharded trainer gathers
    the weights and reduce-scatters the gradients once per micro-batch, overlapped with that
    micro-batch's compute: a GPU with few tokens waits on the network, which is why a fixed
    global batch on more GPUs trains fewer tokens per GPU-second. In colocated sync it is also
    capped by the memory the engines keep. None: collectives once per optimizer step, not
    overlapped, as scenarios written before this field were priced."""
    micro_batch_half_tokens: float = Field(MICRO_BATCH_HALF_TOKENS.value, gt=0)
    """Tokens per GPU micro-batch at which training reaches half of ``mfu`` (core/model/measurements.py
    MICRO_BATCH_HALF_TOKENS); read only with ``micro_batch_tokens``."""
    weights_sharded: bool = True
    """With ``micro_batch_tokens``: the weights are sharded over the data-parallel GPUs (FSDP,
    ZeRO-3), gathered for every micro-batch's forward and backward, gradients reduce-scattered
    after each. False: each GPU holds the weights (DDP; Megatron's distributed optimizer, ZeRO-1):
    gradients are reduced and updated weights gathered once per optimizer step, behind the last
    micro-batch's backward."""
    reference: bool = False
    """A reference policy's forward pass over every trained sample (a KL penalty or KL loss;
    verl use_kl_loss or use_kl_in_reward): one more forward per sample, and in colocated sync the
    reference weights moved to the host and back at each switch (verl offloads them). DAPO-style
    recipes drop it."""
    optimizer_sharded: bool = True
    """Adam's state is sharded over the data-parallel GPUs (FSDP, ZeRO-1 and up): each GPU updates
    its 1 / GPUs of the parameters. False: every GPU updates all of them (plain DDP)."""
    lora: Optional[LoraSpec] = None
    """Train a LoRA adapter instead of the whole model, and sync only the adapter (e.g.
    ``lora: {rank: 8}``; docs/real-runtimes.md). The torch trainer trains it through peft; the
    torch engine and the evaluators apply it to their own copy of the base weights; the sim prices
    a sync at the adapter's bytes. None: full fine-tuning, every weight synced."""


class StalenessSpec(_Frozen):
    """How stale a trained sample may be, and how far rollout may run ahead. Read by: every runtime."""

    max_staleness: int = Field(1, ge=0, le=MAX_STEPS)
    """Hard bound: no sample is trained on weights more than this many versions newer than its first token."""
    admission_lead: Optional[float] = Field(None, ge=0)
    """Sync windows the rollout may run ahead of training; None means max_staleness (verl staleness_threshold)."""


class SyncSpec(_Frozen):
    """Weight transfer from trainer to rollout engines. Read by: the sim runtime for the costs
    (a real run measures its transfers); the LLM ray runtime for ``transport`` and ``bucket_mb``."""

    transport: Literal["broadcast", "object_store"] = "broadcast"
    """LLM ray runtime: how weights reach the engines. `broadcast`: a collective broadcast from the
    trainer into every engine's parameters (the device's collectives), bucket by bucket, in the
    engines' dtype (core/real/weight_broadcast.py); an engine back from a restart, which cannot
    join a broadcast alone, loads one copy through the object store and rejoins the group at the
    next sync. `object_store`: fp32 copies put in Ray's object store once per version, which every
    engine resolves (the seeds' ray.put pattern). The env ray runtime always uses the object store.
    The sim prices either (core/sim/costs.py TransferCost)."""
    bucket_mb: float = Field(64.0, gt=0, le=MAX_GB * 1024)
    """`broadcast`: the most MiB one bucket holds (a tensor larger goes alone): the extra memory a
    sync needs on each side. 64 is meant for GPUs (not measured); on CPU 4-16 were
    faster than 64 (docs/results/2026-12-02-broadcast-sync.md)."""

    bandwidth_gb_s: float = Field(25.0, gt=0)
    """Trainer-to-rollout bandwidth in GB/s across nodes (one 200 Gb/s RDMA NIC per GPU)."""
    bucket_overhead_s: float = Field(COLLECTIVE_CALL.value, ge=0)
    """`broadcast`, sim only: fixed cost of each collective call, one per bucket (per tensor when
    not ``bucketed``): its launch from Python and NCCL's latency (core/model/measurements.py
    COLLECTIVE_CALL). The real runtime measures its own."""
    object_store_gb_s: float = Field(0.9, gt=0)
    """`object_store`, sim only: GB/s of float32 weights through that path, put once and then
    resolved, written to a file and reloaded by every engine at once. 0.9: its stages in series
    as measured on a 2-core CPU machine (fp32 copy 3.8, put 10.5, file 2.1, vLLM reload 3.8 GB/s;
    issue 16)."""
    latency_s: float = Field(SYNC_LATENCY.value, ge=0)
    """Fixed cost of one transfer besides its bytes and tensors (core/model/measurements.py
    SYNC_LATENCY; it was an assumed 0.5 s)."""
    bucketed: bool = True
    """`broadcast`: tensors are packed into buckets of ``bucket_mb``, one collective each
    (asyncrl, slime, NeMo-RL). False: one collective per tensor (verl's fully-async NCCL sync),
    which pays ``bucket_overhead_s`` per tensor: tens of thousands of calls for a mixture of experts."""
    per_tensor_s: float = Field(PER_TENSOR.value, ge=0)
    """`broadcast`, sim only: host seconds per tensor at a sync, bucketed or not: the sender's
    name lookup and full-tensor gather call, the receiver's load_weights match and copy launch
    (core/model/measurements.py PER_TENSOR)."""
    senders: int = Field(1, ge=1, le=MAX_DEVICES)
    """Trainer ranks that send weights at once, each a share of the tensors over its own NIC
    (1: rank 0 broadcasts everything, verl; more: each rank sends its shard, as slime's and
    checkpoint-engine's transfers do). More than the receivers gain nothing."""
    kv_rebuild_s: float = Field(KV_REBUILD.value, ge=0)
    """Colocated sync only: seconds per switch for an engine to release its KV cache for the
    trainer and allocate it again after (vLLM sleep / wake_up; core/model/measurements.py
    KV_REBUILD)."""
    colocated_bandwidth_gb_s: float = Field(400.0, gt=0)
    """Bandwidth of the in-node reshard in colocated sync mode (NVLink, H20: 900 GB/s peak)."""
    colocated_switch_s: Optional[float] = Field(None, ge=0)
    """Colocated mode only: time to swap between engine and trainer memory each sync. None
    computes it: each GPU moves its share of the trainer state (sync.trainer_state_bytes_per_param)
    and its engine's weights to the host and back at sync.offload_gb_s. A number overrides that
    (before this was computed it was a flat 3 s, assumed)."""
    offload_gb_s: float = Field(HOST_COPY_GB_S.value, gt=0)
    """Host-device bandwidth per GPU in GB/s for the colocated switch (core/model/measurements.py
    HOST_COPY_GB_S: eight GPUs sharing a host's memory)."""
    engine_sleeps: bool = True
    """Colocated sync only: engines release their weights and KV cache while the trainer runs
    (vLLM sleep mode, verl free_cache_engine), keeping only ``rollout.activation_reserve_gb``.
    False: they keep ``rollout.gpu_memory_utilization`` of each GPU, which caps the trainer's
    micro-batches (``trainer.micro_batch_tokens``) and moves no engine weights at a switch."""
    trainer_state_bytes_per_param: float = Field(14.0, ge=0)
    """Trainer bytes per parameter moved aside at a colocated switch: bf16 weights 2 + fp32
    master weights 4 + Adam moments 8 (ZeRO paper's mixed-precision Adam, gradients freed)."""


# A group's priority is its rewards' spread, held to [MIN_PRIORITY, MAX_PRIORITY] (a reward may be
# any finite float: a spread of 1e300 raised to alpha would overflow the replay's sum tree).
MIN_PRIORITY = 1e-3  # PER's epsilon: a group with no learning signal is still drawn now and then
MAX_PRIORITY = 1e6
MAX_REPLAY_ALPHA = 50.0
"""The LLM replay's largest priority exponent: 1e6 ** 50 = 1e300 stays under the limit the replay
takes at its most groups (1.8e308 / 2**25 = 5.4e300), and 1e-3 ** 50 = 1e-150 above zero. At 1e6
a run ended mid-way (0.43 ** 1e6 is 0). Past a few, sampling takes nearly only the top group."""


class ReplaySpec(_Frozen):
    """An optional replay buffer (ext.replay) between the queue and the trainer, for off-policy reuse.

    Fresh groups from the queue go into a ring of ``capacity_groups``; every trainer batch is
    drawn from the ring, so a group is trained about ``reuse`` times before it is overwritten.
    Reuse trades staleness for rollout: trained samples may then be older than
    ``staleness.max_staleness`` by the versions a group can live in the ring, and the report
    states that bound (``staleness/bound``). Read by: every runtime.
    """

    enabled: bool = False
    """Put the replay buffer in the pipeline; off, the trainer takes fresh groups from the queue."""
    capacity_groups: int = Field(256, ge=1, le=MAX_SAMPLES)
    """Groups the ring holds; the oldest is overwritten when a new one arrives."""
    reuse: float = Field(2.0, ge=1)
    """Trained samples per fresh sample: each step takes ceil(batch groups / reuse) fresh groups from the queue."""
    prioritized: bool = False
    """Sample by priority (sum-tree, stratified) instead of uniformly."""
    alpha: float = Field(0.6, ge=0, le=MAX_REPLAY_ALPHA)
    """Priority exponent: P(i) ~ p_i^alpha (Schaul et al. 2016, proportional PER: 0.6), at most ``MAX_REPLAY_ALPHA``."""
    beta: float = Field(0.4, ge=0, le=1)
    """Importance-weight exponent (Schaul et al. 2016: 0.4, annealed towards 1 in their runs)."""


class TinyModelSpec(_Frozen):
    """The tiny random-weight Qwen2 model that the real runtimes train and serve unless ``model.path``
    names one (core/real/tiny_model.py). Read by: the local and ray runtimes."""

    path: str = "models/tiny-qwen2"
    """Model directory, relative to the working directory; built on first use if missing, and
    rebuilt when asyncrl built it for another spec. A directory there that asyncrl did not
    build is refused, never written into: a model of your own goes in ``model.path``."""
    seed: int = Field(0, ge=0, le=MAX_INT)
    """Seeds the random weights and the tokenizer's training text."""
    layers: int = Field(2, ge=1, le=MAX_DIM)
    """Transformer layers."""
    heads: int = Field(4, ge=1, le=MAX_DIM)
    """Attention heads; hidden size is heads x head_dim."""
    kv_heads: int = Field(2, ge=1, le=MAX_DIM)
    """Key/value heads (grouped-query attention, as in Qwen2)."""
    head_dim: int = Field(32, ge=32, le=MAX_DIM)
    """Head dimension; vLLM's CPU attention needs 32 or more."""
    intermediate: int = Field(256, ge=1, le=MAX_DIM)
    """MLP width."""
    max_positions: int = Field(512, ge=16, le=MAX_TOKENS)
    """Longest prompt + response the model takes."""
    tool_tokens: bool = False
    """The tokenizer has ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
    ``</tool_response>`` as tokens of their own (docs/agents.md), as a chat model's has: agent
    episodes need ``</tool_call>`` as one token to end a turn. Changes the vocabulary, so the
    weights too."""
    vocabulary: Literal["letters", "arithmetic"] = "letters"
    """`letters`: words of the letters task, split at spaces. `arithmetic`: the calculator task's
    (``task.kind: arithmetic``): one token per digit and operator, the tool tags and the
    calculator call's JSON around its expression, decoded by joining tokens without spaces."""
    warm_start_steps: int = Field(0, ge=0, le=100_000)
    """`arithmetic`: supervised steps on demonstrations of the calculator task (a call with the
    prompt's expression, then its answer copied) after the random initialisation, as agent
    recipes start from a model that has seen the tool's format; 0: none. Deterministic in
    ``seed``; demonstrations come from a stream apart from the training and held-out prompts."""


class TaskSpec(_Frozen):
    """The verifiable task of the real runtimes (core/real/task.py): repeat letters of the prompt, then stop.
    Read by: the local and ray runtimes."""

    kind: Literal["letters", "arithmetic"] = "letters"
    """`letters`: repeat letters of the prompt, then stop. `arithmetic`: a product of two
    ``digits``-digit numbers (``37*48=``), which the model gets right by calling the calculator
    and copying its answer (reward 1; 0.25 for a correct call whose answer it did not copy;
    needs ``tiny_model.vocabulary: arithmetic`` and the calculator among ``tools``)."""
    digits: int = Field(2, ge=1, le=6)
    """`arithmetic`: digits of each operand."""

    alphabet: int = Field(8, ge=1, le=26)
    """Prompts draw their letters from the first this many of a-z; the tokenizer knows all 26 (the rest are distractors)."""
    min_letters: int = Field(2, ge=1, le=26)
    """Fewest distinct letters in a prompt."""
    max_letters: int = Field(6, ge=1, le=26)
    """Most distinct letters in a prompt."""
    length_per_letter: int = Field(2, ge=1, le=MAX_TOKENS)
    """Full reward needs at least length_per_letter x k**2 response words before <eos> (k: the prompt's letters)."""
    truncated_reward: float = Field(0.0, ge=0, le=1)
    """Share of its reward a response keeps when it runs into the cap without <eos>. 0: it scores 0, a cliff
    the stop decision learns from; above 0, a soft penalty in the manner of DAPO's overlong reward shaping."""
    overshoot: float = Field(0.0, ge=0)
    """Past the length target the length factor is (target / n) ** overshoot. 0: longer costs nothing until
    the cap; above 0 the reward peaks at the target, so the stop decision has a pull from both sides."""
    target_reward: float = Field(0.3, gt=0, le=1)
    """The reward a run is timed to reach unless `learn.target_reward` says otherwise: an untrained tiny
    model scores about 0.08 here, and a run of 40 sync steps ends near 0.4 (docs/results)."""
    prompts: Optional[str] = None
    """A file of prompts and answers to train on instead of the letters task: JSON Lines of
    {"prompt": str, "answer": str}, or parquet with those columns (core/model/prompt_file.py),
    relative to the working directory. Prompts are taken in an order shuffled per pass by
    the seed; the reward is ``reward.fn``, else 1 for a response that equals the answer
    (whitespace stripped) and 0 otherwise. None: the letters task."""
    eval_prompts: Optional[str] = None
    """Held-out prompts for ``eval`` when ``task.prompts`` is set, in the same format. None:
    the letters task's own held-out stream (with ``task.prompts``, no evaluation)."""
    prompt_truncation: Literal["error", "left", "right"] = "error"
    """What becomes of a prompt of ``prompts`` or ``eval_prompts`` longer than the model's
    positions less ``workload.max_response_len`` (<bos> included): `error` refuses the scenario
    before anything runs, naming the file and the line; `left` cuts tokens off its beginning,
    keeping its end; `right` cuts them off its end, keeping its beginning (verl's
    data.truncation). A run that cuts any says how many in a warning as it starts."""

    @model_validator(mode="after")
    def _prompt_files(self) -> "TaskSpec":
        for key in ("prompts", "eval_prompts"):
            path = getattr(self, key)
            if path is not None:
                try:
                    read_prompts(path)
                except PromptFileError as exc:
                    fix = exc.fix or 'give a .jsonl file of {"prompt": ..., "answer": ...} lines, or a .parquet file with those columns'
                    raise ConfigError(f"task.{key}", path, str(exc), fix) from None
        if self.eval_prompts is not None and self.prompts is None:
            raise ConfigError("task.eval_prompts", self.eval_prompts, "held-out prompts of a task.prompts file, and there is none",
                              "set task.prompts too, or remove task.eval_prompts")
        return self


class EngineSpec(_Frozen):
    """What generates: the simulated engine, a torch model, or vLLM. Read by: every runtime for
    kind; the rest by the local and ray runtimes."""

    kind: Literal["sim", "torch", "vllm"] = "sim"
    """`sim` on the sim runtime; `torch` or `vllm` on the local and ray runtimes."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of rollout (1.0: the behaviour policy is the policy itself)."""
    vllm_kv_cache_gb: int = Field(1, ge=1, le=MAX_GB)
    """vLLM on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM on GPU: fraction of device memory the engine may take."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = "auto"
    """The engines' parameter dtype, which the weights are sent in. `auto`: the model's own (its
    config.json's torch_dtype; the tiny model is saved as float32). The trainer keeps float32.
    `fp8` (the sim only): FP8 rollout with the trainer in the model's dtype, as verl and slime
    run it. The engines hold and read one byte per weight (the KV cache stays in the model's
    dtype), their GEMMs run at ``gpu.fp8_tflops``, and every sync moves the model's dtype and
    quantizes on arrival (core/sim/costs.py, ``quantize_s``)."""


class LearnSpec(_Frozen):
    """The torch GRPO trainer of the real runtimes. Read by: the local and ray runtimes."""

    lr: float = Field(1e-3, gt=0)
    """Adam learning rate. 1e-3: on the tiny task sync learns as fast in wall time as at 3e-3 and ends
    higher, and the policy moves a third as far per version, so stale data swings it less (docs/results)."""
    is_cap: float = Field(2.0, ge=1)
    """C of the corrections: the cap of an importance weight to the behaviour policy (tis, decoupled, seq_tis truncate
    at it; icepop masks tokens outside [1/C, C]; seq_mis rejects responses above it)."""
    correction: Correction = "decoupled"
    """Off-policy correction for samples generated by older weights, each loss written out with its
    source in core/real/corrections.py: `bypass` PPO clipped against the behaviour log-probs, no
    importance weight; `tis` token-level truncated importance sampling on the policy gradient;
    `decoupled` decoupled PPO (clip to a recomputed proximal policy, weight to the behaviour
    truncated at `is_cap`); `icepop` the same with tokens whose weight leaves [1/cap, cap] masked;
    `seq_tis` / `seq_mis` one weight per response, the product of its tokens', truncated at the cap
    / the response rejected above it; `m2po` no clip, but drops the tokens whose weight is furthest
    off until the mean squared log weight of the rest is at most `learn.m2_threshold`."""

    @field_validator("correction", mode="before")
    @classmethod
    def _renamed(cls, value: object) -> object:
        if isinstance(value, str) and value in RENAMED_CORRECTIONS:
            new = RENAMED_CORRECTIONS[value]
            raise refused(f"renamed {new!r} (the same loss, under the name users know it by)", f"write {new!r}")
        return value
    m2_threshold: float = Field(0.04, gt=0)
    """`m2po`: the bound on the mean of (log pi_prox / pi_behaviour)^2 over a minibatch's kept tokens (0.04, the paper's)."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO clip range of the ratio (to the proximal policy; to the behaviour policy with `none`)."""
    minibatches: int = Field(4, ge=1, le=MAX_SAMPLES)
    """Optimizer updates per trainer step, each on a slice of whole groups (4: measured on the tiny task,
    reward doubles in ~80 steps of 8 groups where 1 update per step stays flat at any stable lr)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    target_reward: Optional[float] = Field(None, gt=0)
    """Reward whose reach times a run (learn/time_to_target_s): the trailing mean batch reward over
    `learn.reward_window` steps. None: the task's own, `task.target_reward`."""
    reward_window: int = Field(5, ge=1, le=MAX_STEPS)
    """Trainer steps the batch reward is averaged over before it is compared with the target."""
    sharding: Literal["none", "ddp", "fsdp2"] = "ddp"
    """How the trainer's ranks (`ray.trainer_ranks`) hold the model, on any device. `ddp`: every
    rank a whole replica, gradients summed by one all-reduce per bucket (one rank: no process
    group at all, the plain single trainer). `fsdp2`: torch's `fully_shard` per decoder layer and
    the root over a mesh of the ranks (one rank too): each holds a shard of every parameter and
    of Adam's state, checkpoints are sharded (torch.distributed.checkpoint, safetensors), and a
    weight sync gathers one tensor at a time. `none`: one rank, no process group (refused with
    more). The device module (core/real/device.py) picks the collective backend."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the trainer computes in. Master weights and Adam's moments stay float32 either
    way: `bfloat16` casts the parameters for the forward and backward (fsdp2: its
    MixedPrecisionPolicy; ddp and none: autocast), as GPU users train."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype gradients are summed across ranks in (verl's FSDP default: float32). `bfloat16`
    halves the reduction's bytes and rounds every rank's gradient to 8 bits of mantissa first."""

    @property
    def recomputes_prox(self) -> bool:
        """The correction needs the proximal policy's log-probs: one no-grad forward per step."""
        return self.correction in RECOMPUTES_PROX


class RewardSpec(_Frozen):
    """How rewards are computed, and where. Read by: the local and ray runtimes (fn); the ray runtime (Serve)."""

    serve: bool = False
    """Ray runtime: score through a Ray Serve deployment instead of in the Rollouter's process."""
    replicas: int = Field(1, ge=1, le=MAX_DEVICES)
    """Replicas of the Serve deployment."""
    fn: Optional[str] = None
    """Your reward, ``module:function``, called as fn(prompt=, response=, answer=, finished=)
    and returning a float (core/model/reward_fn.py); imported before the run, and by name in
    every process that scores (the Serve replicas too). None: the task's own reward."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Longest a call of ``fn``, or its import, may take. A call that does not return in time
    ends the run (or is skipped, with ``on_error: skip``); an import is refused. 30 s: far above a
    verifier's milliseconds, below what a user waits before thinking the run hung."""
    on_error: Literal["fail", "skip"] = "fail"
    """What a call of ``fn`` that raises, exits, times out or returns anything but a finite number
    does: ``fail`` ends the run in one line naming the function and the sample; ``skip`` drops
    that sample's group (GRPO's advantage is relative within the group), counted in the ledger
    as ``samples/dropped_reward_error``, and the run goes on, unless more than half of at
    least 16 calls failed (core/real/task.py): then it ends as with ``fail``, since dropping
    nearly every group would leave the trainer waiting for ever."""

    @model_validator(mode="after")
    def _importable(self) -> "RewardSpec":
        if self.fn is not None:
            try:
                load_reward_fn(self.fn, self.timeout_s)
            except UserCodeError as exc:
                raise ConfigError("reward.fn", self.fn, exc.problem, exc.fix) from None
        return self


class ToolSpec(_Frozen):
    """One tool. The model calls it as ``{"name": name, "arguments": {...}}`` (docs/agents.md)."""

    name: str
    """What the model calls it by: letters, digits and _, not starting with a digit."""
    fn: Optional[str] = None
    """Your function, ``module:function``, sync or ``async``, called with the call's arguments as
    keywords and returning text. None: the built-in tool ``name`` (calculator, lookup)."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Longest one call may take; a call that does not return in time is answered with an error
    and the episode goes on. 10 s: above a sandboxed code run, below a stalled connection's."""
    data: Optional[str] = None
    """The built-in ``lookup``'s table: a JSONL file of ``{"key": ..., "value": ...}`` lines."""

    @model_validator(mode="after")
    def _checked(self) -> "ToolSpec":
        if not TOOL_NAME.fullmatch(self.name):
            raise ConfigError("tools.name", self.name, "not a tool name", "use letters, digits and _, not starting with a digit")
        if self.fn is None:
            if self.name not in BUILTIN_TOOLS:
                raise ConfigError("tools.name", self.name, "no built-in tool of that name and no fn",
                                  f"name a built-in ({', '.join(BUILTIN_TOOLS)}) or give fn: module:function")
            if self.name == "lookup":
                if self.data is None:
                    raise ConfigError("tools.data", self.data, "the lookup tool needs its table", "give data: a JSONL file of key/value lines")
                try:
                    read_lookup(self.data)
                except LookupFileError as exc:
                    raise ConfigError("tools.data", self.data, exc.problem, exc.fix) from None
        else:
            try:
                check_tool_fn(self.fn, self.timeout_s)
            except UserCodeError as exc:
                raise ConfigError("tools.fn", self.fn, exc.problem, exc.fix) from None
        return self


class SpreadSpec(_Frozen):
    """A quantity drawn afresh for each event: lognormal around ``median`` with log-spread
    ``sigma`` (0: always the median), clipped to [``low``, ``high``]."""

    median: float = Field(0.0, ge=0)
    """The typical value."""
    sigma: float = Field(0.0, ge=0, le=10)
    """Standard deviation of its logarithm: 0.5 puts two thirds of draws within 0.6x to 1.65x the median."""
    low: float = Field(0.0, ge=0)
    """The least a draw may be."""
    high: Optional[float] = Field(None, ge=0)
    """The most a draw may be; None: no ceiling."""

    def draw(self, rng, n: int):
        """``n`` draws (a numpy array) from ``rng``, a ``numpy.random.Generator``."""
        import numpy as np  # config is read where numpy is not otherwise needed

        draws = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return np.clip(draws, self.low, np.inf if self.high is None else self.high)

    @model_validator(mode="after")
    def _ordered(self) -> "SpreadSpec":
        if self.high is not None and self.high < self.low:
            raise refused(f"high = {self.high:g} is below low = {self.low:g}", f"make high at least {self.low:g}")
        return self


class AgentSpec(_Frozen):
    """Episodes of many turns in which the model calls ``tools`` (docs/agents.md). Set, or
    ``tools`` given, the Rollouter runs each sample as an episode; absent, one completion.
    Read by: every runtime (the sim draws turns, answers and tool latency from it)."""

    max_turns: int = Field(8, ge=1, le=MAX_STEPS)
    """Model turns per episode: a turn whose calls would lead to one more ends the episode
    (reason ``max_turns``). 8: above the 2 to 8 turns of the tool tasks users train. The sim
    draws each episode's turns uniformly from ``min_turns`` to this."""
    min_turns: int = Field(1, ge=1, le=MAX_STEPS)
    """Sim: the fewest model turns an episode has (each turn but the last ends in a tool call)."""
    max_tool_calls: int = Field(16, ge=0, le=MAX_STEPS)
    """Tool calls per episode: a turn whose calls would pass it ends the episode unanswered
    (reason ``max_tool_calls``)."""
    max_episode_tokens: Optional[int] = Field(None, ge=2, le=MAX_TOKENS)
    """Prompt, model turns and tool answers together: the context. A turn stops at it, and
    answers that would fill it end the episode (reason ``max_episode_tokens``). None: the
    model's positions (real runtimes), unbounded but by ``workload.max_response_len`` (sim)."""
    tool_delay_s: SpreadSpec = SpreadSpec()
    """How long a tool call takes beyond the tool's own time: drawn per call, slept before its
    answer (real runtimes: a stand-in for a sandbox's or a search engine's latency); the whole
    of a call's time in the sim."""
    observation_tokens: SpreadSpec = SpreadSpec(median=64.0, sigma=0.5, low=1.0)
    """Sim: the tokens of a tool's answer (64: a short JSON or a few lines of a program's output)."""
    release_kv_during_tools: bool = False
    """While an episode's tool runs its engine frees the episode's KV cache, and prefills the
    whole context again for the next turn; false: the KV stays held (taking cache room that
    other requests could use), and the next turn prefills only the tool's answer."""

    @model_validator(mode="after")
    def _turns(self) -> "AgentSpec":
        if self.min_turns > self.max_turns:
            raise ConfigError("agent.min_turns", self.min_turns, f"is above agent.max_turns = {self.max_turns}", f"use at most {self.max_turns}")
        return self


class EvalSpec(_Frozen):
    """Evaluation of the current policy on held-out prompts, beside training. Read by: the local and
    ray runtimes."""

    every: int = Field(0, ge=0, le=MAX_STEPS)
    """Evaluate every this many versions; 0 turns evaluation off."""
    prompts: int = Field(32, ge=1, le=MAX_SAMPLES)
    """Held-out prompts per evaluation, split among the workers."""
    workers: int = Field(2, ge=1, le=MAX_DEVICES)
    """Parallel evaluators (Ray remote functions on the ray runtime)."""
    timeout_s: float = Field(30.0, gt=0)
    """How long the driver waits, once training ended, for evaluations still running; later ones are reported missing."""
    num_cpus: float = Field(0.0, ge=0)
    """CPUs each Ray evaluator reserves; 0 lets them run beside a placement group that holds every core."""


class RoleSpec(_Frozen):
    """Ray resources of one role's actors."""

    num_cpus: float = Field(1.0, ge=0)
    """CPUs each actor reserves."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs each actor reserves."""
    max_concurrency: int = Field(64, ge=1, le=MAX_SAMPLES)
    """Calls an actor runs at once (async actors interleave them on one loop)."""


class RaySpec(_Frozen):
    """The ray runtime: where the cluster is and what each role reserves. Read by: the ray runtime only."""

    address: Optional[str] = None
    """Join this cluster (e.g. `ray://head:10001` or `auto`); None starts a local instance and stops it after the run."""
    num_cpus: Optional[int] = Field(None, ge=1, le=MAX_DEVICES)
    """CPUs of the local instance; None gives it every core of the machine."""
    rollout: RoleSpec = RoleSpec(num_cpus=1.0, max_concurrency=256)
    """Each rollout engine actor; on CPU one engine is one core."""
    trainer: RoleSpec = RoleSpec(num_cpus=1.0, max_concurrency=8)
    """Each trainer rank's actor."""
    trainer_ranks: int = Field(1, ge=1, le=MAX_DEVICES)
    """Data-parallel trainer ranks, one actor each in one torch process group: each trains whole
    groups of every minibatch, gradients summed across ranks, so the update is one rank's on
    the whole batch; `learn.sharding` says whether each holds a replica or a shard. Rank 0
    drives the step, checkpoints and is the weight-sync source. Each rank gets
    ``resources.trainer_gpus`` / ranks devices (on CPU, torch threads), so that must divide evenly."""
    controller: RoleSpec = RoleSpec(num_cpus=0.0, max_concurrency=256)
    """The Rollouter actor: scheduling only, no model."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the placement group lays the rollout and trainer bundles on nodes."""
    poll_s: float = Field(1.0, gt=0)
    """Timeout of each ray.wait of the driver, between which it reports progress."""
    ship_model: bool = False
    """Send the model directory through the object store, once, to the nodes that do not see
    its path; each such node keeps one copy in a directory asyncrl stamps. For models that fit
    the object store; larger ones belong on storage every node mounts at the same path."""


class FaultSpec(_Frozen):
    """One injected fault, at a time or after a trainer step (exactly one of the two).

    ``kill`` ends a component's process: a rollout worker (engine), the queue (on ray, the
    rollout actor that holds it: the run goes back to its last whole checkpoint), or the
    trainer; or, on the ray runtime, a whole node (``node_of`` names it by what runs there), as
    a preempted host goes: every actor on it dies at once and Ray restarts them elsewhere;
    ``slow`` makes a rollout worker ``factor`` times slower for ``duration_s``;
    ``hang`` makes the worker's next ``call`` never answer, until its timeout gives up on it.
    Read by: operations, on the sim and ray runtimes.
    """

    kind: Literal["kill", "slow", "hang"]
    """What happens: kill, slow or hang."""
    target: Literal["rollout_worker", "queue", "trainer", "node"] = "rollout_worker"
    """Which component: kill takes any (``node``: the ray runtime's node that ``node_of`` names); slow and hang act on a rollout worker."""
    worker: int = Field(0, ge=0, le=MAX_DEVICES)
    """Which rollout worker (engine index, from 0)."""
    node_of: Literal["rollout_worker", "trainer"] = "rollout_worker"
    """target node: the node that runs this component (rollout worker ``worker``, or the trainer's rank 0) when the fault fires."""
    at_s: Optional[float] = Field(None, ge=0)
    """When, in seconds from the start of the run (simulated seconds on the sim runtime)."""
    at_step: Optional[int] = Field(None, ge=1, le=MAX_STEPS)
    """When: as soon as the trainer has finished this step."""
    factor: float = Field(4.0, ge=1)
    """slow: how many times longer every decode step and prefill takes."""
    duration_s: float = Field(60.0, gt=0)
    """slow: how long the slowdown lasts."""
    call: Literal["generate", "update_weights", "abort_all"] = "generate"
    """hang: the engine call that never answers."""


class TimeoutsSpec(_Frozen):
    """How long a caller waits on another component before it gives up on it. A call that
    times out raises an error naming the component and the call, and the component is
    restarted as if it had died. Read by: operations on every runtime."""

    generate_s: float = Field(3600.0, gt=0)
    """One engine's generation of one group (the long tail of a 28K-token response at a few
    ms per step is minutes; an hour means it hangs)."""
    control_s: float = Field(300.0, gt=0)
    """Every other call between components: abort, weight loading, queue and trainer control."""
    restart_s: float = Field(900.0, gt=0)
    """How long a restarted worker may take to be back (vLLM start-up of a large model)."""


class RecoverySpec(_Frozen):
    """What a restart costs and how many a component gets. Read by: operations on every runtime
    (max_restarts); the *_restart_s costs by the sim only (a real restart takes what it takes)."""

    max_restarts: int = Field(3, ge=0, le=MAX_STEPS)
    """Restarts each worker, the queue and the trainer get (Ray max_restarts); one more death fails the run."""
    engine_restart_s: float = Field(60.0, ge=0)
    """Sim: seconds a killed rollout worker takes to be back (process and engine start-up, weights load; assumed)."""
    trainer_restart_s: float = Field(120.0, ge=0)
    """Sim: seconds a killed trainer takes to be back and load its checkpoint (assumed)."""
    queue_restart_s: float = Field(5.0, ge=0)
    """Sim: seconds a killed queue takes to be back and replay its journal (assumed)."""


class CheckpointSpec(_Frozen):
    """Checkpoints of the whole run, taken at a weight sync, while rollout is paused. Read by:
    operations on every runtime (whole-run resume on sim and local; trainer restarts on ray)."""

    every: int = Field(0, ge=0, le=MAX_STEPS)
    """Checkpoint every this many versions; 0 turns checkpoints off (a trainer kill needs them)."""
    keep: int = Field(2, ge=1, le=MAX_STEPS)
    """Checkpoints kept per mode; older ones are deleted once a newer one is complete."""

    def due(self, version: int) -> bool:
        """Whether the sync to ``version`` takes a checkpoint."""
        return bool(self.every) and version % self.every == 0


Logger = Literal["tensorboard", "wandb", "mlflow"]


class LoggersSpec(_Frozen):
    """Where a run's live figures go as it runs. Read by: the harness."""

    loggers: tuple[Logger, ...] = ("tensorboard",)
    """Loggers fed each mode's figures as they happen, besides ``<mode>/metrics.jsonl`` (always
    written): ``tensorboard``, event files in each mode's directory (``tensorboard --logdir RUN``);
    ``wandb``, a W&B run per mode (``WANDB_MODE=offline`` keeps it on disk, in ``RUN/wandb``);
    ``mlflow``, an MLflow run per mode (in ``RUN/mlruns`` unless ``MLFLOW_TRACKING_URI`` says where).
    W&B and MLflow are imported only when listed, and must then be installed (``pip install wandb``,
    ``pip install mlflow-skinny``). Empty: metrics.jsonl alone."""

    @model_validator(mode="after")
    def _each_once(self) -> "LoggersSpec":
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError("report.loggers", list(self.loggers), "a logger is listed twice", "list each logger once")
        return self


class ReportSpec(LoggersSpec):
    """What a run writes besides report.json. Read by: the harness."""

    timeline: bool = True
    """Write timeline.png, one row per worker."""
    timeline_rows: int = Field(32, ge=1, le=MAX_DEVICES)
    """Rollout rows drawn at most; larger fleets show an evenly spaced subset."""


class CalibratedSpec(_Frozen):
    """Cost coefficients measured on a real run (written by ``python -m harness.calibrate``);
    when set they replace the roofline terms of the sim's cost model (core/sim/costs.py).
    Read by: the sim runtime only."""

    source: str = ""
    """Where the coefficients were fitted from (run directory and mode)."""
    decode_overhead_s: float = Field(ge=0)
    """Seconds of one engine step whatever its batch (fitted)."""
    decode_per_seq_s: float = Field(ge=0)
    """Seconds per running sequence in one engine step (fitted)."""
    decode_kv_s_per_token: float = Field(ge=0)
    """Seconds per context token held by the running batch, per engine step (fitted)."""
    prefill_s_per_token: float = Field(ge=0)
    """Seconds per prefilled token (fitted)."""
    train_overhead_s: float = Field(ge=0)
    """Seconds of one trainer step whatever its batch, on ``train_devices`` devices (fitted)."""
    train_s_per_token: float = Field(ge=0)
    """Trainer seconds per trained token (prompt + response) on ``train_devices`` devices (fitted)."""
    train_s_per_token_sq: float = Field(ge=0)
    """Trainer seconds per squared sequence length (attention) on ``train_devices`` devices (fitted)."""
    train_devices: int = Field(ge=1, le=MAX_DEVICES)
    """Devices the trainer ran on where it was measured."""
    train_speedup: dict[int, float] = {}
    """Measured speed of the trainer's step on n devices relative to ``train_devices`` ({n: speed});
    a device count not listed scales linearly (the roofline's assumption)."""
    transfer_s: float = Field(ge=0)
    """Seconds from rollout paused to resumed at a weight sync (measured mean)."""
    decode_placement: Literal["colocated", "separated"] = "colocated"
    """Where the engine costs above were measured: the fitted mode's placement (sync: colocated;
    async and partial: separated). Engines of that placement cost what was fitted."""
    decode_error: float = Field(0.0, ge=0, le=10)
    """Relative root-mean-square error of the engine-step fit (its residuals over the mean step):
    the band draws the decode coefficients within twice it (core/sim/band.py). 0: not drawn."""
    train_error: float = Field(0.0, ge=0, le=10)
    """Relative root-mean-square error of the trainer-step fit, as ``decode_error``."""
    transfer_error: float = Field(0.0, ge=0, le=10)
    """Relative spread (standard deviation over mean) of the measured syncs, as ``decode_error``."""
    separated_decode_speedup: float = Field(1.0, gt=0)
    """How much faster an engine steps in the separated placement (one engine next to a trainer)
    than in the colocated one (the engines side by side in one process), measured on the
    machine by harness/probes.py; engines of the placement not fitted have their costs scaled
    by it. 1: the same."""


MAX_BAND_POINTS = 1000


class BandSpec(_Frozen):
    """The error band of a sim prediction (``python -m harness.run --band``; core/sim/band.py).
    Read by: the harness, on the sim runtime."""

    points: int = Field(16, ge=4, le=MAX_BAND_POINTS)
    """Scenarios drawn over a Latin hypercube of the uncertain inputs' ranges, each run in every
    mode: the band costs this many runs."""
    ranges: dict[str, tuple[float, float]] = {}
    """``{dotted.key: [low, high]}``: a range for an input, replacing the default one
    (core/sim/band.py lists them with their sources) or adding one; a number field of the
    scenario, both ends above 0."""

    @field_validator("ranges")
    @classmethod
    def _ranges(cls, ranges: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        for key, (low, high) in ranges.items():
            if not (0 < low <= high and math.isfinite(high)):
                raise ConfigError(f"band.ranges.{key}", [low, high], "is not a range of figures above 0",
                                  "write [low, high] with 0 < low <= high")
        return ranges


class Scenario(_Frozen):
    """One workload on one set of resources, run in one or more modes with one seed."""

    name: RunName = "scenario"
    """A label for reports and the default run directory: letters, digits, '-', '_' and '.'."""
    seed: int = Field(0, ge=0, le=MAX_INT)
    """Seeds the workload; every mode sees the same prompts and lengths."""
    seeds: tuple[int, ...] = Field((), max_length=MAX_SEEDS)
    """Run every mode once per seed and report mean and spread; empty: `seed` alone."""
    modes: tuple[Mode, ...] = ("sync", "async", "partial", "inflight")
    """Modes to run, each on the same workload: sync, async, partial, inflight (docs/modes.md)."""
    runtime: Literal["sim", "local", "ray"] = "sim"
    """Where components run: `sim` one process on a virtual clock; `local` one process on the
    real clock with real engines; `ray` every component a Ray actor. On the real runtimes a
    device of `resources` is a GPU when the roles reserve GPUs, else one CPU core."""
    # What every runtime reads.
    resources: ResourcesSpec = ResourcesSpec()
    """The GPU split."""
    workload: WorkloadSpec = WorkloadSpec()
    """Prompts and response lengths."""
    rollout: RolloutSpec = RolloutSpec()
    """The rollout engines."""
    trainer: TrainerSpec = TrainerSpec()
    """The trainer."""
    staleness: StalenessSpec = StalenessSpec()
    """The staleness budget."""
    replay: ReplaySpec = ReplaySpec()
    """The optional replay stage between queue and trainer."""
    filter: Optional[FilterSpec] = None
    """Dynamic sampling: drop scored groups without learning signal, sample on to fill batches. None: off."""
    # What only the sim runtime reads: the cost model.
    model: ModelSpec = ModelSpec()
    """The policy model."""
    gpu: GpuSpec = GpuSpec()
    """The accelerator."""
    sync: SyncSpec = SyncSpec()
    """Weight sync costs."""
    calibrated: Optional[CalibratedSpec] = None
    """Measured cost coefficients that replace the roofline terms (harness.calibrate); None: the roofline."""
    # What only the real runtimes (local, ray) read.
    engine: EngineSpec = EngineSpec()
    """The rollout engine."""
    tiny_model: TinyModelSpec = TinyModelSpec()
    """The model of the real runtimes."""
    task: TaskSpec = TaskSpec()
    """The task of the real runtimes."""
    learn: LearnSpec = LearnSpec()
    """The torch trainer of the real runtimes."""
    eval: EvalSpec = EvalSpec()
    """Held-out evaluation (real runtimes)."""
    # What only the ray runtime reads.
    ray: RaySpec = RaySpec()
    """The ray runtime."""
    reward: RewardSpec = RewardSpec()
    """Reward computation (real runtimes)."""
    agent: Optional[AgentSpec] = None
    """Agent episodes with tool calls (real runtimes); None: one completion per sample, unless ``tools`` are given."""
    tools: tuple[ToolSpec, ...] = Field((), max_length=MAX_TOOLS)
    """The tools an agent calls; given, the Rollouter runs agent episodes (``agent``'s limits, its defaults if unset)."""

    @field_validator("tools", mode="before")
    @classmethod
    def _few_enough_tools(cls, value: object) -> object:
        """The count first: each tool imports a module or reads a table when it is checked."""
        if isinstance(value, (list, tuple)) and len(value) > MAX_TOOLS:
            raise refused(f"{len(value)} tools, more than {MAX_TOOLS}", f"give at most {MAX_TOOLS} tools")
        return value
    # Operations: faults, timeouts, restarts and checkpoints.
    faults: tuple[FaultSpec, ...] = ()
    """Faults to inject (sim and ray runtimes)."""
    timeouts: TimeoutsSpec = TimeoutsSpec()
    """How long calls between components may take."""
    recovery: RecoverySpec = RecoverySpec()
    """Restarts of failed components."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Checkpoints of the run, for restarts and ``--resume``."""
    # What the harness writes.
    report: ReportSpec = ReportSpec()
    """Report extras."""
    band: BandSpec = BandSpec()
    """The error band's points and ranges (``--band``)."""

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        n = self.workload.group_size
        bs = self.trainer.batch_size
        check_runs(self.modes, self.seeds, MODES)
        if bs % n:
            fix = f"use a multiple of workload.group_size = {n}, such as {max(n, round(bs / n) * n)}"
            raise ConfigError("trainer.batch_size", bs, "must hold whole groups", fix)
        r = self.resources
        if r.rollout_gpus % r.gpus_per_engine:
            raise ConfigError(
                "resources.rollout_gpus", r.rollout_gpus,
                f"does not divide into engines of resources.gpus_per_engine = {r.gpus_per_engine}",
                f"use a multiple of {r.gpus_per_engine}",
            )
        if (r.rollout_gpus + r.trainer_gpus) % r.gpus_per_engine:
            raise ConfigError(
                "resources.trainer_gpus", r.trainer_gpus,
                "sync mode colocates all GPUs, which must divide into engines of resources.gpus_per_engine",
                f"make rollout_gpus + trainer_gpus a multiple of {r.gpus_per_engine}",
            )
        mb = self.trainer.minibatch_size
        if mb is not None and (mb > bs or bs % mb):
            k = next((k for k in range(max(1, bs // mb), bs // mb + 1000) if bs % k == 0), 1)
            raise ConfigError("trainer.minibatch_size", mb, f"does not divide trainer.batch_size = {bs} into optimizer steps",
                              f"use a divisor of {bs}, such as {bs // k}")
        mc = self.rollout.max_concurrency
        if mc is not None and mc < n:
            raise ConfigError("rollout.max_concurrency", mc, "cannot hold one group", f"use at least workload.group_size = {n}")
        lead = self.staleness.admission_lead
        if lead is not None and lead > self.staleness.max_staleness:
            raise ConfigError(
                "staleness.admission_lead", lead,
                f"runs further ahead than staleness.max_staleness = {self.staleness.max_staleness} lets anything be trained",
                f"use at most {self.staleness.max_staleness}, or raise staleness.max_staleness",
            )
        kind = self.engine.kind
        if self.engine.dtype == "fp8" and kind != "sim":
            raise ConfigError("engine.dtype", "fp8", f"FP8 rollout is modelled by the sim; the {kind} engine does not quantize",
                              "use bfloat16 (or auto) on real engines")
        if (self.runtime == "sim") != (kind == "sim"):
            fix = "use engine.kind: sim" if self.runtime == "sim" else "use engine.kind: torch or vllm"
            raise ConfigError("engine.kind", kind, f"does not run on runtime {self.runtime}", fix)
        if self.task.min_letters > self.task.max_letters:
            raise ConfigError("task.min_letters", self.task.min_letters, "is above task.max_letters", f"use at most {self.task.max_letters}")
        if self.task.max_letters > self.task.alphabet:
            raise ConfigError(
                "task.max_letters", self.task.max_letters, f"a prompt's letters are distinct, and task.alphabet has {self.task.alphabet}",
                f"use at most {self.task.alphabet}, or raise task.alphabet",
            )
        if self.runtime != "sim":
            self._check_real_model()
        if self.reward.serve and self.runtime != "ray":
            raise ConfigError("reward.serve", True, f"Ray Serve needs runtime ray, not {self.runtime}", "set runtime: ray, or reward.serve: false")
        rp = self.replay
        if rp.enabled and rp.capacity_groups < bs // n:
            raise ConfigError(
                "replay.capacity_groups", rp.capacity_groups, f"cannot hold one trainer batch of {bs // n} groups",
                f"use at least trainer.batch_size / workload.group_size = {bs // n}",
            )
        self._check_trainer_ranks()
        self._check_sharding()
        self._check_lora()
        self._check_faults()
        self._check_kv_fits()
        self._check_expert_parallel()
        self._check_agent()
        self._check_band()
        if self.filter is not None and self.filter.zero_variance and n == 1:
            raise ConfigError("filter.zero_variance", True, "a group of one response never has reward variance: every group would be dropped",
                              "raise workload.group_size, or set filter.zero_variance: false and use a reward band")
        return self

    def _check_band(self) -> None:
        for key in self.band.ranges:
            obj: object = self
            for part in key.split("."):
                fields = type(obj).model_fields if isinstance(obj, BaseModel) else {}
                if part not in fields:
                    raise ConfigError(f"band.ranges.{key}", list(self.band.ranges[key]), "names no key of the scenario",
                                      "name a number field, e.g. trainer.mfu or workload.response_median")
                obj = getattr(obj, part)
            if isinstance(obj, bool) or not isinstance(obj, (int, float)):
                raise ConfigError(f"band.ranges.{key}", list(self.band.ranges[key]), f"is not a number field (it holds {shown(obj)})",
                                  "name a number field, e.g. trainer.mfu or workload.response_median")

    @property
    def episodes(self) -> Optional[AgentSpec]:
        """The limits of agent episodes, or None where each sample is one completion."""
        return self.agent if self.agent is not None else (AgentSpec() if self.tools else None)

    def _check_agent(self) -> None:
        if self.agent is not None and not self.tools and self.runtime != "sim":
            raise ConfigError("tools", [], "agent episodes call tools, and none is given", "list tools, e.g. tools: [{name: calculator}]")
        names = [t.name for t in self.tools]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError("tools.name", name, "names two tools", "give each tool a name of its own")
        tm = self.tiny_model
        if self.task.kind == "arithmetic" and self.runtime != "sim":
            if self.model.path is None and tm.vocabulary != "arithmetic":
                raise ConfigError("tiny_model.vocabulary", tm.vocabulary, "the arithmetic task's digits and calls need the arithmetic vocabulary",
                                  "set tiny_model.vocabulary: arithmetic")
            # A user's function may stand in as the calculator (one that logs or counts its calls).
            if not any(t.name == "calculator" for t in self.tools):
                raise ConfigError("tools", [t.name for t in self.tools], "the arithmetic task is solved with the calculator, and it is not among the tools",
                                  "add {name: calculator} to tools")
        if self.episodes is not None and self.eval.every:
            raise ConfigError("eval.every", self.eval.every, "held-out evaluation runs single completions, not agent episodes",
                              "set eval.every: 0 (the training reward is the agent's measure for now)")
        if tm.warm_start_steps and tm.vocabulary != "arithmetic":
            raise ConfigError("tiny_model.warm_start_steps", tm.warm_start_steps, "warm starts demonstrate the arithmetic task",
                              "set tiny_model.vocabulary: arithmetic, or warm_start_steps: 0")
        if self.episodes is not None and self.runtime != "sim" and self.model.path is None and not tm.tool_tokens and tm.vocabulary == "letters":
            raise ConfigError("tiny_model.tool_tokens", False, "agent episodes end a model turn at </tool_call>, one token, and "
                              "the tiny model's tokenizer has none", "set tiny_model.tool_tokens: true")
        if self.tools and self.runtime == "sim":
            raise ConfigError("tools", [t.name for t in self.tools], "the sim runtime models tool calls by agent.tool_delay_s and "
                              "agent.observation_tokens, and runs no tool", "remove tools, or use runtime: local or ray")

    def _check_trainer_ranks(self) -> None:
        """Ranks exist on the ray runtime only, and each gets whole devices."""
        ranks = self.ray.trainer_ranks
        if ranks == 1:
            return
        if self.runtime != "ray":
            raise ConfigError("ray.trainer_ranks", ranks, f"trainer ranks are actors of the ray runtime, not of {self.runtime}",
                              "set runtime: ray, or ray.trainer_ranks: 1")
        r = self.resources
        if r.trainer_gpus % ranks:
            raise ConfigError("ray.trainer_ranks", ranks, f"does not divide resources.trainer_gpus = {r.trainer_gpus} into whole devices per rank",
                              f"use a divisor of {r.trainer_gpus}, or make resources.trainer_gpus a multiple of {ranks}")
        if "sync" in self.modes:
            engines = Placement.of(self, "sync").engines
            if ranks > engines:
                raise ConfigError("ray.trainer_ranks", ranks, f"sync colocates each rank with an engine, and it has {engines}",
                                  f"use at most {engines}, or leave sync out of modes")

    def _check_expert_parallel(self) -> None:
        r, m = self.resources, self.model
        for key, ep in (("rollout.expert_parallel", self.rollout.expert_parallel), ("trainer.expert_parallel", self.trainer.expert_parallel)):
            if ep > 1 and m.experts == 1:
                raise ConfigError(key, ep, "spreads experts, and model.experts is 1 (a dense model)", "set it to 1, or describe the model's experts")
            if ep > m.experts:
                raise ConfigError(key, ep, f"is more than model.experts = {m.experts}: a GPU would hold no expert", f"use at most {m.experts}")
        ep = self.rollout.expert_parallel
        if ep not in (1, r.gpus_per_engine):
            raise ConfigError("rollout.expert_parallel", ep, f"an engine spreads its experts over all its GPUs or none (resources.gpus_per_engine = {r.gpus_per_engine})",
                              f"use 1 or {r.gpus_per_engine}")
        ep = self.trainer.expert_parallel
        trains = [("sync", r.rollout_gpus + r.trainer_gpus)] if "sync" in self.modes else []
        if any(mode != "sync" for mode in self.modes):
            trains.append(("async", r.trainer_gpus))
        for mode, gpus in trains:
            if gpus % ep:
                raise ConfigError("trainer.expert_parallel", ep, f"does not divide the {gpus} GPUs that train in {mode} mode",
                                  f"use a divisor of {gpus}")
        if ep > self.gpu.gpus_per_node and self.gpu.interconnect_gb_s is None:
            raise ConfigError("trainer.expert_parallel", ep, f"spans nodes of gpu.gpus_per_node = {self.gpu.gpus_per_node}, and gpu.interconnect_gb_s "
                              "is not given to price the all-to-all between them", "set gpu.interconnect_gb_s, or keep the experts within a node")

    def _check_sharding(self) -> None:
        ranks, sharding = self.ray.trainer_ranks, self.learn.sharding
        if sharding == "none" and ranks > 1:
            raise ConfigError("learn.sharding", sharding, f"one trainer holds the whole model, and ray.trainer_ranks = {ranks}",
                              "use learn.sharding: ddp or fsdp2, or ray.trainer_ranks: 1")
        if sharding == "fsdp2" and self.runtime == "local" and self.engine.kind == "vllm":
            raise ConfigError("learn.sharding", sharding, "an fsdp2 trainer's process group and vLLM's own would share the local runtime's one process",
                              "use engine.kind: torch, runtime: ray, or learn.sharding: ddp")
        if sharding == "fsdp2" and ranks > 1:
            groups = self.trainer.batch_size // self.workload.group_size
            per_mb = groups // max(1, min(self.learn.minibatches, groups))
            if per_mb < ranks:
                raise ConfigError("learn.sharding", sharding, f"every fsdp2 rank takes part in every minibatch's forward, and a minibatch "
                                  f"of {per_mb} groups leaves one of {ranks} ranks without a group",
                                  "use fewer learn.minibatches or ray.trainer_ranks, or a larger trainer.batch_size")

    def _check_lora(self) -> None:
        """An adapter every part of the run can train, send and apply: each target a linear
        layer of the model (the sim and the tiny model know the seven of a gated-MLP decoder),
        and an engine that applies it."""
        lora = self.trainer.lora
        if lora is None:
            return
        if self.engine.kind == "vllm":
            raise ConfigError("engine.kind", "vllm", "the vLLM engine takes no LoRA adapter from a weight sync, and trainer.lora is set "
                              "(vLLM 0.32 loads adapters from a directory per request; docs/real-runtimes.md)",
                              "use engine.kind: torch, or remove trainer.lora")
        if self.runtime != "sim" and self.model.path is not None:
            known = linear_layers(self.model.path) - _LORA_NOT_TARGETS
            where = f"model.path {self.model.path}"
        else:
            known = set(LORA_TARGETS)
            where = "the sim's model figures" if self.runtime == "sim" else "the tiny model (a Qwen2)"
        missing = [t for t in lora.targets if t not in known]
        if missing:
            raise ConfigError("trainer.lora.targets", list(lora.targets), f"{missing[0]!r} names no linear layer of {where}",
                              f"list only layers it has: {', '.join(sorted(known)) or 'none found'}")

    def _check_real_model(self) -> None:
        """The model a real run loads is there, its tokenizer loads, and it takes the longest
        sequence, a prompts file's counted with that tokenizer; the tiny model is built only
        where asyncrl may write."""
        m, t, w = self.model, self.task, self.workload
        counter = None
        if m.path is not None:
            try:
                check_loadable(m.path)
                # What loading it would raise at run time, in one line now.
                counter = read_tokenizer(m.path, plain=is_owned(Path(m.path), TINY_MODEL_KIND))
            except ModelDirError as exc:
                raise ConfigError("model.path", m.path, str(exc), "give a directory as save_pretrained writes it (safetensors weights and tokenizer)") from None
            except UserCodeError as exc:
                raise ConfigError("model.path", m.path, exc.problem, exc.fix) from None
            limit, key, raise_it = m.max_positions, "model.max_positions", ""
        else:
            _check_tiny_model_dir(self.tiny_model.path)
            limit, key, raise_it = self.tiny_model.max_positions, "tiny_model.max_positions", ", or raise tiny_model.max_positions"
        # A file's prompts are measured when they are tokenized; here they count one token.
        prompt = 1 if t.prompts is not None else 1 + t.max_letters + 2
        need = prompt + w.max_response_len
        if limit is not None and need > limit:
            raise ConfigError(
                "workload.max_response_len", w.max_response_len, f"prompt + response can reach {need} tokens, beyond {key} = {limit}",
                f"use at most {limit - prompt}{raise_it}",
            )
        if t.prompts is not None and t.eval_prompts is None and self.eval.every:
            raise ConfigError("eval.every", self.eval.every, "with task.prompts, held-out prompts come from task.eval_prompts, and none is given",
                              "set task.eval_prompts to a file of held-out prompts, or eval.every: 0")
        if counter is not None:
            self.check_prompt_lengths(counter)

    def check_prompt_lengths(self, counter) -> None:
        """Every prompt of ``task.prompts`` and ``task.eval_prompts``, counted by ``counter`` (the
        run's tokenizer, ``model_dir.read_tokenizer``), fits beside a response: ``ConfigError``
        naming the file and line of the first that does not, unless ``task.prompt_truncation``
        cuts them. A ``model.path``'s are counted with the scenario; the tiny model's as it is
        built (core/real/hf_model.py ``ensure_model_dir``)."""
        t, w = self.task, self.workload
        if t.prompt_truncation != "error":
            return
        limit, key = (self.model.max_positions, "model.max_positions") if self.model.path is not None else (
            self.tiny_model.max_positions, "tiny_model.max_positions")
        room = self.real_max_positions - w.max_response_len
        context = f"{key} = {limit}" if limit is not None else f"workload.prompt_tokens + workload.max_response_len = {self.real_max_positions}"
        for name in ("prompts", "eval_prompts"):
            file = getattr(t, name)
            if file is None:
                continue
            rows = read_prompts(file)
            try:
                counts = counter.counts([r.prompt for r in rows])
            except UserCodeError as exc:
                raise ConfigError("model.path", self.real_model_path, exc.problem, exc.fix) from None
            for row, n in zip(rows, counts):
                if n > room:
                    raise ConfigError(
                        f"task.{name}", file, f"the prompt of {row.where} is {n} tokens, more than the {room} that {context} leaves "
                        f"beside workload.max_response_len = {w.max_response_len}",
                        "shorten or drop it, lower workload.max_response_len, or set task.prompt_truncation: left (keeps its end) "
                        "or right (keeps its beginning)",
                    )

    def _check_kv_fits(self) -> None:
        """vLLM refuses to start an engine that cannot hold its weights plus one sequence of
        the longest context, or whose model takes no sequence that long; so does the sim."""
        if self.runtime != "sim":
            return
        r, g = self.resources, self.gpu
        need = self.workload.prompt_tokens + self.workload.max_response_len
        cap = kv_capacity_tokens(self, r.gpus_per_engine)
        limit = self.model.max_positions
        if cap > 0 and limit is not None and need > limit:
            room = limit - self.workload.prompt_tokens
            raise ConfigError("workload.max_response_len", self.workload.max_response_len,
                              f"workload.prompt_tokens + workload.max_response_len = {need:,} is beyond model.max_positions = {limit:,}",
                              f"use at most {room}" if room > 0 else f"lower workload.prompt_tokens below {limit}, and the response length with it")
        if cap >= need:
            return
        engine_gb = r.gpus_per_engine * g.memory_gb * self.rollout.gpu_memory_utilization
        weights_gb = self.model.params_b * self.model.dtype_bytes
        reserve_gb = r.gpus_per_engine * self.rollout.activation_reserve_gb
        numbers = (f"an engine of {r.gpus_per_engine} GPU(s) has {engine_gb:.1f} GB (gpu.memory_gb {g.memory_gb:g} x "
                   f"rollout.gpu_memory_utilization {self.rollout.gpu_memory_utilization:g}); weights take {weights_gb:.1f} GB "
                   f"and the activation reserve {reserve_gb:.1f} GB, leaving KV for {max(cap, 0):,.0f} tokens, "
                   f"less than one sequence of workload.prompt_tokens + workload.max_response_len = {need:,}")
        if cap <= 0:
            raise ConfigError("resources.gpus_per_engine", r.gpus_per_engine, numbers,
                              "raise resources.gpus_per_engine (tensor parallelism), gpu.memory_gb or rollout.gpu_memory_utilization, "
                              "or simulate a smaller model")
        raise ConfigError("workload.max_response_len", self.workload.max_response_len, numbers,
                          f"use at most {int(cap) - self.workload.prompt_tokens}, or raise resources.gpus_per_engine, "
                          "gpu.memory_gb or rollout.gpu_memory_utilization")

    def _check_faults(self) -> None:
        if self.checkpoint.every and self.replay.enabled:
            raise ConfigError(
                "checkpoint.every", self.checkpoint.every, "the replay ring is not checkpointed",
                "set checkpoint.every: 0, or replay.enabled: false",
            )
        if self.faults and self.runtime == "local":
            raise ConfigError("faults", "[...]", "faults are injected on the sim and ray runtimes", "set runtime: sim or ray, or remove faults")
        if self.faults and self.replay.enabled:
            raise ConfigError("faults", "[...]", "recovery needs checkpoints, and the replay ring is not checkpointed", "set replay.enabled: false")
        engines = min(Placement.of(self, m).engines for m in self.modes)
        for i, f in enumerate(self.faults):
            key = f"faults.{i}"
            if (f.at_s is None) == (f.at_step is None):
                raise ConfigError(key, f.model_dump(exclude_defaults=True), "needs exactly one of at_s and at_step", f"add {key}.at_s or {key}.at_step")
            if f.at_step is not None and f.at_step >= self.trainer.steps:
                raise ConfigError(f"{key}.at_step", f.at_step, f"the run ends at trainer.steps = {self.trainer.steps}", f"use at most {self.trainer.steps - 1}")
            if f.kind != "kill" and f.target != "rollout_worker":
                raise ConfigError(f"{key}.target", f.target, f"a {f.kind} fault acts on a rollout worker", "set target: rollout_worker")
            if f.target == "node" and self.runtime != "ray":
                raise ConfigError(
                    f"{key}.target", "node", f"a node is a host of a Ray cluster; the {self.runtime} runtime has one process",
                    "set runtime: ray, or target a rollout_worker or the trainer",
                )
            if (f.target == "rollout_worker" or (f.target == "node" and f.node_of == "rollout_worker")) and f.worker >= engines:
                raise ConfigError(f"{key}.worker", f.worker, f"there are {engines} rollout workers in the smallest mode", f"use 0 to {engines - 1}")
            if f.kind == "kill" and f.target in ("trainer", "node") and not self.checkpoint.every:
                what = "the trainer" if f.target == "trainer" else "a node, which may run the trainer"
                raise ConfigError(
                    "checkpoint.every", 0, f"{key} kills {what}, which restarts from its last checkpoint",
                    "set checkpoint.every: 1 (a checkpoint at every weight sync)",
                )
            if f.kind == "kill" and f.target == "queue" and self.runtime == "ray" and not self.checkpoint.every:
                raise ConfigError(
                    "checkpoint.every", 0, f"{key} kills the rollout actor (the queue's process on ray), and the run goes back "
                    "to its last whole checkpoint", "set checkpoint.every: 1 (a checkpoint at every weight sync)",
                )
        self._check_restarts()

    def _check_restarts(self) -> None:
        """Each kill of a worker or of the trainer costs it a restart (a queue's are not counted,
        except on ray, where it is the rollout actor's); more kills of one than
        ``recovery.max_restarts`` make the run's failure certain."""
        kills: dict[str, int] = {}
        for f in self.faults:
            if f.kind == "kill" and (f.target != "queue" or self.runtime == "ray"):
                on = f.node_of if f.target == "node" else f.target
                name = {"rollout_worker": f"rollout worker {f.worker}", "trainer": "the trainer", "queue": "the rollout actor"}[on]
                kills[name] = kills.get(name, 0) + 1
        most = max(kills.items(), key=lambda kv: kv[1], default=None)
        if most is not None and most[1] > self.recovery.max_restarts:
            name, n = most
            raise ConfigError(
                "recovery.max_restarts", self.recovery.max_restarts,
                f"{n} fault{'s kill' if n > 1 else ' kills'} {name}, so the run would end in RestartsExhausted", f"use at least {n}, or fewer kills",
            )

    def with_absolute_paths(self) -> "Scenario":
        """This scenario with the paths the real runtimes open made absolute, for processes
        that may run in another working directory (a copy: not validated again)."""
        def absolute(p: Optional[str]) -> Optional[str]:
            return None if p is None else str(Path(p).absolute())

        t = self.task
        return self.model_copy(update={
            "model": self.model.model_copy(update={"path": absolute(self.model.path)}),
            "tiny_model": self.tiny_model.model_copy(update={"path": absolute(self.tiny_model.path)}),
            "task": t.model_copy(update={"prompts": absolute(t.prompts), "eval_prompts": absolute(t.eval_prompts)}),
        })

    def with_model_dir(self, path: str) -> "Scenario":
        """This scenario loading its model from ``path`` (a node's copy of it; a copy, not
        validated again). Its identity (a checkpoint's digest) is the original's, not this."""
        if self.model.path is not None:
            return self.model_copy(update={"model": self.model.model_copy(update={"path": path})})
        return self.model_copy(update={"tiny_model": self.tiny_model.model_copy(update={"path": path})})

    @property
    def real_model_path(self) -> str:
        """The model directory the real runtimes load: ``model.path``, else the tiny model's."""
        return self.model.path if self.model.path is not None else self.tiny_model.path

    @property
    def real_max_positions(self) -> int:
        """The longest prompt + response the real runtimes' model takes."""
        if self.model.path is None:
            return self.tiny_model.max_positions
        # A config.json without the figure: as much as the workload asks for.
        return self.model.max_positions or (self.workload.prompt_tokens + self.workload.max_response_len)

    @property
    def groups_per_step(self) -> int:
        """Groups each trainer step trains."""
        return self.trainer.batch_size // self.workload.group_size

    @property
    def fresh_groups_per_step(self) -> int:
        """Groups each trainer step takes from the queue: all of its batch, or 1/reuse of it with replay."""
        groups = self.groups_per_step
        return math.ceil(groups / self.replay.reuse) if self.replay.enabled else groups

    @property
    def warm_up_groups(self) -> int:
        """Fresh groups the first step takes on top of ``fresh_groups_per_step``: a replay ring
        fills up to one whole batch before it is drawn from."""
        return self.groups_per_step - self.fresh_groups_per_step

    @property
    def window(self) -> int:
        """Fresh samples the trainer consumes per version: one sync window."""
        return self.fresh_groups_per_step * self.workload.group_size * self.trainer.sync_every

    @property
    def lead(self) -> float:
        """Sync windows rollout may run ahead of training."""
        a = self.staleness.admission_lead
        return float(self.staleness.max_staleness) if a is None else a

    @property
    def target_reward(self) -> float:
        """The reward whose reach times a run: `learn.target_reward`, else the task's."""
        t = self.learn.target_reward
        return self.task.target_reward if t is None else t

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """The seeds each mode runs with: `seeds`, else `seed` alone."""
        return self.seeds or (self.seed,)


def _check_tiny_model_dir(path: str) -> None:
    """The tiny model is (re)built only into a directory that is missing or that asyncrl built
    (stamped): anything else at that path is the user's, and is never written into."""
    p = Path(path)
    if (p.exists() or p.is_symlink()) and (p.is_symlink() or not is_owned(p, TINY_MODEL_KIND)):
        raise ConfigError(
            "tiny_model.path", path, "exists and is not a tiny model asyncrl built (no stamp); asyncrl never writes into it",
            "to train the model in that directory set model.path to it, else point tiny_model.path at a new directory",
        )


_S = TypeVar("_S", bound=BaseModel)


def set_dotted(data: dict, key: str, value: object) -> None:
    """Set ``data["a"]["b"] = value`` for key ``"a.b"``, creating missing sections.

    Raises ``ConfigError`` when a part of the path holds a value instead of a section.
    """
    node = data
    *path, leaf = key.split(".")
    for part in path:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(key, value, f"'{part}' is not a section", "set a key that exists, e.g. trainer.steps=100")
        node = child
    node[leaf] = value


def with_changes(sc: _S, changes: dict[str, object]) -> _S:
    """A validated copy of ``sc`` (any scenario model) with dotted-key changes, e.g. ``{"trainer.steps": 10}``."""
    data = sc.model_dump(exclude_unset=True)  # what was given: figures read from model.path are read again
    for key, value in changes.items():
        set_dotted(data, key, value)
    return type(sc).model_validate(data)


# -- placement: which GPUs each role gets in a mode ----------------------------------------------
@dataclass(frozen=True)
class Placement:
    """GPUs per role in one mode. ``sync`` colocates: every GPU generates, then trains."""

    colocated: bool
    engines: int
    gpus_per_engine: int
    trainer_gpus: int

    @classmethod
    def of(cls, sc: Scenario, mode: str) -> "Placement":
        r = sc.resources
        if mode == "sync":
            total = r.rollout_gpus + r.trainer_gpus
            return cls(True, total // r.gpus_per_engine, r.gpus_per_engine, total)
        return cls(False, r.rollout_gpus // r.gpus_per_engine, r.gpus_per_engine, r.trainer_gpus)

    @property
    def total_gpus(self) -> int:
        return self.trainer_gpus if self.colocated else self.trainer_gpus + self.engines * self.gpus_per_engine


def effective_staleness(sc: Scenario, mode: str) -> tuple[int, float]:
    """(max_staleness, admission lead); sync is on-policy whatever the scenario says."""
    if mode == "sync":
        return 0, 0.0
    return sc.staleness.max_staleness, sc.lead


def engine_weight_bytes(sc: Scenario) -> int:
    """Bytes per weight an engine holds and reads: one in FP8 rollout, else the model's dtype."""
    return 1 if sc.engine.dtype == "fp8" else sc.model.dtype_bytes


def kv_capacity_tokens(sc: Scenario, gpus: int) -> float:
    """Tokens of KV cache one engine of ``gpus`` GPUs holds: its share of their memory
    (``rollout.gpu_memory_utilization``) less the weights and the activation reserve, over the
    KV bytes of one token (K and V, every layer, every KV head; split over the GPUs as they are)."""
    m, r = sc.model, sc.rollout
    free = gpus * (sc.gpu.memory_gb * r.gpu_memory_utilization - r.activation_reserve_gb) * 1e9 - m.params_b * 1e9 * engine_weight_bytes(sc)
    return free / (2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes)
