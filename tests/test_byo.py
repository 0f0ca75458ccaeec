"""Bring your own model, prompts and reward (model.path, task.prompts, reward.fn), the memory
check that goes with a model of one's own, and a tiny-model builder that never writes where
it did not build.

"Any" directory is shown with one asyncrl did not build: a random-weight Llama with a
byte-level BPE tokenizer trained by ``tokenizers``, made here (no model hub is reachable).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.model import prompt_file
from core.model.config import Scenario, TaskSpec, kv_capacity_tokens, with_changes
from core.model.model_dir import ModelDirError, read_model_dir
from core.model.owned import NotOwned
from core.model.prompt_file import PromptFileError, read_prompts
from core.model.config import RewardSpec
from core.model.reward_fn import load_reward_fn
from core.model.user_code import UserCodeError
from core.real.hf_model import load_model, load_tokenizer
from core.real.reward import task_from
from core.real.task import FilePrompts, score_text
from core.real.tiny_model import build, ensure
from core.real.tiny_model import main as tiny_model_main
from core.runtimes.dispatch import run_mode
from harness.metrics import collect
from harness.run import main
from harness.scenario import load
from tests import byo_reward

ROOT = Path(__file__).resolve().parent.parent
L70B = ROOT / "tests" / "corpus" / "byo" / "llama-3-70b"
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
TORCH = str(ROOT / "scenarios" / "real-cpu-torch.yaml")


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with a hash of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def sim(**changes) -> Scenario:
    """A sim scenario whose sequences fit the small test models' positions."""
    return with_changes(Scenario(), {"workload.prompt_tokens": 32, "workload.max_response_len": 64, **changes})


def one_error(capsys) -> str:
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error:") and err.count("error:") == 1 and "Traceback" not in err, err
    return err


