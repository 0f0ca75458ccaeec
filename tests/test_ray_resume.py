"""A ray run stopped mid-way resumes as a whole: both sides of its latest whole checkpoint
(trainer and rollout, core/runtimes/ray_checkpoint.py) go into fresh actors, the sync it was
taken in is finished, and the run's clock goes on from the checkpoint."""

from __future__ import annotations

import shutil

import pytest

from core.api import RunStopped
from core.runtimes.dispatch import run_mode
from core.runtimes.ray_checkpoint import ROLLOUT_FILE, latest_whole
from core.runtimes.run_checkpoint import checkpoint_dir
from core.store.checkpoint import checkpoints, load
from tests.test_runtimes import assert_recovered_run, small


def ray_torch(model_dir, **changes):
    return small(
        "scenarios/real-cpu-vllm.yaml", model_dir,
        **{"engine.kind": "torch", "trainer.steps": 6, "checkpoint.every": 1, "ray.poll_s": 0.1, **changes},
    )


@pytest.mark.parametrize("mode", ["async", "partial"])
def test_ray_run_stopped_and_resumed_accounts_for_every_sample(ray_session, tiny_model_dir, tmp_path, mode):
    sc = ray_torch(tiny_model_dir, modes=[mode])
    with pytest.raises(RunStopped, match="stopped after step 4"):
        run_mode(sc, mode, run_dir=tmp_path, stop_at_step=4)
    root = checkpoint_dir(tmp_path, mode)
    whole = latest_whole(root)
    assert whole is not None and whole.name == "step-000003"  # the sync after step 4 never came
    saved = load(whole).state["trainer"]["step_info"]
    clock = load(whole).state  # the trainer side's; the rollout side was written after it
    assert len(saved) == 3
    if mode == "async":
        # A crash between the two writes: the newest checkpoint holds the trainer's side only.
        torn = root / "step-000004"
        shutil.copytree(whole, torn)
        (torn / ROLLOUT_FILE).unlink()
    system = run_mode(sc, mode, run_dir=tmp_path, resume=True)
    m = assert_recovered_run(system)
    assert m["samples/requeued"] == 0
    info = system.trainer.step_info
    # The learning curve goes on from the checkpoint: its steps first, then the rest, in time order.
    assert [i["trainings"] for i in info] == [32 * k for k in range(1, 7)]
    assert [i["end_s"] for i in info[:3]] == pytest.approx([i["end_s"] for i in saved])
    assert all(a < b for a, b in zip([i["end_s"] for i in info], [i["end_s"] for i in info[1:]]))
    assert info[3]["end_s"] > info[2]["end_s"] and system.end_s >= info[-1]["end_s"]
    assert all(0 <= a <= b for rows in system.timeline.spans.values() for _, a, b in rows)
    assert clock["trainer"]["step"] == 3
    assert all(latest_whole(root) == p for p in checkpoints(root)[-1:])  # the torn one is gone, the new ones whole
