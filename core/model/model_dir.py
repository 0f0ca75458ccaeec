"""What a local Hugging Face model directory says about its model (``model.path``), read
without loading it: the architecture figures from ``config.json`` and the exact parameter
count from the tensor shapes in the safetensors headers (no weight is read).

Without safetensors weights (a directory holding only ``config.json``, enough to simulate a
model one has not downloaded) the parameter count is estimated from the figures, for a
decoder with a gated MLP (Llama, Qwen2, Mistral): biases are left out, a few millionths of it.

Every file is read within bounds, and a FIFO or a device named like one of them never blocks
the read. A safetensors header is checked as the safetensors library checks it before it
loads the weights: its size, JSON nested at most 3 deep, each tensor's dtype, shape and data
offsets, which must tile the data section exactly, to the file's last byte (so truncated
weights are found here, not by the trainer); the shard index likewise. Each defect is one
line naming the file and the field.

The tokenizer a real run loads is checked here too (``read_tokenizer``), behind the guard of
core/model/user_code.py: a tokenizer.json through the ``tokenizers`` library alone, which is
what transformers hands it to, so a broken one is refused at once (importing ``tokenizers``
takes 0.05 s; AutoTokenizer, about 4 s, torch with it). A prompts file is counted with the
run's own tokenizer (``load_tokenizer``): AutoTokenizer may rebuild tokenizer.json for the
config's model type, and split otherwise than the file alone.
"""

from __future__ import annotations

import importlib.util
import math
import os
import reprlib
import stat
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from core.model.bounded_parse import TooNested, loads_json
from core.model.regular_file import UnreadableFile, read_regular
from core.model.user_code import run_guarded

# The safetensors library refuses headers above this size; so does this reader.
MAX_HEADER_BYTES = 100_000_000
CONFIG_BYTES = 1 << 24  # a config.json is a few KB; a multimodal one with its processors, a few hundred
INDEX_BYTES = 1 << 27  # a shard index is a line per tensor: DeepSeek-V3's 91,000 take 9 MB
TOKENIZER_BYTES = 1 << 30  # tokenizer.json: Qwen2.5's is 7 MB, Gemma 3's 33 MB
HEADER_DEPTH = 3  # {tensor: {"shape": [dims]}}
INDEX_DEPTH = 4  # {"weight_map": {tensor: file}}, and room for metadata a level deeper
# Far above any real dimension (vocabularies are millions), far below what would take a
# bignum product to price.
MAX_TENSOR_DIM = 1 << 40
# Element sizes of the dtypes a safetensors header names; the sub-byte ones (F4, F6_*) are not read here.
TENSOR_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1, "C64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
# What a dtype named in config.json ("torch_dtype", newer "dtype") or a safetensors header takes per element.
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, **TENSOR_DTYPE_BYTES,
}
INDEX = "model.safetensors.index.json"
# Files a tokenizer loads from: fast (tokenizer.json), SentencePiece, or BPE / WordPiece vocabularies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# What transformers reads beside them: each must be a regular file, or its read would block.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")
# tokenizer.json loads in well under a second; transformers converting a SentencePiece model
# to a fast tokenizer (no tokenizer.json) can take most of a minute.
TOKENIZER_TIMEOUT_S = 120.0
TOKENIZER_FIX = "give a directory whose tokenizer loads (tokenizer.json as save_pretrained writes it)"
# Names the same figure has in the configs of different architectures, the usual one first.
_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "vocab": ("vocab_size",),
}
# A value of a file in an error line: a few characters, never a 4,000-digit number whole.
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong, _SHORT.maxlist, _SHORT.maxdict = 100, 40, 24, 6, 3


class ModelDirError(ValueError):
    """The directory is missing, is not a model directory, or its files cannot be read."""


