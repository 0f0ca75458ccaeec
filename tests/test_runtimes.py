"""The real runtimes: the same components on the local runtime (torch engine, one process)
and on the ray runtime (vLLM engines, every component an actor), end to end.

The runs are short (a few trainer steps) but real: real engines, a real torch trainer, real
rewards. What they check is what the sim's invariant tests check, on real clocks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from core.model.config import MODES, Scenario, TinyModelSpec, with_changes
from core.model.user_code import UserCodeError
from core.runtimes.dispatch import run_mode
from harness.metrics import collect
from harness.scenario import load


def small(path: str, model_dir, **changes) -> Scenario:
    sc = load(path)
    base = {
        # The session's tiny model: the default spec, whatever the scenario's model is.
        "tiny_model.path": str(model_dir),
        "tiny_model.layers": TinyModelSpec().layers,
        "tiny_model.intermediate": TinyModelSpec().intermediate,
        "trainer.steps": 3,
        "trainer.batch_size": 32,
        "workload.max_response_len": 48,
        "eval.every": 0,
    }
    return with_changes(sc, {**base, **changes})


def assert_accounted(system) -> dict:
    m = collect(system)
    led = system.ledger
    assert m["samples/lost"] == 0
    assert system.in_flight == 0
    assert led.produced == led.trained + led.dropped_total
    assert m["samples/trained"] == system.scenario.trainer.steps * system.scenario.trainer.batch_size
    assert m["staleness/max"] <= m["staleness/bound"]
    for _, gen_version, train_version in led.trained_log:
        assert 0 <= train_version - gen_version <= led.max_staleness
    assert m["learn/reward_mean"] > 0  # rewards came back from the task
    assert m["util/gpu_source"] == "spans"
    assert 0 < m["util/rollout_busy"] <= 1.0 + 1e-6
    assert 0 < m["util/trainer_busy"] <= 1.0 + 1e-6
    assert 0 < m["util/mfu"] < 1
    return m


@pytest.mark.parametrize("mode", MODES)
def test_local_runtime_torch_engine(mode, tiny_model_dir):
    sc = small("scenarios/real-cpu-torch.yaml", tiny_model_dir, modes=[mode])
    system = run_mode(sc, mode)
    m = assert_accounted(system)
    assert m["trainer/final_version"] == sc.trainer.steps - 1
    # Each step's batch reward is recorded against trained samples and time.
    assert [i["trainings"] for i in system.trainer.step_info] == [32, 64, 96]


def test_local_runtime_filters_groups_without_reward_variance(tiny_model_dir):
    """Dynamic sampling on real engines: groups whose rewards are all equal never reach the
    trainer, rollout samples on until every batch is full, and the ledger closes."""
    from core.real.reward import make_task

    sc = small("scenarios/real-cpu-torch.yaml", tiny_model_dir, modes=["async"],
               **{"reward.fn": "tests.byo_reward:constant_when_even", "filter": {}})
    system = run_mode(sc, "async")
    m = assert_accounted(system)
    n = sc.workload.group_size
    assert m["samples/dropped_filter_no_variance"] >= n and m["samples/filtered"] == m["samples/dropped_filter_no_variance"]
    task = make_task(sc)
    assert all(len(task.prompt_text(pid).split()) % 2 for pid, _, _ in system.ledger.trained_log)


def ran_on(system) -> dict:
    """Where each component ran (node ids, asked of the actors), and the driver's node."""
    import ray

    return system.nodes, ray.get_runtime_context().get_node_id()


