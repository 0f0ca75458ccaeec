"""Ray connected for a run: joining a cluster (the project's code shipped with the job), or
starting a local instance, with the environment every Ray process gets. The harness, the
benchmarks and the test session start Ray through these; a run started inside one reuses it."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Optional

from core.real.workers import REAL_RUNTIME_ENV
from core.runtimes.ray_actor import ray_module
from core.runtimes.ray_cluster import code_env

# Every Ray process gets these. vLLM's own settings (KV cache size, multiprocessing) are set
# by VllmEngine in its process before vLLM is imported.
ENV_VARS = {**REAL_RUNTIME_ENV, "RAY_AUTH_MODE": "disabled"}
# A local instance keeps idle workers instead of killing them after a second: a remote
# function (an evaluator) then reuses a warm process rather than importing torch again, which
# costs seconds of a core that the run being measured needs.
LOCAL_SYSTEM_CONFIG = {"num_workers_soft_limit": 32}


def start_cluster(address: Optional[str], num_cpus: Optional[int]) -> bool:
    """Connect to ``address``, or start a local instance of ``num_cpus`` (None: every core);
    True if this call started it. An instance already connected in this process (a test
    session's) is reused."""
    ray = ray_module()
    for k, v in ENV_VARS.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return False
    env = {"env_vars": dict(ENV_VARS)}
    try:
        _init(ray, address, num_cpus, env)
    except BaseException:  # Ctrl-C while Ray starts: what it started so far goes with it
        ray.shutdown()
        raise
    return True


def _init(ray, address: Optional[str], num_cpus: Optional[int], env: dict) -> None:
    if address:
        # Joining a cluster: its other nodes have no copy of this code, so it goes with the job.
        ray.init(address=address, runtime_env={**env, **code_env(Path(__file__).resolve().parents[2])}, log_to_driver=False,
                 logging_level=logging.WARNING)
    else:
        # "local": a new instance even when another is running on this machine (ray.init would
        # join that one, and refuse num_cpus).
        ray.init(
            address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=env,
            log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG, logging_level=logging.WARNING,
        )


@contextlib.contextmanager
def cluster(address: Optional[str], num_cpus: Optional[int], serve: bool = False):
    """Ray connected for the block: started (and stopped after) unless already connected;
    ``serve``: shut Ray Serve down first."""
    started = start_cluster(address, num_cpus)
    try:
        yield
    finally:
        if started:
            if serve:
                from ray import serve

                serve.shutdown()
            ray_module().shutdown()
