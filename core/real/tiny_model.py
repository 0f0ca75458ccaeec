"""The tiny model of the real runtimes, built locally: no model hub is reachable here.

``python -m core.real.tiny_model [DIR]`` writes a Hugging Face model directory: a random-weight
Qwen2 config (head_dim >= 32, which vLLM's CPU attention needs), ``model.safetensors`` and a
word-level tokenizer trained with ``tokenizers`` on text of the task's language. The torch
trainer, the torch engine and vLLM all load this same directory.

The build is deterministic in its seed, and it is written aside (in a stamped temporary
directory beside ``DIR``) and renamed into place, so a directory that exists is complete and a
killed build leaves nothing at ``DIR``. It only ever writes a missing ``DIR`` or replaces one
it built itself (stamped, core/model/owned.py): any other directory there is the user's, and
is refused untouched. Models of one's own are loaded through ``model.path``
(core/real/hf_model.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from core.model.bounded_parse import loads_json
from core.model.config import TINY_MODEL_KIND, TinyModelSpec
from core.model.owned import NotOwned, discard_owned, is_owned, make_owned, remove_owned
from core.model.regular_file import UnreadableFile, read_regular
from core.agent.tool_call import CALCULATOR_HEAD, CALCULATOR_TAIL, CLOSE, OPEN, RESPONSE_CLOSE, RESPONSE_OPEN
from core.real.task import EOS, PAD, BOS, SPECIAL, corpus
from core.real.warm_start import warm_start

log = logging.getLogger(__name__)

# Bumped when the layout changes, so a directory built by an older version is rebuilt.
BUILD_VERSION = 1
STAMP = "asyncrl-tiny-model.json"
TAGS = (OPEN, CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)  # tiny_model.tool_tokens


def quiet_transformers() -> None:
    """No progress bars from transformers' loads and saves: HF_HUB_DISABLE_PROGRESS_BARS
    (core/real/workers.py) binds only if set before transformers is first imported, and a bar
    on stderr would add lines to a run's one error line."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def build(out: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model directory ``out``: a new one, or in place of an older build of asyncrl's
    (another spec); ``NotOwned`` before anything is written if ``out`` is anything else."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    quiet_transformers()
    out = Path(out)
    if (out.exists() or out.is_symlink()) and (out.is_symlink() or not is_owned(out, TINY_MODEL_KIND)):
        raise NotOwned(f"{out}: exists and is not a tiny model asyncrl built; refusing to write into it (use it as model.path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_owned(out.parent, f".{out.name}.", TINY_MODEL_KIND)
    try:
        if spec.vocabulary == "arithmetic":
            tok = arithmetic_tokenizer()
        else:
            tok = Tokenizer(models.WordLevel(unk_token=PAD))
            tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            # The tags are special: matched in text before it is split at spaces, as a chat model's are.
            tags = list(TAGS) if spec.tool_tokens else []
            trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL) + tags, min_frequency=1)
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
        if spec.warm_start_steps:
            warm_start(model, fast, spec.warm_start_steps, spec.seed)
        model.save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps({"build": BUILD_VERSION, "spec": _built_from(spec)}, sort_keys=True))
        _umask_modes(tmp)
        remove_owned(out, TINY_MODEL_KIND)  # an older build of ours; anything else at that path is the user's
        os.replace(tmp, out)
    except BaseException:
        discard_owned(tmp, TINY_MODEL_KIND)
        raise
    log.info("built tiny model in %s (%d parameters)", out, sum(p.numel() for p in model.parameters()))
    return out


def _umask_modes(path: Path) -> None:
    """Every file of the model as the user's umask makes a new file: safetensors writes its
    weights 0600 (through a temporary file), which another user or a container of the user's
    could not read although every other file of the model was readable."""
    mask = os.umask(0)
    os.umask(mask)
    for f in path.iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~mask)


def arithmetic_tokenizer():
    """The arithmetic vocabulary: one token per digit and operator, the tool tags and the
    calculator call's JSON around its expression (matched first, as a chat model's tags are),
    decoded by joining tokens as they are: ``<tool_call>{...}</tool_call>`` parses."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    symbols = list(SPECIAL) + list(TAGS) + [CALCULATOR_HEAD, CALCULATOR_TAIL] + list("0123456789+-*/().=") + [" "]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(symbols)}, unk_token=PAD))
    tok.add_special_tokens(list(SPECIAL) + list(TAGS) + [CALCULATOR_HEAD, CALCULATOR_TAIL])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def is_built(out: str | Path, spec: TinyModelSpec) -> bool:
    """``out`` holds asyncrl's build of ``spec``, complete (it was renamed into place whole)."""
    stamp = Path(out) / STAMP
    if not is_owned(Path(out), TINY_MODEL_KIND) or not stamp.is_file():
        return False
    try:
        meta = loads_json(read_regular(stamp, 1 << 20, "", follow_links=False))
    except (UnreadableFile, ValueError):
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m core.real.tiny_model", description="Build the tiny local model.")
    p.add_argument("out", nargs="?", default=TinyModelSpec.model_fields["path"].default, help="model directory")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        ensure(args.out)
    except NotOwned as exc:
        log.error("error: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
