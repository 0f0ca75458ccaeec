"""Bad input gives one clear error, exit code 2, and changes nothing, at once.

Every case holds the same: ``python -m harness.run`` (its ``main``, in process) exits 2 and
writes exactly one line on stderr, ``error: ...``, naming the file, the dotted key or the line
and column, and the fix, with no traceback; nothing under the watched directories is written
or removed (their trees are hashed before and after); and it takes less than 5 s.

The cases: bad scenarios (``tests/corpus/scenarios/*.yaml``, each with the fragments its
message must hold on its first line, ``# expect: a | b``); inputs that cannot be committed as
files, built here (UTF-16, FIFOs, files of megabytes, YAML nested thousands deep or made of
aliases that expand to billions of values); ``--set`` and ``--out`` values; and bad run
directories and checkpoints, made by damaging a real stopped run in every way a disk or a user
can, including contents that pass the format check but could not be restored. Last, Ctrl-C
during a run: one line on what was kept, exit code 130.

Then the families of issue 33, each in a section of its own: the user's code (``reward.fn``
imported and called behind one guard: exit 2 when the scenario is checked, exit 1 and one line
naming the sample while the run runs); a user's model directory (safetensors headers, the shard
index, the tokenizer) and prompts longer than its context; env scenarios (spaces the pipeline
cannot take, sizes that could not fit memory, more samplers than can be placed, all refused
before Ray starts); damaged run directories on ``--resume``, argument errors, a user's file in
a finished run, and JSON or YAML nested thousands deep.

Last, issue 40's: small inputs that asked for hours or gigabytes (a sweep of a million points
or workers, a YAML alias bomb, a trillion samples a step); ``harness.calibrate``'s readers (a
damaged spans.json, table of phase times or report), its arguments and the user's files beside
its outputs; loggers that cannot start (a broken install, W&B without a login, an MLflow server
that does not answer); values of the wrong type, and a count written ``1e6``; a failure no check
foresaw (one line naming a file that keeps its traceback, exit 1); the tiny model's file modes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import typing
from pathlib import Path

import annotated_types
import numpy as np
import pytest

from core.model import config, env_config, phase_table
from core.model.bounded_parse import TooNested, loads_json, loads_yaml
from core.model.config import MAX_SAMPLES, TaskSpec, with_changes
from core.model.env_config import MAX_ALPHA, EnvScenario
from core.model.owned import LOCK, STAMP, contents, is_owned
from core.model.prompt_file import PromptRow
from core.real.task import FilePrompts, Task, exact_match
from core.runtimes.run_checkpoint import load_run
from core.store import checkpoint
from harness.run import main
from harness.run_directory import RunDirectory
from harness.scenario import load, load_resolved, load_variants

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "corpus" / "scenarios"
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
SMALL = ["trainer.steps=12", "checkpoint.every=1", "modes=[async]"]


def sets(*items: str) -> list[str]:
    return [a for kv in items for a in ("--set", kv)]


def tree(path: Path) -> dict[str, str]:
    """Every entry under ``path``: a file with a hash of its bytes (its size and mode, if it
    cannot be read), a directory, a link or another kind (a FIFO is never opened): what
    'changes nothing' compares."""
    if not path.exists():
        return {}
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(path))] = f"link {os.readlink(p)}"
        elif p.is_file():
            try:
                out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
            except PermissionError:
                st = p.stat()
                out[str(p.relative_to(path))] = f"unreadable {st.st_size} {st.st_mode:o} {st.st_mtime_ns}"
        else:
            out[str(p.relative_to(path))] = "dir" if p.is_dir() else "other"
    return out


def one_error(capsys) -> str:
    raw = capsys.readouterr().err
    assert raw.count("\n") == 1 and raw.endswith("\n"), f"not one line: {raw!r}"
    err = " ".join(raw.split())
    assert err.startswith("error:") and err.count("error:") == 1, err
    assert "Traceback" not in err and "fix:" in err, err
    assert len(err) < 1000, f"an error line echoes too much: {len(err)} characters"  # never a whole value
    return err


def refused(capsys, argv: list[str], fragments: list[str], *watched: Path, command=main) -> str:
    """``command(argv)`` (harness.run's main unless given): exit 2 with one error line holding every
    fragment, nothing under ``watched`` changed, in less than 5 s; the line."""
    before = [tree(w) for w in watched]
    t0 = time.monotonic()
    rc = command(argv)
    elapsed = time.monotonic() - t0
    err = one_error(capsys)
    assert rc == 2, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert [tree(w) for w in watched] == before  # nothing written, nothing removed
    assert elapsed < 5, f"took {elapsed:.1f} s"  # the issue's bound: refused at once, never after a run or a hang
    return err


def expected(path: Path) -> list[str]:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect:"), f"{path.name}: first line must be '# expect: ...'"
    return [f.strip() for f in first[len("# expect:"):].split("|")]


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.yaml")), ids=lambda p: p.stem)
def test_bad_scenario_corpus(path, tmp_path, capsys):
    # Names the file, and what its first line expects.
    refused(capsys, [str(path), "--out", str(tmp_path / "run")], [str(path), *expected(path)], tmp_path, CORPUS)
    assert list(tmp_path.iterdir()) == []


def test_the_corpus_covers_every_class_of_bad_input():
    """At least 60 cases in all, as the issue asks (files, built inputs, --set, --out, run directories)."""
    n = len(list(CORPUS.glob("*.yaml"))) + len(BUILT) + len(SET_CASES) + len(OUT_CASES) + len(CASES)
    assert n >= 60, n


def _write(name: str, data: bytes) -> "typing.Callable[[Path], Path]":
    def build(d: Path) -> Path:
        (d / name).write_bytes(data)
        return d / name
    return build


def _mkdir(d: Path) -> Path:
    (d / "scenario.yaml").mkdir()
    return d / "scenario.yaml"


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "scenario.yaml")  # opened blocking, reading it would wait for a writer forever
    return d / "scenario.yaml"


def _under_a_file(d: Path) -> Path:
    (d / "notes.txt").write_text("a file, not a directory\n")
    return d / "notes.txt" / "scenario.yaml"


def _unreadable(d: Path) -> Path:
    (d / "scenario.yaml").write_text("name: secret\n")
    (d / "scenario.yaml").chmod(0)
    return d / "scenario.yaml"


def _model_dir_fifo(d: Path) -> Path:
    """model.path at a directory whose config.json is a FIFO: read for the sim's figures, it would block."""
    (d / "model").mkdir()
    os.mkfifo(d / "model" / "config.json")
    (d / "s.yaml").write_text(f"name: bad\nmodel: {{path: {d / 'model'}}}\n")
    return d / "s.yaml"


def _lengths_fifo(d: Path) -> Path:
    os.mkfifo(d / "lengths.json")
    (d / "s.yaml").write_text(f"name: bad\nworkload: {{lengths: {d / 'lengths.json'}}}\n")
    return d / "s.yaml"


def _bomb(last: str) -> bytes:
    """'Billion laughs': nine levels of nine aliases each, 9**9 values once expanded."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return ("\n".join(lines) + f"\n{last}\n").encode()


def _block_nested(depth: int) -> bytes:
    return "".join(f"{'  ' * i}k{i}:\n" for i in range(depth)).encode() + b"  " * depth + b"v\n"


# (what it is, how to build it in a directory, fragments of the error besides the file's name)
BUILT = [
    ("utf16_with_bom", _write("s.yaml", "name: x\n".encode("utf-16")), ["is UTF-16", "fix: save it as UTF-8"]),
    ("utf32_with_bom", _write("s.yaml", "name: x\n".encode("utf-32")), ["is UTF-32", "fix: save it as UTF-8"]),
    ("latin1_byte", _write("s.yaml", b"name: bad\nlabel: caf\xe9\n"), ["line 2, column 11 (byte 20)", "0xe9 is not UTF-8", "fix: save the file as UTF-8"]),
    ("nul_character", _write("s.yaml", b"name: a\x00b\n"), ["line 1, column 8", "U+0000", "fix: remove it"]),
    ("empty_file", _write("s.yaml", b""), ["holds no scenario", "fix:"]),
    ("blank_lines_only", _write("s.yaml", b"\n\n   \n"), ["holds no scenario", "fix:"]),
    ("missing_file", lambda d: d / "nowhere.yaml", ["no such file", "fix: pass a scenario YAML"]),
    ("a_directory", _mkdir, ["is a directory", "fix: pass a scenario YAML"]),
    ("a_fifo", _fifo, ["is not a regular file (a FIFO", "fix: pass a scenario YAML"]),
    ("path_through_a_file", _under_a_file, ["a part of the path is not a directory", "fix:"]),
    ("unreadable", _unreadable, ["cannot be read (permission denied)", "fix: make it readable"]),
    ("two_megabytes", _write("s.yaml", b"# " + b"x" * (2 << 20) + b"\n"), ["more than the 1,048,576", "fix:"]),
    ("nested_5000_deep_flow", _write("s.yaml", b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n"),
     ["line 1, column 35", "nested more than 32 deep", "fix:"]),
    ("nested_40_deep_block", _write("s.yaml", _block_nested(40)), ["line 33, column 65", "nested more than 32 deep", "fix:"]),
    ("int_of_5000_digits", _write("s.yaml", b"seed: " + b"9" * 5000 + b"\n"), ["line 1, column 7", "a number of 5,000 characters", "fix:"]),
    ("alias_bomb", _write("s.yaml", _bomb("name: bad")), ["line 6, column 10", "once its aliases (*name) are expanded", "fix:"]),
    ("alias_bomb_in_a_known_key", _write("s.yaml", _bomb("seeds: *l8")), ["once its aliases", "fix:"]),
    ("undefined_alias", _write("s.yaml", b"name: *nowhere\n"), ["line 1, column 7", "not valid YAML", "found undefined alias"]),
    ("model_config_a_fifo", _model_dir_fifo, ["model.path", "config.json is unreadable: it is not a regular file (a FIFO", "fix:"]),
    ("lengths_file_a_fifo", _lengths_fifo, ["workload.lengths", "is not a regular file", "fix:"]),
    ("duplicate_key_deep_in_a_list", _write("s.yaml", b"name: bad\nfaults:\n  - {kind: kill, kind: slow, at_s: 1}\n"),
     ["line 3, column 18", "'kind' is given twice", "fix:"]),
]


@pytest.fixture(scope="module")
def modes_bind(tmp_path_factory) -> bool:
    """Whether file modes bind this process: not for root (CAP_DAC_OVERRIDE), which reads and
    writes whatever the mode; they do for root without that capability (setpriv
    --bounding-set=-dac_override,-dac_read_search), as for any other user."""
    probe = tmp_path_factory.mktemp("modes") / "probe"
    probe.write_text("")
    probe.chmod(0)
    return not os.access(probe, os.R_OK)


@pytest.mark.parametrize("build,fragments", [c[1:] for c in BUILT], ids=[c[0] for c in BUILT])
def test_built_bad_scenario(build, fragments, tmp_path, capsys, modes_bind):
    if build is _unreadable and not modes_bind:
        pytest.skip("file modes do not bind this process (root): the FIFO, directory and path cases cover the rest")
    inputs = tmp_path / "in"
    inputs.mkdir()
    path = build(inputs)
    try:
        refused(capsys, [str(path), "--out", str(tmp_path / "run")], [str(path), *fragments], tmp_path)
    finally:
        if path.exists() and not path.is_dir():
            path.chmod(0o600)
    assert not (tmp_path / "run").exists()


QUICK_SET = [QUICK, "--no-plots"]
# (--set items, fragments): each names the --set item or the dotted key it set
SET_CASES = [
    (["trainer=5"], ["--set trainer=5", "trainer = 5", "fix:"]),
    (["trainer=5", "trainer.steps=3"], ["--set trainer.steps=3", "'trainer' is not a section", "fix:"]),
    (["=3"], ["--set '=3'", "expected dotted.key=value", "fix: e.g. --set trainer.steps=100"]),
    (["trainer..steps=3"], ["expected dotted.key=value", "fix:"]),
    ([".".join(["a"] * 20) + "=1"], ["expected dotted.key=value", "fix:"]),
    (["seed=" + "9" * 5000], ["--set seed=99999", "line 1, column 1", "a number of 5,000 characters", "fix:"]),
    (["modes=" + "[" * 100 + "]" * 100], ["--set modes=[[[[", "nested more than 32 deep", "fix:"]),
    (["seeds=[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], "
      "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]]"],
     ["once its aliases", "fix:"]),
    (["trainer.step_overhead_s=.inf"], ["trainer.step_overhead_s = inf", "not a finite number", "fix:"]),
    (["sync.latency_s=.inf"], ["sync.latency_s = inf", "not a finite number", "fix:"]),
    (["workload.response_sigma=.nan"], ["workload.response_sigma = nan", "not a finite number", "fix:"]),
    (["trainer.batch_size=9223372036854775808"], ["trainer.batch_size = 9223372036854775808", "fix: use a value <= 10000000"]),
    (["resources.rollout_gpus=1000000000"], ["resources.rollout_gpus = 1000000000", "fix: use a value <= 100000"]),
    (["trainer.steps=1000000000000000000"], ["trainer.steps = 1000000000000000000", "fix: use a value <= 1000000"]),
    (["seeds=[" + ",".join(map(str, range(1001))) + "]"], ["seeds = [0, 1, 2, 3, 4, 5, ...]", "more than 1000 entries", "fix: list at most 1000"]),
    (["name=../x"], ["--set name=../x", "name = '../x'", "may hold only letters", "fix:"]),
    (["modes=async"], ["modes = 'async'", "fix:"]),
    (["faults={kind: kill}"], ["faults = {...}", "fix:"]),
    (["recovery.max_restarts=0", "faults=[{kind: kill, worker: 1, at_step: 5}]"], ["recovery.max_restarts = 0", "RestartsExhausted", "fix: use at least 1"]),
    (["reward.timeout_s=0"], ["reward.timeout_s = 0", "fix: use a value > 0"]),
    (["reward.timeout_s=.inf"], ["reward.timeout_s = inf", "not a finite number", "fix:"]),
    (["reward.on_error=retry"], ["reward.on_error = 'retry'", "fix: use one of 'fail' or 'skip'"]),
]


@pytest.mark.parametrize("items,fragments", SET_CASES, ids=[c[0][-1][:32] for c in SET_CASES])
def test_bad_set_value(items, fragments, tmp_path, capsys):
    refused(capsys, [*QUICK_SET, "--out", str(tmp_path / "run"), *sets(*items)], fragments, tmp_path, ROOT / "scenarios")
    assert list(tmp_path.iterdir()) == []


def _out_under_a_file(d: Path) -> Path:
    (d / "results").write_text("a file the user keeps\n")
    return d / "results" / "run"


def _out_name_too_long(d: Path) -> Path:
    return d / ("r" * 300)  # past the 255 bytes a file system takes


def _out_read_only(d: Path) -> Path:
    (d / "ro").mkdir()
    (d / "ro").chmod(0o555)
    return d / "ro" / "run"


# (how to make the --out path, fragments)
OUT_CASES = [
    (_out_under_a_file, ["--out", "results is not a directory", "fix: pass a path under a directory"]),
    (_out_name_too_long, ["--out", "is longer than 240 bytes", "fix: use a shorter one"]),
    (_out_read_only, ["--out", "ro is not writable", "fix: pass a directory you can write"]),
]


@pytest.mark.parametrize("make,fragments", OUT_CASES, ids=lambda v: getattr(v, "__name__", None))
def test_bad_out(make, fragments, tmp_path, capsys, modes_bind):
    if make is _out_read_only and not modes_bind:
        pytest.skip("file modes do not bind this process (root writes in a read-only directory), so it is not refused")
    out = make(tmp_path)
    try:
        refused(capsys, [*QUICK_SET, "--out", str(out), *sets("trainer.steps=12")], fragments, tmp_path)
    finally:
        for p in tmp_path.iterdir():
            p.chmod(0o755)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A real run stopped after step 6, with its checkpoints: the thing every case damages a copy of."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", "--stop-at-step", "6", *sets(*SMALL)]) == 0
    assert (run / "scenario.json").is_file() and not (run / "summary.json").exists()
    return run


def latest_state(run: Path) -> Path:
    return sorted((run / "async" / "checkpoints").glob("step-*"))[-1] / "state.ckpt"


def _truncate(run: Path) -> None:
    f = latest_state(run)
    f.write_bytes(f.read_bytes()[:200])


def _flip(run: Path) -> None:
    f = latest_state(run)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


def _version(run: Path) -> None:
    f = latest_state(run)
    data = bytearray(f.read_bytes())
    struct.pack_into("<H", data, 8, 9)
    f.write_bytes(bytes(data))


def _magic(run: Path) -> None:
    f = latest_state(run)
    f.write_bytes(b"PK\x03\x04" + f.read_bytes()[4:])


def _empty(run: Path) -> None:
    latest_state(run).write_bytes(b"")


def _missing(run: Path) -> None:
    latest_state(run).unlink()


def _other_scenario(run: Path) -> None:
    """A checkpoint taken of another scenario, copied in over this run's latest."""
    other = run.parent / "other"
    assert main([QUICK, "--out", str(other), "--no-plots", "--stop-at-step", "6", *sets(*SMALL, "seed=7")]) == 0
    shutil.copyfile(latest_state(other), latest_state(run))
    shutil.rmtree(other)


def _scenario_json(run: Path) -> None:
    (run / "scenario.json").write_text('{"trainer": {"steps": "many"}}')


def _scenario_json_garbage(run: Path) -> None:
    (run / "scenario.json").write_bytes(b"\x00\xff{")


def _finished(run: Path) -> None:
    (run / "summary.json").write_text("{}")


def _state_fifo(run: Path) -> None:
    f = latest_state(run)
    f.unlink()
    os.mkfifo(f)


def _state_directory(run: Path) -> None:
    f = latest_state(run)
    f.unlink()
    f.mkdir()


def _restate(change) -> "typing.Callable[[Path], None]":
    """A damage that rewrites the latest checkpoint's state through ``change``, re-encoded so it
    passes every format check (magic, version, checksums): only ``restore`` would have failed."""
    def damage(run: Path) -> None:
        f = latest_state(run)
        snap = checkpoint.decode(f.read_bytes())
        change(snap.state)
        f.write_bytes(checkpoint.encode(snap))
    damage.__name__ = change.__name__
    return damage


def clock_nan(st: dict) -> None:
    st["clock"] = float("nan")


def clock_negative(st: dict) -> None:
    st["clock"] = -5.0


def sync_t1_inf(st: dict) -> None:
    st["sync"]["t1"] = float("inf")


def engine_missing(st: dict) -> None:
    st["engines"].pop()


def engine_time_nan(st: dict) -> None:
    st["engines"][0]["t"] = float("nan")


def engine_state_lacks_keys(st: dict) -> None:
    st["engines"][1] = {"version": 0}


def trainer_step_past_the_end(st: dict) -> None:
    st["trainer"]["step"] = 999


def trainer_missing(st: dict) -> None:
    del st["trainer"]


def ledger_count_a_string(st: dict) -> None:
    st["ledger"]["trained"] = "many"


def ledger_mask_not_base64(st: dict) -> None:
    st["ledger"]["_trained_mask"] = "***"


def queue_counter_negative(st: dict) -> None:
    st["queue"]["counters"]["put"] = -1


def fired_fault_out_of_range(st: dict) -> None:
    st["faults"]["fired"] = [5]


def fault_record_mangled(st: dict) -> None:
    st["faults"]["records"] = [{"kind": "kill"}]


CASES = [
    # (damage, extra argv, fragments of the one error line)
    (_truncate, [], ["state.ckpt", "byte", "truncated", "fix:"]),
    (_flip, [], ["state.ckpt", "byte", "checksum mismatch", "fix:"]),
    (_version, [], ["state.ckpt", "byte 8", "format version 9, this build reads 1", "fix:"]),
    (_magic, [], ["state.ckpt", "byte 0", "not an asyncrl checkpoint", "fix:"]),
    (_empty, [], ["state.ckpt", "byte 0", "truncated", "fix:"]),
    (_missing, [], ["state.ckpt", "no such file", "fix:"]),
    (_other_scenario, [], ["checkpoints/step-", "was taken of scenario", "digest", "fix: resume the run directory this checkpoint belongs to"]),
    (_scenario_json, [], ["scenario.json", "trainer.steps = 'many'", "fix:"]),
    (_scenario_json_garbage, [], ["scenario.json", "unreadable", "fix:"]),
    (_finished, [], ["this run finished", "fix:"]),
    (None, ["--set", "trainer.steps=99"], ["--set trainer.steps=99", "keeps the scenario it started with", "fix:"]),
    (None, [str(ROOT / "scenarios" / "replay-reuse.yaml")], ["replay-reuse.yaml", "is not the scenario", "fix:"]),
    (_state_fifo, [], ["state.ckpt", "is not a regular file (a FIFO", "fix:"]),
    (_state_directory, [], ["state.ckpt", "is a directory", "fix:"]),
    # Contents that pass the format check and fit no run: refused before anything runs.
    (_restate(clock_nan), [], ["state.ckpt", "does not fit this run", "clock = nan", "fix: delete this checkpoint"]),
    (_restate(clock_negative), [], ["state.ckpt", "clock = -5.0 is not a finite number >= 0", "fix:"]),
    (_restate(sync_t1_inf), [], ["state.ckpt", "sync.t1 = inf", "fix:"]),
    (_restate(engine_missing), [], ["state.ckpt", "holds 3 engine states", "async mode has 4 engines", "fix:"]),
    (_restate(engine_time_nan), [], ["state.ckpt", "engines.0.t = nan is not finite", "fix:"]),
    (_restate(engine_state_lacks_keys), [], ["state.ckpt", "engines.1 lacks tokens_generated", "fix:"]),
    (_restate(trainer_step_past_the_end), [], ["state.ckpt", "trainer.step = 999 is not a count from 0 to 12", "fix:"]),
    (_restate(trainer_missing), [], ["state.ckpt", "trainer is NoneType, not the dict", "fix:"]),
    (_restate(ledger_count_a_string), [], ["state.ckpt", "ledger.trained is str, not int", "fix:"]),
    (_restate(ledger_mask_not_base64), [], ["state.ckpt", "ledger._trained_mask is not base64", "fix:"]),
    (_restate(queue_counter_negative), [], ["state.ckpt", "queue.counters.put = -1", "fix:"]),
    (_restate(fired_fault_out_of_range), [], ["state.ckpt", "faults.fired names fault 5, and this run has 0 faults", "fix:"]),
    (_restate(fault_record_mangled), [], ["state.ckpt", "faults.records.0 is not a fault record", "fix:"]),
]


@pytest.mark.parametrize("damage,argv,fragments", CASES, ids=lambda c: getattr(c, "__name__", None) or "")
def test_bad_run_directory_or_checkpoint(stopped_run, tmp_path, capsys, damage, argv, fragments):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    if damage is not None:
        damage(run)
    refused(capsys, ["--resume", str(run), "--no-plots", *argv], fragments, tmp_path)


def test_the_undamaged_checkpoint_fits(stopped_run):
    """The consistency check refuses only what is wrong: the stopped run's own checkpoint passes."""
    sc = load_resolved(stopped_run / "scenario.json")
    assert load_run(stopped_run, sc, "async") is not None


def test_every_count_has_a_ceiling():
    """Every whole-number field of every scenario model has an upper bound of its own (besides
    the 2**53 every number has), so a slip of a few zeros is refused, not run for ever."""
    models = {m for mod in (config, env_config, phase_table) for m in vars(mod).values()
              if isinstance(m, type) and issubclass(m, config._Frozen) and m is not config._Frozen}
    unbounded = []
    for model in models:
        for name, field in model.model_fields.items():
            args = typing.get_args(field.annotation)
            if field.annotation is int or (int in args and type(None) in args):
                if not any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in field.metadata):
                    unbounded.append(f"{model.__name__}.{name}")
    assert len(models) > 20 and not unbounded, unbounded


