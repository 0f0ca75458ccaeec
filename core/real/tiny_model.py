"""The tiny model of the real runtimes, built locally: no model hub is reachable here.

``python -m core.real.tiny_model [DIR]`` writes a Hugging Face model directory: a random-weight
Qwen2 config (head_dim >= 32, which vLLM's CPU attention needs), ``model.safetensors`` and a
word-level tokenizer trained with ``tokenizers`` on text of the task's language. The torch
trainer, the torch engine and vLLM all load this same directory.

The build is deterministic in its seed, and it is written aside and renamed into place,
so a directory that exists is complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path

from core.model.config import TinyModelSpec
from core.model.owned import discard_owned, make_owned, remove_owned
from core.real.task import EOS, PAD, BOS, SPECIAL, corpus

log = logging.getLogger(__name__)

# Bumped when the layout changes, so a directory built by an older version is rebuilt.
BUILD_VERSION = 1
STAMP = "asyncrl-tiny-model.json"


def build(out: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model directory ``out`` (replacing an older build of another spec)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_owned(out.parent, f".{out.name}.", "tiny-model")
    try:
        tok = Tokenizer(models.WordLevel(unk_token=PAD))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL), min_frequency=1)
        tok.train_from_iterator(corpus(4096, spec.seed), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=BOS)
        fast.save_pretrained(tmp)
        vocab = tok.get_vocab_size()
        cfg = Qwen2Config(
            vocab_size=vocab,
            hidden_size=spec.heads * spec.head_dim,
            intermediate_size=spec.intermediate,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_positions,
            eos_token_id=tok.token_to_id(EOS),
            bos_token_id=tok.token_to_id(BOS),
            pad_token_id=tok.token_to_id(PAD),
            tie_word_embeddings=True,
            torch_dtype="float32",
        )
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(cfg)
        model.save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps({"build": BUILD_VERSION, "spec": _built_from(spec)}, sort_keys=True))
        remove_owned(out, "tiny-model")  # an older build of ours; anything else at that path is the user's
        os.replace(tmp, out)
    except BaseException:
        discard_owned(tmp, "tiny-model")
        raise
    log.info("built tiny model in %s (%d parameters)", out, sum(p.numel() for p in model.parameters()))
    return out


def is_built(out: str | Path, spec: TinyModelSpec) -> bool:
    stamp = Path(out) / STAMP
    if not stamp.is_file():
        return False
    try:
        meta = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("build") == BUILD_VERSION and meta.get("spec") == _built_from(spec)


def _built_from(spec: TinyModelSpec) -> dict:
    """What the weights depend on: the spec but where it is written."""
    return spec.model_dump(exclude={"path"})


def ensure(out: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """The model directory ``out``, built first unless it already holds this spec's build."""
    if not is_built(out, spec):
        build(out, spec)
    return Path(out)


# transformers builds a model on the meta device under process-wide state: two threads
# loading at once corrupt each other (a tied lm_head left on meta), so loads take turns.
_LOAD_LOCK = threading.Lock()


def load_model(model_dir: str | Path, **kwargs):
    """``Qwen2ForCausalLM.from_pretrained`` in float32, safe to call from several threads."""
    import torch
    from transformers import Qwen2ForCausalLM

    kwargs.setdefault("dtype", torch.float32)
    with _LOAD_LOCK:
        return Qwen2ForCausalLM.from_pretrained(str(model_dir), use_safetensors=True, **kwargs)  # never a pickle


def load_tokenizer(model_dir: str | Path):
    """The model directory's tokenizer (a ``PreTrainedTokenizerFast``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m core.real.tiny_model", description="Build the tiny local model.")
    p.add_argument("out", nargs="?", default=TinyModelSpec.model_fields["path"].default, help="model directory")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ensure(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