# One case per mode but async (each ~75 s of actor start-up, so xdist can spread them): async's
# run on vLLM engines over Ray is the kill test's below, and what this test checks of a fault-free
# run (placement, one transfer per sync, the actors' spans) does not depend on the mode but for
# sync's colocation, which the sync case checks.
@pytest.mark.runtime
@pytest.mark.parametrize("mode", [m for m in MODES if m != "async"])
def test_ray_runtime_every_mode_on_vllm(mode, ray_session, tiny_model_dir):
    """The short real-cpu-vllm run inside the suite, in each mode, across the test cluster's
    nodes: STRICT_SPREAD puts each bundle (engine, trainer) on a node of its own; the rollout
    actor stays on the driver's."""
    # Broadcast sync (the default transport) in buckets of 0.25 MB: the tiny model goes in ten.
    sc = small("scenarios/real-cpu-vllm.yaml", tiny_model_dir, **{"ray.placement_strategy": "STRICT_SPREAD", "sync.bucket_mb": 0.25})
    assert mode in sc.modes
    system = run_mode(sc, mode)
    m = assert_accounted(system)
    assert m["trainer/final_version"] == sc.trainer.steps - 1
    assert len(system.sync.transfer_s) == sc.trainer.steps - 1 and all(t > 0 for t in system.sync.transfer_s)  # none after the last step
    nodes, driver = ran_on(system)
    assert nodes["rollouter"] == [driver]
    assert all(len(seen) == 1 for seen in nodes.values())  # nothing moved
    engines = [nodes[n][0] for n in nodes if n.startswith("engine")]
    assert len(set(engines) | {driver}) == len(engines) + 1, nodes
    # sync colocates the trainer with engine 0 on its bundle; otherwise it has its own
    assert (nodes["trainer"][0] == engines[0]) if system.placement.colocated else (nodes["trainer"][0] not in {*engines, driver}), nodes
    spans = system.timeline.spans
    assert spans["trainer"] and spans["engine000"]  # engine spans came back from the actor
    assert all(0 <= a <= b <= system.end_s + 5 for rows in spans.values() for _, a, b in rows)
    assert ray_session.is_initialized()  # the runtime did not stop the shared instance


@pytest.mark.runtime
def test_ray_runtime_on_torch_engines_across_nodes(ray_session, tiny_model_dir):
    """real-cpu-torch's engine on the ray runtime, SPREAD over the test cluster: nothing lost,
    and no bundle on the driver's node (it has no CPUs). Sync (two torch engines colocated with
    the trainer) here; async and partial run on torch engines on the same cluster in
    tests/test_ray_resume.py, inflight's freeze and thaw through an engine actor on vLLM above
    (each mode's run costs ~40 s of actor start-up on 2 cores)."""
    sc = small("scenarios/real-cpu-vllm.yaml", tiny_model_dir, **{
        "engine.kind": "torch", "trainer.steps": 2, "trainer.batch_size": 16, "ray.placement_strategy": "SPREAD",
        "modes": ["sync"],
    })
    for mode in sc.modes:
        system = run_mode(sc, mode)
        assert_accounted(system)
        nodes, driver = ran_on(system)
        assert nodes["rollouter"] == [driver]
        assert driver not in {seen[0] for name, seen in nodes.items() if name != "rollouter"}, nodes


@pytest.mark.runtime
def test_evaluation_arrives_while_training_continues(ray_session, tiny_model_dir):
    """Evaluators are Ray tasks sampling with the HF model, whatever the engine: on torch engines
    the run starts in a third of a vLLM run's time (vLLM's runs: the tests above and below), and
    24 of their quicker steps still outlast a first evaluation in a cold worker (~7 s, 2 cores)."""
    sc = small(
        "scenarios/real-cpu-vllm.yaml", tiny_model_dir,
        **{"engine.kind": "torch", "trainer.steps": 24, "eval.every": 8, "eval.prompts": 4, "eval.workers": 2, "ray.poll_s": 0.05},
    )
    system = run_mode(sc, "async")
    evals = system.evaluations
    assert evals, "no evaluation finished"
    assert all(e["prompts"] == 4 and 0 <= e["reward_mean"] <= 1 for e in evals)
    assert [e["version"] for e in evals] == sorted({e["version"] for e in evals})
    # Results came back while the trainer still had steps to go, and it kept stepping after
    # an evaluation was launched: the driver never waits for one.
    ends = [i["end_s"] for i in system.trainer.step_info]
    assert any(e["done_s"] < ends[-1] for e in evals)
    assert sum(t > evals[0]["started_s"] for t in ends) >= sc.trainer.steps - 1
    assert collect(system)["eval/count"] == len(evals)