def test_resume_needs_a_run_directory(tmp_path, capsys):
    assert main(["--resume", str(tmp_path / "nope")]) == 2
    assert "no such directory" in one_error(capsys)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert main(["--resume", str(plain)]) == 2
    assert "carries no stamp of a run asyncrl wrote" in one_error(capsys)
    assert list(plain.iterdir()) == []


def test_resume_refuses_a_users_directory_that_holds_a_scenario_json(stopped_run, tmp_path, capsys):
    """A copy of a stopped run's files in a directory asyncrl did not create (no stamp): resuming
    it would write a whole run over the user's metrics and traces."""
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(stopped_run, mine, ignore=shutil.ignore_patterns(".asyncrl*"))
    before = tree(mine)
    t0 = time.monotonic()
    assert main(["--resume", str(mine)]) == 2
    assert "carries no stamp of a run asyncrl wrote" in one_error(capsys)
    assert tree(mine) == before and time.monotonic() - t0 < 5


def test_stop_at_step_needs_checkpoints_and_a_step_in_range(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([QUICK, "--out", str(out), "--stop-at-step", "3", *sets("trainer.steps=12")]) == 2
    assert "--set checkpoint.every=1" in one_error(capsys)
    assert main([QUICK, "--out", str(out), "--stop-at-step", "12", *sets(*SMALL)]) == 2
    assert "between 1 and trainer.steps - 1 = 11" in one_error(capsys)
    assert not out.exists()


def test_a_damaged_checkpoint_fails_before_any_mode_runs(stopped_run, tmp_path, capsys):
    """A run of two modes, the first finished: damage the second's checkpoint, and the resume
    refuses before it runs anything (the finished mode's report is untouched)."""
    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", "--stop-at-step", "6", *sets(*SMALL[:2], "modes=[sync,async]")]) == 0
    capsys.readouterr()
    assert not (run / "async").exists()  # stopped in the first mode
    _truncate_mode(run, "sync")
    before = tree(run)
    assert main(["--resume", str(run), "--no-plots"]) == 2
    assert "truncated" in one_error(capsys)
    assert tree(run) == before


def _truncate_mode(run: Path, mode: str) -> None:
    f = sorted((run / mode / "checkpoints").glob("step-*"))[-1] / "state.ckpt"
    f.write_bytes(f.read_bytes()[:100])


def test_no_traceback_from_the_command_line(stopped_run, tmp_path):
    """The same, through the real entry point: exit code 2, one line, no traceback."""
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    _flip(run)
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "--resume", str(run)], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env={**os.environ, "ASYNCRL_PUREPYTHON": os.environ.get("ASYNCRL_PUREPYTHON", "0")},
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1
    assert "checksum mismatch" in " ".join(proc.stderr.split())


def test_a_stopped_run_resumes_to_the_uninterrupted_report(stopped_run, tmp_path, capsys):
    """Through the command line: the resumed run's reports equal the uninterrupted run's
    (wall-clock fields aside)."""
    from harness.metrics import WALL_CLOCK_KEYS

    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    assert main(["--resume", str(run), "--no-plots"]) == 0
    full = tmp_path / "full"
    assert main([QUICK, "--out", str(full), "--no-plots", *sets(*SMALL)]) == 0
    a, b = (json.loads((d / "async" / "report.json").read_text()) for d in (run, full))
    for rep in (a, b):
        rep.pop("created_at")
        for k in WALL_CLOCK_KEYS:
            rep["metrics"].pop(k, None)
    assert a == b


# The command line as a user's shell runs it, except that SIGINT is handled even where the
# test runner's own parent ignores it (a background job), as a terminal's Ctrl-C would be.
_CLI = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'harness.run'; runpy.run_module('harness.run', run_name='__main__', alter_sys=True)")


