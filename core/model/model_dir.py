"""What a local Hugging Face model directory says about its model (``model.path``), read
without loading it: the architecture figures from ``config.json`` and the exact parameter
count from the tensor shapes in the safetensors headers (no weight is read).

Without safetensors weights (a directory holding only ``config.json``, enough to simulate a
model one has not downloaded) the parameter count is estimated from the figures, for a
decoder with a gated MLP (Llama, Qwen2, Mistral): biases are left out, a few millionths of it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from core.model.regular_file import UnreadableFile, read_regular

# The safetensors library refuses headers above this size; so does this reader.
MAX_HEADER_BYTES = 100_000_000
CONFIG_BYTES = 1 << 24  # a config.json is a few KB; a multimodal one with its processors, a few hundred
# What a dtype named in config.json ("torch_dtype", newer "dtype") or a safetensors header takes per element.
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
# Files a tokenizer loads from: fast (tokenizer.json), SentencePiece, or BPE / WordPiece vocabularies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# Names the same figure has in the configs of different architectures, the usual one first.
_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "vocab": ("vocab_size",),
}


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
        out = {"layers": self.layers, "hidden": self.hidden, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "vocab": self.vocab}
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
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and not isinstance(e, bool))
    return ModelFigures(
        name=path.resolve().name,
        layers=layers,
        hidden=hidden,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
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
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def _config(file: Path) -> dict:
    if not file.exists() and not file.is_symlink():
        raise ModelDirError("holds no config.json: not a Hugging Face model directory")
    try:
        # A regular file of bounded size only: a FIFO named config.json would block the read forever.
        data = read_regular(file, CONFIG_BYTES, "give a local Hugging Face model directory")
    except UnreadableFile as exc:
        raise ModelDirError(f"config.json is unreadable: it {exc.problem}") from None
    try:
        cfg = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelDirError(f"config.json is unreadable (not UTF-8 at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise ModelDirError(f"config.json is not JSON ({str(exc)[:80]})") from None
    if not isinstance(cfg, dict):
        raise ModelDirError("config.json does not hold a JSON object")
    return cfg


def _int(cfg: dict, *keys: str, default: object = ...) -> Optional[int]:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelDirError(f"config.json: {k} = {v!r} is not a positive whole number")
            return v
    if default is ...:
        raise ModelDirError(f"config.json has no {' / '.join(keys)}: not a causal-LM config asyncrl can read")
    return default  # type: ignore[return-value]


def _weight_files(path: Path) -> tuple[Path, ...]:
    """The safetensors files of the directory: those the shard index names, else every one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelDirError(f"{index.name} is unreadable ({type(exc).__name__})") from None
        files = tuple(path / n for n in names)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(f"{index.name} names {missing[0]}, which is not there")
        return files
    return tuple(sorted(p for p in path.glob("*.safetensors") if p.is_file()))


def _tensor_shapes(files: tuple[Path, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} from the headers of ``files``."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        try:
            with f.open("rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise ValueError("shorter than its header")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES:
                    raise ValueError(f"a header of {n} bytes")
                header = json.loads(fh.read(n))
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                shape = tuple(int(x) for x in t["shape"])
                if any(x < 0 for x in shape):
                    raise ValueError(f"{name} has shape {shape}")
                out[name] = (shape, str(t["dtype"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelDirError(f"{f.name} is not a readable safetensors file ({type(exc).__name__}: {exc})"[:300]) from None
    return out


def _estimate(cfg: dict, layers: int, heads: int, hidden: int, kv_heads: int, head_dim: int, vocab: int, tied: bool) -> Optional[int]:
    """Parameters of a decoder with a gated MLP, from its figures; None for a config this does
    not describe (no intermediate_size, or experts)."""
    inter = cfg.get("intermediate_size")
    if not isinstance(inter, int) or any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * inter + 2 * hidden  # gate, up, down; two norms
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden
