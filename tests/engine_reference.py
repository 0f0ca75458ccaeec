"""A token-level oracle for the simulated engine: one decode step at a time.

Every request joins at t = ``stall`` and stays until it has generated its length; each step
costs ``cost.step_s(running, context held)``. The event engine must agree with it.
"""

from __future__ import annotations

import numpy as np

from core.sim.costs import DecodeCost


def stepped_finish_times(cost: DecodeCost, prompt: int, lengths, stall: float = 0.0) -> list[float]:
    lengths = np.asarray(lengths)
    t = stall
    done = np.full(len(lengths), np.nan)
    step = 0
    while np.isnan(done).any():
        live = np.isnan(done)
        b = int(live.sum())
        t += cost.step_s(b, b * (prompt + step))
        step += 1
        done[live & (lengths == step)] = t
    return done.tolist()