def _interrupt(argv: list[str], ready, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run the command line, send it SIGINT once ``ready()`` (a file the run writes appears;
    polled, never a blind sleep), and wait for it."""
    proc = subprocess.Popen([sys.executable, "-c", _CLI, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ASYNCRL_PUREPYTHON": os.environ.get("ASYNCRL_PUREPYTHON", "0")})
    try:
        deadline = time.monotonic() + 120
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it was interrupted: {proc.communicate()}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_keeps_the_checkpoints_and_says_how_to_resume(tmp_path):
    run = tmp_path / "run"
    # Long enough that it is still running when its second checkpoint appears.
    argv = [QUICK, "--out", str(run), "--no-plots", *sets("trainer.steps=100000", "checkpoint.every=1", "modes=[async]")]
    proc = _interrupt(argv, lambda: len(list(run.glob("async/checkpoints/step-*"))) >= 2, tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"its checkpoints are kept in {run}" in proc.stderr
    assert f"python -m harness.run --resume {run}" in proc.stderr
    sc = load_resolved(run / "scenario.json")
    assert load_run(run, sc, "async") is not None  # what the line promises: a checkpoint --resume takes


def test_ctrl_c_of_a_run_without_checkpoints_keeps_nothing(tmp_path):
    run = tmp_path / "run"
    argv = [QUICK, "--out", str(run), "--no-plots", *sets("trainer.steps=100000", "modes=[async]")]
    proc = _interrupt(argv, lambda: (run / "async").is_dir(), tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "nothing was kept (the partial run directory was removed)" in proc.stderr
    assert list(tmp_path.iterdir()) == []


# -- the user's code: reward.fn imported and called behind one guard --------------------------
# Each module is written under a name of its own: an import that hung keeps its module's lock.
IMPORT_CASES = [
    # (id, the module's source, --set items besides reward.fn, fragments)
    ("exits_0", "import sys\nsys.exit(0)\n", [], ["reward.fn", "importing", "called sys.exit(0)", "fix: name an importable"]),
    ("exits_message", "import sys\nsys.exit('no GPU here')\n", [], ["importing", "called sys.exit('no GPU here')", "fix:"]),
    ("keyboard_interrupt", "raise KeyboardInterrupt\n", [], ["importing", "raised KeyboardInterrupt", "fix:"]),
    ("sleeps_forever", "import time\ntime.sleep(1e6)\n", ["reward.timeout_s=1"], ["importing", "did not return within 1 s", "fix:"]),
    ("recursion", "def f():\n    return f()\nf()\n", [], ["importing", "recursed without end (RecursionError)", "fix:"]),
    ("syntax_error", "def score(prompt, response, answer, finished)\n    return 1\n", [], ["importing", "raised SyntaxError", "fix:"]),
    ("long_multiline_message", "raise RuntimeError('x' * 5000 + '\\nsecond line')\n", [], ["importing", "raised RuntimeError: xxx", "fix:"]),
    ("getattr_raises", "def __getattr__(name):\n    raise OSError('lazy import failed')\n", [],
     ["looking up 'score' raised OSError: lazy import failed", "fix:"]),
    ("a_class_without_the_keywords", "class score:\n    def __init__(self, text): pass\n", [], ["cannot be called as fn(prompt, response, answer, finished)", "fix:"]),
]


def _user_module(tmp_path: Path, monkeypatch, case: str, source: str) -> str:
    """``source`` as a module importable by a name no other case uses; its name."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    name = f"user_reward_{case}_{os.getpid()}_{time.monotonic_ns()}"
    (code / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(code))
    return name


@pytest.mark.parametrize("source,items,fragments", [c[1:] for c in IMPORT_CASES], ids=[c[0] for c in IMPORT_CASES])
def test_a_reward_module_that_fails_as_it_is_imported(source, items, fragments, tmp_path, capsys, monkeypatch):
    """Checked with the scenario: exit 2, one line, within the import's timeout plus 5 s."""
    name = _user_module(tmp_path, monkeypatch, "imp", source)
    refused(capsys, [*QUICK_SET, "--out", str(tmp_path / "run"), *sets(f"reward.fn={name}:score", *items)],
            [f"reward.fn = '{name}:score'", *fragments], tmp_path, ROOT / "scenarios")
    assert not (tmp_path / "run").exists()


REWARD_BODIES = [
    # (id, the function's body, fragments): each fails at its first call, while the run runs
    ("raises", "raise ValueError('cannot parse the answer')", ["raised ValueError: cannot parse the answer"]),
    ("returns_nan", "return float('nan')", ["returned nan, not a finite number"]),
    ("returns_a_string", "return 'high'", ["returned 'high', not a number"]),
    ("returns_none", "return None", ["returned None, not a number"]),
    ("returns_1e400", "return 1e400", ["returned inf, not a finite number"]),
    ("returns_a_huge_int", "return 10 ** 400", ["returned an int of 1329 bits, not a finite number"]),
    ("returns_an_object", "return object()", ["returned a object, not a number"]),
    ("returns_a_list", "return [1.0]", ["returned a list, not a number"]),
    ("recurses", "return score(prompt, response, answer, finished)", ["recursed without end (RecursionError)"]),
    ("calls_sys_exit", "import sys; sys.exit(3)", ["called sys.exit(3)"]),
    ("raises_keyboard_interrupt", "raise KeyboardInterrupt", ["raised KeyboardInterrupt"]),
    ("sleeps_forever", "import time; time.sleep(1e6)", ["did not return within 1 s"]),
]
# A real run on the tiny model, as short as one that scores anything can be.
REAL_SHORT = [str(ROOT / "scenarios" / "real-cpu-torch.yaml"), "--no-plots",
              *sets("modes=[async]", "trainer.steps=2", "trainer.batch_size=16", "workload.max_response_len=8", "eval.every=0",
                    "reward.timeout_s=1")]


@pytest.fixture
def real_short(tiny_model_dir) -> list[str]:
    """``REAL_SHORT`` on the session's tiny model, built already: a case times the refusal,
    never a first build of the model."""
    return [*REAL_SHORT, *sets(f"tiny_model.path={tiny_model_dir}")]


@pytest.mark.parametrize("body,fragments", [c[1:] for c in REWARD_BODIES], ids=[c[0] for c in REWARD_BODIES])
def test_a_reward_function_that_fails_while_the_run_runs(body, fragments, tmp_path, capsys, monkeypatch, real_short):
    """Exit 1 and one line naming the function, the sample and what it did; the run directory
    (nothing to resume) is removed; under 5 s past the start, plus the call's timeout."""
    pytest.importorskip("torch")
    name = _user_module(tmp_path, monkeypatch, "call", f"def score(prompt, response, answer, finished):\n    {body}\n")
    before = tree(tmp_path)
    t0 = time.monotonic()
    rc = main([*real_short, "--out", str(tmp_path / "run"), *sets(f"reward.fn={name}:score")])
    elapsed = time.monotonic() - t0
    err = one_error(capsys)
    assert rc == 1, err
    assert err.startswith(f"error: reward.fn {name}:score: scoring sample ") and " of prompt " in err, err
    for fragment in [*fragments, "fix: make it return a finite float", "reward.on_error to skip"]:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert tree(tmp_path) == before
    assert elapsed < 5 + 1, f"took {elapsed:.1f} s"


def test_skipping_a_reward_that_fails_on_most_samples_ends_the_run_instead_of_starving_it(tmp_path, capsys, monkeypatch, real_short):
    """reward.on_error: skip drops a group now and then; a function that fails on most calls
    would drop every group, and the trainer would wait for ever: one line, exit 1."""
    pytest.importorskip("torch")
    name = _user_module(tmp_path, monkeypatch, "skip_all", "def score(prompt, response, answer, finished):\n    raise KeyError('answer')\n")
    assert main([*real_short, "--out", str(tmp_path / "run"), *sets(f"reward.fn={name}:score", "reward.on_error=skip")]) == 1
    err = one_error(capsys)
    assert "raised KeyError: 'answer' (16 of its 16 calls failed, more than half; skipping drops a group now and then" in err, err
    assert "fix: make it score most responses" in err
    assert not (tmp_path / "run").exists()


def test_a_reward_that_fails_on_one_sample_in_a_thousand_ends_the_run_or_is_skipped(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """The issue's case: one call in 1,000 raises. By default the run ends in one line naming
    that sample; with reward.on_error: skip its group is dropped with a reason, and the run
    finishes with nothing lost."""
    pytest.importorskip("torch")
    source = ("calls = 0\n"
              "def score(prompt, response, answer, finished):\n"
              "    global calls\n"
              "    calls += 1\n"
              "    if calls % 1000 == 700:\n"
              "        raise ValueError(f'call {calls}')\n"
              "    return min(1.0, len(response.split()) / 8) if finished else 0.0\n")
    run = [str(ROOT / "scenarios" / "real-cpu-torch.yaml"), "--no-plots",
           *sets("modes=[async]", "trainer.steps=20", "trainer.batch_size=64", "workload.max_response_len=16", "eval.every=0",
                 f"tiny_model.path={tiny_model_dir}")]
    name = _user_module(tmp_path, monkeypatch, "one_in_1000", source)
    assert main([*run, "--out", str(tmp_path / "failed"), *sets(f"reward.fn={name}:score")]) == 1
    err = one_error(capsys)
    assert f"reward.fn {name}:score: scoring sample " in err and "raised ValueError: call 700; fix:" in err, err
    assert not (tmp_path / "failed").exists()

    name = _user_module(tmp_path, monkeypatch, "one_in_1000_skip", source)
    out = tmp_path / "skipped"
    assert main([*run, "--out", str(out), *sets(f"reward.fn={name}:score", "reward.on_error=skip")]) == 0
    m = json.loads((out / "async" / "report.json").read_text())["metrics"]
    assert m["samples/dropped_reward_error"] == 8  # one group of 8, for the one failed call in 1,280
    assert m["samples/lost"] == 0 and m["samples/in_flight"] == 0
    assert m["samples/produced"] == m["samples/trained"] + m["samples/dropped"] and m["samples/trained"] == 20 * 64

# ==== A user's model directory and prompts ========================================================
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The files save_pretrained writes; asyncrl's stamps are left out, so the copy is a user's.
MODEL_FILES = ("config.json", "generation_config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json")
EMBED = "model.embed_tokens.weight"  # [40, 128] F32, the first tensor of the data
NORM0, NORM0_POST = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"  # both [128] F32


@pytest.fixture(scope="session")
def users_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model as a user's directory: only what save_pretrained writes."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("users") / "my-model"
    out.mkdir()
    for f in MODEL_FILES:
        shutil.copy(tiny_model_dir / f, out / f)
    return out


def scenario(d: Path, model: Path, prompts: typing.Optional[Path] = None, eval_prompts: typing.Optional[Path] = None,
             truncation: str = "") -> Path:
    """A local run of ``model`` on the torch engine, small enough to be checked at once."""
    task = {k: str(v) for k, v in (("prompts", prompts), ("eval_prompts", eval_prompts)) if v is not None}
    text = (
        "name: users-model\nruntime: local\nmodes: [async]\nengine: {kind: torch}\n"
        "resources: {rollout_gpus: 1, trainer_gpus: 1}\n"
        f"model: {{path: {model}}}\n"
        "workload: {group_size: 4, max_response_len: 64}\n"
        "trainer: {batch_size: 8, steps: 2, sync_every: 1}\n"
        "rollout: {max_num_seqs: 8}\n"
        f"eval: {{every: {1 if eval_prompts else 0}, prompts: 2, workers: 1}}\n"
        + (f"task: {json.dumps({**task, **({'prompt_truncation': truncation} if truncation else {})})}\n" if task else "")
    )
    (d / "s.yaml").write_text(text)
    return d / "s.yaml"


# -- damage: the safetensors header -------------------------------------------------------------
def _split(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _put(f: Path, text: bytes, data: bytes) -> None:
    f.write_bytes(struct.pack("<Q", len(text)) + text + data)


def header(name: str, change: typing.Callable[[dict], object], raw: typing.Optional[str] = None):
    """A damage that edits the header of the weights, keeping their data; ``raw``: text put in
    place of the JSON string "@" the edit left, for a value json.dumps cannot write."""
    def damage(model: Path) -> None:
        h, data = _split(model / WEIGHTS)
        change(h)
        text = json.dumps(h)
        if raw is not None:
            text = text.replace('"@"', raw)
        _put(model / WEIGHTS, text.encode(), data)
    damage.__name__ = name
    return damage


def field(name: str, tensor: str, key: str, value: object, index: typing.Optional[int] = None, raw: typing.Optional[str] = None):
    """A damage that sets one field of one tensor's header entry (``index``: one element of it)."""
    def change(h: dict) -> None:
        if index is None:
            h[tensor][key] = value
        else:
            h[tensor][key][index] = value
    return header(name, change, raw)


def _overlap(h: dict) -> None:
    h[NORM0_POST]["data_offsets"] = list(h[NORM0]["data_offsets"])


def header_deeply_nested(model: Path) -> None:
    h, data = _split(model / WEIGHTS)
    text = json.dumps(h).replace("[40, 128]", "[" * 100_000 + "]" * 100_000)  # json.loads: RecursionError
    _put(model / WEIGHTS, text.encode(), data)


def header_longer_than_the_file(model: Path) -> None:
    f = model / WEIGHTS
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])


def header_length_huge(model: Path) -> None:
    f = model / WEIGHTS
    f.write_bytes(struct.pack("<Q", 10**12) + f.read_bytes()[8:])


def weights_truncated(model: Path) -> None:
    f = model / WEIGHTS
    f.write_bytes(f.read_bytes()[:-1000])


def weights_with_bytes_after(model: Path) -> None:
    with (model / WEIGHTS).open("ab") as fh:
        fh.write(b"\0" * 16)


def weights_of_five_bytes(model: Path) -> None:
    (model / WEIGHTS).write_bytes(b"\x01\x02\x03\x04\x05")


def header_not_json(model: Path) -> None:
    _, data = _split(model / WEIGHTS)
    _put(model / WEIGHTS, b"{'not': json}", data)


def header_not_utf8(model: Path) -> None:
    _, data = _split(model / WEIGHTS)
    _put(model / WEIGHTS, b'{"\xff": 1}', data)


def header_a_list(model: Path) -> None:
    _put(model / WEIGHTS, b"[]", b"")


def weights_a_fifo(model: Path) -> None:
    (model / WEIGHTS).unlink()
    os.mkfifo(model / WEIGHTS)


# -- damage: the shard index --------------------------------------------------------------------
def index(name: str, text: typing.Union[str, typing.Callable[[dict], object]]):
    """A damage that adds a shard index: ``text`` as it is, or the index of the weights as
    save_pretrained writes it, edited by ``text``."""
    def damage(model: Path) -> None:
        if isinstance(text, str):
            (model / INDEX).write_text(text)
            return
        h, _ = _split(model / WEIGHTS)
        obj = {"metadata": {"total_size": 1204736}, "weight_map": {k: WEIGHTS for k in h if k != "__metadata__"}}
        text(obj)
        (model / INDEX).write_text(json.dumps(obj))
    damage.__name__ = name
    return damage


def shard(name: str):
    """An index edit: the embedding's shard named ``name``."""
    return lambda obj: obj["weight_map"].update({EMBED: name})


def index_a_fifo(model: Path) -> None:
    os.mkfifo(model / INDEX)


# -- damage: the tokenizer ----------------------------------------------------------------------
def tokenizer_garbage(model: Path) -> None:
    (model / "tokenizer.json").write_bytes(b"\x89PNG not a tokenizer")


def tokenizer_truncated(model: Path) -> None:
    f = model / "tokenizer.json"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def tokenizer_a_directory(model: Path) -> None:
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").mkdir()


def tokenizer_a_fifo(model: Path) -> None:
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")


def tokenizer_json_transformers_cannot_load(model: Path) -> None:
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel", "vocab": 5}}')


def tokenizer_a_list(model: Path) -> None:
    (model / "tokenizer.json").write_text("[1, 2, 3]")


def tokenizer_config_garbage(model: Path) -> None:
    (model / "tokenizer_config.json").write_text('{"bos_token": "<bos>",')


# (damage, fragments of the one error line besides model.path = '<dir>')
MODEL_CASES = [
    # json.dumps writes inf as Infinity, and json reads 1e400 as inf: int(inf) raised OverflowError.
    (field("shape_inf", EMBED, "shape", float("inf"), 0), [f"{WEIGHTS}: header: {EMBED}.shape[0] = inf is not a whole number >= 0"]),
    (field("shape_1e400", EMBED, "shape", "@", 0, raw="1e400"), [f"{WEIGHTS}: header: {EMBED}.shape[0] = inf is not a whole number >= 0"]),
    (field("shape_negative", EMBED, "shape", -40, 0), [f"{EMBED}.shape[0] = -40 is not a whole number >= 0"]),
    (field("shape_bool", EMBED, "shape", True, 0), [f"{EMBED}.shape[0] = True is not a whole number >= 0"]),
    (field("shape_float", EMBED, "shape", 40.0, 0), [f"{EMBED}.shape[0] = 40.0 is not a whole number >= 0"]),
    (field("shape_huge", EMBED, "shape", 2**50, 0), [f"{EMBED}.shape[0] = 1125899906842624 is more than 1,099,511,627,776"]),
    (field("shape_not_a_list", EMBED, "shape", "40x128"), [f"{EMBED}.shape = '40x128' is not a list of dimensions"]),
    (header_deeply_nested, [f"{WEIGHTS} is not a readable safetensors file", "of its header, values are nested more than 3 deep"]),
    (field("dtype_unknown", EMBED, "dtype", "F33"), [f"{WEIGHTS}: header: {EMBED}.dtype = 'F33' is not a safetensors dtype (F64, F32"]),
    (field("dtype_a_number", EMBED, "dtype", 4), [f"{EMBED}.dtype = 4 is not a safetensors dtype"]),
    (field("offsets_one_number", EMBED, "data_offsets", [0]), [f"{EMBED}.data_offsets = [0] is not [begin, end], two whole numbers >= 0"]),
    (field("offsets_reversed", EMBED, "data_offsets", [20480, 0]), [f"{EMBED}.data_offsets = [20480, 0] end before they begin"]),
    (field("offsets_past_the_file", "model.norm.weight", "data_offsets", [1001204224, 1001204736]), ["model.norm.weight.data_offsets = [1001204224, 1001204736] reach past the 1,204,736 bytes of data"]),
    (header("offsets_overlap", _overlap), [f"{NORM0_POST}.data_offsets = [20480, 20992] overlap those of {NORM0}, which end at 20992"]),
    (field("shape_disagrees_with_offsets", NORM0, "shape", [129]), [f"{NORM0}.data_offsets = [20480, 20992] hold 512 bytes, and shape [129] of F32 takes 516"]),
    (header("tensor_not_an_object", lambda h: h.update({EMBED: [40, 128]})), [f"{WEIGHTS}: header: {EMBED} is a list, not an object of dtype, shape and data_offsets"]),
    (header("tensor_without_offsets", lambda h: h[EMBED].pop("data_offsets")), [f"{WEIGHTS}: header: {EMBED} has no data_offsets"]),
    (header("metadata_not_strings", lambda h: h.update({"__metadata__": {"format": 1}})), [f"{WEIGHTS}: header: __metadata__ is not an object of strings"]),
    (weights_truncated, ["reach past the 1,203,736 bytes of data the file holds (truncated?)"]),
    (weights_with_bytes_after, [f"{WEIGHTS}: header: its tensors end at byte 1,204,736 of the data, and 16 more bytes follow them"]),
    (header_longer_than_the_file, [f"{WEIGHTS} is not a readable safetensors file: its header length says", "(truncated?)"]),
    (header_length_huge, ["its header length says 1,000,000,000,000 bytes, more than the 100,000,000 a header may have"]),
    (weights_of_five_bytes, [f"{WEIGHTS} is not a readable safetensors file: it is 5 bytes, fewer than the 8"]),
    (header_not_json, [f"{WEIGHTS} is not a readable safetensors file: its header is not JSON"]),
    (header_not_utf8, ["its header is not UTF-8 (byte 10)"]),
    (header_a_list, [f"{WEIGHTS}: header is a list, not an object of tensors"]),
    (weights_a_fifo, [f"{WEIGHTS} is not a regular file (a FIFO, socket or device)"]),
    (index("index_int_file_names", shard(1)), [f"{INDEX}: weight_map['{EMBED}'] = 1 is a number, not a file name"]),
    (index("index_outside_the_directory", shard("../x.safetensors")), [f"weight_map['{EMBED}'] = '../x.safetensors' is not the name of a file in the directory"]),
    (index("index_names_a_missing_shard", shard("model-00002-of-00002.safetensors")), [f"{INDEX}: weight_map names 'model-00002-of-00002.safetensors', which is not there"]),
    (index("index_names_a_pickle", shard("pytorch_model.bin")), [f"weight_map['{EMBED}'] = 'pytorch_model.bin' is not a .safetensors file"]),
    (index("index_weight_map_a_list", lambda obj: obj.update(weight_map=[1, 2])), [f"{INDEX}: weight_map is a list, not an object of tensor name: file name"]),
    (index("index_weight_map_empty", lambda obj: obj.update(weight_map={})), [f"{INDEX}: weight_map names no file"]),
    (index("index_without_weight_map", lambda obj: obj.pop("weight_map")), [f"{INDEX} has no weight_map"]),
    (index("index_a_list", "[1, 2]"), [f"{INDEX} holds a list, not an object with a weight_map"]),
    (index("index_deeply_nested", '{"weight_map": ' + "[" * 50_000 + "]" * 50_000 + "}"),
     [f"{INDEX}: line 1, column 19: values are nested more than 4 deep"]),
    (index("index_truncated", '{"weight_map": {'), [f"{INDEX} is not JSON"]),
    (index_a_fifo, [f"{INDEX} is unreadable: it is not a regular file (a FIFO"]),
    (tokenizer_garbage, ["tokenizer.json is unreadable (not UTF-8 at byte 0)"]),
    (tokenizer_truncated, ["tokenizer.json is not JSON ("]),
    (tokenizer_a_directory, ["tokenizer.json is unreadable: it is a directory, not a file"]),
    (tokenizer_a_fifo, ["tokenizer.json is unreadable: it is not a regular file (a FIFO"]),
    (tokenizer_json_transformers_cannot_load, ["loading its tokenizer raised Exception:", "fix: give a directory whose tokenizer loads"]),
    (tokenizer_a_list, ["tokenizer.json does not hold a JSON object"]),
    (tokenizer_config_garbage, ["tokenizer_config.json is not JSON ("]),
]


@pytest.mark.parametrize("damage,fragments", MODEL_CASES, ids=[c[0].__name__ for c in MODEL_CASES])
def test_a_damaged_model_directory_is_one_line(damage, fragments, users_model, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(users_model, model)
    damage(model)
    refused(capsys, [str(scenario(tmp_path, model)), "--out", str(tmp_path / "run")], [f"model.path = '{model}'", *fragments, "fix:"], tmp_path)
    assert not (tmp_path / "run").exists()


def _prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "a"}) + "\n" for p in prompts))
    return path