@dataclass(frozen=True)
class ModelFigures:
    """The figures of one model directory, under the names of ``ModelSpec``."""

    name: str
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: Optional[int]
    """The gated MLP's width; None where config.json does not say."""
    heads: int
    experts: int
    """Routed experts per MoE layer; 1 for a dense model."""
    experts_per_token: int
    expert_params_b: float
    """One routed expert's parameters over every MoE layer, in billions; 0 for a dense model."""
    tied_embeddings: Optional[bool]
    """None: neither config.json nor the weights say."""
    params: Optional[int]
    """Exact, from the safetensors headers; None without weights."""
    params_estimate: Optional[int]
    """From the figures, when the weights are not there to count; None if the config lacks what it needs."""
    dtype_bytes: Optional[int]
    max_positions: Optional[int]
    eos_ids: tuple[int, ...]
    weights: tuple[Path, ...]

    def stated(self) -> dict:
        """What the directory states exactly: an explicit value in the scenario must agree."""
        out = {"layers": self.layers, "hidden": self.hidden, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "vocab": self.vocab,
               "heads": self.heads}
        if self.experts > 1:
            out.update(experts=self.experts, experts_per_token=self.experts_per_token, expert_params_b=self.expert_params_b)
        if self.intermediate is not None:
            out["intermediate"] = self.intermediate
        if self.tied_embeddings is not None:
            out["tied_embeddings"] = self.tied_embeddings
        if self.params is not None:
            out["params_b"] = self.params / 1e9
        if self.max_positions is not None:
            out["max_positions"] = self.max_positions
        return out

    def defaults(self) -> dict:
        """What stands in for a value the scenario leaves out but may set: a label, the dtype to
        serve in, a parameter count that is only an estimate."""
        out: dict = {"name": self.name}
        if self.dtype_bytes is not None:
            out["dtype_bytes"] = self.dtype_bytes
        if self.params is None and self.params_estimate is not None:
            out["params_b"] = self.params_estimate / 1e9
        return out


def read_model_dir(path: str | Path) -> ModelFigures:
    """The figures of the model in ``path``; ``ModelDirError`` (one line) if there is none."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError("no such directory" if not path.exists() else "not a directory")
    cfg = _config(path / "config.json")
    text = cfg.get("text_config")
    if isinstance(text, dict) and not any(k in cfg for k in _KEYS["layers"]):
        cfg = {**cfg, **text}  # a multimodal model: its language model's figures
    layers, heads, hidden, vocab = (_int(cfg, *_KEYS[k]) for k in ("layers", "heads", "hidden", "vocab"))
    kv_heads = _int(cfg, "num_key_value_heads", default=1 if cfg.get("multi_query") else heads)
    head_dim = _int(cfg, "head_dim", default=hidden // heads if hidden % heads == 0 else ...)
    weights = _weight_files(path)
    tensors = _tensor_shapes(weights)
    tied = cfg.get("tie_word_embeddings")
    if not isinstance(tied, bool):
        tied = ("lm_head.weight" not in tensors) if tensors else None
    params = sum(math.prod(shape) for shape, _ in tensors.values()) if tensors else None
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    dtype_bytes = DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
    if dtype_bytes is None and tensors:
        dtypes = [d for _, d in tensors.values()]
        dtype_bytes = DTYPE_BYTES.get(max(set(dtypes), key=dtypes.count))
    experts, per_token, expert_params = _experts(cfg, layers, hidden)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and not isinstance(e, bool))
    return ModelFigures(
        name=path.resolve().name,
        layers=layers,
        hidden=hidden,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        intermediate=_optional_int(cfg.get("intermediate_size")),
        heads=heads,
        experts=experts,
        experts_per_token=per_token,
        expert_params_b=expert_params / 1e9,
        tied_embeddings=tied,
        params=params,
        params_estimate=_estimate(cfg, layers, heads, hidden, kv_heads, head_dim, vocab, bool(tied)),
        dtype_bytes=dtype_bytes,
        max_positions=_int(cfg, "max_position_embeddings", "n_positions", "max_sequence_length", default=None),
        eos_ids=eos_ids,
        weights=weights,
    )


def check_loadable(path: str | Path) -> None:
    """What the real runtimes load besides config.json: safetensors weights (never a pickle)
    and a tokenizer; ``ModelDirError`` naming what is missing."""
    path = Path(path)
    if not _weight_files(path):
        raise ModelDirError("holds no *.safetensors weights (the real runtimes load nothing else)")
    # Present in any form: one that is not a regular file is refused by name when it is read.
    if not any(os.path.lexists(path / f) for f in TOKENIZER_FILES):
        raise ModelDirError(f"holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def read_config(path: Path) -> dict:
    """The config.json of the model directory ``path``, read within bounds; ``ModelDirError``."""
    return _config(Path(path) / "config.json")


def _config(file: Path) -> dict:
    if not file.exists() and not file.is_symlink():
        raise ModelDirError("holds no config.json: not a Hugging Face model directory")
    cfg = _json_file(file, CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise ModelDirError("config.json does not hold a JSON object")
    return cfg


def _json_file(file: Path, max_bytes: int, max_depth: Optional[int] = None) -> Any:
    """The JSON value of ``file``, a regular file of at most ``max_bytes``; ``ModelDirError`` naming it."""
    return _parse_json(file.name, _read_text(file, max_bytes), max_depth)


def _read_text(file: Path, max_bytes: int) -> str:
    try:
        # A regular file of bounded size only: a FIFO named config.json would block the read forever.
        data = read_regular(file, max_bytes, "give a local Hugging Face model directory")
    except UnreadableFile as exc:
        raise ModelDirError(f"{file.name} is unreadable: it {exc.problem}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelDirError(f"{file.name} is unreadable (not UTF-8 at byte {exc.start})") from None


def _parse_json(name: str, text: str, max_depth: Optional[int]) -> Any:
    try:
        return loads_json(text) if max_depth is None else loads_json(text, max_depth)
    except TooNested as exc:
        raise ModelDirError(f"{name}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ModelDirError(f"{name} is not JSON ({str(exc)[:80]})") from None


def _optional_int(v: object) -> Optional[int]:
    """A figure only LoRA pricing reads: a positive whole number, else None (never an error:
    a model whose MLP widths are listed per layer still loads)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def _int(cfg: dict, *keys: str, default: object = ...) -> Optional[int]:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelDirError(f"config.json: {k} = {_shown(v)} is not a positive whole number")
            return v
    if default is ...:
        raise ModelDirError(f"config.json has no {' / '.join(keys)}: not a causal-LM config asyncrl can read")
    return default  # type: ignore[return-value]


