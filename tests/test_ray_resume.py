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
from core.store.checkpoint import SHARDS_DIR, checkpoints, load
from tests.test_runtimes import assert_recovered_run, small

# The ray runtime's resume is the subject: `make test`'s pure-Python pass skips it.
pytestmark = pytest.mark.runtime


def ray_torch(model_dir, **changes):
    return small(
        "scenarios/real-cpu-vllm.yaml", model_dir,
        **{"engine.kind": "torch", "trainer.steps": 6, "checkpoint.every": 1, "ray.poll_s": 0.1, **changes},
    )


# partial stops earlier: its checkpoint at version 2 usually holds interrupted groups, whose
# partial tokens the resumed engines must take back (a wrong count fails the run).
@pytest.mark.parametrize("mode, stop", [("async", 4), ("partial", 3)])
def test_ray_run_stopped_and_resumed_accounts_for_every_sample(ray_session, tiny_model_dir, tmp_path, mode, stop):
    sc = ray_torch(tiny_model_dir, modes=[mode])
    with pytest.raises(RunStopped, match=f"stopped after step {stop}"):
        run_mode(sc, mode, run_dir=tmp_path, stop_at_step=stop)
    root = checkpoint_dir(tmp_path, mode)
    whole = latest_whole(root)
    assert whole is not None and whole.name == f"step-{stop - 1:06d}"  # the sync after the last step never came
    trainer_side = load(whole).state
    saved = trainer_side["trainer"]["step_info"]
    assert len(saved) == trainer_side["trainer"]["step"] == stop - 1
    if mode == "async":
        # A crash between the two writes: the newest checkpoint holds the trainer's side only.
        torn = root / f"step-{stop:06d}"
        shutil.copytree(whole, torn)
        (torn / ROLLOUT_FILE).unlink()
    system = run_mode(sc, mode, run_dir=tmp_path, resume=True)
    m = assert_recovered_run(system)
    assert m["samples/requeued"] == 0
    info = system.trainer.step_info
    # The learning curve goes on from the checkpoint: its steps first, then the rest, in time order.
    assert [i["trainings"] for i in info] == [32 * k for k in range(1, 7)]
    ends = [i["end_s"] for i in info]
    assert ends[: stop - 1] == pytest.approx([i["end_s"] for i in saved])
    assert all(a < b for a, b in zip(ends, ends[1:])) and system.end_s >= ends[-1]
    assert all(0 <= a <= b for rows in system.timeline.spans.values() for _, a, b in rows)
    assert latest_whole(root) == checkpoints(root)[-1]  # the torn one is gone; the resumed run's are whole


def test_the_harness_takes_stop_at_step_for_ray_and_checks_it_as_for_sim(tmp_path, capsys):
    """--stop-at-step on a ray scenario is no longer refused for its runtime: it is checked as
    a sim or local run's is (one line, exit 2, nothing written)."""
    from harness.run import main
    from tests.test_bad_input import one_error, sets

    out = tmp_path / "run"
    ray_sets = sets("trainer.steps=4", "checkpoint.every=1")
    assert main(["scenarios/real-cpu-vllm.yaml", "--out", str(out), "--stop-at-step", "4", *ray_sets]) == 2
    assert "between 1 and trainer.steps - 1 = 3" in one_error(capsys)
    assert main(["scenarios/real-cpu-vllm.yaml", "--out", str(out), "--stop-at-step", "2", *sets("checkpoint.every=0")]) == 2
    assert "--set checkpoint.every=1" in one_error(capsys)
    assert not out.exists()


def test_a_killed_rollout_actor_brings_the_run_back_to_its_last_whole_checkpoint(ray_session, tiny_model_dir, tmp_path):
    """The rollout actor (queue, Rollouter, producer's ledger) killed mid-run: the driver puts
    both sides of the last whole checkpoint into new actors and the run goes on to its end,
    every sample accounted for, the kill reported recovered, and no fault fired twice."""
    sc = ray_torch(tiny_model_dir, modes=["async"], faults=[{"kind": "kill", "target": "queue", "at_step": 3}])
    system = run_mode(sc, "async", run_dir=tmp_path)
    m = assert_recovered_run(system)
    assert m["faults/injected"] == 1 and m["faults/recovered"] == 1
    (rec,) = system.faults.records
    assert (rec.kind, rec.target) == ("kill", "queue") and rec.recovered_s > rec.at_s
    info = system.trainer.step_info
    assert [i["trainings"] for i in info] == [32 * k for k in range(1, 7)]
    # The steps of the checkpoint it went back to (taken at the sync after step 1, 2 or 3, as
    # the kill's timing falls) ended before the kill; every later one after the run came back.
    ends = [i["end_s"] for i in info]
    kept = sum(e < rec.at_s for e in ends)
    assert 1 <= kept <= 3 and all(a < b for a, b in zip(ends, ends[1:]))
    assert all(e > rec.recovered_s for e in ends[kept:])
    assert latest_whole(checkpoint_dir(tmp_path, "async")) == checkpoints(checkpoint_dir(tmp_path, "async"))[-1]


def test_a_two_rank_fsdp2_ray_run_stopped_and_resumed_loses_nothing(ray_session, tiny_model_dir, tmp_path):
    """learn.sharding: fsdp2 on two trainer rank actors (gloo): every sync broadcasts weights
    gathered one tensor at a time, every checkpoint holds each rank's shards, and a run stopped
    after step 3 resumes in fresh actors that read them back, to its end with nothing lost."""
    sc = ray_torch(
        tiny_model_dir, modes=["async"],
        **{"learn.sharding": "fsdp2", "learn.minibatches": 1, "resources.trainer_gpus": 2, "ray.trainer_ranks": 2, "ray.trainer.num_cpus": 0.5,
           "trainer.steps": 5, "trainer.batch_size": 16, "workload.max_response_len": 24},
    )
    with pytest.raises(RunStopped, match="stopped after step 3"):
        run_mode(sc, "async", run_dir=tmp_path, stop_at_step=3)
    whole = latest_whole(checkpoint_dir(tmp_path, "async"))
    shards = sorted(p.name for p in (whole / SHARDS_DIR).iterdir())
    assert len([s for s in shards if s.endswith(".safetensors")]) == 2, shards  # one file per rank
    assert not (whole / "weights.safetensors").exists()
    system = run_mode(sc, "async", run_dir=tmp_path, resume=True)
    m = assert_recovered_run(system)
    info = system.trainer.step_info
    assert [i["trainings"] for i in info] == [16 * k for k in range(1, 6)]
    assert all(i["ranks"] == 2 for i in info) and m["sync/bytes_mean"] > 0