def test_a_prompt_longer_than_the_context_is_refused_naming_its_line(users_model, tmp_path, capsys):
    # max_positions 512 less max_response_len 64 leaves a prompt 448 tokens: a word is a token here.
    prompts = _prompts(tmp_path / "p.jsonl", ["a b =", "c d =", "a " * 500 + "="])
    refused(capsys, [str(scenario(tmp_path, users_model, prompts)), "--out", str(tmp_path / "run")],
            [f"task.prompts = '{prompts}': the prompt of line 3 is 502 tokens, more than the 448 that model.max_positions = 512 "
             "leaves beside workload.max_response_len = 64", "fix: shorten or drop it", "task.prompt_truncation: left"], tmp_path)


def test_a_held_out_prompt_too_long_is_refused_too(users_model, tmp_path, capsys):
    prompts = _prompts(tmp_path / "p.jsonl", ["a b ="])
    held_out = _prompts(tmp_path / "eval.jsonl", ["a b =", "b " * 448 + "="])
    refused(capsys, [str(scenario(tmp_path, users_model, prompts, held_out)), "--out", str(tmp_path / "run")],
            [f"task.eval_prompts = '{held_out}': the prompt of line 2 is 450 tokens, more than the 448", "fix:"], tmp_path)


def test_a_prompt_too_long_for_the_tiny_model_is_refused_as_it_is_built(real_short, tmp_path, capsys):
    """Without model.path the tokenizer is the tiny model's, built with the run: its prompts are
    counted as it is built, before any worker starts, and refused the same way."""
    prompts = _prompts(tmp_path / "p.jsonl", ["a b =", "c d =", "a b c d e f g h " * 70 + "="])
    refused(capsys, [*real_short, "--out", str(tmp_path / "run"), *sets(f"task.prompts={prompts}")],
            [f"task.prompts = '{prompts}': the prompt of line 3 is", "that tiny_model.max_positions = 512 leaves beside "
             "workload.max_response_len = 8", "fix: shorten or drop it"], tmp_path)


def test_a_good_directory_passes_and_the_check_counts_as_the_run_tokenizes(users_model, tmp_path):
    from core.model.model_dir import read_tokenizer
    from core.real.reward import make_task

    prompts = _prompts(tmp_path / "p.jsonl", ["a b =", "c d e f =", "a " * 446 + "="])  # the last: 448 tokens, <bos> included
    sc = load(scenario(tmp_path, users_model, prompts))
    assert sc.model.path == str(users_model)
    task = make_task(sc)
    counted = read_tokenizer(users_model, plain=False).counts([r.prompt for r in task.prompts.rows])
    assert counted == [4, 6, 448]
    assert sorted(len(task.tokens(i)) for i in range(3)) == counted  # one pass takes each row once
    task.check_lengths()  # and the run agrees: nothing to refuse


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_prompt_truncation_cuts_a_long_prompt_and_says_how_many(truncation, users_model, tmp_path, caplog):
    """``task.prompt_truncation: left`` keeps a prompt's end, ``right`` its beginning, <bos> first
    either way; the scenario passes, and the run warns how many prompts it cuts."""
    from core.real.reward import make_task

    words = [f"{c}" for c in "abcdefgh"] * 60 + ["="]  # 481 words, one token each
    prompts = _prompts(tmp_path / "p.jsonl", ["a b =", " ".join(words)])
    sc = load(scenario(tmp_path, users_model, prompts, truncation=truncation))
    assert sc.task.prompt_truncation == truncation
    task = make_task(sc)
    caplog.set_level(logging.WARNING, logger="core.real.task")
    task.check_lengths()
    assert "task.prompts: 1 of its 2 prompts are longer than the 448 tokens" in caplog.text
    assert f"(task.prompt_truncation: {truncation})" in caplog.text
    long_id = next(i for i in range(2) if task.prompt_text(i) != "a b =")
    ids = task.tokens(long_id).tolist()
    full = task.tokens(1 - long_id).tolist()
    assert len(ids) == 448 and ids[0] == full[0]  # <bos>, and 447 of the text's 481 tokens
    kept = task._decode(ids[1:]).replace(" ", "")  # AutoTokenizer decodes this vocabulary without spaces
    assert kept == "".join(words[-447:] if truncation == "left" else words[:447])


def test_truncation_on_task_tokens():
    """Unit level: 10 positions, 4 for the response, <bos>: 5 tokens of the text are kept."""
    rows = (PromptRow("1 2 3 4 5 6 7 8", "", "line 1"), PromptRow("1 2", "", "line 2"))
    encode = lambda text: [int(w) for w in text.split()]  # noqa: E731
    tasks = {t: Task(FilePrompts(rows, None, seed=0), exact_match, encode, str, bos_id=0, eos_ids=[9], max_positions=10,
                     max_response_len=4, truncation=t) for t in ("error", "left", "right")}
    long_id = next(i for i in range(2) if tasks["left"].prompt_text(i) == rows[0].prompt)
    assert tasks["left"].tokens(long_id).tolist() == [0, 4, 5, 6, 7, 8]
    assert tasks["right"].tokens(long_id).tolist() == [0, 1, 2, 3, 4, 5]
    assert tasks["left"].tokens(1 - long_id).tolist() == [0, 1, 2]  # a prompt that fits is as it is
    with pytest.raises(ValueError, match=r"task.prompts: the prompt of line 1 is 9 tokens, leaving no room for a response of "
                                         r"workload.max_response_len = 4 in the model's 10 positions; fix: shorten or drop it"):
        tasks["error"].check_lengths()
    TaskSpec(prompt_truncation="left")
    with pytest.raises(ValueError, match="prompt_truncation"):
        TaskSpec(prompt_truncation="middle")


def test_the_cases_cover_the_issue():
    assert len(MODEL_CASES) >= 25

# ==== Env scenarios ===============================================================================
DQN = str(ROOT / "scenarios" / "cartpole-dqn.yaml")
PPO = str(ROOT / "scenarios" / "cartpole-ppo.yaml")
def _id(name: str) -> str:
    return f"asyncrl-test/{name}-v0"


@pytest.fixture(scope="module")
def stub_envs():
    """The envs these cases name, registered in this process (a scenario names an env by id
    only); and harness.env_run imported (torch, Ray's module), so that the 5 s bound times the
    refusal, not the import."""
    gym = pytest.importorskip("gymnasium")
    pytest.importorskip("torch")
    import harness.env_run  # noqa: F401

    Box, Discrete = gym.spaces.Box, gym.spaces.Discrete

    class Stub(gym.Env):
        """An env of the given spaces whose episodes never end by themselves."""

        def __init__(self, observation_space, action_space) -> None:
            self.observation_space, self.action_space = observation_space, action_space

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return self.observation_space.sample(), {}

        def step(self, action):
            return self.observation_space.sample(), 0.0, False, False, {}

    def broken(**_):
        raise RuntimeError("the simulator's licence server is unreachable")

    stubs = {
        "TupleObs": (gym.spaces.Tuple((Discrete(3), Box(-1, 1, (2,)))), Discrete(2)),
        "DictObs": (gym.spaces.Dict({"pos": Box(-1, 1, (2,)), "goal": Discrete(4)}), Discrete(2)),
        "DiscreteObs": (Discrete(16), Discrete(4)),
        "ImageObs": (Box(0, 255, (84, 84, 3), np.uint8), Discrete(4)),
        "MultiDiscreteAct": (Box(-1, 1, (4,)), gym.spaces.MultiDiscrete([3, 3])),
        "MultiBinaryAct": (Box(-1, 1, (4,)), gym.spaces.MultiBinary(4)),
        "TupleAct": (Box(-1, 1, (4,)), gym.spaces.Tuple((Discrete(2), Discrete(3)))),
        "DiscreteFrom1": (Box(-1, 1, (4,)), Discrete(3, start=1)),
        "MatrixAct": (Box(-1, 1, (4,)), Box(-1, 1, (2, 2))),
        "NoTimeLimit": (Box(-1, 1, (4,)), Discrete(2)),
        "WideObs": (Box(-1, 1, (100_000,)), Discrete(2)),
    }
    for name, (obs, act) in stubs.items():
        if _id(name) not in gym.registry:
            gym.register(id=_id(name), entry_point=Stub, kwargs={"observation_space": obs, "action_space": act},
                         disable_env_checker=True)
    if _id("Broken") not in gym.registry:
        gym.register(id=_id("Broken"), entry_point=broken, disable_env_checker=True)


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


SYNC = ("modes=[sync]",)  # sizes are checked per mode; sync alone needs no CPUs for actors

# (id, scenario, --set items, fragments of the one error line)
SPACE_CASES = [
    ("tuple_observation", DQN, [f"env.id={_id('TupleObs')}"],
     [f"env.id = '{_id('TupleObs')}'", "observation space is a Tuple of 2 spaces ('Discrete', 'Box')", "takes a Box of one dimension",
      "fix: register an id that wraps the env in gymnasium.wrappers.FlattenObservation"]),
    ("dict_observation", PPO, [f"env.id={_id('DictObs')}"],
     ["observation space is a Dict of 2 spaces (keys 'goal', 'pos')", "takes a Box of one dimension", "fix:"]),
    ("discrete_observation", DQN, [f"env.id={_id('DiscreteObs')}"], ["observation space is Discrete(16)", "fix:"]),
    ("image_observation", DQN, [f"env.id={_id('ImageObs')}"],
     ["observation space is a Box of shape (84, 84, 3) (uint8)", "the networks are MLPs", "fix:"]),
    ("multidiscrete_action", PPO, [f"env.id={_id('MultiDiscreteAct')}"],
     ["action space is a MultiDiscrete of shape (2,)", "the samplers act in Discrete(n) from 0, or for PPO a Box", "fix:"]),
    ("multibinary_action", DQN, [f"env.id={_id('MultiBinaryAct')}"], ["action space is a MultiBinary of shape (4,)", "fix:"]),
    ("tuple_action", PPO, [f"env.id={_id('TupleAct')}"], ["action space is a Tuple of 2 spaces ('Discrete', 'Discrete')", "fix:"]),
    ("discrete_action_from_1", DQN, [f"env.id={_id('DiscreteFrom1')}"], ["action space is Discrete(3, start=1)", "fix:"]),
    ("matrix_of_continuous_actions", PPO, [f"env.id={_id('MatrixAct')}"], ["action space is a Box of shape (2, 2) (float32)", "fix:"]),
    ("continuous_actions_for_dqn", DQN, ["env.id=Pendulum-v1"],
     ["env.id = 'Pendulum-v1'", "DQN needs discrete actions", "fix: use learner: ppo for continuous ones"]),
    ("env_that_fails_to_build", DQN, [f"env.id={_id('Broken')}"],
     ["making it failed (RuntimeError: the simulator's licence server is unreachable)", "fix:"]),
]