@pytest.mark.runtime
def test_serve_reward_matches_in_process(ray_session, tiny_model_dir):
    from core.real.reward import ServeReward, TaskReward, deploy_reward, make_task
    from core.model.sample import Group, Sample

    sc = with_changes(Scenario(), {"tiny_model.path": str(tiny_model_dir)})
    handle = deploy_reward(sc)
    task = make_task(sc)
    rng = np.random.default_rng(0)
    vocab = len(task._decode(list(range(64))).split())  # every id the tokenizer knows
    groups = []
    for pid in range(6):
        samples = []
        for i in range(4):
            resp = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
            samples.append(Sample(uid=pid * 4 + i, prompt_id=pid, index=i, n_prompt=0, response_tokens=resp))
        # Make some responses good ones: prompt letters, then <eos>.
        letters = task.tokens(pid)[1:-1].tolist()
        samples[0].response_tokens = letters * (2 * len(letters)) + [task._encode("<eos>")[0]]  # 2 k**2 words
        groups.append(Group(prompt_id=pid, samples=samples, version=0, admitted_at=0.0))

    async def both():
        served = [await ServeReward(handle, 60.0).score(g) for g in groups]
        local = [await TaskReward(task).score(g) for g in groups]
        return served, local

    served, local = asyncio.run(both())
    assert served == local
    assert max(r for rs in local for r in rs) == 1.0


@pytest.mark.runtime
def test_reward_served_in_a_run(ray_session, tiny_model_dir):
    """... with STRICT_PACK: engine and trainer on one node (not the driver's, which has no CPUs).
    The user's function fails now and then in the replica; with reward.on_error: skip the
    groups it failed on are dropped with their reason, and nothing is lost."""
    sc = small("scenarios/real-cpu-vllm.yaml", tiny_model_dir, **{
        "engine.kind": "torch", "reward.serve": True, "trainer.steps": 2, "ray.placement_strategy": "STRICT_PACK",
        "reward.fn": "tests.byo_reward:fails_now_and_then", "reward.on_error": "skip",
    })
    system = run_mode(sc, "async")
    m = assert_accounted(system)
    assert m["samples/dropped_reward_error"] >= sc.workload.group_size  # call 7 of the replica's first 40 failed
    nodes, driver = ran_on(system)
    assert nodes["rollouter"] == [driver]
    assert nodes["engine000"] == nodes["trainer"] != [driver], nodes


@pytest.mark.runtime
def test_a_reward_that_fails_in_an_engine_actor_ends_the_run_in_one_line(ray_session, tiny_model_dir):
    """Scored where the tokens are (the engine actors): the user's error crosses Ray as itself,
    and the run ends with the guard's one line, not a restart of the engine."""
    sc = small("scenarios/real-cpu-vllm.yaml", tiny_model_dir, **{
        "engine.kind": "torch", "trainer.steps": 2, "trainer.batch_size": 16, "reward.fn": "tests.byo_reward:always_fails",
    })
    with pytest.raises(UserCodeError) as failed:
        run_mode(sc, "async")
    line = str(failed.value.plain())
    assert line.startswith("reward.fn tests.byo_reward:always_fails: scoring sample "), line
    assert "raised ValueError: no verifier for this answer; fix:" in line and "\n" not in line


@pytest.mark.runtime
def test_weights_are_put_once_per_version(ray_session):
    from core.runtimes.object_store_transfer import ObjectStoreTransfer

    class Backend:
        def __init__(self):
            self.calls = 0

        def weights(self):
            self.calls += 1
            return {"w": np.full(4, float(self.calls), dtype=np.float32)}

    t = ObjectStoreTransfer(Backend(), ray_session.put)
    refs = [asyncio.run(t.send(v)) for v in (1, 2)]
    assert all(len(r) == 1 and isinstance(r[0], ray_session.ObjectRef) for r in refs)
    assert t.latest[0] == 2 and t.latest[1][0] == refs[1][0]
    assert ray_session.get(refs[1][0])["w"][0] == 2.0
    assert t.backend.calls == 2
    assert t.bytes == 16 and t.put_s > 0


