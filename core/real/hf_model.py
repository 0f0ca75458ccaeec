"""The model directory of the real runtimes, and loading it: the tiny model asyncrl builds, or
any local Hugging Face causal-LM directory given as ``model.path``.

Every loader here reads the directory only (``local_files_only``; nothing is downloaded, no
code from the directory is run, weights from safetensors only, never a pickle), and the same
loaders serve the trainer, the torch engine, the evaluators and the reward's tokenizer (vLLM
is given the path).
"""

from __future__ import annotations

import threading
from pathlib import Path

from core.model import model_dir
from core.model.config import TINY_MODEL_KIND, Scenario
from core.model.owned import is_owned
from core.real.tiny_model import ensure, quiet_transformers

# transformers builds a model on the meta device under process-wide state: two threads
# loading at once corrupt each other (a tied lm_head left on meta), so loads take turns.
_LOAD_LOCK = threading.Lock()


def ensure_model_dir(sc: Scenario) -> Path:
    """The directory the scenario's real run loads: ``model.path`` as it is, else the tiny
    model, built first unless asyncrl already built it; ``ConfigError`` if a prompt of
    ``task.prompts`` does not fit beside a response on it."""
    if sc.model.path is not None:
        return Path(sc.model.path)  # its prompts were counted with the scenario
    path = ensure(sc.tiny_model.path, sc.tiny_model)
    counter = model_dir.read_tokenizer(path, plain=True) if sc.task.prompts is not None else None
    if counter is not None:  # counted now that its tokenizer exists, before any worker starts
        sc.check_prompt_lengths(counter)
    return path


def load_model(path: str | Path, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` of a local directory, float32 unless told,
    safe to call from several threads."""
    import torch  # imported on use: a sim run never pays for torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    kwargs.setdefault("dtype", torch.float32)
    with _LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, use_safetensors=True, **kwargs)


def load_tokenizer(path: str | Path):
    """The directory's tokenizer: ``AutoTokenizer``, local files only, the loader the scenario
    check counts prompts with. The tiny model's is read as the plain tokenizer.json it is:
    AutoTokenizer would take its model type, qwen2, for Qwen2's byte-level tokenizer and decode
    its words without the spaces between them."""
    return model_dir.load_tokenizer(path, plain=is_owned(Path(path), TINY_MODEL_KIND))


def model_dtype(path: str | Path, dtype: str = "auto") -> str:
    """The engines' parameter dtype: ``dtype`` unless ``auto``, else the directory's own
    (config.json's ``torch_dtype``, or ``dtype`` in newer transformers; float32 if it says none)."""
    if dtype != "auto":
        return dtype
    cfg = model_dir.read_config(Path(path))
    found = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return found.removeprefix("torch.")
