"""Run directories (harness/run_directory.py): nothing of the user's is deleted or overwritten,
one writer at a time, what killed runs left is cleaned up, files are as readable as the umask
says, and the closing line names exactly the files written."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from core.model.owned import LOCK, STAMP, Hold, make_owned
from harness.run import main
from harness.run_directory import listing

ROOT = Path(__file__).resolve().parent.parent
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
SMALL = ["trainer.steps=6", "trainer.batch_size=64", "resources.rollout_gpus=2", "resources.trainer_gpus=2", "modes=[async]"]


def sets(*items: str) -> list[str]:
    return [a for kv in items for a in ("--set", kv)]


def tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def users_directory(path: Path) -> Path:
    """A directory of a user's files, among them names asyncrl writes."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("precious")
    (path / "summary.json").write_text('{"mine": true}')
    (path / "sub" / "report.json").write_text("{}")
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


def closing_line(capsys) -> str:
    out = " ".join(capsys.readouterr().out.split())
    return out[out.index("reports in "):]


def test_out_at_a_users_directory_or_a_link_to_it_leaves_every_file_intact(tmp_path, capsys):
    mine = users_directory(tmp_path / "mine")
    before = tree(mine)
    link = tmp_path / "link"
    link.symlink_to(mine)
    for out in (mine, link, mine / "sub"):
        assert main([QUICK, "--out", str(out), "--no-plots", *sets(*SMALL)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "is not a run directory asyncrl created" in err and "fix: pass a new directory" in err
    assert tree(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "mine"]


def test_a_link_to_a_finished_run_is_followed_and_the_run_replaced_only_once_finished(tmp_path, capsys):
    run = tmp_path / "runs" / "first"
    assert main([QUICK, "--out", str(run), "--no-plots", *sets(*SMALL)]) == 0
    first = json.loads((run / "summary.json").read_text())
    latest = tmp_path / "latest"
    latest.symlink_to(run)
    assert main([QUICK, "--out", str(latest), "--no-plots", *sets(*SMALL, "seed=1")]) == 0
    assert latest.is_symlink() and latest.resolve() == run.resolve()  # the link is kept, pointing at the new run
    assert json.loads((run / "async" / "report.json").read_text())["seed"] == 1
    assert json.loads((run / "summary.json").read_text()) != first
    assert sorted(p.name for p in run.parent.iterdir()) == ["first"]  # no staging directory left


def test_a_failed_replacement_keeps_the_finished_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", *sets(*SMALL)]) == 0
    before = tree(run)

    def crash(*a, **k):
        raise RuntimeError("the run failed")

    monkeypatch.setattr("harness.run.run_mode", crash)
    with pytest.raises(RuntimeError):
        main([QUICK, "--out", str(run), "--no-plots", *sets(*SMALL)])
    assert tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_second_writer_fails_at_once(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", "--stop-at-step", "3", *sets(*SMALL, "checkpoint.every=1")]) == 0
    before = tree(run)
    other = Hold(run)  # another process writing it, as far as this one can tell
    try:
        for argv in (["--resume", str(run)], [QUICK, "--out", str(run), *sets(*SMALL)]):
            assert main(argv) == 2
            err = " ".join(capsys.readouterr().err.split())
            assert err.startswith("error:") and f"(pid {os.getpid()}) is writing" in err and "fix:" in err
        assert tree(run) == before
    finally:
        other.release()
    assert main(["--resume", str(run), "--no-plots"]) == 0  # released: the resume goes on
    assert (run / "summary.json").is_file()


def test_staging_directories_that_killed_runs_left_are_removed_at_the_next_start(tmp_path):
    parent = tmp_path / "runs"
    parent.mkdir()
    maker = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from core.model.owned import make_owned; "
             f"from pathlib import Path; print(make_owned(Path({str(parent)!r}), '.old.', 'run'))")
    dead = Path(subprocess.run([sys.executable, "-c", maker], capture_output=True, text=True, check=True).stdout.strip())
    (dead / "async").mkdir()
    live = make_owned(parent, ".busy.", "run")  # this process is alive: a run still being built
    users = parent / ".cache"
    users.mkdir()  # the user's, unstamped
    assert main([QUICK, "--out", str(parent / "new"), "--no-plots", *sets(*SMALL)]) == 0
    assert not dead.exists()
    assert live.is_dir() and users.is_dir()


def test_a_killed_run_without_checkpoints_is_replaced_and_a_killed_write_removed_on_resume(tmp_path):
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / STAMP).write_text(json.dumps({"owner": "asyncrl", "kind": "run"}))  # half-written, its writer gone
    (killed / "async").mkdir()
    assert main([QUICK, "--out", str(killed), "--no-plots", *sets(*SMALL)]) == 0
    assert (killed / "summary.json").is_file()

    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", "--stop-at-step", "3", *sets(*SMALL, "checkpoint.every=1")]) == 0
    half = run / "async" / ".report.json.abc123.partial"
    half.write_text("{")
    assert main(["--resume", str(run), "--no-plots"]) == 0
    assert not half.exists() and (run / "summary.json").is_file()


def test_a_run_with_checkpoints_never_replaces_an_earlier_run_before_it_finished(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", *sets(*SMALL)]) == 0
    before = tree(run)
    assert main([QUICK, "--out", str(run), "--no-plots", "--stop-at-step", "3", *sets(*SMALL, "checkpoint.every=1")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "holds an earlier run" in err and "fix: pass a new directory" in err
    assert tree(run) == before


@pytest.mark.parametrize("umask, dirs, files", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600), (0o002, 0o775, 0o664)])
def test_files_are_as_readable_as_the_umask_says(tmp_path, umask, dirs, files):
    old = os.umask(umask)
    try:
        run = tmp_path / "run"
        assert main([QUICK, "--out", str(run), "--no-plots", "--stop-at-step", "4", *sets(*SMALL, "checkpoint.every=2")]) == 0
        staged = tmp_path / "staged"
        assert main([QUICK, "--out", str(staged), "--no-plots", *sets(*SMALL)]) == 0
        assert main([QUICK, "--out", str(staged), "--no-plots", *sets(*SMALL)]) == 0  # built aside (mkdtemp), moved in
    finally:
        os.umask(old)
    for root in (run, staged):
        paths = [root, *root.rglob("*")]
        assert len(paths) > 5
        for p in paths:
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode == (dirs if p.is_dir() else files), f"{p.relative_to(tmp_path)}: {oct(mode)}"


def test_the_closing_line_names_exactly_the_files_written(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", *sets(*SMALL, "modes=[sync,async]")]) == 0
    line = closing_line(capsys)
    assert line == (f"reports in {run}: <mode>/events.out.tfevents.*, <mode>/metrics.jsonl, <mode>/report.json, "
                    "<mode>/trace.json, summary.json")
    assert not list(run.glob("*/*.png"))
    several = tmp_path / "several"
    assert main([QUICK, "--out", str(several), *sets(*SMALL, "modes=[sync,async]", "seeds=[0,1]")]) == 0
    named = closing_line(capsys).split(": ", 1)[1].split(", ")
    assert "seed-<s>/<mode>/timeline.png" in named and "seed-<s>/summary.json" in named
    assert set(named) == set(listing(several, ("sync", "async")))


def test_listing_names_a_file_of_every_mode_once_and_others_by_their_path(tmp_path):
    for rel in ("summary.json", "sync/report.json", "async/report.json", "async/profile/driver.svg",
                "async/checkpoints/step-000002/state.ckpt", "async/checkpoints/step-000004/state.ckpt",
                "async/tb/events.out.tfevents.123.host", f"async/{STAMP}", f"{LOCK}"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert listing(tmp_path, ("sync", "async")) == [
        "<mode>/report.json", "async/checkpoints/", "async/profile/driver.svg", "async/tb/events.out.tfevents.*", "summary.json",
    ]


def test_profile_records_the_sim_runtime_and_the_line_names_the_flame_graph(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([QUICK, "--out", str(run), "--no-plots", "--profile", *sets(*SMALL, "trainer.steps=1500")]) == 0  # long enough to be sampled, on 2 busy cores too
    svg = run / "async" / "profile" / "driver.svg"
    assert svg.is_file() and svg.stat().st_size > 1000
    assert "async/profile/driver.svg" in closing_line(capsys)
