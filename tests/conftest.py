"""Shared pytest configuration for the test suite."""

import asyncio
import os

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


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (starting one costs seconds and memory);
    the ray runtime reuses an instance already connected instead of starting its own."""
    import ray

    from core.runtimes.ray import ENV_VARS, LOCAL_SYSTEM_CONFIG

    for k, v in ENV_VARS.items():
        os.environ.setdefault(k, v)
    ray.init(
        num_cpus=2, include_dashboard=False, runtime_env={"env_vars": dict(ENV_VARS)},
        log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG,
    )
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


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
