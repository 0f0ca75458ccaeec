"""Shared pytest configuration for the test suite."""

import os

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