# Sizes: each names the key, the bytes the run would hold and this machine's available bytes.
SIZE_CASES = [
    ("n_step_past_the_time_limit", DQN, ["env.n_step=1000000"],
     ["env.n_step = 1000000", "episodes of 'CartPole-v1' end by step 500", "chunks of up to 8,000,248 rows",
      "4,000,132 updates between two chunks", "fix: use at most 500"]),
    # Without a time limit, n_step x envs rows wait in a sampler: 100,003,100,000 rows x 556 bytes.
    ("n_step_memory", DQN, [*SYNC, f"env.id={_id('NoTimeLimit')}", "env.n_step=1000000", "env.envs_per_sampler=100000"],
     ["env.n_step = 1000000", "a sync run would hold at least 55,602,252,309,592 bytes",
      "chunks of up to 100,003,100,000 rows x 556 bytes", "bytes available", "fix: use at most"]),
    # 10,000,000 rows x (8 x 100,000 + 28 + 9) bytes, and PER's trees over 2**24 leaves.
    ("replay_capacity", DQN, [*SYNC, f"env.id={_id('WideObs')}", "replay.capacity=10000000"],
     ["replay.capacity = 10000000", "a sync run would hold at least 8,002,141,429,368 bytes", "the replay: 10,000,000 rows x 800,037 bytes",
      "bytes available", "fix: use at most"]),
    ("envs_per_sampler", DQN, [*SYNC, "env.envs_per_sampler=10000000", "env.send_every=1000"],
     ["env.envs_per_sampler = 10000000", "at least 5,622,653,509,592 bytes", "10,000,000 environments", "bytes available", "fix:"]),
    ("ppo_send_every", PPO, [*SYNC, "env.envs_per_sampler=10000", "env.send_every=1000000"],
     ["env.send_every = 1000000", "at least 2,620,052,574,920 bytes", "bytes available", "fix: use at most"]),
    ("dqn_hidden_widths", DQN, [*SYNC, "dqn.hidden=[1000000, 1000000]"],
     ["dqn.hidden = (1000000, 1000000)", "at least 28,000,235,809,688 bytes", "5 x 4,000,032,000,008 bytes of weights",
      "fix: use layers of at most"]),
    ("eval_episodes", DQN, [*SYNC, f"env.id={_id('WideObs')}", "replay.capacity=1000", "env.eval_episodes=10000000"],
     ["env.eval_episodes = 10000000", "evaluation 8.1 TB", "bytes available", "fix: use at most"]),
    # Each sampler is a process: 100,000 x 180 MiB at least, whatever it holds.
    ("samplers_memory", DQN, ["ray.num_cpus=1", "ray.sampler.num_cpus=0", "ray.learner.num_cpus=1", "env.samplers=100000"],
     ["env.samplers = 100000", "an async run would hold at least 18,951,524,853,704 bytes", "100,000 samplers 18.9 TB", "fix: use at most"]),
]

ALPHA_CASES = [
    ("alpha_1000", DQN, ["replay.alpha=1000"], ["replay.alpha = 1000", "above 7", "overflow the replay's sum tree", "fix: use at most 7"]),
    ("alpha_1e300", DQN, ["replay.alpha=1e300"], ["replay.alpha = '1e300'", "above 7", "fix: use at most 7"]),
]

# More samplers than any machine or cluster could place.
SAMPLER_CASES = [
    ("samplers_100000", DQN, ["env.samplers=100000"], ["env.samplers = 100000", "reserve 100001 CPUs", "fix:"]),
    ("ppo_samplers_100000", PPO, ["env.samplers=100000", "ppo.queue_chunks=100000"], ["env.samplers = 100000", "reserve 100001 CPUs", "fix:"]),
]

ENV_CASES = SPACE_CASES + SIZE_CASES + ALPHA_CASES + SAMPLER_CASES


@pytest.mark.parametrize("scenario,items,fragments", [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
def test_bad_env_scenario(scenario, items, fragments, tmp_path, capsys, stub_envs):
    connected = _ray_connected()
    refused(capsys, [scenario, "--no-plots", "--out", str(tmp_path / "run"), *sets(*items)], fragments, tmp_path, ROOT / "scenarios")
    assert not (tmp_path / "run").exists()
    assert _ray_connected() == connected  # refused before Ray started


def test_the_family_has_its_cases():
    assert len(ENV_CASES) >= 12 and len(SPACE_CASES) >= 8 and len(SIZE_CASES) >= 6


def test_more_samplers_than_the_local_instance_has_cpus_is_refused_before_ray_starts(tmp_path, capsys, stub_envs):
    if _ray_connected():
        pytest.skip("Ray is connected in this process (a test session's cluster): the run would join it, and is checked there")
    err = refused(capsys, [DQN, "--no-plots", "--out", str(tmp_path / "run"), *sets("ray.num_cpus=2", "env.samplers=4")],
                  ["env.samplers = 4", "reserve 5 CPUs", "the local Ray instance would have 2", "fix: use at most 1 sampler,"], tmp_path)
    assert "Ray cluster has" not in err  # counted before ray.init, which would have logged a line of its own
    assert not _ray_connected()


def _check(path: str, *items: str) -> None:
    from harness.env_run import check_new

    check_new(load_variants(path, list(items)), argparse.Namespace(scenario=path, stop_at_step=None))


@pytest.mark.parametrize("path,items", [
    (DQN, ()), (PPO, ()),
    (DQN, ("env.n_step=500",)),  # at the time limit: still taken
    (DQN, ("env.samplers=2", "ray.num_cpus=3", "replay.capacity=1000000", "env.envs_per_sampler=64")),
    (PPO, ("env.samplers=2", "ray.num_cpus=3", "env.send_every=256", "ppo.queue_chunks=2")),
    (PPO, ("env.id=Pendulum-v1", "modes=[sync]")),
    (DQN, (f"env.id={_id('NoTimeLimit')}", "env.n_step=1000", "modes=[sync]")),
], ids=["dqn", "ppo", "dqn_n_step_500", "dqn_bigger", "ppo_bigger", "ppo_continuous", "no_time_limit"])
def test_ordinary_env_scenarios_pass_the_checks(path, items, stub_envs):
    """The checks refuse only what could not run: the shipped scenarios and modest growths pass them."""
    _check(path, "ray.num_cpus=4", *items)


def test_an_ordinary_run_is_counted_at_well_under_a_gigabyte(stub_envs):
    from core.env.footprint import check_memory, total
    from core.env.wiring import env_space

    for path in (DQN, PPO):
        sc = load_variants(path, [])[0].scenario
        space = env_space(sc)
        assert 10**5 < total(sc, space, "sync") < 10**8
        assert total(sc, space, "async") < 10**9  # three actors' processes, mostly
        check_memory(sc, space, available=(2 * 10**9, "a 2 GB machine"))


def test_the_alpha_ceiling_keeps_every_priority_the_learner_sends_finite():
    """MAX_ALPHA's derivation (core/model/env_config.py): priorities lie in [MIN_PRIORITY, float32's
    max + MIN_PRIORITY]; raised to MAX_ALPHA they stay positive and under the replay's limit at its
    most rows, and a little past the ceiling they would not."""
    from core.env.dqn import MIN_PRIORITY

    top, low = float(np.finfo(np.float32).max) + MIN_PRIORITY, MIN_PRIORITY
    leaves = 1 << (MAX_SAMPLES - 1).bit_length()  # replay.capacity's ceiling
    limit = sys.float_info.max / (2 * leaves)
    assert math.pow(top, MAX_ALPHA) <= limit and math.pow(low, MAX_ALPHA) >= sys.float_info.min
    assert math.pow(top, 7.9) > limit
    assert with_changes(EnvScenario(), {"replay.alpha": MAX_ALPHA}).replay.alpha == MAX_ALPHA


def test_the_replay_takes_the_extreme_priorities_at_the_ceiling():
    """On this process's backend (ASYNCRL_PUREPYTHON picks it), the extremes the learner can send."""
    from core.env.dqn import MIN_PRIORITY
    from ext.replay import ReplayBuffer

    buf = ReplayBuffer(4, {"x": ((), np.float32)}, prioritized=True, alpha=MAX_ALPHA, seed=0)
    buf.add({"x": np.zeros(4, np.float32)})
    top = float(np.finfo(np.float32).max) + MIN_PRIORITY
    buf.update_priorities(np.array([0, 1, 2, 3]), np.array([MIN_PRIORITY, top, 1.0, top]))
    _, slots, weights = buf.sample(4, beta=1.0)
    assert np.all(np.isfinite(weights)) and set(slots.tolist()) <= {1, 3}



def test_the_llm_replay_takes_the_extreme_priorities_at_its_alpha_ceiling():
    """A group's priority is held to [MIN_PRIORITY, MAX_PRIORITY] (core/model/config.py); raised to
    MAX_REPLAY_ALPHA both ends fit the replay at its most groups, and past the ceiling the scenario
    is refused (at alpha 1e6 a run ended mid-way: 0.43 ** 1e6 is 0)."""
    from core.model.config import MAX_PRIORITY, MAX_REPLAY_ALPHA, MIN_PRIORITY
    from ext.replay import ReplayBuffer

    leaves = 1 << (MAX_SAMPLES - 1).bit_length()  # replay.capacity_groups' ceiling
    limit = sys.float_info.max / (2 * leaves)
    assert math.pow(MAX_PRIORITY, MAX_REPLAY_ALPHA) <= limit and math.pow(MIN_PRIORITY, MAX_REPLAY_ALPHA) >= sys.float_info.min
    buf = ReplayBuffer(4, {"x": ((), np.float32)}, prioritized=True, alpha=MAX_REPLAY_ALPHA, seed=0)
    buf.add({"x": np.zeros(4, np.float32)})
    buf.update_priorities(np.array([0, 1, 2, 3]), np.array([MIN_PRIORITY, MAX_PRIORITY, 0.43, MAX_PRIORITY]))
    _, slots, weights = buf.sample(4, beta=1.0)
    assert np.all(np.isfinite(weights)) and set(slots.tolist()) <= {1, 3}
    with pytest.raises(ValueError, match="replay.alpha"):
        with_changes(config.Scenario(), {"replay.alpha": 1e6})


def test_the_replay_stage_holds_a_group_s_priority_to_the_range():
    """A user's reward may be any finite float: a spread of 1e300 is drawn as MAX_PRIORITY (raised
    to the ceiling alpha unclipped it would be inf, refused mid-run), no spread as MIN_PRIORITY."""
    from core.model.config import MAX_REPLAY_ALPHA
    from core.model.ledger import Ledger
    from core.model.sample import Group
    from core.pipeline.replay_stage import ReplayStage

    spread = {0: 1e300, 1: 0.0, 2: 0.25, 3: 0.25}
    stage = ReplayStage(queue=None, ledger=Ledger(max_staleness=1), capacity=4, groups_per_step=4, fresh_per_step=4, warm_up=0, prioritized=True,
                        alpha=MAX_REPLAY_ALPHA, beta=1.0, seed=0, priority=lambda g: spread[g.prompt_id])
    stage._add([Group(prompt_id=i, samples=[], version=0, admitted_at=0.0) for i in range(4)])
    stage._draw()  # every group's priority set from its spread
    drawn, weights = stage._draw()
    assert [g.prompt_id for g in drawn] == [0, 0, 0, 0] and np.all(np.isfinite(weights))


# ==== Run directories, arguments, and nesting =====================================================
DEEP = 10_000
NESTED = "[" * DEEP + "]" * DEEP


# -- damaged run directories, resumed ------------------------------------------------------------

def _metrics(run: Path) -> Path:
    return run / "async" / "metrics.jsonl"


def _report(run: Path) -> Path:
    """Where a finished mode's report is: one there marks async finished."""
    return run / "async" / "report.json"


def _link_to_passwd(path: Path) -> None:
    if path.exists():
        path.unlink()
    path.symlink_to("/etc/passwd")


def _make_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def metrics_garbage(run):
    _metrics(run).write_text("garbage\n{{{\n")


def metrics_binary(run):
    _metrics(run).write_bytes(b"\x00\xff\xfe" * 100)


def metrics_garbage_after_good_lines(run):
    f = _metrics(run)
    f.write_bytes(f.read_bytes() + b"[1, 2]\n")


def metrics_a_line_of_another_event(run):
    f = _metrics(run)
    f.write_bytes(b'{"event": "lunch", "step": 1, "unix_s": 1.0}\n' + f.read_bytes())


def metrics_nested_10000_deep(run):
    _metrics(run).write_text('{"event": "step", "step": 1, "unix_s": 1.0, "x": ' + NESTED + "}\n")


def metrics_a_link_to_a_system_file(run):
    _link_to_passwd(_metrics(run))


def metrics_a_fifo(run):
    _make_fifo(_metrics(run))


def metrics_a_directory(run):
    _metrics(run).unlink()
    _metrics(run).mkdir()


def report_garbage(run):
    _report(run).write_text("this is not json")


def report_binary(run):
    _report(run).write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")


def report_an_empty_object(run):
    _report(run).write_text("{}")


def report_a_link_to_a_system_file(run):
    _link_to_passwd(_report(run))


def report_a_fifo(run):
    _make_fifo(_report(run))


def report_nested_10000_deep(run):
    _report(run).write_text('{"schema": ' + NESTED + "}")


def report_of_another_mode(run):
    _report(run).write_text(json.dumps({"schema": "asyncrl.report/1", "mode": "sync", "metrics": {}, "series": {}, "scenario": {}}))


def report_without_its_figures(run):
    _report(run).write_text(json.dumps({"schema": "asyncrl.report/1", "mode": "async", "metrics": {}, "series": {}, "scenario": {}}))


def mode_directory_a_file(run):
    shutil.rmtree(run / "async")
    (run / "async").write_text("a file where the mode's directory was\n")


def mode_directory_a_link(run):
    elsewhere = run.parent / "elsewhere"
    (run / "async").rename(elsewhere)
    (run / "async").symlink_to(elsewhere)


def queue_journal_a_link_to_a_system_file(run):
    """Opened to append on resume: a link would be written through."""
    _link_to_passwd(run / "async" / "queue.journal")


def queue_journal_a_fifo(run):
    _make_fifo(run / "async" / "queue.journal")


def lock_a_link_to_a_system_file(run):
    _link_to_passwd(run / LOCK)


def lock_a_directory(run):
    (run / LOCK).unlink(missing_ok=True)
    (run / LOCK).mkdir()


def stamp_a_link(run):
    (run / STAMP).rename(run.parent / "stamp")
    (run / STAMP).symlink_to(run.parent / "stamp")


def scenario_json_a_link(run):
    (run / "scenario.json").rename(run.parent / "scenario.json")
    (run / "scenario.json").symlink_to(run.parent / "scenario.json")


def scenario_json_a_link_to_a_system_file(run):
    _link_to_passwd(run / "scenario.json")


def scenario_json_nested_10000_deep(run):
    (run / "scenario.json").write_text('{"name": ' + NESTED + "}")


def checkpoint_state_nested_200_deep(run):
    """Contents that pass every format check (magic, version, checksums), nested past the bound."""
    f = latest_state(run)
    snap = checkpoint.decode(f.read_bytes())
    deep: list = []
    for _ in range(200):
        deep = [deep]
    snap.state["extra"] = deep
    f.write_bytes(checkpoint.encode(snap))


RESUME_CASES = [
    # (damage, fragments of the one error line besides its path)
    (metrics_garbage, ["async/metrics.jsonl: line 1: not JSON", "fix: delete it"]),
    (metrics_binary, ["async/metrics.jsonl: line 1: byte 1 of the line is not UTF-8", "fix: delete it"]),
    (metrics_garbage_after_good_lines, ["async/metrics.jsonl: line", "a JSON list, not an object", "fix: delete it"]),
    (metrics_a_line_of_another_event, ["async/metrics.jsonl: line 1: event = 'lunch' is not one of step, sync", "fix:"]),
    (metrics_nested_10000_deep, ["async/metrics.jsonl: line 1, column 149: values are nested more than 100 deep", "fix:"]),
    (metrics_a_link_to_a_system_file, ["async/metrics.jsonl: is a symbolic link, which asyncrl does not follow", "fix: delete it"]),
    (metrics_a_fifo, ["async/metrics.jsonl: is not a regular file (a FIFO", "fix:"]),
    (metrics_a_directory, ["async/metrics.jsonl: is a directory", "fix:"]),
    (report_garbage, ["async/report.json: line 1, column 1: not JSON", "to run mode async again"]),
    (report_binary, ["async/report.json: byte 0 is not UTF-8", "to run mode async again"]),
    (report_an_empty_object, ["async/report.json: not a report asyncrl wrote (no schema", "fix: delete", "to run mode async again"]),
    (report_a_link_to_a_system_file, ["async/report.json: is a symbolic link", "to run mode async again"]),
    (report_a_fifo, ["async/report.json: is not a regular file (a FIFO", "to run mode async again"]),
    (report_nested_10000_deep, ["async/report.json: line 1, column 111: values are nested more than 100 deep", "fix: delete"]),
    (report_of_another_mode, ["async/report.json: the report of mode 'sync', not of mode 'async'", "fix: delete"]),
    (report_without_its_figures, ["metrics.throughput/trained_samples_per_s = None is not a number", "fix: delete"]),
    (mode_directory_a_file, ["async: is a file, not the directory of mode async", "fix: move it out of the run directory"]),
    (mode_directory_a_link, ["async: is a symbolic link, not the directory of mode async", "fix:"]),
    (queue_journal_a_link_to_a_system_file, ["async/queue.journal: is a symbolic link, not the journal asyncrl wrote", "fix:"]),
    (queue_journal_a_fifo, ["async/queue.journal: is not a regular file", "fix:"]),
    (lock_a_link_to_a_system_file, [f"{LOCK} is a symbolic link, which asyncrl never follows", "fix: remove the link"]),
    (lock_a_directory, [f"{LOCK} is not a regular file", "fix: remove it"]),
    (stamp_a_link, [f"{STAMP} is a symbolic link, which asyncrl never follows", "fix: remove the link"]),
    (scenario_json_a_link, ["scenario.json: is a symbolic link, which asyncrl never follows", "fix:"]),
    (scenario_json_a_link_to_a_system_file, ["scenario.json: is a symbolic link", "fix:"]),
    (scenario_json_nested_10000_deep, ["scenario.json: unreadable (line 1, column 109: values are nested more than 100 deep)", "fix:"]),
    (checkpoint_state_nested_200_deep, ["state.ckpt", "state JSON unreadable", "nested more than 100 deep", "fix: delete this checkpoint"]),
]


@pytest.mark.parametrize("damage,fragments", RESUME_CASES, ids=[c[0].__name__ for c in RESUME_CASES])
def test_a_damaged_run_directory_is_refused_naming_the_file(stopped_run, tmp_path, capsys, damage, fragments):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run, symlinks=True)
    damage(run)
    refused(capsys, ["--resume", str(run), "--no-plots"], [str(run), *fragments], tmp_path)


def test_a_last_metrics_line_a_kill_cut_short_is_dropped_not_refused(stopped_run, tmp_path, capsys):
    """What a kill leaves at the end of metrics.jsonl is no damage: the resume goes on."""
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    f = _metrics(run)
    whole = f.read_bytes()
    f.write_bytes(whole + whole.splitlines(keepends=True)[0][:30])  # a line cut short, no newline
    assert main(["--resume", str(run), "--no-plots"]) == 0
    assert (run / "summary.json").is_file()
    assert all(json.loads(line)["event"] for line in f.read_text().splitlines())


# -- an env run's directory ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def env_stopped(tmp_path_factory) -> Path:
    """An env run (PPO on CartPole, sync mode) stopped at learner version 2: seed-0/sync/."""
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    run = tmp_path_factory.mktemp("env") / "run"
    argv = [str(ROOT / "scenarios" / "cartpole-ppo.yaml"), "--out", str(run), "--no-plots", "--stop-at-step", "2",
            *sets("modes=[sync]", "checkpoint.every=2", "env.env_steps=4096", "env.eval_every=2048", "env.eval_episodes=5",
                  "ppo.epochs=2", "env.samplers=2", "seeds=[0]")]
    assert main(argv) == 0
    assert (run / "seed-0" / "sync" / "checkpoints").is_dir() and not (run / "summary.json").exists()
    return run


def env_report_garbage(run):
    (run / "seed-0" / "sync" / "report.json").write_text("{ not json")


def env_report_an_empty_object(run):
    (run / "seed-0" / "sync" / "report.json").write_text("{}")


def env_report_without_its_series(run):
    (run / "seed-0" / "sync" / "report.json").write_text(json.dumps(
        {"schema": "asyncrl.env-report/1", "mode": "sync", "metrics": {}, "series": {}, "scenario": {}}))


def env_metrics_garbage(run):
    (run / "seed-0" / "sync" / "metrics.jsonl").write_bytes(b"\xff\xfe garbage\n")


def env_seed_directory_a_file(run):
    shutil.rmtree(run / "seed-0")
    (run / "seed-0").write_text("a file\n")


ENV_RESUME_CASES = [
    (env_report_garbage, ["seed-0/sync/report.json: line 1, column 3: not JSON", "seed-0/sync to run mode sync again"]),
    (env_report_an_empty_object, ["seed-0/sync/report.json: not a report asyncrl wrote (no schema", "fix: delete"]),
    (env_report_without_its_series, ["seed-0/sync/report.json: metrics has no time_to_target_s", "fix: delete"]),
    (env_metrics_garbage, ["seed-0/sync/metrics.jsonl: line 1: byte 0 of the line is not UTF-8", "fix: delete it"]),
    (env_seed_directory_a_file, ["seed-0: is a file, not the directory of seed 0", "fix:"]),
]


@pytest.mark.parametrize("damage,fragments", ENV_RESUME_CASES, ids=[c[0].__name__ for c in ENV_RESUME_CASES])
def test_a_damaged_env_run_directory_is_refused_naming_the_file(env_stopped, tmp_path, capsys, damage, fragments):
    run = tmp_path / "run"
    shutil.copytree(env_stopped, run, symlinks=True)
    damage(run)
    refused(capsys, ["--resume", str(run), "--no-plots"], [str(run), *fragments], tmp_path)


# -- arguments argparse cannot read --------------------------------------------------------------

ARG_CASES = [
    ("stop_at_step_not_a_number", ["--stop-at-step", "x"],
     ["argument --stop-at-step: 'x' is not a whole number", "fix: give a whole number, e.g. --stop-at-step 6"]),
    ("stop_at_step_a_fraction", ["--stop-at-step=1.5"], ["'1.5' is not a whole number", "fix: give a whole number"]),
    ("stop_at_step_of_5000_digits", ["--stop-at-step", "9" * 5000], ["'99999999999999999999'... is not a whole number", "fix:"]),
    ("stop_at_step_without_a_value", ["--stop-at-step"],
     ["argument --stop-at-step: expected one argument", "fix: give it a value, e.g. --stop-at-step 6"]),
    ("out_without_a_value", ["--out"], ["argument --out: expected one argument", "fix: give it a value, e.g. --out runs/my-run"]),
    ("set_without_a_value", ["--set"], ["argument --set: expected one argument", "fix: give it a value, e.g. --set trainer.steps=100"]),
    ("unknown_flag", ["--bogus"], ["--bogus: not an argument python -m harness.run takes", "fix: drop it; the options are", "--stop-at-step"]),
    ("misspelt_flag", ["--sett", "trainer.steps=3"], ["--sett: not an argument", "fix: did you mean --set?"]),
    ("two_scenario_files", [QUICK], [f"{QUICK}: not an argument", "fix: drop it"]),
]


@pytest.mark.parametrize("argv,fragments", [c[1:] for c in ARG_CASES], ids=[c[0] for c in ARG_CASES])
def test_an_argument_error_is_one_line_not_the_usage(tmp_path, capsys, argv, fragments):
    err = refused(capsys, [QUICK, "--no-plots", *argv], fragments, tmp_path)
    assert "usage:" not in err


def test_an_argument_error_from_the_command_line_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness.run", QUICK, "--stop-at-step", "x"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error:") and "fix:" in proc.stderr, proc.stderr