@pytest.mark.runtime
def test_profile_writes_flame_graphs_for_driver_and_actors(ray_session, tiny_model_dir, tmp_path):
    from harness.run import main

    out = tmp_path / "run"
    sets = {
        "tiny_model.path": str(tiny_model_dir), "tiny_model.layers": 2, "tiny_model.intermediate": 256,
        "modes": "[partial]", "trainer.steps": 3, "trainer.batch_size": 32, "workload.max_response_len": 48,
        "engine.kind": "torch",
    }
    argv = ["scenarios/real-cpu-vllm.yaml", "--out", str(out), "--profile", "--no-plots"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    assert main(argv) == 0
    svgs = {p.name: p.stat().st_size for p in (out / "partial" / "profile").glob("*.svg")}
    assert set(svgs) == {"driver.svg", "engine000.svg", "rollouter.svg", "trainer.svg"}
    assert all(size > 1000 for size in svgs.values())


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"runtime": "local"}, "engine.kind"),  # a real runtime needs a real engine
        ({"engine.kind": "vllm"}, "engine.kind"),  # and the sim runtime a simulated one
        ({"runtime": "local", "engine.kind": "torch", "workload.max_response_len": 4096}, "workload.max_response_len"),
        ({"runtime": "local", "engine.kind": "torch", "workload.max_response_len": 64, "reward.serve": True}, "reward.serve"),
        ({"task.max_letters": 9}, "task.max_letters"),
        ({"checkpoint.every": 1, "faults": [{"kind": "kill", "target": "node", "at_step": 1}]}, "faults.0.target"),  # nodes are Ray's
    ],
)
def test_real_runtime_settings_are_checked(changes, key):
    from core.model.config import ConfigError

    with pytest.raises(ValueError) as err:
        with_changes(Scenario(), changes)
    cause = err.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, ConfigError) and cause.key == key


def assert_recovered_run(system) -> dict:
    """A run with faults: everything accounted for, and it ended where the plan says."""
    m = collect(system)
    sc, led = system.scenario, system.ledger
    assert m["samples/lost"] == 0
    assert system.in_flight == 0
    assert led.produced == led.trained + led.dropped_total
    assert sum(led._trained_mask) == led.trained  # no uid trained twice (the ledger also refuses it)
    assert m["staleness/max"] <= m["staleness/bound"]
    assert system.trainer.step == sc.trainer.steps
    assert m["trainer/final_version"] == (sc.trainer.steps - 1) // sc.trainer.sync_every
    assert m["samples/trained"] == sc.trainer.steps * sc.trainer.batch_size
    return m


# One vLLM engine's restart (its engine core process goes with it) and one torch engine's: an
# engine's start is most of such a run's time, and vLLM's is the longer (~25 s of a core). The
# trainer's kill, whose recovery is the same whatever the engine, rides on the torch run. The
# vLLM run's last step, 7, trains version 3, so at staleness 2 its samples come from version 1
# or later, published after step 2, after the kill: the run cannot end before its only worker is
# back. (At 4 steps every sample could come from version 0; on a slow machine rollout had made
# them all before the kill, and the run ended with the worker still restarting, unrecovered.)
WORKER_KILL = {"kind": "kill", "target": "rollout_worker", "at_step": 1}
TRAINER_KILL = {"kind": "kill", "target": "trainer", "at_step": 5}


@pytest.mark.runtime
@pytest.mark.parametrize(("mode", "engine", "steps", "faults"), [
    ("async", "vllm", 7, [WORKER_KILL]), ("partial", "torch", 8, [WORKER_KILL, TRAINER_KILL]),
], ids=["async-vllm", "partial-torch"])
def test_ray_kills_of_a_rollout_worker_and_the_trainer_lose_nothing(ray_session, tiny_model_dir, mode, engine, steps, faults):
    """Ray restarts both (max_restarts): the worker's groups are generated again, the trainer
    goes back to its checkpoint and the queue hands it again what it had been given since."""
    sc = small(
        "scenarios/real-cpu-vllm.yaml", tiny_model_dir,
        **{
            "engine.kind": engine,
            # A step that no sync follows, and a lead of two windows: rollout runs ahead then,
            # so the worker dies mid-generation.
            "trainer.steps": steps, "trainer.sync_every": 2, "checkpoint.every": 1, "ray.poll_s": 0.1,
            "staleness.max_staleness": 2, "staleness.admission_lead": 2, "faults": faults,
        },
    )
    system = run_mode(sc, mode)
    m = assert_recovered_run(system)
    assert m["faults/injected"] == len(faults) and m["faults/recovered"] == len(faults)
    # The only worker was generating when it died (rollout runs ahead): its groups came back.
    assert m["samples/requeued"] > 0
    kinds = {(r.kind, r.target) for r in system.faults.records}
    assert kinds == {("kill", "rollout_worker0")} | ({("kill", "trainer")} if TRAINER_KILL in faults else set())
    assert all(r.recovered_s > r.at_s for r in system.faults.records)


