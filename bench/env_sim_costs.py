"""The env sim's costs (``sim.*`` of an env scenario), measured on this machine with the real parts:
the sampler's environments and policy, the learner's update, the replay's calls, and one Ray
actor call carrying a chunk.

    python bench/env_sim_costs.py [scenarios/cartpole-dqn.yaml] [--set KEY=VALUE ...] [--no-ray]

Prints the figures as ``--set sim.KEY=VALUE`` lines for ``python -m harness.run``, so a sim
run can be compared with a real one on the same machine (docs/results/2026-12-02-env-sim.md).
Each figure is the median of several timed repeats; the machine's load average is printed
beside them, since other processes inflate every one. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.env.rate_limiter import RateLimiter  # noqa: E402
from core.env.transition_replay import TransitionReplay  # noqa: E402
from core.env.wiring import learner_process, make_learner, make_policy, make_sampler, replay_args  # noqa: E402
from harness.report import load_average  # noqa: E402
from harness.scenario import load_variants  # noqa: E402

REPEATS = 7


def median_s(fn, calls: int) -> float:
    """Median over ``REPEATS`` of the mean seconds per call of ``calls`` calls."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of a least-squares line through (x, y) points, neither below 0."""
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    slope, intercept = np.polyfit(xs, ys, 1)
    return max(0.0, float(intercept)), max(0.0, float(slope))


def sampler_costs(sc) -> dict:
    e = sc.env
    torch.set_num_threads(1)  # what a sampler actor with one CPU gets
    policy = make_policy(sc, 0, 0)
    sampler = make_sampler(sc, 0, 0, policy)
    try:
        sampler.collect()  # warm-up: first resets, torch's first calls
        vector_step = median_s(sampler.collect, 5) / e.send_every
        obs_dim = sampler.obs_shape[0]
        rng = np.random.default_rng(0)
        forward = {}
        for n in (1, e.envs_per_sampler, 64):
            obs = rng.standard_normal((n, obs_dim)).astype(np.float32)
            forward[n] = median_s(lambda: policy.act(obs, 10**9), 200)
        fixed, per_env = fit(list(forward.items()))
        env_step = max(0.0, (vector_step - forward[e.envs_per_sampler]) / e.envs_per_sampler)
        return {"env_step_s": env_step, "forward_s": fixed, "forward_env_s": per_env}
    finally:
        sampler.close()


def learner_and_replay_costs(sc) -> dict:
    with learner_process(sc):  # the learner's threads and float mode, as in a run
        return _learner_and_replay_costs(sc)


def _learner_and_replay_costs(sc) -> dict:
    # The replay's own work, without the pacing: a limiter that never holds either side back.
    args, kwargs = replay_args(sc, 0)
    most_in, most_out = sc.max_chunk_rows(), sc.max_sample_rows()
    kwargs["limiter"] = RateLimiter(1.0, sc.replay.min_size_to_sample, 1e12, most_in, most_out)
    replay = TransitionReplay(*args, **kwargs)
    learner = make_learner(sc, 0)
    policy = make_policy(sc, 0, 0)
    sampler = make_sampler(sc, 0, 0, policy)
    loop = asyncio.new_event_loop()
    try:
        chunks = [sampler.collect() for _ in range(max(2, -(-sc.replay.min_size_to_sample // (sc.env.envs_per_sampler * sc.env.send_every)) + 2))]
        for c in chunks:
            loop.run_until_complete(replay.insert_chunk(c))
        full = {**chunks[-1].columns, "version": chunks[-1].version}
        b = sc.dqn.batch_size
        # (rows inserted, rows sampled, seconds) of single calls; one fixed cost per call and
        # one per row of each kind, fitted through all of them.
        calls = []
        for n in (max(1, len(full["version"]) // 8), len(full["version"])):
            part = {k: v[:n] for k, v in full.items()}
            calls.append((n, 0, median_s(lambda: loop.run_until_complete(replay.insert(part)), 20)))

        def sample_and_update(n: int) -> None:
            batch, slots, w = loop.run_until_complete(replay.sample(n, 0.4))
            replay.update_priorities(slots, np.ones(n))

        for n in (b, sc.max_sample_rows()):
            calls.append((0, n, median_s(lambda: sample_and_update(n), 20)))
        design = np.array([[1.0, i, o] for i, o, _ in calls])
        (call_s, insert_row_s, sample_row_s), *_ = np.linalg.lstsq(design, np.array([t for *_, t in calls]), rcond=None)
        print("# replay calls (rows in, rows out, seconds): " + ", ".join(f"({i}, {o}, {t:.2e})" for i, o, t in calls))
        rows, slots, w = loop.run_until_complete(replay.sample(b, 0.4))
        learner.update(rows, w)
        update_s = median_s(lambda: learner.update(rows, w), 30)
        return {"learner_update_s": update_s, "replay_call_s": max(0.0, call_s),
                "replay_insert_row_s": max(0.0, insert_row_s), "replay_sample_row_s": max(0.0, sample_row_s)}
    finally:
        sampler.close()
        loop.close()


def rpc_cost(sc) -> float:
    """Seconds of one awaited Ray actor call carrying one chunk, on this machine: the caller's
    submit, the codec record both ways, the actor's loop, the reply."""
    class Sink:
        async def insert_chunk(self, chunk) -> int:
            return len(chunk)

    policy = make_policy(sc, 0, 0)
    sampler = make_sampler(sc, 0, 0, policy)
    chunk = sampler.collect()
    sampler.close()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        sink = ray.remote(Sink).options(num_cpus=0).remote()
        ray.get(sink.insert_chunk.remote(chunk))
        return median_s(lambda: ray.get(sink.insert_chunk.remote(chunk)), 200)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", nargs="?", default="scenarios/cartpole-dqn.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray call (sim.rpc_latency_s)")
    args = p.parse_args(argv)
    sc = load_variants(args.scenario, args.overrides)[0].scenario
    costs = {**sampler_costs(sc), **learner_and_replay_costs(sc)}
    if not args.no_ray:
        costs["rpc_latency_s"] = rpc_cost(sc)
    print(f"# {sc.env.id}, {sc.env.envs_per_sampler} envs per sampler, hidden {list(sc.dqn.hidden)}, batch {sc.dqn.batch_size}; "
          f"loadavg {load_average()}")
    for k, v in costs.items():
        print(f'--set sim.{k}={v:.3g}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