# -- replacing a finished run --------------------------------------------------------------------

RUN = [QUICK, "--no-plots", *sets("trainer.steps=6", "modes=[async]")]


@pytest.fixture
def finished(tmp_path) -> Path:
    run = tmp_path / "run"
    assert main([*RUN, "--out", str(run)]) == 0
    return run


def test_a_finished_run_s_stamp_lists_every_file_it_wrote(finished):
    mark = json.loads((finished / STAMP).read_text())
    assert mark["contents"] == contents(finished)
    assert mark["contents"]["async/report.json"] == "file" and mark["contents"]["async"] == "dir"
    assert STAMP not in mark["contents"] and LOCK not in mark["contents"]
    assert is_owned(finished, "run")


@pytest.mark.parametrize("where", ["notes.txt", "async/notes.txt", "async/mine/"])
def test_a_users_file_in_a_finished_run_stops_its_replacement(finished, tmp_path, capsys, where):
    user = finished / where
    if where.endswith("/"):
        user.mkdir()  # even an empty directory of the user's is not removed
    else:
        user.write_text("precious\n")
    refused(capsys, [*RUN, "--out", str(finished), *sets("seed=1")],
            [f"holds {user}".rstrip("/"), "which the earlier run did not write", "fix: move it out of", "or pass a new directory"],
            tmp_path)
    assert user.exists() and (finished / "summary.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging directory began


def test_a_clean_finished_run_is_replaced_as_before(finished, tmp_path, capsys):
    assert main([*RUN, "--out", str(finished), *sets("seed=1")]) == 0
    assert json.loads((finished / "async" / "report.json").read_text())["seed"] == 1
    assert json.loads((finished / STAMP).read_text())["contents"] == contents(finished)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_run_that_never_finished_is_replaced_only_if_it_holds_no_file(tmp_path, capsys):
    """Without the list a finished run keeps, nothing tells asyncrl's files from the user's."""
    killed = tmp_path / "killed"
    (killed / "async").mkdir(parents=True)
    (killed / STAMP).write_text(json.dumps({"owner": "asyncrl", "kind": "run"}))
    (killed / "async" / "metrics.jsonl").write_text("")
    refused(capsys, [*RUN, "--out", str(killed)],
            [f"holds {killed / 'async' / 'metrics.jsonl'}", "no list of the files asyncrl wrote there", f"fix: remove {killed} yourself"],
            tmp_path)
    (killed / "async" / "metrics.jsonl").unlink()
    assert main([*RUN, "--out", str(killed)]) == 0  # directories only: nothing of anyone's is lost


def test_a_file_that_appears_in_the_old_run_while_the_new_one_runs_keeps_both(finished, tmp_path):
    new = RunDirectory.claim(finished, "run")
    (new.path / "summary.json").write_text("{}")
    (finished / "notes.txt").write_text("written while the new run ran\n")
    new.commit()
    assert (finished / "notes.txt").is_file() and (finished / "async" / "report.json").is_file()
    aside = tmp_path / "run-new"
    assert new.path == aside and (aside / "summary.json").is_file() and is_owned(aside, "run")


def test_a_users_file_in_a_finished_sweep_stops_its_replacement(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: tiny\nmodes: [partial]\nresources: {rollout_gpus: 2, trainer_gpus: 2}\n"
                     "trainer: {batch_size: 64, steps: 2}\nsweep:\n  axes:\n    staleness.max_staleness: [1]\n"
                     "  mode: partial\n  workers: 1\n")
    out = tmp_path / "out"
    assert main([str(sweep), "--out", str(out), "--no-plots"]) == 0
    assert json.loads((out / STAMP).read_text())["contents"] == contents(out)
    (out / "points" / "notes.txt").write_text("mine\n")
    refused(capsys, [str(sweep), "--out", str(out), "--no-plots"],
            [f"holds {out / 'points' / 'notes.txt'}", "which the earlier sweep did not write", "fix:"], tmp_path)


def test_a_finished_run_whose_lock_is_a_link_is_not_replaced(finished, tmp_path, capsys):
    _link_to_passwd(finished / LOCK)
    refused(capsys, [*RUN, "--out", str(finished)],
            [f"{finished / LOCK} is a symbolic link, which asyncrl never follows", "fix: remove the link", "or pass a new directory"],
            tmp_path)


def test_a_stamp_nested_10000_deep_is_no_stamp(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / STAMP).write_text(NESTED)
    refused(capsys, [*RUN, "--out", str(mine)], ["exists and is not a run directory asyncrl created", "fix: pass a new directory"], tmp_path)


# -- prompt and length files nested 10,000 deep --------------------------------------------------

def _block_nested_text(depth: int) -> str:
    """Block sequences nested on one line ("- - - 1"): deep without indenting 10,000 lines."""
    return "- " * depth + "1\n"


def _alias_bomb() -> str:
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nl9: [*l8, *l8, *l8, *l8, *l8, *l8, *l8, *l8, *l8]\n"


# (key, file name, its text, fragments of the error line besides the file's path)
NESTED_FILES = [
    ("prompts_jsonl", "task.prompts", "p.jsonl",
     '{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": "d", "meta": ' + NESTED + "}\n",
     ["task.prompts", "line 2, column 139: values are nested more than 100 deep", "fix:"]),
    ("prompts_jsonl_a_bare_list", "task.prompts", "p.jsonl", NESTED + "\n",
     ["task.prompts", "line 1, column 101: values are nested more than 100 deep", "fix:"]),
    ("eval_prompts_jsonl", "task.eval_prompts", "e.jsonl", '{"prompt": ' + NESTED + "}\n",
     ["task.eval_prompts", "line 1, column 111: values are nested more than 100 deep", "fix:"]),
    ("lengths_json", "workload.lengths", "l.json", NESTED,
     ["workload.lengths", "line 1, column 101: values are nested more than 100 deep", "fix:"]),
    ("lengths_json_in_an_object", "workload.lengths", "l.json", '{\n  "edges": ' + NESTED + ', "counts": [1]\n}',
     ["workload.lengths", "line 2, column 111: values are nested more than 100 deep", "fix:"]),
    ("lengths_yaml_flow", "workload.lengths", "l.yaml", NESTED + "\n",
     ["workload.lengths", "line 1, column 101: values are nested more than 100 deep", "fix:"]),
    ("lengths_yaml_block", "workload.lengths", "l.yaml", _block_nested_text(DEEP),
     ["workload.lengths", "line 1, column 201: values are nested more than 100 deep", "fix:"]),
    ("lengths_yaml_alias_bomb", "workload.lengths", "l.yaml", _alias_bomb(),
     ["workload.lengths", "once its aliases (*name) are expanded", "fix:"]),
]


@pytest.mark.parametrize("key,name,text,fragments", [c[1:] for c in NESTED_FILES], ids=[c[0] for c in NESTED_FILES])
def test_a_file_nested_10000_deep_is_one_line(tmp_path, capsys, key, name, text, fragments):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / name).write_text(text)
    section, field = key.split(".")
    extra = f"  prompts: {inputs / 'p0.jsonl'}\n" if field == "eval_prompts" else ""
    if extra:
        (inputs / "p0.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    scenario = inputs / "s.yaml"
    scenario.write_text(f"name: nested\n{section}:\n  {field}: {inputs / name}\n{extra}")
    refused(capsys, [str(scenario), "--out", str(tmp_path / "run")], [str(scenario), str(inputs / name), *fragments], tmp_path)
    assert not (tmp_path / "run").exists()


def test_the_json_bound_skips_strings_and_counts_every_bracket():
    """Brackets inside strings (escaped quotes too) are not nesting; 100 levels pass, 101 do not."""
    text = '["' + "[{" * 500 + '\\"]]' + '"]'
    assert loads_json(text) == ["[{" * 500 + '"]]']
    assert loads_json("[" * 100 + "]" * 100) is not None
    with pytest.raises(TooNested, match="line 2, column 102: values are nested more than 100 deep"):
        loads_json("{\n  " + "[" * 100 + "]" * 100 + "}")
    assert loads_yaml("a: [1, 2]\n") == {"a": [1, 2]}
    with pytest.raises(TooNested, match="nested more than 100 deep"):
        loads_yaml("[" * 101 + "]" * 101)


# ==== Small inputs that asked for hours or gigabytes (issue 40) ===================================
def _refused_fast(argv: list[str], capsys, fragments: list[str], code: int = 2) -> None:
    t0 = time.monotonic()
    assert main(argv) == code
    err = one_error(capsys)
    assert all(f in err for f in fragments), err
    assert time.monotonic() - t0 < 5


def test_a_sweep_of_a_million_points_is_refused_before_any_is_built(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    values = ", ".join(str(i) for i in range(1000))
    path.write_text("name: big\nmodes: [partial]\nsweep:\n  axes:\n"
                    f"    seed: [{values}]\n    trainer.steps: [{', '.join(str(i) for i in range(1, 1001))}]\n")
    before = tree(tmp_path)
    _refused_fast([str(path), "--out", str(tmp_path / "out")], capsys, ["a grid of 1,000,000 points", "(10,000)", "fix:"])
    assert tree(tmp_path) == before


def test_a_sweep_of_a_million_workers_is_refused_before_any_starts(tmp_path, capsys):
    path = tmp_path / "forks.yaml"
    path.write_text("name: forks\nmodes: [partial]\nsweep:\n  axes:\n    trainer.steps: [2, 3]\n  workers: 1000000\n")
    before = tree(tmp_path)
    _refused_fast([str(path), "--out", str(tmp_path / "out")], capsys, ["sweep.workers = 1000000", "from 1 to 256", "fix:"])
    assert tree(tmp_path) == before


def test_a_yaml_alias_bomb_in_a_lengths_file_is_refused_without_building_it(tmp_path, capsys):
    bomb = tmp_path / "lengths.yaml"
    lines = ["a0: &a0 [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]"]
    for i in range(1, 9):  # 10 x 10^8 values once every alias is followed
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    lines.append("lengths: *a8")
    bomb.write_text("\n".join(lines) + "\n")
    _refused_fast([QUICK, "--out", str(tmp_path / "out"), *sets(f"workload.lengths={bomb}")], capsys, ["workload.lengths", "fix:"])


def test_a_phases_file_of_a_trillion_samples_a_step_is_refused(tmp_path, capsys):
    import yaml

    table = _table()
    table["samples_per_step"] = 10**12
    path = tmp_path / "phases.yaml"
    path.write_text(yaml.safe_dump(table))
    _calibrate_refused([str(path)], capsys, ["samples_per_step = 1000000000000: input should be less than or equal to 1000000; "
                                             "fix: use a value <= 1000000"], tmp_path)


def test_profile_without_py_spy_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    import harness.profiler as profiler

    monkeypatch.setattr(profiler.shutil, "which", lambda name: None)
    monkeypatch.setattr(profiler.os, "sys", type("S", (), {"executable": str(tmp_path / "bin" / "python")}))
    out = tmp_path / "out"
    _refused_fast([QUICK, "--out", str(out), "--profile"], capsys, ["--profile: py-spy not found", "fix:"])
    assert not out.exists()


def test_ctrl_c_while_the_command_imports_is_one_line_and_130(tmp_path):
    """SIGINT a moment after start, while ``python -m harness.run`` still imports its modules
    (seconds): no traceback from inside an import, nothing written."""
    out = tmp_path / "out"
    # -X importtime writes a line per module imported: SIGINT once the harness package is in,
    # while harness.run's own imports (most of a second) still load; never a blind sleep.
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "harness.run", QUICK, "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:
            if line.rstrip().endswith("| harness"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    told = [x for x in err.splitlines() if not x.startswith("import time:")]
    assert told == ["interrupted while starting; nothing was run"], err[-2000:]
    assert not out.exists()


# ==== calibrate: what it reads, and a user's files beside what it writes (issue 40) ==============
# Each case: exit 2, one error line with its fix, nothing under the run's parent written or
# removed, in less than 5 s. calibrate's outputs lie in the user's tree, outside any stamped run
# directory: created anew, never replacing a file unasked, never through a link or into a device.
def _calibrate_refused(argv: list[str], capsys, fragments: list[str], watched: Path) -> str:
    from harness.calibrate import main as calibrate

    return refused(capsys, argv, fragments, watched, command=calibrate)


def _spans_run(tmp_path: Path, spans: object) -> Path:
    """A run directory whose sync mode holds ``spans`` (JSON; a str is written as it is)."""
    run = tmp_path / "run"
    (run / "sync").mkdir(parents=True)
    (run / "sync" / "spans.json").write_text(spans if isinstance(spans, str) else json.dumps(spans))
    return run


def _good_spans() -> dict:
    from tests.test_calibrate import synthetic_spans, truth

    return synthetic_spans(truth())


def _spans_with(path: tuple, value: object) -> typing.Callable[[dict], object]:
    def change(spans: dict) -> object:
        *parents, last = path
        d = spans
        for key in parents:
            d = d[key]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
        return spans
    return change


DECODE = ("engines", "engine000", "decode")
SPANS_CASES = [
    ("row_too_short", _spans_with((*DECODE, 0), [1, 2]), ["engines.engine000.decode.0", "fix: run the scenario again"]),
    ("seconds_nan", _spans_with(("train", 0, 2), math.nan), ["train.0.2 = nan", "finite number"]),
    ("seconds_negative", _spans_with((*DECODE, 3, 2), -1.0), ["engines.engine000.decode.3.2 = -1.0", "greater than or equal to 0"]),
    ("figure_past_any_run", _spans_with(("train", 1, 1), 1e300), ["train.1.1 = 1e+300", "less than or equal to 1000000000000000000"]),
    ("length_a_string", _spans_with(("response_lens", 0), "12"), ["response_lens.0 = '12'", "valid integer"]),
    ("length_negative", _spans_with(("prompt_lens", 5), -1), ["prompt_lens.5 = -1"]),
    ("train_missing", _spans_with(("train",), KeyError), ["spans.json: train: field required"]),
    ("train_not_a_list", _spans_with(("train",), 7), ["train = 7", "valid list"]),
    ("placement_a_bool", _spans_with(("placement", "trainer_gpus"), True), ["placement.trainer_gpus = True"]),
    ("engine_rows_unknown", _spans_with(("engines", "engine000", "decoded"), []), ["engines.engine000.decoded", "extra inputs"]),
    ("scenario_broken", _spans_with(("scenario", "trainer", "steps"), 0), ["scenario.trainer.steps = 0"]),
    ("scenario_a_list", _spans_with(("scenario",), [1]), ["scenario = [1]"]),
    ("of_another_mode", _spans_with(("mode",), "async"), ["the spans of mode 'async', not of 'sync'"]),
    ("of_another_schema", _spans_with(("schema",), "asyncrl.spans/0"), ["not a spans file of schema asyncrl.spans/1", "'asyncrl.spans/0'"]),
    ("a_list", lambda spans: [spans], ["a JSON list, not the object asyncrl writes"]),
    ("not_json", lambda spans: '{"schema": "asyncrl.spans/1", "train": [', ["not JSON", "fix:"]),
    ("nested_10000_deep", lambda spans: NESTED, ["nested more than", "fix:"]),
]


@pytest.mark.parametrize("damage,fragments", [c[1:] for c in SPANS_CASES], ids=[c[0] for c in SPANS_CASES])
def test_a_damaged_spans_file_is_one_line(damage, fragments, tmp_path, capsys):
    run = _spans_run(tmp_path, damage(_good_spans()))
    _calibrate_refused([str(run), "-o", str(tmp_path / "cal.yaml")], capsys, [str(run / "sync" / "spans.json"), *fragments], tmp_path)


def _table() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "scenarios" / "published" / "verl-fully-async-7b.yaml").read_text())


SETUP = ("setups", "16:16")
TABLE_CASES = [
    ("phase_time_nan", _spans_with((*SETUP, "colocated", "gen_s"), math.nan), ["setups.16:16.colocated.gen_s = nan", "finite number"]),
    ("phase_time_zero", _spans_with((*SETUP, "separated", "update_actor_s"), 0), ["setups.16:16.separated.update_actor_s = 0", "fix: use a value > 0"]),
    ("phase_time_a_bool", _spans_with((*SETUP, "colocated", "step_s"), True), ["setups.16:16.colocated.step_s = True"]),
    ("phase_missing", _spans_with((*SETUP, "colocated", "old_log_prob_s"), KeyError), ["setups.16:16.colocated.old_log_prob_s: is required; fix: add it"]),
    ("a_checking_row_damaged", _spans_with(("setups", "64:64", "colocated"), "fast"), ["setups.64:64.colocated = 'fast'"]),
    ("fit_not_a_setup", _spans_with(("fit",), "8:8"), ["fit = '8:8': is not a setup of the table", "fix: use one of ['16:16', '32:32', '64:64']"]),
    ("gpus_the_engines_cannot_split", _spans_with((*SETUP, "rollout_gpus"), 6),
     ["setup '16:16': its rollout_gpus and trainer_gpus give resources.rollout_gpus = 6", "fix: use a multiple of 4"]),
    ("samples_per_step_text", _spans_with(("samples_per_step",), "8k"), ["samples_per_step = '8k'"]),
    ("samples_per_step_1e6_as_text", _spans_with(("samples_per_step",), "1e6"), ["samples_per_step = '1e6'", "fix: write 1000000"]),
    ("scenario_key_misspelt", _spans_with(("scenario", "trainr"), {}), ["scenario.trainr", "unknown key", "did you mean 'trainer'?"]),
    ("setups_empty", _spans_with(("setups",), {}), ["setups = {...}", "at least 1 item"]),
]


@pytest.mark.parametrize("damage,fragments", [c[1:] for c in TABLE_CASES], ids=[c[0] for c in TABLE_CASES])
def test_a_damaged_table_of_phase_times_is_one_line(damage, fragments, tmp_path, capsys):
    import yaml

    path = tmp_path / "phases.yaml"
    path.write_text(yaml.safe_dump(damage(_table())))
    _calibrate_refused([str(path)], capsys, [str(path), *fragments], tmp_path)


REPORT_CASES = [
    ("garbage", "{not json", ["report.json: line 1, column 2: not JSON"]),
    ("a_figure_a_string", json.dumps({"schema": "asyncrl.report/1", "mode": "sync", "metrics": {"throughput/trained_samples_per_s": "x"},
                                      "series": {}, "scenario": {}}), ["metrics.throughput/trained_samples_per_s = x is not a number"]),
    ("of_another_mode", json.dumps({"schema": "asyncrl.report/1", "mode": "async", "metrics": {}, "series": {}, "scenario": {}}),
     ["the report of mode 'async', not of mode 'sync'"]),
]


@pytest.mark.parametrize("text,fragments", [c[1:] for c in REPORT_CASES], ids=[c[0] for c in REPORT_CASES])
def test_predict_reads_each_report_before_it_writes(text, fragments, tmp_path, capsys):
    run = _spans_run(tmp_path, _good_spans())
    (run / "sync" / "report.json").write_text(text)
    _calibrate_refused([str(run), "-o", str(tmp_path / "cal.yaml"), "--predict"], capsys, fragments, tmp_path)
    assert not (tmp_path / "cal.lengths.json").exists()


CALIBRATE_ARG_CASES = [
    ("mode_a_path", ["--mode", "/etc"], ["argument --mode: invalid choice: '/etc'", "fix: give one of those, e.g. --mode sync"]),
    ("out_names_no_file", ["-o", ""], ["names no file", "fix: name a new YAML file"]),
    ("out_the_root", ["-o", "/"], ["names no file"]),
    ("factor_infinite", ["--separated-decode-speedup", "inf"], ["must be a finite number > 0"]),
    ("factor_not_a_number", ["--separated-decode-speedup", "x"], ["invalid float value: 'x'", "fix: give a number"]),
    ("speedup_malformed", ["--train-speedup", "one=fast"], ["expected DEVICES=SPEED"]),
    ("unknown_flag", ["--bogus"], ["--bogus: not an argument python -m harness.calibrate takes", "fix: drop it; the options are"]),
    ("value_missing", ["--train-speedup"], ["expected one argument", "fix: give it a value, e.g. --train-speedup 1=0.55"]),
]


@pytest.mark.parametrize("argv,fragments", [c[1:] for c in CALIBRATE_ARG_CASES], ids=[c[0] for c in CALIBRATE_ARG_CASES])
def test_a_calibrate_argument_error_is_one_line_not_the_usage(argv, fragments, tmp_path, capsys):
    run = _spans_run(tmp_path, _good_spans())
    err = _calibrate_refused([str(run), *argv], capsys, fragments, tmp_path)
    assert "usage:" not in err


def test_a_table_of_phase_times_takes_no_run_options(tmp_path, capsys):
    import yaml

    path = tmp_path / "phases.yaml"
    path.write_text(yaml.safe_dump(_table()))
    _calibrate_refused([str(path), "-o", str(tmp_path / "cal.yaml")], capsys,
                       ["--out: fits from a run directory", "is a table of phase times", "fix: drop --out"], tmp_path)


@pytest.mark.parametrize("case", ["exists", "lengths-exists", "symlink", "device", "directory"])
def test_calibrate_never_writes_over_a_users_file(tmp_path, capsys, case):
    run = _spans_run(tmp_path, _good_spans())
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's\n")
    out = tmp_path / "cal.yaml"
    if case == "exists":
        out.write_text("the user's scenario\n")
    elif case == "lengths-exists":
        (tmp_path / "cal.lengths.json").write_text("[1]\n")
    elif case == "symlink":
        out.symlink_to(mine)
    elif case == "directory":
        out.mkdir()
    else:
        out = Path("/dev/null")
    fragment = {"exists": "exists, and calibrate does not replace a file unasked", "lengths-exists": "cal.lengths.json: exists",
                "symlink": "is a symbolic link, which calibrate never writes through", "device": "is not a regular file",
                "directory": "is a directory"}[case]
    _calibrate_refused([str(run), "-o", str(out)], capsys, [fragment, "fix:"], tmp_path)
    assert mine.read_text() == "the user's\n"
    assert not Path("/dev/null.lengths.json").exists()


def test_calibrate_replaces_its_own_output_with_force(tmp_path, capsys):
    from harness.calibrate import main as calibrate

    run = _spans_run(tmp_path, _good_spans())
    out = tmp_path / "cal.yaml"
    assert calibrate([str(run), "-o", str(out)]) == 0
    first = out.read_text()
    capsys.readouterr()
    _calibrate_refused([str(run), "-o", str(out)], capsys, ["pass --force"], tmp_path)  # a second time: it exists now
    assert calibrate([str(run), "-o", str(out), "--force"]) == 0
    assert out.read_text().splitlines()[1:] == first.splitlines()[1:]  # the command line aside, the same fit


# ==== Loggers that cannot start: refused before anything runs (issue 40) =========================
LOGGED = [QUICK, "--no-plots", *sets("trainer.steps=4", "modes=[async]")]


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def _logged(tmp_path: Path, logger: str) -> list[str]:
    return [*LOGGED, "--out", str(tmp_path / "w" / "run"), *sets(f"report.loggers=[{logger}]")]


def test_a_broken_wandb_install_is_one_line(tmp_path, capsys, monkeypatch):
    """wandb is found but fails as it is imported, as a protobuf mismatch makes it fail."""
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise AttributeError(\"module 'google.protobuf.descriptor' has no attribute '_internal_create_key'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "w").mkdir()
    refused(capsys, _logged(tmp_path, "wandb"),
            ["report.loggers: wandb is installed but fails as it is imported (AttributeError: module 'google.protobuf.descriptor'",
             "fix: pip install wandb --force-reinstall, or drop wandb from report.loggers"], tmp_path / "w")


def test_wandb_online_without_a_login_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    (tmp_path / "w").mkdir()
    refused(capsys, _logged(tmp_path, "wandb"),
            ["report.loggers: wandb runs online and has no login", "fix: wandb login, or export WANDB_API_KEY, or WANDB_MODE=offline"],
            tmp_path / "w")


def test_a_wandb_mode_wandb_does_not_have_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "")  # W&B itself fails on it with a pydantic traceback
    (tmp_path / "w").mkdir()
    refused(capsys, _logged(tmp_path, "wandb"), ["WANDB_MODE = '' is not a mode W&B has", "fix: export WANDB_MODE=offline"], tmp_path / "w")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed as the block ends: a connection is refused


@pytest.mark.parametrize("uri,fragments", [
    ("http://127.0.0.1:{port}", ["mlflow's tracking server http://127.0.0.1:{port} (MLFLOW_TRACKING_URI) cannot be reached (Connection refused)",
                                 "fix: start it or correct MLFLOW_TRACKING_URI"]),
    ("http://:5000", ["MLFLOW_TRACKING_URI = 'http://:5000' names no host and port", "fix: export MLFLOW_TRACKING_URI=http://HOST:PORT"]),
    ("https://tracking:port", ["names no host and port"]),
], ids=["refused", "no_host", "port_not_a_number"])
def test_an_mlflow_server_that_cannot_be_reached_is_one_line(uri, fragments, tmp_path, capsys, monkeypatch, no_proxy):
    pytest.importorskip("mlflow")
    port = _closed_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(port=port))
    (tmp_path / "w").mkdir()
    refused(capsys, _logged(tmp_path, "mlflow"), [f.format(port=port) for f in fragments], tmp_path / "w")