# On torch engines: the subject is the node, not the engine. A vLLM engine's restart (its engine
# core process with it) is the kill test's above; on vLLM this test cost twice that one's start-up.
@pytest.mark.runtime
@pytest.mark.parametrize(("mode", "strategy", "of"), [("async", "STRICT_SPREAD", "rollout_worker"), ("partial", "PACK", "trainer")])
def test_ray_node_lost_mid_run_loses_nothing(ray_session, spare_node, tiny_model_dir, mode, strategy, of):
    """A node taken down mid-run (its raylet killed, as a preempted host): every actor on it dies
    at once, Ray restarts them on another node (the spare one, as an autoscaler would add), and
    the run goes on. STRICT_SPREAD: the engine's node alone; PACK: engine and trainer together."""
    sc = small(
        "scenarios/real-cpu-vllm.yaml", tiny_model_dir,
        **{
            "trainer.steps": 4, "checkpoint.every": 1, "ray.poll_s": 0.1, "ray.placement_strategy": strategy, "engine.kind": "torch",
            "faults": [{"kind": "kill", "target": "node", "node_of": of, "at_step": 1}],
        },
    )
    system = run_mode(sc, mode)
    assert_recovered_run(system)
    recs = {r.target: r for r in system.faults.records}
    node = recs[f"node_of_{'rollout_worker0' if of == 'rollout_worker' else 'trainer'}"]
    assert node.recovered_s is not None and node.recovered_s > node.at_s
    lost = {"rollout_worker0"} | ({"trainer"} if strategy == "PACK" else set())
    assert set(recs) == lost | {node.target} and all(r.recovered_s is not None for r in recs.values())
    nodes, driver = ran_on(system)
    moved = ["engine000"] + (["trainer"] if strategy == "PACK" else [])
    assert all(len(nodes[n]) == 2 and driver not in nodes[n] for n in moved), nodes  # restarted on another node
    assert nodes["rollouter"] == [driver]


@pytest.mark.runtime
def test_ray_hung_and_slow_workers_time_out_and_recover(ray_session, tiny_model_dir):
    """A generate that never answers is given up on after timeouts.generate_s, the worker is
    killed and restarted; a slowed worker only costs time."""
    sc = small(
        "scenarios/real-cpu-vllm.yaml", tiny_model_dir,
        **{
            "engine.kind": "torch", "trainer.steps": 6, "ray.poll_s": 0.1, "timeouts.generate_s": 15,
            "faults": [
                {"kind": "slow", "target": "rollout_worker", "at_step": 1, "factor": 3, "duration_s": 3},
                {"kind": "hang", "target": "rollout_worker", "at_step": 2, "call": "generate"},
            ],
        },
    )
    system = run_mode(sc, "async")
    m = assert_recovered_run(system)
    assert m["faults/injected"] == 2 and m["faults/recovered"] == 2
    hang = next(r for r in system.faults.records if r.kind == "hang")
    assert hang.recovery_s >= 15  # not before the timeout gave up on the call


def test_local_run_stopped_and_resumed_accounts_for_every_sample(tiny_model_dir, tmp_path):
    """The local runtime checkpoints weights and Adam's moments beside the run's state; a
    run stopped mid-way resumes from them and ends where the plan says."""
    from core.store.checkpoint import latest, load_tensors
    from core.api import RunStopped
    from core.runtimes.run_checkpoint import checkpoint_dir
    from core.real.workers import make_backend

    sc = small("scenarios/real-cpu-torch.yaml", tiny_model_dir, modes=["partial"], **{"trainer.steps": 6, "checkpoint.every": 1})
    with pytest.raises(RunStopped):
        run_mode(sc, "partial", run_dir=tmp_path, stop_at_step=4)
    ckpt = latest(checkpoint_dir(tmp_path, "partial"))
    saved = {stem: load_tensors(ckpt, stem) for stem in ("weights", "optimizer")}
    assert saved["optimizer"], "Adam's moments are in the checkpoint"
    backend = make_backend(sc, 1)
    backend.load(saved)
    again = backend.state_dict()
    for stem in saved:
        assert saved[stem].keys() == again[stem].keys()
        assert all(np.array_equal(saved[stem][k], again[stem][k]) for k in saved[stem])

    system = run_mode(sc, "partial", run_dir=tmp_path, resume=True)
    assert_recovered_run(system)
    assert [i["trainings"] for i in system.trainer.step_info] == [32 * k for k in range(1, 7)]


