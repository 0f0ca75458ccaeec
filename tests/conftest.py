"""Shared pytest configuration for the test suite."""

import asyncio
import os
from pathlib import Path

# OpenMP threads that finish a parallel region sleep at once instead of spinning for the next:
# the suite runs many torch and vLLM processes on 2 cores, where a spinning thread takes a core
# from another process's work (measured: the vLLM mode and kill tests on 2 workers, 276 s
# spinning, 236 s passive). Set before torch is imported here or in any actor or engine process
# (they inherit this environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest

from hypothesis import settings

# Shared machines (CI on 2 cores) make per-example timings noisy: no deadlines, and always
# print the blob that reproduces a failure.
settings.register_profile("asyncrl", deadline=None, print_blob=True)
# CI (CI=true) explores the same examples on every run, so a red build is reproducible and
# never a coin flip; local runs keep exploring new ones.
settings.register_profile("ci", parent=settings.get_profile("asyncrl"), derandomize=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "asyncrl")


# The session's test cluster: a head node (the driver, the rollout actor) and two worker nodes,
# each with a custom resource naming it. The head has no logical CPUs, so every bundle lands on a
# worker node and losing one never takes the driver's down; three each, so every existing ray test
# fits (the machine has 2 real cores: logical ones only reserve) and a lost node's bundles have
# room on the other. A lost node is declared dead after 3 missed 0.5 s health checks (Ray: ~30 s).
NODES = ("head", "w1", "w2")
WORKER_CPUS = 3
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3,
}
# Nothing reads the cluster's metrics or streams its logs (log_to_driver=False): without the
# metrics export and the log monitor an idle cluster with a few warm workers takes about half
# the CPU (measured over 30 s: 2.3 s against 4.5 s), which the Ray tests' own processes need.
QUIET = {"enable_metrics_collection": False}


def pytest_collection_modifyitems(items: list) -> None:
    """The Ray and vLLM runtime tests first, those on vLLM (the costliest starts) leading; the
    quick tests after them. Under ``--dist worksteal`` a worker that runs out takes tests off the
    end of another's queue: the quick ones, so the two workers finish together instead of one
    finishing a two-minute Ray test alone (measured: the compiled pass's last minute ran its 2
    cores 60 % busy when the Ray tests came last, as alphabetical order put them). The order is
    the same in every worker (xdist requires it); within each group it is the collection order."""

    def weight(item) -> int:
        if item.get_closest_marker("runtime") is None:
            return 2
        return 0 if "vllm" in item.nodeid.lower() else 1

    items[:] = sorted(items, key=weight)  # stable


def node_resource(name: str) -> str:
    """The custom resource that names a node of the test cluster."""
    return f"asyncrl_node_{name}"


CALL_LOG = "ASYNCRL_TEST_CALL_LOG"  # tests/agent_tools_user.py calculator_counting_calls


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One multi-node Ray test cluster for the whole test session (``ray.cluster_utils.Cluster``:
    several raylets on this machine; starting one costs seconds and memory), the driver connected
    to its head; under pytest-xdist (``make test``), one per worker that runs a Ray test. The ray
    runtime reuses an instance already connected instead of starting its own."""
    import ray
    from ray.cluster_utils import Cluster

    from core.runtimes.ray_start import ENV_VARS, LOCAL_SYSTEM_CONFIG

    for k, v in ENV_VARS.items():
        os.environ.setdefault(k, v)
    # Where a counting tool in an actor writes: actors see the environment they are started with.
    os.environ[CALL_LOG] = str(tmp_path_factory.mktemp("calls") / "calls.log")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "resources": {node_resource("head"): 1}, "include_dashboard": False, "include_log_monitor": False,
        "_system_config": {**LOCAL_SYSTEM_CONFIG, **HEALTH_CHECKS, **QUIET},
    })
    for name in NODES[1:]:
        cluster.add_node(num_cpus=WORKER_CPUS, resources={node_resource(name): 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {**ENV_VARS, CALL_LOG: os.environ[CALL_LOG]}}, log_to_driver=False)
    yield cluster
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def spare_node(ray_cluster):
    """A worker node added for one test, as an autoscaler would: room for what a node that the
    test takes down ran (the session's cluster keeps its size)."""
    n = len(ray_cluster.worker_nodes)
    node = ray_cluster.add_node(num_cpus=WORKER_CPUS, resources={node_resource(f"spare{n}"): 1})
    ray_cluster.wait_for_nodes()
    yield node
    for lost in [w for w in ray_cluster.worker_nodes if not w.remaining_processes_alive()]:
        ray_cluster.remove_node(lost, allow_graceful=False)  # the one the test took down


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """Ray, connected to the session's test cluster."""
    import ray

    return ray


@pytest.fixture
def call_log(tmp_path, monkeypatch):
    """The file the counting calculator appends each call id it executes to, empty: the
    session cluster's where it runs (its actors' environment is fixed), else the test's own."""
    path = Path(os.environ[CALL_LOG]) if CALL_LOG in os.environ else tmp_path / "calls.log"
    monkeypatch.setenv(CALL_LOG, str(path))
    path.write_text("")
    return path


@pytest.fixture(scope="session")
def arithmetic_model_dir(tmp_path_factory):
    """The tiny model of scenarios/real-cpu-agent.yaml: the arithmetic vocabulary and its warm start."""
    from core.model.config import TinyModelSpec
    from harness.scenario import load
    from core.real.tiny_model import ensure

    tm = load("scenarios/real-cpu-agent.yaml").tiny_model
    spec = TinyModelSpec(vocabulary=tm.vocabulary, warm_start_steps=tm.warm_start_steps)
    return ensure(tmp_path_factory.mktemp("tiny-arith") / "tiny-qwen2-arithmetic", spec)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny model, built once per session outside the working tree."""
    from core.real.tiny_model import ensure

    return ensure(tmp_path_factory.mktemp("tiny") / "tiny-qwen2")


@pytest.fixture(scope="module")
def loop():
    """One event loop per module, for engines whose calls the tests drive one by one."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def weights(tiny_model_dir) -> dict:
    """The tiny model's weights, as the trainer would send them."""
    from safetensors.numpy import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def perturbed(weights) -> dict:
    """Other weights of the same shapes: what a trainer step could have made of them."""
    rng = np.random.default_rng(1)
    return {k: (v + rng.normal(0.0, 0.05, v.shape)).astype(np.float32) for k, v in weights.items()}