def test_an_mlflow_server_that_never_answers_is_given_up_on_after_the_connect_timeout(tmp_path, capsys, monkeypatch, no_proxy):
    """A black-holed address: the connection is given CONNECT_TIMEOUT_S, then one line (the
    timeout is shortened here; the socket's own wait is what is exercised)."""
    import socket

    import harness.live_metrics as live

    pytest.importorskip("mlflow")
    waited = []

    def black_hole(address, timeout):
        waited.append(timeout)
        raise socket.timeout("timed out")

    monkeypatch.setattr(live.socket, "create_connection", black_hole)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.255.255.1:5000")
    (tmp_path / "w").mkdir()
    refused(capsys, _logged(tmp_path, "mlflow"), ["http://10.255.255.1:5000 (MLFLOW_TRACKING_URI) cannot be reached (no answer in 30 s)"],
            tmp_path / "w")
    assert waited == [live.CONNECT_TIMEOUT_S]


# ==== A count written as 1e6 (issue 40) ===========================================================
def test_a_count_written_1e6_is_one_line_with_the_number_to_write(tmp_path, capsys):
    """YAML reads 1e6 (no dot, no exponent sign) as text: refused at once, naming the number,
    whether written in the file or given with --set."""
    path = tmp_path / "dqn.yaml"
    path.write_text((ROOT / "scenarios" / "cartpole-dqn.yaml").read_text().replace("\nenv:\n", "\nenv:\n  n_step: 1e6\n", 1))
    fragment = "env.n_step = '1e6': is not written as a whole number; fix: write 1000000"
    refused(capsys, [str(path), "--no-plots", "--out", str(tmp_path / "run")], [str(path), fragment], tmp_path)
    refused(capsys, [DQN, "--no-plots", "--out", str(tmp_path / "run"), *sets("env.n_step=1e6")], ["--set env.n_step=1e6", fragment], tmp_path)