@pytest.mark.runtime
def test_harness_joins_a_running_cluster(ray_cluster, tiny_model_dir, tmp_path):
    """As a user would: scenarios/real-cpu-cluster.yaml run by the harness in its own process,
    joining the session's cluster through ray.address (the code goes with it as py_modules)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    sets = {
        "ray.address": ray_cluster.address, "tiny_model.path": str(tiny_model_dir), "tiny_model.layers": 2,
        "tiny_model.intermediate": 256, "modes": "[async]", "trainer.steps": 2, "trainer.batch_size": 32,
        "workload.max_response_len": 48, "engine.kind": "torch",
    }
    argv = [sys.executable, "-m", "harness.run", "scenarios/real-cpu-cluster.yaml", "--out", str(out), "--no-plots"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "async" / "report.json").read_text())
    assert report["metrics"]["samples/lost"] == 0 and report["metrics"]["samples/trained"] == 64
    assert set(report["series"]["nodes"]) == {"engine000", "rollouter", "trainer"}


@pytest.mark.runtime
def test_model_dir_a_node_cannot_see_is_shipped_once_or_refused(ray_session, tiny_model_dir, tmp_path):
    """On a worker node, a model path that node does not see: the driver's copy, shipped through
    the object store, is unpacked once into a stamped cache directory and reused; with none
    shipped, one error names the node, the path and the fix."""
    from core.model.owned import is_owned
    from core.runtimes.ray_cluster import MODEL_CACHE_KIND, local_model_dir, node_scenario, on_node, pack_model

    missing = str(tmp_path / "only-on-the-driver")  # no node sees it
    shipped = [ray_session.put(pack_model(str(tiny_model_dir)))]
    cache = {"env_vars": {"ASYNCRL_MODEL_CACHE": str(tmp_path / "cache")}}
    # A worker node alive now (a node-loss test may have taken one of the session's down).
    driver = ray_session.get_runtime_context().get_node_id()
    worker = next(n["NodeID"] for n in ray_session.nodes() if n["Alive"] and n["NodeID"] != driver)
    on_worker = {"num_cpus": 0, "runtime_env": cache, "scheduling_strategy": on_node(worker)}
    resolve = ray_session.remote(local_model_dir).options(**on_worker)
    first = ray_session.get(resolve.remote(missing, shipped))
    again = ray_session.get(resolve.remote(missing, shipped))
    assert first == again != missing  # unpacked once, then reused
    assert is_owned(Path(first).parent, MODEL_CACHE_KIND)
    assert (Path(first) / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert ray_session.get(resolve.remote(str(tiny_model_dir), shipped)) == str(tiny_model_dir)  # a path it sees: as is
    with pytest.raises(ray_session.exceptions.RayTaskError, match="only-on-the-driver is not there and none was shipped; fix"):
        ray_session.get(resolve.remote(missing, []))
    # What every actor of a run does with it (ray.ship_model): the same copy, the run's identity kept.
    sc = small("scenarios/real-cpu-vllm.yaml", tiny_model_dir).with_model_dir(missing)
    here = ray_session.get(ray_session.remote(node_scenario).options(**on_worker).remote(sc, tuple(shipped)))
    assert here.real_model_path == first and sc.real_model_path == missing


def test_an_engine_restarting_at_the_runs_end_is_asked_again_for_its_counters():
    """A worker killed near the run's end may still be coming back when the rollout stops: the
    close that reads its counters waits for the new process instead of failing the run."""
    import ray

    from core.runtimes.ray_engine_host import EngineProxy

    calls = []

    class Close:
        def remote(self):
            calls.append(1)

            async def answer():
                if len(calls) < 3:
                    raise ray.exceptions.ActorUnavailableError("The actor is restarting.", None)
                return {"spans": {}, "tokens_generated": 7}
            return answer()

    proxy = EngineProxy("engine000", type("Handle", (), {"close": Close()})(), 0.0)
    asyncio.run(proxy.close(0.0))
    assert len(calls) == 3 and proxy.tokens_generated == 7
    gone = EngineProxy("engine001", type("Handle", (), {"close": Close()})(), 0.0)
    calls.clear()
    asyncio.run(gone.close(0.0, wait_s=0.0))  # still restarting at the deadline: left out, one warning
    assert len(calls) == 1
