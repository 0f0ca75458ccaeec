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
"""

from __future__ import annotations

import hashlib
import json
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
import pytest

from core.model import config, env_config
from core.runtimes.run_checkpoint import load_run
from core.store import checkpoint
from harness.run import main
from harness.scenario import load_resolved

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


def refused(capsys, argv: list[str], fragments: list[str], *watched: Path) -> str:
    """``main(argv)``: exit 2 with one error line holding every fragment, nothing under
    ``watched`` changed, in less than 5 s; the line."""
    before = [tree(w) for w in watched]
    t0 = time.monotonic()
    rc = main(argv)
    elapsed = time.monotonic() - t0
    err = one_error(capsys)
    assert rc == 2, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert [tree(w) for w in watched] == before  # nothing written, nothing removed
    assert elapsed < 5, f"took {elapsed:.1f} s"  # the bound: refused at once, never after a run or a hang
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
    models = {m for mod in (config, env_config) for m in vars(mod).values()
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
    assert "not a run that kept checkpoints" in one_error(capsys)
    assert list(plain.iterdir()) == []


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


@pytest.mark.parametrize("body,fragments", [c[1:] for c in REWARD_BODIES], ids=[c[0] for c in REWARD_BODIES])
def test_a_reward_function_that_fails_while_the_run_runs(body, fragments, tmp_path, capsys, monkeypatch):
    """Exit 1 and one line naming the function, the sample and what it did; the run directory
    (nothing to resume) is removed; under 5 s past the start, plus the call's timeout."""
    pytest.importorskip("torch")
    name = _user_module(tmp_path, monkeypatch, "call", f"def score(prompt, response, answer, finished):\n    {body}\n")
    before = tree(tmp_path)
    t0 = time.monotonic()
    rc = main([*REAL_SHORT, "--out", str(tmp_path / "run"), *sets(f"reward.fn={name}:score")])
    elapsed = time.monotonic() - t0
    err = one_error(capsys)
    assert rc == 1, err
    assert err.startswith(f"error: reward.fn {name}:score: scoring sample ") and " of prompt " in err, err
    for fragment in [*fragments, "fix: make it return a finite float", "reward.on_error to skip"]:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert tree(tmp_path) == before
    assert elapsed < 5 + 1, f"took {elapsed:.1f} s"


def test_a_reward_that_fails_on_one_sample_in_a_thousand_ends_the_run_or_is_skipped(tmp_path, capsys, monkeypatch):
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
           *sets("modes=[async]", "trainer.steps=20", "trainer.batch_size=64", "workload.max_response_len=16", "eval.every=0")]
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