def linear_layers(path: str | Path) -> set[str]:
    """Leaf names of the matrices inside the model's blocks (``model.layers.0.mlp.up_proj.weight``:
    ``up_proj``), from the safetensors headers: what a LoRA target may name. Empty where the
    weights cannot be read (``check_loadable`` says why)."""
    try:
        tensors = _tensor_shapes(_weight_files(Path(path)))
    except ModelDirError:
        return set()
    out = set()
    for name, (shape, _) in tensors.items():
        parts = name.split(".")
        if len(shape) == 2 and len(parts) >= 3 and parts[-1] == "weight":
            out.add(parts[-2])
    return out


def _weight_files(path: Path) -> tuple[Path, ...]:
    """The safetensors files of the directory: those the shard index names, else every one."""
    index = path / INDEX
    if os.path.lexists(index):
        return tuple(path / name for name in _indexed(path, index))
    # A FIFO or a dangling link named *.safetensors stays in, to be refused by name when read.
    return tuple(sorted(p for p in path.glob("*.safetensors") if not p.is_dir()))


def _indexed(path: Path, index: Path) -> list[str]:
    """The files the shard index's weight_map names: plain names of files in ``path``."""
    obj = _json_file(index, INDEX_BYTES, INDEX_DEPTH)
    if not isinstance(obj, dict):
        raise ModelDirError(f"{INDEX} holds {_kind(obj)}, not an object with a weight_map")
    if "weight_map" not in obj:
        raise ModelDirError(f"{INDEX} has no weight_map")
    wm = obj["weight_map"]
    if not isinstance(wm, dict):
        raise ModelDirError(f"{INDEX}: weight_map is {_kind(wm)}, not an object of tensor name: file name")
    if not wm:
        raise ModelDirError(f"{INDEX}: weight_map names no file")
    names = set()
    for tensor, name in wm.items():
        field = f"{INDEX}: weight_map[{_shown(tensor)}] = {_shown(name)}"
        if not isinstance(name, str):
            raise ModelDirError(f"{field} is {_kind(name)}, not a file name")
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ModelDirError(f"{field} is not the name of a file in the directory")
        if not name.endswith(".safetensors"):
            raise ModelDirError(f"{field} is not a .safetensors file")
        names.add(name)
    for name in sorted(names):
        if not os.path.lexists(path / name):
            raise ModelDirError(f"{INDEX}: weight_map names {_shown(name)}, which is not there")
    return sorted(names)