def sets(**kv) -> list[str]:
    return [a for k, v in kv.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A Llama directory as ``save_pretrained`` writes one, of a user's own."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("users") / "my-llama"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["a b c d e f g h =", "what is two plus two ? four", "the answer is four"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b), "source": "arith"} for a in range(3) for b in range(2)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


# -- model.path: the figures ------------------------------------------------------------------
def test_a_directorys_figures_are_read_exactly(llama_dir):
    sc = sim(**{"model.path": str(llama_dir)})
    model = load_model(llama_dir)
    cfg = model.config
    m = sc.model
    assert m.params_b * 1e9 == sum(p.numel() for p in model.parameters())  # counted from the headers, exactly
    assert (m.layers, m.hidden, m.kv_heads, m.head_dim, m.vocab) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    assert (m.tied_embeddings, m.max_positions, m.dtype_bytes, m.name) == (False, 256, 4, "my-llama")


def test_a_tied_embedding_is_counted_once(tiny_model_dir):
    m = sim(**{"model.path": str(tiny_model_dir)}).model
    assert m.tied_embeddings is True
    assert m.params_b * 1e9 == sum(p.numel() for p in load_model(tiny_model_dir).parameters())


def test_without_weights_the_parameters_are_estimated_from_the_figures(llama_dir, tmp_path):
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    exact = read_model_dir(llama_dir).params
    # A Llama has no biases: the estimate is the count.
    assert sim(**{"model.path": str(tmp_path)}).model.params_b * 1e9 == exact
    # Llama 3 70B: 70,553,706,496 parameters.
    assert sim(**{"model.path": str(L70B), "gpu.memory_gb": 1000}).model.params_b == pytest.approx(70.5537, abs=1e-4)
    # Only an estimate: a count of one's own is taken as given.
    assert sim(**{"model.path": str(tmp_path), "model.params_b": 0.5}).model.params_b == 0.5


def test_an_explicit_figure_must_agree_with_the_directory(llama_dir):
    with pytest.raises(ValueError, match=r"model\.layers = 3: model\.path .*my-llama says 2; fix: remove model\.layers, or set it to 2"):
        sim(**{"model.path": str(llama_dir), "model.layers": 3})
    with pytest.raises(ValueError, match=r"model\.tied_embeddings = True: .* says False"):
        sim(**{"model.path": str(llama_dir), "model.tied_embeddings": True})
    # A model card's rounded count agrees (within 1 %); a label and the dtype to serve in are free.
    card = round(read_model_dir(llama_dir).params / 1e9, 6)
    m = sim(**{"model.path": str(llama_dir), "model.params_b": card, "model.name": "mine", "model.dtype_bytes": 2}).model
    assert (m.params_b, m.name, m.dtype_bytes, m.layers) == (card, "mine", 2, 2)
    with pytest.raises(ValueError, match=rf"model\.params_b = {card * 1.02}: .* says {card:.4g}"):
        sim(**{"model.path": str(llama_dir), "model.params_b": card * 1.02})


def test_a_copy_with_another_model_path_reads_that_directory(llama_dir, tiny_model_dir):
    llama = sim(**{"model.path": str(llama_dir)})
    assert with_changes(llama, {"trainer.steps": 5}).model == llama.model
    tiny = with_changes(llama, {"model.path": str(tiny_model_dir)}).model
    assert (tiny.hidden, tiny.tied_embeddings, tiny.name) == (128, True, tiny_model_dir.name)
    # A run directory's resolved scenario (every key written) reads back the same.
    assert Scenario.model_validate(json.loads(llama.model_dump_json())) == llama


def _broken_header(d: Path) -> None:
    shutil.copy(ROOT / "tests" / "corpus" / "byo" / "llama-3-70b" / "config.json", d / "config.json")
    (d / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")


BAD_DIRS = {
    "config_not_json": (lambda d: (d / "config.json").write_text("{layers: 2"), "config.json is not JSON"),
    "config_a_list": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json does not hold a JSON object"),
    "config_not_utf8": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"), "config.json is unreadable"),
    "config_no_layers": (lambda d: (d / "config.json").write_text('{"hidden_size": 64}'), "config.json has no num_hidden_layers"),
    "config_zero_heads": (lambda d: (d / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 0}'),
                          "num_attention_heads = 0 is not a positive whole number"),
    "config_a_directory": (lambda d: (d / "config.json").mkdir(), "config.json is unreadable"),
    "safetensors_header": (_broken_header, "model.safetensors is not a readable safetensors file"),
}


@pytest.mark.parametrize("case", sorted(BAD_DIRS))
def test_a_bad_model_directory_is_one_line_and_exit_2(case, tmp_path, capsys):
    bad = tmp_path / "model"
    bad.mkdir()
    make, fragment = BAD_DIRS[case]
    make(bad)
    before = tree(tmp_path)
    assert main([QUICK, "--out", str(tmp_path / "run"), *sets(**{"model.path": bad})]) == 2
    err = one_error(capsys)
    assert f"model.path = '{bad}'" in err and fragment in err and "fix:" in err
    assert tree(tmp_path) == before and not (tmp_path / "run").exists()


def test_a_real_run_needs_weights_and_a_tokenizer(llama_dir, tmp_path):
    for keep, missing in ((["config.json", "tokenizer.json", "tokenizer_config.json"], "no *.safetensors"),
                          (["config.json", "model.safetensors"], "no tokenizer")):
        d = tmp_path / missing.replace(" ", "-").replace("*", "")
        d.mkdir()
        for f in keep:
            shutil.copy(llama_dir / f, d / f)
        with pytest.raises(ValueError, match=f"model.path = .*holds {missing.replace('*', '[*]')}"):
            with_changes(load(TORCH), {"model.path": str(d)})


# -- the memory check -------------------------------------------------------------------------
def test_a_70b_model_on_one_80gb_gpu_is_refused_and_fits_tensor_parallel_on_four():
    h100 = {"model.path": str(L70B), "gpu.memory_gb": 80, "workload.max_response_len": 4096}
    with pytest.raises(ValueError) as err:
        with_changes(Scenario(), h100)
    msg = str(err.value)
    assert "resources.gpus_per_engine = 1: an engine of 1 GPU(s) has 72.0 GB" in msg
    assert "weights take 141.1 GB" in msg and "fix: raise resources.gpus_per_engine" in msg and "smaller model" in msg
    sc = with_changes(Scenario(), {**h100, "resources.gpus_per_engine": 4})
    # Four H100s hold the bf16 weights and KV for many sequences of the longest length.
    assert kv_capacity_tokens(sc, 4) > 10 * (sc.workload.prompt_tokens + sc.workload.max_response_len)


# -- task.prompts ---------------------------------------------------------------------------
def test_prompt_file_rows_each_pass_in_an_order_of_the_seed(prompts_file):
    rows = read_prompts(prompts_file)
    assert len(rows) == 6 and rows[0].prompt == "what is 0 plus 0 ?" and rows[5].answer == "3"
    p = FilePrompts(rows, rows[:2], seed=1)
    passes = [[p.text(6 * k + i) for i in range(6)] for k in range(3)]
    assert all(sorted(x) == sorted(r.prompt for r in rows) for x in passes)  # every prompt once a pass
    assert passes[0] != passes[1] or passes[1] != passes[2]  # reshuffled
    assert passes[0] == [FilePrompts(rows, None, seed=1).text(i) for i in range(6)]  # by the seed alone
    assert [p.text(i, held_out=True) for i in range(3)] == [rows[0].prompt, rows[1].prompt, rows[0].prompt]
    assert p.answer(0) == next(r.answer for r in rows if r.prompt == p.text(0))


BAD_ROWS = {
    "missing answer": ('{"prompt": "x"}\n', "line 1: no 'answer'"),
    "null prompt": ('{"prompt": "a", "answer": "b"}\n\n{"prompt": null, "answer": "b"}\n', "line 3: no 'prompt'"),
    "number answer": ('{"prompt": "a", "answer": 4}\n', "line 1: 'answer' is a int, not a string"),
    "blank prompt": ('{"prompt": "  ", "answer": ""}\n', "line 1: 'prompt' is empty"),
    "a list": ('["a", "b"]\n', "line 1: a list, not an object"),
    "not json": ('{"prompt": "a", "answer": "b"}\n{"prompt": \n', "line 2: not JSON"),
    "not utf-8": (b'{"prompt": "a", "answer": "b"}\n{"prompt": "\xff", "answer": "b"}\n', "line 2: not UTF-8"),
    "empty": ("\n  \n", "holds no prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_prompt_file_names_the_line(case, tmp_path):
    text, fragment = BAD_ROWS[case]
    f = tmp_path / "p.jsonl"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PromptFileError, match=fragment):
        read_prompts(f)
    with pytest.raises(ValueError, match=f"task.prompts = '{f}': {fragment}.*; fix: give a .jsonl file"):
        with_changes(Scenario(), {"task.prompts": str(f)})


def test_parquet_without_pyarrow_names_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow then fails as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    prompt_file._read.cache_clear()
    f = tmp_path / "p.parquet"
    f.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"task.prompts = .*needs pyarrow, which is not installed; fix: pip install 'asyncrl\[parquet\]'"):
        with_changes(Scenario(), {"task.prompts": str(f)})


def test_parquet_rows_are_read_like_json_lines(tmp_path, prompts_file):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = read_prompts(prompts_file)
    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": [r.prompt for r in rows], "answer": [r.answer for r in rows], "id": list(range(6))}), f)
    assert read_prompts(f) == rows
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["b", "c"]}), f)
    with pytest.raises(PromptFileError, match="row 2: no 'prompt'"):
        read_prompts(f)
    pq.write_table(pa.table({"question": ["a"]}), f)
    with pytest.raises(PromptFileError, match="has no column 'prompt'"):
        read_prompts(f)


