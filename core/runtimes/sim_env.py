"""The env pipeline's sim runtime: either mode on the virtual clock (core/sim/env_pipeline.py),
paced by the real ``RateLimiter`` built as the replay builds it (core/env/wiring.py replay_args).

No environment is stepped and nothing is learned: the run says how fast the pipeline would go on
the scenario's machines and costs (``sim``), and which part holds it back. ``env.id`` is made
once, only when ``sim.row_bytes`` or ``sim.param_bytes`` is left to be derived from it.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from core.env.chunk_intake import chunk_ledger, run_ledger
from core.env.curve import EnvCurve
from core.env.rate_limiter import RateLimiter
from core.env.wiring import env_space, replay_spec
from core.model.config import ConfigError
from core.model.env_config import EnvScenario
from core.model.progress import ProgressFn
from core.sim import virtual_clock
from core.sim.env_pipeline import EnvPipelineSim, EnvSimResult


def sim_sizes(sc: EnvScenario) -> tuple[int, int]:
    """(bytes of a row on the wire, bytes of one weight version): ``sim.row_bytes`` and
    ``sim.param_bytes``, or what the replay's columns and the Q-network take for ``env.id``."""
    s = sc.sim
    if s.row_bytes is not None and s.param_bytes is not None:
        return s.row_bytes, s.param_bytes
    missing = "sim.row_bytes" if s.row_bytes is None else "sim.param_bytes"
    try:
        space = env_space(sc)
        spec = replay_spec(sc)
    except Exception as exc:  # any reason gymnasium cannot make it here: the fix is the same
        raise ConfigError(
            missing, None, f"is derived from env.id {sc.env.id!r}, which cannot be used here ({exc})",
            "set sim.row_bytes and sim.param_bytes, then env.id is not made",
        ) from None
    row = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in spec.values())
    widths = (space.obs_dim, *sc.dqn.hidden, space.actions)
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    return (s.row_bytes or row), (s.param_bytes or 4 * params)


def make_limiter(sc: EnvScenario) -> RateLimiter:
    """The limiter the scenario's replay would hold (core/env/wiring.py replay_args)."""
    r = sc.replay
    return RateLimiter(r.samples_per_insert, r.min_size_to_sample, sc.error_buffer(), sc.max_chunk_rows(), sc.max_sample_rows())


def run_env_sim(sc: EnvScenario, mode: str, seed: int, on_progress: Optional[ProgressFn] = None) -> EnvCurve:
    """One mode on the virtual clock, as an ``EnvCurve`` with no evaluations; the sim's own
    figures are in ``curve.replay["sim"]``. ``on_progress`` is told every version published."""
    row_bytes, param_bytes = sim_sizes(sc)
    limiter = make_limiter(sc)
    sim = EnvPipelineSim(sc, mode, seed, limiter, row_bytes, param_bytes, on_progress)
    try:
        res = virtual_clock.run(sim.run())
    except virtual_clock.SimulationStalled as exc:
        raise virtual_clock.SimulationStalled(f"{exc}; the rate limiter then: {limiter.stats()}") from None
    return _curve(sc, res, limiter, row_bytes, param_bytes)


def _curve(sc: EnvScenario, res: EnvSimResult, limiter: RateLimiter, row_bytes: int, param_bytes: int) -> EnvCurve:
    curve = EnvCurve(updates=res.updates, versions=res.versions, train_s=res.train_s, learner=dict(res.learner_s))
    curve.replay = {
        **limiter.stats(),
        "env_steps": res.env_steps,
        "rows_inserted": res.rows,
        "rows_sampled": limiter.samples,
        "rows_evicted_unsampled": None,  # the sim keeps no rows, so it cannot tell
        "rows_refused": 0,
        "chunks": res.chunks,
        "chunks_refused": 0,
        "sim": {
            "row_bytes": row_bytes,
            "param_bytes": param_bytes,
            "weight_fetches": res.weight_fetches,
            "weight_pulls": res.weight_pulls,
            "bytes_sent": res.bytes_sent,
            "sampler_s": res.sampler_s,
            "link_busy": res.links,
            "link_busy_max": max((v for m in res.links.values() for v in m.values()), default=0.0),
            "replay_busy": res.replay_busy,
        },
    }
    # Every chunk a sampler sent is in the replay: the sim drops none, and learns no chunk whole.
    curve.chunks, curve.chunks_in_flight = run_ledger(sc, res.chunks, chunk_ledger(sc), curve.replay)
    return curve