# ==== Every pydantic error carries a fix that says what to write (issue 40) =======================
@pytest.mark.parametrize("item,fragments", [
    ("filter={zero_variance: x}", ["--set filter={zero_variance: x}: filter.zero_variance = 'x'", "fix: write true or false"]),
    ("faults=[1]", ["--set faults=[1]: faults.0 = 1", "fix: write a mapping of its keys"]),
    ("modes=x", ["modes = 'x'", "fix: write a list, e.g. [a, b]"]),
    ("seed=x", ["seed = 'x'", "fix: write a whole number"]),
    ("name=[1]", ["name = [1]", "fix: write text"]),
    ("trainer.mfu=x", ["trainer.mfu = 'x'", "fix: write a number"]),
    ("trainer.mfu=yes", ["trainer.mfu = True: is true, not a number (YAML reads yes, no, on and off as true and false)", "fix: write a number"]),
    ("trainer.steps=on", ["trainer.steps = True: is true", "fix: write a number"]),
], ids=["bool", "mapping_in_a_list", "list", "int", "str", "float", "yes_for_a_fraction", "on_for_a_count"])
def test_a_value_of_the_wrong_type_says_what_to_write_and_where_it_came_from(item, fragments, tmp_path, capsys):
    refused(capsys, [QUICK, "--no-plots", "--out", str(tmp_path / "run"), "--set", item], fragments, tmp_path)


# ==== A failure no check foresaw is one line too (issue 40) =======================================
def test_an_unforeseen_exception_is_one_line_naming_a_file_with_its_traceback(tmp_path, capsys, monkeypatch):
    from harness import command_line

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again

    def buggy() -> int:
        return {"steps": None}["steps"] + 1

    assert command_line(buggy) == 1
    err = one_error(capsys)
    assert "asyncrl failed (TypeError: unsupported operand type(s) for +: 'NoneType' and 'int' at tests/test_bad_input.py:" in err
    (kept,) = tmp_path.glob("asyncrl-traceback-*.txt")
    assert f"fix: report it with the traceback in {kept}" in err
    assert "Traceback (most recent call last)" in kept.read_text() and "def buggy" not in err


def test_a_disk_error_no_check_foresaw_names_the_path(tmp_path, capsys):
    from harness import command_line

    def full() -> int:
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "async" / "trace.json"))

    assert command_line(full) == 1
    err = one_error(capsys)
    assert f"{tmp_path}/run/async/trace.json: No space left on device (OSError); fix: check that path" in err
    assert not list(tmp_path.glob("asyncrl-traceback-*"))


def test_python_m_harness_calibrate_ends_an_unforeseen_exception_in_one_line(tmp_path):
    """The command itself, as a user starts it: a bug injected into the fit ends in one line and
    exit 1, its traceback in a new file, nothing written beside the run."""
    run = _spans_run(tmp_path / "w", _good_spans())
    code = ("import runpy, sys, numpy\n"
            "def broken(*args, **kwargs): raise ZeroDivisionError('float division by zero')\n"
            "numpy.linalg.lstsq = broken\n"
            f"sys.argv = ['harness.calibrate', {str(run)!r}]\n"
            "runpy.run_module('harness.calibrate', run_name='__main__', alter_sys=True)\n")
    before = tree(tmp_path / "w")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: asyncrl failed (ZeroDivisionError: float division by zero")
    assert len(list(tmp_path.glob("asyncrl-traceback-*.txt"))) == 1
    assert tree(tmp_path / "w") == before


# ==== The tiny model's files, readable as the user's umask says (issue 40) =====================
def test_the_tiny_models_files_are_as_readable_as_the_umask_makes_new_files(tiny_model_dir):
    """safetensors writes its weights 0600; every file of the model is what the umask gives a new
    file (0644 under 022), so a user's other account or container can load the model."""
    import stat

    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in tiny_model_dir.iterdir() if f.is_file()}
    assert modes["model.safetensors"] == 0o666 & ~mask
    assert set(modes.values()) == {0o666 & ~mask}


# ==== Round four (issue 53): the tool journal, ceilings before reads, echoes, Ctrl-C ==========
AGENT_RUN = ["trainer.steps=3", "trainer.batch_size=16", "checkpoint.every=1", "modes=[partial]",
             'tools=[{name: calculator, fn: "tests.agent_tools_user:calculator_counting_calls", timeout_s: 5}]']


@pytest.fixture(scope="module")
def stopped_agent_run(tmp_path_factory, arithmetic_model_dir) -> Path:
    """A real agent run (tools journaled) stopped after step 2: the thing every journal case
    damages a copy of."""
    run = tmp_path_factory.mktemp("stopped-agent") / "run"
    log = run.parent / "calls.log"
    os.environ["ASYNCRL_TEST_CALL_LOG"] = str(log)
    try:
        argv = [str(ROOT / "scenarios" / "real-cpu-agent.yaml"), "--out", str(run), "--no-plots", "--stop-at-step", "2",
                *sets(*AGENT_RUN, f"tiny_model.path={arithmetic_model_dir}")]
        assert main(argv) == 0
    finally:
        os.environ.pop("ASYNCRL_TEST_CALL_LOG")
    assert (run / "partial" / "tools.journal").stat().st_size > 0
    return run


def _journal_records(path: Path) -> list[bytes]:
    data, at, out = path.read_bytes(), 0, []
    while at + 8 <= len(data):
        (n,) = struct.unpack_from("<Q", data, at)
        out.append(data[at + 8 : at + 8 + n])
        at += 8 + n
    return out


def _framed(bodies: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(b)) + b for b in bodies)


def _edit_first(path: Path, edit) -> None:
    recs = _journal_records(path)
    rec = json.loads(recs[0])
    edit(rec)
    path.write_bytes(_framed([json.dumps(rec).encode(), *recs[1:]]))


def _symlink_to_users_file(journal: Path) -> None:
    users = journal.parent.parent.parent / "users-notes.txt"
    users.write_text("mine\n")
    journal.unlink()
    journal.symlink_to(users)


def _sparse(journal: Path) -> None:
    journal.unlink()
    with open(journal, "wb") as f:
        f.truncate(1 << 30)  # 1 GB of zeros, none of it on disk


JOURNAL_CASES = [
    # (id, the damage, fragments)
    ("symlink", _symlink_to_users_file, ["tools.journal", "a symbolic link", "fix:"]),
    ("fifo", lambda j: (j.unlink(), os.mkfifo(j)), ["tools.journal", "not a regular file", "fix:"]),
    ("directory", lambda j: (j.unlink(), j.mkdir()), ["tools.journal", "not a regular file", "fix:"]),
    ("not_json", lambda j: j.write_bytes(_framed([b"{not json", *_journal_records(j)[1:]])), ["tool result unreadable", "not JSON", "fix:"]),
    ("extra_field", lambda j: _edit_first(j, lambda r: r.update(extra=1)), ["tool result unreadable", "fields", "fix:"]),
    ("wrong_kind", lambda j: _edit_first(j, lambda r: r.update(kind="asyncrl.other/1")), ["tool result unreadable", "kind", "fix:"]),
    ("bad_call_id", lambda j: _edit_first(j, lambda r: r.update(id="../../etc")), ["tool result unreadable", "call id", "fix:"]),
    ("sparse_1gb", _sparse, ["tool result unreadable", "fix:"]),
    ("deleted", lambda j: j.unlink(), ["tools.journal", "is missing", "fix:"]),
    ("cut_short", lambda j: j.write_bytes(_framed(_journal_records(j)[:1])), ["tools.journal", "fewer than the", "fix:"]),
    ("rewritten", lambda j: _edit_first(j, lambda r: r.update(content=r["content"] + " (edited)")), ["rewritten", "fix:"]),
]


@pytest.mark.parametrize("damage,fragments", [c[1:] for c in JOURNAL_CASES], ids=[c[0] for c in JOURNAL_CASES])
def test_a_resume_checks_the_tool_journal_before_anything_runs(stopped_agent_run, tmp_path, capsys, damage, fragments):
    run = tmp_path / "run"
    shutil.copytree(stopped_agent_run, run, symlinks=True)
    damage(run / "partial" / "tools.journal")
    before = tree(tmp_path)
    _refused_fast(["--resume", str(run)], capsys, fragments)
    assert tree(tmp_path) == before


def test_the_journal_is_never_appended_through_a_link(tmp_path):
    """Opened without following links: a link put in its place is refused, its target unchanged."""
    from core.store.tool_journal import ToolJournal

    target = tmp_path / "users.txt"
    target.write_text("mine\n")
    (tmp_path / "tools.journal").symlink_to(target)
    with pytest.raises(OSError):
        ToolJournal(tmp_path / "tools.journal")
    assert target.read_text() == "mine\n"


def test_the_tool_count_is_checked_before_any_table_is_read(tmp_path, capsys):
    """Checked the other way round, the 64 tables the limit lets through (20 MB each) are read first."""
    table = tmp_path / "big.jsonl"
    table.write_text("".join(json.dumps({"key": f"k{i}", "value": "v" * 80}) + "\n" for i in range(200_000)))
    path = tmp_path / "many.yaml"
    path.write_text("name: many\nruntime: local\ntools:\n" + f"  - {{name: lookup, data: {table}}}\n" * 1_000)
    before = tree(tmp_path)
    _refused_fast([str(path), "--out", str(tmp_path / "out")], capsys, ["tools", "1000 tools, more than 64", "fix:"])
    assert tree(tmp_path) == before


def test_an_unknown_key_of_ten_thousand_characters_is_echoed_cut(tmp_path, capsys):
    key = "k" * 10_000
    _refused_fast([QUICK, "--out", str(tmp_path / "out"), "--set", f"trainer.{key}=1"], capsys, ["unknown key", "fix:", "..."])


def _ctrl_c_group(argv: list[str], ready, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m argv`` in a process group of its own, as a terminal starts it; SIGINT to the
    whole group (as Ctrl-C sends it) once ``ready()``, polled."""
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + timeout
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"it ended before it was interrupted: {proc.communicate()}"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_of_a_sweep_is_one_line_from_the_sweep_and_none_from_its_workers(tmp_path):
    out = tmp_path / "sweep"
    started = time.monotonic()
    proc = _ctrl_c_group(["harness.run", str(ROOT / "scenarios" / "sweep-split-staleness.yaml"), "--out", str(out), "--no-plots"],
                         lambda: time.monotonic() - started > 4 and out.exists())
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "interrupted; nothing was kept (the partial run directory was removed)\n", proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.parametrize("module", ["tensorboardX", "torch"])
def test_ctrl_c_during_a_lazy_import_before_the_run_is_one_line(tmp_path, module):
    """The start-up guard holds until the run directory is claimed: the loggers' check imports
    tensorboardX (and it torch) after the harness's own imports are done."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "harness.run", QUICK, "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = False
        for line in proc.stderr:
            name = line.rsplit("|", 1)[-1].strip()
            seen = seen or name == "harness.trace"  # harness.run's last import: main() runs
            if seen and name.split(".")[0] == module:
                break
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    told = [x for x in err.splitlines() if not x.startswith("import time:")]
    assert proc.returncode == 130 and told == ["interrupted while starting; nothing was run"], err[-2000:]
    assert not out.exists()


def test_ctrl_c_of_gpu_check_removes_its_half_made_output(tmp_path):
    out = tmp_path / "check"
    proc = _ctrl_c_group(["bench.gpu_check", "--cpu-smoke", "--out", str(out)], lambda: (out / "model").exists())
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "gpu_check: interrupted; nothing was kept\n", proc.stderr[-3000:]
    assert not out.exists()


def test_ctrl_c_of_calibrate_writes_neither_file(tmp_path, monkeypatch, capsys):
    from harness import calibrate

    run = _spans_run(tmp_path / "w", _good_spans())
    before = tree(tmp_path / "w")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "sim_scenario", interrupted)  # after the lengths file is written
    assert calibrate.main([str(run)]) == 130
    assert capsys.readouterr().err == "interrupted; nothing was written\n"
    assert tree(tmp_path / "w") == before


def test_ctrl_c_while_the_local_runtime_builds_the_tiny_model_is_one_line(tmp_path):
    """Mid-set-up of the local runtime (the tiny model half built, its loop not yet answering
    Ctrl-C): one line, and the run directory removed."""
    out, model = tmp_path / "out", tmp_path / "tiny"
    argv = ["harness.run", str(ROOT / "scenarios" / "real-cpu-torch.yaml"), "--out", str(out), "--no-plots",
            *sets("trainer.steps=2", "modes=[sync]", f"tiny_model.path={model}")]
    proc = _ctrl_c_group(argv, lambda: model.is_dir())
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr == "interrupted; nothing was kept (the partial run directory was removed)\n", proc.stderr[-3000:]
    assert not out.exists()
