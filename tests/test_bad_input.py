"""Bad input gives one clear error, exit code 2, and changes nothing.

Two corpora: bad scenarios (``tests/corpus/scenarios/*.yaml``, each with the fragments its
message must hold on its first line, ``# expect: a | b``), and bad run directories and
checkpoints, made here by damaging a real stopped run in every way a disk or a user can.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness.run import main

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "corpus" / "scenarios"
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
SMALL = ["trainer.steps=12", "checkpoint.every=1", "modes=[async]"]


def sets(*items: str) -> list[str]:
    return [a for kv in items for a in ("--set", kv)]


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with a hash of its bytes: what 'changes nothing' compares."""
    if not path.exists():
        return {}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*")) if p.is_file()
    }


def one_error(capsys) -> str:
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error:") and err.count("error:") == 1, err
    assert "Traceback" not in err
    return err


def expected(path: Path) -> list[str]:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect:"), f"{path.name}: first line must be '# expect: ...'"
    return [f.strip() for f in first[len("# expect:"):].split("|")]


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.yaml")), ids=lambda p: p.stem)
def test_bad_scenario_corpus(path, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([str(path), "--out", str(out)]) == 2
    err = one_error(capsys)
    assert str(path) in err  # names the file
    for fragment in expected(path):
        assert fragment in err, f"{path.name}: {fragment!r} not in {err!r}"
    assert not out.exists() and list(tmp_path.iterdir()) == []


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


CASES = [
    # (damage, extra argv, fragments of the one error line)
    (_truncate, [], ["state.ckpt", "byte", "truncated", "fix:"]),
    (_flip, [], ["state.ckpt", "byte", "checksum mismatch", "fix:"]),
    (_version, [], ["state.ckpt", "byte 8", "format version 9, this build reads 1", "fix:"]),
    (_magic, [], ["state.ckpt", "byte 0", "not an asyncrl checkpoint", "fix:"]),
    (_empty, [], ["state.ckpt", "byte 0", "truncated", "fix:"]),
    (_missing, [], ["state.ckpt", "cannot be read", "fix:"]),
    (_other_scenario, [], ["checkpoints/step-", "was taken of scenario", "digest", "fix: resume the run directory this checkpoint belongs to"]),
    (_scenario_json, [], ["scenario.json", "trainer.steps = 'many'", "fix:"]),
    (_scenario_json_garbage, [], ["scenario.json", "unreadable", "fix:"]),
    (_finished, [], ["this run finished", "fix:"]),
    (None, ["--set", "trainer.steps=99"], ["--set trainer.steps=99", "keeps the scenario it started with", "fix:"]),
    (None, [str(ROOT / "scenarios" / "replay-reuse.yaml")], ["replay-reuse.yaml", "is not the scenario", "fix:"]),
]


@pytest.mark.parametrize("damage,argv,fragments", CASES, ids=lambda c: getattr(c, "__name__", None) or "")
def test_bad_run_directory_or_checkpoint(stopped_run, tmp_path, capsys, damage, argv, fragments):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    if damage is not None:
        damage(run)
    before = tree(tmp_path)
    assert main(["--resume", str(run), "--no-plots", *argv]) == 2
    err = one_error(capsys)
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    assert tree(tmp_path) == before  # nothing written, nothing removed


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
    import json

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