def _tensor_shapes(files: tuple[Path, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} from the headers of ``files``."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        try:
            st = os.stat(f)  # never blocks, even on a FIFO
        except OSError:
            out.update(_header(f))  # says why it cannot be opened
            continue
        out.update(_header_of(f, st.st_ino, st.st_size, st.st_mtime_ns))
    return out


@lru_cache(maxsize=256)
def _header_of(f: Path, inode: int, size: int, mtime_ns: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Read once per version of the file: a run checks its scenario several times, and
    checking a header of 90,000 tensors takes most of a second."""
    return _header(f)


def _header(f: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} of one safetensors file: its 8-byte header length, then
    its header, read without the weights after them."""
    bad = f"{f.name} is not a readable safetensors file"
    try:
        # Non-blocking, as core/model/regular_file.py: a FIFO would otherwise block the open.
        fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise ModelDirError(f"{f.name} cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelDirError(f"{f.name} is {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a regular file (a FIFO, socket or device)'}")
        size = st.st_size
        try:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelDirError(f"{bad}: it is {size} bytes, fewer than the 8 that give its header's length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise ModelDirError(f"{bad}: its header length says {n:,} bytes, more than the {MAX_HEADER_BYTES:,} a header may have")
            if n > size - 8:
                raise ModelDirError(f"{bad}: its header length says {n:,} bytes, and the file holds {size - 8:,} after it (truncated?)")
            raw = fh.read(n)
        except OSError as exc:
            raise ModelDirError(f"{f.name} cannot be read ({exc.strerror})") from None
    if len(raw) < n:  # it shrank since the stat
        raise ModelDirError(f"{bad}: its header is cut short at {len(raw):,} of {n:,} bytes (truncated?)")
    try:
        header = loads_json(raw, HEADER_DEPTH)
    except UnicodeDecodeError as exc:
        raise ModelDirError(f"{bad}: its header is not UTF-8 (byte {8 + exc.start})") from None
    except TooNested as exc:
        raise ModelDirError(f"{bad}: at line {exc.line}, column {exc.column} of its header, {exc.problem}") from None
    except (ValueError, RecursionError) as exc:
        raise ModelDirError(f"{bad}: its header is not JSON ({str(exc)[:80]})") from None
    return _tensors(f.name, header, size - 8 - n)


def _tensors(file: str, header: object, data_bytes: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors of a parsed header, each checked; their data must tile the ``data_bytes``
    after the header exactly, in any order, as the safetensors library requires."""
    where = f"{file}: header"
    if not isinstance(header, dict):
        raise ModelDirError(f"{where} is {_kind(header)}, not an object of tensors")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ModelDirError(f"{where}: __metadata__ is not an object of strings")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        field = f"{where}: {_name(name)}"
        if not isinstance(t, dict):
            raise ModelDirError(f"{field} is {_kind(t)}, not an object of dtype, shape and data_offsets")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in t:
                raise ModelDirError(f"{field} has no {key}")
        dtype, shape, offsets = t["dtype"], t["shape"], t["data_offsets"]
        if not isinstance(dtype, str) or dtype not in TENSOR_DTYPE_BYTES:
            raise ModelDirError(f"{field}.dtype = {_shown(dtype)} is not a safetensors dtype ({', '.join(list(TENSOR_DTYPE_BYTES)[:6])}, ...)")
        if not isinstance(shape, list):
            raise ModelDirError(f"{field}.shape = {_shown(shape)} is not a list of dimensions")
        for i, d in enumerate(shape):
            if not _whole(d):
                raise ModelDirError(f"{field}.shape[{i}] = {_shown(d)} is not a whole number >= 0")
            if d > MAX_TENSOR_DIM:
                raise ModelDirError(f"{field}.shape[{i}] = {_shown(d)} is more than {MAX_TENSOR_DIM:,}, beyond any model's tensors")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(x) for x in offsets)):
            raise ModelDirError(f"{field}.data_offsets = {_shown(offsets)} is not [begin, end], two whole numbers >= 0")
        begin, end = offsets
        span = f"{field}.data_offsets = [{begin}, {end}]"
        if end < begin:
            raise ModelDirError(f"{span} end before they begin")
        if end > data_bytes:
            raise ModelDirError(f"{span} reach past the {data_bytes:,} bytes of data the file holds (truncated?)")
        need = math.prod(shape) * TENSOR_DTYPE_BYTES[dtype]
        if end - begin != need:
            raise ModelDirError(f"{span} hold {end - begin:,} bytes, and shape {_shown(shape)} of {dtype} takes {need:,}")
        spans.append((begin, end, name))
        out[name] = (tuple(shape), dtype)
    at, before = 0, None
    for begin, end, name in sorted(spans):
        span = f"{where}: {_name(name)}.data_offsets = [{begin}, {end}]"
        if begin < at:
            raise ModelDirError(f"{span} overlap those of {_name(before)}, which end at {at}")
        if begin > at:
            raise ModelDirError(f"{span} leave bytes {at} to {begin} of the data unused")
        at, before = end, name
    if at != data_bytes:
        raise ModelDirError(f"{where}: its tensors end at byte {at:,} of the data, and {data_bytes - at:,} more bytes follow them")
    return out


def _whole(x: object) -> bool:
    return type(x) is int and x >= 0  # not a bool, not a float such as 1e400 (inf) or 2.0


def _shown(value: object) -> str:
    return _SHORT.repr(value)


def _name(name: str) -> str:
    """A tensor's name as an error shows it: itself, unless that would break the line or run on."""
    return name if name.isprintable() and len(name) <= 120 else _SHORT.repr(name)


def _kind(value: object) -> str:
    """A JSON value's kind: 'a list', 'a number', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _experts(cfg: dict, layers: int, hidden: int) -> tuple[int, int, float]:
    """(routed experts, experts per token, one expert's parameters over every MoE layer) of a
    mixture-of-experts config (Qwen2/3-MoE: num_experts, moe_intermediate_size,
    decoder_sparse_step, mlp_only_layers; DeepSeek: n_routed_experts, first_k_dense_replace;
    Mixtral: num_local_experts, intermediate_size); (1, 1, 0.0) for a dense one. Each expert a
    gated MLP: 3 x hidden x its width."""
    experts = _int(cfg, "num_experts", "n_routed_experts", "num_local_experts", default=1)
    if experts <= 1:
        return 1, 1, 0.0
    per_token = _int(cfg, "num_experts_per_tok", "moe_top_k", default=...)
    if per_token > experts:
        raise ModelDirError(f"config.json: num_experts_per_tok = {per_token} is more than the {experts} experts")
    width = _int(cfg, "moe_intermediate_size", "intermediate_size", default=...)
    dense_first = cfg.get("first_k_dense_replace", 0)
    step = cfg.get("decoder_sparse_step", 1)
    only_mlp = cfg.get("mlp_only_layers") or []
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (dense_first, step)) or not isinstance(only_mlp, list):
        raise ModelDirError("config.json: first_k_dense_replace, decoder_sparse_step or mlp_only_layers is not a layer count or list")
    moe_layers = sum(1 for i in range(layers) if i >= dense_first and i not in only_mlp and (step <= 1 or (i + 1) % step == 0))
    return experts, per_token, 3.0 * hidden * width * moe_layers


def _estimate(cfg: dict, layers: int, heads: int, hidden: int, kv_heads: int, head_dim: int, vocab: int, tied: bool) -> Optional[int]:
    """Parameters of a decoder with a gated MLP, from its figures; None for a config this does
    not describe (no intermediate_size, or experts)."""
    inter = cfg.get("intermediate_size")
    if not isinstance(inter, int) or any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * inter + 2 * hidden  # gate, up, down; two norms
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


# -- the tokenizer ----------------------------------------------------------------------------
def load_tokenizer(path: str | Path, plain: bool):
    """The tokenizer a real run loads from ``path``, local files only: tokenizer.json as it is
    (``PreTrainedTokenizerFast``) when ``plain``, else whatever ``AutoTokenizer`` makes of the
    directory, which may rebuild it for the config's model type."""
    if plain:
        from transformers import PreTrainedTokenizerFast  # 1 s: without the 4 s of AutoTokenizer's torch

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class TokenCounter:
    """Counts a prompt's tokens as a run makes them (``Task.tokens``): <bos> when the tokenizer
    has one, then the text's own tokens, no other special token. Counted with the run's own
    tokenizer (``load_tokenizer``), loaded on the first count: tokenizer.json alone may split
    otherwise where AutoTokenizer rebuilds it for a model type."""

    def __init__(self, path: str, plain: bool, stamps: tuple) -> None:
        self.path, self.plain, self.stamps = path, plain, stamps
        self._counted: dict[tuple[str, ...], list[int]] = {}

    def counts(self, texts: Sequence[str]) -> list[int]:
        """The token count of each text; ``UserCodeError`` (one line) if the tokenizer cannot be
        loaded or fails on them within ``TOKENIZER_TIMEOUT_S``."""
        key = tuple(texts)
        if key not in self._counted:  # a run checks its scenario several times
            counted = run_guarded(self._count, (list(key),), timeout_s=TOKENIZER_TIMEOUT_S, key="model.path", name=self.path,
                                  doing="loading its tokenizer to count the prompts' tokens", fix=TOKENIZER_FIX)
            self._counted = {key: counted}
        return self._counted[key]

    def _count(self, texts: list[str]) -> list[int]:
        tok = _run_tokenizer(self.path, self.plain, self.stamps)
        bos = tok.bos_token_id is not None
        return [bos + len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


@lru_cache(maxsize=2)
def _run_tokenizer(path: str, plain: bool, stamps: tuple):
    return load_tokenizer(path, plain)


def read_tokenizer(path: str | Path, plain: bool) -> Optional[TokenCounter]:
    """Loads the tokenizer of ``path`` as a run would (``plain``: see ``load_tokenizer``), or
    fails in one line: ``ModelDirError`` for a file that is not a regular file or not JSON,
    ``UserCodeError`` for one the library cannot load within ``TOKENIZER_TIMEOUT_S``. A
    tokenizer.json is loaded by the ``tokenizers`` library alone (what transformers hands it
    to, in 0.05 s; importing transformers takes seconds), other tokenizers by transformers.
    The counter of its prompts' tokens; None without ``tokenizers`` or ``transformers``
    installed, which the install check then refuses a real run for."""
    if any(importlib.util.find_spec(m) is None for m in ("tokenizers", "transformers")):
        return None
    path = Path(path)
    stamps = []
    for f in (*TOKENIZER_FILES, *TOKENIZER_SIDE_FILES):
        if not os.path.lexists(path / f):
            continue
        try:
            st = os.stat(path / f)
        except OSError as exc:
            raise ModelDirError(f"{f} is unreadable: it cannot be opened ({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory, not a file" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
            raise ModelDirError(f"{f} is unreadable: it is {kind}")
        stamps.append((f, st.st_ino, st.st_size, st.st_mtime_ns))
    return _checked_tokenizer(str(path), plain, tuple(stamps))


@lru_cache(maxsize=4)
def _checked_tokenizer(path: str, plain: bool, stamps: tuple) -> TokenCounter:
    """Once per version of its files (and its counter kept, with its counts): a run checks
    its scenario several times."""
    guard = dict(timeout_s=TOKENIZER_TIMEOUT_S, key="model.path", name=path, doing="loading its tokenizer", fix=TOKENIZER_FIX)
    d = Path(path)
    for f in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        if any(name == f for name, *_ in stamps):
            obj = _json_file(d / f, CONFIG_BYTES)
            if not isinstance(obj, dict):
                raise ModelDirError(f"{f} holds {_kind(obj)}, not an object")
    if not any(name == "tokenizer.json" for name, *_ in stamps):
        run_guarded(_run_tokenizer, (path, plain, stamps), **guard)  # SentencePiece or vocabulary files: transformers reads them
    else:
        text = _read_text(d / "tokenizer.json", TOKENIZER_BYTES)
        if not isinstance(_parse_json("tokenizer.json", text, None), dict):
            raise ModelDirError("tokenizer.json does not hold a JSON object")
        run_guarded(_from_str, (text,), **guard)
    return TokenCounter(path, plain, stamps)


def _from_str(text: str) -> None:
    from tokenizers import Tokenizer

    Tokenizer.from_str(text)