# -- reward.fn ------------------------------------------------------------------------------
def test_a_prompt_file_is_scored_by_exact_match_unless_reward_fn_says_otherwise(tiny_model_dir, tmp_path):
    f = tmp_path / "letters.jsonl"
    f.write_text('{"prompt": "a b =", "answer": "b a"}\n')
    task = task_from(TaskSpec(prompts=str(f)), 0, tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("b a", add_special_tokens=False)
    assert task.tokens(0).tolist() == tok.encode("<bos> a b =", add_special_tokens=False)
    assert task.reward(0, ids + [tok.eos_token_id]) == 1.0
    assert task.reward(0, ids) == 0.0  # ran into the cap: no answer given
    assert task.reward(0, tok.encode("a b", add_special_tokens=False) + [tok.eos_token_id]) == 0.0


def test_reward_fn_gets_the_prompt_the_response_the_answer_and_whether_it_ended(tiny_model_dir, prompts_file):
    task = task_from(TaskSpec(prompts=str(prompts_file)), 0, tiny_model_dir, RewardSpec(fn="tests.byo_reward:length_share"))
    tok = load_tokenizer(tiny_model_dir)
    byo_reward.calls.clear()
    words = tok.encode("a b c", add_special_tokens=False)
    assert task.reward(2, words + [tok.eos_token_id] + words) == 3 / 8  # what follows <eos> is not the response
    assert task.reward(2, words) == 0.0
    prompt, answer = task.prompt_text(2), task.prompts.answer(2)
    assert byo_reward.calls == [(prompt, "a b c", answer, True), (prompt, "a b c", answer, False)]
    # On the letters task there is no answer.
    letters = task_from(TaskSpec(), 0, tiny_model_dir, RewardSpec(fn="tests.byo_reward:length_share"))
    letters.reward(0, words + [tok.eos_token_id])
    assert byo_reward.calls[-1] == (letters.prompt_text(0), "a b c", None, True)


@pytest.mark.parametrize("fn", ["not_a_number", "infinite"])
def test_a_reward_that_is_not_a_finite_number_is_an_error_naming_the_function(fn, tiny_model_dir):
    task = task_from(TaskSpec(), 0, tiny_model_dir, RewardSpec(fn=f"tests.byo_reward:{fn}"))
    with pytest.raises(UserCodeError, match=f"reward.fn tests.byo_reward:{fn}: scoring sample 7 of prompt 0 .* returned .*, not a (finite )?number"):
        task.reward(0, [3, 4], sample=7)


def test_reward_fn_may_take_keywords_only_and_more():
    assert load_reward_fn("tests.byo_reward:keywords_only", 5)(prompt="p", response="x 4", answer="4", finished=True) == 1.0
    with pytest.raises(UserCodeError, match="no module 'no_such_pkg'"):
        load_reward_fn("no_such_pkg.rewards:score", 5)


def test_a_prompt_that_leaves_no_room_for_a_response_is_refused_before_the_run(llama_dir, tmp_path):
    from core.real.reward import TaskPrompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b =", "answer": ""}\n\n' + json.dumps({"prompt": "a b c d " * 100, "answer": ""}) + "\n")
    with pytest.raises(ValueError, match=r"task.prompts: the prompt of line 3 is \d+ tokens, leaving no room .* 256 positions; fix: shorten or drop it"):
        TaskPrompts(task_from(TaskSpec(prompts=str(f)), 0, llama_dir, max_positions=256))
    TaskPrompts(task_from(TaskSpec(prompts=str(f)), 0, llama_dir, max_positions=4096))


def test_the_letters_task_runs_on_a_byte_level_tokenizer(llama_dir):
    task = task_from(TaskSpec(), 0, llama_dir)
    tok = load_tokenizer(llama_dir)
    ids = task.tokens(0).tolist()
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == task.prompt_text(0)
    letters = task.prompt_text(0).split()[:-1]
    target = " ".join(letters * (2 * len(letters)))  # 2 k**2 words
    response = tok.encode(target, add_special_tokens=False) + [tok.eos_token_id]
    assert task.reward(0, response) == score_text(task.prompt_text(0), target + " <eos>", 2, 0.0, 0.0) == 1.0


# -- all three on a real run ------------------------------------------------------------------
def test_a_local_run_trains_your_model_on_your_prompts_with_your_reward(llama_dir, prompts_file):
    before = tree(llama_dir)
    sc = with_changes(load(TORCH), {
        "model.path": str(llama_dir), "task.prompts": str(prompts_file), "reward.fn": "tests.byo_reward:length_share",
        "modes": ["async"], "trainer.steps": 2, "trainer.batch_size": 8, "workload.group_size": 4,
        "workload.max_response_len": 12, "rollout.max_num_seqs": 8,
        "task.eval_prompts": str(prompts_file), "eval.every": 1, "eval.prompts": 2, "eval.workers": 1,
    })
    byo_reward.calls.clear()
    system = run_mode(sc, "async")
    m = collect(system)
    assert m["samples/trained"] == 16 and m["samples/lost"] == 0
    rows = {(r.prompt, r.answer) for r in read_prompts(prompts_file)}
    assert len(byo_reward.calls) >= 16 and {(p, a) for p, _, a, _ in byo_reward.calls} <= rows
    assert all(0 <= i["reward_mean"] <= 1 for i in system.trainer.step_info)
    assert system.evaluations and all(e["prompts"] == 2 and 0 <= e["reward_mean"] <= 1 for e in system.evaluations)
    assert tree(llama_dir) == before  # trained on, never written


# -- the tiny model builder writes only where it built -----------------------------------------
@pytest.fixture
def users_dir(tmp_path) -> Path:
    d = tmp_path / "my-model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    (d / "sub" / "notes.txt").write_text("mine")
    return d


def test_tiny_model_path_at_a_users_directory_leaves_every_file_intact(users_dir, tmp_path, capsys):
    before, around = tree(users_dir), sorted(tmp_path.iterdir())
    assert main([TORCH, "--out", str(tmp_path / "run"), *sets(**{"tiny_model.path": users_dir, "modes": "[async]"})]) == 2
    err = one_error(capsys)
    assert f"tiny_model.path = '{users_dir}': exists and is not a tiny model asyncrl built" in err
    assert "fix: to train the model in that directory set model.path to it" in err
    for call in (lambda: ensure(users_dir), lambda: build(users_dir)):
        with pytest.raises(NotOwned):
            call()
    assert tiny_model_main([str(users_dir)]) == 2
    assert tree(users_dir) == before and sorted(tmp_path.iterdir()) == around  # no temporary directory left either


def test_a_build_that_dies_leaves_nothing_at_the_path(tmp_path, monkeypatch):
    from transformers import Qwen2ForCausalLM

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Qwen2ForCausalLM, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_the_builder_replaces_only_its_own_build(tmp_path):
    from core.model.config import TinyModelSpec

    out = ensure(tmp_path / "tiny", TinyModelSpec(layers=1))
    first = tree(out)
    assert ensure(out, TinyModelSpec(layers=1)) == out and tree(out) == first  # kept as it is
    ensure(out, TinyModelSpec(layers=1, seed=1))  # another spec: rebuilt in its place
    assert tree(out) != first and read_model_dir(out).layers == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_model_dir_errors_are_one_line():
    with pytest.raises(ModelDirError, match="^no such directory$"):
        read_model_dir("no/such/dir")


@pytest.mark.runtime
def test_reward_fn_scores_the_same_in_a_serve_replica_process(ray_session, tiny_model_dir, prompts_file):
    """A Serve replica is a Ray actor of RewardService built from the scenario (deploy_reward;
    tests/test_runtimes.py runs it through Serve itself): in its own process it imports the
    function by name, as the Rollouter's process does, and scores the same."""
    from core.real.reward import RewardService, make_task

    sc = with_changes(Scenario(), {
        "tiny_model.path": str(tiny_model_dir), "task.prompts": str(prompts_file), "reward.fn": "tests.byo_reward:length_share",
    }).with_absolute_paths()
    replica = ray_session.remote(RewardService).options(num_cpus=0).remote(sc)
    task = make_task(sc)
    eos = load_tokenizer(tiny_model_dir).eos_token_id
    rng = np.random.default_rng(0)
    for pid in range(4):
        responses = [rng.integers(3, 30, size=int(rng.integers(1, 12))).tolist() + [eos] * (i % 2) for i in range(4)]
        served = ray_session.get(replica.score.remote(pid, 4 * pid, responses), timeout=120)
        assert served == [task.reward(pid, r) for r in responses]
        assert served[1] > 0 and served[0] == 0.0  # ended, and ran into the cap
    ray_session.kill(replica)
    # A function that fails in the replica reaches the caller as the one line of the guard.
    failing = ray_session.remote(RewardService).options(num_cpus=0).remote(with_changes(sc, {"reward.fn": "tests.byo_reward:not_a_number"}))
    with pytest.raises(UserCodeError) as failed:
        ray_session.get(failing.score.remote(2, 8, responses), timeout=120)
    assert str(failed.value.plain()).startswith("reward.fn tests.byo_reward:not_a_number: scoring sample 8 of prompt 2 (line ")
    assert "returned 'high', not a number; fix:" in str(failed.value.plain())
    ray_session.kill(failing)


@pytest.mark.runtime
@pytest.mark.slow
def test_vllm_serves_your_model_and_takes_its_new_weights(llama_dir):
    """One vLLM engine on the Llama directory (18 to 30 s measured on 2 shared cores, most of it vLLM's start)."""
    from safetensors.numpy import load_file

    from core.model.sample import Group, Sample
    from core.real.engine_vllm import VllmEngine

    tok = load_tokenizer(llama_dir)
    prompt = np.asarray([tok.bos_token_id, *tok.encode("a b c =", add_special_tokens=False)])

    def group(uid: int) -> Group:
        samples = [Sample(uid=uid + i, prompt_id=0, index=i, n_prompt=len(prompt), prompt_tokens=prompt) for i in range(2)]
        return Group(prompt_id=0, samples=samples, version=0, admitted_at=0.0)

    async def run() -> list[list[int]]:
        engine = VllmEngine("vllm-byo", llama_dir, max_model_len=256, max_num_seqs=4, temperature=0.0)
        await engine.start()
        weights = load_file(str(llama_dir / "model.safetensors"))
        moved = {k: (v + np.random.default_rng(1).normal(0, 0.5, v.shape)).astype(np.float32) for k, v in weights.items()}
        out = []
        for version, w in ((0, None), (1, moved), (2, weights)):
            if w is not None:
                await engine.update_weights(version, w)
            g = group(10 * version)
            assert await engine.generate(g, 12)
            out.append(list(g.samples[0].response_tokens))
        await engine.close(0.0)
        assert engine.eos_token_id == tok.eos_token_id
        return out

    first, moved, back = asyncio.run(run())
    assert len(first) > 0 and moved != first and back == first  # greedy: the weights alone decide
