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


def stepped_with_capacity(cost: DecodeCost, prompt: int, lengths, capacity: float, max_num_seqs: int):
    """One group on one engine whose KV cache holds ``capacity`` tokens, a step at a time.

    Admission: the next waiting request joins while the batch's context, its own and the next
    token of every running request and of its own fit (or the batch is empty); its prefill
    stalls decoding (the group's prompt once per admission round). Before a step that would
    not fit, the most recently admitted request is preempted: its KV is freed and it waits
    first in line with its tokens, prefilled again over prompt + tokens when it is back.
    Returns (finish times, preemptions, recomputed prefill tokens, all prefilled tokens)."""
    lengths = [int(n) for n in lengths]
    n = len(lengths)
    ctx = [prompt] * n  # context held (prompt + tokens so far)
    gen = [0] * n
    preempted = [False] * n
    waiting = list(range(n))
    running: list[int] = []  # in admission order
    done = [float("nan")] * n
    t = 0.0
    preemptions = recomputed = prefilled = 0

    def admit() -> float:
        nonlocal recomputed, prefilled
        stall, first = 0.0, True
        while waiting and len(running) < max_num_seqs:
            i = waiting[0]
            held = sum(ctx[j] for j in running)
            if running and held + ctx[i] + len(running) + 1 > capacity:
                break
            waiting.pop(0)
            start = 0 if first else prompt
            first = False
            stall += cost.prefill_s(start, ctx[i])
            prefilled += ctx[i] - start
            if preempted[i]:
                preempted[i] = False
                recomputed += ctx[i] - start
            running.append(i)
        return stall

    t += admit()
    while running:
        held = sum(ctx[j] for j in running)
        while held + len(running) > capacity and len(running) > 1:
            j = running.pop()
            held -= ctx[j]
            preempted[j] = True
            preemptions += 1
            waiting.insert(0, j)
        t += cost.step_s(len(running), held)
        for j in running:
            ctx[j] += 1
            gen[j] += 1
        finished = [j for j in running if gen[j] == lengths[j]]
        for j in finished:
            done[j] = t
            running.remove(j)
        if finished:
            t += admit()
    return done, preemptions, recomputed, prefilled
